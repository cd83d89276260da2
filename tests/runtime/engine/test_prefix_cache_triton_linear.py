"""The prefix cache with the linear layers on triton_linear, the backend the CUDA target binds them
to, on the CPU: its kernels in Triton's interpreter, float32.

With its chunk kernels (chunk_impl=triton) the backend writes in-step snapshots into the cache's
pool, so the engine turns the cache's in-step mode on and a snapshot point inside a chunk costs no
step of its own (docs/DESIGN.md, "The prefix cache's snapshots"):

- greedy tokens with the cache equal those without it, over prompts that share prefixes (hits
  restore snapshots the kernels wrote inside a chunk and at a chunk end);
- a miss whose prompt end is not page-aligned prefills in one step, and the snapshot at its last
  page boundary is the state a prefill of that prefix alone leaves (to float32 rounding: the
  chunks fall otherwise);
- later prompts hit it.

The kernels' snapshots against launches of the rows alone are in
tests/runtime/backends/test_triton_step_snapshots.py; the CPU reference's engine-level checks on
every family in tests/runtime/cache/test_step_snapshots.py."""

from __future__ import annotations

import pytest
import torch

from runtime.assembly import EngineOptions, engine_for_artifact
from runtime.engine.engine import SamplingParams
from testkit.helpers import artifacts_by_family
from testkit.linear_cases import compile_linear_routed, interpreted_linear_registry

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

PAGE = 16
MAX_LEN = 96


@pytest.fixture(scope="module")
def registry():
    return interpreted_linear_registry("tests/runtime/engine/test_prefix_cache_triton_linear.py")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, registry):
    def compile_one(family, ckpt, out):  # `hgc compile --route OP=BACKEND[chunk_impl=triton]` with the test's registry
        compile_linear_routed(ckpt, out, ("gdn_core", "short_conv"), "chunk_impl=triton", registry)

    return artifacts_by_family(tmp_path_factory.mktemp("prefix-tl"), compile_one)("qwen3_next")


def engine(art, registry, cache: bool, overlap: bool = True):
    return engine_for_artifact(art, EngineOptions(slots=2, token_budget=64, page_size=PAGE, prefix_cache=cache,
                                                  prefix_snapshots=8, overlap=overlap), MAX_LEN, registry=registry)


def prefix_state(art, registry, tokens: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Every linear layer's state after a cache-off engine's prefill of `tokens` alone (one step)."""
    eng = engine(art, registry, cache=False, overlap=False)
    eng.add_request(tokens, SamplingParams(max_new_tokens=2))
    eng.step()
    [req] = eng.scheduler.running
    return {layer_id: {name: t[req.seq.slot].clone() for name, t in entries.items()}
            for layer_id, entries in eng.state_pool.buffers.items()}


def run(eng, prompts) -> list[list[int]]:
    """One request after another (each can hit what the ones before left)."""
    outputs = []
    for p in prompts:
        rid = eng.add_request(p, SamplingParams(max_new_tokens=3))
        outputs.append(list(eng.run_until_done()[rid].output_ids))
    return outputs


def test_in_step_snapshots_from_the_chunk_kernels_keep_greedy_tokens_and_save_a_step(artifact, registry):
    vocab = int(artifact.manifest["model"]["vocab_size"])
    g = torch.Generator().manual_seed(0)
    base = torch.randint(2, vocab, (45,), generator=g).tolist()  # 2 pages and 13 tokens
    prompts = [base, base[:37] + torch.randint(2, vocab, (8,), generator=g).tolist(), base]
    want = run(engine(artifact, registry, cache=False), prompts)
    eng = engine(artifact, registry, cache=True)
    assert eng.prefix_cache.in_step, "triton_linear on its chunk kernels writes in-step snapshots"
    rid = eng.add_request(base, SamplingParams(max_new_tokens=3))
    first = list(eng.run_until_done()[rid].output_ids)
    assert sum(1 for r in eng.step_records() if r.prefill_tokens) == 1, "a miss off a page boundary: one step"
    # the snapshot the chunk kernels and the conv wrote at the last page boundary, 32, inside the step
    match = eng.prefix_cache.tree.match(base[:32] + [0], 32)
    assert match.tokens == 32
    alone = prefix_state(artifact, registry, base[:32])
    for layer_id, entries in eng.prefix_cache.snapshots.buffers.items():
        for name, t in entries.items():
            torch.testing.assert_close(t[match.snapshot], alone[layer_id][name], rtol=1e-5, atol=1e-6)
    assert [first] + run(eng, prompts[1:]) == want
    stats = eng.stats()
    assert stats["prefix_cache_hits"] >= 2 and stats["prefix_cache_hit_tokens"] >= 32 + 32, stats
    assert stats["free_slots"] == stats["total_slots"], stats
