"""Tight accountant: privacy loss distributions (PLD) composed by FFT.

Conventions
-----------
For a pair of output distributions (P, Q) the privacy loss is ``L = log(dP/dQ)``
with ``L ~ P`` (mass where Q = 0 sits at ``L = +inf``), and

    delta(eps) = E_P[(1 - exp(eps - L))_+] = sum_l p(l) (1 - e^(eps - l))_+ + p(+inf).

Composition adds independent losses, i.e. convolves their distributions.  One
Poisson-subsampled Gaussian step (sensitivity 1, noise sigma, rate q) has two
dominating pairs, one per neighbouring direction, with ``M = (1-q) N(0,s^2) + q N(1,s^2)``:

* remove: P = M, Q = N(0, s^2), ``L(x) = log(1 - q + q exp((2x - 1) / (2 s^2)))``;
* add:    P = N(0, s^2), Q = M, ``L(x) = -log(1 - q + q exp((2x - 1) / (2 s^2)))``.

A history is composed separately in each direction and the reported epsilon is the
larger of the two (datasets are neighbours in the same direction at every step).

Discretisation (always pessimistic)
-----------------------------------
Losses live on the grid ``l_i = i * h``.  The exact probability of every interval
``(l_i, l_(i+1)]`` is computed from Gaussian CDFs; the mass inside it is split between
its two end points so that the Q-weighted mean of ``exp(L)`` is kept ("connect the
dots", Doroshenko et al. 2022).  Since ``y -> (y - e^eps)_+`` is convex, Jensen's
inequality shows the split can only increase delta(eps) for every eps, and the error
is second order in h (about ``h^2 / 8`` of extra mean loss per step).  The far lower
tail is rounded up onto the lowest grid point; the far upper tail goes to ``+inf``.

Composition of ``T`` identical steps is a power in Fourier space; distinct (sigma, q)
groups multiply.  The FFT window is chosen from Chernoff bounds on the discretised
distributions, and the mass those bounds allow outside the window is added to delta,
so the reported epsilon stays an upper bound (up to float rounding).  When every step
has ``q = 1`` the composition is a Gaussian mechanism with ``mu = sqrt(sum T / sigma^2)``
and the exact formula of Balle & Wang 2018 is used instead.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
from scipy import fft as sp_fft
from scipy import signal, special

from .base import Accountant, HistoryEntry, check_delta, register_accountant

__all__ = [
    "PLDAccountant",
    "DiscretePLD",
    "subsampled_gaussian_pld",
    "compose_plds",
    "gaussian_delta",
    "gaussian_epsilon",
    "pld_epsilon",
]

DIRECTIONS = ("remove", "add")


# --------------------------------------------------------------------------- helpers
def _std_normal_mass(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """P(a < Z <= b) for Z ~ N(0, 1), elementwise with a <= b; accurate in both tails."""
    upper = a > 0  # both ends in the right half: difference of survival functions
    with np.errstate(invalid="ignore"):
        mass = np.where(upper, special.ndtr(-a) - special.ndtr(-b), special.ndtr(b) - special.ndtr(a))
    return np.maximum(mass, 0.0)


@dataclass
class DiscretePLD:
    """Privacy loss distribution on the grid ``(offset + k) * interval``, ``k = 0..len-1``.

    ``probs[k]`` is the P-probability of loss ``(offset + k) * interval``; ``inf_mass`` is
    the probability of infinite loss; ``extra_delta`` is mass that left the represented
    range (counted in full in delta).  Sub-probability vectors are allowed.
    """

    offset: int
    probs: np.ndarray
    interval: float
    inf_mass: float = 0.0
    extra_delta: float = 0.0

    @property
    def losses(self) -> np.ndarray:
        return (self.offset + np.arange(self.probs.size)) * self.interval

    def delta(self, epsilon: float) -> float:
        """delta(epsilon) of this PLD (hockey-stick divergence)."""
        losses = self.losses
        above = losses > epsilon
        terms = self.probs[above] * -np.expm1(epsilon - losses[above])
        return float(terms.sum() + self.inf_mass + self.extra_delta)

    def epsilon(self, delta: float) -> float:
        """Smallest epsilon >= 0 with ``self.delta(epsilon) <= delta`` (inf if none)."""
        return pld_epsilon(self, delta)


def pld_epsilon(pld: DiscretePLD, delta: float) -> float:
    """Smallest eps >= 0 with delta_pld(eps) <= delta.

    delta(eps) is continuous and decreasing; between consecutive grid points it equals
    ``S - e^(eps - l_j) G`` with ``S`` the mass above ``l_j`` and ``G`` that mass discounted
    by ``e^(l_j - l)``, both suffix sums, so the crossing is solved exactly.
    """
    floor_mass = pld.inf_mass + pld.extra_delta
    if floor_mass >= delta:
        return math.inf
    p = pld.probs
    h = pld.interval
    n = p.size
    if n == 0:
        return 0.0
    decay = math.exp(-h)
    # S[j] = sum_{k > j} p[k];  G[j] = sum_{k > j} p[k] exp(-(k - j) h)
    suffix = np.concatenate([np.cumsum(p[::-1])[::-1][1:], [0.0]])
    rev = signal.lfilter([0.0, decay], [1.0, -decay], p[::-1])  # rev[m] = G[n-1-m]
    discounted = rev[::-1]
    delta_at = suffix - discounted + floor_mass  # delta at each grid point, non-increasing
    below = delta_at <= delta  # true at least at the last point, since floor_mass < delta
    j = int(np.argmax(below))
    if j == 0:
        # crossing at or below l_0: delta(eps) = total - e^(eps - l_0) * (p_0 + G_0)
        mass = float(p.sum()) + floor_mass
        weight = p[0] + discounted[0]
        if mass <= delta or weight <= 0.0:
            return 0.0
        eps = pld.offset * h + math.log((mass - delta) / weight)
    else:
        j -= 1  # crossing in [l_j, l_{j+1}]: delta(eps) = S_j + floor - e^(eps - l_j) * G_j
        mass = suffix[j] + floor_mass
        weight = discounted[j]
        ratio = (mass - delta) / weight if weight > 0.0 else math.inf
        eps = (pld.offset + j) * h + math.log(min(max(ratio, 1.0), math.exp(h)))
    return max(float(eps), 0.0)


# --------------------------------------------------------------------------- one step
MAX_LOSS = 600.0  # grid losses stay below this: e^loss must not overflow float64 (e^709)
MAX_INTERVAL = 100.0  # the grid's last point, the first past MAX_LOSS, stays below e^709 too

def _loss_range(direction: str, sigma: float, q: float, tail: float) -> Tuple[float, float]:
    """Losses between which all but ``tail`` of P's mass lies (each side)."""
    z = -special.ndtri(tail)  # P(N(0,1) > z) = tail
    if direction == "remove":
        x_lo, x_hi = -sigma * z, 1.0 + sigma * z  # M's tails are at most the extreme component's
        return _remove_loss(x_lo, sigma, q), _remove_loss(x_hi, sigma, q)
    x_lo, x_hi = -sigma * z, sigma * z
    return -_remove_loss(x_hi, sigma, q), -_remove_loss(x_lo, sigma, q)


