"""DP-SGD over ``torch.distributed`` (data parallel, any backend; tested with gloo).

Conventions:

* Sampling: rank r owns the shard ``r, r + W, r + 2W, ...`` of the N examples and
  Poisson-samples it with the GLOBAL rate q. The union over ranks is exactly one Poisson
  batch of the whole dataset with rate q (expected size q N); a rank may get no
  examples (it still takes part in every step). All ranks share one seed (rank 0's,
  broadcast) and draw from per-rank streams of it.
* Clipping: each rank clips its own examples (the engine, unchanged).
* Reduction: the clipped sums are all-reduced (SUM) in one flat buffer per dtype and device.
* Noise: **rank 0 adds all of it**, N(0, sigma^2 C^2), to its local sum before the
  all-reduce; the other ranks add none. The reduced sum therefore carries the noise
  exactly once, every rank receives the identical noisy sum, and with the same seed a
  W-rank run draws the very noise a 1-rank run would.
* Division: by the GLOBAL expected batch size q N, passed as ``expected_batch_size``.
* Accounting: on rank 0 only (``attach_accountant`` is a no-op elsewhere).

Do not wrap the model in ``DistributedDataParallel``: its hooks all-reduce ordinary
gradients, which the engine never produces. The optimizer broadcasts rank 0's
parameters and buffers once at construction so that all replicas start equal.
"""
from __future__ import annotations

import hashlib
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import ConcatDataset, DataLoader, Subset

from fastdp.data import PoissonBatchSampler, PoissonDataLoader, _loader_kwargs, dataset_and_rate
from fastdp.optimizer import DPOptimizer
from fastdp.secure import os_entropy


def _rank_world(rank: Optional[int], world_size: Optional[int], group=None):
    if rank is None or world_size is None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call init_process_group, or pass rank and world_size")
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a world of {world_size}")
    return int(rank), int(world_size)


def _digest(value) -> float:
    """48 bits of a SHA-256 of ``repr(value)``, exact in float64 (for a MAX all-reduce)."""
    return float(int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:6], "little"))


def _dataset_fingerprint(dataset) -> tuple:
    """What tells two ranks' datasets apart without reading an example: each level's type and size (where
    it has one) down ``Subset`` and ``ConcatDataset`` wrappers, and a digest of each ``Subset``'s indices."""
    level = (type(dataset).__name__, len(dataset) if hasattr(type(dataset), "__len__") else None)
    if isinstance(dataset, Subset):
        indices = hashlib.sha256(np.asarray(dataset.indices, dtype=np.int64).tobytes()).hexdigest()
        return level, indices, _dataset_fingerprint(dataset.dataset)
    if isinstance(dataset, ConcatDataset):
        return level, tuple(_dataset_fingerprint(part) for part in dataset.datasets)
    return (level,)


def _first_rank(group) -> int:
    """The global rank of ``group``'s rank 0 (the default group's: 0)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


class DistributedPoissonBatchSampler(PoissonBatchSampler):
    """This rank's share of a Poisson batch with rate q over ``num_samples`` examples: global
    indices of its shard ``rank::world_size``, each included with probability q.

    ``rank``/``world_size`` default to ``process_group``'s (the default group's). ``seed=None``
    takes the group's rank 0's seed (OS entropy) by broadcast within the group;
    ``secure_mode=True`` draws every batch from fresh OS entropy on every rank.
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: Optional[int] = None,
                 seed: Optional[int] = None, secure_mode: bool = False,
                 rank: Optional[int] = None, world_size: Optional[int] = None, process_group=None):
        if num_samples <= 0:
            raise ValueError(f"Poisson sampling needs a non-empty dataset, got {num_samples} samples")
        self.rank, self.world_size = _rank_world(rank, world_size, process_group)
        self.global_samples = int(num_samples)
        if seed is None and not secure_mode and dist.is_initialized():
            box = [os_entropy(128)]
            dist.broadcast_object_list(box, src=_first_rank(process_group), group=process_group)
            seed = box[0]
        shard = len(range(self.rank, self.global_samples, self.world_size))
        self._setup(shard, sample_rate, steps, seed, secure_mode)

    @property
    def stream(self) -> tuple:
        return (self.rank,)

    def _settings(self, state=None):
        """Global, so that every rank loads the state rank 0 saved (the shards differ in size), at any
        number of ranks: whatever their number, the union of the ranks' batches is one Poisson batch of
        the dataset at rate q, which is what the accountant analyses. A state written before global
        sizes (no ``world_size``) that does not hold the dataset's size holds this rank's shard size."""
        settings = {**super()._settings(), "num_samples": self.global_samples}
        if state is not None and "world_size" not in state and state.get("num_samples") != self.global_samples:
            settings["num_samples"] = self.num_samples
        return settings

    def state_dict(self, include_secrets: bool = False):
        """As :class:`PoissonBatchSampler`'s, with the dataset's size and the number of ranks."""
        return {**super().state_dict(include_secrets), "world_size": self.world_size}

    def batch(self, n: int) -> List[int]:
        """Global indices of this rank's share of batch ``n`` (a Poisson draw from its shard)."""
        return [self.rank + self.world_size * j for j in super().batch(n)]


