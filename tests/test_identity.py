"""TensorMap: bookkeeping by tensor identity that holds no tensor alive."""
import gc
import weakref

import torch

from fastdp.identity import TensorMap


def test_entries_follow_identity_not_value():
    a, b = torch.zeros(3), torch.zeros(3)
    table = TensorMap()
    table[a] = 1
    assert a in table and b not in table
    assert table.get(a) == 1 and table.get(b, "absent") == "absent"
    assert table.setdefault(a, 2) == 1 and table.setdefault(b, 3) == 3
    assert sorted(v for _, v in table.items()) == [1, 3]


def test_a_dead_tensor_reads_as_absent_even_where_its_id_is_reused():
    table = TensorMap()
    dead = torch.ones(2)
    table[dead] = "old"
    ref = weakref.ref(dead)
    del dead
    gc.collect()
    assert ref() is None and list(table) == []
    new = torch.ones(2)
    table._entries[id(new)] = (ref, "old")  # as if ``new`` took the freed tensor's id
    assert new not in table and table.get(new) is None
    assert table.setdefault(new, "new") == "new" and table.get(new) == "new"
    table.prune()
    assert [v for _, v in table.items()] == ["new"]


def test_update_merges_entries():
    a, b = torch.zeros(1), torch.zeros(1)
    first, second = TensorMap(), TensorMap()
    first[a], second[b] = 1, 2
    first.update(second)
    assert first.get(a) == 1 and first.get(b) == 2
