"""The engine: hooks a module's layers and turns one backward pass into clipped sums.

Each supported layer's ``forward`` is replaced (on the instance) by its rule's hooked
forward. During ``loss.backward()`` the hooked layers hand their activations and output
gradients to the engine (whose rule may find some norms then, see ``LayerRule.prepare``)
and autograd computes no weight gradients. When the whole backward pass has finished, an
autograd callback

1. computes every trainable parameter's per-sample squared norms not found yet (ghost or
   direct, per layer and per batch),
2. turns them into clipping coefficients with the clipping policy,
3. adds ``sum_i c_i * grad_i`` to the parameter's clipped-sum buffer.

Several backward passes before one optimizer step accumulate (virtual steps); each must
bring new samples (a layer input seen again, unchanged, is refused), and a pass that
accumulates no parameter gradient (``torch.autograd.grad``) adds nothing. A
parameter used by more than one call (tied weights, a layer applied twice) has its
per-sample gradients instantiated and summed, so its norm includes the cross terms.
"""
from __future__ import annotations

import inspect
import types
import warnings
from collections import defaultdict
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn
from torch.nn.utils import parametrize

from fastdp import ops
from fastdp.callers import user_stacklevel
from fastdp.identity import TensorMap
from fastdp.layout import UNKNOWN
from fastdp.layers import Record, Tap, UnsupportedModuleError, rule_for
from fastdp.layers.base import weighted_sum, zeroed_samples
from fastdp.ops import compute_dtype, sample_sq_norms
from fastdp.validate import stale_forward, trained_parametrization, validate

LOSS_REDUCTIONS = ("mean", "sum")
NONFINITE_POLICIES = ("raise", "skip")
_FLOAT32_TINY, _FLOAT32_HUGE = ops.FLOAT32_NORMAL_RANGE
_CONCATENATED_VIEWS = ("Two views of each sample concatenated on dim 0 (torch.cat([v1, v2])) count as two samples: "
                       "pass them as separate tensors, or stacked on dim 1")


class NonFiniteGradientError(FloatingPointError):
    """A per-sample gradient contained NaN or Inf."""


