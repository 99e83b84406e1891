"""Common machinery for the privacy accountants: input checks, history, state.

Conventions shared by every accountant in :mod:`fastdp.accounting`:

* One DP-SGD step is the Poisson-subsampled Gaussian mechanism: every example is
  included independently with probability ``sample_rate`` (q), the clipped gradient
  sum (L2 sensitivity C, i.e. 1 in units of C) gets N(0, (sigma*C)^2) noise, so only
  ``noise_multiplier`` (sigma) and q matter.
* Neighbouring datasets differ by adding or removing one example ("add/remove"
  adjacency); the reported epsilon covers both directions.
* ``history`` is a list of ``(noise_multiplier, sample_rate, steps)`` tuples in the
  order the steps were taken; consecutive entries with the same (sigma, q) are merged.
"""
from __future__ import annotations

import math
import sys
from typing import Dict, Iterable, List, Tuple, Type

HistoryEntry = Tuple[float, float, int]

_REGISTRY: Dict[str, Type["Accountant"]] = {}


# --------------------------------------------------------------------------- checks
def check_noise_multiplier(sigma: float) -> float:
    """Return sigma as float; sigma must be a number >= 0 (0 means no noise, inf allowed)."""
    try:
        value = float(sigma)
    except (TypeError, ValueError):
        raise ValueError(f"noise_multiplier must be a number >= 0, got {sigma!r}") from None
    if math.isnan(value) or value < 0:
        raise ValueError(f"noise_multiplier must be >= 0 (0 = no noise), got {sigma!r}")
    return value


def check_sample_rate(q: float, allow_zero: bool = True) -> float:
    """Return q as float; q is a Poisson sampling probability and must lie in [0, 1]. The
    accountants take 0 (nothing released); a rate batches are drawn at (``allow_zero=False``)
    must lie in (0, 1]."""
    interval = "[0, 1]" if allow_zero else "(0, 1]"
    try:
        value = float(q)
    except (TypeError, ValueError):
        raise ValueError(f"sample_rate must be a number in {interval}, got {q!r}") from None
    if math.isnan(value) or not 0.0 <= value <= 1.0 or (value == 0.0 and not allow_zero):
        raise ValueError(f"sample_rate must lie in {interval} (1 = full batch), got {q!r}")
    return value


def check_steps(steps: int) -> int:
    """Return steps as int; steps must be a non-negative integer."""
    if isinstance(steps, bool):
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    try:
        value = int(steps)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}") from None
    if value != steps or value < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    return value


def check_delta(delta: float) -> float:
    """Return delta as float; delta must satisfy 0 < delta < 1 and be a normal float (a
    subnormal delta, below ``sys.float_info.min`` = 2.2250738585072014e-308, leaves the Gaussian
    tails the accountants evaluate without precision: the exact q = 1 epsilon came out too low)."""
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"delta must be a number with 0 < delta < 1, got {delta!r}") from None
    if not 0.0 < value < 1.0:  # also rejects NaN
        raise ValueError(f"delta must satisfy 0 < delta < 1, got {delta!r}")
    if value < sys.float_info.min:
        raise ValueError(f"delta={delta!r} is below {sys.float_info.min!r} (a subnormal float), where epsilon "
                         "cannot be computed accurately; use a larger delta")
    return value


def merge_history(entries: Iterable[HistoryEntry]) -> List[HistoryEntry]:
    """Validate entries and merge consecutive ones with identical (sigma, q); drop 0-step ones."""
    merged: List[HistoryEntry] = []
    for entry in entries:
        if len(entry) != 3:
            raise ValueError(f"history entries are (noise_multiplier, sample_rate, steps), got {entry!r}")
        sigma = check_noise_multiplier(entry[0])
        q = check_sample_rate(entry[1])
        steps = check_steps(entry[2])
        if steps == 0:
            continue
        if merged and merged[-1][0] == sigma and merged[-1][1] == q:
            merged[-1] = (sigma, q, merged[-1][2] + steps)
        else:
            merged.append((sigma, q, steps))
    return merged


