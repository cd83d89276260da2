"""StepStaging.lay_out against build_step + stage: the static buffers hold the same bits, every
field and every padding row, whichever way a step reaches them; and a laid-out step stays whole
when another is laid out over it while still held."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from compiler.splitops import Mode
from runtime.cache.batch import SeqState, build_step, step_lengths, step_mode
from runtime.cache.kv_pool import KVPool
from runtime.cache.state_pool import PADDING_SLOT
from runtime.graphs.buckets import CaptureKey
from runtime.graphs.cuda_graphs import CaptureError
from runtime.graphs.staging import CONTEXT_TABLES, StepStaging
from tests.compiler.test_compiler_toys import toy_traced

MAX_TOKENS, MAX_SEQS, MAX_PAGES, PAGE = 64, 8, 12, 4
FIELDS = ("input_ids", "positions", "slot_mapping", "logits_index") + CONTEXT_TABLES


@pytest.fixture(scope="module")
def registry():
    return toy_traced(layers=["full_gqa"]).registry


def junk(staging: StepStaging, seed: int) -> None:
    """Every byte of the block, host and device, something no step writes (random bytes)."""
    g = torch.Generator().manual_seed(seed)
    for block in (staging.host, staging.dev):
        block.copy_(torch.randint(0, 256, block.shape, generator=g, dtype=block.dtype))


def requests(rng: random.Random, kind: str, B: int, pool: KVPool, verify_tokens: int = 3):
    """B requests of a step of `kind`, their pages taken from `pool` (some with fewer than they need:
    the layout takes the rest); about half of those with several tokens carry an in-step snapshot."""
    items = []
    for _ in range(B):
        cached = 0 if kind == "extend" else rng.randint(1, MAX_PAGES * PAGE // 2)
        n = {"decode": 1, "verify": verify_tokens}.get(kind) or rng.randint(1, 9)
        if kind == "mixed" and rng.random() < 0.5:
            n = 1
        need = pool.pages_for(cached + n)
        pages = pool.alloc(need - rng.randint(0, 1) if cached else rng.randint(0, need))
        snapshot = (cached + rng.randint(1, n - 1), rng.randint(0, 9)) if n > 1 and rng.random() < 0.5 else None
        items.append((SeqState(rng.randint(0, 30), pages=pages, num_cached=cached, snapshot=snapshot),
                      [rng.randint(1, 999) for _ in range(n)]))
    if kind == "mixed" and len({len(t) == 1 for _, t in items}) < 2:
        items[0] = (items[0][0], items[0][1] + [7])  # a chunk beside decodes
        items[-1] = (SeqState(items[-1][0].slot, pages=items[-1][0].pages, num_cached=max(1, items[-1][0].num_cached)),
                     items[-1][1][:1])
    return items


def both_ways(registry, items, key: CaptureKey, mode: Mode, logits_rows=None, max_pages=MAX_PAGES):
    """(reference staging, its step, its static ctx, laid-out staging, its step, its static ctx): the
    reference built by build_step (padded to `key`, its page table `max_pages` wide or as wide as its
    longest request) and copied in by `stage`; the other laid out in place, over junk."""
    pools = [KVPool(registry, 400, page_size=PAGE) for _ in range(2)]
    for pool in pools:  # the same pages free in both: the layouts take the same ones
        pool.alloc(sum(len(s.pages) for s, _ in items))
    ref_items, items = copy.deepcopy(items), copy.deepcopy(items)
    ref, got = (StepStaging(MAX_TOKENS, MAX_SEQS, MAX_PAGES, torch.device("cpu")) for _ in range(2))
    junk(ref, 1)
    junk(got, 2)
    ref_step = build_step(ref_items, pools[0], "cpu", mode=mode, pad_tokens_to=key.tokens, pad_seqs_to=key.seqs,
                          max_pages=max_pages, logits_rows=logits_rows)
    _, ref_ctx = ref.stage(ref_step, key)
    query_lens, cache_lens = step_lengths(items)
    step = got.lay_out(items, key, mode, query_lens, cache_lens, pools[1], logits_rows)
    _, ctx = got.stage(step, key)
    assert [s.pages for s, _ in items] == [s.pages for s, _ in ref_items]
    return ref, ref_step, ref_ctx, got, step, ctx


def assert_same(ref, ref_step, ref_ctx, got, step, ctx, key: CaptureKey):
    # every field of the blocks, bit for bit (its padding rows too), host and device; the gaps that
    # align the next field's start are never written or read
    (got_host, got_dev, _), (ref_host, ref_dev, _) = (staging.views(key.tokens, key.seqs, key.logits_rows)
                                                      for staging in (got, ref))
    for name in got_dev:
        assert (got_host[name] == ref_host[name]).all(), name
        assert torch.equal(got_dev[name], ref_dev[name]), name
    for name in CONTEXT_TABLES:
        assert torch.equal(getattr(ctx, name), getattr(ref_ctx, name)), name
        at = getattr(ref_ctx, name).data_ptr() - ref.dev.data_ptr()
        assert getattr(ctx, name).data_ptr() == got.dev.data_ptr() + at, name
    for f in ("mode", "query_lens", "cache_lens", "page_size", "num_tokens", "num_seqs"):
        assert getattr(ctx, f) == getattr(ref_ctx, f) == getattr(step.ctx, f), f
    # the laid-out step's own (host) tensors: build_step's, the page table at the key's width
    for name in ("input_ids", "positions", "logits_index"):
        assert torch.equal(getattr(step, name), getattr(ref_step, name)), name
    for name in set(CONTEXT_TABLES) - {"page_table"}:
        a, b = getattr(step.ctx, name), getattr(ref_step.ctx, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    width = ref_step.ctx.page_table.shape[1]
    assert torch.equal(step.ctx.page_table[:, :width], ref_step.ctx.page_table)
    assert not step.ctx.page_table[:, width:].any()


CASES = [  # (kind, real requests, key)
    ("decode", 1, CaptureKey(Mode.DECODE, 1, 1)),
    ("decode", 3, CaptureKey(Mode.DECODE, 4, 4)),
    ("decode", 8, CaptureKey(Mode.DECODE, 8, 8)),
    ("extend", 1, CaptureKey(Mode.EXTEND, 32, 8)),
    ("extend", 4, CaptureKey(Mode.EXTEND, 64, 8)),
    ("mixed", 2, CaptureKey(Mode.EXTEND, 32, 4)),
    ("mixed", 6, CaptureKey(Mode.EXTEND, 64, 8)),
    ("verify", 1, CaptureKey(Mode.TARGET_VERIFY, 6, 2, 6)),
    ("verify", 3, CaptureKey(Mode.TARGET_VERIFY, 12, 4, 12)),
]


@pytest.mark.parametrize("kind,B,key", CASES, ids=[f"{k}-{b}-{key}" for k, b, key in CASES])
@pytest.mark.parametrize("seed", range(4))
def test_laid_out_step_stages_what_build_step_and_stage_do(registry, kind, B, key, seed):
    rng = random.Random(seed)
    items = requests(rng, kind, B, KVPool(registry, 400, page_size=PAGE))
    mode = Mode.TARGET_VERIFY if kind == "verify" else step_mode(*step_lengths(items))
    rows = [3] * B if kind == "verify" else None
    assert_same(*both_ways(registry, items, key, mode, rows), key)


@pytest.mark.parametrize("seed", range(4))
def test_prompt_scoring_rows_and_narrow_page_tables(registry, seed):
    """Several logits rows per request (a prompt scored), and a reference whose page table is as
    wide as its longest request (build_step without max_pages): the rest of the view reads 0."""
    rng = random.Random(seed)
    items = requests(rng, rng.choice(["extend", "mixed"]), 3, KVPool(registry, 400, page_size=PAGE))
    lens, _ = step_lengths(items)
    key = CaptureKey(Mode.EXTEND, 32, 4, 32)
    mode = step_mode(*step_lengths(items))
    rows = [rng.randint(1, n) for n in lens]
    assert_same(*both_ways(registry, items, key, mode, rows), key)
    got = both_ways(registry, items, key, mode, None, max_pages=None)
    assert got[1].ctx.page_table.shape[1] < MAX_PAGES, "the reference's table is narrower than the buffers'"
    assert_same(*got, key)


def test_a_held_step_stays_whole_when_another_is_laid_out(registry):
    """Laid out, then another laid out over the block before the first runs: the first was copied
    out (its tensors and context changed in place) and is copied in again when staged. A step
    dropped before the next is laid out is not copied: the next step's tensors are the block's."""
    pool = KVPool(registry, 400, page_size=PAGE)
    staging = StepStaging(MAX_TOKENS, MAX_SEQS, MAX_PAGES, torch.device("cpu"))
    key_a, key_b = CaptureKey(Mode.EXTEND, 32, 4), CaptureKey(Mode.DECODE, 2, 2)
    a_items = [(SeqState(3, pages=pool.alloc(1)), [5, 6, 7]), (SeqState(4, pages=pool.alloc(1)), [8])]
    b_items = [(SeqState(5, pages=pool.alloc(1), num_cached=2), [9]), (SeqState(6, pages=pool.alloc(1), num_cached=1), [1])]
    want = build_step(copy.deepcopy(a_items), pool, "cpu", pad_tokens_to=32,
                      pad_seqs_to=4, max_pages=MAX_PAGES)
    a = staging.lay_out(a_items, key_a, Mode.EXTEND, *step_lengths(a_items), pool)
    held_ctx = a.ctx
    assert a.input_ids.data_ptr() == staging.host.data_ptr(), "laid out in the block itself"
    b = staging.lay_out(b_items, key_b, Mode.DECODE, *step_lengths(b_items), pool)
    assert a.ctx is held_ctx and a.input_ids.data_ptr() != staging.host.data_ptr()
    assert torch.equal(a.input_ids, want.input_ids) and torch.equal(a.ctx.slot_mapping, want.ctx.slot_mapping)
    inputs, ctx = staging.stage(a, key_a)
    assert torch.equal(inputs["input_ids"], want.input_ids) and torch.equal(ctx.page_table, want.ctx.page_table)
    assert b.input_ids.data_ptr() != staging.host.data_ptr(), "b was copied out in turn"
    assert b.input_ids.tolist() == [9, 1] and b.positions.tolist() == [2, 1]
    del a, b, held_ctx
    c = staging.lay_out(b_items, key_b, Mode.DECODE, *step_lengths(b_items), pool)
    inputs, _ = staging.stage(c, key_b)
    del c
    d = staging.lay_out(b_items, key_b, Mode.DECODE, *step_lengths(b_items), pool)
    assert d.input_ids.data_ptr() == staging.host.data_ptr()


def test_a_step_beyond_the_buffers_pages_is_refused(registry):
    pool = KVPool(registry, 400, page_size=PAGE)
    staging = StepStaging(MAX_TOKENS, MAX_SEQS, MAX_PAGES, torch.device("cpu"))
    long = [(SeqState(1, pages=pool.alloc(MAX_PAGES), num_cached=MAX_PAGES * PAGE), [4])]
    with pytest.raises(CaptureError, match=f"holds {MAX_PAGES + 1} pages"):
        staging.lay_out(long, CaptureKey(Mode.DECODE, 1, 1), Mode.DECODE, *step_lengths(long), pool)


def rules(items, pages_before, T_pad: int, B_pad: int, P: int, page_size: int, logits_rows=None) -> dict:
    """The layout rules of runtime/cache/batch.py's lay_out, request by request (the test's own
    statement of them): what every element of every field holds."""
    ids, pos, slots, starts, lens, state, table, logits, snapshots = [], [], [], [0], [], [], [], [], []
    for b, ((seq, tokens), pages) in enumerate(zip(items, pages_before)):
        first = len(ids)
        for i, token in enumerate(tokens):
            p = seq.num_cached + i
            ids.append(token)
            pos.append(p)
            slots.append(pages[p // page_size] * page_size + p % page_size)
        starts.append(len(ids))
        lens.append(seq.num_cached + len(tokens))
        state.append(seq.slot)
        snapshots.append((-1, 0) if seq.snapshot is None else (seq.snapshot[0] - seq.num_cached, seq.snapshot[1]))
        table.append(pages + [0] * (P - len(pages)))
        n = 1 if logits_rows is None else logits_rows[b]
        logits += list(range(first + len(tokens) - n, first + len(tokens)))
    T, B = len(ids), len(items)
    return {"input_ids": ids + [0] * (T_pad - T), "positions": pos + [0] * (T_pad - T),
            "slot_mapping": slots + [-1] * (T_pad - T), "query_start_loc": starts + [T] * (B_pad - B),
            "seq_lens": lens + [0] * (B_pad - B), "state_slots": state + [PADDING_SLOT] * (B_pad - B),
            "page_table": table + [[0] * P] * (B_pad - B), "logits_index": logits,
            "snapshot_rows": [r for r, _ in snapshots] + [-1] * (B_pad - B),
            "snapshot_ids": [i for _, i in snapshots] + [0] * (B_pad - B)}


@pytest.mark.parametrize("seed", range(40))
def test_the_layout_follows_its_rules_request_by_request(registry, seed):
    """build_step (and with it lay_out, every branch: one request of one token or more, decodes,
    chunks) against the rules stated request by request, padding and several logits rows included."""
    rng = random.Random(seed)
    kind = ["decode", "extend", "mixed", "verify"][seed % 4]
    B = 1 if seed % 3 == 0 else rng.randint(2 if kind == "mixed" else 1, 6)
    pool = KVPool(registry, 400, page_size=PAGE)
    items = requests(rng, kind, B, pool)
    T = sum(len(t) for _, t in items)
    rows = [rng.randint(1, len(t)) for _, t in items] if rng.random() < 0.5 else None
    T_pad, B_pad = T + rng.randint(0, 5), B + rng.randint(0, 3)
    step = build_step(items, pool, "cpu", pad_tokens_to=T_pad, pad_seqs_to=B_pad, max_pages=MAX_PAGES,
                      logits_rows=rows)
    want = rules(items, [s.pages for s, _ in items], T_pad, B_pad, MAX_PAGES, PAGE, rows)
    got = {name: getattr(step, name, None) if name in ("input_ids", "positions", "logits_index")
           else getattr(step.ctx, name) for name in FIELDS}
    assert {name: t.tolist() for name, t in got.items()} == want


@pytest.mark.parametrize("T,B,R", [(16, 1, 1), (17, 3, 3), (5, 5, 7), (64, 4, 4), (63, 8, 1)])
def test_every_field_of_a_layout_starts_16_byte_aligned(T, B, R):
    """Triton builds a kernel per 16-byte alignment of each pointer it takes: a table at an odd
    8-byte offset (a one-request key's snapshot ids) would launch a build the bundle lacks. And
    every field, int64 and int32, lies in the block's used prefix: one copy sends a step."""
    staging = StepStaging(MAX_TOKENS, MAX_SEQS, MAX_PAGES, torch.device("cpu"))
    _, dev, used = staging.views(T, B, R)
    assert set(dev) == {*StepStaging.INT64, *StepStaging.INT32}
    for name, view in dev.items():
        at = view.data_ptr() - staging.dev.data_ptr()
        assert at % 16 == 0, (name, T, B, R)
        assert at + view.numel() * view.element_size() <= used, "every field inside the one copied prefix"
    assert used <= staging.dev.numel()
