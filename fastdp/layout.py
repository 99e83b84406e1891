"""Which sample of a handed-out batch each part of its memory holds.

fastdp clips each row of a layer input's dim 0 as one sample. Where that input is a view of a
tensor the loader handed out, :class:`SampleLayout` tells whether each of its rows lies in one
sample, a different one per row, and which: ``(start, step, count)``, row ``i`` holding sample
``start + i * step``. Two kinds of memory:

* sample-major: the handed tensor's dim 0 is its root tensor's, each sample's elements within
  one stride of dim 0 (a stacked batch and every slice or reshape of it). Byte arithmetic on
  offsets and strides, so views that change the dtype (``view_as_real``) are measured alike.
* interleaved: the samples' elements alternate in memory (a collate returning a transposed
  tensor, ``pad_sequence(b).t()``, or a column-major array). A label per element, made once.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

Rows = Tuple[int, int, int]  # (start, step, count): row i holds sample start + i * step


def _reach(t: torch.Tensor, dims: slice = slice(1, None)) -> int:
    """Bytes from the first byte of a row of ``t`` (dims ``dims``) past its last: 0 if empty."""
    shape, strides = t.shape[dims], t.stride()[dims]
    if any(n == 0 for n in shape):
        return 0
    return (sum((n - 1) * abs(s) for n, s in zip(shape, strides)) + 1) * t.element_size()


class SampleLayout:
    """The samples of ``handed`` (a tensor the loader handed out, dim 0 the samples) in the memory of
    ``root`` (``handed`` itself, or the tensor it is a view of)."""

    def __init__(self, handed: torch.Tensor, root: torch.Tensor):
        size = handed.element_size()
        self._root_offset = root.storage_offset() * root.element_size()
        self._cell = root.stride(0) * root.element_size() if root.dim() else 0  # bytes from a sample to the next
        shifted = handed.storage_offset() * size - self._root_offset
        self.sample_major = (self._cell > 0 and _reach(root) <= self._cell and handed.dim() > 0
                             and (handed.shape[0] <= 1 or handed.stride(0) * size == self._cell)
                             and shifted % self._cell + _reach(handed) <= self._cell)
        # interleaved: the handed tensor's geometry (in its elements) and the index of its first sample
        self._geometry = (tuple(handed.shape), handed.stride(), handed.storage_offset(), size, handed.device)
        self._first = shifted // (handed.stride(0) * size) if handed.dim() and handed.stride(0) > 0 else 0
        self._labels: Optional[torch.Tensor] = None  # made at the first interleaved query

    def rows_of(self, x: torch.Tensor) -> Optional[Rows]:
        """The samples of the rows of ``x`` (a view of the root's memory, ``x.dim() > 0``), or None
        where a row reaches into two samples or two rows into one."""
        return self._rows_by_offset(x) if self.sample_major else self._rows_by_label(x)

    def _rows_by_offset(self, x: torch.Tensor) -> Optional[Rows]:
        size, cell = x.element_size(), self._cell
        start, within = divmod(x.storage_offset() * size - self._root_offset, cell)
        if within + _reach(x) > cell:
            return None
        if x.shape[0] <= 1:
            return start, 1, x.shape[0]
        stride = x.stride(0) * size
        return (start, stride // cell, x.shape[0]) if stride > 0 and stride % cell == 0 else None

    def _rows_by_label(self, x: torch.Tensor) -> Optional[Rows]:
        shape, strides, offset, size, device = self._geometry
        if x.element_size() != size or x.device != device or not shape or strides[0] <= 0:
            return None  # another element size over interleaved samples, or samples sharing memory: not told
        labels, low = self._label_memory(), offset
        if x.storage_offset() < low or x.storage_offset() - low + _reach(x, slice(0, None)) // size > labels.numel():
            return None  # reaches past the handed tensor's memory
        rows = labels.as_strided(x.shape, x.stride(), x.storage_offset() - low).reshape(x.shape[0], -1)
        if x.shape[0] == 0 or rows.shape[1] == 0:
            return self._first, 1, x.shape[0]
        first = rows[:, 0]
        if bool((first < 0).any()) or not bool((rows == first[:, None]).all()):
            return None
        start = int(first[0])
        step = int(first[1] - first[0]) if x.shape[0] > 1 else 1
        if step <= 0 or not torch.equal(first, start + step * torch.arange(x.shape[0], device=device)):
            return None
        return start, step, x.shape[0]

    def _label_memory(self) -> torch.Tensor:
        """Each element of the handed tensor's span of memory labelled with its sample (-1: none)."""
        if self._labels is None:
            shape, strides, offset, _, device = self._geometry
            extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0
            labels = torch.full((extent,), -1, dtype=torch.int64, device=device)
            samples = torch.arange(self._first, self._first + shape[0], device=device)
            try:
                labels.as_strided(shape, strides, 0).copy_(samples.view(-1, *[1] * (len(shape) - 1)).expand(shape))
            except RuntimeError:  # elements sharing memory (an expanded batch): no sample is told
                labels.fill_(-1)
            self._labels = labels
        return self._labels


def disagree(a: Optional[SampleLayout], b: Optional[SampleLayout]) -> bool:
    """Whether two handed tensors of one root place the samples differently (then neither is used)."""
    if a is None or b is None:
        return True
    if a.sample_major and b.sample_major:
        return a._cell != b._cell or a._root_offset != b._root_offset
    return a.sample_major != b.sample_major or a._geometry[1:3] != b._geometry[1:3]

