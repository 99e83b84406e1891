"""Poisson sampling: every example joins a batch independently with probability q.

Batches are drawn in O(batch size) each: the size from Binomial(N, q), then a uniform
subset of that size (Floyd's algorithm), never a pass over all N examples. Empty
batches are yielded (as empty tensors shaped like a real batch): the step still runs,
adds noise and counts for the accountant.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator, List, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate


def uniform_subset(rng: np.random.Generator, population: int, size: int) -> List[int]:
    """``size`` distinct integers drawn uniformly from ``range(population)`` (Floyd), O(size)."""
    chosen = set()
    for j in range(population - size, population):
        t = int(rng.integers(0, j + 1))
        chosen.add(j if t in chosen else t)
    out = list(chosen)
    rng.shuffle(out)
    return out


class PoissonBatchSampler(Sampler[List[int]]):
    """Yields ``steps`` batches of indices of ``range(num_samples)``, each Poisson with rate q.

    ``steps`` defaults to ``round(1 / sample_rate)`` (one epoch in expectation). ``seed``
    makes the batches reproducible; ``None`` seeds from OS entropy.
    """

    def __init__(self, num_samples: int, sample_rate: float, steps: Optional[int] = None,
                 seed: Optional[int] = None):
        if num_samples <= 0:
            raise ValueError(f"Poisson sampling needs a non-empty dataset, got {num_samples} samples")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.num_samples, self.sample_rate = num_samples, float(sample_rate)
        self.steps = int(round(1 / sample_rate)) if steps is None else int(steps)
        if self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        self.rng = np.random.default_rng(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.steps):
            size = int(self.rng.binomial(self.num_samples, self.sample_rate))
            yield uniform_subset(self.rng, self.num_samples, size)


def _empty_like(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _empty_like(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [_empty_like(v) for v in batch]
        return type(batch)(items) if not hasattr(batch, "_fields") else type(batch)(*items)
    return batch


class EmptySafeCollate:
    """Wraps a collate function so an empty batch collates to zero-length tensors shaped
    like a real batch (taken from the dataset's first example)."""

    def __init__(self, dataset: Dataset, collate_fn: Callable = default_collate):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, samples):
        if len(samples) == 0:
            return _empty_like(self.collate_fn([self.dataset[0]]))
        return self.collate_fn(samples)


def poisson_loader(data_loader: DataLoader, sample_rate: Optional[float] = None,
                   steps: Optional[int] = None, seed: Optional[int] = None) -> DataLoader:
    """A DataLoader over ``data_loader``'s dataset with Poisson batches of expected size
    ``sample_rate * N`` (default rate: ``batch_size / N``); workers and collate are kept."""
    dataset = data_loader.dataset
    n = len(dataset)
    if n == 0:
        raise ValueError("the data loader's dataset is empty")
    if sample_rate is None:
        if not data_loader.batch_size:
            raise ValueError("pass sample_rate: the data loader has no batch_size to derive it from")
        sample_rate = data_loader.batch_size / n
    collate = data_loader.collate_fn
    if isinstance(collate, EmptySafeCollate):
        collate = collate.collate_fn
    return DataLoader(
        dataset,
        batch_sampler=PoissonBatchSampler(n, sample_rate, steps, seed),
        collate_fn=EmptySafeCollate(dataset, collate),
        num_workers=data_loader.num_workers,
        pin_memory=data_loader.pin_memory,
        worker_init_fn=data_loader.worker_init_fn,
        persistent_workers=data_loader.persistent_workers,
    )
