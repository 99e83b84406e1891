"""``DPOptimizer``: DP-SGD around any ``torch.optim`` optimizer; the training loop is unchanged.

Conventions (DP-SGD, Abadi et al. 2016, as Opacus states them):

* each sample's gradient is clipped to norm ``max_grad_norm`` (C);
* Gaussian noise of std ``noise_multiplier * C`` (sigma C) is added to the SUM of the
  clipped gradients, once per optimizer step, fresh every step;
* the noisy sum is divided by ``expected_batch_size``: under Poisson sampling the
  expected batch size q N, never the actual one (dividing by it would leak it).

``step()`` writes that average into ``p.grad`` and runs the wrapped optimizer. Several
``backward()`` calls before one ``step()`` accumulate clipped sums (virtual steps, each over
different samples): the noise is added once per step. After ``backward()`` and before ``step()``, ``p.grad`` is not
populated: autograd skips the unclipped weight gradients entirely.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import math
import operator
import os
import types
import warnings
import weakref
from collections import OrderedDict
from typing import Callable, List, NamedTuple, Optional, Sequence, Union

import torch
import torch.optim.optimizer as torch_optimizer_module
from torch import nn

from fastdp import ops, secure
from fastdp.arguments import finite_number
from fastdp.callers import user_stacklevel
from fastdp.clipping import make_clipping
from fastdp.accounting.base import check_sample_rate
from fastdp.engine import GradSampleEngine
from fastdp.layers import UnsupportedModuleError
from fastdp.validate import grad_hook_problem


_MASK64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd: key + n * golden is distinct for every n < 2^64


# torch's global optimizer step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook).
_GLOBAL_STEP_HOOKS = (getattr(torch_optimizer_module, "_global_optimizer_pre_hooks", {}),
                      getattr(torch_optimizer_module, "_global_optimizer_post_hooks", {}))


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele et al. 2014), a bijection of 64-bit integers."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class _UnfinishedStep(NamedTuple):
    """A step that raised part-way, resumed by a retry on the same clipped sums: ``key`` is
    ``DPOptimizer._retry_key()`` after the last ``phase`` done ("closed": the loader's batch,
    "counted": by the accountant, at noise multiplier ``sigma``; "released": the noisy gradients)."""
    key: tuple
    phase: str
    sigma: Optional[float] = None


class DPOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` so that each ``step()`` is a DP-SGD step.

    Args:
        optimizer: any ``torch.optim`` optimizer over (a subset of) ``module``'s parameters.
        module: hooked in place; ``detach()`` restores it.
        noise_multiplier: sigma; noise std on the summed gradient is ``sigma * C``.
        max_grad_norm: C (per-layer clipping: one float, or one bound per parameter).
        expected_batch_size: the divisor of the noisy sum (Poisson: q * dataset size).
        loss_reduction: "mean" or "sum", how the loss reduces over the batch.
        clipping: "flat" (default), "per_layer" or "automatic" (Bu et al., ``C/(|g|+gamma)``).
        gamma: automatic clipping's stability constant (default 0.01).
        nonfinite: "raise" (default) or "skip" samples whose gradient has NaN/Inf.
        seed: seeds the noise for reproducible runs; ``None`` draws one from OS entropy.
        secure_mode: draw the noise with :func:`fastdp.secure.secure_noisy_average` (fresh
            OS entropy every step, hardened against floating-point attacks); no ``seed``.
    """

    _sums_across_ranks = False  # DistributedDPOptimizer: the step all-reduces the ranks' sums

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        module: nn.Module,
        noise_multiplier: float,
        max_grad_norm: Union[float, Sequence[float]],
        expected_batch_size: int,
        loss_reduction: str = "mean",
        clipping: str = "flat",
        gamma: float = 0.01,
        nonfinite: str = "raise",
        seed: Optional[int] = None,
        secure_mode: bool = False,
    ):
        if secure_mode and seed is not None:
            raise ValueError("secure_mode=True draws the noise from OS entropy: do not pass a seed")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise TypeError(
                f"{type(optimizer).__name__} needs a closure in step(): it evaluates the loss and its gradient "
                "several times per step (a line search), each a release of the data that one noisy step does not "
                "cover; use an optimizer that steps on one gradient (SGD, Adam, ...)")
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise TypeError("SparseAdam steps on sparse gradients only, and fastdp's are dense (noise reaches every "
                            "row: a sparse noisy gradient would show which rows the batch used); use Adam or AdamW")
        # torch.optim.Optimizer.__init__ is not called: state and groups are the wrapped ones.
        self.original_optimizer = optimizer
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self.noise_multiplier = noise_multiplier
        self.expected_batch_size = expected_batch_size
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        self._clipping_mode, self._gamma = clipping, gamma
        self.clipping = make_clipping(clipping, max_grad_norm, params, gamma)
        _check_noise_std(self.noise_multiplier, self.clipping)
        self._max_grad_norm = max_grad_norm
        if seed is not None:
            try:
                seed = operator.index(seed)
            except TypeError:
                raise TypeError(f"seed must be an integer, got {seed!r}") from None
        self._noise_key = (seed if seed is not None else int.from_bytes(os.urandom(8), "little")) & _MASK64
        self.secure_mode = bool(secure_mode)
        self.steps = 0
        self._steps_loaded = 0
        self._skip_next_step = False  # set by BatchMemoryManager for non-final chunks
        self._logical_batch_open = False  # a skipped step left clipped sums to keep
        self._step_hooks: List[Callable[["DPOptimizer"], None]] = []
        self.accountant = None
        self.loader = None  # the Poisson loader whose batches the steps take, once attached
        self._detached = False
        self._warned_samples = False  # more samples clipped in a step than its batch holds, said once
        self._unfinished: Optional[_UnfinishedStep] = None  # a step that raised part-way
        if hasattr(inspect.getattr_static(type(module), "zero_grad"), "__set__"):
            raise TypeError(f"{type(module).__name__}.zero_grad is a property (a data descriptor): fastdp cannot hook "
                            "it to drop clipped sums not yet stepped; define zero_grad as a method")
        # last: it hooks the module, so nothing after it may fail and leave the hooks behind
        self.engine = GradSampleEngine(module, params, self.clipping, loss_reduction, nonfinite)
        # seeds drawn per noise key and module: an optimizer rebuilt on the module with the same seed (after
        # detach()) continues the stream instead of releasing the earlier steps' noise again. Kept in this
        # process only (not on the module, which is pickled and copied), under a digest of the secret key
        self._draws_by_key = _NOISE_DRAWS.setdefault(module, {})
        self._noise_draws = self._draws_by_key.get(self._key_digest(), 0)  # seeds handed out: the next is f(key, draws)
        self._module_steps = _MODULE_STEPS.setdefault(module, [0])  # noisy steps on the module, by any optimizer
        self._earlier_steps = self._module_steps[0]
        self._hook_module_zero_grad(module)

    def _hook_module_zero_grad(self, module: nn.Module) -> None:
        """``module.zero_grad()`` also drops the clipped sums not yet stepped, as ``zero_grad()`` does
        (a loop calling the model's zero_grad, to drop a backward pass made for another purpose, saw that
        pass's sums released with the next step). A bound method: a copy of the module (an EMA) runs its
        plain zero_grad. A zero_grad the user set on the instance is left alone."""
        # as the class defines it (a function, or a staticmethod or classmethod: bound through its descriptor)
        plain, optimizer = inspect.getattr_static(type(module), "zero_grad"), weakref.ref(self)
        current = module.__dict__.get("zero_grad")
        inert = current is None or hasattr(current, "fastdp_module") or (  # ours: a copy's, a detached optimizer's
            current == plain.__get__(module, type(module)))  # an unpickled hooked module's: the class's, bound
        if not inert:
            return

        def zero_grad(owner, *args, **kwargs):  # the class's own signature (an override may take no set_to_none)
            out = plain.__get__(owner, type(owner))(*args, **kwargs)
            opt = optimizer()
            if owner is module and opt is not None and not opt._detached:
                opt._drop_unstepped_sums()
            return out

        zero_grad.fastdp_module, zero_grad.fastdp_optimizer = module, optimizer
        module.__dict__["zero_grad"] = types.MethodType(zero_grad, module)  # past a __setattr__ refusing new names

    # -- what torch.optim.Optimizer users and LR schedulers read --------------------------
    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @property
    def state(self):
        return self.original_optimizer.state

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    def add_param_group(self, param_group) -> None:
        raise NotImplementedError("fastdp: create a new DPOptimizer to privatise more parameters")

    def __repr__(self) -> str:
        return (f"DPOptimizer(noise_multiplier={self.noise_multiplier}, max_grad_norm="
                f"{self.max_grad_norm}, expected_batch_size={self.expected_batch_size}, "
                f"inner={self.original_optimizer!r})")

    # -- DP-SGD ----------------------------------------------------------------------------
    @property
    def max_grad_norm(self) -> Union[float, Sequence[float]]:
        """C. Setting it (a clipping-bound schedule) applies from the next backward pass, and the
        noise follows (sigma times the new sensitivity); only between a step and the next
        backward, so that one step's clipped sums and its noise share one bound."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: Union[float, Sequence[float]]) -> None:
        if self.engine.summed or self._logical_batch_open:
            raise RuntimeError(
                "max_grad_norm changed while clipped sums for the coming step exist (clipped to the old "
                "bound, the noise would be scaled for the new one): change it after step() and before the "
                "next backward()")
        clipping = make_clipping(self._clipping_mode, value, self.engine.params, self._gamma)
        _check_noise_std(self.noise_multiplier, clipping)
        self.clipping = self.engine.clipping = clipping
        self._max_grad_norm = value

    @property
    def noise_multiplier(self) -> float:
        """sigma, a finite number >= 0; settable between steps (the accountant records each step's)."""
        return self._noise_multiplier

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        value = finite_number(value, "noise_multiplier", zero_ok=True)
        if hasattr(self, "clipping"):  # not yet while __init__ runs, which checks once both are set
            _check_noise_std(value, self.clipping)
        self._noise_multiplier = value

    @property
    def expected_batch_size(self) -> float:
        """The divisor of the noisy sum: under Poisson sampling q N, a finite number > 0."""
        return self._expected_batch_size

    @expected_batch_size.setter
    def expected_batch_size(self, value: float) -> None:
        self._expected_batch_size = finite_number(
            value, "expected_batch_size (Poisson sampling: sample_rate * dataset size)")

    @property
    def noise_std(self) -> float:
        """Std of the Gaussian noise on the summed clipped gradient: sigma times the sensitivity."""
        return _noise_std(self.noise_multiplier, self.clipping)

    @property
    def skipped_samples(self) -> int:
        return self.engine.skipped_samples

    @property
    def loss_reduction(self) -> str:
        """How the loss reduces over the batch ("mean" or "sum"), fixed at construction."""
        return self.engine.loss_reduction

    def attach_step_hook(self, hook: Callable[["DPOptimizer"], None]) -> None:
        """Call ``hook(self)`` after every noisy step (not after the skipped steps of a
        ``BatchMemoryManager``'s chunks)."""
        self._step_hooks.append(hook)

    def attach_accountant(self, accountant, sample_rate: float) -> None:
        """Record every step with ``accountant`` (anything with ``step(noise_multiplier=,
        sample_rate=)``) at this optimizer's sigma and ``sample_rate``, before the step's noisy
        gradients are released: a step is counted even if it fails afterwards, never released
        uncounted."""
        rate = check_sample_rate(sample_rate, allow_zero=False)  # at 0 the accountant would report epsilon = 0
        recorded = getattr(accountant, "steps", None)  # fastdp's accountants count their steps
        if self.steps and not (isinstance(recorded, int) and recorded >= self.steps):
            raise ValueError(
                f"this optimizer has taken {self.steps} noisy steps, which this {type(accountant).__name__} has "
                f"not recorded ({'it records ' + str(recorded) if isinstance(recorded, int) else 'it cannot say'}): "
                "its epsilon would leave them out; attach the accountant before the first step, or record "
                "them in it first (accountant.step(noise_multiplier=..., sample_rate=..., num_steps=...) with "
                "the settings they ran at)")
        drawn = self._loader_rate()
        if drawn is not None and not math.isclose(rate, drawn, rel_tol=1e-12):
            raise ValueError(
                f"sample_rate={rate}, but the attached loader draws each example with probability {drawn}: the "
                "accountant must record the rate the batches are drawn at (to change it, attach the new loader "
                "first: attach_loader)")
        self.sample_rate = rate
        self.accountant = accountant

    def _loader_rate(self) -> Optional[float]:
        return None if self.loader is None else self.loader.batch_sampler.sample_rate

    def _account_step(self) -> None:
        if self.accountant is not None:
            if self._earlier_steps:
                self._check_earlier_steps_recorded()
            self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)

    def _check_earlier_steps_recorded(self) -> None:
        """Warn, once, where the accountant has not recorded the noisy steps earlier optimizers took
        on the module in this process (checked at the first step: an accountant attached or loaded
        since the optimizer was built may still bring them)."""
        recorded = getattr(self.accountant, "steps", None)
        if not (isinstance(recorded, int) and recorded >= self._earlier_steps + self.steps - self._steps_loaded):
            warnings.warn(
                f"the module took {self._earlier_steps} noisy steps under earlier DPOptimizers in this process, which "
                f"this {type(self.accountant).__name__} has not recorded: its epsilon covers this optimizer's steps "
                "only. If they trained on the same data, attach the earlier optimizer's accountant "
                "(optimizer.attach_accountant(earlier.accountant, sample_rate)), which goes on counting",
                UserWarning, stacklevel=user_stacklevel())
        self._earlier_steps = 0  # said once

    def attach_loader(self, loader) -> None:
        """Check at every step that the loop took exactly one batch of ``loader`` (a
        :class:`~fastdp.data.PoissonDataLoader`, e.g. ``make_private``'s) since the last step and
        that the step's backward passes all came from it (see
        :meth:`~fastdp.data.BatchLedger.close_step`). The accountant analyses one Poisson batch
        per step: gradients of several batches summed into one step can hold a sample several
        times (sensitivity up to k C), a batch skipped without a step (an empty one) reveals
        that it was empty, and a second step on one batch counts its samples twice. The count
        belongs to the loader: an optimizer attached after another one has stepped on it (rebuilt
        mid-epoch) continues it, and two optimizers stepping on each batch of one loader are
        refused (each accountant would see half the privacy cost)."""
        ledger = getattr(loader, "ledger", None)
        if ledger is None:
            raise TypeError(
                f"attach_loader needs a fastdp PoissonDataLoader (it counts the batches it hands out), got "
                f"{type(loader).__name__}: build it with fastdp.poisson_loader(data_loader) or make_private")
        if getattr(loader.batch_sampler, "world_size", 1) > 1 and not self._sums_across_ranks:
            raise ValueError("a distributed_poisson_loader hands out one rank's shard: a plain DPOptimizer would "
                             "neither all-reduce the ranks' clipped sums nor add the noise once; use "
                             "fastdp.DistributedDPOptimizer")
        if self.engine.step_passes or self._logical_batch_open:
            raise RuntimeError(
                "attach_loader between backward() and step(): the coming step releases a batch of the loader "
                "attached before, drawn at its rate, which the accountant would record at the new loader's; "
                "attach the new loader after step() (or call zero_grad() first to drop the pending batch)")
        rate = loader.batch_sampler.sample_rate
        if self.accountant is not None and not math.isclose(rate, self.sample_rate, rel_tol=1e-12):
            warnings.warn(
                f"the loader draws each example with probability {rate}, the accountant recorded {self.sample_rate} "
                f"per step so far: it records {rate} from the next step on (the noisy sum's divisor stays "
                f"expected_batch_size={self.expected_batch_size}; set it to {rate} x the dataset size if it should "
                "follow)", UserWarning, stacklevel=user_stacklevel())
            self.sample_rate = rate
        if not ledger.closed_once:
            ledger.restart(ledger.taken)
        self.loader = loader
        self.engine.ledger = ledger

    def _close_loader_step(self) -> None:
        """Close the step in the attached loader's ledger, which raises where the step took other than
        one new batch; closed either way (the next step starts from here)."""
        if self.loader is not None:
            ledger = self.loader.ledger
            handed = ledger.batch_samples if ledger.taken == ledger.stepped_at + 1 else None
            ledger.close_step(self.engine.step_batches)  # raises where the step took other than one new batch
            if handed is not None and self.engine.samples_seen > handed and not self._warned_samples:
                self._warned_samples = True
                warnings.warn(
                    f"this step clipped {self.engine.samples_seen} samples (rows) but its batch holds {handed}: "
                    "samples fed to the model in two backward passes (micro-batches that overlap, where no "
                    "trained layer sees the loader's tensors, e.g. behind a frozen first layer) are clipped "
                    "twice while the noise is scaled for once; ignore this for data that does not come from the "
                    "private dataset, such as a GAN's generated samples", UserWarning, stacklevel=user_stacklevel())

    def abandon_logical_batch(self) -> None:
        """Drop the clipped sums of a logical batch left before its last chunk (a loop over a
        BatchMemoryManager ended early): nothing of them was released, and a later step must
        not add them to another batch's."""
        if self._logical_batch_open or self._skip_next_step:
            self._skip_next_step = self._logical_batch_open = False
            self.engine.clear()

    def epsilon(self, delta: float) -> float:
        """Privacy spent so far, from the attached accountant."""
        if self.accountant is None:
            raise RuntimeError("no accountant attached: use fastdp.make_private or attach_accountant")
        return self.accountant.epsilon(delta)

    def next_seed(self) -> int:
        """The noise seed of the next step: ``splitmix64(key + n * golden)`` for the n-th draw, so
        no two draws of a run share a seed (a bijection of distinct inputs) and the stream is
        checkpointed by two integers. Pure Python: no tensor op on the step's critical path."""
        self._noise_draws += 1
        digest = self._key_digest()
        self._draws_by_key[digest] = max(self._draws_by_key.get(digest, 0), self._noise_draws)
        return _splitmix64(self._noise_key + self._noise_draws * _GOLDEN)

    def _key_digest(self) -> bytes:
        return hashlib.sha256(self._noise_key.to_bytes(8, "little")).digest()

    def noisy_average(self, sums: List[torch.Tensor], divisor: float,
                      dtypes: Optional[List[torch.dtype]] = None) -> List[torch.Tensor]:
        """``(sums + N(0, noise_std^2 I)) / divisor``, from the seeded stream or, in secure mode, OS entropy
        (rounded once from float64 to ``dtypes``, default the sums' own)."""
        if self.secure_mode:
            return secure.secure_noisy_average(sums, self.noise_std, divisor, dtypes)
        return ops.noisy_average(sums, self.noise_std, divisor, self.next_seed(), inplace=True)

    def privatise_grads(self) -> None:
        """Write ``(sum of clipped grads + N(0, (sigma C)^2)) / expected_batch_size`` into ``.grad``
        of every private parameter that still requires grad (frozen since: ``.grad = None``)."""
        sums = self.engine.sums()  # kept until released (a failure while noising them drops them: _dp_step)
        params = self.engine.params
        if not all(p.requires_grad for p in params):
            for p in params:
                if not p.requires_grad:
                    p.grad = None
            sums = [s for p, s in zip(params, sums) if p.requires_grad]
            params = [p for p in params if p.requires_grad]
        grads = self.noisy_average(sums, float(self.expected_batch_size), [p.dtype for p in params])
        for p, g in zip(params, grads):
            p.grad = g if g.dtype == p.dtype else g.to(p.dtype)  # half precision: rounded once, here
        self.engine.clear()
        self.engine.adopt_current_grads()

    def _check_trainable(self) -> None:
        """Refuse a parameter that trains in the wrapped optimizer but is not private: unfrozen or
        added (``add_param_group`` on the wrapped optimizer) after this optimizer was built, it
        gets no clipped gradient, or a raw one from autograd where its layer was not hooked."""
        private = self.engine._private_ids
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                hooked = grad_hook_problem(p, self.engine.names.get(p, "?"))
                if hooked is not None:
                    raise UnsupportedModuleError(hooked)
                if id(p) not in private:
                    raise UnsupportedModuleError(
                        f"parameter '{self.engine.names.get(p, '?')}' trains in the optimizer but did not when "
                        "the DPOptimizer was built (unfrozen, or added to the wrapped optimizer, since): fastdp "
                        "computes no clipped gradient for it, and a gradient autograd wrote would be neither "
                        "clipped nor noised; build the DPOptimizer again (detach() this one first) after "
                        "changing which parameters train")

    def step(self, closure=None):
        """A DP-SGD step; step pre/post hooks (this optimizer's and torch's global ones) run around
        it as for any torch.optim optimizer (through torch's wrapper, only when there are hooks:
        its profiler range costs about 9 us a step)."""
        if (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                or _GLOBAL_STEP_HOOKS[0] or _GLOBAL_STEP_HOOKS[1]):
            return _STEP_WITH_HOOKS(self, closure)
        return self._dp_step(closure)

    def _dp_step(self, closure=None):
        if self._detached:
            raise RuntimeError("this DPOptimizer was detached (detach()) and can no longer step privately: build a "
                               "new one on the module")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._skip_next_step:
            self._skip_next_step, self._logical_batch_open = False, True
            return loss
        self._logical_batch_open = False
        # checks that refuse the step before the loader's count closes it: fixed, it can be retried
        self._check_trainable()
        self.engine.check_foreign_grads()  # also where no hooked layer ran, so no backward callback did
        self.check_noise_fits_parameters()
        self._check_ranks_agree()
        # A step that raised after its batch was closed (the accountant raising, the wrapped optimizer
        # failing) resumes where it stopped if retried on the same clipped sums, before any other pass or
        # batch: the batch is not closed or counted twice, its sums released once.
        key = self._retry_key()
        done = self._unfinished.phase if self._unfinished is not None and self._unfinished.key == key else None
        if done is None:
            self._close_loader_step()
            self._unfinished = _UnfinishedStep(key, "closed")
        if done in (None, "closed"):
            self._account_step()
            self._unfinished = _UnfinishedStep(key, "counted", self.noise_multiplier)
        if done != "released":
            if self._unfinished.sigma != self.noise_multiplier:
                raise ValueError(
                    f"this step was counted at noise_multiplier={self._unfinished.sigma} before it failed; releasing it "
                    f"at {self.noise_multiplier} would not be what the accountant recorded: set noise_multiplier "
                    "back to retry it, or call zero_grad() to give it up (it stays counted)")
            try:
                self.privatise_grads()
            except BaseException:
                # the noise is written into the sums in place, tensor by tensor: partly noised and divided, they
                # are dropped. A retry releases noise only, counted again (conservative)
                self.engine.clear()
                raise
            self._unfinished = self._unfinished._replace(key=self._retry_key(), phase="released")
        self.original_optimizer.step()
        self._unfinished = None
        self.steps += 1
        self._module_steps[0] += 1
        for hook in self._step_hooks:
            hook(self)
        return loss

    def resumable_failed_step(self) -> bool:
        """A step raised part-way and a retry of ``step()`` would resume it (nothing changed since)."""
        return self._unfinished is not None and self._unfinished.key == self._retry_key()

    def _retry_key(self) -> tuple:
        """What a retried step must find unchanged since it failed: the clipped sums (any backward pass
        or zero_grad() changes their generation) and the batches the loader handed out."""
        return self.engine.generation, None if self.loader is None else self.loader.ledger.taken

    def _check_ranks_agree(self) -> None:
        """One process: nothing to compare (see DistributedDPOptimizer)."""

    def check_noise_fits_parameters(self) -> None:
        """Raise ValueError if the noise would overflow a private parameter's dtype (its coordinates,
        std / expected_batch_size, past float16's 65504: a "no clipping" bound of 1e6), or if its std
        is one the kernels, which scale float32 and half sums in float32, would turn into Inf or 0 (no
        noise). ``step()`` checks this before the step is counted; call it to fail before training."""
        std = _noise_std(self.noise_multiplier, self.clipping)
        spread = 64.0 * std / self.expected_batch_size  # 64 std
        # secure mode forms the noise in float64 and rounds it once: only the kernels' float32 std z can overflow
        highest = _FLOAT32_MAX if self.secure_mode else ops.FLOAT32_NOISE_STD_MAX
        if spread <= _SMALLEST_FLOAT_MAX and (std == 0 or _FLOAT32_TINY <= std <= highest):
            return  # fits every floating dtype: no pass over the parameters each step
        for dtype in {p.dtype for p in self.engine.params if p.requires_grad}:
            if spread > torch.finfo(dtype).max:
                raise ValueError(
                    f"the noise on the {dtype} parameters (std {spread / 64:.3g} per coordinate: noise_multiplier "
                    "times the clipping sensitivity over expected_batch_size) would overflow their dtype: lower "
                    "max_grad_norm (or noise_multiplier), or train in a wider dtype")
            if dtype != torch.float64 and std > 0 and not _FLOAT32_TINY <= std <= highest:
                raise ValueError(
                    f"the noise std on the sum, {std:.3g} (noise_multiplier times the clipping sensitivity), is "
                    f"outside float32's normal range, in which the {dtype} parameters' noise is formed (std at "
                    f"most {highest:.3g}, where std z stays finite): it would become Inf or 0 (no noise); change "
                    "max_grad_norm or noise_multiplier, or train in float64")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients and drop clipped sums not yet stepped (kept
        while a logical batch is open, see :meth:`signal_skip_step`)."""
        self.original_optimizer.zero_grad(set_to_none)
        self._drop_unstepped_sums()

    def _drop_unstepped_sums(self) -> None:
        if not self._logical_batch_open:
            self.engine.clear()
        self.engine.adopt_current_grads()

    def signal_skip_step(self, skip: bool = True) -> None:
        """``skip=True``: the next ``step()`` only keeps the clipped sums (a non-final chunk of a
        logical batch) and ``zero_grad()`` keeps them until a real step has run."""
        self._skip_next_step = bool(skip)

    def detach(self) -> None:
        """Remove every hook from the module; this optimizer can no longer step privately."""
        self.engine.detach()
        module = self.engine.module
        ours = getattr(module.__dict__.get("zero_grad"), "fastdp_optimizer", lambda: None)()
        if ours is self:  # not a later optimizer's, after an earlier detach()
            del module.__dict__["zero_grad"]
        self._detached = True

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a DPOptimizer cannot be copied or pickled: a copy would hook the same module and draw the same noise "
            "(its secret key), and it holds the module's hooks; save optimizer.state_dict() (or use "
            "fastdp.checkpoint) and build a new DPOptimizer to load it into")

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self, include_secrets: bool = False):
        """The wrapped optimizer's state, the step count, the accountant's history and how many
        noise seeds were drawn. The noise key is secret (with it anyone can subtract every
        step's noise): it is left out unless ``include_secrets`` (never publish such a state).
        Without it a resumed optimizer keeps its own key: the same noise if it was built with
        the same ``seed``, fresh noise otherwise."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        seeds = {"draws": self._noise_draws}
        if include_secrets:
            seeds["key"] = self._noise_key
        saves_history = hasattr(self.accountant, "state_dict")  # not a bare step-recording object
        state = {
            "optimizer": self.original_optimizer.state_dict(),
            "steps": self.steps,
            "noise_seed_state": seeds,
            "accountant": self.accountant.state_dict() if saves_history else None,
            "param_names": self._group_param_names(),
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            state = post_hook(self, state) or state
        return state

    def load_state_dict(self, state_dict) -> None:
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre_hook(self, state_dict) or state_dict
        self._load_state(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _group_param_names(self) -> List[List[str]]:
        """The module's name of each parameter of each group of the wrapped optimizer."""
        names = self.engine.names
        return [[names.get(p, "?") for p in group["params"]] for group in self.original_optimizer.param_groups]

    def _check_param_order(self, saved_names: Optional[List[List[str]]], saved: dict) -> None:
        """torch's load gives the saved per-parameter state (momentum, Adam's moments) and each group's
        settings to the parameters by position: refuse a state whose parameters are ours in another order
        (groups built in another order) where that hands a parameter another one's state or settings
        (it got their momentum, or its next step crashed after it was counted). Renamed parameters
        (another module layout) are not checked here."""
        ours = sum(self._group_param_names(), [])
        flat = sum(saved_names or [], [])
        if saved_names is None or flat == ours or sorted(flat) != sorted(ours):
            return
        try:  # per position: the settings and state torch's load puts there
            at = [(repr(sorted((k, v) for k, v in group.items() if k not in ("params", "param_names"))),
                   bool(saved["state"].get(index))) for group in saved["param_groups"] for index in group["params"]]
        except (AttributeError, KeyError, TypeError):
            return  # not a torch layout: torch's load decides
        if len(at) != len(flat):
            return  # torch refuses it
        had = dict(zip(flat, at))  # what each parameter had
        moved = [name for name, was, here in zip(ours, flat, at)
                 if name != was and (here[1] or had[name][1] or here[0] != had[name][0])]
        if moved:
            raise ValueError(
                f"the state's optimizer holds this module's parameters in another order (groups {saved_names} "
                f"against this optimizer's {self._group_param_names()}): torch would load another parameter's "
                f"state or group settings into {moved[:4]}; build the optimizer's parameter groups in the order of "
                "the run that saved it")

    def _check_wrapped_state(self, state) -> None:
        """Refuse the state of another optimizer type before torch's load, which replaces the groups
        first and raises after, or not at all (an SGD state in an Adam left it without betas, its next
        step counted and then failing). The saved groups' settings, with what the wrapped optimizer's
        ``__setstate__`` fills in for states of older torch versions, must cover its own."""
        saved = state.get("param_groups") if isinstance(state, dict) else None
        groups = self.original_optimizer.param_groups
        if not isinstance(saved, list) or len(saved) != len(groups) or not all(isinstance(g, dict) for g in saved):
            return  # torch refuses these before changing anything
        kind = type(self.original_optimizer)
        probe = kind.__new__(kind)
        probe.defaults = {}
        try:
            probe.__setstate__({"state": {}, "param_groups": [{**g, "params": []} for g in saved]})
        except Exception:  # an optimizer whose __setstate__ needs more than torch's do: torch's load decides
            return
        # the optimizer's own settings: not a scheduler's (initial_lr) or the user's keys, nor param_names,
        # which torch's load carries over from the groups it loads into
        settings = set(self.original_optimizer.defaults) - {"param_names"}
        missing = sorted(settings - {k for group in probe.param_groups for k in group})
        if missing:
            raise ValueError(
                f"the state's wrapped optimizer has no {missing} in its parameter groups: it is not a state of "
                f"this {type(self.original_optimizer).__name__} (a checkpoint of another optimizer type?); wrap the "
                "optimizer the checkpoint was taken with")

    def _load_state(self, state_dict) -> None:
        if not isinstance(state_dict, dict) or "noise_seed_state" not in state_dict:
            raise ValueError(
                "not a fastdp DPOptimizer state (it has no 'noise_seed_state'; a plain torch or Opacus optimizer "
                "state holds no accountant history or noise stream): load such a state into the wrapped optimizer "
                "(optimizer.original_optimizer.load_state_dict) and restore the privacy accounting separately")
        seeds = state_dict["noise_seed_state"]
        if not isinstance(seeds, dict):
            raise ValueError("this optimizer state was written by an older fastdp, whose noise seeds came from a "
                             "torch.Generator: it cannot resume the same noise stream; resume with that version "
                             "or start the run again")
        draws, key = int(seeds["draws"]), seeds.get("key")
        self._check_wrapped_state(state_dict["optimizer"])
        self._check_param_order(state_dict.get("param_names"), state_dict["optimizer"])
        history = state_dict.get("accountant")
        if history is not None and self.accountant is None and getattr(self, "rank", 0) == 0:
            raise ValueError("the state holds an accountant history but this optimizer has no accountant: "
                             "attach one first (make_private or attach_accountant) so that epsilon continues from it")
        from fastdp.accounting.base import Accountant  # not at import: the package loads SciPy
        restorable = hasattr(self.accountant, "load_state_dict")
        ours = isinstance(self.accountant, Accountant)  # a fastdp accountant: its state's layout is known
        recorded = history.get("history") if ours and isinstance(history, dict) else history
        if restorable and state_dict["steps"] > 0 and not recorded:
            raise ValueError("the state has steps but no accountant history: epsilon would restart from zero")
        if history is not None and self.accountant is not None and not restorable:
            raise ValueError(f"the state holds an accountant history that {type(self.accountant).__name__} "
                             "cannot load: attach a fastdp accountant")
        if history is not None and ours:  # refused here, before anything of this optimizer changed
            loaded = copy.deepcopy(self.accountant)
            loaded.load_state_dict(history)
            if self.accountant.steps and self.accountant.history != loaded.history:  # not a plain rollback
                warnings.warn(
                    f"loading replaces the {self.accountant.steps} steps this optimizer's accountant recorded "
                    "with the state's history: their privacy cost is forgotten, which is sound only if nothing "
                    "computed from them (weights, losses, metrics) is ever released",
                    UserWarning, stacklevel=user_stacklevel())
        self.original_optimizer.load_state_dict(state_dict["optimizer"])
        self.steps = self._steps_loaded = state_dict["steps"]  # a resume's steps: counted in _earlier_steps too
        if history is not None and restorable:
            self.accountant.load_state_dict(history)
        self._noise_draws = draws
        if key is not None:
            self._noise_key = int(key)
        # clipped sums of backward passes run before the load belong to the abandoned run (a rollback
        # between backward() and step()): stepped with the reloaded loader's batch, its samples would count twice
        self.engine.clear()
        self._skip_next_step = self._logical_batch_open = False
        self._unfinished = None  # a step that failed before the load is not resumed after it


_SMALLEST_FLOAT_MAX = float(torch.finfo(torch.float16).max)  # the smallest of the dtypes parameters train in
_FLOAT32_TINY, _FLOAT32_MAX = ops.FLOAT32_NORMAL_RANGE


def _noise_std(sigma: float, clipping) -> float:
    return 0.0 if sigma == 0 else sigma * clipping.sensitivity


def _check_noise_std(sigma: float, clipping) -> None:
    """Refuse a noise std that is not a finite float (sigma times a huge bound): found at the
    step, it would come after the step was counted."""
    if not math.isfinite(_noise_std(sigma, clipping)):
        raise ValueError(f"the noise std, noise_multiplier ({sigma}) times the clipping sensitivity "
                         f"({clipping.sensitivity}), overflows a float: lower max_grad_norm or noise_multiplier")


# module -> {digest of a noise key: seeds drawn under it}, for as long as the module lives
_NOISE_DRAWS: "weakref.WeakKeyDictionary[nn.Module, Dict[bytes, int]]" = weakref.WeakKeyDictionary()
# module -> [noisy steps taken on it by any DPOptimizer], for as long as the module lives
_MODULE_STEPS: "weakref.WeakKeyDictionary[nn.Module, List[int]]" = weakref.WeakKeyDictionary()

_STEP_WITH_HOOKS = torch.optim.Optimizer.profile_hook_step(DPOptimizer._dp_step)