class GradSampleEngine:
    """Per-sample clipping for the trainable ``params`` of ``module``.

    Args:
        module: hooked in place; :meth:`detach` restores it.
        params: the parameters to privatise (those of the optimizer).
        clipping: a policy from :mod:`fastdp.clipping`.
        loss_reduction: "mean" if the loss averages over the batch (per-sample gradients
            are then the captured ones times the batch size of that backward), or "sum".
        nonfinite: "raise" on NaN/Inf per-sample gradients, or "skip" to drop those
            samples' contributions (counted in ``skipped_samples``).
    """

    def __init__(self, module: nn.Module, params: Sequence[torch.Tensor], clipping,
                 loss_reduction: str = "mean", nonfinite: str = "raise"):
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction={loss_reduction!r}: expected 'mean' or 'sum'")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r}: expected 'raise' or 'skip'")
        self.params = [p for p in params if p.requires_grad]
        self._private_ids = {id(p) for p in self.params}
        validate(module, self.params)
        self.module = module
        self.clipping = clipping
        self.loss_reduction = loss_reduction
        self.nonfinite = nonfinite
        self.names = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            self.names.setdefault(p, name)
        self._module_param_ids = {id(p) for p in self.names}
        self.summed: Dict[torch.Tensor, torch.Tensor] = {}
        self.samples_seen = 0  # samples clipped since the last step (or clear())
        self.generation = 0  # counts the passes completed and the clears: what a retried step checks
        self.skipped_samples = 0
        self._drop_pass()  # the state of one backward pass: _PASS_STATE
        self._drop_step_state()  # what the passes since the last step saw: _STEP_STATE
        # earlier passes' state set aside when a pass started: one run inside them hands theirs back
        self._suspended: List[dict] = []
        self._owned_grads: Dict[torch.Tensor, tuple] = {}
        self.ledger = None  # the attached Poisson loader's BatchLedger (fastdp.data), if any
        self._warned_rows = False
        self._patched: List[nn.Module] = []
        self.adopt_current_grads()
        self._warn_about_unprivatised()  # before hooking: a warning raised as an error leaves no hook behind
        self._patch()

    # -- hooks ---------------------------------------------------------------------------
    def _patch(self) -> None:
        for name, module in self.module.named_modules():
            rule = rule_for(module)
            if rule is None or not rule.trainable(module):
                continue
            if stale_forward(module):  # validate refused any other forward set on the instance
                del module.forward
            module.forward = self._hooked_forward(module, rule)
            self._patched.append(module)

    def _warn_about_unprivatised(self) -> None:
        """Hooked layers compute no gradient for parameters outside the optimizer: say so."""
        left = [self.names.get(p, "?") for m in self.module.modules() if rule_for(m) is not None
                for p in rule_for(m).trainable(m).values() if id(p) not in self._private_ids]
        if left:
            warnings.warn(
                f"parameter(s) {left[:8]} require grad but are not in the DP optimizer: fastdp's layers "
                "compute no gradient for them (their .grad stays None); freeze them (requires_grad_(False)) "
                "or give them to the optimizer", UserWarning, stacklevel=user_stacklevel())

    def _hooked_forward(self, module: nn.Module, rule):
        """``module``'s hooked forward, a method bound to it: ``copy.deepcopy`` rebinds it to the
        copy, which then runs its plain forward (a copy is not private, e.g. an EMA model)."""
        plain = type(module).forward
        signature = inspect.signature(plain.__get__(module))

        known = self._module_param_ids
        names = rule.param_names
        attributes, children = module.__dict__, module._modules

        def hooked(args, kwargs, params):
            if kwargs:  # by the layer's own argument names (nn.Linear(...)(input=x)): passed on by position
                args, kwargs = signature.bind(*args, **kwargs).args, {}
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            return rule.forward(module, Tap(self._record, module, rule, params, source), *args, **kwargs)

        def forward(owner, *args, **kwargs):
            # plain for a copy of the module, without grad, or once detached (a wrapper that kept this forward)
            params = rule.trainable(module) if owner is module and torch.is_grad_enabled() and self._patched else None
            # plain also where the layer holds tensors other than the model's parameters (torch.func.functional_call),
            # or one of its parameters' names is a tensor set by hand that requires grad (a weight computed from
            # another parameter before each call), or a trained parametrization registered since: autograd then
            # gives what it comes from its gradient, and one reaching a private parameter is refused as written
            # outside its layer. A constant one (a frozen pruned weight) is the layer's input like any other
            if (not params or any(id(p) not in known for p in params.values())
                    or any(getattr(attributes.get(n), "requires_grad", False) for n in names)):
                return plain(owner, *args, **kwargs)
            if "parametrizations" in children:
                with parametrize.cached():  # its tensors computed once, for the check and the call
                    if trained_parametrization(module):
                        return plain(owner, *args, **kwargs)
                    return hooked(args, kwargs, params)
            return hooked(args, kwargs, params)

        forward.fastdp_engine, forward.fastdp_module = self, module
        return types.MethodType(forward, module)

    def detach(self) -> None:
        """Remove every hook: the module behaves as a plain module again (a forward the user set over
        a hooked one stays, and calls the plain forward from now on)."""
        for module in self._patched:
            if getattr(module.__dict__.get("forward"), "fastdp_engine", None) is self:
                del module.forward
        self._patched = []
        self._drop_pass()
        self._suspended.clear()

    def _record(self, rec: Record, rounded_grads: bool = False) -> None:
        """Take a hooked layer's record. One whose parameters this pass does not accumulate
        (``backward(inputs=...)`` naming others) only marks its input as seen: a later pass through
        the same forward, accumulating those parameters, would clip the same samples again.
        ``rounded_grads``: its forward ran under a 16-bit autocast, or its output gradient is 16-bit."""
        if rounded_grads and rec.params and self.loss_reduction == "mean":
            raise UnsupportedModuleError(
                f"{self._module_name(rec.module)} ran under autocast or got a 16-bit output gradient with "
                "loss_reduction='mean': each sample's gradient arrives as g_i / B rounded to 16 bits, and "
                "fastdp's rescaling by B then moves every other sample's share when one sample joins the "
                "batch (sensitivity above C, up to 1.8 C measured); use loss_reduction='sum' with a summed loss "
                "(the noisy sum is still divided by the expected batch size: the step is unchanged)")
        task = torch._C._current_graph_task_id()
        if task != self._queued_task:  # the first record of this backward pass
            self._start_pass(task)
        self._pass_taps[id(rec.tap)] = rec.tap  # the same forward call in two passes: its samples twice
        x = rec.tap.source[0]() if rec.tap.source is not None else None  # the call's input, if alive
        if x is None:
            x = rec.activation[0] if isinstance(rec.activation, tuple) else rec.activation
        if isinstance(x, torch.Tensor):
            self._pass_inputs[x] = x._version
            if not rec.params:
                return
            self._check_rows(rec.module, x)
            if x._base is not None and self.ledger is not None:  # a view of the batch (nn.Flatten)
                self._pass_bases[x._base] = None
        if rec.params:
            rec.rule.prepare(rec)
            self._pending.append(rec)

    def _start_pass(self, task: int) -> None:
        """Queue the end-of-pass callback in backward pass ``task``. What an earlier pass left is set
        aside: a pass run inside it (torch.autograd.grad in a custom Function's backward) hands it
        back at its end, and the earlier pass goes on to its own. Otherwise the earlier pass raised
        before its end, autograd dropped its callback, and nothing of it is clipped or counted: the
        next pass to end outside any other drops it (with a flag instead, no later pass queued a
        callback again)."""
        self._suspended.append({name: getattr(self, name) for name in _PASS_STATE})
        self._drop_pass()
        self._queued_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _end_pass(self) -> None:
        """Drop this pass's state; hand the enclosing pass's back if this one ran inside it."""
        self._drop_pass()
        if torch._C._current_autograd_node() is None:  # outside any other pass: the set-aside ones raised
            self._suspended.clear()
        elif self._suspended:
            self.__dict__.update(self._suspended.pop())

    def _drop_pass(self) -> None:
        """Start the state of one backward pass afresh (its attributes: ``_PASS_STATE``)."""
        for name, fresh in _PASS_STATE.items():
            setattr(self, name, fresh())

    def _drop_step_state(self) -> None:
        """Forget what the passes since the last step saw (``_STEP_STATE``)."""
        for name, fresh in _STEP_STATE.items():
            setattr(self, name, fresh())

    def _check_rows(self, module: nn.Module, x: torch.Tensor) -> None:
        """A layer's calls in one pass are combined sample by sample (by index), so each call must
        see the same samples: refuse one whose input covers other rows of the same tensor than an
        earlier call's (a batch sent through the model in chunks inside one backward would have
        sample i of each chunk clipped together). On the loader's own tensors, where the samples
        are known (:class:`fastdp.layout.SampleLayout`), each row must also be one sample, and
        every layer must see the same ones."""
        base = x if x._base is None else x._base
        if x.dim() == 0 or base.dim() == 0:
            return
        layout = self.ledger.sample_layout(base) if self.ledger is not None else None
        rows = layout.rows_of(x) if layout is not None else UNKNOWN
        of_loader = rows is not UNKNOWN
        if of_loader:
            if rows is None:
                raise UnsupportedModuleError(
                    f"layer {self._module_name(module)} got rows (dim 0 of {tuple(x.shape)}) of the loader's batch "
                    "that are not one sample each: one sample without its batch dimension (x[i]), a batch flattened "
                    "into rows or moved off dim 0 (x.view(-1, d), x.transpose(0, 1)), or one sample repeated (expand). "
                    "fastdp clips each row of dim 0 as one sample, so one sample's parts would each be clipped to C; "
                    "keep the samples on dim 0 (x[i:i + 1] or x[i].unsqueeze(0) for one sample; (B, T, ...) layouts "
                    "for sequences)")
            key = ("loader", layout.batch)  # every layer, every tensor of the batch: row i is sample i
        else:
            rows = self._rows_of_other(x, base)
            if rows is None:
                return
            key = (id(module), id(base))
        if self._pass_rows.setdefault(key, rows) != rows:
            raise UnsupportedModuleError(
                f"layer {self._module_name(module)} saw other samples of one batch tensor than an earlier layer call "
                "in this backward pass (a batch sent through the model in chunks, then one backward; or shifted "
                "slices, x[1:] and x[:-1], in two layers): fastdp combines the calls sample by sample, so sample i "
                "of each would be clipped together; call backward() on each chunk's loss (or pass the batch "
                "whole). " + _CONCATENATED_VIEWS + ". A loop over time steps of a (B*T, d) tensor viewed as "
                "(B, T, d), y[:, t], looks the same: if every call does see each sample once, in order, give each "
                "step's input its own tensor (y[:, t].contiguous())")
        if of_loader:
            self._note_samples(layout.batch, rows)

    @staticmethod
    def _rows_of_other(x: torch.Tensor, base: torch.Tensor) -> Optional[tuple]:
        """For a tensor not from the loader, the rows of ``base`` that the rows of ``x`` are, where
        ``x`` is a block of whole rows of it; else None (no sample correspondence to check)."""
        if x.shape[0] == 1 or base.stride(0) <= 0:
            return None  # one row: its strides cannot tell the base's dim 0 from another of size 1
        span = sum((n - 1) * abs(st) for n, st in zip(x.shape[1:], x.stride()[1:]))
        if x.stride(0) % base.stride(0) or x.stride(0) == 0 or x.shape == base.shape[1:] or span >= base.stride(0):
            # not row blocks of the base: broadcast (stride 0), one element of its dim 0 (base[t], e.g.
            # outputs stacked time-first), or rows spanning several of its rows (a token stream viewed
            # as (B, T)): no sample correspondence to check
            return None
        return (x.storage_offset() - base.storage_offset()) // base.stride(0), x.stride(0) // base.stride(0), x.shape[0]

    def _note_samples(self, batch: int, rows: tuple) -> None:
        """Keep the samples of the loader's batch (or chunk) number ``batch`` a layer call saw:
        ``_check_samples_once`` compares them with the earlier passes' at the pass's end."""
        self._pass_samples.setdefault(batch, set()).add(rows)

    def _check_samples_once(self, samples: Dict[int, set]) -> None:
        """Refuse samples of a loader batch (this pass's ``_pass_samples``) that an earlier pass since
        the last step saw through other views or other tensors of the batch (overlapping micro-batches,
        x[:4] sliced twice, one pass through x and one through y): clipped twice."""
        for data, ranges in samples.items():
            earlier = self._step_samples.get(data)
            if earlier is not None and any(not earlier.isdisjoint(_rows(rows)) for rows in ranges):
                raise UnsupportedModuleError(
                    "this backward pass's layers saw samples of the loader's batch that an earlier pass since the "
                    "last step saw too (micro-batches that overlap, or one sliced twice): each pass clips its "
                    "samples on their own, so they would count twice while the noise is scaled for once; split "
                    "the batch into disjoint chunks (one backward() each), or call backward() once")

    # -- after each backward pass ---------------------------------------------------------
    def _finish_backward(self) -> None:
        records, inputs, bases, taps = self._pending, self._pass_inputs, self._pass_bases, self._pass_taps
        samples = self._pass_samples
        self._end_pass()
        if not records:  # no private parameter accumulated (torch.autograd.grad): the pass adds nothing
            return
        # checks first, then everything the pass adds at once at the end: a pass that raises (a refusal,
        # a non-finite sample, an interrupt) leaves no partial sums and no inputs marked as seen
        self._check_pass(inputs, taps, samples)
        batch = self._batch_size(records)
        if batch == 0:  # an empty (Poisson) batch: nothing to clip, the step adds noise only
            self.generation += 1  # still a pass: a step failed before it is not retried on it
            self.step_passes += 1
            return
        scale = float(batch) if self.loss_reduction == "mean" else 1.0
        found = None if self.ledger is None else self._trace_batches(inputs, bases, batch)
        own, shared = self._uses(records)
        params, norms = self._sq_norms(own, shared)
        if not norms:  # the pass reached only parameters left out of the optimizer: nothing to clip
            return

        # per sample, over all parameters: checked for NaN/Inf here, the flat norm to clip
        total_sq, finite = ops.total_sq_norms(norms)
        bad = None if finite else self._nonfinite_samples(dict(zip(params, norms)), total_sq)
        if bad is not None:
            norms = [torch.where(bad, 0.0, n) for n in norms]
            total_sq = torch.where(bad, 0.0, total_sq)
            for rec in records:
                rec.zero_samples(bad)
            shared = {p: zeroed_samples(g, bad) for p, g in shared.items()}

        coef_of = self._coefficients(params, norms, scale, total_sq)
        summed = dict(self.summed)
        for rec, names in own.items():
            sums = rec.rule.clipped_sums(rec, {n: coef_of(rec.params[n]) for n in names})
            for name, s in sums.items():
                self._accumulate(summed, rec.params[name], s)
        for p, grads in shared.items():
            self._accumulate(summed, p, weighted_sum(coef_of(p), grads))
        self.summed = summed  # committed: what follows cannot fail
        self.generation += 1
        self.step_passes += 1
        self._step_inputs.update(inputs)
        self._step_taps.update(taps)
        for data, ranges in samples.items():
            earlier = self._step_samples.setdefault(data, set())
            for rows in ranges:
                earlier.update(_rows(rows))
        self.samples_seen += batch
        if found is not None:
            self.step_batches.update(found)

    def _check_pass(self, inputs: TensorMap, taps: Dict[int, Tap], samples: TensorMap) -> None:
        """Refuse a pass that would clip samples seen before, or a part of their gradients on its
        own (a pass inside another one), or whose parameters got gradients outside the hooks."""
        self._check_new_samples(inputs, taps)
        self._check_samples_once(samples)
        if torch._C._current_autograd_node() is not None:
            # A backward pass run from inside another one's node (reentrant checkpointing): its
            # callback would clip the samples' gradients of this inner part on their own.
            raise UnsupportedModuleError(
                "a backward pass ran inside another one (torch.utils.checkpoint with use_reentrant=True?) "
                "and reached hooked layers first: fastdp would clip that part of each sample's gradient "
                "on its own; use torch.utils.checkpoint(..., use_reentrant=False)"
            )
        self.check_foreign_grads()

    def _trace_batches(self, inputs: TensorMap, bases: TensorMap, batch: int) -> set:
        """The attached loader's batches this pass's layer inputs (or the tensors they view) came
        from; refuses more rows than the batch holds samples where the pass is traced to it."""
        traced = self.ledger.traced_batches([*inputs, *bases])
        found = self.ledger.batches_of(traced)
        self._check_rows_per_sample(batch, self.ledger.samples_in_pass(found), bool(traced))
        return found

    def _uses(self, records: List[Record]):
        """``(own, shared)``: per record, the names of the private parameters only it used; per
        private parameter used by several records (tied, or a layer called twice), its summed
        per-sample gradients (B, *shape), cross terms included."""
        uses: Dict[int, List[tuple]] = {}  # (record, name) per parameter, by id (Tensor.__hash__ is Python)
        private = self._private_ids
        for rec in records:
            for name, p in rec.params.items():
                if id(p) in private:
                    uses.setdefault(id(p), []).append((rec, name))
        shared = {u[0][0].params[u[0][1]]: self._summed_per_sample(u) for u in uses.values() if len(u) > 1}
        own: Dict[Record, List[str]] = defaultdict(list)
        for u in uses.values():
            if len(u) == 1:
                own[u[0][0]].append(u[0][1])
        return own, shared

    @staticmethod
    def _sq_norms(own: Dict[Record, List[str]], shared: Dict[torch.Tensor, torch.Tensor]):
        """``(params, norms)``: each private parameter of the pass and its per-sample squared norms (B,)."""
        params: List[torch.Tensor] = []
        norms: List[torch.Tensor] = []
        for rec, names in own.items():
            for name, n in rec.rule.sq_norms(rec, names).items():
                params.append(rec.params[name])
                norms.append(n)
        for p, grads in shared.items():
            params.append(p)
            norms.append(sample_sq_norms(grads))
        return params, norms

    def _check_rows_per_sample(self, rows: int, samples: Optional[int], traced: bool) -> None:
        """The layers' dim 0 (``rows``) may not exceed the samples of the batch or chunk the
        loader handed out last: each sample must be one row, or it is clipped as several.
        Refused where the pass is traced to the loader's tensors; else (data the loader did not
        hand out, e.g. a GAN's generated batch, or views concatenated) a warning, once."""
        if samples is None or rows <= samples:
            return
        what = (f"this backward pass's layers saw {rows} rows (dim 0) but the loader's last batch (or chunk) holds "
                f"{samples} samples: each sample must be one row of every layer input, or its rows are clipped as "
                f"separate samples. {_CONCATENATED_VIEWS}; keep (B, T, ...) layouts rather than flattening tokens "
                "into rows")
        if traced:
            raise UnsupportedModuleError(what)
        if not self._warned_rows:
            self._warned_rows = True
            warnings.warn(what + " (ignore this for data that does not come from the private dataset, such as a "
                          "GAN's generated samples)", UserWarning, stacklevel=user_stacklevel())

    def _check_new_samples(self, inputs: TensorMap, taps: Dict[int, Tap]) -> None:
        """Each backward pass before a step adds its samples' clipped sums, so it must see new
        samples: a layer input (same tensor, unchanged) already seen in an earlier pass since the
        last step, or a forward call an earlier pass went through (backward twice through one
        forward, whatever a norm layer's rule hands its backward), means the same samples twice,
        with noise for once."""
        seen = self._step_inputs  # the passes since the last step add theirs when they complete
        if any(key in self._step_taps for key in taps) or any(
                seen.get(x) == version for x, version in inputs.items()):
            raise UnsupportedModuleError(
                "the same samples were backpropagated twice before step() (a layer saw the same "
                "input tensor in two backward() calls): fastdp clips each backward call's samples "
                "on their own, so they would count twice while the noise is scaled for once; add "
                "the losses and call backward() once (also with backward(inputs=...) for parts of the model)"
            )

    def _coefficients(self, params: List[torch.Tensor], norms: List[torch.Tensor], scale: float,
                      total_sq: torch.Tensor):
        """``coef_of(param)``: its clipping coefficients (B,), zeroed for samples without gradient and
        dropped ones (``total_sq`` 0), in the dtype the rules compute in (float32 for half-precision
        parameters). A policy with one coefficient for all parameters (flat, automatic) gives it once,
        cast once per dtype."""
        shared = getattr(self.clipping, "coefficient", None)
        if shared is not None:
            one, per_param = shared(total_sq, scale), None
        else:
            one, per_param = None, self.clipping.coefficients(dict(zip(params, norms)), scale, total_sq)
        cast: Dict[tuple, torch.Tensor] = {}
        zero = total_sq == 0  # also the dropped (non-finite) samples, whose totals were set to 0

        def coef_of(p: torch.Tensor) -> torch.Tensor:
            c = one if per_param is None else per_param[p]
            dtype = compute_dtype(p.dtype)
            done = cast.get((id(c), dtype))
            if done is None:
                # a sample without gradient adds nothing: 0, not a coefficient up to B (mean) or C / gamma whose
                # product with activations near float32's range would overflow, 0 x Inf = NaN in the sum (a sample
                # with some gradient can still overflow there: README, Errors)
                kept = torch.where(zero, 0.0, c)
                if dtype != torch.float64:  # a float32 subnormal rounds by up to 2x: a share up to 2C, so 0;
                    # above float32's range (a tiny gamma) it would be Inf: at float32's largest, a share of at most C
                    kept = torch.where(kept < _FLOAT32_TINY, 0.0, kept).clamp_(max=_FLOAT32_HUGE)
                done = cast[(id(c), dtype)] = kept.to(dtype)
            return done

        return coef_of

    @staticmethod
    def _summed_per_sample(uses) -> torch.Tensor:
        total = None
        for rec, name in uses:
            g = rec.rule.cached_grads(rec, [name])[name]
            total = g if total is None else total + g
        return total

    def _batch_size(self, records: List[Record]) -> int:
        sizes = {rec.batch_size for rec in records}
        if len(sizes) > 1:
            seen = ", ".join(f"{self._module_name(r.module)}: {r.batch_size}" for r in records)
            raise UnsupportedModuleError(
                f"layers saw different batch sizes in one backward pass ({seen}); fastdp "
                "takes dim 0 of every layer input as the batch dimension (use batch_first=True "
                "layouts, or permute inputs so the batch comes first; give a layer applied to what all "
                "samples share, such as position embeddings of torch.arange(T), its input expanded to the "
                "batch: wpe(torch.arange(T).expand(B, T)); route samples to layers by dense masking, "
                "expert(h) * mask, not by selecting rows, expert(h[mask]))"
            )
        return sizes.pop()

    def _nonfinite_samples(self, sq_norms, per_sample: torch.Tensor) -> Optional[torch.Tensor]:
        """Boolean (B,) mask of the samples with a NaN/Inf squared norm (``per_sample``: their
        sum over parameters, which ``ops.total_sq_norms`` found not all finite), or None if
        there are none; raises under nonfinite="raise"."""
        finite = torch.isfinite(per_sample).cpu()
        bad = (~finite).nonzero().flatten().tolist()
        if not bad:  # the batch's total overflowed, no sample's norm did
            return None
        if self.nonfinite == "raise":
            params = [self.names.get(p, "?") for p, n in sq_norms.items() if not bool(torch.isfinite(n).all())]
            raise NonFiniteGradientError(
                f"non-finite per-sample gradient for sample(s) {bad[:10]} of the batch in "
                f"parameter(s) {params[:5]}; check the inputs and loss of those samples, or pass "
                "nonfinite='skip' to drop their contributions (counted in skipped_samples)"
            )
        self.skipped_samples += len(bad)
        return (~finite).to(next(iter(sq_norms.values())).device)

    @staticmethod
    def _accumulate(summed: Dict[torch.Tensor, torch.Tensor], p: torch.Tensor, s: torch.Tensor) -> None:
        """Add a clipped sum to ``summed`` (a copy of the engine's until the pass completes: out of
        place), kept in the compute dtype (float32 for half-precision parameters): rounded to the
        parameter's dtype only once, after the noise (the optimizer does that)."""
        dtype = compute_dtype(p.dtype)
        if s.dtype != dtype:  # rules return fresh tensors: no copy needed otherwise
            s = s.to(dtype)
        if s.shape != p.shape:
            s = s.view_as(p)
        summed[p] = summed[p] + s if p in summed else s

    def _module_name(self, module: nn.Module) -> str:
        for name, m in self.module.named_modules():
            if m is module:
                return f"'{name or '<root>'}'"
        return type(module).__name__

    # -- gradients written outside the engine ----------------------------------------------
    def adopt_current_grads(self) -> None:
        """Take the parameters' present ``.grad`` tensors as the engine's own (after a step)."""
        self._owned_grads = {p: (p.grad, p.grad._version) for p in self.params if p.grad is not None}

    def check_foreign_grads(self) -> None:
        """Autograd never writes ``.grad`` of a hooked parameter: a new or changed one means the
        parameter was used outside its layer's forward, where fastdp cannot clip it."""
        for p in self.params:
            grad = p.grad
            if grad is None:
                continue
            owned = self._owned_grads.get(p)
            if owned is not None and owned[0] is grad and (owned[1] == grad._version or not grad.any()):
                continue
            name = self.names.get(p, "?")
            raise UnsupportedModuleError(
                f"parameter '{name}' received a gradient from outside its layer's forward (e.g. "
                f"F.linear(x, module.weight), module.weight used directly, a layer's weight set by hand from it or "
                "computed from it by a parametrization registered after the optimizer was built, "
                "or torch.func.functional_call with tensors computed from it), which fastdp cannot clip per "
                "sample; call the module itself instead of reading its parameters"
            )

    # -- for the optimizer -----------------------------------------------------------------
    def sums(self) -> List[torch.Tensor]:
        """Clipped sums of all parameters (zeros where nothing was seen), in the compute dtype; kept."""
        return [self.summed[p] if p in self.summed else torch.zeros_like(p, dtype=compute_dtype(p.dtype))
                for p in self.params]

    def clear(self) -> None:
        """Drop the clipped sums and what the passes since the last step saw (and what a pass
        that raised before its end left)."""
        self._drop_pass()
        self._suspended.clear()
        self.summed.clear()
        self.generation += 1
        self.samples_seen = 0
        self._drop_step_state()


