"""Poisson sampling and physical batching for DP-SGD.

* :class:`PoissonBatchSampler`: every example joins a batch independently with
  probability q. A batch is drawn in O(batch size): its size from Binomial(N, q), then a
  uniform subset of that size (Floyd's algorithm), never a pass over all N examples.
  Batch ``n`` is a pure function of ``(seed, n)``, so a run resumes bit-identically
  from ``(seed, position)``. ``secure_mode=True`` instead draws every batch from a fresh
  generator seeded with 256 bits of OS entropy (not reproducible, not predictable).
* Empty batches are yielded as zero-length tensors shaped like a real batch
  (:class:`EmptySafeCollate`): the step still runs, adds noise and counts for the
  accountant.
* :class:`SampleDimsCollate` tells, with each batch, which dim of each tensor holds its
  samples (:func:`sample_dims`), for the engine's check that each row a layer sees is one.
* :class:`BatchMemoryManager` cuts each logical (Poisson) batch into physical chunks of
  at most ``max_physical_batch_size`` and makes the optimizer take one noisy step per
  logical batch.
"""
from __future__ import annotations

import hashlib
import math
import operator
import random
import warnings
import weakref
from collections import deque
from collections.abc import Mapping
from itertools import repeat
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler,
                              SequentialSampler, SubsetRandomSampler)
from torch.utils.data._utils.collate import default_collate

from fastdp.accounting.base import check_sample_rate
from fastdp.callers import user_stacklevel
from fastdp.identity import TensorMap
from fastdp.layout import SampleLayout
from fastdp.secure import os_entropy


def uniform_subset(rng: np.random.Generator, population: int, size: int) -> List[int]:
    """``size`` distinct integers drawn uniformly from ``range(population)`` (Floyd), O(size)."""
    chosen = set()
    for j in range(population - size, population):
        t = int(rng.integers(0, j + 1))
        chosen.add(j if t in chosen else t)
    out = list(chosen)
    rng.shuffle(out)
    return out


# digest of (seed, stream, dataset size) -> [batches of it that steps released in this process (the highest index + 1)]
_BATCHES_RELEASED: Dict[bytes, List[int]] = {}