def is_trivial(sigma: float, q: float) -> bool:
    """True when a step leaks nothing: nobody is sampled (q = 0) or the noise is infinite, or so
    large that sigma^2 overflows float64 (sigma > 1.3e154: a privacy loss under 1e-308 a step,
    where the accountants' formulas break down)."""
    return q == 0.0 or math.isinf(sigma * sigma)


# --------------------------------------------------------------------------- base class
class Accountant:
    """Stateful accountant: record steps with :meth:`step`, ask :meth:`epsilon`.

    Subclasses set ``name`` and implement ``_epsilon(history, delta)`` where ``history``
    is already validated and non-empty; they may add their own settings to
    ``_config()`` so that ``state_dict`` round-trips them.
    """

    name = "base"

    def __init__(self) -> None:
        self._history: List[HistoryEntry] = []

    # -- recording ------------------------------------------------------------
    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> "Accountant":
        """Record ``num_steps`` steps with the given sigma and q; returns ``self``."""
        sigma = check_noise_multiplier(noise_multiplier)
        q = check_sample_rate(sample_rate)
        steps = check_steps(num_steps)
        if steps:
            if self._history and self._history[-1][:2] == (sigma, q):
                self._history[-1] = (sigma, q, self._history[-1][2] + steps)
            else:
                self._history.append((sigma, q, steps))
        return self

    @property
    def history(self) -> List[HistoryEntry]:
        """Copy of the recorded ``(noise_multiplier, sample_rate, steps)`` entries."""
        return list(self._history)

    @property
    def steps(self) -> int:
        """Total number of recorded steps."""
        return sum(entry[2] for entry in self._history)

    def __len__(self) -> int:
        return self.steps

    # -- querying -------------------------------------------------------------
    def epsilon(self, delta: float) -> float:
        """Smallest epsilon (>= 0, possibly inf) this accountant certifies at ``delta``."""
        delta = check_delta(delta)
        history = [entry for entry in self._history if not is_trivial(entry[0], entry[1])]
        if not history:
            return 0.0
        if any(sigma == 0.0 for sigma, _, _ in history):
            return math.inf  # a noiseless step on a sampled example reveals it
        return float(self._epsilon(history, delta))

    def _epsilon(self, history: List[HistoryEntry], delta: float) -> float:
        raise NotImplementedError

    # -- persistence ----------------------------------------------------------
    def _config(self) -> dict:
        return {}

    def _load_config(self, config: dict) -> None:
        if config:
            raise ValueError(f"unexpected accountant settings {sorted(config)}")

    def state_dict(self) -> dict:
        """Plain-Python state: ``{"accountant": name, "history": [[sigma, q, steps], ...], ...}``."""
        state = {"accountant": self.name, "history": [list(entry) for entry in self._history]}
        state.update(self._config())
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` produced (the accountant type must match)."""
        state = dict(state)
        kind = state.pop("accountant", self.name)
        if kind != self.name:
            raise ValueError(f"state belongs to a {kind!r} accountant, this one is {self.name!r}")
        if not isinstance(state.get("history"), (list, tuple)):
            raise ValueError(f"state has no 'history' list, got {state.get('history')!r}")
        history = merge_history(tuple(entry) for entry in state.pop("history"))
        self._load_config(state)
        self._history = history

    def __repr__(self) -> str:
        return f"{type(self).__name__}(steps={self.steps}, history={self._history!r})"


def register_accountant(cls: Type[Accountant]) -> Type[Accountant]:
    """Class decorator: make ``cls`` available to :func:`make_accountant` by ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def available_accountants() -> List[str]:
    return sorted(_REGISTRY)


def make_accountant(name: str = "pld", **kwargs) -> Accountant:
    """Create an accountant by name: ``"pld"`` (tight, default) or ``"rdp"`` (reference)."""
    key = str(name).lower()
    if key not in _REGISTRY:
        raise ValueError(f"unknown accountant {name!r}; choose one of {available_accountants()}")
    return _REGISTRY[key](**kwargs)
