"""Which sample of a handed-out batch each part of its memory holds.

fastdp clips each row of a layer input's dim 0 as one sample. Where that input is a view of the
tensors the loader handed out, :class:`SampleLayout` tells whether each of its rows lies in one
sample, a different one per row, and which: ``(start, step, count)``, row ``i`` holding sample
``start + i * step``, sample ``i`` being row ``i`` of every tensor of the batch. Two ways of telling:

* a grid: where every tensor of the batch on this memory keeps each sample within one stride of
  its dim 0, the same stride for all (a stacked batch, its halves, a pair ``v[0], v[1]`` of one
  stack, features and labels split from one buffer), byte arithmetic on offsets and strides;
* labels: otherwise (a collate returning a transposed tensor, ``pad_sequence(b).t()``, or a
  column-major array), a label per element, written through each tensor's strides; memory two
  samples claim (an expanded tensor) is unknown.

Both count in bytes, so views that change the dtype (``view_as_real``) are measured alike. A view
reaching memory that no tensor of the batch holds, or that samples share, is :data:`UNKNOWN`: the
engine then checks it as any other tensor.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

Rows = Tuple[int, int, int]  # (start, step, count): row i holds sample start + i * step
UNKNOWN = "unknown"  # rows_of: the memory does not tell
_FREE, _SHARED = -1, -2  # labels of memory no tensor of the batch holds, and of memory two samples claim
_UNCLEAR = -3  # label of memory only a tensor of unclear samples holds: rows reaching it are refused


def _reach(t: torch.Tensor, dims: slice = slice(1, None)) -> int:
    """Bytes from the first byte of a row of ``t`` (dims ``dims``) past its last: 0 if empty."""
    shape, strides = t.shape[dims], t.stride()[dims]
    if any(n == 0 for n in shape):
        return 0
    return (sum((n - 1) * abs(s) for n, s in zip(shape, strides)) + 1) * t.element_size()


def _strided(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_nested and t.dim() > 0


def _offset(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


class _Placement:
    """Where a handed-out tensor lies, without its memory (holding the tensors would keep every
    batch alive): the shape, strides, offset and element size that ``_reach``, ``_offset`` and the
    label writer read, under the tensor's own method names."""

    __slots__ = ("shape", "_stride", "_offset", "_size", "device", "overlaps")

    def __init__(self, t: torch.Tensor):
        self.shape, self._stride, self._offset, self._size = t.shape, t.stride(), t.storage_offset(), t.element_size()
        self.device = t.device
        self.overlaps = torch._debug_has_internal_overlap(t) == 1  # some element is written twice through t

    def stride(self, dim: Optional[int] = None):
        return self._stride if dim is None else self._stride[dim]

    def storage_offset(self) -> int:
        return self._offset

    def element_size(self) -> int:
        return self._size

    def numel(self) -> int:
        return math.prod(self.shape)


def _arithmetic(first: torch.Tensor) -> Optional[Rows]:
    """``(start, step, count)`` of sample indices that step up evenly, else None."""
    count, start = first.numel(), int(first[0])
    step = int(first[1] - first[0]) if count > 1 else 1
    if step <= 0 or not torch.equal(first, start + step * torch.arange(count, device=first.device)):
        return None
    return start, step, count


