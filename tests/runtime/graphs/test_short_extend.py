"""Short extends on the CPU: small extend buckets with request rows of their own
(runtime/graphs/buckets.py), a 32-token extend replayed in the 32-token bucket with the eager
tokens (testkit/graph_cases.RerunGraphs standing in for CUDA graphs), `hgc inspect` showing the
buckets and how they were chosen, and an artifact recorded with the earlier buckets still running.

Whole-step extend graphs: where an artifact's extend and mixed plans are one captured piece (a
GPU's GQA attention routed to `flashinfer[extend_impl=triton]`; here the reference math declared
for the cpu target as a GQA backend whose extends may be captured), each extend bucket is one
graph and extend and mixed steps replay it, with the eager engine's tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil
import types

import pytest

from compiler.splitops import MODES, Mode, OpCapture
from compiler.splitops.artifact import DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS
from hgc import main
from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.engine.engine import SamplingParams
from runtime.engine.generate import make_pools
from runtime.graphs.buckets import Buckets, extend_seqs
from runtime.graphs.runner import CaptureError, CaptureKey, GraphRunner
from runtime.step.bound_ops import BoundOps
from testkit.graph_cases import RerunGraphs, greedy
from testkit.helpers import edit_manifest, shared_artifact

# five compiles of the tiny qwen3_next's config, their artifacts loaded again and again
pytestmark = pytest.mark.usefixtures("shared_traces", "shared_loads", "one_thread")

EARLIER_EXTEND_BUCKETS = [256, 512, 1024, 2048, 4096]  # what artifacts recorded before the small buckets


@pytest.fixture(scope="module")
def art_dir(tmp_path_factory):
    """The test run's tiny qwen3_next artifact (testkit/helpers.shared_artifact): only read."""
    return shared_artifact(tmp_path_factory, "qwen3_next")[1]


def test_each_extend_bucket_holds_at_most_its_tokens_in_requests():
    """The default buckets: small extend graphs hold as many requests as they have tokens, the
    large ones as many as the largest decode bucket; a step goes to the smallest that holds it."""
    b = Buckets(DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS,
                extend_seqs(DEFAULT_DECODE_BATCH_SIZES[-1], DEFAULT_EXTEND_TOKEN_COUNTS))
    assert [(k.tokens, k.seqs) for k in b.capture_keys() if k.mode == Mode.EXTEND] == [
        (4096, 256), (2048, 256), (1024, 256), (512, 256), (256, 256), (128, 128), (128, 1), (64, 64), (64, 1),
        (32, 32), (32, 1), (16, 16), (16, 1)]
    assert b.key_for(Mode.EXTEND, 32, 1) == CaptureKey(Mode.EXTEND, 32, 1), "a prefix hit's suffix: not 256, nor 32 rows"
    assert b.key_for(Mode.EXTEND, 32, 2) == CaptureKey(Mode.EXTEND, 32, 32), "two requests: the bucket's full rows"
    assert b.key_for(Mode.EXTEND, 1, 1) == CaptureKey(Mode.EXTEND, 16, 1)
    assert b.key_for(Mode.EXTEND, 200, 1) == CaptureKey(Mode.EXTEND, 256, 256), "one request key up to 128 tokens only"
    assert b.key_for(Mode.MIXED, 200, 150) == CaptureKey(Mode.EXTEND, 256, 256), "150 decodes beside a 50-token chunk"
    assert b.key_for(Mode.MIXED, 600, 256) == CaptureKey(Mode.EXTEND, 1024, 256)
    assert b.key_for(Mode.MIXED, 600, 257) is None, "more requests than any extend graph holds: eager"
    assert (b.max_tokens, b.max_seqs) == (4096, 256), "the static buffers are no larger than before"


