"""The overlapped schedule: the same tokens as synchronous steps, one step late, nothing past an end.

With `overlap=True` a step's greedy ids stay on the device, the next step is laid out and
launched with them, and only then are they read (runtime/engine/engine.py, "Overlap"). These
tests run the same loads with overlap on and off and compare every request's tokens and finish
reason, on every family: mixed prompt lengths and limits, a stop id that is hit, chunked prefill,
requests joining mid-run, shared prefill (n > 1), cancels mid-stream, seeded draws, penalties,
log-probabilities, the prefix cache (snapshots of output tokens too), preemption; structured
output and speculative decoding on an artifact. Each run checks that what was streamed is the
result, that nothing came after a request's finished output, and that every slot, page and
snapshot is back in its pool; and that the overlapped path was taken, in the order it promises.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from runtime.cache.snapshot_pool import SnapshotPool
from runtime.engine import choices as choices_module
from runtime.engine.engine import Engine, SamplingParams
from runtime.step.bound_ops import BoundOps
from testkit.engine_loads import Job, drive
from testkit.engine_toy import available_families, build_model, eager_engine, make_engine, make_pools, prompts

MODELS = ["toy"] + available_families()
LENGTHS = [3, 17, 9, 30, 1, 12, 25, 6, 14, 2]

pytestmark = pytest.mark.usefixtures("one_thread")


def vocab_of(model) -> int:
    return model.lm_head.weight.shape[0]


def mixed_load(model, stop_engine) -> list[Job]:
    """Greedy requests of mixed lengths and limits joining over time, one ending on a stop id, one
    cancelled mid-stream, a shared prefill of three (one of them drawn), and the kinds of request
    that read the host (a seeded draw, penalties with bias, log-probabilities, a prompt scored)."""
    ps = prompts(len(LENGTHS), LENGTHS, vocab_of(model), seed=3)
    greedy = [SamplingParams(max_new_tokens=n) for n in (7, 3, 12, 1, 9, 5, 11, 4, 8, 6)]
    jobs = [Job(p, g, at_step=s) for p, g, s in zip(ps, greedy, (0, 0, 1, 2, 2, 3, 5, 8, 8, 13))]
    # A stop id it hits: its fourth token, the first time that token comes.
    tokens = stop_engine.generate(ps[2], greedy[2]).output_ids
    stop = tokens[3]
    assert tokens.index(stop) < len(tokens) - 1, "the stop must cut the request short"
    jobs[2].params = dataclasses.replace(greedy[2], stop_token_ids={stop})
    jobs[6].cancel_after = 4
    shared = prompts(1, [11], vocab_of(model), seed=9)[0]
    jobs += [Job(shared, SamplingParams(max_new_tokens=6), at_step=4),
             Job(shared, SamplingParams(max_new_tokens=9), at_step=4, share_with=len(jobs)),
             Job(shared, SamplingParams(max_new_tokens=5, temperature=0.9, seed=5), at_step=4, share_with=len(jobs))]
    jobs += [Job(ps[0], SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20, seed=11), at_step=3),
             Job(ps[1], SamplingParams(max_new_tokens=5, frequency_penalty=0.7, logit_bias={3: 2.0}), at_step=6),
             Job(ps[3], SamplingParams(max_new_tokens=4, logprobs=2), at_step=6),
             Job(ps[4], SamplingParams(max_new_tokens=3, prompt_logprobs=1), at_step=7),
             Job(ps[5], SamplingParams(max_new_tokens=0, prompt_logprobs=0), at_step=9)]
    return jobs


@pytest.mark.parametrize("name", MODELS)
def test_a_mixed_load_gives_the_same_tokens_with_overlap_on_and_off(name):
    model = build_model(name)
    runs, stats = {}, {}
    for overlap in (False, True):
        engine = make_engine(model, num_slots=8, num_pages=256, page_size=4, max_tokens_per_step=12,
                             overlap=overlap)
        jobs = mixed_load(model, make_engine(model, num_slots=1, num_pages=64, page_size=4))
        model.set_ops(engine.ops)
        runs[overlap], stats[overlap] = drive(engine, jobs), engine.stats()
    assert runs[True] == runs[False]
    reasons = [reason for _, reason in runs[True].values()]
    assert reasons.count("stop") == 1 and reasons.count("cancelled") == 1
    assert len(runs[True][6][0]) == 4, "the cancelled job keeps the tokens streamed before its cancel"
    assert stats[False]["overlapped_steps"] == 0
    assert stats[True]["overlapped_steps"] > 0 and stats[True]["synchronous_steps"] > 0
    assert stats[True]["prefills_shared"] == stats[False]["prefills_shared"] == 2


def test_greedy_steps_all_overlap_when_prompt_chunks_share_them_with_decodes():
    """A greedy load with chunked prompts arriving while others decode: every step is overlapped."""
    model = build_model("toy")
    engine = make_engine(model, num_slots=8, num_pages=256, page_size=4, max_tokens_per_step=10)
    ps = prompts(6, LENGTHS, vocab_of(model), seed=4)
    drive(engine, [Job(p, SamplingParams(max_new_tokens=5 + i), at_step=2 * i) for i, p in enumerate(ps)])
    stats = engine.stats()
    assert stats["synchronous_steps"] == 0 and stats["overlapped_steps"] == stats["steps"] > 0
    assert any(r.prefill_tokens and r.decode_tokens for r in engine.step_records()), "no mixed step ran"


def cached_engine(model, overlap: bool, snapshot_output: bool, in_step: bool = False, **kw) -> Engine:
    """in_step: the backend writes snapshots inside chunks (tests/runtime/cache/test_step_snapshots.py)."""
    kv_pool, state_pool = make_pools(model, 6, 160, 4)
    snapshots = SnapshotPool(model.layer_registry, 12)
    ops = BoundOps(CPUReferenceBackend(kv_pool, state_pool, snapshots=snapshots if in_step else None))
    model.set_ops(ops)
    cache = PrefixCache(kv_pool, state_pool, snapshots,
                        PrefixCacheConfig(snapshot_interval=8, snapshot_output=snapshot_output))
    return eager_engine(model, ops, kv_pool, state_pool, prefix_cache=cache, overlap=overlap, **kw)


@pytest.mark.parametrize("name, in_step", [("toy", False), ("qwen3_next", False), ("toy", True)])
@pytest.mark.parametrize("snapshot_output", [False, True])
def test_the_prefix_cache_stays_on_and_gives_the_same_tokens(name, snapshot_output, in_step):
    """Prompts sharing prefixes, repeated, with and without snapshots of output tokens (which need
    the tokens on the host before the cache takes them: the step in flight is read first), with
    snapshots at chunk ends or written inside chunks by the step."""
    model = build_model(name)
    g = torch.Generator().manual_seed(2)
    base = torch.randint(2, vocab_of(model), (21,), generator=g).tolist()
    tails = [torch.randint(2, vocab_of(model), (n,), generator=g).tolist() for n in (3, 9, 0, 5)]
    ps = [base + t for t in tails] + [base[:12], base + tails[1]]
    runs, stats = {}, {}
    for overlap in (False, True):
        engine = cached_engine(model, overlap, snapshot_output, in_step, max_tokens_per_step=16)
        jobs = [Job(p, SamplingParams(max_new_tokens=10 + i), at_step=3 * i) for i, p in enumerate(ps)]
        runs[overlap] = drive(engine, jobs)
        stats[overlap] = engine.stats()
    assert runs[True] == runs[False]
    assert stats[True]["prefix_cache_hit_tokens"] > 0 and stats[True]["overlapped_steps"] > 0
    assert stats[True]["prefix_cache_hit_tokens"] == stats[False]["prefix_cache_hit_tokens"]


@pytest.mark.parametrize("name", ["toy", "kimi_linear"])
def test_preemption_in_a_tiny_kv_pool_gives_the_same_tokens(name):
    model = build_model(name)
    ps = prompts(6, [9, 14, 5, 11, 7, 12], vocab_of(model), seed=6)
    runs, stats = {}, {}
    for overlap in (False, True):
        engine = make_engine(model, num_slots=6, num_pages=14, page_size=4, max_tokens_per_step=16, overlap=overlap)
        runs[overlap] = drive(engine, [Job(p, SamplingParams(max_new_tokens=12)) for p in ps])
        stats[overlap] = engine.stats()
    assert runs[True] == runs[False]
    assert stats[True]["preemptions"] > 0 and stats[True]["overlapped_steps"] > 0


def test_a_cancel_holds_the_slot_and_pages_until_the_step_in_flight_ends():
    model = build_model("toy")
    engine = make_engine(model, num_slots=2, num_pages=32, page_size=4)
    prompt = prompts(1, [6], vocab_of(model))[0]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=20))
    streamed = []
    while len(streamed) < 3:
        streamed += [out.token for out in engine.step()]
    assert engine.cancel(rid)
    assert engine.pop_result(rid).output_ids == tuple(streamed)
    stats = engine.stats()
    assert stats["free_slots"] == 1 and stats["free_pages"] < stats["total_pages"], "released under a running step"
    assert engine.has_work() and engine.step() == []
    stats = engine.stats()
    assert stats["free_slots"] == 2 and stats["free_pages"] == stats["total_pages"] and not engine.has_work()


def test_ids_are_read_only_after_the_next_step_is_launched(monkeypatch):
    """The order the overlap promises, seen from outside: a step's ids (their HostCopy) are read
    only after the next step's forward was queued; the only exception is the last read, with
    nothing left to run. Fails if the engine reads ids before launching the next step."""
    model = build_model("toy")
    engine = make_engine(model, num_slots=4, num_pages=64, page_size=4)
    events = []

    class WatchedCopy(choices_module.HostCopy):
        def __init__(self, values):
            super().__init__(values)
            self.number = sum(kind == "chosen" for kind, _ in events)
            events.append(("chosen", self.number))

        def tolist(self):
            events.append(("read", self.number))
            return super().tolist()

    monkeypatch.setattr(choices_module, "HostCopy", WatchedCopy)
    execute = engine.runner.execute

    def launching(*args, **kwargs):
        events.append(("launch", None))
        return execute(*args, **kwargs)
    monkeypatch.setattr(engine.runner, "execute", launching)
    ps = prompts(3, [5, 8, 3], vocab_of(model), seed=8)
    drive(engine, [Job(p, SamplingParams(max_new_tokens=6 + i)) for i, p in enumerate(ps)])
    reads = [i for i, (kind, _) in enumerate(events) if kind == "read"]
    assert len(reads) == engine.stats()["overlapped_steps"] > 5
    for read in reads[:-1]:
        chosen = events.index(("chosen", events[read][1]))
        assert ("launch", None) in events[chosen:read], f"ids read before the next step was launched: {events}"
    assert events[-1][0] == "read"


def test_tensor_parallel_refuses_overlap_naming_the_switch():
    model = build_model("toy")
    with pytest.raises(ValueError, match="no-overlap-schedule"):
        make_engine(model, broadcast=lambda seq_items, logits_rows: None)
    assert not make_engine(model, broadcast=lambda seq_items, logits_rows: None, overlap=False).overlap


# -- on an artifact: structured output, speculative decoding ------------------------------------

@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from runtime.artifact.loader import load_artifact
    from testkit.helpers import shared_artifact
    return load_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1])


def artifact_jobs(art, grammar=None) -> list[Job]:
    vocab = int(art.manifest["model"]["vocab_size"])
    ps = prompts(6, [5, 13, 2, 9, 17, 4], vocab, seed=12)
    jobs = [Job(p, SamplingParams(max_new_tokens=4 + 2 * i), at_step=i) for i, p in enumerate(ps)]
    if grammar is not None:
        jobs.append(Job(ps[1], SamplingParams(max_new_tokens=12, grammar=grammar), at_step=2))
    return jobs


def test_structured_output_mixed_with_greedy_requests_gives_the_same_tokens(artifact):
    pytest.importorskip("xgrammar")
    from runtime.artifact.tokenizer import TextTokenizer
    from runtime.assembly import EngineOptions, engine_for_artifact
    from runtime.engine.grammar import StructuredOutput

    tok = TextTokenizer.from_dir(artifact.docs.path)
    grammar = StructuredOutput(tok, int(artifact.manifest["model"]["vocab_size"]), [tok.eos_token_id]).compile(
        {"type": "json_object"})
    runs, stats = {}, {}
    for overlap in (False, True):
        options = EngineOptions(slots=8, token_budget=16, prefix_cache=False, overlap=overlap)
        engine = engine_for_artifact(artifact, options, 64)
        runs[overlap], stats[overlap] = drive(engine, artifact_jobs(artifact, grammar)), engine.stats()
    assert runs[True] == runs[False]
    assert stats[True]["overlapped_steps"] > 0 and stats[True]["synchronous_steps"] > 0


def test_speculative_decoding_runs_synchronous_steps_with_the_overlapped_engines_tokens(artifact):
    from runtime.assembly import EngineOptions, engine_for_artifact

    runs, stats = {}, {}
    for D in (0, 2):
        engine = engine_for_artifact(artifact, EngineOptions(slots=4, token_budget=16, speculative_tokens=D), 64)
        runs[D], stats[D] = drive(engine, artifact_jobs(artifact)), engine.stats()
    assert runs[2] == runs[0]
    assert stats[0]["overlapped_steps"] > 0
    assert stats[2]["overlapped_steps"] == 0 and stats[2]["synchronous_steps"] == stats[2]["steps"] > 0


def test_replayed_graph_steps_get_the_device_ids_written_into_their_static_inputs(artifact):
    """Through a GraphRunner (graphs rerun on the CPU): decode and mixed steps replayed from
    captured keys take the ids of the step before from the device, written into the static
    input buffer after the staging copy, and give the tokens of synchronous steps."""
    from runtime.assembly import EngineOptions, engine_for_artifact
    from testkit.graph_cases import RerunGraphs

    runs, stats = {}, {}
    for overlap in (False, True):
        options = EngineOptions(slots=4, token_budget=16, prefix_cache=False, overlap=overlap)
        engine = engine_for_artifact(artifact, options, 64, graphs=RerunGraphs())
        runs[overlap], stats[overlap] = drive(engine, artifact_jobs(artifact)), engine.stats()
    assert runs[True] == runs[False]
    assert stats[True]["graph_replays"] > 0 and stats[True]["piecewise_steps"] > 0
    assert stats[True]["overlapped_steps"] == stats[True]["steps"]


@pytest.mark.parametrize("name", MODELS)
def test_decodes_apart_from_the_prompt_chunks_give_the_same_tokens(name):
    """decodes_apart_from (runtime/engine/engine.py, "Decodes apart"): a step's prompt chunks and its
    decodes as two forwards, with overlap on and off, give the tokens of one forward per step."""
    model = build_model(name)
    runs, forwards = {}, {}
    for apart, overlap in ((0, True), (1, True), (1, False)):
        engine = make_engine(model, num_slots=8, num_pages=256, page_size=4, max_tokens_per_step=12,
                             overlap=overlap, decodes_apart_from=apart)
        jobs = mixed_load(model, make_engine(model, num_slots=1, num_pages=64, page_size=4))
        model.set_ops(engine.ops)
        execute, calls = engine.runner.execute, []
        engine.runner.execute = lambda *a, **k: calls.append(1) or execute(*a, **k)
        runs[apart, overlap] = drive(engine, jobs)
        forwards[apart, overlap] = (len(calls), engine.stats()["steps"])
    assert runs[1, True] == runs[0, True] == runs[1, False]
    assert forwards[0, True][0] == forwards[0, True][1], "one forward a step"
    assert forwards[1, True][0] > forwards[1, True][1], "mixed steps ran their decodes apart"


def test_decodes_apart_only_from_so_many_decodes():
    from runtime.engine.request import StepPlan

    engine = make_engine(build_model("toy"), decodes_apart_from=3)
    chunk, decodes = [(object(), 5)], [object()] * 3
    assert engine._decodes_apart(StepPlan(chunk, decodes, [])) == 1
    assert engine._decodes_apart(StepPlan(chunk, decodes[:2], [])) == 0
    assert engine._decodes_apart(StepPlan([], decodes, [])) == 0
    with pytest.raises(ValueError, match="decodes_apart_from"):
        make_engine(build_model("toy"), decodes_apart_from=-1)
