"""Keep freed CPU memory in the process for reuse (glibc malloc): a process-wide setting.

glibc returns blocks above its mmap threshold to the OS when they are freed and maps fresh
pages for the next allocation, and the first write to each fresh page faults. A training
step frees and reallocates the same large activation and gradient buffers every step, so
on CPU these faults can cost more than the kernels that write the buffers. A DP step keeps
more tensors alive during backward (each layer's input and output gradient until the
clipped sums), which pushes more of its buffers onto fresh pages: in the CIFAR CNN of
``fastdp bench`` the ReLU, GroupNorm and max-pool backward kernels ran 3-4x slower in the
DP step than in the non-private one, and at the same speed once freed memory was kept.

:func:`keep_freed_memory` raises the mmap threshold to glibc's maximum (32 MiB) and the trim
threshold to 2 GiB, so freed buffers stay in the heap and are reused. The cost: resident
memory stays near its peak instead of shrinking between steps. ``fastdp train`` and
``fastdp bench`` (for every method alike, so comparisons stay fair) call it; in your own
training script, call it once before training. Elsewhere (not glibc) it does nothing.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's limit on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int


def keep_freed_memory() -> bool:
    """Set the glibc thresholds above; ``True`` if they were set, ``False`` where the C
    library is not glibc (nothing changes then)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
