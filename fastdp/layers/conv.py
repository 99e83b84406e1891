"""``nn.Conv1d/2d/3d`` with any stride, padding (int, tuple, "same", "valid", non-zero
padding modes), dilation and groups (depthwise included).

Padding that is not a symmetric zero pad is applied with ``F.pad`` before the hooked
convolution, so autograd carries the input gradient through it and the rule only sees
``padding`` as explicit zeros.

Per-sample weight gradients, per group g: ``G_i = g_i^T a_i`` where ``a_i`` is the unfolded
input (T = output positions, d = C_in/groups * prod(kernel)) and ``g_i`` the output gradient
(p = C_out/groups). A grouped weight is block diagonal, so the norm is taken per group and
summed; never as one dense matrix. Two routes, whose costs are estimated as for Linear
(``route_costs``):

* direct: all per-sample gradients at once as ONE grouped convolution backward, the batch
  folded into the group dimension; no unfold;
* ghost: unfold (``prod(kernel)`` times the input) and the linear ghost norm per group.

Where the estimates are within ``AUTOTUNE_WITHIN`` of each other, the first calls of each
shape time the candidates (both routes, fused or composed, keeping the per-sample gradients
or not) and remember the fastest (``_time_routes``); ``AUTOTUNE = False`` takes the cheaper
estimate instead.

Where a backend has a fused kernel for the call (``ops.conv_sq_norms``: C++ on CPU for 1-D
and 2-D convolutions), either route runs in it instead, one sample's patches at a time,
and may write the layer's input gradient from the same read of g (where timing found that
faster than aten's). The clipped sum is then one weight-gradient convolution on
coefficient-scaled ``x`` or ``g``, except where the direct route kept the per-sample
gradients (where they are small, or where timing found keeping them faster).
"""
from __future__ import annotations

import functools
import math
import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fastdp import ops
from fastdp.layers import register
from fastdp.layers.base import (LayerRule, Record, Tap, as_dtype, batch_chunks, check_batched, expand_like,
                                tf32_in_use, weighted_sum, with_gram_allowance, with_rounding_allowance)
from fastdp.layers.linear import route_costs
from fastdp.ops import sample_sq_norms

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


# Routes for a convolution's weight norms: "ghost" and "direct" run in the fused kernel
# (ops.conv_sq_norms) where a backend has one and in composed PyTorch ops otherwise; beside
# a fused kernel, "instantiate" is the composed direct route and "direct-keep" the fused
# direct route keeping its per-sample gradients. Composed direct keeps them for the clipped
# sum (a weighted sum), as fused direct does where they are no larger than x and g; the
# other routes pay one more weight-gradient convolution. "direct-keep" is offered (to the
# timing below) where the kept gradients hold at most KEEP_LIMIT times the elements of x
# and g, which the kept route frees early.
#
# A fused route may also write the input gradient (where the layer's input needs one): a
# transposed convolution from the g it already read, in place of aten's. A choice is a pair
# (route, fused input gradient).
#
# The cost model is only a rough guide (grouped convolutions with many channels and few
# positions run far below peak, the fused kernel's speed depends on the geometry). Where
# more than one choice is plausible, the first call with a new geometry times each with the
# clipped sum and the input gradient it leaves to do and remembers the fastest (elsewhere
# the one plausible choice). The key holds every dimension except the batch (costs scale
# linearly in it): a new image size is a new key, so no decision goes stale. AUTOTUNE=False
# always follows the cost model and leaves the input gradient to aten.
AUTOTUNE = True
AUTOTUNE_WITHIN = 4.0  # both flop routes are plausible where their estimates are this close
KEEP_LIMIT = 4.0
# A fused input gradient is chosen only where its timed choice is faster by this factor:
# timed alone, close calls (stride-1 layers with many channels, where aten's is near peak)
# came out either way from run to run, and inside a step the fused kernel shares the caches.
FUSED_INPUT_EDGE = 1.1
TIMED_RUNS = 5
_FASTEST_ROUTE: Dict[tuple, Tuple[str, bool]] = {}


class InputGradRequest:
    """Passed from the Function's backward to the rule where the layer's input needs a
    gradient: the ``weight`` it takes, and the gradient once a fused route wrote it
    (``None``: aten computes it)."""

    __slots__ = ("weight", "grad")

    def __init__(self, weight: torch.Tensor):
        self.weight: torch.Tensor = weight
        self.grad: Optional[torch.Tensor] = None


