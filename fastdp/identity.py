"""A table keyed by a tensor's identity that does not keep the tensor alive.

The engine and the batch ledger remember tensors they saw (layer inputs, the loader's batches)
without holding them. ``Tensor.__hash__`` is Python-level and ``==`` is elementwise, so the
table is keyed by ``id()``; an id is reused once its tensor is freed, so each entry keeps a weak
reference beside its value and an entry whose tensor died reads as absent.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Iterator, Tuple

import torch


class TensorMap:
    """A mapping from live tensors (by identity) to values."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[weakref.ref, Any]] = {}

    def __setitem__(self, t: torch.Tensor, value: Any) -> None:
        self._entries[id(t)] = (weakref.ref(t), value)

    def get(self, t: torch.Tensor, default: Any = None) -> Any:
        entry = self._entries.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else default

    def __contains__(self, t: torch.Tensor) -> bool:
        entry = self._entries.get(id(t))
        return entry is not None and entry[0]() is t

    def setdefault(self, t: torch.Tensor, default: Any) -> Any:
        """``t``'s value, after setting it to ``default`` where ``t`` has none."""
        entry = self._entries.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        self[t] = default
        return default

    def items(self) -> Iterator[Tuple[torch.Tensor, Any]]:
        """(tensor, value) of the entries whose tensor is alive."""
        for ref, value in list(self._entries.values()):
            t = ref()
            if t is not None:
                yield t, value

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (t for t, _ in self.items())

    def update(self, other: "TensorMap") -> None:
        self._entries.update(other._entries)

    def prune(self) -> None:
        """Forget the entries whose tensor died."""
        self._entries = {key: entry for key, entry in self._entries.items() if entry[0]() is not None}
