"""``nn.Linear`` on inputs ``(B, *, d)``: the middle dimensions are flattened into T.

Per-sample weight gradient of sample i: ``g_i^T a_i`` (p x d), with ``a_i``: (T, d) and
``g_i``: (T, p). Its squared norm comes from one of two routes, chosen per call by cost:

* ghost: ``sum_{s,t} (a_s . a_t)(g_s . g_t)``, ~T^2 (d + p) per sample;
* direct: instantiate ``g_i^T a_i``, ~T d p per sample;

plus the floats each moves through memory (:func:`route_costs`): ghost when
``T^2 (d + p + 32) < d p (T + 16)``. T = 1 reduces to ``|a_i|^2 |g_i|^2``. The clipped
sum is one GEMM on coefficient-scaled rows, the same cost as the gradient autograd skipped.
"""
from __future__ import annotations

from typing import Dict, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fastdp import ops
from fastdp.layers import register
from fastdp.layers.base import (LayerRule, Record, Tap, UnsupportedModuleError, as_dtype, batch_chunks,
                                in_layout_of, tf32_in_use, weighted_sum, with_gram_allowance, with_rounding_allowance)
from fastdp.ops import sample_sq_norms


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tap):
        ctx.save_for_backward(x, weight)
        ctx.tap = tap
        out = F.linear(x, weight, bias)
        # On (B, T, d) inputs with a bias, F.linear returns a view of its (B*T, p) result, and autograd
        # forbids in-place ops (ReLU(inplace=True), out += residual) on a view made inside a Function.
        # The result is ours alone: drop the view relation, as ATen's own linear does.
        return torch.ops.aten._unsafe_view(out, out.shape) if out._is_view() else out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.tap.fire(ctx, x, grad_out)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = in_layout_of(grad_out.matmul(as_dtype(weight, grad_out.dtype)), x)
        return grad_x, None, None, None


# Weight of one float written and read again, in flops: the direct route streams a (p, d)
# per-sample gradient through memory, the ghost route two (T, T) Grams. Measured on a
# 2-core AVX-512 CPU (a CIFAR CNN's convolutions), 16 puts the switch where timings cross.
MEMORY_WEIGHT = 16


def route_costs(seq: int, d: int, p: int):
    """Estimated (ghost, direct) cost of one per-sample norm: ghost ~T^2(d+p) flops and 2T^2
    floats of Grams, direct ~T d p flops and d p floats of per-sample gradient."""
    return seq * seq * (d + p + 2 * MEMORY_WEIGHT), d * p * (seq + MEMORY_WEIGHT)


def ghost_is_cheaper(seq: int, d: int, p: int) -> bool:
    """Decided per call from the shapes: T changes between batches."""
    ghost, direct = route_costs(seq, d, p)
    return ghost < direct


def sq_norms_3d(a: torch.Tensor, g: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """Per-sample ``|g_i^T a_i|_F^2`` for ``a``: (B, T, d), ``g``: (B, T, p) with T > 1, by the
    cheaper route; float64 (B,). A ghost norm carries its Gram sum's rounding allowance
    (:func:`with_gram_allowance`, ``slack``: (B,) as there)."""
    batch, seq, d = a.shape
    p = g.shape[-1]
    ghost = ghost_is_cheaper(seq, d, p)
    op = ops.linear_sq_norms_ghost if ghost else ops.linear_sq_norms_direct
    sq = torch.cat([op(a[c], g[c]) for c in batch_chunks(batch, 2 * seq * seq if ghost else d * p)])
    return with_gram_allowance(sq, slack, d + p + 2 * seq * seq) if ghost else sq


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(B, *, n) -> (B * T, n): one row per position, samples in order."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


class LinearRule(LayerRule):
    """Records hold ``a`` and ``g`` as row matrices (B*T, d) and (B*T, p); T = rows / B."""

    module_types = (nn.Linear,)

    def forward(self, module: nn.Linear, tap: Tap, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise UnsupportedModuleError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)}: fastdp needs "
                "a leading batch dimension (B, ..., in_features); add one with x.unsqueeze(0)"
            )
        return _LinearFn.apply(x, module.weight, module.bias, tap)

    def prepare(self, rec: Record) -> None:
        rec.activation, rec.grad_output = _rows(rec.activation), _rows(rec.grad_output)
        # One row per sample: the bias gradient is g_i, the weight's g_i a_i^T, and both norms
        # are cheap; found now, while a and g are still in cache.
        if self._seq(rec) == 1:
            rec.norms["weight"], rec.norms["bias"] = ops.outer_sq_norms(rec.activation, rec.grad_output)

    @staticmethod
    def _seq(rec: Record) -> int:
        """T, the rows per sample (1 for an empty batch)."""
        return rec.activation.shape[0] // rec.batch_size if rec.batch_size else 1

    def _per_sample(self, rec: Record):
        """``a`` (B, T, d) and ``g`` (B, T, p) as views of the record's rows."""
        a, g, batch, seq = rec.activation, rec.grad_output, rec.batch_size, self._seq(rec)
        return a.view(batch, seq, a.shape[1]), g.view(batch, seq, g.shape[1])

    def sq_norms(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        if self._seq(rec) == 1:  # prepare found them
            return super().sq_norms(rec, names)
        out = {}
        for name in names:
            if name == "weight":
                a, g = self._per_sample(rec)
                batch, seq = a.shape[:2]
                slack = (sample_sq_norms(rec.activation) * sample_sq_norms(rec.grad_output)).sqrt_()
                slack = slack.view(batch, seq).sum(1)
                out[name] = with_rounding_allowance(sq_norms_3d(a, g, slack), slack, seq,
                                                    torch.promote_types(a.dtype, g.dtype),
                                                    a.is_cuda and tf32_in_use("matmul"))
            else:  # the bias's per-sample gradients are small: sum over T once
                out[name] = sample_sq_norms(self.cached_grads(rec, [name])[name])
        return out

    def per_sample_grads(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        a, g = self._per_sample(rec)
        grads = {"weight": lambda: torch.bmm(g.transpose(1, 2), a.to(g.dtype)), "bias": lambda: g.sum(1)}
        return {name: grads[name]() for name in names}

    def clipped_sums(self, rec: Record, coefs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The weight's sum is one GEMM over the B*T rows of ``a`` and ``g``, the narrower
        operand scaled by its sample's coefficient; the bias's one vector-matrix product."""
        a, g = rec.activation, rec.grad_output
        dtype = a.dtype if a.dtype == g.dtype else torch.promote_types(a.dtype, g.dtype)
        a, g = as_dtype(a, dtype), as_dtype(g, dtype)
        seq = self._seq(rec)
        out = {}
        if "weight" in coefs:
            c = _per_row(coefs["weight"], seq, dtype).unsqueeze(1)
            out["weight"] = g.t().mm(a * c) if a.shape[1] <= g.shape[1] else (g * c).t().mm(a)
        if "bias" in coefs:  # T = 1: g is the per-sample bias gradient; else sum over T once
            if seq == 1:
                out["bias"] = as_dtype(coefs["bias"], dtype) @ g
            else:
                out["bias"] = weighted_sum(coefs["bias"], self.cached_grads(rec, ["bias"])["bias"])
        return out


def _per_row(coef: torch.Tensor, seq: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-sample ``coef`` (B,) repeated for each of the T rows of its sample: (B*T,)."""
    coef = as_dtype(coef, dtype)
    return coef if seq == 1 else coef.repeat_interleave(seq)


register(LinearRule())
