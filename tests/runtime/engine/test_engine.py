"""Engine: batch invariance, no leaks, seeded sampling, queueing, preemption, chunked prefill, the loop."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import pytest
import torch

from compiler.splitops import Mode
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.backends.protocol import ProtocolError
from runtime.step.bound_ops import BoundOps
from runtime.engine.engine import Engine, EngineStalled, SamplingParams
from runtime.engine.loop import EngineLoop, EngineLoopError
from runtime.engine.sampling import filtered_distribution, make_generator, sample_next
from testkit.engine_toy import available_families, build_model, eager_engine, make_engine, make_pools, prompts

MODELS = ["toy"] + available_families()
LENGTHS = [3, 17, 9, 30, 1, 12, 25, 6]  # mixed prompt lengths


pytestmark = pytest.mark.usefixtures("one_thread")


def vocab_of(model) -> int:
    return model.lm_head.weight.shape[0]


def alone(model, prompt, params: SamplingParams) -> tuple[int, ...]:
    """The request on a fresh engine of its own: the reference every batched run must match."""
    engine = make_engine(model, num_slots=1, num_pages=64, page_size=4)
    return engine.generate(prompt, params).output_ids


def assert_all_free(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["free_slots"] == stats["total_slots"], stats
    assert stats["free_pages"] == stats["total_pages"], stats
    assert stats["queue_depth"] == 0 and stats["running"] == 0


def run_staggered(engine: Engine, requests, join_every: int = 2) -> dict:
    """Add requests a pair at a time between steps; return {index: result}."""
    ids = {}
    pending = list(enumerate(requests))
    while pending or engine.has_work():
        for _ in range(join_every):
            if pending:
                i, (prompt, params) = pending.pop(0)
                ids[engine.add_request(prompt, params)] = i
        engine.step()
    return {ids[rid]: result for rid, result in engine.run_until_done().items()}


# -- batch invariance -------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_do_not_depend_on_the_batch(name):
    model = build_model(name)
    requests = [(p, SamplingParams(max_new_tokens=4 + i)) for i, p in enumerate(prompts(8, LENGTHS, vocab_of(model)))]
    engine = make_engine(model, num_slots=8, num_pages=128, page_size=4, max_tokens_per_step=24)
    results = run_staggered(engine, requests)
    modes = {record.mode for record in engine.step_records()}
    assert Mode.MIXED in modes and Mode.DECODE in modes, "the run must mix prefill chunks with decodes"
    for i, (prompt, params) in enumerate(requests):
        assert results[i].output_ids == alone(model, prompt, params), f"request {i} (prompt of {len(prompt)})"
        assert results[i].finish_reason == "length"
    assert_all_free(engine)


def test_decodes_apart_from_one_never_mixes_a_decode_row_into_a_prompt_forward():
    """decodes_apart_from=1 (what an artifact compiled with --batch-invariant runs with): the staggered run above, where
    chunks and decodes share steps, runs them as two forwards, chunks first; no forward is mixed, a
    decoding request's row always goes through a decode forward, and the tokens are each request's own."""
    model = build_model("toy")
    requests = [(p, SamplingParams(max_new_tokens=4 + i)) for i, p in enumerate(prompts(8, LENGTHS, vocab_of(model)))]
    engine = make_engine(model, num_slots=8, num_pages=128, page_size=4, max_tokens_per_step=24, decodes_apart_from=1)
    forwards = []
    execute = engine.execute

    def recording(seq_items, logits_rows, input_ids=None):
        mode, logits, hidden = execute(seq_items, logits_rows, input_ids)
        forwards.append((mode, [len(tokens) for _, tokens in seq_items]))
        return mode, logits, hidden
    engine.execute = recording
    results = run_staggered(engine, requests)
    assert Mode.MIXED not in {mode for mode, _ in forwards}
    decodes = [lens for mode, lens in forwards if mode is Mode.DECODE]
    assert decodes and all(set(lens) == {1} for lens in decodes)
    steps = len(engine.step_records())
    assert len(forwards) > steps, "the run must have steps that carried both a prompt chunk and decodes"
    for i, (prompt, params) in enumerate(requests):
        assert results[i].output_ids == alone(model, prompt, params), f"request {i} (prompt of {len(prompt)})"
    assert_all_free(engine)


# -- no leak between requests -----------------------------------------------------------------


def test_a_reused_slot_and_pages_give_fresh_engine_tokens():
    model = build_model(MODELS[-1])
    first, second = prompts(2, [21, 11], vocab_of(model), seed=5)
    params = SamplingParams(max_new_tokens=6)
    engine = make_engine(model, num_slots=1, num_pages=16, page_size=4)
    engine.generate(first, params)
    assert_all_free(engine)
    reused = engine.generate(second, params)  # the same slot 1 and pages 0.. as `first` had
    assert reused.output_ids == alone(model, second, params)
    assert_all_free(engine)


def test_cancel_frees_everything_and_leaves_nothing_behind():
    model = build_model("toy")
    a, b, c = prompts(3, [14, 9, 5], vocab_of(model), seed=7)
    params = SamplingParams(max_new_tokens=10)
    engine = make_engine(model, num_slots=1, num_pages=16, page_size=4)
    running = engine.add_request(a, params)
    queued = engine.add_request(b, params)
    engine.step()
    engine.step()
    assert engine.stats()["running"] == 1 and engine.stats()["queue_depth"] == 1
    assert engine.cancel(running) and engine.cancel(queued)
    assert not engine.cancel(running), "a finished request cannot be cancelled twice"
    assert engine.pop_result(running).finish_reason == "cancelled"
    assert engine.pop_result(queued).output_ids == ()
    # The step still on the device keeps the slot and pages of the request it runs until it ends.
    assert engine.step() == [], "a cancelled request's token still on the device is never emitted"
    assert not engine.has_work()
    assert_all_free(engine)
    assert engine.generate(c, params).output_ids == alone(model, c, params)


# -- sampling ---------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    model = build_model(MODELS[-1])
    ps = prompts(6, LENGTHS, vocab_of(model), seed=3)
    sampled = [SamplingParams(max_new_tokens=8, temperature=0.9, top_k=40, top_p=0.95, seed=100 + i)
               for i in range(len(ps))]
    requests = list(zip(ps, sampled))

    def batch_run():
        engine = make_engine(model, num_slots=6, num_pages=128, page_size=4, max_tokens_per_step=16)
        return {i: r.output_ids for i, r in run_staggered(engine, requests, join_every=3).items()}

    first, again = batch_run(), batch_run()
    assert first == again
    for i, (prompt, params) in enumerate(requests):
        assert first[i] == alone(model, prompt, params)
    greedy = [alone(model, prompt, SamplingParams(max_new_tokens=8)) for prompt in ps]
    assert sum(first[i] != greedy[i] for i in range(len(ps))) >= len(ps) // 2, "this is hardly sampling"
    reseeded = dataclasses.replace(sampled[0], seed=7)
    assert alone(model, ps[0], reseeded) != first[0], "another seed, another continuation"


def test_sampling_filters():
    logits = torch.tensor([1.0, 3.0, 2.0, 3.0, -1.0])
    ids, probs = filtered_distribution(logits, SamplingParams(temperature=1.0, top_k=3))
    assert ids.tolist() == [1, 3, 2] and abs(float(probs.sum()) - 1) < 1e-12  # ties by token id
    ids, _ = filtered_distribution(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert ids.tolist() == [1, 3]  # 0.3995 after the first, 0.799 after the second: two reach 0.5
    g = make_generator(SamplingParams(temperature=1.0, seed=0))
    assert sample_next(logits, SamplingParams(temperature=1.0, top_k=1, seed=0), g) == 1  # top-1 is greedy
    assert sample_next(logits, SamplingParams(), None) == 1
    draws = [sample_next(logits, SamplingParams(temperature=1.0, top_k=2, seed=0), g) for _ in range(50)]
    assert set(draws) == {1, 3}
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_k=-1), dict(top_p=0.0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# -- queueing, preemption, chunked prefill ----------------------------------------------------


def test_requests_queue_when_slots_and_pages_run_out():
    model = build_model("toy")
    requests = [(p, SamplingParams(max_new_tokens=5 + i % 3)) for i, p in enumerate(prompts(8, LENGTHS, 96, seed=2))]
    # 2 slots, and pages for about one long request: most requests wait for both.
    engine = make_engine(model, num_slots=2, num_pages=10, page_size=4, max_tokens_per_step=64)
    ids = [engine.add_request(p, params) for p, params in requests]
    depths = []
    while engine.has_work():
        engine.step()
        depths.append(engine.stats()["queue_depth"])
    assert max(depths) >= 5
    results = engine.run_until_done()
    for rid, (prompt, params) in zip(ids, requests):
        assert results[rid].output_ids == alone(model, prompt, params)
    assert_all_free(engine)


def test_preempted_requests_resume_with_the_same_tokens():
    model = build_model("toy")
    greedy = SamplingParams(max_new_tokens=14)
    seeded = SamplingParams(max_new_tokens=14, temperature=1.0, seed=11)
    requests = [(p, greedy if i % 2 else seeded) for i, p in enumerate(prompts(4, [7, 5, 6, 4], 96, seed=9))]
    # 8 pages of 4 = 32 tokens; four requests growing to ~20 tokens each cannot all stay.
    engine = make_engine(model, num_slots=4, num_pages=8, page_size=4, max_tokens_per_step=64)
    ids = [engine.add_request(p, params) for p, params in requests]
    results = engine.run_until_done()
    assert engine.stats()["preemptions"] > 0
    assert any(results[rid].preemptions for rid in ids)
    for rid, (prompt, params) in zip(ids, requests):
        assert results[rid].output_ids == alone(model, prompt, params)
    assert_all_free(engine)


@pytest.mark.parametrize("name", MODELS[-1:])
def test_chunked_prefill_matches_unchunked(name):
    model = build_model(name)
    requests = [(p, SamplingParams(max_new_tokens=5)) for p in prompts(4, [30, 17, 3, 25], vocab_of(model), seed=4)]

    def run(budget):
        engine = make_engine(model, num_slots=4, num_pages=128, page_size=4, max_tokens_per_step=budget)
        ids = [engine.add_request(p, params) for p, params in requests]
        results = engine.run_until_done()
        sizes = [r.prefill_tokens + r.decode_tokens for r in engine.step_records()]
        assert max(sizes) <= budget
        return [results[rid].output_ids for rid in ids]

    assert run(3) == run(512)


def test_many_requests_through_tiny_pools_never_stall():
    model = build_model("toy")
    requests = [(p, SamplingParams(max_new_tokens=1 + i % 6)) for i, p in enumerate(prompts(20, [2, 9, 4, 13, 1], 96))]
    engine = make_engine(model, num_slots=3, num_pages=10, page_size=2, max_tokens_per_step=5)
    ids = [engine.add_request(p, params) for p, params in requests]
    results = engine.run_until_done()
    assert sorted(results) == sorted(ids)
    for rid, (prompt, params) in list(zip(ids, requests))[::4]:
        assert results[rid].output_ids == alone(model, prompt, params)
    assert_all_free(engine)


# -- stop conditions and validation -----------------------------------------------------------


def test_stop_token_ends_the_request_and_is_emitted():
    model = build_model("toy")
    prompt = prompts(1, [8], 96, seed=12)[0]
    full = alone(model, prompt, SamplingParams(max_new_tokens=10))
    stop = full[3]
    cut = full[: full.index(stop) + 1]
    engine = make_engine(model)
    result = engine.generate(prompt, SamplingParams(max_new_tokens=10, stop_token_ids={stop}))
    assert result.output_ids == cut and result.finish_reason == "stop"


def test_requests_that_could_never_finish_are_refused():
    engine = make_engine(build_model("toy"), num_slots=1, num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="exceed the engine's 16 tokens"):
        engine.add_request(list(range(2, 14)), SamplingParams(max_new_tokens=5))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    engine.add_request([3], SamplingParams(max_new_tokens=2), request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([3], SamplingParams(max_new_tokens=2), request_id="a")


def test_the_engine_needs_a_protocol_backend():
    model = build_model("toy")
    kv_pool, state_pool = make_pools(model, 1, 4)
    class OpsWithoutHooks:  # every op method, but not a BackendHooks: its plans would never run
        def __getattr__(self, name):
            return getattr(CPUReferenceBackend(kv_pool, state_pool), name)

    with pytest.raises(ProtocolError, match="does not implement the backend protocol"):
        eager_engine(model, BoundOps(OpsWithoutHooks()), kv_pool, state_pool)


def test_a_stall_is_an_error_not_a_hang():
    engine = make_engine(build_model("toy"), num_slots=1, num_pages=8, page_size=4)
    engine.add_request([3, 4], SamplingParams())
    engine.kv_pool.alloc(8)  # pages taken behind the engine's back: nothing can be admitted
    with pytest.raises(EngineStalled, match="nothing scheduled"):
        engine.step()


# -- timing and stats -------------------------------------------------------------------------


def test_timing_reports_prefill_and_decode_phases():
    engine = make_engine(build_model("toy"))
    result = engine.generate(prompts(1, [20], 96)[0], SamplingParams(max_new_tokens=6))
    timing = engine.timing()
    # One prefill step gives the first token; five decode steps give the rest.
    assert timing["prefill_steps"] == 1 and timing["prefill_tokens"] == 20 and timing["decode_steps"] == 5
    assert timing["prefill_s"] > 0 and timing["decode_s_per_token"] == pytest.approx(timing["decode_s"] / 5)
    assert timing["decode_tokens_per_s"] > 0
    assert result.first_token_s is not None and result.total_s >= result.first_token_s
    stats = engine.stats()
    assert stats["tokens_generated"] == 6 and stats["steps"] == 6 and stats["last_step_s"] > 0
    assert json.loads(json.dumps(stats))["recent_steps"][0]["mode"] == "extend"


# -- the engine loop --------------------------------------------------------------------------


def test_engine_loop_serves_threads_with_the_same_tokens():
    model = build_model("toy")
    requests = [(p, SamplingParams(max_new_tokens=6, temperature=0.8, seed=i) if i % 2 else SamplingParams(max_new_tokens=6))
                for i, p in enumerate(prompts(6, LENGTHS, 96, seed=6))]
    streamed: dict[int, list[int]] = {}
    with EngineLoop(make_engine(model, num_slots=3, num_pages=64, page_size=4, max_tokens_per_step=16)) as loop:
        def client(i):
            handle = loop.submit(*requests[i])
            streamed[i] = list(handle)
            assert tuple(streamed[i]) == handle.result(timeout=30).output_ids

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert loop.stats()["running"] == 0
    for i, (prompt, params) in enumerate(requests):
        assert tuple(streamed[i]) == alone(model, prompt, params)


def test_engine_loop_streams_to_asyncio_and_cancels():
    model = build_model("toy")
    prompt = prompts(1, [10], 96, seed=8)[0]
    params = SamplingParams(max_new_tokens=8)

    async def main(loop_):
        handle = loop_.submit(prompt, params, loop=asyncio.get_running_loop())
        tokens = [token async for token in handle]
        long_one = loop_.submit(prompt, SamplingParams(max_new_tokens=500), loop=asyncio.get_running_loop())
        seen = 0
        async for _ in long_one:
            seen += 1
            if seen == 1:
                assert long_one.cancel()
        assert seen < 500
        assert long_one.result(timeout=30).finish_reason == "cancelled"
        return tokens

    engine = make_engine(model, num_slots=2, num_pages=256, page_size=4)
    # A toy step takes about a millisecond, so on a loaded machine all 500 tokens could be made
    # before the consumer wakes up once; a paced step keeps the long request live for ~10 s, far
    # longer than the consumer needs to see its first token.
    unpaced_step = engine.step

    def paced_step():
        time.sleep(0.02)
        return unpaced_step()

    engine.step = paced_step
    with EngineLoop(engine) as loop_:
        tokens = asyncio.run(main(loop_))
    assert tuple(tokens) == alone(model, prompt, params)
    assert_all_free(engine)


def test_engine_loop_lets_a_waiting_caller_in_before_its_next_step():
    # The stepping thread releases the lock and would take it back at once: with a plain lock a
    # waiting cancel could sit through dozens of steps (a shutdown's cancels then missed their
    # bound). Here a step is held open until a stats() call is known to wait for the lock; the
    # step after it must find that call served.
    engine = make_engine(build_model("toy"), num_slots=2, num_pages=256, page_size=4)
    unpaced_step, unlocked_stats = engine.step, engine.stats
    served, seen_by_step = [0], []
    in_step, go = threading.Event(), threading.Event()

    def gated_step():
        seen_by_step.append(served[0])
        if len(seen_by_step) == 3:
            in_step.set()
            assert go.wait(30)
        return unpaced_step()

    def counted_stats():
        served[0] += 1
        return unlocked_stats()

    engine.step, engine.stats = gated_step, counted_stats
    with EngineLoop(engine) as loop_:
        handle = loop_.submit(prompts(1, [10], 96, seed=8)[0], SamplingParams(max_new_tokens=200))
        assert in_step.wait(30)
        caller = threading.Thread(target=loop_.stats)
        caller.start()
        deadline = time.monotonic() + 30
        while loop_._announced == 0:  # the caller has announced itself and waits for the lock
            assert time.monotonic() < deadline
            time.sleep(0.001)
        go.set()
        caller.join(30)
        while len(seen_by_step) < 4:  # the step after the held one has begun
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert loop_.cancel(handle.request_id)
    assert seen_by_step[2] == 0 and seen_by_step[3] == 1, seen_by_step[:6]


def test_engine_loop_steps_on_while_callers_keep_coming():
    # Fairness the other way round: callers that never stop asking (a metrics scraper, a stream of
    # submits) must not hold the steps back; only those that asked before a step go before it.
    engine = make_engine(build_model("toy"), num_slots=2, num_pages=256, page_size=4)
    stop = threading.Event()
    with EngineLoop(engine) as loop_:
        def hammer():
            while not stop.is_set():
                loop_.stats()

        callers = [threading.Thread(target=hammer) for _ in range(4)]
        for t in callers:
            t.start()
        try:
            handle = loop_.submit(prompts(1, [10], 96, seed=8)[0], SamplingParams(max_new_tokens=100))
            assert handle.result(timeout=60).finish_reason == "length"
        finally:
            stop.set()
            for t in callers:
                t.join(30)


def test_engine_loop_reports_a_failed_step_to_every_request():
    model = build_model("toy")
    engine = make_engine(model)

    def broken(*args):
        raise RuntimeError("kernel exploded")

    engine.runner.forward = broken
    with EngineLoop(engine) as loop_:
        handle = loop_.submit([3, 4, 5], SamplingParams())
        with pytest.raises(EngineLoopError, match="kernel exploded"):
            handle.result(timeout=10)
        with pytest.raises(RuntimeError, match="stopped"):
            loop_.submit([3], SamplingParams())
