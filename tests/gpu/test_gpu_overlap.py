"""The overlap pass on a CUDA GPU: side branches forked onto a second stream, captured and replayed.

Runs only on the GPU machine (`pytest -m gpu`). A tiny Kimi-Linear in float32 (its MLA runs on the
Triton MLA kernel, its MoE on the Triton MoE kernel; no bf16 rounding between the two compiles to
hide a fault or to excuse one) is compiled with `--overlap` (size rule 4 KiB: the tiny shared
expert is a side branch in every MoE layer) and without. The runner with the pass captures every
decode bucket as one graph holding both streams, and the extend bucket piecewise, each side
branch forked off the capturing stream and joined back before its capture ends
(runtime/graphs/side_stream.py states the rule). benchmarks/serving/overlap_bench.py times it.
"""

from __future__ import annotations

import pytest
import torch

from hgc import main
from compiler.splitops import Mode
from runtime.step.bound_ops import BoundOps
from runtime.engine.generate import make_pools
from runtime.graphs.runner import GraphRunner
from runtime.artifact.loader import load_artifact
from runtime.graphs.side_stream import CudaSideStream
from testkit.graph_cases import greedy
from testkit.helpers import tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gov")
    tiny_checkpoint("kimi_linear", root / "c", seed=1)
    for name, flags in (("on", ["--overlap", "--overlap-min-bytes", "4096"]), ("off", [])):
        assert main(["compile", str(root / "c"), "-o", str(root / name), "--target", "cuda", "--no-inductor", "--no-dumps",
                     "--no-inductor", *flags]) == 0
    on, off = load_artifact(root / "on", "cuda"), load_artifact(root / "off", "cuda")
    assert all(plan.side_branches() for plan in on.split_plans["main"].values())
    return on, off


def make_runner(art, streams=None):
    kv, st = make_pools(art.registry, 128, 8, page_size=16, device="cuda")
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops, streams=streams), ops, kv, st, "cuda", decode_buckets=(1, 2, 4),
                         extend_buckets=(64,), max_pages_per_seq=8, extend_max_seqs=4, debug=True)
    return runner, st


def _differ(a, b) -> int:
    return sum(x != y for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_side_stream_graphs_give_the_tokens_of_the_compile_without_the_pass(artifacts):
    """Capture with the side stream (start-up parity included), then replayed steps: 0 of 48 tokens
    differ from the replayed steps of the compile without the pass, and the eager steps of both
    agree too. Replays and eager steps may part (padded kernels, as tests/gpu/test_gpu_graphs.py
    allows), but the pass adds no difference: the replays with it differ from the eager steps
    without it exactly where the replays without it do."""
    on, off = artifacts
    tokens = {}
    for name, art in (("on", on), ("off", off)):
        runner, st = make_runner(art)
        tokens[name, "eager"], _ = greedy(runner, st, PROMPTS, NEW_TOKENS, eager=True, sync=torch.cuda.synchronize)
        runner.start(vocab_size=art.manifest["model"]["vocab_size"])
        tokens[name, "graphs"], keys = greedy(runner, st, PROMPTS, NEW_TOKENS, sync=torch.cuda.synchronize)
        assert keys[0].mode == Mode.EXTEND and all(k is not None and k.mode == Mode.DECODE for k in keys[1:])
        if name == "on":
            assert isinstance(runner.program.streams, CudaSideStream) and runner.program.streams.forks > 0
            assert torch.cuda.current_stream() == torch.cuda.default_stream(), "a step left the side stream current"
    total = len(PROMPTS) * NEW_TOKENS
    assert _differ(tokens["on", "graphs"], tokens["off", "graphs"]) == 0, (tokens["on", "graphs"], tokens["off", "graphs"])
    assert _differ(tokens["on", "eager"], tokens["off", "eager"]) == 0, (tokens["on", "eager"], tokens["off", "eager"])
    replay_vs_eager = _differ(tokens["off", "graphs"], tokens["off", "eager"])
    assert _differ(tokens["on", "graphs"], tokens["off", "eager"]) == replay_vs_eager, f"of {total}"


def test_eager_steps_on_two_streams_equal_the_same_steps_in_graph_order(artifacts):
    """The same artifact, eager, with and without its side stream: the same kernels on the same
    inputs, so every logit is equal bit for bit (a missing wait would show as a race here)."""
    on, _ = artifacts
    logits = {}
    for name, streams in (("two streams", None), ("in order", False)):
        runner, st = make_runner(on, streams)
        rows: list = []
        greedy(runner, st, PROMPTS, 6, eager=True, sync=torch.cuda.synchronize, logits=rows)
        logits[name] = rows
        if streams is None:
            assert runner.program.streams.forks > 0
    for a, b in zip(logits["two streams"], logits["in order"]):
        assert torch.equal(a, b)
