"""Snapshots written by the step: a snapshot point inside a chunk costs no step of its own.

With a backend that writes in-step snapshots (the CPU reference over the cache's snapshot pool),
the prefix cache ends no chunk at a snapshot point; the step writes the state there into a snapshot.

- Exactness: greedy tokens with the cache equal those without it on the toy model and all four
  families, with points inside chunks (two in one chunk too), at chunk ends and at a prompt's last
  page; and requests hit exactly where they hit when chunks end at the points.
- The snapshot is the state an unpadded eager run of the prefix alone leaves, in every linear
  layer's entries, for requests sharing a step: bit for bit on the toy model; on the families to
  the last bits of float32, since their glue's rows are not computed bitwise alike in steps of
  other row counts (tests/runtime/backends/test_cpu_step_snapshots.py says why, and checks each
  linear op's snapshot bit for bit against its rows alone).
- Steps: a miss whose prompt end is not page-aligned prefills in one step fewer, and an identical
  prompt then hits that snapshot.
- Pressure: with one or two snapshot ids, outputs stay exact and no id leaks, also when a request
  leaves between the cache's choice of an id and its step.
"""

from __future__ import annotations

import pytest
import torch

from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.batch import SeqState
from runtime.engine.engine import Engine, SamplingParams
from runtime.graphs.step_runner import EagerRunner, run_step
from runtime.step.bound_ops import BoundOps
from testkit.engine_toy import build_model, make_pools
from tests.runtime.cache.test_prefix_cache import (MODELS, PAGE, SMALL, assert_all_free, cached_engine, random_ids,
                                                   requests_on_three_bases, run, sharing_prompts, vocab_of)

pytestmark = pytest.mark.usefixtures("one_thread")


def in_step_points(engine: Engine) -> list[int]:
    """The points the engine's steps will write snapshots at (filled as they are chosen)."""
    cache, points = engine.prefix_cache, []
    choose = cache.before_step

    def recording(entries):
        choose(entries)
        points.extend(seq.snapshot[0] for _, seq, _ in entries if seq.snapshot is not None)

    cache.before_step = recording
    return points


def prefill_steps(engine: Engine) -> int:
    return sum(1 for r in engine.step_records() if r.prefill_tokens)


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_with_in_step_snapshots_equal_tokens_without_the_cache(name):
    """A 12-token budget, two arrivals a step: points at chunk ends, and inside chunks beside other
    requests; a 64-token one, one request after another: inside chunks of whole prompts."""
    model = build_model(name)
    requests = [(p, SamplingParams(max_new_tokens=4)) for p in sharing_prompts(vocab_of(model))]
    for budget, arrival in ((12, "staggered"), (64, "sequential")):
        want = run(cached_engine(model, cache=False, max_tokens_per_step=budget), requests, arrival)
        engine = cached_engine(model, in_step=True, max_tokens_per_step=budget)
        points = in_step_points(engine)
        assert run(engine, requests, arrival) == want, budget
        stats = engine.stats()
        assert points and stats["prefix_cache_snapshots_taken"] > len(points), (budget, points, stats)
        assert stats["prefix_cache_hits"] >= 4, stats
        assert_all_free(engine)


def test_requests_hit_where_they_hit_when_chunks_end_at_the_points():
    """tests/runtime/cache/test_prefix_cache.py's branch points and prompt ends, each written inside
    the chunk that passes it: the same hits, in fewer steps. The fourth prompt (23 tokens, parting
    from the first at 17) passes its branch point 16 and its last page 20 in one chunk: the step
    writes 16 and the chunk ends at 20."""
    model = build_model("toy")
    params = SamplingParams(max_new_tokens=3)
    got = {}
    for in_step in (False, True):
        engine = cached_engine(model, interval=10_000, max_tokens_per_step=64, in_step=in_step)
        points = in_step_points(engine) if in_step else []
        results = [engine.generate(p, params) for p in sharing_prompts(vocab_of(model))]
        got[in_step] = ([r.cached_tokens for r in results], [r.output_ids for r in results], prefill_steps(engine))
        assert_all_free(engine)
    assert got[True][:2] == got[False][:2]
    assert got[True][0] == [0, 0, 0, 4, 24, 24, 16, 20, 16]
    assert 16 in points and 24 in points
    assert got[True][2] < got[False][2]