def _clipped_loss_range(direction: str, sigma: float, q: float, tail: float) -> Tuple[float, float]:
    """:func:`_loss_range` within [-MAX_LOSS, MAX_LOSS]: beyond, e^loss overflows; the mass above goes
    to +inf and the mass below is rounded up onto the first point, both pessimistic (only very small
    sigma gets there)."""
    lo_loss, hi_loss = _loss_range(direction, sigma, q, tail)
    return min(max(lo_loss, -MAX_LOSS), MAX_LOSS), min(max(hi_loss, -MAX_LOSS), MAX_LOSS)


def _remove_loss(x: float, sigma: float, q: float) -> float:
    """log(1 - q + q exp((2x - 1) / (2 sigma^2))), computed without overflow."""
    with np.errstate(over="ignore", divide="ignore"):  # sigma^2 underflowing: +-inf, no privacy (read as such)
        u = (2.0 * x - 1.0) / (2.0 * (sigma * sigma))
    if q == 1.0:
        return u
    return float(np.logaddexp(math.log1p(-q), math.log(q) + u))


def _threshold_remove(losses: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """x with L_remove(x) = loss (L_remove increasing in x); -inf below log(1 - q)."""
    t = np.expm1(losses) + q  # e^l - (1 - q)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = (sigma * sigma) * (np.log(t) - math.log(q)) + 0.5
    return np.where(t > 0, x, -np.inf)


def _threshold_add(losses: np.ndarray, sigma: float, q: float) -> np.ndarray:
    """x with L_add(x) = loss (L_add decreasing in x); {L > loss} = {x < threshold}.

    At or above the largest loss -log(1 - q) that set is empty: threshold -inf.
    """
    t = np.expm1(-losses) + q  # e^-l - (1 - q)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = (sigma * sigma) * (np.log(t) - math.log(q)) + 0.5
    return np.where(t > 0, x, -np.inf)


def subsampled_gaussian_pld(
    sigma: float, q: float, direction: str, interval: float, tail: float
) -> DiscretePLD:
    """Pessimistic connect-the-dots PLD of ONE Poisson-subsampled Gaussian step.

    ``direction`` is ``"remove"`` or ``"add"``; ``tail`` is the P-mass allowed beyond the
    grid on each side (upper side -> +inf, lower side -> rounded up to the first point).
    Requires ``sigma > 0`` finite and ``0 < q <= 1``.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if not 0 < interval <= MAX_INTERVAL:
        raise ValueError(f"interval must lie in (0, {MAX_INTERVAL}], got {interval!r}: a coarser grid's last "
                         "point passes e^709, where its thresholds overflow and the mass above it is lost")
    lo_loss, hi_loss = _clipped_loss_range(direction, sigma, q, tail)
    i0 = math.floor(lo_loss / interval)
    i1 = max(math.ceil(hi_loss / interval), i0 + 1)
    idx = np.arange(i0, i1 + 1, dtype=np.float64)
    losses = idx * interval
    y_minus_1 = np.expm1(losses)  # e^l - 1 at every grid point
    if direction == "remove":
        x = _threshold_remove(losses, sigma, q)  # bin (l_i, l_i+1] <-> x in (x_i, x_i+1]
        a, b = x[:-1], x[1:]
        q_mass = _std_normal_mass(a / sigma, b / sigma)  # N(0, s^2)
        one_mass = _std_normal_mass((a - 1.0) / sigma, (b - 1.0) / sigma)  # N(1, s^2)
        p_mass = (1.0 - q) * q_mass + q * one_mass
        # excess = P(bin) - e^{l_i} Q(bin) = q N1(bin) - (e^{l_i} - 1 + q) N0(bin)
        excess = q * one_mass - (y_minus_1[:-1] + q) * q_mass
        # P(L <= l_0): mass of M left of x_0, rounded up onto l_0
        x0 = x[0]
        below = (1.0 - q) * special.ndtr(x0 / sigma) + q * special.ndtr((x0 - 1.0) / sigma)
        xn = x[-1]
        above = (1.0 - q) * special.ndtr(-xn / sigma) + q * special.ndtr(-(xn - 1.0) / sigma)
    else:
        x = _threshold_add(losses, sigma, q)  # bin (l_i, l_i+1] <-> x in [x_i+1, x_i)
        a, b = x[1:], x[:-1]
        p_mass = _std_normal_mass(a / sigma, b / sigma)  # P = N(0, s^2)
        one_mass = _std_normal_mass((a - 1.0) / sigma, (b - 1.0) / sigma)
        y = y_minus_1[:-1] + 1.0
        # excess = P(bin) - e^{l_i} Q(bin) with Q = (1-q) N0 + q N1
        #        = N0(bin) (q e^{l_i} - (e^{l_i} - 1)) - q e^{l_i} N1(bin)
        excess = p_mass * (q * y - y_minus_1[:-1]) - q * y * one_mass
        below = float(special.ndtr(-x[0] / sigma))  # x > x_0  <->  L <= l_0
        above = float(special.ndtr(x[-1] / sigma))  # x < x_n  <->  L > l_n
    # Split each bin's P-mass: the part e^h * excess / (e^h - 1) goes to the right end.
    right = np.clip(excess * (math.exp(interval) / math.expm1(interval)), 0.0, p_mass)
    left = p_mass - right
    probs = np.zeros(idx.size)
    probs[:-1] += left
    probs[1:] += right
    probs[0] += below
    return DiscretePLD(offset=i0, probs=probs, interval=interval, inf_mass=float(above))


# --------------------------------------------------------------------------- composition
# Multiples of the Gaussian optimum lam0 tried in the Chernoff bounds. At tiny q (small variance)
# lam0 is huge and the best lam far below it: with a grid starting at lam0 / 64 the window reached far
# past the real mass, and the FFT noise bound summed over it exceeded delta (eps 18,000x too large).
# Powers of sqrt(2) from 2^-24 (~6e-8) to 2^6: the earlier grid's points, 2^-6 to 2^6, and more below.
_LAMBDA_STEPS = np.power(2.0, np.arange(-48, 13) / 2.0)


_LOG_LOW_TAIL = math.log(1e-17)


def _log_mgf(pld: DiscretePLD, lambdas: np.ndarray) -> np.ndarray:
    """log E[exp(lam * L); L finite] for each lam (any sign), from the exact grid masses."""
    keep = pld.probs > 0
    log_p = np.log(pld.probs[keep])
    losses = pld.losses[keep]
    out = np.empty(lambdas.size)
    for k, lam in enumerate(lambdas):
        exponent = log_p + lam * losses
        top = exponent.max()
        out[k] = top + math.log(np.exp(exponent - top).sum())
    return out


def _moments(pld: DiscretePLD) -> Tuple[float, float]:
    """Mean and variance of the finite part (normalised)."""
    mass = pld.probs.sum()
    losses = pld.losses
    mean = float((pld.probs * losses).sum() / mass)
    var = float((pld.probs * (losses - mean) ** 2).sum() / mass)
    return mean, var


def _fold(probs: np.ndarray, n: int) -> np.ndarray:
    """Wrap a vector onto length n (index k -> k mod n)."""
    if probs.size <= n:
        out = np.zeros(n)
        out[: probs.size] = probs
        return out
    padded = np.zeros(-(-probs.size // n) * n)
    padded[: probs.size] = probs
    return padded.reshape(-1, n).sum(axis=0)


class WindowTooLarge(Exception):
    """Raised by :func:`compose_plds` when the FFT would exceed ``max_size``."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def _fft_power_product(weights: Sequence[Tuple[np.ndarray, int]], size: int, shift: int) -> np.ndarray:
    """prod_g (weights_g)^{*count_g} as a circular convolution of length ``size``, rolled by ``shift``."""
    spectrum = None
    for w, count in weights:
        f = sp_fft.rfft(_fold(w, size))
        f = f**count if count > 1 else f
        spectrum = f if spectrum is None else spectrum * f
    return np.roll(sp_fft.irfft(spectrum, n=size), -shift)


def _noise_level(raw: np.ndarray, total_steps: int) -> float:
    """Per-bin bound on FFT rounding noise: 4x the larger of the most negative entry
    (pure noise) and ``steps * eps_machine * peak`` (the T-th power amplifies relative
    errors of the transform about T-fold)."""
    peak = float(raw.max())
    observed = max(-float(raw.min()), 0.0)
    return 4.0 * max(observed, total_steps * np.finfo(float).eps * max(peak, 0.0))


def _tilt(lambdas, pos, neg, groups, delta, bottom, top, h, max_size):
    """(tilt, window top) for the refinement pass, or None.

    The ideal tilt centres the composition where P(S > t) ~ delta (the Chernoff optimum
    for delta).  The tilted composition needs its own window: it starts at ``bottom``
    like the plain one and ends where the tilted upper tail drops below 1e-16 (again a
    Chernoff bound, with the MGF values on the grid); going down from the ideal tilt
    we take the first one whose window is at most ``max_size`` points.  (Wrap-around
    would only add mass, i.e. stay pessimistic; the bound keeps it negligible.)
    """
    log_mass = sum(count * math.log(max(pld.probs.sum(), 1e-300)) for pld, count in groups)
    lam_all = np.concatenate([-lambdas[::-1], [0.0], lambdas])
    k_all = np.concatenate([neg[::-1], [log_mass], pos])  # sum_g T_g log M_g(lam)
    target = int(np.argmin((pos - math.log(delta)) / lambdas))
    first = lambdas.size + 1  # index of lambdas[0] in lam_all
    log_alias = math.log(1e-16)
    for i in range(min(first + target, lam_all.size - 2), first - 1, -1):
        down = np.min(k_all[:i] - k_all[i] - (lam_all[:i] - lam_all[i]) * bottom)
        if down > log_alias:
            continue
        tilted_top = float(np.min((k_all[i + 1:] - k_all[i] - log_alias) / (lam_all[i + 1:] - lam_all[i])))
        top_index = math.ceil(max(tilted_top, top) / h)
        if top_index - math.floor(bottom / h) + 1 <= max_size:
            return float(lam_all[i]), top_index
    return None


def _refine_with_tilt(groups, composed, noise, lam, size, size_t, shift_t, first, h):
    """Recompute entries of ``composed`` from the tilted composition where that is more
    precise (see compose_plds); ``noise`` holds per-bin noise bounds and is updated too."""
    weights, log_norm = [], 0.0
    for pld, count in groups:
        keep = pld.probs > 0
        exponent = np.full(pld.probs.size, -np.inf)
        # tilt relative to the group's own grid start; the offsets are restored below
        exponent[keep] = np.log(pld.probs[keep]) + lam * np.flatnonzero(keep) * h
        top = exponent.max()
        norm = top + math.log(np.exp(exponent - top).sum())
        weights.append((np.exp(exponent - norm), count))
        log_norm += count * norm
    raw = _fft_power_product(weights, size_t, shift_t)[:size]
    tilted_noise = _noise_level(raw, sum(count for _, count in groups))
    # composed[m] = tilted[m] * exp(log_factor[m])
    log_factor = log_norm - lam * (first + np.arange(size)) * h
    with np.errstate(divide="ignore"):
        better = log_factor + math.log(tilted_noise) < np.log(noise)
    factor = np.exp(log_factor[better])
    composed[better] = np.maximum(raw[better], 0.0) * factor
    noise[better] = tilted_noise * factor


def compose_plds(
    groups: Sequence[Tuple[DiscretePLD, int]],
    tail: float,
    max_size: int = 1 << 22,
    delta: Optional[float] = None,
) -> DiscretePLD:
    """Compose ``count`` copies of each PLD (all on one grid) by FFT.

    The window keeps all but ``tail`` of the composed finite mass on each side (Chernoff
    bounds); that allowance is carried in ``extra_delta``.  Mass outside the window
    wraps around into it, which only adds mass, so the result stays pessimistic.

    FFT rounding leaves noise of about ``steps * 1e-16`` of the largest entry in every
    bin, which swamps masses of order delta when delta is tiny.  When ``delta`` is given,
    a second pass composes the exponentially tilted distributions ``p(l) e^(lam l) / M(lam)``
    (tilting commutes with convolution) with ``lam`` chosen so that the tilted
    composition peaks where losses of probability ~delta live; each bin then takes
    whichever of the two passes has the smaller noise level there, and that noise bound
    is added to the bin (pessimistic).
    """
    h = groups[0][0].interval
    if any(g.interval != h for g, _ in groups):
        raise ValueError("all PLDs must share one discretisation interval")
    log_tail = math.log(tail)
    # Chernoff: P(S >= t) <= exp(sum_g T_g log M_g(lam) - lam t) for lam > 0 (and the
    # mirror image for lam < 0).  The lam grid is centred on the Gaussian optimum.
    total_var = 0.0
    for pld, count in groups:
        total_var += count * _moments(pld)[1]
    total_var = max(total_var, (h * h) / 12.0)
    lam0 = math.sqrt(2.0 * -log_tail / total_var)
    lambdas = lam0 * _LAMBDA_STEPS
    pos = np.zeros(lambdas.size)
    neg = np.zeros(lambdas.size)
    log_keep = 0.0  # log of the probability that no step hits +inf
    for pld, count in groups:
        pos += count * _log_mgf(pld, lambdas)
        neg += count * _log_mgf(pld, -lambdas)
        log_keep += count * math.log1p(-pld.inf_mass) if pld.inf_mass < 1.0 else -math.inf
    hi_loss = float(np.min((pos - log_tail) / lambdas))
    # the lower edge keeps at most 1e-17 below it where a tilted pass may run: that pass needs its own
    # mass below the edge under 1e-16 (wrap-around), which a window cut at a larger tail cannot give
    log_low = min(log_tail, _LOG_LOW_TAIL) if delta is not None else log_tail
    lo_loss = float(np.max((log_low - neg) / lambdas))
    hi = math.ceil(hi_loss / h)
    lo = math.floor(lo_loss / h)
    if hi < lo:  # the finite mass is below the tail allowance (a step that nearly always hits +inf)
        return DiscretePLD(offset=0, probs=np.zeros(1), interval=h, inf_mass=1.0)  # the worst case
    size = sp_fft.next_fast_len(hi - lo + 1, real=True)
    if size > max_size:
        raise WindowTooLarge(size)
    base = sum(count * pld.offset for pld, count in groups)
    shift = (lo - base) % size
    raw = _fft_power_product([(pld.probs, count) for pld, count in groups], size, shift)
    composed = np.maximum(raw, 0.0)
    noise = np.full(size, _noise_level(raw, sum(count for _, count in groups)))

    if delta is not None and 0.0 < delta < 1.0:
        tilt_max = min(max_size, max(4 * size, 1 << 16))
        choice = _tilt(lambdas, pos, neg, groups, delta, lo * h, (lo + size - 1) * h, h, tilt_max)
        if choice is not None:
            lam, top_index = choice
            size_t = sp_fft.next_fast_len(top_index - lo + 1, real=True)
            shift_t = (lo - base) % size_t
            _refine_with_tilt(groups, composed, noise, lam, size, size_t, shift_t, lo - base, h)
    composed += noise  # pessimistic: every bin may hold up to its noise bound more

    inf_mass = -math.expm1(log_keep) if log_keep > -math.inf else 1.0
    extra = 2.0 * tail + sum(pld.extra_delta * count for pld, count in groups)
    return DiscretePLD(offset=lo, probs=composed, interval=h, inf_mass=inf_mass, extra_delta=extra)


# --------------------------------------------------------------------------- q = 1: exact
def gaussian_delta(mu: float, epsilon: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with ``mu = sensitivity / sigma``."""
    if mu == 0.0:
        return 0.0
    first = special.ndtr(mu / 2.0 - epsilon / mu)
    second = math.exp(epsilon + special.log_ndtr(-mu / 2.0 - epsilon / mu))
    return max(float(first - second), 0.0)


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Smallest eps >= 0 with gaussian_delta(mu, eps) <= delta (upper end of a bisection)."""
    if mu == 0.0 or gaussian_delta(mu, 0.0) <= delta:
        return 0.0
    lo, hi = 0.0, max(1.0, mu * mu)
    while gaussian_delta(mu, hi) > delta:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gaussian_delta(mu, mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return hi


# --------------------------------------------------------------------------- accountant
RDP_CHECK_DELTA = 1e-30  # below it, and from RDP_CHECK_STEPS steps on, epsilon is min(PLD, RDP)
RDP_CHECK_STEPS = 10**7
REFINE_POINTS, REFINE_MOST = 1 << 18, 1000  # see PLDAccountant._grid_epsilon


@register_accountant
class PLDAccountant(Accountant):
    """Tight accountant (default): ``PLDAccountant(value_interval=1e-4, max_fft_size=2**22)``.

    ``value_interval``: loss grid spacing h (grown automatically, only if the FFT window
    would exceed ``max_fft_size`` points).  ``tail_fraction``: the truncated masses
    together are kept below ``tail_fraction * delta``.
    """

    name = "pld"

    def __init__(self, value_interval: float = 1e-4, max_fft_size: int = 1 << 22, tail_fraction: float = 1e-6):
        super().__init__()
        if not (value_interval > 0 and math.isfinite(value_interval)):
            raise ValueError(f"value_interval must be a positive number, got {value_interval!r}")
        if int(max_fft_size) < 1024:
            raise ValueError(f"max_fft_size must be at least 1024, got {max_fft_size!r}")
        if not 0 < tail_fraction < 1:
            raise ValueError(f"tail_fraction must lie in (0, 1), got {tail_fraction!r}")
        self.value_interval = float(value_interval)
        self.max_fft_size = int(max_fft_size)
        self.tail_fraction = float(tail_fraction)
        self._cache: Dict[tuple, float] = {}

    def _epsilon(self, history: List[HistoryEntry], delta: float) -> float:
        counts: Dict[Tuple[float, float], int] = {}
        for sigma, q, steps in history:  # composition commutes: merge equal (sigma, q) anywhere
            counts[(sigma, q)] = counts.get((sigma, q), 0) + steps
        key = (tuple(sorted(counts.items())), delta)
        if key not in self._cache:
            if len(self._cache) >= 32:  # keep the cache small: drop the oldest answer
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = self._compute(counts, delta)
        return self._cache[key]

    def _compute(self, counts: Dict[Tuple[float, float], int], delta: float) -> float:
        if all(q == 1.0 for _, q in counts):
            # sigma^2 underflowing to 0 (sigma below ~1e-162): no noise at all, mu infinite
            mu = math.sqrt(sum(steps / (sigma * sigma) if sigma * sigma > 0 else math.inf
                               for (sigma, _), steps in counts.items()))
            try:
                return gaussian_epsilon(mu, delta) if math.isfinite(mu) else math.inf
            except OverflowError:  # mu past ~1e10: its exp cancels numbers of ~mu^2; RDP's bound below
                epsilon = math.inf
        else:
            epsilon = self._grid_epsilon(counts, delta)
        # Both are upper bounds, so the smaller one holds. The grid's bound is the looser one
        # where losses pass it (Inf: sigma of a few hundredths) and where its error floor
        # outgrows RDP's slack (measured: delta below ~1e-45, or ~1e9 steps); checked with a
        # margin, at ~50 ms a call.
        if math.isinf(epsilon) or delta < RDP_CHECK_DELTA or sum(counts.values()) >= RDP_CHECK_STEPS:
            from .rdp import OrderGridWarning, RDPAccountant
            rdp = RDPAccountant()
            for (sigma, q), steps in counts.items():
                rdp.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
            with warnings.catch_warnings():  # its advice (a wider 'orders' grid) is not this accountant's to take
                warnings.simplefilter("ignore", OrderGridWarning)
                epsilon = min(epsilon, rdp.epsilon(delta))
        return epsilon

    def _grid_epsilon(self, counts: Dict[Tuple[float, float], int], delta: float) -> float:
        """Both directions' epsilon on the grid, and again on the finest grid whose window stays
        within about REFINE_POINTS points (at most REFINE_MOST times finer) where that is finer:
        each step's loss rounded up to the grid adds up over the steps (0.016 at h = 1e-4 where the
        true epsilon is 0.0034: sigma 20, q 1e-4, 1e5 steps). A small epsilon's losses are narrow,
        so its fine grid is cheap; the spacing follows the window's width, so epsilon(sigma) has
        no jump where refining starts (a fixed tenfold step with a cap on the window had one)."""
        h = self.value_interval
        plds = [self.composed_pld(counts, delta, d, h) for d in DIRECTIONS]
        epsilon = max(pld.epsilon(delta) for pld in plds)
        fine = max(h * max(pld.probs.size for pld in plds) / REFINE_POINTS, h / REFINE_MOST)
        if 0.0 < epsilon < math.inf and fine < h:
            epsilon = min(epsilon, max(self.direction_epsilons(counts, delta, fine).values()))
        return epsilon

    def direction_epsilons(self, counts: Dict[Tuple[float, float], int], delta: float,
                           interval: Optional[float] = None) -> Dict[str, float]:
        """epsilon of the composed PLD in each direction for ``{(sigma, q): steps}``."""
        delta = check_delta(delta)
        return {d: self.composed_pld(counts, delta, d, interval).epsilon(delta) for d in DIRECTIONS}

    def composed_pld(self, counts: Dict[Tuple[float, float], int], delta: float, direction: str,
                     interval: Optional[float] = None) -> DiscretePLD:
        """Pessimistic composed PLD for ``{(sigma, q): steps}`` in one direction, on a grid of
        ``interval`` (default ``value_interval``; grown where the window would not fit)."""
        total_steps = sum(counts.values())
        budget = self.tail_fraction * delta
        step_tail = budget / (4.0 * total_steps)  # per step and side
        window_tail = budget / 4.0  # per side
        h = self.value_interval if interval is None else interval
        for _ in range(20):
            if h > MAX_INTERVAL:  # no grid fits: no bound from it (the accountant then reports RDP's)
                return DiscretePLD(offset=0, probs=np.zeros(1), interval=MAX_INTERVAL, inf_mass=1.0)
            groups = []
            widths = []
            for sigma, q in counts:
                lo_loss, hi_loss = _clipped_loss_range(direction, sigma, q, step_tail)
                widths.append((hi_loss - lo_loss) / h)
            if max(widths) > self.max_fft_size:
                h *= 1.25 * max(widths) / self.max_fft_size
                continue
            for (sigma, q), steps in counts.items():
                groups.append((subsampled_gaussian_pld(sigma, q, direction, h, step_tail), steps))
            if not all(pld.probs.any() for pld, _ in groups):  # a step with no finite loss (q = 1, sigma ~0.01)
                return DiscretePLD(offset=0, probs=np.zeros(1), interval=h, inf_mass=1.0)  # no bound: RDP's
            try:
                return compose_plds(groups, window_tail, self.max_fft_size, delta=delta)
            except WindowTooLarge as exc:
                h *= 1.25 * exc.size / self.max_fft_size
        raise RuntimeError("could not fit the privacy loss distribution into the FFT window")

    def _config(self) -> dict:
        return {
            "value_interval": self.value_interval,
            "max_fft_size": self.max_fft_size,
            "tail_fraction": self.tail_fraction,
        }

    def _load_config(self, config: dict) -> None:
        config = dict(config)
        fresh = PLDAccountant(
            value_interval=config.pop("value_interval", self.value_interval),
            max_fft_size=config.pop("max_fft_size", self.max_fft_size),
            tail_fraction=config.pop("tail_fraction", self.tail_fraction),
        )
        super()._load_config(config)
        self.value_interval = fresh.value_interval
        self.max_fft_size = fresh.max_fft_size
        self.tail_fraction = fresh.tail_fraction
        self._cache = {}
