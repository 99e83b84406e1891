"""Normalisation layers with an elementwise affine: LayerNorm, RMSNorm, GroupNorm, InstanceNorm.

LayerNorm and GroupNorm run fused: aten's native forward; LayerNorm's backward is aten's
input gradient plus ``x_hat`` rebuilt from the saved mean and reciprocal std, GroupNorm's is
``ops.group_norm_backward``, whose per-channel sums give both the per-sample gradients and
the input gradient (one pass per sample and group in the C++ kernel).
RMSNorm and InstanceNorm run the parameter-free normalisation in plain autograd and hook
only the affine map ``y = x_hat * weight + bias``. Per-sample gradients are cheap to instantiate:
weight: ``x_hat * g`` summed over the positions that share a weight entry; bias: ``g`` summed.

* LayerNorm / RMSNorm: parameters cover the trailing ``normalized_shape`` dims;
* GroupNorm / InstanceNorm: one parameter per channel (dim 1).
"""
from __future__ import annotations

import math
from typing import Dict, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from fastdp import ops
from fastdp.layers import register
from fastdp.layers.base import LayerRule, Record, Tap, UnsupportedModuleError, check_batched, in_layout_of


def _param_view(param: torch.Tensor, x: torch.Tensor, channel_dim: bool) -> torch.Tensor:
    if channel_dim:
        return param.view(1, -1, *([1] * (x.dim() - 2)))
    return param


class _AffineFn(torch.autograd.Function):
    """``y = x_hat * w + b`` with w, b either trailing-shaped or per channel (dim 1)."""

    @staticmethod
    def forward(ctx, x_hat, weight, bias, channel_dim, tap):
        ctx.save_for_backward(x_hat, weight)
        ctx.channel_dim, ctx.tap = channel_dim, tap
        y = x_hat
        if weight is not None:
            y = y * _param_view(weight, x_hat, channel_dim)
        if bias is not None:
            y = y + _param_view(bias, x_hat, channel_dim)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x_hat, weight = ctx.saved_tensors
        ctx.tap.fire(ctx, (x_hat, ctx.channel_dim), grad_out)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out if weight is None else grad_out * _param_view(weight, x_hat, ctx.channel_dim)
            grad_x = in_layout_of(grad_x, x_hat)
        return grad_x, None, None, None, None