@pytest.mark.parametrize("name", MODELS)
def test_a_snapshot_written_in_the_step_is_the_state_an_eager_run_of_its_prefix_leaves(name):
    """Two misses in one step, their last page boundaries (16 and 20) inside their chunks: each
    snapshot equals, in every entry of every linear layer, the state a fresh slot holds after an
    unpadded eager step of that prefix alone (the module docstring says how exactly)."""
    model = build_model(name)
    g = torch.Generator().manual_seed(4)
    prompts = [random_ids(18, vocab_of(model), g), random_ids(23, vocab_of(model), g)]
    engine = cached_engine(model, in_step=True, interval=10_000, max_tokens_per_step=64)
    points = in_step_points(engine)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=1))
    engine.run_until_done()
    assert points == [16, 20] and prefill_steps(engine) == 1
    cache = engine.prefix_cache
    for prompt, point in zip(prompts, points):
        match = cache.tree.match(prompt[:point] + [0], point)
        assert match.tokens == point
        want = prefix_state(model, prompt[:point])
        assert want
        for layer_id, entries in cache.snapshots.buffers.items():
            for entry, t in entries.items():
                if name == "toy":
                    assert torch.equal(t[match.snapshot], want[layer_id][entry]), (point, layer_id, entry)
                else:
                    torch.testing.assert_close(t[match.snapshot], want[layer_id][entry], rtol=1e-5, atol=1e-6)


def prefix_state(model, tokens: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Every linear layer's state after one eager step of `tokens` on a fresh slot of fresh pools."""
    kv_pool, state_pool = make_pools(model, 1, 16, PAGE)
    ops = BoundOps(CPUReferenceBackend(kv_pool, state_pool))
    model.set_ops(ops)
    seq = SeqState(state_pool.alloc())
    run_step(EagerRunner(model, ops, kv_pool, "cpu", len(tokens)), [(seq, tokens)])
    return {layer_id: {name: t[seq.slot].clone() for name, t in entries.items()}
            for layer_id, entries in state_pool.buffers.items()}


@pytest.mark.parametrize("name", ["toy", MODELS[-1]])
def test_a_miss_off_a_page_boundary_takes_one_step_fewer_and_a_repeat_hits_its_snapshot(name):
    model = build_model(name)
    prompt = random_ids(18, vocab_of(model), torch.Generator().manual_seed(8))
    params = SamplingParams(max_new_tokens=3)
    steps, outputs = {}, set()
    for in_step in (False, True):
        engine = cached_engine(model, in_step=in_step, interval=10_000, max_tokens_per_step=64)
        first = engine.generate(prompt, params)
        steps[in_step] = prefill_steps(engine)
        again = engine.generate(prompt, params)
        assert (first.cached_tokens, again.cached_tokens) == (0, 16), in_step
        outputs |= {first.output_ids, again.output_ids}
        assert_all_free(engine)
    assert steps == {False: 2, True: 1} and len(outputs) == 1


@pytest.mark.parametrize("name, snapshots", [("toy", 1), ("toy", 2), (MODELS[-1], 2)])
def test_a_pool_of_one_or_two_snapshots_keeps_requests_exact_and_leaks_no_id(name, snapshots):
    """Prompts on three bases, staggered, in a KV pool that evicts and a snapshot pool that evicts in
    most steps; `run` checks after every step that every id is free or the tree's."""
    model = build_model(name)
    requests = requests_on_three_bases(model)
    want = run(cached_engine(model, cache=False, **SMALL), requests, "staggered")
    engine = cached_engine(model, in_step=True, snapshots=snapshots, **SMALL)
    points = in_step_points(engine)
    assert run(engine, requests, "staggered") == want
    assert points and engine.stats()["prefix_cache_snapshots_taken"] > 2 * snapshots, "the pool must have evicted"
    assert_all_free(engine)


def test_an_in_step_snapshot_of_a_request_that_leaves_before_its_step_goes_back():
    model = build_model("toy")
    engine = cached_engine(model, in_step=True, snapshots=2, max_tokens_per_step=64)
    cache = engine.prefix_cache
    request_id = engine.add_request(random_ids(18, vocab_of(model), torch.Generator().manual_seed(2)),
                                    SamplingParams(max_new_tokens=2))
    [(req, n)] = engine.scheduler.schedule().prefill
    cache.before_step([(req.cache, req.seq, n)])
    assert req.seq.snapshot is not None and req.seq.snapshot[0] == 16 and cache.snapshots.num_free == 1
    engine.cancel(request_id)
    assert cache.snapshots.num_free == 2
    assert_all_free(engine)
