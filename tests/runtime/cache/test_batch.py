"""build_step's layout of one step, field by field, on a small case worked out by hand."""

from __future__ import annotations

import torch

from compiler.splitops import Mode
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.cache.kv_pool import KVPool
from runtime.cache.state_pool import PADDING_SLOT
from tests.compiler.test_compiler_toys import toy_traced


def test_a_mixed_step_padded_to_a_bucket():
    registry = toy_traced(layers=["full_gqa"]).registry
    kv = KVPool(registry, 8, page_size=4)
    old = SeqState(slot=3, pages=[6, 2], num_cached=5)  # decoding: its 6th token lands on page 2, offset 1
    new = SeqState(slot=1)  # prefilling 3 tokens: takes one page from the pool
    step = build_step([(old, [11]), (new, [21, 22, 23])], kv, mode=None, pad_tokens_to=6, pad_seqs_to=3, max_pages=3)
    ctx = step.ctx
    fresh_page = new.pages[0]
    assert ctx.mode == Mode.MIXED and (ctx.num_tokens, ctx.num_seqs) == (6, 3)
    assert ctx.query_lens == [1, 3] and ctx.cache_lens == [5, 0]
    assert step.input_ids.tolist() == [11, 21, 22, 23, 0, 0]
    assert step.positions.tolist() == [5, 0, 1, 2, 0, 0]
    assert ctx.slot_mapping.tolist() == [2 * 4 + 1, fresh_page * 4, fresh_page * 4 + 1, fresh_page * 4 + 2, -1, -1]
    assert ctx.query_start_loc.tolist() == [0, 1, 4, 4] and ctx.query_start_loc.dtype == torch.int32
    assert ctx.seq_lens.tolist() == [6, 3, 0] and ctx.seq_lens.dtype == torch.int32
    assert ctx.state_slots.tolist() == [3, 1, PADDING_SLOT] and ctx.state_slots.dtype == torch.int64
    assert ctx.page_table.tolist() == [[6, 2, 0], [fresh_page, 0, 0], [0, 0, 0]]
    assert ctx.page_table.dtype == torch.int32
    assert step.logits_index.tolist() == [0, 3]
    commit_step([(old, [11]), (new, [21, 22, 23])])
    assert (old.num_cached, new.num_cached) == (6, 3)
