"""Clipping policies: per-sample squared norms in, per-sample coefficients out.

A policy has

* ``sensitivity``: the largest L2 norm one sample's clipped gradient can have, which scales
  the noise (std = noise_multiplier * sensitivity on the sum);
* either ``coefficient(total_sq, scale)``: one (B,) coefficient shared by every parameter,
  from the per-sample total squared norm (flat, automatic), or ``coefficients(sq_norms,
  scale, total_sq)``: ``{param: (B,) squared norm}`` to ``{param: (B,) coefficient}``
  (per-layer); float64 either way. The engine calls the first where a policy has it;
* ``settings()``: what data-parallel ranks must agree on (compared at every step).

``scale``: the norms given are of the per-sample gradients divided by ``scale`` (a mean
loss divides them by the batch size), and the coefficients returned apply to those divided
gradients: ``scale * c(scale^2 * sq_norms)``. ``total_sq``, where the caller has it, is the
per-sample sum of ``sq_norms`` over parameters (not modified).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch

from fastdp import ops
from fastdp.arguments import finite_number

# Added to norms before dividing, so a zero gradient gets coefficient 1, not inf.
EPS = 1e-6


class FlatClipping:
    """Clip the whole per-sample gradient (all parameters) to norm C: ``min(1, C/(|g_i| + EPS))``."""

    def __init__(self, max_grad_norm: float):
        self.max_grad_norm = finite_number(max_grad_norm, "max_grad_norm")

    @property
    def sensitivity(self) -> float:
        return self.max_grad_norm

    def settings(self) -> tuple:
        return type(self).__name__, self.max_grad_norm

    def coefficient(self, total_sq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The one coefficient (B,) that every parameter shares, from the per-sample total."""
        return ops.clip_factors(total_sq, self.max_grad_norm, scale, EPS, True)


class AutomaticClipping(FlatClipping):
    """Automatic clipping (Bu et al. 2023): ``C / (|g_i| + gamma)``; every sample is rescaled."""

    def __init__(self, max_grad_norm: float, gamma: float = 0.01):
        super().__init__(max_grad_norm)
        self.gamma = finite_number(gamma, "gamma")

    def coefficient(self, total_sq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return ops.clip_factors(total_sq, self.max_grad_norm, scale, self.gamma, False)

    def settings(self) -> tuple:
        return type(self).__name__, self.max_grad_norm, self.gamma


class PerLayerClipping:
    """Clip each parameter tensor separately to its own bound ``C_p``.

    ``max_grad_norm`` is one float C (each of the P parameters gets ``C / sqrt(P)``, so the
    total sensitivity stays C) or a sequence with one bound per parameter, in parameter
    order; the sensitivity is then ``sqrt(sum_p C_p^2)``.
    """

    def __init__(self, max_grad_norm: Union[float, Sequence[float]], params: Sequence[torch.Tensor]):
        one_per_parameter = (isinstance(max_grad_norm, Sequence) and not isinstance(max_grad_norm, (str, bytes))
                             or getattr(max_grad_norm, "ndim", 0) > 0)
        if one_per_parameter:
            bounds = [finite_number(c, f"max_grad_norm[{i}]") for i, c in enumerate(max_grad_norm)]
            if len(bounds) != len(params):
                raise ValueError(
                    f"per-layer clipping got {len(bounds)} bounds for {len(params)} trainable parameters"
                )
        else:
            c = finite_number(max_grad_norm, "max_grad_norm") / math.sqrt(max(1, len(params)))
            bounds = [c] * len(params)
        self.bounds = dict(zip(params, bounds))

    @property
    def sensitivity(self) -> float:
        return math.hypot(*self.bounds.values())  # no overflow of the squares for bounds past 1e154

    def settings(self) -> tuple:
        return type(self).__name__, list(self.bounds.values())

    def coefficients(self, sq_norms, scale: float = 1.0, total_sq: Optional[torch.Tensor] = None):
        return {p: ops.clip_factors(n, self.bounds[p], scale, EPS, True) for p, n in sq_norms.items()}


def make_clipping(mode: str, max_grad_norm, params, gamma: float = 0.01):
    """The policy named ``mode``: "flat" (default), "per_layer" or "automatic"."""
    if mode == "flat":
        return FlatClipping(max_grad_norm)
    if mode == "automatic":
        return AutomaticClipping(max_grad_norm, gamma)
    if mode == "per_layer":
        return PerLayerClipping(max_grad_norm, params)
    raise ValueError(f"clipping={mode!r}: expected 'flat', 'per_layer' or 'automatic'")