def _reduce_to_param(t: torch.Tensor, channel_dim: bool, param_shape) -> torch.Tensor:
    """Sum a per-sample (B, ...) tensor down to (B, *param_shape). Sizes are explicit, not -1,
    so that an empty batch (B = 0) reshapes too."""
    if channel_dim:
        return t.reshape(t.shape[0], t.shape[1], math.prod(t.shape[2:])).sum(2)
    return t.reshape(t.shape[0], math.prod(t.shape[1:]) // math.prod(param_shape), *param_shape).sum(1)


class _AffineNormRule(LayerRule):
    channel_dim = False

    def normalize(self, module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def probe(x: torch.Tensor) -> torch.Tensor:
        """The functional norm on a tiny input: tells whether autocast keeps its input's dtype."""
        raise NotImplementedError

    def forward(self, module, tap: Tap, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise UnsupportedModuleError(
                f"{type(module).__name__} got an input of shape {tuple(x.shape)}: fastdp needs a batch dimension"
            )
        # A half-precision input with float32 parameters, in a norm autocast leaves in the input's dtype (CPU):
        # the plain module normalises in float32 and rounds once, to the input's dtype; so does this path.
        weight = module.weight
        widen = (x.dtype in (torch.float16, torch.bfloat16) and weight is not None and weight.dtype == torch.float32
                 and _autocast_keeps_dtype(self.probe, x))
        x_hat = self.normalize(module, x.float() if widen else x)
        out = _AffineFn.apply(x_hat, weight, getattr(module, "bias", None), self.channel_dim, tap)
        return out.to(x.dtype) if widen else out

    def prepare(self, rec: Record) -> None:
        """Per-sample grads are small (B x C): take them now and free x_hat and g."""
        self.cached_grads(rec, rec.names)
        rec.release()

    def per_sample_grads(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        x_hat, channel_dim = rec.activation
        g = rec.grad_output
        out = {}
        for name in names:
            shape = rec.params[name].shape
            source = g * x_hat.to(g.dtype) if name == "weight" else g
            out[name] = _reduce_to_param(source, channel_dim, shape)
        return out


class _FusedLayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, tap):
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.normalized_shape, ctx.tap = normalized_shape, tap
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        ctx.tap.fire(ctx, ((x - mean) * rstd, False), grad_out)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.native_layer_norm_backward(
                grad_out, x, ctx.normalized_shape, mean, rstd, weight, bias, [True, False, False])[0]
        return grad_x, None, None, None, None, None


class _FusedGroupNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, tap):
        n, c = x.shape[:2]
        y, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, n, c, x[0, 0].numel(), groups, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.groups, ctx.tap = groups, tap
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, rstd = ctx.saved_tensors
        grad_x, weight_grads, bias_grads = ops.group_norm_backward(
            grad_out, x, mean, rstd, weight, ctx.groups, ctx.needs_input_grad[0])
        # the per-sample gradients come with the input gradient: x_hat is never built
        ctx.tap.fire(ctx, ({"weight": weight_grads, "bias": bias_grads}, True), grad_out)
        return grad_x, None, None, None, None, None


# Whether a functional norm, under the autocast state of the key, computes in its input's own
# dtype: then the fused path (aten's native kernel on the same input) matches it exactly, and the
# unfused path computes a half-precision input in float32 and rounds its output once, as the plain
# module does. CPU autocast leaves the norms alone; CUDA autocast runs them in float32, and there
# the unfused path keeps autocast's casts.
_AUTOCAST_KEEPS_DTYPE: Dict[tuple, bool] = {}


def _autocast_keeps_dtype(norm, x: torch.Tensor) -> bool:
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return True
    key = (norm, device, x.dtype, torch.get_autocast_dtype(device))
    if key not in _AUTOCAST_KEEPS_DTYPE:
        probe = torch.zeros(1, 1, 2, device=x.device, dtype=x.dtype)
        _AUTOCAST_KEEPS_DTYPE[key] = norm(probe).dtype == x.dtype
    return _AUTOCAST_KEEPS_DTYPE[key]


class LayerNormRule(_AffineNormRule):
    module_types = (nn.LayerNorm,)

    @staticmethod
    def probe(x):
        return F.layer_norm(x, x.shape[-1:])

    def forward(self, module, tap: Tap, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[0] == 0 or not _autocast_keeps_dtype(self.probe, x):
            return super().forward(module, tap, x)  # checks, empty batch, autocast casts: unfused path
        return _FusedLayerNormFn.apply(x.contiguous(), module.weight, module.bias,
                                       list(module.normalized_shape), module.eps, tap)

    def normalize(self, module, x):
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)


class RMSNormRule(_AffineNormRule):
    module_types = (nn.RMSNorm,)
    param_names = ("weight",)

    @staticmethod
    def probe(x):
        return F.rms_norm(x, x.shape[-1:])

    def normalize(self, module, x):
        return F.rms_norm(x, module.normalized_shape, None, module.eps)


class GroupNormRule(_AffineNormRule):
    module_types = (nn.GroupNorm,)
    channel_dim = True

    @staticmethod
    def probe(x):
        return F.group_norm(x, 1)

    def forward(self, module, tap: Tap, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[0] == 0 or not _autocast_keeps_dtype(self.probe, x):
            return super().forward(module, tap, x)  # checks, empty batch, autocast casts: unfused path
        return _FusedGroupNormFn.apply(x.contiguous(), module.weight, module.bias, module.num_groups,
                                       module.eps, tap)

    def normalize(self, module, x):
        return F.group_norm(x, module.num_groups, None, None, module.eps)

    def per_sample_grads(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """The fused path's backward already computed them (``ops.group_norm_backward``)."""
        computed, _ = rec.activation
        if not isinstance(computed, dict):  # the unfused path saved x_hat
            return super().per_sample_grads(rec, names)
        return {name: computed[name] for name in names}


class InstanceNormRule(_AffineNormRule):
    module_types = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
    channel_dim = True

    @staticmethod
    def probe(x):
        return F.instance_norm(x)

    def check(self, module) -> None:
        if module.track_running_stats:
            raise UnsupportedModuleError(
                "track_running_stats=True accumulates statistics over samples without noise; "
                "set track_running_stats=False (fastdp.fix(model) does this)"
            )

    def forward(self, module, tap: Tap, x: torch.Tensor) -> torch.Tensor:
        spatial = next(n for kind, n in ((nn.InstanceNorm3d, 3), (nn.InstanceNorm2d, 2), (nn.InstanceNorm1d, 1))
                       if isinstance(module, kind))
        check_batched(module, x, spatial)
        return super().forward(module, tap, x)

    def normalize(self, module, x):
        return _ContiguousGrad.apply(F.instance_norm(x, None, None, None, None, True, 0.0, module.eps))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: torch's instance_norm backward is
    wrong for a channels-last output gradient at batch size 1 (torch 2.13)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


for _rule in (LayerNormRule(), RMSNormRule(), GroupNormRule(), InstanceNormRule()):
    register(_rule)