def _time_routes(key, choices: List[Tuple[str, bool]], run: Callable[[Tuple[str, bool]], torch.Tensor],
                 weight_sum: Callable[[], object], input_grad: Optional[Callable[[], object]],
                 rec: Record) -> torch.Tensor:
    """Run each choice TIMED_RUNS times, in turns (the first run pays one-off allocations,
    the best of the others resists a busy machine) and keep the fastest, counting what each
    leaves to do: the clipped sum, ``weight_sum`` (a weight-gradient convolution) after
    routes that keep no per-sample gradients and a weighted sum of the kept ones after the
    others; and aten's ``input_grad`` where the input gradient is wanted and the route did
    not write it. A choice that wrote the input gradient counts FUSED_INPUT_EDGE times its time."""
    def timed(fn):
        _wait_for_device(rec)
        start = time.perf_counter()
        out = fn()
        _wait_for_device(rec)
        return out, time.perf_counter() - start

    request: Optional[InputGradRequest] = rec.activation[2]
    sum_time = min(timed(weight_sum)[1] for _ in range(2))
    input_time = min(timed(input_grad)[1] for _ in range(2)) if input_grad is not None else 0.0
    fastest, result = math.inf, None  # the fastest run so far and what it left (one run's tensors held)
    for choice in choices * TIMED_RUNS:
        rec.cache.pop("weight", None)
        if request is not None:
            request.grad = None
        out, elapsed = timed(lambda: run(choice))
        kept = rec.cache.get("weight")
        if kept is None:
            elapsed += sum_time
        else:
            ones = kept.new_ones(kept.shape[0])
            elapsed += min(timed(lambda: weighted_sum(ones, kept))[1] for _ in range(2))
        grad_input = None if request is None else request.grad
        if request is not None and grad_input is None:
            elapsed += input_time
        elif grad_input is not None:
            elapsed *= FUSED_INPUT_EDGE
        if elapsed < fastest:
            fastest, result = elapsed, (choice, out, kept, grad_input)
        del out, kept, grad_input
    choice, out, kept, grad_input = result
    _FASTEST_ROUTE[key] = choice
    rec.cache.pop("weight", None)
    if kept is not None:
        rec.cache["weight"] = kept
    if request is not None:
        request.grad = grad_input
    return out


