"""Reference accountant: Renyi DP of the Poisson-subsampled Gaussian mechanism.

Written to be read.  With ``mu0 = N(0, sigma^2)``, ``mu1 = N(1, sigma^2)`` and the
subsampled output ``mu = (1-q) mu0 + q mu1``, the Renyi divergence of order ``alpha``
of one step is (Mironov 2017; Mironov, Talwar, Zhang 2019)

    RDP(alpha) = log A_alpha / (alpha - 1),   A_alpha = E_{z~mu0}[(mu(z)/mu0(z))^alpha],

and ``mu/mu0 = 1 - q + q exp((2z - 1) / (2 sigma^2))``.

* integer alpha: binomial expansion, a finite sum
  ``A = sum_k C(alpha,k) (1-q)^(alpha-k) q^k exp((k^2 - k) / (2 sigma^2))``;
* fractional alpha: split the integral at ``z0 = sigma^2 log(1/q - 1) + 1/2``, where
  ``q e^u = 1 - q``, and expand ``(1 - q + q e^u)^alpha`` on each side with generalised
  binomial coefficients; each term has a closed Gaussian integral.  The two series
  converge absolutely; we sum them in log space with explicit signs.

RDP composes additively over steps (also for different sigma and q).  Conversion to
(epsilon, delta) uses the bound of Balle et al. 2020 (Thm. 21):

    eps = RDP(alpha) + log((alpha-1)/alpha) - (log delta + log alpha) / (alpha - 1),

minimised over the order grid, plus the observation that epsilon = 0 is certified once
``sqrt(1 - exp(-RDP(alpha))) <= delta`` (total variation is at most that, and the
KL divergence is at most any RDP with alpha >= 1).
"""
from __future__ import annotations

import math
import warnings
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np
from scipy import special

from fastdp.callers import user_stacklevel

from .base import Accountant, HistoryEntry, check_delta, register_accountant

__all__ = [
    "DEFAULT_ORDERS",
    "RDPAccountant",
    "OrderGridWarning",
    "log_a",
    "rdp_subsampled_gaussian",
    "rdp_to_epsilon",
]


def _default_orders() -> Tuple[float, ...]:
    near_one = [round(1.0 + k / 20.0, 10) for k in range(1, 20)]  # 1.05 .. 1.95
    small = [round(2.0 + k / 10.0, 10) for k in range(0, 90)]  # 2.0 .. 10.9
    medium = [float(k) for k in range(11, 65)]  # 11 .. 64
    large = [72.0, 80.0, 96.0, 112.0, 128.0, 160.0, 192.0, 224.0, 256.0, 320.0, 384.0, 512.0, 768.0, 1024.0]
    return tuple(sorted(set(near_one + small + medium + large)))


#: Default Renyi orders: 1.05..1.95 by 0.05, 2..10.9 by 0.1, integers 11..64, then sparse
#: up to 1024 (a superset of the default grids of Opacus and dp-accounting).
DEFAULT_ORDERS: Tuple[float, ...] = _default_orders()


class OrderGridWarning(UserWarning):
    """The best Renyi order is the smallest or largest of the grid: widen the grid."""


