"""Where a warning points: the user's line, past fastdp's own frames and torch's.

fastdp warns from deep call paths (a DataLoader's ``__next__``, the end-of-backward callback,
``torch.optim``'s step wrappers and hooks), so a fixed ``stacklevel`` lands in library code on
some paths.
"""
from __future__ import annotations

import os
import sys

import torch

_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep
                      for module in (sys.modules[__package__], torch))


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, for a warning issued by the function calling this, of the
    first frame outside fastdp and torch."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level
