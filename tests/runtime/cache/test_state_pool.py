"""State and snapshot pools: every layer's entries of one shape live in one group, so a slot is
zeroed, copied, saved and restored in every layer with one operation per group, and the states
come out as with one tensor per layer and entry."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from runtime.cache import state_pool as state_pool_module
from runtime.cache.snapshot_pool import SnapshotPool
from runtime.cache.state_pool import StatePool
from testkit.engine_toy import build_model


class CountCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def fill_and_move(registry) -> dict:
    """Random states in slots 1-3, then a zeroing, a slot copy, a save and a restore; every state after."""
    st, snaps = StatePool(registry, 4), SnapshotPool(registry, 3)
    g = torch.Generator().manual_seed(0)
    for entries in st.buffers.values():
        for t in entries.values():
            t.copy_(torch.randn(t.shape, generator=g))
    st.zero_slot(1)
    st.copy_slot(2, 4)
    snaps.save(st, [3, 2], [0, 2])
    snaps.restore(st, [2, 0], [1, 3])
    return {(layer, name, pool): t.clone() for pool, p in (("state", st), ("snapshot", snaps))
            for layer, entries in p.buffers.items() for name, t in entries.items()}


def test_grouped_states_equal_one_tensor_per_layer_and_entry(monkeypatch):
    registry = build_model("qwen3_next").layer_registry
    grouped = fill_and_move(registry)
    monkeypatch.setattr(state_pool_module, "GROUP_ALIGN", 1 << 40)  # no row is a multiple: a group per entry
    alone = fill_and_move(registry)
    assert grouped.keys() == alone.keys()
    assert all(torch.equal(grouped[k], alone[k]) for k in grouped)


def test_a_save_of_few_pairs_copies_rows_and_of_more_one_indexed_copy_per_group_and_buffers_are_views_of_the_groups():
    registry = build_model("qwen3_next").layer_registry
    st, snaps = StatePool(registry, 4), SnapshotPool(registry, 3)
    entries = [t for e in st.buffers.values() for t in e.values()]
    assert len(st.groups) < len(entries)  # the tiny model's linear layers share shapes
    storages = {g.untyped_storage().data_ptr() for g in st.groups}
    assert all(t.untyped_storage().data_ptr() in storages for t in entries)
    # each entry is a whole row of its group: contiguous, or (a conv history) the transpose of a contiguous row
    for e in st.buffers.values():
        for name, t in e.items():
            stored = t.transpose(-1, -2) if name == "conv" and state_pool_module.CONV_HISTORY_CHANNELS_LAST else t
            assert stored.is_contiguous(), (name, t.stride())
    assert sum(g.nbytes for g in st.groups) == st.nbytes()
    assert all(t.data_ptr() % state_pool_module.GROUP_ALIGN == 0 for t in entries if st.groups[0].is_cuda)
    with CountCalls() as calls:
        snaps.save(st, [1, 2], [0, 1])
    assert calls.names.count("index_copy_") == 0 and calls.names.count("copy_") == 2 * len(st.groups)
    with CountCalls() as calls:
        snaps.save(st, [1, 2, 3], [0, 1, 2])
    assert calls.names.count("index_copy_") == len(st.groups)


@pytest.mark.parametrize("direct_pairs", [0, 8])
def test_row_copies_and_indexed_copies_move_the_same_states(monkeypatch, direct_pairs):
    from runtime.cache import snapshot_pool

    registry = build_model("qwen3_next").layer_registry
    expected = fill_and_move(registry)
    monkeypatch.setattr(snapshot_pool, "DIRECT_PAIRS", direct_pairs)  # every copy one way, then the other
    moved = fill_and_move(registry)
    assert all(torch.equal(expected[k], moved[k]) for k in expected)


def test_an_entry_whose_row_is_not_aligned_is_a_group_of_its_own(monkeypatch):
    registry = build_model("qwen3_next").layer_registry
    shapes = [(tuple(t.shape[1:]), t.dtype) for e in StatePool(registry, 1).buffers.values() for t in e.values()]
    monkeypatch.setattr(state_pool_module, "GROUP_ALIGN", 1 << 40)
    st = StatePool(registry, 1)
    assert len(st.groups) == len(shapes) and all(g.shape[0] == 1 for g in st.groups)


@pytest.mark.parametrize("rows", [0, 3])
def test_a_snapshot_pool_of_any_size_pairs_its_groups_with_the_state_pools(rows):
    registry = build_model("qwen3_next").layer_registry
    st, snaps = StatePool(registry, 2), SnapshotPool(registry, rows)
    assert [(g.shape[0], g.shape[2:]) for g in st.groups] == [(g.shape[0], g.shape[2:]) for g in snaps.groups]


def test_a_slot_is_zeroed_when_given_back_so_a_new_request_finds_it_zero():
    registry = build_model("qwen3_next").layer_registry
    st = StatePool(registry, 2)
    slot = st.alloc()
    assert all(not v.any() for v in st._slot_views(slot))
    for view in st._slot_views(slot):
        view.fill_(1.0)
    st.free(slot)
    assert all(not v.any() for v in st._slot_views(slot))
    assert st.alloc() == slot