def distributed_poisson_loader(data_loader: DataLoader, sample_rate: Optional[float] = None,
                               steps: Optional[int] = None, seed: Optional[int] = None,
                               secure_mode: bool = False, rank: Optional[int] = None,
                               world_size: Optional[int] = None, process_group=None) -> PoissonDataLoader:
    """This rank's Poisson loader over ``data_loader``'s (full) dataset. The default rate is
    ``batch_size / N``: ``batch_size`` is the GLOBAL expected batch size, each rank
    receiving about ``batch_size / world_size`` examples per step. ``process_group``: the
    DistributedDPOptimizer's, where it is not the default group."""
    dataset, n, sample_rate = dataset_and_rate(data_loader, sample_rate)
    sampler = DistributedPoissonBatchSampler(n, sample_rate, steps, seed, secure_mode, rank, world_size,
                                             process_group)
    return PoissonDataLoader(dataset, sampler, collate_fn=data_loader.collate_fn,
                             **_loader_kwargs(data_loader))


class DistributedDPOptimizer(DPOptimizer):
    """:class:`DPOptimizer` whose step all-reduces the clipped sums of all ranks, rank 0
    adding the noise (see the module's conventions). ``expected_batch_size`` is the GLOBAL
    q N. ``process_group`` defaults to the default group. Call :meth:`attach_loader` with this
    rank's :func:`distributed_poisson_loader` to have each step checked to take one batch."""

    _sums_across_ranks = True
    _dataset_digest = -1.0  # of the attached loader's dataset (_dataset_fingerprint); -1: none attached

    def __init__(self, optimizer: torch.optim.Optimizer, *, process_group=None, **kwargs):
        if not dist.is_initialized():
            raise RuntimeError("DistributedDPOptimizer needs torch.distributed.init_process_group first")
        self.process_group = process_group
        self.rank, self.world_size = _rank_world(None, None, process_group)
        super().__init__(optimizer, **kwargs)
        try:
            self._broadcast_state(_first_rank(process_group))
        except BaseException:  # refused with the module hooked: leave it as it was, so that it can be built again
            self.detach()
            raise

    def _broadcast_state(self, src: int) -> None:
        """Every rank starts from rank ``src``'s parameters and buffers. gloo sends a tensor's
        elements from its first one on, ignoring strides: a view with gaps (a column slice) goes
        through a contiguous copy; one whose elements share memory (``expand``) cannot take
        another rank's values and is refused."""
        module = self.engine.module
        with torch.no_grad():
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                data = t.data
                if data.is_contiguous():
                    dist.broadcast(data, src=src, group=self.process_group)
                    continue
                if torch._debug_has_internal_overlap(data) == 1:
                    raise ValueError(
                        f"{name} is an expanded view (several of its elements share memory), which rank 0's values "
                        "cannot be copied into: register a tensor of its own (.clone()) before building the optimizer")
                copy = data.contiguous()
                dist.broadcast(copy, src=src, group=self.process_group)
                data.copy_(copy)

    def attach_accountant(self, accountant, sample_rate: float) -> None:
        """Rank 0 records the steps; the other ranks keep no accountant."""
        if self.rank == 0:
            super().attach_accountant(accountant, sample_rate)

    def attach_loader(self, loader) -> None:
        """Only this rank's shard loader (:func:`distributed_poisson_loader` with this group's rank and
        size): a loader of the whole dataset on every rank would put each sample in the sum up to
        world_size times (sensitivity up to W C) with noise for C."""
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, DistributedPoissonBatchSampler) or \
                (sampler.rank, sampler.world_size) != (self.rank, self.world_size):
            got = (f"rank {sampler.rank} of {sampler.world_size}" if isinstance(sampler, DistributedPoissonBatchSampler)
                   else type(sampler).__name__)
            raise ValueError(
                f"DistributedDPOptimizer (rank {self.rank} of {self.world_size}) needs this rank's shard loader: "
                f"fastdp.distributed_poisson_loader(data_loader, rank={self.rank}, world_size={self.world_size}); "
                f"got {got} (a loader of the whole dataset on every rank puts each sample in the sum several times)")
        super().attach_loader(loader)
        self._dataset_digest = _digest(_dataset_fingerprint(loader.dataset))

    def epsilon(self, delta: float) -> float:
        if self.rank != 0:
            raise RuntimeError("the accountant lives on rank 0: ask rank 0 for epsilon")
        return super().epsilon(delta)

    def _check_ranks_agree(self) -> None:
        """Refuse a step (on every rank, before it is counted) where the ranks clip or divide differently:
        rank 0's noise covers rank 0's sensitivity only, and replicas dividing by different sizes drift apart.
        One small MAX all-reduce of each setting and its negation (so both the largest and smallest arrive).
        First, on this rank alone: a retry of a step that failed midway, which may find the ranks out of step."""
        if self.resumable_failed_step():
            raise RuntimeError(
                "a step that failed midway cannot be retried in a data-parallel run (a rank that failed alone left "
                "the others in their collectives): give it up with zero_grad() on every rank, or restart the ranks "
                "from a checkpoint")
        # the sums are added element by element in flat buffers: every rank must list the same parameters in the
        # same order (an optimizer built from a set() orders them by id(), which differs between processes)
        params = [(self.engine.names.get(p, "?"), tuple(p.shape), p.dtype, p.requires_grad)
                  for p in self.engine.params]
        rate = self._loader_rate()
        named = {"the clipping sensitivity (max_grad_norm)": self.clipping.sensitivity,
                 "expected_batch_size": float(self.expected_batch_size),
                 # rank 0's accountant counts its own loader's rate: every rank's must draw at it
                 "the attached loader's sample rate (-1: none attached)": -1.0 if rate is None else float(rate)}
        digests = {"the clipping settings (clipping mode, per-layer bounds, gamma or loss_reduction)":
                       _digest((self.clipping.settings(), self.engine.loss_reduction)),
                   "the private parameters (their names, shapes, dtypes, requires_grad, and order in the optimizer)":
                       _digest(params),
                   # rank r samples indices r, r + W, ... of its own dataset: every rank must hold the same examples
                   # in the same order, or one lands in several ranks' shards (sensitivity above C) and others in none
                   "the attached loaders' datasets (their sizes, or Subset indices: a split drawn with a per-rank "
                   "seed?), which must hold the same examples in the same order on every rank (-1: none attached)":
                       self._dataset_digest}
        settings = [*named.items(), *digests.items()]
        values = torch.tensor([v for _, x in settings for v in (x, -x)], dtype=torch.float64,
                              device=self.engine.params[0].device if self.engine.params else "cpu")
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.process_group)
        for i, (name, _) in enumerate(settings):
            high, low = values[2 * i].item(), -values[2 * i + 1].item()
            if high != low:
                spread = "" if name in digests else f" (from {low:.6g} to {high:.6g})"
                raise ValueError(
                    f"the ranks disagree on {name}{spread}: every rank must clip, divide and sample as rank 0 "
                    "does, whose noise and accountant cover only its own settings; set the same values on all "
                    "ranks, then step again")

    def noisy_average(self, sums: List[torch.Tensor], divisor: float,
                      dtypes: Optional[List[torch.dtype]] = None) -> List[torch.Tensor]:
        """All-reduce of the local clipped sums, rank 0's carrying all the noise, over ``divisor``;
        in the sums' dtype throughout (``dtypes`` unused: the optimizer rounds the result once)."""
        local = super().noisy_average(sums, 1.0) if self.rank == 0 else sums
        buckets: Dict[tuple, List[int]] = {}
        for i, s in enumerate(local):
            buckets.setdefault((s.dtype, s.device), []).append(i)
        out: List[torch.Tensor] = [None] * len(local)
        for idx in buckets.values():
            flat = torch.cat([local[i].reshape(-1) for i in idx])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            flat.div_(divisor)
            for i, part in zip(idx, flat.split([local[i].numel() for i in idx])):
                out[i] = part.view_as(local[i])
        return out