def test_a_32_token_extend_replays_the_32_token_bucket_with_the_eager_tokens(art_dir):
    art = load_artifact(art_dir)
    kv, st = make_pools(art.registry, 512, 8, page_size=8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(1, 2), extend_buckets=(16, 32, 256),
                         max_pages_per_seq=64, extend_max_seqs=24, graphs=RerunGraphs())
    prompt = [(7 * i) % 200 + 1 for i in range(32)]
    pair = [list(range(3, 13)), list(range(50, 56))]  # two requests, 16 tokens
    want = [greedy(runner, st, [prompt], 5, eager=True)[0], greedy(runner, st, pair, 3, eager=True)[0]]
    runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    assert [str(k) for k in runner.keys if k.mode == Mode.EXTEND] == [
        "extend[tokens=256, seqs=24]", "extend[tokens=32, seqs=24]", "extend[tokens=32, seqs=1]",
        "extend[tokens=16, seqs=16]", "extend[tokens=16, seqs=1]"]
    tokens, keys = greedy(runner, st, [prompt], 5)
    assert keys[0] == CaptureKey(Mode.EXTEND, 32, 1) and keys[1] == CaptureKey(Mode.DECODE, 1, 1)
    assert tokens == want[0]
    tokens, keys = greedy(runner, st, pair, 3)
    assert keys[0] == CaptureKey(Mode.EXTEND, 16, 16) and tokens == want[1]


def _served(art_dir, prompt, graphs):
    """The first step's key and the tokens of `prompt` on an engine as `hgc serve` builds it."""
    engine = engine_for_artifact(load_artifact(art_dir), EngineOptions(slots=2, token_budget=64, page_size=8), 48,
                                 graphs=graphs)
    keys, build = [], getattr(engine.runner, "build", None)
    if graphs:
        def recording_build(*args, **kwargs):
            step, key = build(*args, **kwargs)
            keys.append(key)
            return step, key
        engine.runner.build = recording_build
    out = engine.generate(prompt, SamplingParams(max_new_tokens=6)).output_ids
    return engine, keys, out


def test_the_engine_sends_a_32_token_prompt_to_the_32_token_bucket(art_dir):
    prompt = [(11 * i) % 150 + 2 for i in range(32)]
    _, _, want = _served(art_dir, prompt, False)
    engine, keys, got = _served(art_dir, prompt, RerunGraphs())
    assert [(k.tokens, k.seqs) for k in engine.runner.keys if k.mode == Mode.EXTEND] == [
        (64, 64), (64, 1), (32, 32), (32, 1), (16, 16), (16, 1)]
    assert keys[0] == CaptureKey(Mode.EXTEND, 32, 1)
    assert got == want


def test_an_artifact_recorded_with_the_earlier_buckets_loads_and_runs(art_dir, tmp_path, capsys):
    """No chosen_by, no small buckets: inspect says so, and its engine pads to 256 as before."""
    old = tmp_path / "old-art"
    shutil.copytree(art_dir, old)
    edit_manifest(old, lambda m: {**m, "buckets": {"decode_batch_sizes": m["buckets"]["decode_batch_sizes"],
                                                   "extend_token_counts": EARLIER_EXTEND_BUCKETS}})
    assert main(["inspect", str(old)]) == 0
    assert ("extend buckets (tokens x requests) 256x256 512x256 1024x256 2048x256 4096x256: how they were chosen "
            "is not recorded") in capsys.readouterr().out
    prompt = [(5 * i) % 120 + 3 for i in range(32)]
    _, _, want = _served(old, prompt, False)
    engine, keys, got = _served(old, prompt, RerunGraphs())
    assert keys[0] == CaptureKey(Mode.EXTEND, 256, 256) and got == want


