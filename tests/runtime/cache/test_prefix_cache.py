"""Prefix cache: the radix tree's bookkeeping, exact reuse on every family, eviction under pressure.

- The tree: matches only up to a snapshot, splits edges where prefixes part, gives back only pages
  nobody else holds, drops least recently used snapshots first, and frees everything on clear.
- Exactness: greedy tokens with the cache equal those without it, for requests sharing prefixes
  shorter than a page, of one page, of many pages and whole prompts, arriving together, a few at
  a time, and one after another, on the toy model and all four families.
- Reuse: the second of two identical prompts reports cached tokens and prefills only the rest.
- Pressure: in a KV pool and a snapshot pool far too small for what the requests would cache,
  after every step each page is held by exactly the running requests that use it plus the cache,
  outputs stay exact, and when the requests end everything is free (the cache's part once cleared).
"""

from __future__ import annotations

import collections

import pytest
import torch

from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.step.bound_ops import BoundOps
from runtime.engine.engine import Engine, SamplingParams
from runtime.cache.kv_pool import KVPool
from runtime.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from runtime.cache.radix_cache import RadixCache
from runtime.cache.snapshot_pool import SnapshotPool
from testkit.engine_toy import available_families, build_model, eager_engine, make_pools

MODELS = ["toy"] + available_families()
PAGE = 4

pytestmark = pytest.mark.usefixtures("one_thread")


def cached_engine(model, *, cache: bool = True, slots: int = 6, pages: int = 128, snapshots: int = 32,
                  interval: int = 8, hit_snapshot_tokens: int = 128, output_end: bool = True, in_step: bool = False,
                  **engine_kwargs) -> Engine:
    """in_step: the backend gets the snapshot pool, so steps write snapshots inside their chunks
    (tests/runtime/cache/test_step_snapshots.py); else chunks end at snapshot points."""
    kv_pool, state_pool = make_pools(model, slots, pages, PAGE)
    pool = SnapshotPool(model.layer_registry, snapshots)
    ops = BoundOps(CPUReferenceBackend(kv_pool, state_pool, snapshots=pool if in_step else None))
    model.set_ops(ops)
    prefix_cache = None
    if cache:
        prefix_cache = PrefixCache(kv_pool, state_pool, pool,
                                   PrefixCacheConfig(snapshot_interval=interval, hit_snapshot_tokens=hit_snapshot_tokens,
                                                     snapshot_output_end=output_end))
    return eager_engine(model, ops, kv_pool, state_pool, prefix_cache=prefix_cache, **engine_kwargs)


