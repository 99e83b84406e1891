"""``nn.Embedding`` on token ids ``(B, *)``: positions are flattened into T.

Sample i's weight gradient is ``sum_t onehot(x_t) g_t^T`` (V x D): rows of repeated tokens
add up, so its squared norm is ``sum_{s,t} [x_s = x_t] (g_s . g_t)``, computed in O(B T D)
by summing g over equal (sample, token) pairs. ``padding_idx`` positions get no gradient.
"""
from __future__ import annotations

import math
from typing import Dict, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fastdp import ops
from fastdp.layers import register
from fastdp.layers.base import LayerRule, Record, Tap, UnsupportedModuleError, expand_like, with_rounding_allowance
from fastdp.ops import sample_sq_norms


class _EmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx, tap):
        ctx.tap = tap
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        ctx.tap.fire(ctx, ids, grad_out)
        return None, None, None, None


class EmbeddingRule(LayerRule):
    module_types = (nn.Embedding,)
    param_names = ("weight",)

    def check(self, module: nn.Embedding) -> None:
        if module.max_norm is not None:
            raise UnsupportedModuleError(
                "max_norm renormalises embedding rows in place from the data seen; set max_norm=None"
            )
        if not module.weight.requires_grad:
            return  # the options below only change the gradient
        if module.scale_grad_by_freq:
            raise UnsupportedModuleError(
                "scale_grad_by_freq couples the samples of a batch; set scale_grad_by_freq=False"
            )
        if module.sparse:
            raise UnsupportedModuleError("sparse gradients are not supported; set sparse=False")

    def forward(self, module: nn.Embedding, tap: Tap, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() < 1:
            raise UnsupportedModuleError("nn.Embedding got a 0-d input: fastdp needs a batch dimension")
        return _EmbeddingFn.apply(ids, module.weight, module.padding_idx, tap)

    @staticmethod
    def _flat(rec: Record):
        """ids (B, T) and g (B, T, D), T the positions per sample (sizes explicit: T may be 0)."""
        ids, g = rec.activation, rec.grad_output
        batch, seq = ids.shape[0], math.prod(ids.shape[1:])
        return ids.reshape(batch, seq), g.reshape(batch, seq, g.shape[-1])

    def sq_norms(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        ids, g = self._flat(rec)
        if ids.shape[1] == 0:  # no position: no gradient
            return {"weight": g.new_zeros(ids.shape[0], dtype=torch.float64)}
        pad = rec.module.padding_idx
        sq_norms = ops.embedding_sq_norms(ids, g, pad)
        # the clipped sum adds each position's scaled g_t to its token's row (a_t one-hot: |a_t| = 1)
        row_norms = sample_sq_norms(g.reshape(-1, g.shape[-1])).sqrt_().view(ids.shape)
        if pad is not None:
            row_norms = row_norms.masked_fill_(ids == pad, 0.0)
        return {"weight": with_rounding_allowance(sq_norms, row_norms.sum(1), ids.shape[1], g.dtype)}

    def _masked(self, rec: Record):
        ids, g = self._flat(rec)
        pad = rec.module.padding_idx
        if pad is not None:  # dropped as torch drops them: a NaN or Inf there (0 * NaN) must not get through
            g = g.masked_fill((ids == pad).unsqueeze(-1), 0.0)
        return ids, g

    def per_sample_grads(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        ids, g = self._masked(rec)
        batch, seq, dim = g.shape
        out = g.new_zeros(batch, rec.module.num_embeddings, dim)
        out.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, dim), g)
        return {"weight": out}

    def clipped_sums(self, rec: Record, coefs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        ids, g = self._masked(rec)
        scaled = (g * expand_like(coefs["weight"], g)).reshape(-1, g.shape[-1])
        out = g.new_zeros(rec.module.num_embeddings, g.shape[-1])
        return {"weight": out.index_add_(0, ids.reshape(-1), scaled)}


register(EmbeddingRule())