def test_inspect_shows_each_bucket_and_how_it_was_chosen(art_dir, tmp_path, capsys):
    assert main(["inspect", str(art_dir)]) == 0
    out = capsys.readouterr().out
    assert ("extend buckets (tokens x requests) 16x1,16 32x1,32 64x1,64 128x1,128 256x256 512x256 1024x256 "
            "2048x256 4096x256: the format's defaults, not measured") in out
    assert main(["inspect", str(art_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["buckets"]["chosen_by"] == "defaults" and doc["buckets"]["extend_rows"]["32"] == [1, 32]
    ckpt = art_dir.parent / "qwen3_next-tiny"
    flagged = tmp_path / "flagged"
    assert main(["compile", str(ckpt), "-o", str(flagged), "--no-dumps", "-q", "--extend-buckets", "8,64"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(flagged)]) == 0
    assert ("extend buckets (tokens x requests) 8x1,8 64x1,64: set by --decode-buckets / --extend-buckets, not measured"
            in capsys.readouterr().out)


# -- whole-step extend graphs ------------------------------------------------------------------


def _plans(**gaps):
    """Split plans by mode, one captured piece each, or captured / eager / captured for the modes named."""
    from compiler.splitops.artifact import CAPTURED, EAGER, Piece, SplitPlan
    whole = (Piece(0, CAPTURED, ("a", "op", "b")),)
    gapped = (Piece(0, CAPTURED, ("a",)), Piece(1, EAGER, ("op",)), Piece(2, CAPTURED, ("b",)))
    return {m: SplitPlan(m, gapped if gaps.get(m.value) else whole) for m in MODES}


def test_extend_keys_are_whole_step_graphs_where_the_extend_and_mixed_plans_have_no_gap():
    """The runner's decision, from split.json alone: extend keys are whole-step graphs when the
    extend plan and the mixed plan (mixed steps replay the extend keys) are each one captured piece;
    decode and target_verify by their own plans; none when decode graphs are asked piecewise."""
    from runtime.graphs.buckets import whole_step_modes

    assert whole_step_modes(_plans()) == {Mode.DECODE, Mode.TARGET_VERIFY, Mode.EXTEND}
    assert whole_step_modes(_plans(extend=True, mixed=True)) == {Mode.DECODE, Mode.TARGET_VERIFY}
    assert whole_step_modes(_plans(mixed=True)) == {Mode.DECODE, Mode.TARGET_VERIFY}, "a mixed gap keeps extend pieces"
    assert whole_step_modes(_plans(decode=True)) == {Mode.TARGET_VERIFY, Mode.EXTEND}

    program = types.SimpleNamespace(name="main", plans=_plans(), program=None)
    for decode_graphs, want in (("full", {Mode.DECODE, Mode.TARGET_VERIFY, Mode.EXTEND}), ("piecewise", set())):
        runner = GraphRunner(program, None, None, None, "cpu", decode_buckets=(1,), extend_buckets=(16,),
                             max_pages_per_seq=4, extend_max_seqs=2, decode_graphs=decode_graphs, graphs=RerunGraphs())
        assert runner.full_modes == want


class CapturedGQAExtends(CPUReferenceBackend):
    """The reference's GQA attention, declared for the cpu target under a name of its own as a
    backend whose extend and mixed steps may be captured (as FlashInfer's is on a GPU with
    extend_impl=triton): routed to it, a tiny qwen3_next's extend and mixed plans are one piece."""

    name = "cpu_captured_gqa_extends"
    capability = dataclasses.replace(CPUReferenceBackend.capability, name=name, ops=frozenset({"gqa_attention"}),
                                     modes_capturable=frozenset(MODES), op_capture=(), priority=-1)


@pytest.fixture(scope="module")
def whole_extend_art(tmp_path_factory):
    """The tiny qwen3_next compiled for the cpu with GQA attention routed to CapturedGQAExtends:
    (artifact, the backend registry that has the class)."""
    from compiler.passes.context import CompileConfig
    from compiler.passes.routing import parse_route
    from compiler.pipeline import compile_checkpoint
    from hgc.wiring import toolchain
    from runtime.backends import discover

    registry = discover().with_classes(CapturedGQAExtends, source="tests/runtime/graphs/test_short_extend.py")
    checkpoint = shared_artifact(tmp_path_factory, "qwen3_next")[0]
    out = tmp_path_factory.mktemp("whole-extend") / "art"
    routes = (parse_route(f"gqa_attention={CapturedGQAExtends.name}"),)
    compile_checkpoint(checkpoint, out, CompileConfig(routes=routes), toolchain(registry), dumps=False)
    return load_artifact(out), registry


def _whole_extend_runner(art, registry, **kw):
    kv, st = make_pools(art.registry, 512, 8, page_size=8)
    ops = BoundOps(art.backends(kv, st, registry).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(1, 2, 4), extend_buckets=(16, 32, 64),
                         max_pages_per_seq=32, extend_max_seqs=4, graphs=RerunGraphs(), debug=True, **kw)
    return runner, kv, st


def test_short_extends_replay_one_whole_step_graph_with_the_eager_tokens(whole_extend_art):
    """Capture, start-up parity, then prompts of 3 to 60 tokens, one and several at once: every
    extend step replays its bucket's whole-step graph (no piecewise step), with the eager tokens."""
    art, registry = whole_extend_art
    for mode in (Mode.EXTEND, Mode.MIXED):
        assert [p.kind for p in art.split_plans["main"][mode].pieces] == ["captured"]
    runner, kv, st = _whole_extend_runner(art, registry)
    assert runner.full_modes == {Mode.DECODE, Mode.TARGET_VERIFY, Mode.EXTEND}
    batches = [[[(5 * i) % 90 + 1 for i in range(n)]] for n in (3, 16, 32, 60)]
    batches.append([list(range(2, 12)), list(range(40, 47)), [9] * 13])  # three requests of 30 tokens
    want = [greedy(runner, st, prompts, 4, eager=True)[0] for prompts in batches]
    report = runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    assert max(report.values()) < 1e-4 and len({k.tokens for k in runner.keys if k.mode == Mode.EXTEND}) == 3
    before = dict(runner.counters)
    for prompts, tokens in zip(batches, want):
        got, keys = greedy(runner, st, prompts, 4)
        assert got == tokens and keys[0].mode == Mode.EXTEND and all(k is not None for k in keys)
    assert runner.counters["piecewise_steps"] == before["piecewise_steps"]
    assert runner.counters["graph_replays"] - before["graph_replays"] == 4 * len(batches)


def test_mixed_steps_and_prefix_hits_replay_the_extend_graphs_in_the_engine(whole_extend_art):
    """The engine on such a runner: chunked prompts beside running decodes (mixed steps) and
    prompts whose system prefix the prefix cache holds (an extend step of the tail over cached
    pages) replay whole-step extend graphs, with the eager engine's tokens."""
    from runtime.cache.prefix_cache import PrefixCache
    from runtime.cache.snapshot_pool import SnapshotPool
    from runtime.engine.engine import Engine, SamplingParams
    from runtime.graphs.step_runner import EagerRunner

    art, registry = whole_extend_art
    system = list(range(10, 37))  # 27 tokens: three pages of 8 and a part
    prompts = [system + [40, 41], list(range(50, 90)), system + [7] * 5, [3, 4, 5], system]
    params = SamplingParams(max_new_tokens=5)

    def serve(graphs: bool):
        runner, kv, st = _whole_extend_runner(art, registry)
        runner.chunk_size = 32
        if graphs:
            runner.start(vocab_size=art.manifest["model"]["vocab_size"])
        steps = runner if graphs else EagerRunner(art.bind(runner.ops), runner.ops, kv, "cpu", 32)
        cache = PrefixCache(kv, st, SnapshotPool(art.registry, 8)) if graphs else None
        engine = Engine(steps, kv, st, max_tokens_per_step=32, max_running=4, prefix_cache=cache)
        modes, build = [], getattr(steps, "build", None)
        if graphs:
            def recording_build(*args, **kwargs):
                step, key = build(*args, **kwargs)
                modes.append((step.ctx.mode, key))
                return step, key
            steps.build = recording_build
        ids = [engine.add_request(p, params) for p in prompts[:3]]  # together: chunks beside decodes
        results = engine.run_until_done()
        outputs = [results[i].output_ids for i in ids]
        for prompt in prompts[3:]:  # one after another: the system prompt's pages are cached by now
            got = engine.generate(prompt, params)
            outputs.append(got.output_ids)
            if graphs and prompt is system:
                assert got.cached_tokens == 24
        return outputs, modes, runner.counters

    want, _, _ = serve(False)
    got, modes, counters = serve(True)
    assert got == want
    assert any(m == Mode.MIXED and key is not None and key.mode == Mode.EXTEND for m, key in modes)
    assert counters["piecewise_steps"] == 0 and counters["graph_replays"] >= len(modes) - counters["eager_steps"]


# -- whole-step graphs for the small extend buckets, pieces for the large ------------------------


class GQAWholeUpTo(CPUReferenceBackend):
    """The reference's GQA attention declared for the cpu target as FlashInfer's is on a GPU: its
    extend and mixed steps captured in steps of up to `whole_extend_tokens` tokens (a gap above),
    or at every size with extend_impl=triton. Routed to it, a tiny qwen3_next's extend and mixed
    plans keep GQA a gap and record the bound."""

    name = "cpu_gqa_whole_up_to"
    capability = dataclasses.replace(
        CPUReferenceBackend.capability, name=name, ops=frozenset({"gqa_attention"}), priority=-1,
        op_capture=(OpCapture("gqa_attention", frozenset({Mode.EXTEND, Mode.MIXED}), when=(("extend_impl", "triton"),)),
                    OpCapture("gqa_attention", frozenset({Mode.EXTEND, Mode.MIXED}), up_to="whole_extend_tokens")),
        options=(("extend_impl", ("ragged", "triton")), ("whole_extend_tokens", ("32", "0", "16", "48"))))


@pytest.fixture(scope="module")
def bounded_arts(tmp_path_factory):
    """The tiny qwen3_next for the cpu with GQA on GQAWholeUpTo under three choices, extend buckets
    16, 32 and 64: {choice: artifact folder}, and the backend registry that has the class."""
    from runtime.backends import discover

    registry = discover().with_classes(GQAWholeUpTo, source="tests/runtime/graphs/test_short_extend.py")
    checkpoint = shared_artifact(tmp_path_factory, "qwen3_next")[0]
    root = tmp_path_factory.mktemp("whole-up-to")
    arts = {}
    for choice in ("", "[whole_extend_tokens=0]", "[extend_impl=triton]"):
        arts[choice] = root / f"art{len(arts)}"
        _compile_routed(checkpoint, arts[choice], f"gqa_attention={GQAWholeUpTo.name}{choice}", registry, (16, 32, 64))
    return arts, registry, checkpoint


def _compile_routed(checkpoint, out, route, registry, extend_buckets):
    from compiler.passes.context import CompileConfig
    from compiler.passes.routing import parse_route
    from compiler.pipeline import compile_checkpoint
    from hgc.wiring import toolchain

    config = CompileConfig(routes=(parse_route(route),), extend_token_counts=tuple(extend_buckets),
                           buckets_chosen_by="flags")
    return compile_checkpoint(checkpoint, out, config, toolchain(registry), dumps=False)


def _whole_extend_tokens(runner) -> list[int]:
    return sorted({k.tokens for k in runner.whole_keys if k.mode == Mode.EXTEND})


def test_extend_buckets_up_to_the_backends_bound_are_whole_step_graphs_the_larger_pieces(bounded_arts):
    """The per-bucket choice, from split.json: GQA stays a gap of the extend and mixed plans with its
    bound recorded (whole_up_to 32 by the option's default); the runner captures the 16- and
    32-token buckets whole and the 64-token one in pieces. whole_extend_tokens=0: pieces everywhere;
    extend_impl=triton: no gap, every bucket whole. Decode and target_verify are whole in all three."""
    arts, registry, _ = bounded_arts
    want = {"": [16, 32], "[whole_extend_tokens=0]": [], "[extend_impl=triton]": [16, 32, 64]}
    for choice, whole in want.items():
        art = load_artifact(arts[choice])
        plans = art.split_plans["main"]
        for mode in (Mode.EXTEND, Mode.MIXED):
            gaps = [p for p in plans[mode].pieces if p.kind == "eager"]
            if choice == "[extend_impl=triton]":
                assert not gaps
            else:
                assert gaps and plans[mode].whole_up_to == (32 if choice == "" else 0), (choice, mode)
        runner, _, _ = _whole_extend_runner(art, registry)
        assert _whole_extend_tokens(runner) == whole, choice
        assert Mode.DECODE in {k.mode for k in runner.whole_keys} and Mode.TARGET_VERIFY in runner.full_modes
        doc = json.loads((arts[choice] / "split.json").read_text())
        assert [(r["tokens"], r["graph"]) for r in doc["extend_graphs"]["main"]] == [
            (t, "whole" if t in whole else "pieces") for t in (16, 32, 64)]
    assert plans[Mode.DECODE].whole_up_to == 0 and len(plans[Mode.DECODE].pieces) == 1


def test_short_extends_replay_whole_graphs_and_long_ones_pieces_with_the_eager_tokens(bounded_arts):
    """Start-up parity passes with whole and piecewise extend keys side by side; prompts of up to 32
    tokens replay a whole-step graph, longer ones a piecewise step, all with the eager tokens."""
    arts, registry, _ = bounded_arts
    art = load_artifact(arts[""])
    runner, kv, st = _whole_extend_runner(art, registry)
    batches = [[[(5 * i) % 90 + 1 for i in range(n)]] for n in (3, 20, 32, 33, 60)]
    batches.append([list(range(2, 12)), list(range(40, 47)), [9] * 13])  # three requests, 30 tokens
    want = [greedy(runner, st, prompts, 3, eager=True)[0] for prompts in batches]
    report = runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    assert max(report.values()) < 1e-4
    for prompts, tokens in zip(batches, want):
        before = dict(runner.counters)
        got, keys = greedy(runner, st, prompts, 3)
        assert got == tokens and keys[0].mode == Mode.EXTEND
        whole_first = keys[0].tokens <= 32
        assert runner.counters["piecewise_steps"] - before["piecewise_steps"] == (0 if whole_first else 1), keys
        assert runner.counters["graph_replays"] - before["graph_replays"] == (3 if whole_first else 2), keys


def test_inspect_and_routing_json_show_the_choice_per_bucket(bounded_arts, capsys):
    arts, _, _ = bounded_arts
    entries = json.loads((arts[""] / "routing.json").read_text())["programs"]["main"]
    gqa = [e for e in entries if e["op"] == "gqa_attention"]
    assert gqa and all(e["options"]["whole_extend_tokens"] == "32" for e in gqa)
    assert all(e["backend_capture_bounds"] == {"extend": 32, "mixed": 32} for e in gqa)
    assert main(["inspect", str(arts[""])]) == 0
    out = capsys.readouterr().out
    assert ("extend graphs (main): 16 32 whole-step, 64 pieces: gaps captured up to 32 tokens: "
            f"hgc.gqa_attention on {GQAWholeUpTo.name} (whole_extend_tokens=32)") in out
    assert main(["inspect", str(arts["[whole_extend_tokens=0]"])]) == 0
    assert "extend graphs (main): 16 32 64 pieces: gaps never captured" in capsys.readouterr().out
    assert main(["inspect", str(arts[""]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["graph"] for r in doc["extend_graphs"]["main"]] == ["whole", "whole", "pieces"]


def test_a_bound_that_is_no_extend_bucket_is_refused(bounded_arts, tmp_path):
    """whole_extend_tokens=48 with buckets 16, 32, 64: a 40-token step would run eagerly on one
    kernel and replay the 64-token bucket's pieces on another. The compile's lint refuses it, and a
    runner over such plans too."""
    from compiler.splitops.artifact import whole_bound_refusal

    arts, registry, checkpoint = bounded_arts
    with pytest.raises(Exception, match="whole-extend-bound-off-buckets"):
        _compile_routed(checkpoint, tmp_path / "off", f"gqa_attention={GQAWholeUpTo.name}[whole_extend_tokens=48]",
                        registry, (16, 32, 64))
    plans = load_artifact(arts[""]).split_plans["main"]
    assert whole_bound_refusal(plans, (16, 32, 64)) is None and whole_bound_refusal(plans, (16,)) is None
    assert "no extend bucket of [16, 64]" in whole_bound_refusal(plans, (16, 64))
    art = load_artifact(arts[""])
    kv, st = make_pools(art.registry, 512, 8, page_size=8)
    ops = BoundOps(art.backends(kv, st, registry).for_program("main"))
    with pytest.raises(CaptureError, match="no extend bucket of"):
        GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(1,), extend_buckets=(16, 64),
                    max_pages_per_seq=32, extend_max_seqs=4, graphs=RerunGraphs())
