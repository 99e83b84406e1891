"""C++/OpenMP CPU kernels of ``fastdp._C``, registered as backend ``"native"`` on ``"cpu"``.

Importing this module fails with ImportError when the extension is not built; the
dispatcher in :mod:`fastdp.ops` then falls back to the references. The kernels take
NumPy views of contiguous CPU tensors, or, those called every step for every parameter or
layer (noise, per-sample norms, totals, clipping factors, the fused convolution norms),
their addresses (``data_ptr()``) with sizes and dtype flags: a NumPy view costs four
dispatcher calls. The wrappers here make operands contiguous, allocate the outputs and
check what the C++ side relies on; other dtypes go through float32.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from fastdp import _C, ops

BINDINGS = 3  # csrc/module.cpp's number: a stale build (source updated, not rebuilt) is refused
_USED = ("noisy_average", "rows_sq_norms", "outer_sq_norms", "total_sq_norms", "clip_factors", "linear_sq_norms_ghost",
         "linear_sq_norms_direct", "embedding_sq_norms", "conv2d_sq_norms", "group_norm_backward")
_MISSING = [name for name in _USED if not hasattr(_C, name)]
if getattr(_C, "BINDINGS", None) != BINDINGS or _MISSING:
    raise ImportError(f"fastdp._C ({getattr(_C, '__file__', '?')}) was built from other sources (its bindings "
                      f"{getattr(_C, 'BINDINGS', '< 2')}, these sources' {BINDINGS}"
                      f"{'; missing ' + ', '.join(_MISSING) if _MISSING else ''}): rebuild it "
                      "(pip install --no-build-isolation -e . or python setup.py build_ext --inplace)")

# Measured crossover of the native ghost norm against torch.bmm (1 and 2 threads, float32,
# d, p from 16 to 784): 0.7-1.2x at T = 8, 1.6-2.0x at T = 16.
GHOST_MIN_SEQ = 16

_FLOAT32_MAX = ops.FLOAT32_NORMAL_RANGE[1]


@ops.register("noisy_average", "native", "cpu")
def noisy_average(sums: Sequence[torch.Tensor], std: float, divisor: float, seed: int,
                  inplace: bool = False) -> List[torch.Tensor]:
    """Fused ``(s + std z) / divisor`` for all tensors in one parallel pass (Philox stream k = list position),
    in float32: float64 sums are refused (``ops.noisy_average`` gives them float64 normals). In place, the
    kernel writes over the (contiguous float32) sums: no fresh pages to fault in."""
    ops.check_float32_sums(sums)
    if std == 0:
        return [s.div_(divisor) if inplace and s.is_contiguous() else s / divisor for s in sums]  # not an expanded one
    srcs = [ops.kernel_operand(s) for s in sums]
    outs = srcs if inplace else [torch.empty_like(s) for s in srcs]
    divide_after = 1.0 / divisor > _FLOAT32_MAX  # the kernel's float32 reciprocal would be Inf
    _C.noisy_average([s.data_ptr() for s in srcs], [o.data_ptr() for o in outs], [s.numel() for s in srcs],
                     float(std), 1.0 if divide_after else float(divisor), seed & (2**64 - 1))
    if divide_after:
        for o in outs:
            o.div_(divisor)
    return ops.in_input_dtypes(outs, sums)


@ops.register("sample_sq_norms", "native", "cpu")
def sample_sq_norms(x: torch.Tensor) -> torch.Tensor:
    """One pass over the rows of ``x`` viewed as (B, -1), each summed in float64."""
    x = ops.kernel_operand(x)
    out = torch.empty(x.shape[0], dtype=torch.float64)
    _C.rows_sq_norms(x.data_ptr(), x.shape[0], x.numel() // max(1, x.shape[0]), x.dtype == torch.float64,
                     out.data_ptr())
    return out


@ops.register("outer_sq_norms", "native", "cpu")
def outer_sq_norms(a: torch.Tensor, g: torch.Tensor):
    """Both row norms in one call, each row summed in float64."""
    dtype = ops.kernel_dtype(a, g)
    a, g = ops.kernel_operand(a, dtype), ops.kernel_operand(g, dtype)
    if a.dim() != 2 or g.dim() != 2 or a.shape[0] != g.shape[0]:
        raise ValueError(f"outer_sq_norms: expected a (B, d) and g (B, p), got {tuple(a.shape)}, {tuple(g.shape)}")
    weight, bias = torch.empty(2, a.shape[0], dtype=torch.float64)
    _C.outer_sq_norms(a.data_ptr(), g.data_ptr(), a.shape[0], a.shape[1], g.shape[1], dtype == torch.float64,
                      weight.data_ptr(), bias.data_ptr())
    return weight, bias


@ops.register("total_sq_norms", "native", "cpu")
def total_sq_norms(parts: Sequence[torch.Tensor]):
    """One pass over the float64 parts, summed in order; the finiteness of every sum, exactly."""
    parts = [ops.kernel_operand(t, torch.float64) for t in parts]
    batch = parts[0].shape[0]
    if any(t.shape != (batch,) for t in parts):
        raise ValueError(f"total_sq_norms: every part must be ({batch},), got {[tuple(t.shape) for t in parts]}")
    total = torch.empty(batch, dtype=torch.float64)
    return total, _C.total_sq_norms([t.data_ptr() for t in parts], batch, total.data_ptr())


@ops.register("clip_factors", "native", "cpu")
def clip_factors(total: torch.Tensor, bound: float, scale: float, offset: float, clamp: bool) -> torch.Tensor:
    total = ops.kernel_operand(total, torch.float64)
    out = torch.empty_like(total)
    _C.clip_factors(total.data_ptr(), total.numel(), float(bound), float(scale), float(offset), bool(clamp),
                    out.data_ptr())
    return out


@ops.register("embedding_sq_norms", "native", "cpu")
def embedding_sq_norms(ids: torch.Tensor, g: torch.Tensor, padding_idx) -> torch.Tensor:
    """Per-sample sort of the ids and segment sums of ``g`` rows in float64, OpenMP over samples."""
    g = ops.kernel_operand(g.reshape(ids.shape[0], ids.shape[1], g.shape[-1]))
    out = torch.empty(ids.shape[0], dtype=torch.float64)
    _C.embedding_sq_norms(ids.detach().to(torch.int64).contiguous().numpy(), g.numpy(),
                          padding_idx is not None, -1 if padding_idx is None else int(padding_idx), out.numpy())
    return out


def _linear_operands(a: torch.Tensor, g: torch.Tensor):
    """``a``, ``g`` detached in one float32/float64 dtype, strides kept (the kernels read any
    layout, so no contiguous copy), and the float64 ``(B,)`` output."""
    dtype = ops.kernel_dtype(a, g)
    a, g = a.detach().to(dtype), g.detach().to(dtype)
    return a.numpy(), g.numpy(), torch.empty(a.shape[0], dtype=torch.float64)


@ops.register("linear_sq_norms_ghost", "native", "cpu")
def linear_sq_norms_ghost(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Tiled ghost norm: 64 x 64 Gram tiles of the upper triangle, multiplied and reduced at once.
    Below GHOST_MIN_SEQ rows per sample the tiles are mostly padding and the batched-Gram
    reference is faster (T = 1, an MLP layer: 0.05-0.4x the reference's speed), so it runs."""
    if a.shape[1] < GHOST_MIN_SEQ:
        return ops.linear_sq_norms_ghost_ref(a, g)
    return linear_sq_norms_ghost_kernel(a, g)