def _memory_of(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


SHARED = "shared"  # a collated tensor's sample dim where it has none: what all samples share (positions)
SampleDim = Tuple[int, Union[int, str, None]]  # (dims of the tensor, its sample dim, SHARED, or None: untold)
UNTOLD: SampleDim = (-1, None)


def _global_generators() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def _restore_generators(state: tuple) -> None:
    cpu, cuda, numpy_state, python_state = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    np.random.set_state(numpy_state)
    random.setstate(python_state)


def probe_collate(collate_fn: Callable, example: Any) -> Tuple[Any, Any]:
    """``example`` collated alone and twice over, each from the same state of the global random
    generators (torch's CPU and initialised CUDA ones, numpy's, Python's), which are left as they
    were: a collate drawing from them (a random crop) draws alike in both."""
    state = _global_generators()
    try:
        one = collate_fn([example])
        _restore_generators(state)
        return one, collate_fn([example, example])
    finally:
        _restore_generators(state)


def sample_dims(one: Any, two: Any) -> Optional[List[SampleDim]]:
    """Per tensor of a collated batch (in :func:`_tensors_in`'s order), where its samples lie, told
    from the batch collated from one example (``one``) and from two (``two``): the one dim that
    is one longer in ``two``; :data:`SHARED` where the shapes agree and hold elements; else
    untold. None where the two batches hold different numbers of tensors, or where no tensor grew
    (a collate that drops the example, or merges repeated ones)."""
    ones, twos = list(_tensors_in(one)), list(_tensors_in(two))
    if len(ones) != len(twos):
        return None
    dims = []
    for a, b in zip(ones, twos):
        grown = [k for k, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
        if a.dim() != b.dim() or (not grown and not a.numel()):  # an example the collate dropped tells nothing
            dims.append(UNTOLD)
        elif not grown:
            dims.append((a.dim(), SHARED))
        else:
            k = grown[0]
            dims.append((a.dim(), k if len(grown) == 1 and b.shape[k] == a.shape[k] + 1 else None))
    return dims if any(isinstance(k, int) for _, k in dims) else None


def _fully_told(dims: Optional[List[SampleDim]]) -> bool:
    """Whether :func:`sample_dims` placed every tensor (a sample dim, or shared)."""
    return dims is not None and all(isinstance(k, int) or k == SHARED for _, k in dims)


def _batch_length_dims(t: torch.Tensor, size: Optional[int]) -> Optional[frozenset]:
    """The dims of strided ``t`` that are ``size`` long (the batch's sampled count); None where that
    tells nothing: no count, an empty batch (whose shapes are made up), or a tensor without elements (a
    collate that dropped every example: nothing was read from it)."""
    if not size or not t.numel() or t.layout != torch.strided or t.is_nested:
        return None
    return frozenset(j for j, n in enumerate(t.shape) if n == size)


def _samples_first(t: torch.Tensor, dim: SampleDim, size: Optional[int]) -> Tuple[Optional[torch.Tensor], str, bool]:
    """``(t with its samples on dim 0, or None where it holds no row per sample; how they were found;
    whether its rows may not all be samples)``: ``dim`` from :func:`sample_dims` (``"told"``); where
    that does not tell, guessed from the lengths (``"guessed"``): dim 0 if it is ``size`` long (the
    batch's sampled count), else the one dim that is, else dim 0 (rows of items the collate
    dropped, or of what the samples share); ``"unclear"`` where two dims are."""
    ndim, k = dim
    if t.dim() == 0 or (ndim == t.dim() and k == SHARED):
        return None, "", False
    if ndim == t.dim() and isinstance(k, int):
        return (t.movedim(k, 0) if k else t), "told", False
    if size is None:
        return t, "guessed", False
    lengths = [j for j, n in enumerate(t.shape) if n == size]
    how = "unclear" if len(lengths) > 1 else "guessed"
    if t.shape[0] == size or t.layout != torch.strided or t.is_nested:
        return t, how, False
    return (t.movedim(lengths[0], 0), how, False) if len(lengths) == 1 else (t, how, True)


class _LengthsSeen:
    """For one tensor of a collate's batches (by its path in the batch and its rank), the dims that had
    the batch's length on every batch where its samples were guessed and it held elements, and the
    sampled counts at which one dim alone had it: where that leaves one dim, found alone at two counts
    at least, it is where the samples lie when two dims have the batch's length (a time-first (T, B)
    tensor at B = T). The sample dim follows every count; a dim of fixed length (T) matches only one,
    and a collate that drops or merges examples leaves the sample dim shorter, so it drops out."""

    __slots__ = ("dims", "counts")

    def __init__(self) -> None:
        self.dims: Optional[frozenset] = None
        self.counts: set = set()  # at most two: all that is asked of them

    def add(self, lengths: frozenset, size: int) -> None:
        self.dims = lengths if self.dims is None else self.dims & lengths
        if len(lengths) == 1 and len(self.counts) < 2:
            self.counts.add(size)

    def sample_dim(self, t: torch.Tensor, size: int) -> Optional[int]:
        """The dim of ``t`` (of the batch's length) where its samples lie, if the batches before told."""
        if self.dims is None or len(self.dims) != 1 or len(self.counts) < 2:
            return None
        (k,) = self.dims
        return k if k < t.dim() and t.shape[k] == size else None


class _OnRoot:
    """The tensors of one batch (or chunk) on one memory, samples on dim 0, by how they were found."""

    __slots__ = ("told", "guesses", "unclear", "foreign")

    def __init__(self) -> None:
        self.told: List[torch.Tensor] = []
        self.guesses: List[torch.Tensor] = []
        # guesses with two dims of the batch's length: (read on dim 0, read where earlier batches found the samples)
        self.unclear: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        self.foreign = False  # a guess whose rows may not all be samples

    def layout(self, batch: int) -> Optional[SampleLayout]:
        """Guesses beside told tensors label only what those leave (a flattened view x.view(-1, d)
        beside x would have had every element claimed by two samples: nothing checked), unclear ones so
        that rows reaching it are refused (a time-first (T, B) tensor at B = T would have been read by
        time step); alone, an unclear guess is read where earlier batches found its samples, else on
        dim 0; None where no tensor holds samples."""
        if self.told:
            return SampleLayout(self.told, batch, filling=self.guesses, unclear=[t for t, _ in self.unclear])
        guesses = self.guesses + [t if found is None else found for t, found in self.unclear]
        return SampleLayout(guesses, batch, guessed=self.foreign) if guesses else None


def steps_per_epoch(sample_rate: float) -> int:
    """Poisson batches that make an epoch at ``sample_rate``: ``round(1 / q)``, at least one."""
    return max(1, round(1 / sample_rate))


def _seed_value(seed) -> int:
    """An integer seed as NumPy's SeedSequence takes it: a negative one in two's complement
    (128 bits), as the optimizer takes it in 64."""
    try:
        seed = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an integer, got {seed!r}") from None
    return seed if seed >= 0 else seed & ((1 << 128) - 1)


class PoissonBatchSampler(Sampler[List[int]]):
    """Batches of indices of ``range(num_samples)``, each example included with probability q.

    One iteration is one epoch of ``steps`` batches (default ``round(1 / sample_rate)``).
    ``position`` is the global index of the next batch to draw; iterating resumes the
    current epoch from there. ``seed=None`` draws a seed from OS entropy. The seed is
    secret (it gives away every batch): :meth:`state_dict` leaves it out unless asked, so a
    resumed sampler keeps its own seed (the same batches if it was given the same seed).
    ``secure_mode=True`` seeds every batch afresh from OS entropy and forbids ``seed``.
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: Optional[int] = None,
                 seed: Optional[int] = None, secure_mode: bool = False):
        if num_samples <= 0:
            raise ValueError(f"Poisson sampling needs a non-empty dataset, got {num_samples} samples")
        self._setup(int(num_samples), sample_rate, steps, seed, secure_mode)

    def _setup(self, num_samples: int, sample_rate: float, steps: Optional[int],
               seed: Optional[int], secure_mode: bool) -> None:
        if secure_mode and seed is not None:
            raise ValueError("secure_mode=True draws batches from OS entropy: do not pass a seed")
        self.num_samples = num_samples
        self._sample_rate = check_sample_rate(sample_rate, allow_zero=False)
        self.steps = steps_per_epoch(self._sample_rate) if steps is None else int(steps)
        if self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        self.secure_mode = bool(secure_mode)
        self.seed = None if secure_mode else (os_entropy(128) if seed is None else _seed_value(seed))
        self.position = 0
        self.sizes: Deque[int] = deque(maxlen=4096)  # sizes of the batches drawn, for the loader to pop
        self.generation = 0  # bumped by each new loop over a loader of this sampler, and by a resume

    @property
    def stream(self) -> tuple:
        """Key separating this sampler's random stream from others with the same seed."""
        return ()

    @property
    def sample_rate(self) -> float:
        """q, fixed: the accountant records the rate the loader was attached at (a new rate is a new
        loader, attached with ``optimizer.attach_loader``)."""
        return self._sample_rate

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.num_samples

    def rng(self, n: int) -> np.random.Generator:
        """The generator batch ``n`` is drawn from."""
        if self.secure_mode:
            return np.random.default_rng(np.random.SeedSequence(os_entropy(256)))
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=self.stream + (n,)))

    def batch(self, n: int) -> List[int]:
        """Indices of global batch ``n``."""
        rng = self.rng(n)
        size = int(rng.binomial(self.num_samples, self.sample_rate))
        return uniform_subset(rng, self.num_samples, size)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        end = (self.position // self.steps + 1) * self.steps
        generation = self.generation
        while self.position < end:
            if self.generation != generation:
                return  # a newer loop over the loader (or a resume) began: this one draws no more
            n = self.position
            self.position += 1
            indices = self.batch(n)
            self.sizes.append(len(indices))
            yield indices

    def released_count(self) -> Optional[List[int]]:
        """How many batches of this sampler's seed, stream and dataset size steps have released
        in this process (batches 0 to count - 1), as a one-element list every such sampler's
        loader shares; None in secure mode (no seed)."""
        if self.secure_mode:
            return None
        key = hashlib.sha256(repr((self.seed, self.stream, self.num_samples)).encode()).digest()
        return _BATCHES_RELEASED.setdefault(key, [0])

    def _settings(self, state: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """What a checkpoint (``state``, when checking one) must agree on to continue this sampler's batches."""
        return {"num_samples": self.num_samples, "sample_rate": self.sample_rate, "secure_mode": self.secure_mode}

    def state_dict(self, include_secrets: bool = False) -> Dict[str, Any]:
        """Position and settings; the seed too with ``include_secrets`` (never publish that)."""
        state = {"position": self.position, **self._settings()}
        if include_secrets:
            state["seed"] = self.seed
        return state

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """Refuse a state this sampler cannot continue (changes nothing)."""
        for key, value in self._settings(state).items():
            if state.get(key) != value:
                raise ValueError(
                    f"sampler checkpoint has {key}={state.get(key)!r}, this sampler {value!r}: "
                    "resume with the same dataset, sample rate and mode"
                )

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.check_state_dict(state)
        if "seed" in state:
            self.seed = state["seed"]
        self.position = int(state["position"])


def _empty_like(batch: Any, dims: Iterator[SampleDim]) -> Any:
    """``batch`` (a collated batch of one example) cut to zero examples: each tensor on its sample
    dim (``dims``, from :func:`sample_dims`), others (shared ones too: nothing tells they hold
    nothing of the example) on dim 0. A leaf it cannot cut is refused: left as it was, the example
    would be trained on in an empty batch's step."""
    if isinstance(batch, (torch.Tensor, np.ndarray)) and batch.ndim > 0:
        ndim, k = next(dims, UNTOLD) if isinstance(batch, torch.Tensor) else UNTOLD
        return batch.narrow(k, 0, 0) if ndim == batch.ndim and isinstance(k, int) else batch[:0]
    if isinstance(batch, Mapping):
        items = {k: _empty_like(v, dims) for k, v in batch.items()}
        return items if type(batch) is dict else type(batch)(items)
    if isinstance(batch, (list, tuple)):
        if not hasattr(batch, "_fields") and all(isinstance(v, (str, bytes)) for v in batch):
            return type(batch)()  # per-example strings (default_collate keeps them as a list or tuple)
        items = [_empty_like(v, dims) for v in batch]
        return type(batch)(items) if not hasattr(batch, "_fields") else type(batch)(*items)
    kind = f"0-dim {type(batch).__name__}" if isinstance(batch, (torch.Tensor, np.ndarray)) else type(batch).__name__
    raise TypeError(
        f"fastdp cannot build an empty batch from a collated {kind}: an empty Poisson batch must hold no "
        "example; collate to tensors or numpy arrays with the examples on dim 0, dicts/mappings, lists or "
        "tuples of them (or per-example strings)")


def _tensors_in(batch: Any) -> Iterator[torch.Tensor]:
    """The tensors of a collated batch (in tuples, lists and mappings, at any depth)."""
    return (t for _, t in _tensor_paths(batch))


def _tensor_paths(batch: Any, path: tuple = ()) -> Iterator[Tuple[tuple, torch.Tensor]]:
    """``(path, tensor)`` for each tensor of a collated batch, ``path`` the keys and indices leading to it."""
    if isinstance(batch, torch.Tensor):
        yield path, batch
    elif isinstance(batch, Mapping):
        for k, v in batch.items():
            yield from _tensor_paths(v, (*path, k))
    elif isinstance(batch, (list, tuple)):
        for i, v in enumerate(batch):
            yield from _tensor_paths(v, (*path, i))


class EmptySafeCollate:
    """Wraps a collate function so an empty batch collates to zero-length tensors shaped
    like a real batch (taken from the dataset's first example)."""

    def __init__(self, dataset: Dataset, collate_fn: Callable = default_collate):
        if isinstance(collate_fn, EmptySafeCollate):
            collate_fn = collate_fn.collate_fn
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, samples):
        return self.collate_fn(samples) if len(samples) else self._empty()[0]

    def _empty(self) -> Tuple[Any, Optional[List[SampleDim]]]:
        """An empty batch and where its tensors' samples lie (:func:`sample_dims`; None where the
        collate takes no example twice over: all cut on dim 0)."""
        try:
            one, two = probe_collate(self.collate_fn, self.dataset[0])
            dims = sample_dims(one, two)
        except Exception:
            one, dims = self.collate_fn([self.dataset[0]]), None
        return _empty_like(one, iter(dims or ())), dims


class Collated(NamedTuple):
    """A batch from :class:`SampleDimsCollate` with where its tensors' samples lie (:func:`sample_dims`;
    None: untold, ``failure`` saying why where the collate raised)."""
    batch: Any
    dims: Optional[List[SampleDim]]
    failure: Optional[str]


class SampleDimsCollate(EmptySafeCollate):
    """An :class:`EmptySafeCollate` whose batches come as :class:`Collated`, told by collating an
    example of the batch alone and twice over (:func:`probe_collate`; for a dataset with
    ``__getitems__``, whose return the collate takes, its example 0); the Poisson loader and
    :class:`BatchMemoryManager` hand out the batch and give the dims to the :class:`BatchLedger`."""

    ASKS = 8  # batches of one arrangement of tensor ranks asked while the answer leaves a tensor untold

    def __init__(self, dataset: Dataset, collate_fn: Callable = default_collate):
        super().__init__(dataset, collate_fn)
        # by the ranks of a batch's tensors: (dims, failure, asks left)
        self._asked: Dict[tuple, Tuple[Optional[List[SampleDim]], Optional[str], int]] = {}

    def __call__(self, samples) -> Collated:
        if len(samples) == 0:
            return Collated(*self._empty(), None)
        batch = self.collate_fn(samples)
        ranks = tuple(t.dim() for t in _tensors_in(batch))
        dims, failure, left = self._asked.get(ranks, (None, None, self.ASKS))
        if not _fully_told(dims) and left:  # saving the generators' states costs ~0.1 ms: asked again only so often
            dims, failure = self._ask(samples)
            self._asked[ranks] = dims, failure, left - 1
        return Collated(batch, dims, failure)

    def _ask(self, samples) -> Tuple[Optional[List[SampleDim]], Optional[str]]:
        """(:func:`sample_dims`, None) from an example of ``samples``: the first, else the last or middle
        where the collate drops it (an invalid example); (None, why) where the collate raised."""
        collate = self.collate_fn
        if getattr(self.dataset, "__getitems__", None):  # the loader hands the collate what this returns
            collate = lambda indices: self.collate_fn(self.dataset.__getitems__(indices))  # noqa: E731
            samples = [0, len(self.dataset) - 1]
        first = None
        try:
            for n, i in enumerate(dict.fromkeys((0, len(samples) - 1, len(samples) // 2))):
                dims = sample_dims(*probe_collate(collate, samples[i]))
                first = dims if n == 0 else first
                if _fully_told(dims):
                    return dims, None
            return first, None
        except Exception as error:  # a collate that takes no batch of one example: guessed from lengths
            return None, f"{type(error).__name__}: {error}"


class BatchLedger:
    """The batches a training loop has taken from a :class:`PoissonDataLoader`, for the
    optimizer's one-batch-per-step check. Batches are numbered from 1 in the order the loop
    receives them: ``taken`` is the last one's number, ``stepped_at`` what it was at the last
    step. Every batch taken counts, used or not: a batch left unused (a loop left with
    ``break``, then resumed) is indistinguishable from one skipped for its content. The
    tensors of each batch handed out are remembered (weakly) with its number, so a backward
    pass whose layers see one of them is attributed to that batch, however old."""

    KEYS_KEPT = 1024  # tensors (path, rank) whose guessed lengths are kept (_LengthsSeen)

    def __init__(self, taken: int = 0, released: Optional[List[int]] = None):
        # batches of the sampler's seed (and stream) released by steps in this process, shared with every
        # loader of that seed (PoissonBatchSampler.released_count): batch number n is its index n - 1
        self.released = released
        self._warned_replay = self._warned_untold = False
        self._lengths_seen: Dict[tuple, _LengthsSeen] = {}  # by (path in the batch, rank) of guessed tensors
        self.restart(taken)

    def restart(self, taken: int) -> None:
        """Start counting at ``taken`` with no step open (a new run, or a resumed position)."""
        self.taken = self.stepped_at = taken
        self.closed_once = False  # a step (or a refused one) has closed the count since
        self.handed = TensorMap()  # tensor -> batch number
        self.layouts = TensorMap()  # root tensor of handed-out tensors -> SampleLayout of the last batch on it
        self._roots: Dict[int, weakref.ref] = {}  # their memory's address -> the root
        self.handouts = 0  # batches and chunks handed out: names each one's SampleLayout
        self.last_chunk: Optional[int] = None  # samples in the batch (or chunk) handed out last
        self.batch_samples: Optional[int] = 0  # samples of the batch taken last, over its chunks (None: unknown)

    def take(self, batch: Collated, size: Optional[int] = None) -> None:
        """A new batch is handed out (``batch``: what the loop receives, or its first chunk, of
        ``size`` samples: the length of its index list, with where its samples lie)."""
        self.taken += 1
        if self.released is not None and self.taken <= self.released[0] and not self._warned_replay:
            self._warned_replay = True
            warnings.warn(
                f"batch {self.taken - 1} of this loader's seed was released by an earlier step in this process (a "
                "loader built again with an earlier one's seed, or a resume from an older checkpoint): the same "
                "samples come together again, while the accountant counts every batch as a fresh Poisson draw; give "
                "each loader its own seed (seed=None draws one from OS entropy), or go on with the earlier loader",
                UserWarning, stacklevel=user_stacklevel())
        self.handed.prune()
        self.layouts.prune()
        self._roots = {memory: root for memory, root in self._roots.items() if root() is not None}
        self.batch_samples = 0
        self.hand_out(batch, size)

    def hand_out(self, batch: Collated, size: Optional[int] = None) -> None:
        """Remember the tensors of ``batch.batch`` (or of a chunk of it, of ``size`` samples), and those
        they are views of, as batch ``taken``'s (a layer input that is a view has the root tensor
        as ``_base``), and where their samples lie."""
        self.last_chunk = size
        self.batch_samples = None if size is None or self.batch_samples is None else self.batch_samples + size
        self.handouts += 1
        if batch.failure is not None and not self._warned_untold:
            self._warned_untold = True
            warnings.warn(
                f"fastdp could not ask the collate where each tensor's samples lie (collating a batch's first "
                f"example alone and twice over raised {batch.failure}); the checks that each row a layer sees is "
                "one sample guess it from the tensors' lengths, which fails where two dims have the batch's length",
                UserWarning, stacklevel=user_stacklevel())
        by_root = TensorMap()  # root -> _OnRoot
        paths = list(_tensor_paths(batch.batch))
        dims = batch.dims if batch.dims is not None and len(batch.dims) == len(paths) else repeat(UNTOLD)
        for (path, t), dim in zip(paths, dims):
            for u in (t, t._base):
                if u is not None:
                    self.handed[u] = self.taken
            samples, how, foreign = _samples_first(t, dim, size)
            on_root = by_root.setdefault(t if t._base is None else t._base, _OnRoot())
            if samples is None:
                continue
            if how == "told":
                on_root.told.append(samples)
                continue
            seen = self._seen((path, t.dim()))
            if how == "unclear":
                found = seen.sample_dim(t, size)
                on_root.unclear.append((samples, None if found is None else t.movedim(found, 0)))
            else:
                on_root.guesses.append(samples)
            on_root.foreign |= foreign
            lengths = _batch_length_dims(t, size)
            if lengths is not None:
                seen.add(lengths, size)
        for root, on_root in by_root.items():  # a tensor handed out again without samples loses its old layout
            self.layouts[root] = on_root.layout(self.handouts)
            if root.layout == torch.strided and not root.is_nested:  # aliases (x.detach(), x.data) find it
                self._roots[_memory_of(root)] = weakref.ref(root)

    def _seen(self, key: tuple) -> _LengthsSeen:
        """The :class:`_LengthsSeen` of ``key`` (path, rank); a throwaway one where the path cannot be a key
        (a mapping with unhashable keys) or keys keep coming (a batch keyed anew each time): nothing kept."""
        try:
            seen = self._lengths_seen.get(key)
        except TypeError:
            return _LengthsSeen()
        if seen is None:
            seen = _LengthsSeen()
            if len(self._lengths_seen) < self.KEYS_KEPT:
                self._lengths_seen[key] = seen
        return seen

    def traced_batches(self, tensors: Iterable[torch.Tensor]) -> set:
        """The batches of the handed-out tensors among ``tensors`` (the inputs a backward pass's
        layers saw, and what they are views of)."""
        return {self.handed.get(t) for t in tensors if t in self.handed}

    def batches_of(self, traced: set) -> set:
        """The batches a backward pass came from: those it was traced to, else the last one
        taken (data transformed on its way to the first layer cannot be traced)."""
        return traced or {self.taken}

    def sample_layout(self, root: torch.Tensor) -> Optional[SampleLayout]:
        """Where the samples lie in ``root``'s memory, if it is (the base of) a tensor the loader handed
        out, or an alias of one (``detach()``, ``.data``: another tensor on the same memory)."""
        layout = self.layouts.get(root)
        if layout is None and root.layout == torch.strided and not root.is_nested:
            handed = self._roots.get(_memory_of(root), lambda: None)()
            if handed is not None and _memory_of(handed) == _memory_of(root):
                layout = self.layouts.get(handed)
        return layout

    def samples_in_pass(self, batches: set) -> Optional[int]:
        """How many samples a backward pass on ``batches`` (its :meth:`batches_of`) can hold, one
        row each: those of the batch or chunk handed out last, if known. None where
        :meth:`close_step` refuses the step anyway (an earlier step's batch, or several)."""
        if self._reused(batches) or self.taken - self.stepped_at > 1:
            return None
        return self.last_chunk

    def _reused(self, batches: set) -> bool:
        """Whether any of ``batches`` is one an earlier step already released."""
        return any(n <= self.stepped_at for n in batches)

    def close_step(self, step_batches: set) -> None:
        """Check, at a step, that it took exactly one new batch: ``step_batches`` are the
        batches its backward passes came from (:meth:`batches_of`). Refused: a pass on a batch
        an earlier step released, several batches handed out since the last step, or passes on
        several. Either way the next step starts from here."""
        drawn = self.taken - self.stepped_at
        reused = self._reused(step_batches)
        self.stepped_at, self.closed_once = self.taken, True
        if self.released is not None:
            self.released[0] = max(self.released[0], self.taken)
        if reused:
            raise RuntimeError(
                "this step's backward pass used the batch an earlier step already released (its samples would "
                "count twice, accounted once): it ran after the last step (or a refused one) before the data "
                "loader handed out a new batch, or it saw a tensor of an earlier step's batch; or it used data "
                "from outside the loader, which the accountant does not cover. Take the next batch from the "
                "loader before backward() and train on it; call zero_grad() to drop a backward pass made for "
                "another purpose")
        if drawn > 1 or len(step_batches) > 1:
            raise RuntimeError(
                f"{max(drawn, len(step_batches))} Poisson batches of the data loader went into this step: the "
                "accountant counts one batch per step, and every batch handed out must go into one. Summing "
                "several batches' gradients can hold a sample several times; a batch taken and not stepped on "
                "(skipped with continue, or held when a loop was left with break and another loop went on) is "
                "indistinguishable from one skipped for its content (e.g. for being empty). Call step() once "
                "per batch, empty ones included; end a loop before taking a batch it will not use (e.g. "
                "itertools.islice(loader, n), not a break after taking it); BatchMemoryManager splits batches "
                "too large for memory")


class PoissonDataLoader(DataLoader):
    """A DataLoader over a :class:`PoissonBatchSampler` that knows how many batches the
    training loop has received (``batches_consumed``), so its :meth:`state_dict` is exact
    even when workers prefetch batches ahead of the loop; its :class:`BatchLedger` serves the
    optimizer's one-batch-per-step check. ``collate_fn`` is an :class:`EmptySafeCollate`; its
    iterators collate with a :class:`SampleDimsCollate` over it and hand out the batches alone."""

    def __init__(self, dataset: Dataset, batch_sampler: PoissonBatchSampler, **kwargs):
        kwargs["collate_fn"] = EmptySafeCollate(dataset, kwargs.get("collate_fn") or default_collate)
        super().__init__(dataset, batch_sampler=batch_sampler, **kwargs)
        self.ledger = BatchLedger(batch_sampler.position, batch_sampler.released_count())

    def _get_iterator(self):
        plain = self.collate_fn
        self.collate_fn = SampleDimsCollate(self.dataset, plain)  # the iterator (and its workers) keep this one
        try:
            return super()._get_iterator()
        finally:
            self.collate_fn = plain

    @property
    def batches_consumed(self) -> int:
        return self.ledger.taken

    def __iter__(self):
        sampler = self.batch_sampler
        mine = _new_loop(sampler, self.ledger)
        sizes = sampler.sizes
        for collated in _current_only(super().__iter__(), sampler, mine):  # Collated, from _get_iterator's collate
            self.ledger.take(collated, sizes.popleft() if sizes else None)
            yield collated.batch

    def state_dict(self, include_secrets: bool = False) -> Dict[str, Any]:
        return dict(self.batch_sampler.state_dict(include_secrets), position=self.ledger.taken)

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        self.batch_sampler.check_state_dict(state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
        self.batch_sampler.generation += 1  # loops begun before the resume must not go on
        self.ledger.restart(self.batch_sampler.position)
        self.ledger.released = self.batch_sampler.released_count()  # the seed may be the state's


def _new_loop(sampler: PoissonBatchSampler, ledger: BatchLedger) -> int:
    """Start a loop over ``sampler``'s batches from the ledger's count; returns its generation.
    An older loop's iterator stops: it holds batches drawn ahead (by workers) that the new loop
    draws again, so going on with it would train on them twice."""
    sampler.generation += 1
    sampler.position = ledger.taken
    sampler.sizes.clear()  # of batches an earlier loop drew ahead and never handed out
    return sampler.generation


def _current_only(items: Iterator, sampler: PoissonBatchSampler, generation: int) -> Iterator:
    """``items`` while loop ``generation`` is the sampler's newest: checked before each is taken
    (with persistent workers every loop shares one iterator, so a stale loop would take a newer
    one's batch), after (one drawn ahead by an older loop), and at the end (stopped by a newer loop)."""
    while True:
        _check_current(sampler, generation)
        try:
            item = next(items)
        except StopIteration:
            break
        _check_current(sampler, generation)
        yield item
    _check_current(sampler, generation)


def _check_current(sampler: PoissonBatchSampler, generation: int) -> None:
    if sampler.generation != generation:
        raise RuntimeError(
            "a newer loop over this Poisson loader (or a load_state_dict) has begun since this iterator was "
            "created: its batches drawn ahead would be trained on twice. Take batches from the newest loop only "
            "(iter(loader) again, or the BatchMemoryManager)")


def _loader_kwargs(data_loader: DataLoader) -> Dict[str, Any]:
    kwargs = dict(num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory,
                  pin_memory_device=data_loader.pin_memory_device, worker_init_fn=data_loader.worker_init_fn,
                  timeout=data_loader.timeout, multiprocessing_context=data_loader.multiprocessing_context,
                  generator=data_loader.generator)
    if data_loader.num_workers > 0:
        kwargs.update(persistent_workers=data_loader.persistent_workers,
                      prefetch_factor=data_loader.prefetch_factor)
    return kwargs


def _index_sampler(data_loader: DataLoader):
    """The sampler the loader's indices come from (its batch sampler's, where that is a plain one)."""
    picker, batches = data_loader.sampler, data_loader.batch_sampler
    if batches is not None:  # batch_sampler=...: the indices come from it
        picker = batches.sampler if type(batches) is BatchSampler else batches
    return picker


def _over_whole_dataset(picker, n: int) -> bool:
    """A sequential or shuffled sampler over n examples (a RandomSampler over range(10) of a
    dataset of 100 picks its own examples)."""
    return isinstance(picker, (SequentialSampler, RandomSampler)) and len(picker.data_source) == n


def partial_sampler(data_loader: DataLoader) -> Optional[str]:
    """What shows that the loader's sampler draws from part of its dataset (a split, a shard), or
    None where nothing does (a sampler fastdp cannot see into is taken at its word)."""
    picker, n = _index_sampler(data_loader), len(data_loader.dataset)
    name = type(picker).__name__
    if isinstance(picker, (SequentialSampler, RandomSampler)) and not _over_whole_dataset(picker, n):
        return f"its {name} runs over {len(picker.data_source)} examples, the dataset has {n}"
    if isinstance(picker, SubsetRandomSampler) and set(map(int, picker.indices)) != set(range(n)):
        return f"its {name} draws from {len(set(map(int, picker.indices)))} of the dataset's {n} examples"
    if isinstance(picker, DistributedSampler) and picker.num_replicas > 1:
        return f"its {name} gives each of {picker.num_replicas} processes a share of the dataset"
    return None


def check_whole_dataset(data_loader: DataLoader) -> None:
    """Refuse a loader whose sampler picks its own examples: Poisson batches are drawn from the
    whole dataset, so that sampler's indices (a split, a shard) would be silently ignored."""
    picker = _index_sampler(data_loader)
    if not _over_whole_dataset(picker, len(data_loader.dataset)):
        raise ValueError(
            f"fastdp samples Poisson batches from the loader's whole dataset, so its "
            f"{type(picker).__name__} would be ignored (its indices, and the sample rate they "
            "imply); give a loader over the examples to train on (torch.utils.data.Subset for a split); for "
            "data-parallel runs give every rank the whole dataset, without a DistributedSampler, to "
            "fastdp.distributed_poisson_loader")


def dataset_and_rate(data_loader: DataLoader, sample_rate: Optional[float]):
    """``(dataset, N, q)`` for a Poisson loader replacing ``data_loader``; q defaults to
    ``batch_size / N``."""
    check_whole_dataset(data_loader)
    dataset = data_loader.dataset
    n = len(dataset)
    if n == 0:
        raise ValueError("the data loader's dataset is empty")
    if sample_rate is None:
        if not data_loader.batch_size:
            raise ValueError("pass sample_rate: the data loader has no batch_size to derive it from")
        sample_rate = data_loader.batch_size / n
    return dataset, n, sample_rate


def poisson_loader(data_loader: DataLoader, sample_rate: Optional[float] = None,
                   steps: Optional[int] = None, seed: Optional[int] = None,
                   secure_mode: bool = False) -> PoissonDataLoader:
    """A loader over ``data_loader``'s dataset with Poisson batches of expected size
    ``sample_rate * N`` (default rate: ``batch_size / N``); workers and collate are kept
    (the collate is wrapped in :class:`SampleDimsCollate`)."""
    dataset, n, sample_rate = dataset_and_rate(data_loader, sample_rate)
    return PoissonDataLoader(
        dataset, PoissonBatchSampler(n, sample_rate, steps, seed, secure_mode),
        collate_fn=data_loader.collate_fn, **_loader_kwargs(data_loader),
    )


class _ChunkSampler(Sampler[List[int]]):
    """Cuts every batch of ``batch_sampler`` into chunks of at most ``size`` indices (an empty
    batch gives one empty chunk) and queues, per chunk, the loop that drew it (the Poisson
    sampler's generation), whether it ends its batch, and its size."""

    def __init__(self, batch_sampler: Sampler[List[int]], size: int, ends: Deque[tuple]):
        self.batch_sampler, self.size, self.ends = batch_sampler, size, ends

    def __len__(self) -> int:
        expected = getattr(self.batch_sampler, "expected_batch_size", None)
        if expected is None:
            expected = getattr(self.batch_sampler, "batch_size", self.size)
        return len(self.batch_sampler) * max(1, math.ceil(expected / self.size))

    def __iter__(self) -> Iterator[List[int]]:
        loop = getattr(self.batch_sampler, "generation", None)  # a Poisson sampler's: whose loop queued it
        for batch in self.batch_sampler:
            batch = list(batch)
            starts = range(0, len(batch), self.size) if batch else [0]
            for start in starts:
                chunk = batch[start:start + self.size]
                self.ends.append((loop, start + self.size >= len(batch), len(chunk)))
                yield chunk


class BatchMemoryManager:
    """Train on logical batches larger than memory allows, one noisy step per logical batch::

        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=64,
                                optimizer=optimizer) as chunks:
            for x, y in chunks:
                optimizer.zero_grad()
                loss_fn(model(x), y).backward()
                optimizer.step()

    Every logical batch of ``data_loader`` is split into chunks of at most
    ``max_physical_batch_size`` examples (an empty batch is one empty chunk). Before a
    chunk is handed out the optimizer is told whether it ends its logical batch: on the
    other chunks ``step()`` only keeps the clipped sums and ``zero_grad()`` keeps them too,
    so the noise is added and the accountant records once per logical batch. Works with
    ``loss_reduction="mean"``: the engine rescales each chunk by its own size.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer):
        if int(max_physical_batch_size) != max_physical_batch_size or max_physical_batch_size < 1:
            raise ValueError(f"max_physical_batch_size must be a positive integer, got {max_physical_batch_size}")
        if data_loader.batch_sampler is None:
            raise ValueError("BatchMemoryManager needs a data loader with a batch sampler (batch_size or batch_sampler)")
        self.data_loader, self.optimizer = data_loader, optimizer
        self._ends: Deque[tuple] = deque()
        self._chunks = DataLoader(
            data_loader.dataset,
            batch_sampler=_ChunkSampler(data_loader.batch_sampler, int(max_physical_batch_size), self._ends),
            collate_fn=SampleDimsCollate(data_loader.dataset, data_loader.collate_fn),
            **_loader_kwargs(data_loader),
        )

    def __enter__(self) -> "BatchMemoryManager":
        return self

    def __exit__(self, *exc) -> None:
        self.optimizer.signal_skip_step(False)

    def __len__(self) -> int:
        """Expected number of chunks per epoch."""
        return len(self._chunks)

    def __iter__(self):
        source = self.data_loader
        poisson = isinstance(source, PoissonDataLoader)
        mine = _new_loop(source.batch_sampler, source.ledger) if poisson else None
        self._ends.clear()
        last, finished = True, False
        chunks = _current_only(iter(self._chunks), source.batch_sampler, mine) if poisson else self._chunks
        try:
            for chunk in chunks:  # Collated, from SampleDimsCollate
                first = last
                loop, last, size = self._ends.popleft()
                while poisson and loop != mine:  # queued by an older loop's chunk sampler as it was stopped
                    loop, last, size = self._ends.popleft()
                if poisson and first:  # the first chunk of a batch: the batch is taken
                    source.ledger.take(chunk, size)
                elif poisson:
                    source.ledger.hand_out(chunk, size)
                self.optimizer.signal_skip_step(not last)
                yield chunk.batch
            finished = True
        finally:
            # left before a batch's step: the clipped sums of its chunks are dropped (not where a newer
            # loop began, whose chunks they are)
            if not finished and not (poisson and source.batch_sampler.generation != mine):
                self.optimizer.abandon_logical_batch()