class SampleLayout:
    """The samples of ``handed``, the tensors of one batch on one memory (dim 0 the samples of each);
    ``batch`` names the batch (or chunk) they were handed out in; ``guessed``: some tensor's dim 0 is
    a guess, its rows perhaps what all samples share, so an expanded view of them tells nothing;
    ``filling``: tensors whose samples are guessed beside ``handed``, known ones: they label only
    memory that none of those holds (a flattened view ``x.view(-1, d)`` beside ``x`` labels none);
    ``unclear``: guesses that could be wrong (two dims of the batch's length): rows reaching memory
    only they hold are refused."""

    def __init__(self, handed: List[torch.Tensor], batch: int, guessed: bool = False,
                 filling: Sequence[torch.Tensor] = (), unclear: Sequence[torch.Tensor] = ()):
        self.batch, self._guessed = batch, guessed
        self._known = all(_strided(t) for t in (*handed, *filling, *unclear))
        self._handed = [_Placement(t) for t in (*handed, *filling, *unclear)] if self._known else []
        self._filling, self._unclear = len(filling) + len(unclear), len(unclear)  # the last ones of _handed
        self._grid = self._sample_grid() if self._known and not unclear else None
        self._labels: Optional[Tuple[torch.Tensor, int, int]] = None  # (labels, first byte, bytes each)

    def _sample_grid(self):
        """``(cell, origin, ranges)`` where sample i of tensor t is cell ``first_t + i`` of the memory
        from byte ``origin`` in steps of ``cell``, ``ranges`` the ``(first_t, count_t)``; None where no
        such grid holds (tensors with other strides, samples wider than a cell, ranges that overlap
        shifted)."""
        rows = [t for t in self._handed if t.shape[0] > 1]
        cell = (rows or self._handed)[0].stride(0) * (rows or self._handed)[0].element_size() if self._handed else 0
        if cell <= 0 or any(t.stride(0) * t.element_size() != cell for t in rows):
            return None
        origin = min(_offset(t) for t in self._handed)
        ranges = set()
        for t in self._handed:
            first, within = divmod(_offset(t) - origin, cell)
            if within + _reach(t) > cell:
                return None
            ranges.add((first, t.shape[0]))
        if any(a[0] != b[0] and a[0] < b[0] + b[1] and b[0] < a[0] + a[1] for a in ranges for b in ranges):
            return None
        return cell, origin, sorted(ranges)

    def rows_of(self, x: torch.Tensor) -> Union[Rows, str, None]:
        """The samples of the rows of ``x`` (a view of this memory, ``x.dim() > 0``); None where a row
        reaches into two samples or two rows hold one; :data:`UNKNOWN` where the memory does not tell."""
        if not self._known or not _strided(x):
            return UNKNOWN
        if x.shape[0] == 0:
            return 0, 1, 0
        if x.numel() == 0:
            return UNKNOWN  # rows without elements: nothing places them
        if self._guessed and x.shape[0] > 1 and x.stride(0) == 0:
            return UNKNOWN
        return self._rows_on_grid(x) if self._grid is not None else self._rows_by_label(x)

    def _rows_on_grid(self, x: torch.Tensor) -> Union[Rows, str, None]:
        cell, origin, ranges = self._grid
        first, within = divmod(_offset(x) - origin, cell)
        if within + _reach(x) > cell:
            return None
        stride = x.stride(0) * x.element_size()
        if x.shape[0] > 1 and (stride <= 0 or stride % cell):
            return None
        step = stride // cell if x.shape[0] > 1 else 1
        last = first + step * (x.shape[0] - 1)
        start = next((lo for lo, n in ranges if lo <= first < lo + n), None)
        end = next((lo for lo, n in ranges if lo <= last < lo + n), None)
        if start is None or end is None:
            return UNKNOWN  # memory no tensor of the batch holds
        if start != end or any(start < lo < last for lo, _ in ranges):
            return None  # rows across two tensors' samples: sample i of each twice
        return first - start, step, x.shape[0]

    def _rows_by_label(self, x: torch.Tensor) -> Union[Rows, str, None]:
        labels, low, unit = self._label_memory()
        size = math.gcd(unit, x.element_size())  # index both in units of this many bytes
        if unit > size:
            labels = labels.repeat_interleave(unit // size)
        per_x, begin = x.element_size() // size, (_offset(x) - low) // size
        if _offset(x) < low or begin + _reach(x, slice(0, None)) // size > labels.numel():
            return UNKNOWN  # reaches past the batch's memory
        seen = labels.as_strided((*x.shape, per_x), (*(s * per_x for s in x.stride()), 1), begin)
        rows = seen.reshape(x.shape[0], -1)
        if bool((rows == _UNCLEAR).any()):
            return None
        if bool((rows < 0).any()):
            return UNKNOWN  # memory no tensor of the batch holds, or that two samples share
        first = rows[:, 0]
        if not bool((rows == first[:, None]).all()):
            return None
        return _arithmetic(first)

    def _label_memory(self) -> Tuple[torch.Tensor, int, int]:
        """(labels, first byte, bytes per label): the batch's span of memory labelled with the sample
        each unit holds, ``_FREE`` where no tensor holds it, ``_SHARED`` where two samples do."""
        if self._labels is None:
            unit = math.gcd(*(t.element_size() for t in self._handed))
            spans = [(_offset(t), _offset(t) + _reach(t, slice(0, None))) for t in self._handed if t.numel()]
            low, high = min((a for a, _ in spans), default=0), max((b for _, b in spans), default=0)
            device = self._handed[0].device
            labels = torch.full(((high - low) // unit,), _FREE, dtype=torch.int32, device=device)
            for n, t in enumerate(self._handed):
                if not t.numel():
                    continue
                per = t.element_size() // unit
                region = labels.as_strided((*t.shape, per), (*(s * per for s in t.stride()), 1),
                                           (_offset(t) - low) // unit)
                sample = torch.arange(t.shape[0], dtype=torch.int32, device=device)
                sample = sample.view(-1, *[1] * len(t.shape)).expand(region.shape)
                if n >= len(self._handed) - self._filling:  # a guess: only where no known tensor is
                    label = sample if n < len(self._handed) - self._unclear else torch.full_like(sample, _UNCLEAR)
                    if not t.overlaps:
                        region.copy_(torch.where(region == _FREE, label, region))
                    continue
                if t.overlaps:  # no write through its strides
                    _label_overlapping(labels, region)
                    continue
                merged = torch.where((region == _FREE) | (region == sample), sample, _SHARED)
                region.copy_(merged)
                if not torch.equal(region, merged):  # a unit written twice through t's strides
                    _label_overlapping(labels, region)
            self._labels = labels, low, unit
        return self._labels


def _label_overlapping(labels: torch.Tensor, region: torch.Tensor) -> None:
    """Label the units of ``region`` (a view of ``labels`` whose dim 0 is the samples, possibly over
    shared memory) with their sample, ``_SHARED`` where two samples claim one or it already held another."""
    index = torch.full((), region.storage_offset(), dtype=torch.int64, device=labels.device)
    for n, s in zip(region.shape, region.stride()):
        index = index.unsqueeze(-1) + s * torch.arange(n, device=labels.device)
    sample = torch.arange(region.shape[0], device=labels.device).view(-1, *[1] * (region.dim() - 1))
    index, sample = index.flatten(), sample.expand(region.shape).flatten()
    lowest = torch.full(labels.shape, region.shape[0], dtype=torch.int64, device=labels.device)
    highest = torch.full(labels.shape, -1, dtype=torch.int64, device=labels.device)
    lowest.scatter_reduce_(0, index, sample, "amin")
    highest.scatter_reduce_(0, index, sample, "amax")
    one = (highest >= 0) & (lowest == highest)
    prior = labels.long()
    claimed_once = one & ((prior == _FREE) | (prior == lowest))
    labels.copy_(torch.where(claimed_once, lowest, torch.where(highest >= 0, _SHARED, prior)).int())
