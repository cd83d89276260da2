"""Decodes apart from prompt chunks on a CUDA GPU, through CUDA graphs (runtime/engine/engine.py,
"Decodes apart"): a step with prompt chunks and decodes as two forwards, the decodes through the
decode graphs, against the same load in one forward per step.

Runs only on the GPU machine (`pytest -m gpu`). What the CPU tests cannot reach: the first
forward's logits are a piecewise graph's output, copied out before the decode graph replays (the
graphs share one memory pool), and the two forwards' staging and plans back to back on one stream.

float32, full attention on torch_reference (FlashInfer has no float32 kernels). A decode row's
result differs in rounding between the extend path (a one-token chunk) and the decode kernel, and a
tiny random model's logits have near ties, so tokens are not compared one by one: every request must
end the same way with as many tokens, most tokens must agree, the decodes must have run apart, and
the pools must come back (drive checks them).
"""

from __future__ import annotations

import pytest
import torch

from runtime.assembly import EngineOptions, engine_for_artifact
from runtime.engine.engine import SamplingParams
from testkit.engine_loads import Job, drive
from tests.gpu.test_gpu_overlapped_engine import float32_cuda_artifact

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return float32_cuda_artifact(tmp_path_factory.mktemp("gapart"))


def load() -> list[Job]:
    """24 requests decoding, then prompts of 40 to 70 tokens joining them one step at a time."""
    jobs = [Job([(5 * i + j) % 200 + 3 for j in range(4)], SamplingParams(max_new_tokens=24)) for i in range(24)]
    jobs += [Job([(7 * i + j) % 200 + 3 for j in range(40 + 10 * i)], SamplingParams(max_new_tokens=8), at_step=2 + i)
             for i in range(4)]
    return jobs


def test_fp32_decodes_apart_end_every_request_alike_through_cuda_graphs(artifact):
    runs, forwards = {}, {}
    for apart in (0, 16):
        engine = engine_for_artifact(artifact, EngineOptions(slots=32, token_budget=64, page_size=16,
                                                             decodes_apart_from=apart), 128, device="cuda")
        execute, calls = engine.runner.execute, []
        engine.runner.execute = lambda *a, **k: calls.append(1) or execute(*a, **k)
        runs[apart] = drive(engine, load())
        stats = engine.stats()
        forwards[apart] = (len(calls), stats["steps"], stats["graph_replays"] + stats["piecewise_steps"])
    assert {i: (len(t), r) for i, (t, r) in runs[16].items()} == {i: (len(t), r) for i, (t, r) in runs[0].items()}
    tokens = sum(len(t) for t, _ in runs[0].values())
    differing = sum(a != b for i in runs[0] for a, b in zip(runs[0][i][0], runs[16][i][0]))
    assert differing <= tokens // 10, f"{differing} of {tokens} tokens differ with the decodes apart"
    assert forwards[0][0] == forwards[0][1] and forwards[16][0] > forwards[16][1], forwards
    assert forwards[16][2] > 0, "the steps ran through captured graphs"
