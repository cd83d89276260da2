"""Short extends on the CPU: small extend buckets with request rows of their own
(runtime/graphs/buckets.py), a 32-token extend replayed in the 32-token bucket with the eager
tokens (testkit/graph_cases.RerunGraphs standing in for CUDA graphs), `hgc inspect` showing the
buckets and how they were chosen, and an artifact recorded with the earlier buckets still running."""

from __future__ import annotations

import json
import shutil

import pytest

from compiler.splitops import Mode
from compiler.splitops.artifact import DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS
from hgc import main
from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.engine.engine import SamplingParams
from runtime.engine.generate import make_pools
from runtime.graphs.buckets import Buckets, extend_seqs
from runtime.graphs.runner import CaptureKey, GraphRunner
from runtime.step.bound_ops import BoundOps
from testkit.graph_cases import RerunGraphs, greedy
from testkit.helpers import edit_manifest, shared_artifact

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
        (4096, 256), (2048, 256), (1024, 256), (512, 256), (256, 256), (128, 128), (64, 64), (32, 32), (16, 16)]
    assert b.key_for(Mode.EXTEND, 32, 1) == CaptureKey(Mode.EXTEND, 32, 32), "a prefix hit's suffix: not 256"
    assert b.key_for(Mode.EXTEND, 1, 1) == CaptureKey(Mode.EXTEND, 16, 16)
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
        "extend[tokens=256, seqs=24]", "extend[tokens=32, seqs=24]", "extend[tokens=16, seqs=16]"]
    tokens, keys = greedy(runner, st, [prompt], 5)
    assert keys[0] == CaptureKey(Mode.EXTEND, 32, 24) and keys[1] == CaptureKey(Mode.DECODE, 1, 1)
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
    assert [(k.tokens, k.seqs) for k in engine.runner.keys if k.mode == Mode.EXTEND] == [(64, 64), (32, 32), (16, 16)]
    assert keys[0] == CaptureKey(Mode.EXTEND, 32, 32)
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
    assert ("extend buckets (tokens x requests) 16x16 32x32 64x64 128x128 256x256 512x256 1024x256 2048x256 "
            "4096x256: the format's defaults, not measured") in out
    assert main(["inspect", str(art_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["buckets"]["chosen_by"] == "defaults" and doc["buckets"]["extend_rows"]["32"] == 32
    ckpt = art_dir.parent / "qwen3_next-tiny"
    flagged = tmp_path / "flagged"
    assert main(["compile", str(ckpt), "-o", str(flagged), "--no-dumps", "-q", "--extend-buckets", "8,64"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(flagged)]) == 0
    assert ("extend buckets (tokens x requests) 8x8 64x64: set by --decode-buckets / --extend-buckets, not measured"
            in capsys.readouterr().out)
