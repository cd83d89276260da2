"""Whole-step extend graphs on a CUDA GPU: GQA attention routed to
`flashinfer[extend_impl=triton]` makes qwen3_next's extend and mixed plans one captured piece, so
each extend bucket is one CUDA graph and extend and mixed steps replay it.

Runs only on the GPU machine (`pytest -m gpu`). What the CPU tests cannot reach: the varlen Triton
kernel and the backend's replay state (device copies of the page table, lengths and query
offsets) recorded inside a real whole-step graph and replayed for steps of other lengths and
request counts, next to the linear backend's static extend plan filled on the host and the MoE
reading the real token count from the staging; the engine's overlapped steps writing their ids
into that graph's static input.

A tiny qwen3_next in float32, compiled for cuda twice: full attention on torch_reference (the
route float32 GQA takes without this change: eager attention, piecewise graphs) and on
`flashinfer[extend_impl=triton]` (float32 GQA runs there because every GQA step is on the Triton
kernels). Every other kernel is the same in both, and in float32 the two attentions agree to
rounding, so the greedy tokens must be the same: prompts of 8 to 200 tokens, several at once and
joining running requests (mixed steps), then prompts whose system prefix the prefix cache holds
(an extend of the tail over cached pages). The routed engine's extend and mixed steps must all be
whole-step graph replays, with no piecewise step at all.
"""

from __future__ import annotations

import pytest
import torch

from compiler.splitops import Mode
from hgc import main
from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact
from runtime.engine.engine import SamplingParams
from testkit.engine_loads import Job, drive

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_LEN = 288
ROUTES = {"reference": "gqa_attention=torch_reference", "triton": "gqa_attention=flashinfer[extend_impl=triton]"}
SYSTEM = [(13 * j) % 200 + 5 for j in range(40)]  # two whole pages of 16 and a part


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """The tiny qwen3_next (head dim 64) in float32 compiled for cuda under each route, loaded."""
    from testkit.helpers import tiny_checkpoint

    root = tmp_path_factory.mktemp("gextend")
    tiny_checkpoint("qwen3_next", root / "c", 1, head_dim=64)
    out = {}
    for name, route in ROUTES.items():
        assert main(["compile", str(root / "c"), "-o", str(root / name), "--target", "cuda", "--no-inductor",
                     "--dtype", "float32", f"--route={route}", "--no-dumps"]) == 0
        out[name] = load_artifact(root / name, "cuda")
    return out


def jobs() -> list[Job]:
    """Prompts of 8 to 200 tokens: three at once, then others joining the running ones."""
    lengths = [(8, 0), (32, 0), (100, 0), (16, 3), (200, 3), (13, 6), (33, 6), (64, 9)]
    return [Job([(7 * i + 3 * j) % 200 + 3 for j in range(n)], SamplingParams(max_new_tokens=12), at_step=s)
            for i, (n, s) in enumerate(lengths)]


def serve(art):
    """(the load's tokens, the prefix phase's tokens and cached tokens, (mode, key) of every step, stats)."""
    engine = engine_for_artifact(art, EngineOptions(slots=8, token_budget=256, page_size=16), MAX_LEN, device="cuda")
    steps, build = [], engine.runner.build

    def recording_build(*args, **kwargs):
        step, key = build(*args, **kwargs)
        steps.append((step.ctx.mode, key))
        return step, key

    engine.runner.build = recording_build
    load = drive(engine, jobs())
    prefix = []
    for tail in ([], [9], [4] * 9, [(5 * j) % 100 + 1 for j in range(32)]):  # the first caches the prefix
        result = engine.generate(SYSTEM + tail, SamplingParams(max_new_tokens=8))
        prefix.append((result.output_ids, result.cached_tokens))
    return load, prefix, steps, engine.stats(), engine.runner


def test_fp32_whole_step_extend_graphs_give_the_reference_routes_tokens(artifacts):
    reference = serve(artifacts["reference"])
    load, prefix, steps, stats, runner = serve(artifacts["triton"])
    differing = sum(a != b for i in load for a, b in zip(load[i][0], reference[0][i][0]))
    assert load == reference[0], f"{differing} tokens of the load differ from the reference route's"
    assert [p[0] for p in prefix] == [p[0] for p in reference[1]], "a prefix-cache hit's tokens differ"
    assert all(cached > 0 for _, cached in prefix[1:]), prefix

    assert Mode.EXTEND in runner.full_modes and Mode.EXTEND not in reference[4].full_modes
    extend = [(mode, key) for mode, key in steps if mode in (Mode.EXTEND, Mode.MIXED)]
    assert {mode for mode, _ in extend} == {Mode.EXTEND, Mode.MIXED}, "the load has extend and mixed steps"
    assert all(key is not None and key.mode == Mode.EXTEND for _, key in extend), extend
    assert stats["piecewise_steps"] == 0 and stats["graph_replays"] >= len(extend), stats
    assert reference[3]["piecewise_steps"] > 0, "the reference route's attention is an eager gap"