def random_ids(n: int, vocab: int, g: torch.Generator) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def sharing_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that share a 27-token prefix in every way that matters at page size 4."""
    g = torch.Generator().manual_seed(seed)
    base = random_ids(27, vocab, g)
    return [
        base,
        base[:2] + random_ids(9, vocab, g),  # shorter than a page
        base[:4] + random_ids(7, vocab, g),  # exactly one page
        base[:17] + random_ids(6, vocab, g),  # many pages, parting mid-page
        base,  # the whole prompt again
        base + random_ids(5, vocab, g),  # the whole prompt, continued
        base[:24],  # a page-aligned prefix, as its own prompt
        base[:24],
        base[:17] + random_ids(3, vocab, g),  # the branch the fourth prompt made, taken again
    ]


def vocab_of(model) -> int:
    return model.lm_head.weight.shape[0]


def check_references(engine: Engine) -> None:
    """Each page is held exactly by the running requests whose page lists have it and the tree, and
    each snapshot id the pool has handed out by the tree (between steps, no in-step id is left)."""
    kv = engine.kv_pool
    want = collections.Counter()
    for req in engine.scheduler.running:
        want.update(req.seq.pages)
    cache = engine.prefix_cache
    if cache is not None:
        want.update(cache.tree.held_pages())
        assert cache.snapshots.num_snapshots - cache.snapshots.num_free == cache.tree.num_snapshots
    assert [kv.holders(p) for p in range(kv.num_pages)] == [want[p] for p in range(kv.num_pages)]
    assert kv.num_free == sum(1 for p in range(kv.num_pages) if want[p] == 0)


def assert_all_free(engine: Engine) -> None:
    """No request holds anything; the cache holds only what it can give back, then, cleared, nothing."""
    stats = engine.stats()
    assert stats["running"] == stats["queue_depth"] == 0
    assert stats["free_slots"] == stats["total_slots"] and stats["free_pages"] == stats["total_pages"], stats
    check_references(engine)
    engine.prefix_cache.clear()
    assert engine.kv_pool.num_free == engine.kv_pool.num_pages
    assert engine.prefix_cache.snapshots.num_free == engine.prefix_cache.snapshots.num_snapshots


def run(engine: Engine, requests, arrival: str) -> list[tuple[int, ...]]:
    """Outputs of `requests` ((prompt, params) pairs) arriving together, two per step, or one after another."""
    if arrival == "sequential":
        return [engine.generate(prompt, params).output_ids for prompt, params in requests]
    per_step = len(requests) if arrival == "together" else 2
    ids, pending = [], list(requests)
    while pending or engine.has_work():
        for _ in range(per_step):
            if pending:
                ids.append(engine.add_request(*pending.pop(0)))
        engine.step()
        check_references(engine)
    results = engine.run_until_done()
    return [results[i].output_ids for i in ids]


# -- the tree ---------------------------------------------------------------------------------


def tree_over(num_pages: int = 32, snapshots: int = 8) -> RadixCache:
    from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, TensorSpec

    registry = LayerRegistry([LayerSpec(0, LayerKind.GDN, state={"recurrent": TensorSpec((2, 2), "float32")}),
                              LayerSpec(1, LayerKind.FULL_GQA, kv={"k": TensorSpec((1, 2), "float32")})])
    return RadixCache(KVPool(registry, num_pages, PAGE), SnapshotPool(registry, snapshots))


def request_pages(tree: RadixCache, tokens: int) -> list[int]:
    return tree.kv_pool.alloc(tokens // PAGE)


def test_a_match_ends_at_the_deepest_snapshot_and_reports_where_the_pages_part():
    tree = tree_over()
    a = list(range(100, 116))  # 4 pages
    pages = request_pages(tree, 16)
    node, held = tree.insert(a, pages)
    assert held == pages and [tree.kv_pool.holders(p) for p in pages] == [2] * 4
    assert tree.match(a, 15).tokens == 0, "pages without a snapshot are no hit"
    tree.set_snapshot(node, tree.snapshots.alloc())
    assert tree.match(a, 15).tokens == 0 and tree.match(a, 15).kv_tokens == 12, "a hit leaves one token to run"
    full = tree.match(a + [7], 16)
    assert (full.tokens, full.pages, full.snapshot) == (16, pages, node.snapshot)
    # A prompt that parts from `a` inside its third page: the KV match stops at the second page.
    part = tree.match(a[:9] + [1, 2, 3, 4, 5], 13)
    assert (part.tokens, part.kv_tokens) == (0, 8)


def test_inserting_a_parting_prefix_splits_the_edge_and_returns_the_trees_pages():
    tree = tree_over()
    a = list(range(100, 116))
    a_pages = request_pages(tree, 16)
    a_end, _ = tree.insert(a, a_pages)
    tree.set_snapshot(a_end, tree.snapshots.alloc())
    b = a[:8] + [1, 2, 3, 4]
    b_pages = request_pages(tree, 12)  # its own pages for the shared 8 tokens too (a recompute)
    b_end, held = tree.insert(b, b_pages)
    assert held == a_pages[:2] + b_pages[2:], "the shared part keeps the tree's pages"
    tree.set_snapshot(b_end, tree.snapshots.alloc())
    assert tree.match(a + [0], 16).tokens == 16 and tree.match(b + [0], 12).tokens == 12
    # The split node at 8 has no snapshot: a prompt sharing 8 tokens has no hit but knows its branch point.
    c = a[:8] + [9, 9, 9, 9, 9]
    assert (tree.match(c, 12).tokens, tree.match(c, 12).kv_tokens) == (0, 8)
    mid, _ = tree.insert(a[:8], a_pages[:2])
    tree.set_snapshot(mid, tree.snapshots.alloc())
    assert tree.match(c, 12).tokens == 8
    assert tree.num_pages == 5 and tree.num_snapshots == 3


def test_eviction_gives_back_only_pages_nobody_else_holds_least_recently_used_first():
    tree = tree_over(num_pages=12)
    prefixes = [[k] * 8 for k in (1, 2, 3)]
    ends = []
    for tokens in prefixes:
        pages = request_pages(tree, 8)
        end, _ = tree.insert(tokens, pages)
        tree.set_snapshot(end, tree.snapshots.alloc())
        tree.kv_pool.free(pages)  # the request ended: the tree alone holds them
        ends.append(end)
    in_use = tree.match(prefixes[0] + [0], 8)
    tree.kv_pool.share(in_use.pages)  # a running request reuses the first prefix
    tree.use(in_use)
    assert tree.kv_pool.num_free == 6 and tree.reclaimable_pages() == 4
    tree.evict_pages(8)  # the second prefix (least recently used) goes, and that is enough
    assert tree.kv_pool.num_free == 8 and tree.match(prefixes[1] + [0], 8).tokens == 0
    assert tree.match(prefixes[2] + [0], 8).tokens == 8
    tree.evict_pages(12)  # all it can: the first prefix is in use
    assert tree.kv_pool.num_free == 10 and tree.match(prefixes[0] + [0], 8).tokens == 8
    tree.kv_pool.free(in_use.pages)
    tree.clear()
    assert tree.kv_pool.num_free == 12 and tree.snapshots.num_free == tree.snapshots.num_snapshots


def test_a_full_snapshot_pool_drops_its_least_recently_used_snapshot_and_the_leaf_it_leaves_useless():
    tree = tree_over(snapshots=2)
    a, b = [5] * 8, [6] * 8
    for tokens in (a, b):
        pages = request_pages(tree, 8)
        end, _ = tree.insert(tokens, pages)
        tree.set_snapshot(end, tree.snapshots.alloc())
        tree.kv_pool.free(pages)
    tree.use(tree.match(a + [0], 8))  # a was hit: b is now the older snapshot
    freed = tree.evict_snapshot()
    assert freed is not None and tree.match(b + [0], 8).tokens == 0
    assert tree.num_pages == 2, "b's pages went with its snapshot: nothing could hit them"
    assert tree.kv_pool.num_free == tree.kv_pool.num_pages - 2


def test_snapshot_eviction_follows_use_order_through_hits_splits_and_page_eviction():
    """The eviction order the tree keeps beside its nodes picks what a walk of every node would:
    the snapshot made or hit longest ago, after random inserts (edges split), hits, page evictions."""
    import random

    rng = random.Random(0)
    tree = tree_over(num_pages=48, snapshots=6)
    prompts = [[rng.randrange(3) for _ in range(rng.choice((4, 8, 12)))] for _ in range(40)]
    for tokens in prompts:
        if rng.random() < 0.4:
            tree.use(tree.match(tokens + [0], len(tokens)))
        if tree.snapshots.num_free == 0:
            held = [n for n in tree._nodes() if n.snapshot is not None]
            oldest = min(held, key=lambda n: (n.snapshot_use, n.end))
            expected = oldest.snapshot
            assert tree.evict_snapshot() == expected
        tree.evict_pages(len(tokens) // PAGE)
        pages = request_pages(tree, len(tokens))
        end, tree_pages = tree.insert(tokens, pages)
        if end.snapshot is None:
            tree.set_snapshot(end, tree.snapshots.alloc())
        tree.kv_pool.free(pages)
    assert tree.num_snapshots == sum(n.snapshot is not None for n in tree._nodes())


# -- exactness --------------------------------------------------------------------------------


# Two arrivals per step on the toy model; every family with requests arriving together and in sequence.
@pytest.mark.parametrize("name, arrival", [("toy", "staggered")] + [(name, arrival) for name in MODELS
                                                                    for arrival in ("together", "sequential")])
def test_greedy_tokens_with_the_cache_equal_tokens_without_it(name, arrival):
    model = build_model(name)
    requests = [(p, SamplingParams(max_new_tokens=4)) for p in sharing_prompts(vocab_of(model))]
    want = run(cached_engine(model, cache=False, max_tokens_per_step=12), requests, arrival)
    engine = cached_engine(model, max_tokens_per_step=12)
    assert run(engine, requests, arrival) == want
    stats = engine.stats()
    assert stats["prefix_cache_hits"] >= (4 if arrival == "sequential" else 1), stats
    assert_all_free(engine)


def test_prompt_ends_and_branch_points_are_where_later_requests_hit():
    model = build_model("toy")
    vocab = vocab_of(model)
    params = SamplingParams(max_new_tokens=3)
    engine = cached_engine(model, interval=10_000, max_tokens_per_step=64)  # no chunk-end snapshots
    cached = {}
    for i, prompt in enumerate(sharing_prompts(vocab)):
        cached[i] = engine.generate(prompt, params).cached_tokens
    # 0, a miss, snapshots the end of its 27 tokens rounded down (24). 1 shares less than a page:
    # nothing. 2 shares one page, no snapshot there: a miss that snapshots its branch point 4.
    # 3 parts at 17: hits 4, snapshots its branch point 16. 4: the same 27 tokens: 24. 5 continues
    # them: 24 (27 is no page boundary). 6, the aligned 24 tokens, may hit at most 23 of them: 16;
    # the pages go on to 20, its branch point, which 7, the same again, hits. 8: the branch at 16.
    assert cached == {0: 0, 1: 0, 2: 0, 3: 4, 4: 24, 5: 24, 6: 16, 7: 20, 8: 16}


@pytest.mark.parametrize("length, hits", [(18, [0, 16, 16]), (16, [0, 0, 12])])
def test_a_repeated_prompt_prefills_only_what_the_cache_lacks(length, hits):
    """18 tokens: the first request splits its last chunk at 16 to snapshot there, and the second
    hits it. 16 tokens: the first snapshots its end (16), which a repeat cannot use (its last token
    must run); the second finds the pages up to 12, snapshots there (its branch point) and the
    third hits it. Each prefills exactly what it did not find."""
    model = build_model(MODELS[-1])
    prompt = random_ids(length, vocab_of(model), torch.Generator().manual_seed(length))
    params = SamplingParams(max_new_tokens=5)
    engine = cached_engine(model, interval=1000, max_tokens_per_step=64)
    results, prefilled = [], []
    for _ in hits:
        steps_before = len(engine.step_records())
        results.append(engine.generate(prompt, params))
        prefilled.append(sum(r.prefill_tokens for r in engine.step_records()[steps_before:]))
    assert [r.cached_tokens for r in results] == hits
    assert prefilled == [length - h for h in hits]
    assert len({r.output_ids for r in results}) == 1
    assert engine.stats()["prefix_cache_hit_tokens"] == sum(hits)
    assert_all_free(engine)


def test_output_snapshots_let_the_next_turn_hit_past_the_prompt():
    model = build_model("toy")
    g = torch.Generator().manual_seed(9)
    prompt, params = random_ids(10, 96, g), SamplingParams(max_new_tokens=12)

    def two_turns(engine):
        first = engine.generate(prompt, params)
        follow_up = prompt + list(first.output_ids) + random_ids(3, 96, g)
        return first, engine.generate(follow_up, SamplingParams(max_new_tokens=4))

    g.manual_seed(9)
    plain = two_turns(cached_engine(model, cache=False))
    g.manual_seed(9)
    kv_pool, state_pool = make_pools(model, 4, 64, PAGE)
    ops = BoundOps(CPUReferenceBackend(kv_pool, state_pool))
    model.set_ops(ops)
    cache = PrefixCache(kv_pool, state_pool, SnapshotPool(model.layer_registry, 16),
                        PrefixCacheConfig(snapshot_interval=4, snapshot_output=True))
    engine = eager_engine(model, ops, kv_pool, state_pool, prefix_cache=cache)
    cached = two_turns(engine)
    assert [r.output_ids for r in cached] == [r.output_ids for r in plain]
    # The first turn's 10 + 12 tokens ran through 21 (its last sample is not fed): snapshots every
    # 4 tokens of its output, the last at 20. Without output snapshots the hit would stop at 8.
    assert cached[1].cached_tokens == 20
    assert_all_free(engine)


@pytest.mark.parametrize("name", ["toy", MODELS[-1]])
def test_each_turn_of_a_chat_hits_the_turn_before_it(name):
    """A chat's turn is the last turn's prompt, its output and new words. With output-end snapshots
    (the default) each turn hits the turn before's prompt and output, rounded down to a page: it
    prefills its new words and at most a page of the output. Without them, a hit with at least
    hit_snapshot_tokens (here 2 pages) up to its prompt's last page boundary snapshots there, so
    each turn hits the turn before's prompt (rounded down to a page); without that either (0) a
    turn snapshots only where it leaves the pages of the turn before (its branch point), so it
    hits the prompt of two turns before. Tokens equal the run without the cache."""
    model = build_model(name)
    vocab = vocab_of(model)

    def chat(engine, seed=5, turns=4):
        g = torch.Generator().manual_seed(seed)
        prompt, results = random_ids(13, vocab, g), []
        for _ in range(turns):
            results.append(engine.generate(prompt, SamplingParams(max_new_tokens=5)))
            prompt = prompt + list(results[-1].output_ids) + random_ids(7, vocab, g)
        return results

    plain = chat(cached_engine(model, cache=False, max_tokens_per_step=64))
    lengths = [13 + 12 * t for t in range(4)]  # each turn adds 5 output and 7 new tokens
    output_ends = [0] + [(n + 4) // PAGE * PAGE for n in lengths[:-1]]  # prompt + 5 - 1 tokens fed
    for output_end, hit_snapshot_tokens, want in ((True, 2 * PAGE, output_ends), (True, 0, output_ends),
                                                  (False, 2 * PAGE, [0] + [n // PAGE * PAGE for n in lengths[:-1]]),
                                                  (False, 0, [0, 12, 12, 24])):
        engine = cached_engine(model, interval=10_000, max_tokens_per_step=64, hit_snapshot_tokens=hit_snapshot_tokens,
                               output_end=output_end)
        results = chat(engine)
        assert [r.output_ids for r in results] == [r.output_ids for r in plain]
        assert [r.cached_tokens for r in results] == want, (output_end, hit_snapshot_tokens)
        assert_all_free(engine)


def test_chats_sharing_a_pool_of_one_snapshot_each_keep_the_turn_before():
    """Four chats take turns together with room for four snapshots. A turn's snapshot supersedes
    the one its chat hit (RadixCache.supersede), so a full pool gives up that one, not the
    snapshot another chat has yet to hit: every turn after the first hits its chat's last prompt
    and output (the output's end: 40 + 8 - 1 tokens fed, rounded down to 44). Without that
    (eviction by use alone), chats lose their snapshot to each other's turns."""
    model = build_model("toy")
    vocab = vocab_of(model)
    engine = cached_engine(model, slots=4, pages=512, snapshots=4, interval=10_000, max_tokens_per_step=64,
                           hit_snapshot_tokens=8 * PAGE)
    g = torch.Generator().manual_seed(3)
    prompts = [random_ids(40, vocab, g) for _ in range(4)]
    for turn in range(4):
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
        results = engine.run_until_done()
        assert [results[i].cached_tokens for i in ids] == [len(prompts[0]) - 44 if turn else 0] * 4, turn
        prompts = [p + list(results[i].output_ids) + random_ids(40, vocab, g) for p, i in zip(prompts, ids)]
    assert_all_free(engine)


def test_chunks_end_on_page_boundaries_and_snapshot_points():
    model = build_model("toy")
    engine = cached_engine(model, interval=8, max_tokens_per_step=7)
    prompt = random_ids(23, vocab_of(model), torch.Generator().manual_seed(3))
    engine.generate(prompt, SamplingParams(max_new_tokens=2))
    chunks = [r.prefill_tokens for r in engine.step_records() if r.prefill_tokens]
    # 7-token budget: 0-4, 4-8, 8-12, ... each cut back to a page boundary; 20 is the prompt's last
    # boundary (snapshot point), 23 its end.
    assert chunks == [4, 4, 4, 4, 4, 3], chunks
    # at 8 and 16 (every 8 tokens), at 20, and at 24, the output's end (23 + 2 - 1 tokens fed, rounded down)
    assert engine.prefix_cache.tree.num_snapshots == 4


# -- memory pressure --------------------------------------------------------------------------


# 16 pages of 4 tokens: about three requests at once, and little room for the cache besides.
SMALL = dict(slots=4, pages=16, interval=4, max_tokens_per_step=16)


def requests_on_three_bases(model) -> list:
    """Twelve requests whose prompts continue one of three bases, for SMALL's pools."""
    vocab = vocab_of(model)
    g = torch.Generator().manual_seed(11)
    bases = [random_ids(20, vocab, g) for _ in range(3)]
    prompts = [bases[i % 3][: 12 + 4 * (i % 2)] + random_ids(3 + i % 4, vocab, g) for i in range(12)]
    return [(p, SamplingParams(max_new_tokens=6)) for p in prompts]


@pytest.mark.parametrize("name", ["toy", MODELS[-1]])
def test_eviction_under_a_small_budget_keeps_requests_exact_and_frees_everything(name):
    model = build_model(name)
    requests = requests_on_three_bases(model)
    want = run(cached_engine(model, cache=False, **SMALL), requests, "staggered")
    engine = cached_engine(model, snapshots=3, **SMALL)  # for prefixes of three bases
    assert run(engine, requests, "staggered") == want
    stats = engine.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_snapshots_taken"] > 3, stats
    assert engine.prefix_cache.tree.evicted_pages > 0, "the pool must have been short enough to evict"
    assert_all_free(engine)


def test_a_request_needing_the_whole_pool_gets_it_from_the_cache():
    model = build_model("toy")
    g = torch.Generator().manual_seed(5)
    engine = cached_engine(model, slots=2, pages=8, snapshots=4, max_tokens_per_step=32)
    for _ in range(3):
        engine.generate(random_ids(14, 96, g), SamplingParams(max_new_tokens=2))
    assert engine.prefix_cache.tree.num_pages > 0
    long_prompt = random_ids(26, 96, g)
    result = engine.generate(long_prompt, SamplingParams(max_new_tokens=6))  # 32 tokens: every page
    assert result.output_ids == cached_engine(model, cache=False, slots=2, pages=8).generate(
        long_prompt, SamplingParams(max_new_tokens=6)).output_ids
    assert_all_free(engine)


def test_a_cache_without_snapshot_room_caches_nothing_and_stays_exact():
    model = build_model("toy")
    prompts = sharing_prompts(96)
    params = SamplingParams(max_new_tokens=3)
    engine = cached_engine(model, snapshots=0, max_tokens_per_step=12)
    got = [engine.generate(p, params).output_ids for p in prompts]
    want = [cached_engine(model, cache=False).generate(p, params).output_ids for p in prompts]
    assert got == want and engine.stats()["prefix_cache_hits"] == 0
    assert engine.prefix_cache.tree.num_pages == 0
    assert_all_free(engine)


def test_the_engine_refuses_a_cache_over_other_pools():
    model = build_model("toy")
    kv_pool, state_pool = make_pools(model, 2, 8, PAGE)
    other_kv, _ = make_pools(model, 2, 8, PAGE)
    cache = PrefixCache(other_kv, state_pool, SnapshotPool(model.layer_registry, 2))
    with pytest.raises(ValueError, match="prefix cache must hold the engine's own pools"):
        eager_engine(model, BoundOps(CPUReferenceBackend(kv_pool, state_pool)), kv_pool, state_pool, prefix_cache=cache)


def test_n_choices_forked_from_a_cache_hit_equal_the_same_choices_without_the_cache():
    """n > 1 with the cache on: the first choice hits the prefix another request left, the others are
    forked from its prefill (they hold nothing of the cache themselves); every choice's tokens equal
    the run without the cache, and everything is free at the end."""
    model = build_model("toy")
    g = torch.Generator().manual_seed(5)
    prompt = random_ids(23, vocab_of(model), g)
    earlier = prompt[:20] + random_ids(3, vocab_of(model), g)  # leaves the first 20 tokens cached
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=30 + i) for i in range(3)]

    def serve(cache: bool):
        engine = cached_engine(model, cache=cache, slots=6, max_tokens_per_step=16)
        engine.generate(earlier, SamplingParams(max_new_tokens=2))
        first = engine.add_request(prompt, params[0])
        ids = [first] + [engine.add_request(prompt, p, prefill_from=first) for p in params[1:]]
        results = engine.run_until_done()
        stats = engine.stats()
        assert stats["free_slots"] == stats["total_slots"]
        return [results[i].output_ids for i in ids], results[first].cached_tokens, stats

    with_cache, cached, stats = serve(True)
    without, _, _ = serve(False)
    assert cached > 0 and stats["prefills_shared"] == 2
    assert with_cache == without


def test_a_request_scoring_its_prompt_prefills_it_whole_and_gets_every_score():
    """Echo with log-probabilities needs each prompt position's logits, which a cached prefix does
    not keep: such a request takes no hit, and its scores equal the run without the cache."""
    model = build_model("toy")
    g = torch.Generator().manual_seed(6)
    prompt = random_ids(22, vocab_of(model), g)
    scored = SamplingParams(max_new_tokens=2, prompt_logprobs=1)

    def serve(cache: bool):
        engine = cached_engine(model, cache=cache, max_tokens_per_step=16)
        engine.generate(prompt, SamplingParams(max_new_tokens=2))
        engine.generate(prompt, SamplingParams(max_new_tokens=2))  # snapshots the branch point on a hit path
        result = engine.generate(prompt, scored)
        return result.prompt_logprobs, result.cached_tokens

    with_cache, cached = serve(True)
    without, _ = serve(False)
    assert cached == 0 and len(with_cache) == len(prompt) - 1
    assert with_cache == without
