"""Checks of the numeric settings given to the optimizer, the clipping policies and make_private."""
from __future__ import annotations

import math


def finite_number(value, name: str, *, zero_ok: bool = False) -> float:
    """``value`` as a finite float, > 0 (>= 0 with ``zero_ok``). Python, NumPy and one-element
    tensor numbers are accepted; bools, strings and anything else are refused, naming ``name``."""
    bound = ">= 0" if zero_ok else "> 0"
    number = math.nan
    if not isinstance(value, (bool, str, bytes)):
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            pass
    if not math.isfinite(number) or number < 0 or (number == 0 and not zero_ok):
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number