# --------------------------------------------------------------------------- log A_alpha
def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha for integer alpha >= 1 by the finite binomial sum (0 < q < 1)."""
    k = np.arange(alpha + 1, dtype=np.float64)
    log_binom = special.gammaln(alpha + 1.0) - special.gammaln(k + 1.0) - special.gammaln(alpha - k + 1.0)
    terms = log_binom + k * math.log(q) + (alpha - k) * math.log1p(-q) + (k * k - k) / (2.0 * (sigma * sigma))
    return float(special.logsumexp(terms))


def _log_a_fractional(q: float, sigma: float, alpha: float, rel_tol_log: float = -32.0) -> float:
    """log A_alpha for non-integer alpha > 1 by the two split series (0 < q < 1).

    Terms are added in chunks until every term in a chunk is below ``exp(rel_tol_log)``
    times the running value of ``A - 1`` (the part that carries the privacy loss; A >= 1)
    or below 1e-16 A (float resolution), and the index has passed alpha (after which
    the terms alternate in sign and shrink, so the remainder is smaller than the last
    term).
    """
    log_q, log_1mq = math.log(q), math.log1p(-q)
    z0 = (sigma * sigma) * (log_1mq - log_q) + 0.5
    s2 = 2.0 * (sigma * sigma)
    lg_alpha1 = special.gammaln(alpha + 1.0)
    first_negative = math.ceil(alpha)  # C(alpha, i) < 0 exactly when i > alpha and i - ceil(alpha) odd

    log_pos, log_neg = -np.inf, -np.inf
    start, chunk = 0, 64
    while True:
        i = np.arange(start, start + chunk, dtype=np.float64)
        log_abs_binom = lg_alpha1 - special.gammaln(i + 1.0) - special.gammaln(alpha - i + 1.0)
        negative = (i > alpha) & (((i - first_negative) % 2) == 1)
        j = alpha - i
        # below z0: sum_i C(alpha,i) (1-q)^(alpha-i) q^i exp((i^2-i)/(2s^2)) Phi((z0-i)/sigma)
        below = log_abs_binom + i * log_q + j * log_1mq + (i * i - i) / s2 + special.log_ndtr((z0 - i) / sigma)
        # above z0: sum_i C(alpha,i) (1-q)^i q^(alpha-i) exp((j^2-j)/(2s^2)) Phi((j-z0)/sigma)
        above = log_abs_binom + j * log_q + i * log_1mq + (j * j - j) / s2 + special.log_ndtr((j - z0) / sigma)
        terms = np.concatenate([below, above])
        signs = np.concatenate([negative, negative])
        if (~signs).any():
            log_pos = np.logaddexp(log_pos, special.logsumexp(terms[~signs]))
        if signs.any():
            log_neg = np.logaddexp(log_neg, special.logsumexp(terms[signs]))
        start += chunk
        if log_neg == -np.inf:
            total = float(log_pos)
        elif log_neg < log_pos:
            total = float(log_pos + math.log1p(-math.exp(log_neg - log_pos)))
        else:  # cannot happen for an exact sum (A >= 1); guard against round-off
            total = 0.0
        if math.isinf(total):  # a term past float64 (sigma ~1e-153): the loop's test would never pass
            return math.inf
        # log(A - 1), the part of A that carries the privacy loss
        excess = -math.expm1(-total)  # (A - 1) / A, accurate for tiny A - 1
        scale = total + math.log(excess) if excess > 0.0 else -745.0
        # (A itself is only resolved to ~1e-16 in float64: no point going below that)
        if start > alpha + 1 and terms.max() < max(scale + rel_tol_log, total - 37.0):
            return float(total)
        if start > 50_000_000:
            warnings.warn(f"RDP series for alpha={alpha} did not converge; result may be inaccurate",
                          stacklevel=user_stacklevel())
            return float(total)
        chunk = min(2 * chunk, 1 << 20)


TINY_SIGMA = 1e-150


def log_a(q: float, sigma: float, alpha: float) -> float:
    """log E_{mu0}[(mu/mu0)^alpha] for one Poisson-subsampled Gaussian step.

    ``alpha > 1``; ``q`` in [0, 1]; ``sigma >= 0``.  Returns 0 for q = 0 and inf for
    sigma = 0 < q, or sigma below ``TINY_SIGMA`` (a sampled example's loss past 1/(2 sigma^2) =
    5e299: no privacy; below it the series' terms overflow, and they read 0 from ~1e-152).
    """
    if q == 0.0 or math.isinf(sigma):
        return 0.0
    if sigma < TINY_SIGMA:
        return math.inf
    if q == 1.0:  # plain Gaussian: D_alpha(N(1,s^2) || N(0,s^2)) = alpha / (2 s^2)
        return (alpha - 1.0) * alpha / (2.0 * (sigma * sigma))
    # A_alpha >= 1 (Jensen): a log below 0 is round-off (sigma ~1e6 or q ~1e-16), which the
    # epsilon conversion would refuse as a negative RDP value
    value = _log_a_integer(q, sigma, int(alpha)) if float(alpha).is_integer() else _log_a_fractional(
        q, sigma, float(alpha))
    return math.inf if math.isnan(value) else max(0.0, value)  # max(0.0, nan) would be 0.0


def _check_orders(orders: Iterable[float]) -> np.ndarray:
    arr = np.asarray(sorted(float(a) for a in orders), dtype=np.float64)
    if arr.size == 0:
        raise ValueError("orders must contain at least one Renyi order > 1")
    if not np.all(np.isfinite(arr)) or arr[0] <= 1.0:
        raise ValueError(f"Renyi orders must be finite and > 1, got smallest {arr[0]!r}")
    return arr


def rdp_subsampled_gaussian(q: float, sigma: float, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of ONE Poisson-subsampled Gaussian step at each order (array, same order as given)."""
    alphas = [float(a) for a in orders]
    _check_orders(alphas)
    return np.array([log_a(q, sigma, a) / (a - 1.0) for a in alphas], dtype=np.float64)


def rdp_to_epsilon(
    orders: Sequence[float], rdp: Sequence[float], delta: float, warn: bool = True
) -> Tuple[float, float]:
    """Convert RDP curve to (epsilon, best order) at ``delta`` (Balle et al. 2020 bound).

    Warns with :class:`OrderGridWarning` when the best order is the first or last one.
    """
    delta = check_delta(delta)
    alphas = np.asarray(orders, dtype=np.float64)
    values = np.asarray(rdp, dtype=np.float64)
    if alphas.shape != values.shape or alphas.ndim != 1 or alphas.size == 0:
        raise ValueError("orders and rdp must be 1-D sequences of the same non-zero length")
    if np.any(alphas <= 1.0):
        raise ValueError("Renyi orders must be > 1")
    if np.any(values < 0) or np.any(np.isnan(values)):
        raise ValueError("RDP values must be >= 0")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        eps = values + np.log1p(-1.0 / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1.0)
        eps = np.where(np.isinf(values), np.inf, np.maximum(eps, 0.0))
        # TV <= sqrt(1 - exp(-KL)) and KL <= RDP(alpha): epsilon = 0 already suffices here.
        eps = np.where(-np.expm1(-values) <= delta**2, 0.0, eps)
    best = int(np.argmin(eps))
    eps_best = float(eps[best])
    if warn and alphas.size > 1 and 0.0 < eps_best < math.inf and best in (0, alphas.size - 1):
        where = "smallest" if best == 0 else "largest"
        warnings.warn(
            f"the optimal Renyi order is the {where} one in the grid (alpha={alphas[best]:g}); "
            "epsilon may be loose, pass a wider `orders` grid",
            OrderGridWarning,
            stacklevel=user_stacklevel(),
        )
    return eps_best, float(alphas[best])


@register_accountant
class RDPAccountant(Accountant):
    """Renyi-DP accountant (reference; looser than PLD, 9-17 % at common settings): ``RDPAccountant(orders=None)``.

    ``orders``: Renyi orders (> 1) to optimise over; default :data:`DEFAULT_ORDERS`.
    """

    name = "rdp"

    def __init__(self, orders: Optional[Sequence[float]] = None) -> None:
        super().__init__()
        self.orders: Tuple[float, ...] = tuple(_check_orders(DEFAULT_ORDERS if orders is None else orders))
        self._cache: dict = {}

    def _rdp_one_step(self, sigma: float, q: float) -> np.ndarray:
        key = (sigma, q)
        if key not in self._cache:
            self._cache[key] = rdp_subsampled_gaussian(q, sigma, self.orders)
        return self._cache[key]

    def rdp(self) -> np.ndarray:
        """Total RDP of the recorded history at each of ``self.orders``."""
        total = np.zeros(len(self.orders))
        for sigma, q, steps in self._history:
            total = total + steps * self._rdp_one_step(sigma, q)
        return total

    def epsilon_and_order(self, delta: float) -> Tuple[float, float]:
        """(epsilon, best Renyi order) at ``delta``."""
        check_delta(delta)
        return rdp_to_epsilon(self.orders, self.rdp(), delta)

    def _epsilon(self, history: List[HistoryEntry], delta: float) -> float:
        return self.epsilon_and_order(delta)[0]

    def _config(self) -> dict:
        return {"orders": [float(order) for order in self.orders]}  # plain floats: weights_only loads

    def _load_config(self, config: dict) -> None:
        config = dict(config)
        orders = config.pop("orders", None)
        super()._load_config(config)
        if orders is not None:
            self.orders = tuple(_check_orders(orders))
            self._cache = {}