# What one backward pass collects until its end, attribute by attribute (a factory of its empty value):
# _drop_pass starts each afresh, and the whole is set aside while a pass runs inside it (_start_pass).
# Tensors are kept in TensorMaps (by identity, weakly).
_PASS_STATE = {
    "_pending": list,  # the Records of the pass's hooked layer calls
    # layer inputs: their version, to tell the same samples backpropagated twice
    "_pass_inputs": TensorMap,
    "_pass_taps": dict,  # the forward calls (their Taps) the pass went through, by id
    # the tensors the layer inputs are views of (values None): with the inputs themselves, what finds
    # the data batch the pass came from (attach_loader)
    "_pass_bases": TensorMap,
    # (first, step, count) of the rows each (layer id, base id), or each loader batch ("loader", number), saw
    "_pass_rows": dict,
    # samples of the loader's batches the layers saw, by SampleLayout.batch: a set of (first, step, count) each
    "_pass_samples": dict,
    "_queued_task": lambda: None,  # the autograd graph task whose end runs _finish_backward
}

# What the passes since the last step saw (each completed pass adds its own; clear() starts afresh).
_STEP_STATE = {
    "_step_inputs": TensorMap,  # as _pass_inputs
    "_step_taps": dict,  # as _pass_taps
    # the samples of the loader's batches (a set of indices each, by SampleLayout.batch), to tell the
    # same samples in two passes (overlapping micro-batches, other tensors of one batch)
    "_step_samples": dict,
    "step_batches": set,  # which data batches of the attached loader the passes came from
    "step_passes": int,  # the passes completed (an empty batch's included)
}


def _rows(ranges: tuple) -> range:
    """The row indices of a row range ``(first, step, count)``."""
    first, step, count = ranges
    return range(first, first + step * count, step)

