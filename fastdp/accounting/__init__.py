"""Privacy accounting for DP-SGD with Poisson sampling and Gaussian noise.

* :class:`PLDAccountant` (``"pld"``, the default): privacy loss distributions composed
  by FFT with a pessimistic discretisation -- tight, always an upper bound.
* :class:`RDPAccountant` (``"rdp"``): Renyi DP, the readable reference; looser.

Both record ``(noise_multiplier, sample_rate, steps)`` with ``.step(...)`` and answer
``.epsilon(delta)``; :func:`epsilon` and :func:`calibrate_noise` are one-shot helpers.
Neighbouring datasets differ by adding or removing one example.
"""
from .base import Accountant, available_accountants, make_accountant
from .calibrate import UnreachableTargetError, calibrate_noise, epsilon
from .pld import PLDAccountant
from .rdp import DEFAULT_ORDERS, OrderGridWarning, RDPAccountant

__all__ = [
    "Accountant",
    "PLDAccountant",
    "RDPAccountant",
    "DEFAULT_ORDERS",
    "OrderGridWarning",
    "available_accountants",
    "make_accountant",
    "epsilon",
    "calibrate_noise",
    "UnreachableTargetError",
]
