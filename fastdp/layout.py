"""Which sample of a handed-out batch each part of its memory holds.

fastdp clips each row of a layer input's dim 0 as one sample. Where that input is a view of
the tensors the loader handed out, :class:`SampleLayout` tells whether each of its rows lies in
one sample, a different one per row, and which: ``(start, step, count)``, row ``i`` holding
sample ``start + i * step``, sample ``i`` being row ``i`` of every handed tensor on that memory.
Two ways of telling:

* one handed tensor whose samples are whole strides of its root's dim 0 (a stacked batch): byte
  arithmetic on offsets and strides, so views that change the dtype are measured alike;
* otherwise (a collate returning a transposed tensor, ``pad_sequence(b).t()``, a column-major
  array, or several views of one buffer): a label per element of the root, written through each
  handed tensor's strides; an element two samples claim (an expanded tensor) is unknown.

A view that reaches memory no handed tensor labels, or an unknown element, is :data:`UNKNOWN`:
the engine then checks it as any other tensor.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple, Union

import torch

Rows = Tuple[int, int, int]  # (start, step, count): row i holds sample start + i * step
UNKNOWN = "unknown"  # rows_of: the memory does not tell
_FREE, _SHARED = -1, -2  # labels of memory no handed tensor covers, and of memory two samples claim


def _reach(t: torch.Tensor, dims: slice = slice(1, None)) -> int:
    """Bytes from the first byte of a row of ``t`` (dims ``dims``) past its last: 0 if empty."""
    shape, strides = t.shape[dims], t.stride()[dims]
    if any(n == 0 for n in shape):
        return 0
    return (sum((n - 1) * abs(s) for n, s in zip(shape, strides)) + 1) * t.element_size()


def _strided(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_nested and t.dim() > 0


def _arithmetic(first: torch.Tensor) -> Optional[Rows]:
    """``(start, step, count)`` of sample indices that step up evenly, else None."""
    count = first.numel()
    start = int(first[0])
    step = int(first[1] - first[0]) if count > 1 else 1
    if step <= 0 or not torch.equal(first, start + step * torch.arange(count, device=first.device)):
        return None
    return start, step, count


class SampleLayout:
    """The samples of the tensors ``handed`` (handed out together, dim 0 the samples) in the memory of
    their common ``root`` (the tensor they are, or are views of)."""

    def __init__(self, root: torch.Tensor, handed: List[torch.Tensor]):
        self._known = _strided(root) and all(_strided(t) and t.element_size() == root.element_size() for t in handed)
        self._size = root.element_size()
        self._handed = [(tuple(t.shape), t.stride(), t.storage_offset()) for t in handed] if self._known else []
        self._cell = 0  # bytes from a sample to the next where byte arithmetic tells (one sample-major tensor)
        if self._known and len(handed) == 1:
            (t,) = handed
            cell = root.stride(0) * self._size
            first_row, within = divmod((t.storage_offset() - root.storage_offset()) * self._size, cell) if cell > 0 \
                else (0, 0)
            if cell > 0 and _reach(root) <= cell and (t.shape[0] <= 1 or t.stride(0) * self._size == cell) \
                    and within + _reach(t) <= cell:
                self._cell, self._origin = cell, (root.storage_offset() + first_row * root.stride(0)) * self._size
                self._samples = t.shape[0]
        self._labels: Optional[torch.Tensor] = None  # made at the first query that needs them
        self._device = root.device

    def rows_of(self, x: torch.Tensor) -> Union[Rows, str, None]:
        """The samples of the rows of ``x`` (a view of the root's memory, ``x.dim() > 0``); None where
        a row reaches into two samples or two rows hold one; :data:`UNKNOWN` where it cannot tell."""
        if not self._known or not _strided(x):
            return UNKNOWN
        if x.shape[0] == 0:
            return 0, 1, 0
        if x.numel() == 0:
            return UNKNOWN  # rows without elements: nothing places them
        return self._rows_by_offset(x) if self._cell else self._rows_by_label(x)

    def _rows_by_offset(self, x: torch.Tensor) -> Union[Rows, str, None]:
        size, cell = x.element_size(), self._cell
        start, within = divmod(x.storage_offset() * size - self._origin, cell)
        if within + _reach(x) > cell:
            return None
        step = x.stride(0) * size // cell if x.shape[0] > 1 else 1
        if x.shape[0] > 1 and (x.stride(0) <= 0 or x.stride(0) * size % cell):
            return None
        if start < 0 or start + step * (x.shape[0] - 1) >= self._samples:
            return UNKNOWN  # rows of the root the handed tensor does not hold
        return start, step, x.shape[0]

    def _rows_by_label(self, x: torch.Tensor) -> Union[Rows, str, None]:
        labels, low = self._label_memory()
        unit = math.gcd(self._size, x.element_size())  # index both in units of this many bytes
        per_label, per_x = self._size // unit, x.element_size() // unit
        begin = x.storage_offset() * per_x - low * per_label
        if begin < 0 or begin + _reach(x, slice(0, None)) // unit > labels.numel() * per_label:
            return UNKNOWN  # reaches past the handed tensors' memory
        if per_label > 1:
            labels = labels.repeat_interleave(per_label)
        seen = labels.as_strided((*x.shape, per_x), (*(s * per_x for s in x.stride()), 1), begin)
        rows = seen.reshape(x.shape[0], -1)
        if bool((rows < 0).any()):
            return UNKNOWN  # memory no handed tensor covers, or two samples share
        first = rows[:, 0]
        if not bool((rows == first[:, None]).all()):
            return None
        return _arithmetic(first)

    def _label_memory(self) -> Tuple[torch.Tensor, int]:
        """(labels, offset of the first): each element of the handed tensors' span of the root's memory
        labelled with its sample, ``_FREE`` where none covers it, ``_SHARED`` where two samples do."""
        if self._labels is None:
            spans = [(off, off + sum((n - 1) * s for n, s in zip(shape, strides)) + 1)
                     for shape, strides, off in self._handed if all(shape)]
            self._low = min((lo for lo, _ in spans), default=0)
            high = max((hi for _, hi in spans), default=0)
            lowest = torch.full((high - self._low,), torch.iinfo(torch.int64).max, dtype=torch.int64,
                                device=self._device)
            highest = torch.full_like(lowest, _FREE)
            for shape, strides, off in self._handed:
                if not all(shape):
                    continue
                index = torch.full((), off - self._low, dtype=torch.int64, device=self._device)
                for n, s in zip(shape, strides):
                    index = index.unsqueeze(-1) + s * torch.arange(n, device=self._device)
                sample = torch.arange(shape[0], device=self._device).view(-1, *[1] * (len(shape) - 1)).expand(shape)
                lowest.scatter_reduce_(0, index.flatten(), sample.flatten(), "amin")
                highest.scatter_reduce_(0, index.flatten(), sample.flatten(), "amax")
            self._labels = torch.where(lowest == highest, highest, torch.where(highest == _FREE, _FREE, _SHARED))
        return self._labels, self._low
