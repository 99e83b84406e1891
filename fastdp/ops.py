"""Kernel dispatch: every hot operation of the engine goes through this module.

Each operation has a pure-PyTorch *reference* implementation here. Faster
implementations (C++ CPU kernels in ``fastdp._C``, Triton kernels in ``kernels/``)
register themselves with :func:`register` for a backend name and a device type.

Backend choice, per call, by the tensor's device:

* ``FASTDP_BACKEND=reference`` forces the references (tests, bisecting);
* ``FASTDP_BACKEND=native`` / ``triton`` prefers that backend where it has the op;
* unset (``auto``): CUDA tensors use ``triton``, then ``native`` (CUDA C++ through
  ``fastdp._cuda_ops``); CPU tensors use ``native`` (C++ in ``fastdp._C``); a backend
  missing the op, or registered ``auto=False`` for it, is passed over for the next in that
  order, and the reference runs where none is left.

Conventions shared by all implementations:

* ``a``: activations ``(B, T, d)``; ``g``: output gradients ``(B, T, p)``.
* Squared norms are returned as float64 tensors of shape ``(B,)``, each square formed and
  summed in float64 (a float32 square overflows past 1.8e19, and a float32 sum of them
  would turn a finite sample's norm into Inf): never sum squares in float32 here.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from fastdp.callers import user_stacklevel

BACKENDS = ("reference", "native", "triton")
_REGISTRY: Dict[str, Dict[Tuple[str, str], Callable]] = {}
_FORCED_ONLY: set = set()  # (op, backend, device_type) used only when FASTDP_BACKEND names it
_CHOICES: Dict[tuple, Tuple[str, Callable]] = {}  # (op, device type, FASTDP_BACKEND) -> implementation
_AUTO_ORDER = {"cuda": ("triton", "native"), "cpu": ("native",)}
_BACKEND_MODULES = {"native": ("fastdp._native_ops", "fastdp._cuda_ops"), "triton": ("kernels.dispatch",)}


def register(op: str, backend: str, device_type: str, auto: bool = True):
    """Decorator registering ``fn`` as ``backend``'s implementation of ``op`` on ``device_type``.

    ``auto=False`` keeps it out of the default choice (a kernel not measured to beat the
    reference there); ``FASTDP_BACKEND=<backend>`` still selects it.
    """
    if backend not in BACKENDS or backend == "reference":
        raise ValueError(f"unknown backend {backend!r}; expected 'native' or 'triton'")

    def decorate(fn: Callable) -> Callable:
        _REGISTRY.setdefault(op, {})[(backend, device_type)] = fn
        _CHOICES.clear()
        if auto:
            _FORCED_ONLY.discard((op, backend, device_type))
        else:
            _FORCED_ONLY.add((op, backend, device_type))
        return fn

    return decorate


def selected_backend() -> str:
    """The backend forced by ``FASTDP_BACKEND`` (``"auto"`` when unset)."""
    name = os.environ.get("FASTDP_BACKEND", "auto").strip().lower() or "auto"
    if name not in BACKENDS + ("auto",):
        raise ValueError(
            f"FASTDP_BACKEND={name!r} is not one of {', '.join(BACKENDS + ('auto',))}"
        )
    return name


_backends_loaded = False
_DEFAULT_MODULES = ("fastdp._native_ops",)  # built by pip install: missing, the CPU default is gone
_LOAD_ERRORS: Dict[str, List[str]] = {}  # backend -> its modules that failed to import, with why
_WARNED: set = set()


def _load_backends() -> None:
    """Import the optional backends once; each registers what it implements. A failure warns
    once where it changes what runs by default (the C++ extension) or, when forced, that backend."""
    global _backends_loaded
    if _backends_loaded:
        return
    _backends_loaded = True
    for backend, modules in _BACKEND_MODULES.items():
        for module in modules:
            try:
                __import__(module)
            except Exception as exc:  # a missing or broken optional backend is not fatal
                _LOAD_ERRORS.setdefault(backend, []).append(f"{module} ({type(exc).__name__}: {exc})")
                if module in _DEFAULT_MODULES:
                    _warn_unavailable(backend)


def _warn_unavailable(backend: str) -> None:
    if backend in _WARNED or backend not in _LOAD_ERRORS:
        return
    _WARNED.add(backend)
    # by module: the native backend's CPU kernels still run where only its CUDA library is missing
    warnings.warn(f"fastdp: {backend} kernels are unavailable from {'; '.join(_LOAD_ERRORS[backend])}; the "
                  "operations those modules implement use the PyTorch references (correct, slower)",
                  RuntimeWarning, stacklevel=user_stacklevel())


def implementation(op: str, device: torch.device) -> Tuple[str, Callable]:
    """Return ``(backend name, function)`` that will run ``op`` on ``device`` (remembered per
    op, device type and ``FASTDP_BACKEND`` value until the next :func:`register`)."""
    key = (op, device.type, os.environ.get("FASTDP_BACKEND"))
    choice = _CHOICES.get(key)
    if choice is None:
        choice = _CHOICES[key] = _choose(op, device.type)
    return choice


def _choose(op: str, device_type: str) -> Tuple[str, Callable]:
    forced = selected_backend()
    if forced != "reference":
        _load_backends()
        if forced != "auto":
            _warn_unavailable(forced)
        impls = _REGISTRY.get(op, {})
        order = (forced,) if forced != "auto" else _AUTO_ORDER.get(device_type, ())
        for backend in order:
            fn = impls.get((backend, device_type))
            if fn is not None and (forced != "auto" or (op, backend, device_type) not in _FORCED_ONLY):
                return backend, fn
    return "reference", _REFERENCE[op]


def _call(op: str, device: torch.device, *args, **kwargs):
    return implementation(op, device)[1](*args, **kwargs)


# --------------------------------------------------------------------------- for kernel backends

KERNEL_FLOATS = (torch.float32, torch.float64)  # what the C++ and CUDA kernels compute in


FLOAT32_NORMAL_RANGE = (1.1754943508222875e-38, 3.4028234663852886e38)

# The largest |z| a backend draws: the reference's inverse normal CDF at 2^-53 is 8.21, the kernels'
# Box-Muller reaches 7.35. Noise on a float32 sum, s + std z, is formed before the division, so it
# stays finite only while std is at most float32's max over this.
NORMAL_DRAW_MAX = 8.25
FLOAT32_NOISE_STD_MAX = FLOAT32_NORMAL_RANGE[1] / NORMAL_DRAW_MAX


def check_float32_noise_scalars(std: float, divisor: float) -> None:
    """The GPU noise kernels take ``std`` and ``divisor`` as float32: refuse values float32 would
    turn into 0 or Inf (or hold with lost precision), instead of releasing Inf or unscaled sums."""
    low, high = FLOAT32_NORMAL_RANGE
    if not (low <= divisor <= high and std <= FLOAT32_NOISE_STD_MAX):
        raise ValueError(f"noise std {std!r} or divisor {divisor!r} is outside float32's normal range "
                         f"[{low:.3g}, {high:.3g}] (std at most {FLOAT32_NOISE_STD_MAX:.3g}, where std z stays "
                         "finite), which the GPU noise kernels take them in")


def check_float32_sums(sums: Sequence[torch.Tensor]) -> None:
    """The noise kernels draw float32 normals: refuse a float64 sum, whose low bits would show
    through noise on float32's grid (:func:`noisy_average` gives float64 sums float64 normals)."""
    if any(s.dtype == torch.float64 for s in sums):
        raise ValueError("the noise kernels draw float32 normals, on whose grid a float64 sum's low bits would "
                         "show through the noise: pass float64 sums to fastdp.ops.noisy_average, which gives "
                         "them float64 normals")


