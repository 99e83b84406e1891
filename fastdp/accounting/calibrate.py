"""One-shot helpers: epsilon of a fixed schedule, and noise calibration for a target."""
from __future__ import annotations

import math
from typing import Optional

from .base import check_delta, check_sample_rate, check_steps, make_accountant

__all__ = ["epsilon", "calibrate_noise", "UnreachableTargetError"]


class UnreachableTargetError(ValueError):
    """No noise multiplier up to ``sigma_max`` meets the target epsilon."""


def epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "pld",
) -> float:
    """epsilon after ``steps`` Poisson-subsampled Gaussian steps at (sigma, q), for ``delta``.

    ``accountant``: ``"pld"`` (tight, default) or ``"rdp"`` (reference, looser).
    """
    acc = make_accountant(accountant)
    acc.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=steps)
    return acc.epsilon(delta)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    *,
    rtol: float = 0.005,
    sigma_max: float = 1e4,
    sigma_min: Optional[float] = None,
) -> float:
    """A noise multiplier whose epsilon (at ``delta``) does not exceed the target and is within
    ``rtol`` of it: the smallest such sigma up to that tolerance.

    The returned sigma always satisfies ``epsilon(sigma) <= target_epsilon``; the search
    (bracketed secant steps on log sigma with bisection fallback; epsilon decreases with
    sigma) stops once ``epsilon(sigma) >= (1 - rtol) * target_epsilon``.  Returns 0.0 when
    nothing is ever released (``sample_rate == 0`` or ``steps == 0``).  Raises
    ValueError when even ``sigma_max`` misses the target. The search stays within
    [``sigma_min``, ``sigma_max``]; ``sigma_min`` defaults to ``min(1e-4, sigma_max)``.
    """
    try:
        target = float(target_epsilon)
    except (TypeError, ValueError):
        raise ValueError(f"target_epsilon must be a positive finite number, got {target_epsilon!r}") from None
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"target_epsilon must be a positive finite number, got {target_epsilon!r}")
    delta = check_delta(delta)
    q = check_sample_rate(sample_rate)
    steps = check_steps(steps)
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must lie in (0, 1), got {rtol!r}")
    sigma_max = float(sigma_max)
    if not sigma_max > 0:  # also refuses NaN
        raise ValueError(f"sigma_max must be a number > 0, got {sigma_max!r}")
    sigma_min = min(1e-4, sigma_max) if sigma_min is None else float(sigma_min)
    if not 0 < sigma_min <= sigma_max:
        raise ValueError(f"need 0 < sigma_min <= sigma_max, got sigma_min={sigma_min!r}, sigma_max={sigma_max!r}")
    make_accountant(accountant)  # validate the name before any work
    if q == 0.0 or steps == 0:
        return 0.0

    def eps_of(sigma: float) -> float:
        return epsilon(sigma, q, steps, delta, accountant)

    # Bracket: eps(lo) > target >= eps(hi), from sigma = 1 (or sigma_max, if lower).
    hi = max(min(1.0, sigma_max), sigma_min)
    eps_hi = eps_of(hi)
    lo, eps_lo = 0.0, math.inf
    while eps_hi > target:
        lo, eps_lo = hi, eps_hi
        if hi >= sigma_max:
            raise UnreachableTargetError(
                f"target_epsilon={target:g} is unreachable: even noise_multiplier={hi:g} (sigma_max) gives "
                f"epsilon={eps_hi:.6g} at delta={delta:g} (sample_rate={q:g}, steps={steps}); "
                "raise the target, lower steps or sample_rate, or pass a larger sigma_max (--sigma-max)"
            )
        hi = min(2.0 * hi, sigma_max)
        eps_hi = eps_of(hi)
    while lo == 0.0:  # the first sigma already meets the target: walk down
        if hi <= sigma_min:
            return hi
        lo = max(hi / 2.0, sigma_min)
        eps_lo = eps_of(lo)
        if eps_lo <= target:
            hi, eps_hi, lo = lo, eps_lo, 0.0

    # Refine on log(sigma) vs log(eps); keep the bracket, fall back to bisection.
    for iteration in range(100):
        if eps_hi >= (1.0 - rtol) * target or hi / lo - 1.0 < 1e-12:
            break
        a, b = math.log(lo), math.log(hi)
        mid = 0.5 * (a + b)
        if iteration % 3 != 2 and math.isfinite(eps_lo) and eps_hi > 0.0:
            aim = target * (1.0 - 0.5 * rtol)  # the middle of the accepted band
            fa, fb = math.log(eps_lo / aim), math.log(eps_hi / aim)
            guess = b - fb * (b - a) / (fb - fa)
            if a < guess < b:
                mid = min(max(guess, a + 0.02 * (b - a)), b - 0.02 * (b - a))
        sigma = math.exp(mid)
        eps_mid = eps_of(sigma)
        if eps_mid > target:
            lo, eps_lo = sigma, eps_mid
        else:
            hi, eps_hi = sigma, eps_mid
    return hi