def linear_sq_norms_ghost_kernel(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The C++ tiled ghost norm at any T (the tests call it directly)."""
    a_np, g_np, out = _linear_operands(a, g)
    _C.linear_sq_norms_ghost(a_np, g_np, out.numpy())
    return out


@ops.register("linear_sq_norms_direct", "native", "cpu")
def linear_sq_norms_direct(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Tiled ``g_i^T a_i``: 64 x 64 tiles accumulated over T and square-summed at once."""
    a_np, g_np, out = _linear_operands(a, g)
    _C.linear_sq_norms_direct(a_np, g_np, out.numpy())
    return out


# Largest unfolded sample (d x T elements, what the ghost route copies into per-thread
# scratch) the fused convolution kernel takes; beyond it (large images) the rule's composed
# routes run.
CONV_MAX_UNFOLDED = 1 << 22


@ops.register("conv_sq_norms", "native", "cpu")
def conv_sq_norms(x: torch.Tensor, g: torch.Tensor, spec, ghost: bool, keep_grads: bool = False,
                  bias_grads: bool = False, input_weight: Optional[torch.Tensor] = None):
    """1-D and 2-D convolutions: each sample's input is split by stride phase into per-thread
    scratch, whose patch rows the ghost tiles copy and the direct tiles read in place, so the
    batch's unfolded input is never stored;
    the direct route writes the per-sample gradients only when ``keep_grads``, either route
    the bias's when ``bias_grads`` and the input gradient when given ``input_weight`` (from
    the same read of g). ``None`` (composed routes) for 3-D convolutions, and where a norm
    came out NaN or Inf: the wide layout multiplies zero output gradients by input columns no
    output reads, which gives NaN where such a column holds NaN or Inf."""
    nd = x.dim() - 2
    if nd not in (1, 2):
        return None
    kernel, stride, padding, dilation = spec.kernel, spec.stride, spec.padding, spec.dilation
    if nd == 1:  # a 1-D convolution as height 1
        kernel, stride, padding, dilation = [1, *kernel], [1, *stride], [0, *padding], [1, *dilation]
    if x.shape[1] // spec.groups * kernel[0] * kernel[1] * math.prod(g.shape[2:]) > CONV_MAX_UNFOLDED:
        return None
    dtype = ops.kernel_dtype(x, g)
    x4, g4 = (ops.kernel_operand(t, dtype) for t in (x, g))
    if nd == 1:
        x4, g4 = x4.unsqueeze(2), g4.unsqueeze(2)
    out = torch.empty(x.shape[0], dtype=torch.float64)
    grads = None
    if keep_grads and not ghost:  # written per group transposed, (B, groups, d, p): see conv2d_sq_norms
        cin = x.shape[1] // spec.groups
        grads = torch.empty(x.shape[0], spec.groups, cin * math.prod(spec.kernel), g.shape[1] // spec.groups,
                            dtype=dtype)
    bias = torch.empty(g.shape[0], g.shape[1], dtype=dtype) if bias_grads else None
    weight = None if input_weight is None else ops.kernel_operand(input_weight, dtype)
    if weight is not None and tuple(weight.shape) != (g.shape[1], x.shape[1] // spec.groups, *spec.kernel):
        # the kernel reads groups x d x p floats from its address, whatever the tensor holds
        raise ValueError(f"conv_sq_norms: input_weight of shape {tuple(weight.shape)} is not the convolution's "
                         f"{(g.shape[1], x.shape[1] // spec.groups, *spec.kernel)}")
    grad_input = None if weight is None else torch.empty(x.shape, dtype=dtype)
    finite = _C.conv2d_sq_norms(x4.data_ptr(), g4.data_ptr(), [*x4.shape, *g4.shape[1:]],
                                [spec.groups, *kernel, *stride, *padding, *dilation], dtype == torch.float64, ghost,
                                out.data_ptr(), 0 if grads is None else grads.data_ptr(),
                                0 if bias is None else bias.data_ptr(), 0 if weight is None else weight.data_ptr(),
                                0 if grad_input is None else grad_input.data_ptr())
    if finite is False:  # maybe from input values no output reads (the kernel's wide layout): composed routes
        return None
    if grads is not None:  # (B, C_out, C_in / groups, *kernel): a strided view for one group, else a copy
        shape = (x.shape[0], g.shape[1], cin, *spec.kernel)
        if spec.groups == 1:  # element (i, o, c, *k) of (B, d, p) sits at i d p + (c K + k) p + o
            tap_strides = [math.prod(spec.kernel[j + 1:]) * g.shape[1] for j in range(len(spec.kernel))]
            grads = grads.as_strided(shape, (grads.stride(0), 1, math.prod(spec.kernel) * g.shape[1], *tap_strides))
        else:
            grads = grads.transpose(2, 3).reshape(shape)
    return out, grads, bias, grad_input


@ops.register("group_norm_backward", "native", "cpu")
def group_norm_backward(g, x, mean, rstd, weight, groups: int, input_grad: bool):
    """One pass per (sample, group): the per-channel sums give the per-sample gradients and
    the input gradient, which is written while the group is still in cache."""
    dtype = ops.kernel_dtype(x, g)
    n, c = x.shape[:2]
    x3, g3 = (ops.kernel_operand(t.reshape(n, c, -1), dtype) for t in (x, g))
    mean, rstd = (ops.kernel_operand(t, dtype) for t in (mean, rstd))
    gamma = None if weight is None else ops.kernel_operand(weight, dtype).numpy()
    grad_x = torch.empty_like(g3) if input_grad else None
    dgamma, dbeta = torch.empty(n, c, dtype=dtype), torch.empty(n, c, dtype=dtype)
    _C.group_norm_backward(x3.numpy(), g3.numpy(), mean.numpy(), rstd.numpy(), gamma, groups,
                           None if grad_x is None else grad_x.numpy(), dgamma.numpy(), dbeta.numpy())
    if grad_x is not None:
        grad_x = grad_x.view(g.shape).to(g.dtype)
    return grad_x, dgamma, dbeta