def kernel_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The one float dtype a kernel computes ``tensors`` in: their promoted dtype where it is
    float32/float64, else float32."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype != dtype:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype if dtype in KERNEL_FLOATS else torch.float32


def kernel_operand(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Detached, contiguous version of ``t`` in ``dtype`` (default: ``kernel_dtype(t)``), no copy
    when already so. Pass the ``kernel_dtype`` of all of a kernel's operands to give them one."""
    if t.requires_grad:
        t = t.detach()
    dtype = dtype or kernel_dtype(t)
    if t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-sample quantities are computed in: float32 for half precision."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def in_input_dtypes(outs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Each kernel result cast back to its input's dtype (no copy where it already is)."""
    return [o if o.dtype == s.dtype else o.to(s.dtype) for o, s in zip(outs, inputs)]


# --------------------------------------------------------------------------- references


def outer_sq_norms_ref(a: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """A linear layer with one row per sample, ``a`` (B, d) and ``g`` (B, p): float64 (B,)
    squared norms of the per-sample weight gradients ``g_i a_i^T`` (``|a_i|^2 |g_i|^2``) and of
    the bias gradients ``g_i``."""
    g_sq = sample_sq_norms_ref(g)
    return sample_sq_norms_ref(a) * g_sq, g_sq


def total_sq_norms_ref(parts: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, bool]:
    """Per-sample sum of the float64 ``(B,)`` squared norms ``parts``, and whether the sums are
    all finite, from one reduction (a single host sync). The sums are of terms >= 0 (up to a
    rounding below 0 for a ghost norm of ~0) or NaN, so
    ``False`` means some sample's norm is NaN/Inf or the batch's total overflowed."""
    total = torch.stack(list(parts)).sum(0)
    return total, math.isfinite(total.sum().item())


def clip_factors_ref(total: torch.Tensor, bound: float, scale: float, offset: float, clamp: bool) -> torch.Tensor:
    """``bound / (sqrt(total) + offset / scale)``, capped at ``scale`` if ``clamp``: the coefficient
    ``scale * min(1, bound / (scale * sqrt(total) + offset))`` of gradients whose squared norms
    ``total`` were divided by ``scale^2`` (float64 ``(B,)``, a new tensor). A total a rounding
    below 0 (the ghost norm of a sample whose gradient is ~0) counts as 0; NaN stays NaN."""
    coef = total.clamp_min(0.0).sqrt_().add_(offset / scale).reciprocal_().mul_(bound)
    return coef.clamp_(max=scale) if clamp else coef


def squared_norms64(x: torch.Tensor, dims) -> torch.Tensor:
    """Squared L2 norms of ``x`` over ``dims``, squared and summed in float64 (a float32 square
    overflows at 1.8e19: a finite sample would get an infinite norm and be dropped)."""
    return torch.linalg.vector_norm(x, dim=dims, dtype=torch.float64).square_()


def sample_sq_norms_ref(x: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each sample's slice of ``x`` (B, ...), float64 (B,)."""
    return squared_norms64(x.flatten(1), 1)


def linear_sq_norms_ghost_ref(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``sum_{s,t} (a_s . a_t)(g_s . g_t)`` per sample via the two ``T x T`` Gram matrices, in
    float64 whatever the inputs: the terms can cancel to a sum far smaller than they are (a
    sample whose per-position gradients nearly cancel), and Grams rounded in float32 then
    gave norms near 0 or below it, so that sample escaped clipping."""
    a, g = a.double(), g.double()
    gram_a = torch.bmm(a, a.transpose(1, 2))
    gram_g = torch.bmm(g, g.transpose(1, 2))
    return gram_a.mul_(gram_g).sum((1, 2))


def linear_sq_norms_direct_ref(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``||g_i^T a_i||_F^2`` per sample by instantiating the ``(p, d)`` per-sample gradients."""
    dtype = compute_dtype(a.dtype)  # half precision: per-sample gradients overflow float16
    per_sample = torch.bmm(g.to(dtype).transpose(1, 2), a.to(dtype))
    return squared_norms64(per_sample, (1, 2))


def embedding_sq_norms_ref(
    ids: torch.Tensor, g: torch.Tensor, padding_idx: Optional[int]
) -> torch.Tensor:
    """Per-sample squared norm of an embedding's weight gradient.

    ``ids``: ``(B, T)`` token ids, ``g``: ``(B, T, D)``. The gradient of sample i is
    ``sum_t onehot(ids_t) g_t^T``; rows of equal ids add up, so the norm is the sum over
    distinct (sample, id) pairs of ``||sum of their g||^2``. ``padding_idx`` rows get
    no gradient and are excluded. O(B T D).
    """
    batch, seq = ids.shape
    flat_g = g.reshape(batch * seq, g.shape[-1]).to(compute_dtype(g.dtype))  # half: its sums overflow
    sample = torch.arange(batch, device=ids.device).repeat_interleave(seq)
    key = sample * (int(ids.max().item()) + 1 if ids.numel() else 1) + ids.reshape(-1)
    keep = None
    if padding_idx is not None:
        keep = ids.reshape(-1) != padding_idx
        key, flat_g, sample = key[keep], flat_g[keep], sample[keep]
    uniq, inverse = torch.unique(key, return_inverse=True)
    sums = flat_g.new_zeros(uniq.numel(), flat_g.shape[1]).index_add_(0, inverse, flat_g)
    uniq_sample = torch.zeros(uniq.numel(), dtype=torch.long, device=ids.device)
    uniq_sample.scatter_(0, inverse, sample)
    out = torch.zeros(batch, dtype=torch.float64, device=ids.device)
    return out.index_add_(0, uniq_sample, squared_norms64(sums, 1))


def noisy_average_ref(
    sums: Sequence[torch.Tensor], std: float, divisor: float, seed: int, inplace: bool = False
) -> List[torch.Tensor]:
    """``(s + std * z) / divisor`` for every tensor, ``z ~ N(0, I)`` drawn from the 64-bit ``seed``.

    torch's CPU generator (mt19937) keeps only the low 32 bits of a seed, so two generators are
    seeded, one with the seed's low word and one with its high word (xor a constant). Each draws
    one 52-bit integer per element; ``a + 3b`` modulo 2^52 is uniform and independent of either
    draw alone, so two seeds that share one word (among N steps of a run, ~N^2 / 2^32 pairs do)
    still get independent noise; only equal seeds repeat it. The integer ``k`` becomes the
    uniform ``(2k + 1) / 2^53`` in (0, 1) and ``z`` its inverse normal CDF, in float64. Parameters
    draw one after another from the two generators. ``inplace=True`` lets an implementation write
    the result into ``sums`` (which the caller then no longer uses); the returned list is the
    result either way.
    """
    if not sums:
        return []
    low, high = [torch.Generator(device=sums[0].device).manual_seed(word)
                 for word in (seed & 0xFFFFFFFF, ((seed >> 32) ^ 0x9E3779B9) & 0xFFFFFFFF)]
    out = []
    for s in sums:
        write = inplace and s.is_contiguous()  # not into an expanded tensor, whose elements share memory
        wide = s if s.dtype in KERNEL_FLOATS else s.float()  # 16-bit sums in float32, as the kernels
        write = write and wide is s
        if std > 0:
            z = torch.special.ndtri(_uniform53(s.shape, low, high, s.device)).to(wide.dtype)
            noisy = (wide.add_(z, alpha=std) if write else wide.add(z, alpha=std)).div_(divisor)
        else:
            noisy = wide.div_(divisor) if write else wide / divisor
        out.append(noisy if wide is s else (s.copy_(noisy) if inplace and s.is_contiguous() else noisy.to(s.dtype)))
    return out


def _uniform53(shape, low: torch.Generator, high: torch.Generator, device) -> torch.Tensor:
    """Float64 uniforms ``(2k + 1) / 2^53``, ``k = (a + 3b) mod 2^52`` of one draw from each generator
    (uniform given either draw, 3 being odd; not symmetric, so a seed that swaps the two generators'
    seeds does not repeat the noise, as ``a + b`` did)."""
    bound = 1 << 52
    k = torch.randint(bound, shape, generator=low, dtype=torch.int64, device=device)
    b = torch.randint(bound, shape, generator=high, dtype=torch.int64, device=device)
    k.add_(b.mul_(3)).bitwise_and_(bound - 1)
    return k.mul_(2).add_(1).to(torch.float64).mul_(2.0 ** -53)


def conv_sq_norms_ref(x: torch.Tensor, g: torch.Tensor, spec, ghost: bool, keep_grads: bool = False,
                      bias_grads: bool = False, input_weight: Optional[torch.Tensor] = None) -> None:
    """No fused reference: ``None`` tells the convolution rule to compose the route itself
    (unfold and :func:`linear_sq_norms_ghost`, or per-sample gradients from one grouped
    convolution, which it then keeps for the clipped sum)."""
    return None


def group_norm_backward_ref(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                            weight: Optional[torch.Tensor], groups: int, input_grad: bool):
    """aten's GroupNorm input gradient (if ``input_grad``) and per-sample parameter gradients
    from per-channel sums: ``dbeta_i = sum_s g``, ``dgamma_i = rstd sum_s g (x - mean)`` (x
    centred before the sum: a large mean would cancel in float32). ``x``, ``g``: (B, C, *S) with B > 0; ``mean``, ``rstd``: (B, groups)
    from the forward. Per-sample gradients are (B, C) in float32 for half-precision inputs."""
    n, c = x.shape[:2]
    hw = math.prod(x.shape[2:])
    grad_x = None
    if input_grad:
        grad_x = torch.ops.aten.native_group_norm_backward(
            g.contiguous(), x.contiguous(), mean, rstd, weight, n, c, hw, groups, [True, False, False])[0]
    dtype = compute_dtype(g.dtype)
    g3, x3 = g.reshape(n, c, hw).to(dtype), x.reshape(n, c, hw).to(dtype)
    sum_g = g3.sum(2)

    def per_channel(stat):  # (B, groups) -> (B, C)
        return stat.reshape(n, groups, 1).expand(n, groups, c // groups).reshape(n, c).to(dtype)

    return grad_x, per_channel(rstd) * (g3 * (x3 - per_channel(mean).unsqueeze(2))).sum(2), sum_g


_REFERENCE: Dict[str, Callable] = {
    "group_norm_backward": group_norm_backward_ref,
    "conv_sq_norms": conv_sq_norms_ref,
    "sample_sq_norms": sample_sq_norms_ref,
    "outer_sq_norms": outer_sq_norms_ref,
    "total_sq_norms": total_sq_norms_ref,
    "clip_factors": clip_factors_ref,
    "linear_sq_norms_ghost": linear_sq_norms_ghost_ref,
    "linear_sq_norms_direct": linear_sq_norms_direct_ref,
    "embedding_sq_norms": embedding_sq_norms_ref,
    "noisy_average": noisy_average_ref,
}


# --------------------------------------------------------------------------- public ops


def sample_sq_norms(x: torch.Tensor) -> torch.Tensor:
    return _call("sample_sq_norms", x.device, x)


def outer_sq_norms(a: torch.Tensor, g: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return _call("outer_sq_norms", a.device, a, g)


def total_sq_norms(parts: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, bool]:
    return _call("total_sq_norms", parts[0].device, parts)


def clip_factors(total: torch.Tensor, bound: float, scale: float, offset: float, clamp: bool) -> torch.Tensor:
    return _call("clip_factors", total.device, total, bound, scale, offset, clamp)


def linear_sq_norms_ghost(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _call("linear_sq_norms_ghost", a.device, a, g)


def linear_sq_norms_direct(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return _call("linear_sq_norms_direct", a.device, a, g)


def conv_sq_norms(x: torch.Tensor, g: torch.Tensor, spec, ghost: bool, keep_grads: bool = False,
                  bias_grads: bool = False, input_weight: Optional[torch.Tensor] = None
                  ) -> Optional[Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                                      Optional[torch.Tensor]]]:
    """Per-sample squared weight-gradient norms of a zero-padded convolution, float64 (B,), by
    the ghost or the direct route, from the input ``x`` (B, C, *S) and output gradient ``g``
    (B, C_out, *S'); ``spec`` has ``stride``, ``padding``, ``dilation``, ``kernel`` and
    ``groups``. Returns ``(norms, grads, bias, grad_input)``: ``grads`` holds the per-sample
    weight gradients (B, *weight.shape) where the direct route was asked to ``keep_grads``,
    ``bias`` the per-sample bias gradients (B, C_out) where asked for ``bias_grads``,
    ``grad_input`` the input gradient (B, C, *S) where given the weight as ``input_weight``,
    else ``None``; all in the kernel's dtype. ``None`` where no fused kernel takes this call."""
    return _call("conv_sq_norms", x.device, x, g, spec, ghost, keep_grads=keep_grads, bias_grads=bias_grads,
                 input_weight=input_weight)


def embedding_sq_norms(ids: torch.Tensor, g: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
    return _call("embedding_sq_norms", g.device, ids, g, padding_idx)


def noisy_average(
    sums: Sequence[torch.Tensor], std: float, divisor: float, seed: int, inplace: bool = False
) -> List[torch.Tensor]:
    """``(s + std * z) / divisor`` for every tensor of ``sums``; std finite >= 0, divisor finite > 0
    (a negative or NaN std would otherwise give no noise on one backend and noise on another)."""
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"noise std must be a finite number >= 0, got {std!r}")
    if not (divisor > 0 and math.isfinite(divisor)):
        raise ValueError(f"the noisy sum's divisor must be a finite number > 0, got {divisor!r}")
    if std > FLOAT32_NOISE_STD_MAX and any(s.dtype != torch.float64 for s in sums):
        raise ValueError(f"noise std {std:.3g} is above {FLOAT32_NOISE_STD_MAX:.3g}: s + std z would overflow "
                         "float32 (the noise of non-float64 sums is formed in float32) before the division; "
                         "pass float64 sums or a smaller std")
    if not sums:
        return []
    name, run = implementation("noisy_average", sums[0].device)
    wide = [i for i, s in enumerate(sums) if s.dtype == torch.float64]
    if name == "reference" or not wide:
        return run(sums, std, divisor, seed, inplace=inplace)
    # The kernels draw float32 normals: on a float64 sum, std z would sit on float32's grid and the
    # sum's low bits would show through the noise. Float64 sums get the reference's float64 normals.
    narrow = [i for i in range(len(sums)) if i not in set(wide)]
    out: List[Optional[torch.Tensor]] = [None] * len(sums)
    for indices, draw in ((narrow, run), (wide, noisy_average_ref)):
        if indices:  # a kernel may check its float32 scalars even for no tensor
            for i, t in zip(indices, draw([sums[i] for i in indices], std, divisor, seed, inplace=inplace)):
                out[i] = t
    return out


def group_norm_backward(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                        weight: Optional[torch.Tensor], groups: int,
                        input_grad: bool) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """GroupNorm backward for the output gradient ``g`` of ``x`` (B, C, *S), B > 0: returns
    ``(grad_x or None, per-sample weight gradients (B, C), per-sample bias gradients (B, C))``."""
    return _call("group_norm_backward", x.device, g, x, mean, rstd, weight, groups, input_grad)
