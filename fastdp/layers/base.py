"""What a layer rule is, and the record a hooked layer leaves behind after a backward pass.

A rule runs its module's forward through a custom autograd Function that saves what the
per-sample math needs (the *activation*) and, in backward, returns only the input
gradient: autograd never computes the (unclipped) weight gradient. When the output
gradient arrives, the Function hands ``(activation, grad_output)`` to the engine as a
:class:`Record`, and the engine calls the rule's ``prepare`` at once (during backward, while
the tensors are in cache: some rules find their norms there). After the whole backward pass
the engine asks each rule for

* ``sq_norms``: per-sample squared gradient norms, float64, ``(B,)`` per parameter (those
  ``prepare`` found, or computed now);
* ``per_sample_grads``: instantiated per-sample gradients ``(B, *param.shape)``, used
  where one parameter gets several contributions (tied weights, a layer called twice);
* ``clipped_sums``: ``sum_i coef_i * grad_i`` per parameter ("book-keeping").

Gradients here are those of the loss as the user reduced it; the engine rescales
(``loss_reduction="mean"`` multiplies per-sample gradients by the batch size).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch import nn

from fastdp import ops
from fastdp.ops import compute_dtype

# Per-sample tensors larger than this many elements are processed in batch chunks.
CHUNK_ELEMENTS = 1 << 24


class UnsupportedModuleError(ValueError):
    """A module (or its configuration) whose per-sample gradients fastdp cannot clip exactly."""


class Record:
    """One call of a hooked module, seen in one backward pass (told apart by identity)."""

    __slots__ = ("module", "rule", "params", "activation", "grad_output", "batch_size", "cache", "norms", "tap")

    def __init__(self, module: nn.Module, rule: "LayerRule", params: Dict[str, torch.Tensor],
                 activation: Any, grad_output: Optional[torch.Tensor], batch_size: int, tap: "Tap"):
        self.module, self.rule = module, rule
        self.params = params  # the trainable parameters this call used, by name
        self.activation, self.grad_output, self.batch_size = activation, grad_output, batch_size
        self.tap = tap  # the forward call's Tap: which call this is, and its input
        self.cache: Dict[str, torch.Tensor] = {}  # per-sample grads (B, *shape)
        self.norms: Dict[str, torch.Tensor] = {}  # squared norms found early

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(self.params)

    def release(self) -> None:
        """Drop the activation and output gradient once everything needed is in ``cache``."""
        self.activation = self.grad_output = None

    def zero_samples(self, mask: torch.Tensor) -> None:
        """Zero every per-sample tensor of the samples in boolean ``mask`` (dropped samples);
        a tensor of B * T rows (a rule's row matrix) has T rows per sample."""
        def zeroed(t):
            return zeroed_samples(t, mask) if isinstance(t, torch.Tensor) and torch.is_floating_point(t) else t

        self.grad_output = zeroed(self.grad_output)
        if isinstance(self.activation, tuple):
            self.activation = (zeroed(self.activation[0]), *self.activation[1:])
        else:
            self.activation = zeroed(self.activation)
        self.cache = {k: zeroed(v) for k, v in self.cache.items()}


class Tap:
    """Created per forward call with the trainable parameters it used (by name); the
    Function's backward calls :meth:`fire` with its ``ctx`` and what it saw."""

    __slots__ = ("sink", "module", "rule", "params", "source", "autocast")

    def __init__(self, sink: Callable[..., None], module: nn.Module, rule: "LayerRule",
                 params: Dict[str, torch.Tensor], source: Optional[torch.Tensor] = None):
        self.sink, self.module, self.rule, self.params = sink, module, rule, params
        # the call's input itself (what a rule hands backward may be derived from it afresh, as the
        # norms' normalised input): what tells the same samples seen twice
        self.source = None if source is None else (weakref.ref(source), source._version)
        # the call ran under a 16-bit autocast (which leaves float64 alone): its output gradient may hold
        # 16-bit-rounded values even where it arrives in float32 (an embedding or norm feeding a matmul)
        self.autocast = source is not None and torch.is_autocast_enabled(source.device.type) and not (
            source.dtype == torch.float64 if source.is_floating_point()
            else all(p.dtype == torch.float64 for p in params.values()))  # ids: the weights' dtype

    def fire(self, ctx, activation: Any, grad_output: torch.Tensor) -> None:
        """Hand over what backward saw, for the parameters whose gradients this backward pass
        accumulates (none under ``torch.autograd.grad`` or ``backward(inputs=...)`` without
        them: such a pass must add no clipped sum). Half-precision tensors are widened to
        float32 so that norms, coefficients and clipped sums accumulate in float32."""
        if torch.is_grad_enabled():  # backward(create_graph=True): this backward would be differentiated
            raise UnsupportedModuleError(
                f"backward(create_graph=True) reached a hooked {type(self.module).__name__}: fastdp's layers "
                "support no double backward (gradient penalties, higher-order gradients), whose parameter "
                "gradients would escape per-sample clipping; compute such terms on a model copy "
                "(copy.deepcopy) or without create_graph")
        params = _accumulated(ctx, self.params, self.rule)
        if not params:  # the engine only notes the layer's input as seen (a later pass may accumulate them)
            self.sink(Record(self.module, self.rule, params, activation, None, grad_output.shape[0], self))
            return
        self.sink(Record(self.module, self.rule, params, _widen(activation), _widen(grad_output),
                         grad_output.shape[0], self),
                  self.autocast or grad_output.dtype in (torch.float16, torch.bfloat16))


def _accumulated(ctx, params: Dict[str, torch.Tensor], rule: "LayerRule") -> Dict[str, torch.Tensor]:
    """The entries of ``params`` whose gradient accumulator the running backward pass executes,
    found from the Function's ``ctx``: ``next_functions`` are its inputs' nodes (none for an input
    passed as None), a parameter's being the accumulator whose ``variable`` it is."""
    nodes = {id(node.variable): node for node, _ in ctx.next_functions if hasattr(node, "variable")}
    kept = {}
    for name, p in params.items():
        node = nodes.get(id(p))
        if node is None:
            raise UnsupportedModuleError(
                f"{type(rule).__name__}'s autograd Function did not take parameter '{name}' itself as an input "
                "(a view or copy of it was passed): fastdp cannot tell whether this backward pass accumulates it")
        try:
            runs = torch._C._will_engine_execute_node(node)
        except RuntimeError:  # raised for a leaf's node under torch.autograd.grad, which accumulates nothing
            runs = False
        if runs:
            kept[name] = p
    return params if len(kept) == len(params) else kept


def _widen(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        dtype = compute_dtype(x.dtype)
        return x if x.dtype == dtype else x.to(dtype)
    if isinstance(x, tuple):
        return tuple(_widen(v) for v in x)
    return x


class LayerRule:
    """Per-sample gradient rule for one family of layers; subclasses set ``module_types`` (and
    ``param_names``). :meth:`forward` runs the module through an autograd Function that takes the
    parameters themselves among its inputs (not views or copies; None for an absent one), whose
    backward calls ``tap.fire(ctx, activation, grad_output)`` and returns no gradient for them."""

    module_types: Tuple[type, ...] = ()
    param_names: Tuple[str, ...] = ("weight", "bias")

    def check(self, module: nn.Module) -> None:
        """Raise :class:`UnsupportedModuleError` for configurations the rule cannot handle. Called
        for frozen modules too: what changes the module's state from the data (running
        statistics, renormalised rows) must be refused there as well."""

    def trainable(self, module: nn.Module) -> Dict[str, torch.Tensor]:
        """The module's registered parameters among ``param_names`` that require grad, by name
        (a tensor computed from other parameters, e.g. a pruned or weight-normed ``weight``, is
        not one: validation refuses such modules)."""
        found = {}
        registered = module._parameters  # direct: nn.Module.__getattr__ is slow
        for n in self.param_names:
            t = registered.get(n)
            if t is not None and t.requires_grad:
                found[n] = t
        return found

    def forward(self, module: nn.Module, tap: Tap, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, rec: Record) -> None:
        """Called as soon as the record arrives, during backward: a rule may instantiate what
        it needs now and :meth:`Record.release` the large tensors early (peak memory)."""

    def cached_grads(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """Per-sample gradients of ``names``, instantiated once per record."""
        missing = [n for n in names if n not in rec.cache]
        if missing:
            rec.cache.update(self.per_sample_grads(rec, missing))
        return {n: rec.cache[n] for n in names}

    def sq_norms(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        """Norms :meth:`prepare` already found, else from the instantiated per-sample gradients."""
        return {n: rec.norms[n] if n in rec.norms else ops.sample_sq_norms(self.cached_grads(rec, [n])[n])
                for n in names}

    def per_sample_grads(self, rec: Record, names: Iterable[str]) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def clipped_sums(self, rec: Record, coefs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``sum_i coefs[name]_i * grad_i`` for each name in ``coefs``; ``coefs[name]``: ``(B,)`` in
        ``compute_dtype`` of the parameter's dtype (float32 for float32 and half parameters),
        already zero for dropped samples."""
        grads = self.cached_grads(rec, coefs.keys())
        return {n: weighted_sum(coefs[n], g) for n, g in grads.items()}


def zeroed_samples(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``t`` (a float tensor of B * T rows, T rows per sample) with the rows of the samples in
    boolean ``mask`` (B,) zeroed, NaN and Inf there included; a new tensor."""
    keep = (~mask).to(t.dtype)
    if t.shape[0] != keep.shape[0]:
        keep = keep.repeat_interleave(t.shape[0] // max(1, keep.shape[0]))
    return torch.nan_to_num(t * keep.view(-1, *([1] * (t.dim() - 1))), 0.0, 0.0, 0.0)


def check_batched(module: nn.Module, x: torch.Tensor, spatial: int) -> None:
    """Refuse an input of ``module`` that is not (B, C, *S) with ``spatial`` dims S: unbatched,
    its channels would be taken for samples."""
    if x.dim() != spatial + 2:
        raise UnsupportedModuleError(
            f"{type(module).__name__} got an input of shape {tuple(x.shape)}: fastdp needs a batched input "
            f"(B, C, {', '.join('S' * spatial)}); add the batch dimension with x.unsqueeze(0)")


def with_rounding_allowance(sq_norms: torch.Tensor, slack: torch.Tensor, seq: int,
                            dtype: torch.dtype, tf32: bool = False) -> torch.Tensor:
    """Squared norms (float64 (B,)) widened by what rounding can add to a sample's share of a
    clipped sum formed as one contraction over its ``seq`` positions in ``dtype`` (a GEMM on
    coefficient-scaled rows): ``(|G_i| + gamma S_i)^2`` with ``S_i = sum_t |a_t| |g_t|``
    (``slack``, float64 (B,), or a bound on it) and ``gamma = 2 (seq u_acc + 2 u)``; ``u`` is
    ``dtype``'s unit roundoff, ``u_acc`` that of the accumulation (float32 for half dtypes).
    The norm is of the exact gradient; a sample whose per-position terms cancel (gradient ~0
    from terms ~1e12) was released as its rounding error, unclipped. The sum's error from the
    sample's own terms is at most ``(seq u_acc + 2 u) S_i``, and so is the norm's (computed in
    its own order): ``c_i`` from the widened norm bounds the share by C. A sample whose terms do
    not cancel has ``S_i`` about ``sqrt(T) |G_i|``: its norm grows by about ``2 T^1.5 u``. ``tf32``:
    the contraction runs in TF32 (CUDA), float32 inputs rounded to 10 mantissa bits: u = 2^-11 there."""
    u = torch.finfo(dtype).eps / 2
    u_in = 2.0 ** -11 if tf32 and dtype == torch.float32 else u
    gamma = 2 * (seq * min(u, 2.0 ** -24) + 2 * u_in)
    return (sq_norms.clamp(min=0).sqrt_() + gamma * slack).square_()  # a Gram sum can round below 0


def tf32_in_use(kind: str) -> bool:
    """Whether CUDA float32 contractions of ``kind`` ("matmul": cuBLAS, "conv": cuDNN, or cuBLAS for a
    convolution run without cuDNN or lowered to a matmul) may run in TF32. torch's legacy ``allow_tf32``
    flags raise once its ``fp32_precision`` settings have been used (even only those): then the first of
    those, from the operator's up to the global one, that is not "none" (inherit) tells; none set, or
    anything but "ieee", counts as TF32 (the larger, safe allowance)."""
    if kind == "conv" and tf32_in_use("matmul"):
        return True
    legacy = torch.backends.cuda.matmul if kind == "matmul" else torch.backends.cudnn
    try:
        return bool(legacy.allow_tf32)
    except RuntimeError:
        chain = (torch.backends.cuda.matmul,) if kind == "matmul" else (torch.backends.cudnn.conv, torch.backends.cudnn)
        for setting in (*chain, torch.backends):
            precision = getattr(setting, "fp32_precision", "none")
            if precision != "none":
                return precision != "ieee"
        return True


def with_gram_allowance(sq_norms: torch.Tensor, slack: torch.Tensor, terms: int) -> torch.Tensor:
    """Squared ghost norms (float64 (B,)) widened by their own rounding: ``sum_{s,t} (a_s . a_t)(g_s . g_t)``
    from float64 Grams errs by up to ``terms u64 S_i^2`` (``terms = d + p + 2 T^2``, ``S_i`` the slack of
    :func:`with_rounding_allowance`), which is about ``sqrt(terms u64) S_i`` in the norm: where the terms
    cancel (float64 inputs, or large d + p) more than the sum's allowance covers."""
    return sq_norms.clamp(min=0).add_(slack.square().mul_(terms * 2.0 ** -53))


def in_layout_of(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad`` (x's shape) with ``x``'s strides, as torch's own backward keeps an input's layout:
    a layer's input gradient in another layout reaches the ops before it (torch's instance_norm
    backward is wrong for a channels-last gradient at batch size 1). A copy only where they differ."""
    if grad.stride() == x.stride() or grad.shape != x.shape or not _dense(x):
        return grad  # a view that skips elements (a CLS token's h[:, 0]): empty_like would be contiguous anyway
    return torch.empty_like(x, dtype=grad.dtype).copy_(grad)


def _dense(x: torch.Tensor) -> bool:
    """Whether ``x``'s elements fill its memory without gaps or overlap (a permuted contiguous
    tensor, channels-last): the layouts ``empty_like`` keeps."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda dim: dim[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call where it is already so (saves a dispatch per use)."""
    return t if t.dtype == dtype else t.to(dtype)


def weighted_sum(coef: torch.Tensor, per_sample: torch.Tensor) -> torch.Tensor:
    """``sum_i coef_i * per_sample[i]`` for ``coef`` (B,) and ``per_sample`` (B, ...): one
    vector-matrix product over the sample dims in memory order, so a permuted layout (a
    kernel's transposed per-sample gradients) is read in place, not copied."""
    coef = as_dtype(coef, per_sample.dtype)
    if per_sample.is_contiguous():
        return (coef @ per_sample.view(per_sample.shape[0], -1)).view(per_sample.shape[1:])
    order = sorted(range(1, per_sample.dim()), key=lambda k: -per_sample.stride(k))
    ordered = per_sample.permute(0, *order)
    total = (coef @ ordered.reshape(per_sample.shape[0], -1)).view(ordered.shape[1:])
    return total.permute(*sorted(range(len(order)), key=order.__getitem__)).contiguous()


def batch_chunks(batch: int, per_sample_elements: int) -> Iterable[slice]:
    """Slices of the batch such that each chunk holds at most ~``CHUNK_ELEMENTS`` elements."""
    step = max(1, CHUNK_ELEMENTS // max(1, per_sample_elements))
    return (slice(i, min(i + step, batch)) for i in range(0, batch, step))


def expand_like(coef: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``coef`` (B,) viewed to broadcast over ``x`` (B, ...), in ``x``'s dtype."""
    return coef.to(x.dtype).view(-1, *([1] * (x.dim() - 1)))