def _kept_ratio(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> float:
    """Elements of the per-sample weight gradients over those of x and g (which keeping the
    gradients frees early)."""
    return x.shape[0] * weight.numel() / max(1, x.numel() + g.numel())


def _wait_for_device(rec: Record) -> None:
    """Wait for queued GPU work, so a host clock times the kernels rather than their launch."""
    if rec.grad_output is not None and rec.grad_output.is_cuda:
        torch.cuda.synchronize(rec.grad_output.device)


class ConvSpec:
    """Geometry of one hooked convolution call (padding already explicit and symmetric)."""

    __slots__ = ("stride", "padding", "dilation", "groups", "kernel")

    def __init__(self, stride, padding, dilation, groups, kernel):
        self.stride, self.padding, self.dilation = list(stride), list(padding), list(dilation)
        self.groups, self.kernel = groups, list(kernel)

    def key(self) -> tuple:
        return (*self.stride, *self.padding, *self.dilation, self.groups, *self.kernel)


def _convolution_backward(grad_out, x, weight, spec: ConvSpec, groups, mask):
    """aten's convolution backward. ``weight``: a tensor, or only its shape where just the
    weight gradient is asked for (its values are then never read)."""
    if not isinstance(weight, torch.Tensor):
        weight = grad_out.new_empty(1).expand(*weight)
    return torch.ops.aten.convolution_backward(
        _plain_strides(grad_out), _plain_strides(x), weight, None, spec.stride, spec.padding, spec.dilation,
        False, [0] * len(spec.stride), groups, mask,
    )


def _plain_strides(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied where it counts as contiguous but a size-1 dimension has another stride (a
    transposed one-token sequence): aten's slow convolution backward refuses such a tensor."""
    if not t.is_contiguous():
        return t
    stride, plain = 1, []
    for n in reversed(t.shape):
        plain.append(stride)
        stride *= n
    return t if t.stride() == tuple(reversed(plain)) else torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _aten_input_grad(grad_out, x, weight, spec: ConvSpec) -> torch.Tensor:
    """aten's input gradient, in ``grad_out``'s dtype (under autocast x may be float32 while
    grad_out is bfloat16: one dtype for aten)."""
    dtype = grad_out.dtype
    return _convolution_backward(grad_out, as_dtype(x, dtype), as_dtype(weight, dtype), spec, spec.groups,
                                 [True, False, False])[0]


class _ConvFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, spec: ConvSpec, tap):
        ctx.save_for_backward(x, weight)
        ctx.spec, ctx.tap = spec, tap
        conv = _CONV_FN[x.dim() - 2]
        return conv(x, weight, bias, spec.stride, spec.padding, spec.dilation, spec.groups)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        request = InputGradRequest(weight) if ctx.needs_input_grad[0] else None
        ctx.tap.fire(ctx, (x, ctx.spec, request), grad_out)
        grad_x = None
        if request is not None:
            grad_x, request.grad = request.grad, None
            if grad_x is None:
                grad_x = _aten_input_grad(grad_out, x, weight, ctx.spec)
            else:
                grad_x = as_dtype(grad_x, grad_out.dtype)
        return grad_x, None, None, None, None


def _same_padding(module) -> Tuple[List[int], List[int]]:
    """(left, right) zero padding per spatial dim that PyTorch's padding='same' applies."""
    total = [d * (k - 1) for d, k in zip(module.dilation, module.kernel_size)]
    left = [t // 2 for t in total]
    return left, [t - l for t, l in zip(total, left)]


@functools.lru_cache(maxsize=64)
def _read_mask(size: Tuple[int, ...], key: tuple, device: torch.device) -> Optional[torch.Tensor]:
    """Boolean (*size) mask of the input elements some output of the convolution ``key``
    (``ConvSpec.key()``) reads; None where it reads them all (stride <= kernel's reach, no tail)."""
    nd = len(size)
    stride, padding, dilation, kernel = key[:nd], key[nd:2 * nd], key[2 * nd:3 * nd], key[3 * nd + 1:]
    per_dim = []
    for n, s, p, d, k in zip(size, stride, padding, dilation, kernel):
        taps = torch.arange(-p, n + p - d * (k - 1), s).unsqueeze(1) + d * torch.arange(k)  # (outputs, k)
        read = torch.zeros(n, dtype=torch.bool)
        read[taps[(taps >= 0) & (taps < n)]] = True
        per_dim.append(read)
    if all(bool(r.all()) for r in per_dim):
        return None
    mask = per_dim[0]
    for r in per_dim[1:]:
        mask = mask.unsqueeze(-1) & r
    return mask.to(device)


def _unfold(x: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """(B, C, *S) -> (B, C * prod(k), T): patches as columns (im2col for 2-D, an identity
    convolution for any spatial rank)."""
    batch, channels = x.shape[:2]
    if len(spec.kernel) == 2:
        return F.unfold(x, spec.kernel, spec.dilation, spec.padding, spec.stride)
    nk = math.prod(spec.kernel)
    eye = torch.eye(nk, dtype=x.dtype, device=x.device).view(nk, 1, *spec.kernel)
    cols = _CONV_FN[len(spec.kernel)](
        x.reshape(batch * channels, 1, *x.shape[2:]), eye, None, spec.stride, spec.padding, spec.dilation
    )
    return cols.reshape(batch, channels * nk, -1)


class ConvRule(LayerRule):
    module_types = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

    def forward(self, module, tap: Tap, x: torch.Tensor) -> torch.Tensor:
        nd = len(module.kernel_size)
        check_batched(module, x, nd)
        padding = module.padding
        if module.padding_mode != "zeros":
            x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
            padding = [0] * nd
        elif padding == "valid":
            padding = [0] * nd
        elif padding == "same":
            left, right = _same_padding(module)
            if left != right:
                pads = [v for l, r in zip(reversed(left), reversed(right)) for v in (l, r)]
                x = F.pad(x, pads)
                left = [0] * nd
            padding = left
        spec = ConvSpec(module.stride, padding, module.dilation, module.groups, module.kernel_size)
        return _ConvFn.apply(x, module.weight, module.bias, spec, tap)

    # -- per-sample math ---------------------------------------------------------------
    @staticmethod
    def _operands(rec: Record):
        """The recorded input x, its ConvSpec and the weight (the module's own where it is frozen:
        its shape is still needed)."""
        x, spec = rec.activation[:2]
        return x, spec, rec.params.get("weight", rec.module.weight)

    @staticmethod
    def _linear_dims(g: torch.Tensor, spec: ConvSpec, weight: torch.Tensor):
        """Each group's convolution as a linear layer: (T positions, d patch elements, p outputs)."""
        return math.prod(g.shape[2:]), weight.shape[1] * math.prod(spec.kernel), weight.shape[0] // spec.groups

    def _per_sample_weight(self, x, g, spec: ConvSpec, weight_shape) -> torch.Tensor:
        """(B, C_out, C_in/groups, *k) per-sample weight gradients via one grouped conv backward."""
        batch = x.shape[0]
        c_out = weight_shape[0]
        if batch == 0:
            return g.new_zeros(0, *weight_shape)
        folded = _convolution_backward(
            g.reshape(1, batch * c_out, *g.shape[2:]),
            x.to(g.dtype).reshape(1, batch * x.shape[1], *x.shape[2:]),
            (batch * c_out, *weight_shape[1:]), spec, batch * spec.groups, [False, True, False],
        )[1]
        return folded.view(batch, *weight_shape)

    @staticmethod
    def _ghost_sq_norms(x, g, spec: ConvSpec, d: int, p: int, seq: int) -> torch.Tensor:
        """Unfold, then the Gram-matrix norm per group, summed over groups."""
        groups, batch, out = spec.groups, x.shape[0], []
        for c in batch_chunks(batch, groups * (d * seq + 2 * seq * seq)):
            cols = _unfold(x[c].to(g.dtype), spec)  # (b, C_in * prod(k), T)
            b = cols.shape[0]
            a = cols.view(b * groups, d, seq).transpose(1, 2)
            gg = g[c].reshape(b * groups, p, seq).transpose(1, 2)
            out.append(ops.linear_sq_norms_ghost(a, gg).view(b, groups).sum(1))
        return torch.cat(out)

    def _direct_sq_norms(self, rec: Record, x, g, spec: ConvSpec, weight_shape) -> torch.Tensor:
        """Instantiated per-sample gradients; kept for clipped_sums when the batch is one chunk."""
        out = []
        for c in batch_chunks(x.shape[0], math.prod(weight_shape)):
            psg = self._per_sample_weight(x[c], g[c], spec, weight_shape)
            if c.start == 0 and c.stop == x.shape[0]:
                rec.cache["weight"] = psg  # reused by clipped_sums: no second convolution
            out.append(sample_sq_norms(psg))
        return torch.cat(out)

    def _weight_sq_norms(self, rec: Record) -> torch.Tensor:
        x, spec, weight = self._operands(rec)
        g = rec.grad_output
        if x.shape[0] == 0:
            return g.new_zeros(0, dtype=torch.float64)
        backend = ops.implementation("conv_sq_norms", x.device)[0]
        request: Optional[InputGradRequest] = rec.activation[2]
        fused_input = request is not None and backend != "reference"  # no fused kernel in the reference
        key = (tuple(x.shape[1:]), tuple(weight.shape), spec.key(), x.dtype, x.device.type, backend, fused_input)
        choice = _FASTEST_ROUTE.get(key) if AUTOTUNE else None
        if choice is not None:
            return self._route(*choice, rec)
        ghost_cost, direct_cost = route_costs(*self._linear_dims(g, spec, weight))
        if not AUTOTUNE:
            return self._route("ghost" if ghost_cost < direct_cost else "direct", False, rec)
        routes = ["ghost", "direct"]
        if backend != "reference":  # without a fused kernel "direct" already is "instantiate"
            routes.append("instantiate")
            if 1 < _kept_ratio(x, g, weight) <= KEEP_LIMIT:
                routes.append("direct-keep")
        if ghost_cost * AUTOTUNE_WITHIN < direct_cost:
            routes = ["ghost"]
        elif direct_cost * AUTOTUNE_WITHIN < ghost_cost:
            routes.remove("ghost")
        choices = [(r, False) for r in routes] + [(r, True) for r in routes if fused_input and r != "instantiate"]
        if len(choices) == 1:
            _FASTEST_ROUTE[key] = choices[0]
            return self._route(*choices[0], rec)
        weight_sum = lambda: _convolution_backward(g, x.to(g.dtype), weight.shape, spec, spec.groups,  # noqa: E731
                                                   [False, True, False])
        input_grad = (lambda: _aten_input_grad(g, x, weight, spec)) if fused_input else None
        return _time_routes(key, choices, lambda choice: self._route(*choice, rec), weight_sum, input_grad, rec)

    def _route(self, name: str, fused_input: bool, rec: Record) -> torch.Tensor:
        """The weight norms by route ``name``; "direct" keeps the per-sample gradients where
        they are no larger than x and g, "direct-keep" always, "instantiate" (composed) too.
        With ``fused_input`` a fused route also writes the input gradient to the request."""
        x, spec, weight = self._operands(rec)
        g = rec.grad_output
        if name != "instantiate":
            ghost = name == "ghost"
            keep = name == "direct-keep" or (name == "direct" and _kept_ratio(x, g, weight) <= 1)
            request: Optional[InputGradRequest] = rec.activation[2] if fused_input else None
            fused = ops.conv_sq_norms(x, g, spec, ghost, keep_grads=keep, bias_grads="bias" in rec.params,
                                      input_weight=None if request is None else request.weight)
            seq, d, p = self._linear_dims(g, spec, weight)
            if fused is not None:
                norms, grads, bias, grad_input = fused
                for param, kept in (("weight", grads), ("bias", bias)):
                    if kept is not None:
                        rec.cache[param] = kept
                if request is not None:
                    request.grad = grad_input
            else:
                norms = self._ghost_sq_norms(x, g, spec, d, p, seq) if ghost else None
            if ghost:
                return with_gram_allowance(norms, self._slack(rec), d + p + 2 * seq * seq)
            if norms is not None:
                return norms
        return self._direct_sq_norms(rec, x, g, spec, weight.shape)

    def prepare(self, rec: Record) -> None:
        """Find the weight norms during backward; where that instantiated the per-sample
        gradients, keep only them (and the bias's) and free the input and output gradient."""
        if "weight" in rec.names:
            rec.norms["weight"] = self._weight_sq_norms(rec)
            if "weight" not in rec.cache:  # the clipped sum is one convolution over all positions: needs x and g
                rec.norms["weight"] = self._with_rounding_allowance(rec, rec.norms["weight"])
                return
        if "bias" in rec.names:
            self.cached_grads(rec, ["bias"])
        rec.release()

    def _slack(self, rec: Record) -> torch.Tensor:
        """A bound on ``sum_t |a_t| |g_t|`` over positions and groups (a_t a patch): each input element
        is in at most prod(kernel) patches, so by Cauchy-Schwarz ``sqrt(prod(kernel)) |x_i| |g_i|``, x_i
        taken over the elements some patch reads where the whole input is not finite (a NaN where no output
        looks is no part of the gradient; elsewhere the whole input's norm, a looser bound, saves a pass)."""
        x, spec, _ = self._operands(rec)
        read = _read_mask(tuple(x.shape[2:]), spec.key(), x.device)
        x_sq = None if read is not None and x.is_cuda else sample_sq_norms(x)  # no host sync on a GPU
        if read is not None and (x_sq is None or not bool(torch.isfinite(x_sq).all())):
            x_sq = sample_sq_norms(x.masked_fill(~read, 0))
        return (x_sq * sample_sq_norms(rec.grad_output)).sqrt_().mul_(math.sqrt(math.prod(spec.kernel)))

    def _with_rounding_allowance(self, rec: Record, sq_norms: torch.Tensor) -> torch.Tensor:
        """:func:`with_rounding_allowance` for the weight's clipped-sum convolution."""
        _, spec, weight = self._operands(rec)
        g = rec.grad_output
        return with_rounding_allowance(sq_norms, self._slack(rec), self._linear_dims(g, spec, weight)[0], g.dtype,
                                       g.is_cuda and tf32_in_use("conv"))

    def per_sample_grads(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        x, spec, weight = self._operands(rec)
        g = rec.grad_output
        out = {}
        for name in names:
            if name == "weight":
                out[name] = self._per_sample_weight(x, g, spec, weight.shape)
            else:
                out[name] = g.flatten(2).sum(2)
        return out

    def clipped_sums(self, rec: Record, coefs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        out = {}
        for name, coef in coefs.items():
            if name in rec.cache or name == "bias":
                out[name] = weighted_sum(coef, self.cached_grads(rec, [name])[name])
            else:  # one weight-gradient convolution, the smaller of x and g scaled per sample
                x, spec, weight = self._operands(rec)
                g = rec.grad_output
                x = x.to(g.dtype)
                if x.numel() < g.numel():
                    x = x * expand_like(coef, x)
                else:
                    g = g * expand_like(coef, g)
                out[name] = _convolution_backward(g, x, weight.shape, spec, spec.groups, [False, True, False])[1]
        return out


register(ConvRule())
