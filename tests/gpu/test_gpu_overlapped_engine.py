"""The overlapped engine loop on a CUDA GPU: the same tokens as synchronous steps, through CUDA graphs.

Runs only on the GPU machine (`pytest -m gpu`); benchmarks/serving/offline_bench.py measures the gain
(with and without --no-overlap-schedule). What the CPU tests cannot reach: the ids' copy into
pinned memory behind a CUDA event (runtime/step/host_copy.HostCopy), the index tensors going over
from pinned memory without blocking, and the ids written into a replayed graph's static input
buffer on the device (whole-step decode graphs and piecewise extend graphs).

float32 with full attention routed to torch_reference (FlashInfer has no float32 kernels). Two loads:

- one whose steps are the same with overlap on and off (every request added at once, prompts that fit
  one step, the same max_new_tokens, no stop): each step has the same rows in both runs, so the
  tokens must be identical, bit for bit;
- a mixed load (lengths, limits, a cancel, requests joining, a shared prefill), whose
  steps differ with overlap (a step is scheduled before the one in flight is read, so requests join
  and leave a step later). On the GPU a row's float32 result depends on the batch it is computed in
  (the MoE kernels' tuned tiles per token count, the graph buckets' padding, TF32 in Triton dots),
  and a tiny random model's logits have near ties, so its tokens are not compared one by one: every
  request must end the same way with the same number of tokens, the pools come back, graphs are
  replayed, most steps overlap, and no step's ids are read before the next step was launched. The
  failure message counts the tokens that differ, and the same mixed load with overlap off but its
  requests one step later shows how many a schedule change alone moves.
"""

from __future__ import annotations

import pytest
import torch

from hgc import main
from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact
from runtime.engine import choices as choices_module
from runtime.engine.engine import SamplingParams
from testkit.engine_loads import Job, drive

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MAX_LEN = 96


def float32_cuda_artifact(root):
    """A tiny qwen3_next compiled for CUDA in float32, full attention on torch_reference (FlashInfer
    has no float32 kernels), traced glue: the engine tests' artifact on the GPU, loaded."""
    from testkit.helpers import tiny_checkpoint

    tiny_checkpoint("qwen3_next", root / "c", 1, head_dim=64)
    assert main(["compile", str(root / "c"), "-o", str(root / "a"), "--target", "cuda", "--no-inductor",
                 "--dtype", "float32", "--route=gqa_attention=torch_reference", "--no-dumps"]) == 0
    return load_artifact(root / "a", "cuda")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return float32_cuda_artifact(tmp_path_factory.mktemp("goverlap"))


def jobs() -> list[Job]:
    prompts = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([1, 5, 17, 3, 9, 2, 12, 7, 30, 4])]
    load = [Job(p, SamplingParams(max_new_tokens=n), at_step=s)
            for p, n, s in zip(prompts, [9, 4, 14, 6, 11, 3, 8, 13, 5, 10], [0, 0, 1, 2, 2, 4, 6, 6, 9, 12])]
    load[3].cancel_after = 2
    load.append(Job(prompts[4], SamplingParams(max_new_tokens=7), at_step=5))
    load.append(Job(prompts[4], SamplingParams(max_new_tokens=9), at_step=5, share_with=len(load) - 1))
    return load


def run(artifact, load: list[Job], overlap: bool):
    options = EngineOptions(slots=8, token_budget=32, page_size=16, overlap=overlap)
    engine = engine_for_artifact(artifact, options, MAX_LEN, device="cuda")
    return drive(engine, load), engine.stats(), engine


def through_graphs(stats: dict) -> bool:
    """Steps ran through captured graphs: whole-step replays, or piecewise steps (the reference
    attention this float32 artifact routes to is not capturable, so its decodes are piecewise)."""
    return stats["graph_replays"] + stats["piecewise_steps"] > 0


def differing(a: dict, b: dict) -> int:
    """Tokens that differ between two runs of the same jobs (by position; a length difference counts)."""
    return sum(sum(x != y for x, y in zip(a[i][0], b[i][0])) + abs(len(a[i][0]) - len(b[i][0])) for i in a)


def test_fp32_steps_of_the_same_rows_give_identical_tokens_with_overlap(artifact):
    prompts = [[(11 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([1, 2, 3, 4, 5, 3, 2, 6])]
    load = [Job(p, SamplingParams(max_new_tokens=12)) for p in prompts]  # 26 prompt tokens: one step
    (off, _, _), (on, stats, _) = run(artifact, load, False), run(artifact, load, True)
    assert on == off, f"{differing(on, off)} tokens differ between steps of the same rows"
    assert through_graphs(stats) and stats["overlapped_steps"] > stats["synchronous_steps"], stats


def test_fp32_a_mixed_load_ends_every_request_alike_through_cuda_graphs(artifact, monkeypatch):
    (off, _, _), (on, stats, engine) = run(artifact, jobs(), False), run(artifact, jobs(), True)
    later = jobs()
    for job in later:
        job.at_step += 1
    shifted, _, _ = run(artifact, later, False)
    assert {i: (len(t), r) for i, (t, r) in on.items()} == {i: (len(t), r) for i, (t, r) in off.items()}, (
        f"{differing(on, off)} tokens differ with overlap; {differing(shifted, off)} with overlap off and the "
        f"requests one step later")
    assert through_graphs(stats) and stats["overlapped_steps"] > stats["synchronous_steps"], stats

    events = []

    class WatchedCopy(choices_module.HostCopy):
        def __init__(self, values):
            super().__init__(values)
            events.append("chosen")

        def tolist(self):
            events.append("read")
            return super().tolist()

    monkeypatch.setattr(choices_module, "HostCopy", WatchedCopy)
    execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda *a, **k: events.append("launch") or execute(*a, **k))
    drive(engine, jobs())
    # between a step's choice and its read, the next step was launched (but for the last read)
    reads = [i for i, e in enumerate(events) if e == "read"]
    chosen = [i for i, e in enumerate(events) if e == "chosen"]
    assert len(reads) == len(chosen) > 0
    for c, r in list(zip(chosen, reads))[:-1]:
        assert "launch" in events[c:r], events
