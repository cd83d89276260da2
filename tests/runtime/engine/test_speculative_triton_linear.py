"""Speculative decoding with the linear layers on triton_linear, the backend the CUDA target binds
them to, on the CPU: its kernels in Triton's interpreter, float32, so every result must be exact.

triton_linear runs a target_verify step as n launches of its decode kernels on the strided rows
t, n + t, 2n + t, ... (token t of every request), each launch starting from the state the one
before left in the request's slot, and copies that state into the state pool's intermediate
entry [row, t] after every token but the last (runtime/backends/triton_linear.py). The
routes bind gdn_core and short_conv (qwen3_next, qwen3_5) or lightning_core (bailing_linear) to
it (testkit/linear_cases.interpreted_triton_linear: FLA's chunk kernels of the prefill stood in by
the reference recurrence); attention, the MoE and the draft program stay on the CPU reference.

1. Row j of a verify step is the decode step after the same j tokens (testkit/spec_checks.py):
   twin requests, one verified with 4 tokens, the other fed them one decode step at a time; the
   three families (qwen3_5's flat projections hand the kernels other input strides).
2. Greedy tokens of an engine with drafts are plain decoding's (qwen3_next): the MTP draft with
   D = 1 and 3 (random weights: its drafts are refused, so every verify step's first row and the
   intermediate state of its first token decide), the MTP draft forced to the plain continuation
   (testkit/spec_drafters.ForcedDrafts: kept in full, the slot's own state after the last token
   goes on) and a drafter that always disagrees.

The kernels' own arithmetic against the reference, op by op in every mode, is in
tests/runtime/backends/test_triton_linear.py; the interpreter walks every program of a launch in Python, so the
workloads here are small and the tiles pinned one per row.
"""

from __future__ import annotations

import pytest
import torch

from runtime.step.bound_ops import BoundOps
from runtime.engine.engine import SamplingParams
from runtime.graphs.runner import GraphRunner
from runtime.cache.kv_pool import KVPool
from runtime.assembly import EngineOptions, engine_for_artifact
from runtime.cache.state_pool import StatePool
from testkit.helpers import artifacts_by_family
from testkit.linear_cases import INTERPRETED_TRITON_LINEAR, compile_linear_routed, interpreted_linear_registry
from testkit.spec_checks import verify_against_decode
from testkit.spec_drafters import DisagreeingDrafter, ForcedDrafts

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")
# the interpreter: about half a minute in all on 2 cores; tiny models run fastest on one thread
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

LINEAR_OPS = {"qwen3_next": ("gdn_core", "short_conv"), "qwen3_5": ("gdn_core", "short_conv"),
              "bailing_linear": ("lightning_core",)}
# Two requests: a prompt longer than the token budget (chunked) and a short one.
PROMPTS = [[(3 * j) % 200 + 3 for j in range(17)], [11, 5, 9]]
NEW_TOKENS = [5, 3]
MAX_LEN = 48
# The recurrent cores' extend steps (the prefills) on FakeFLA, the reference recurrence, as the
# docstring says: the routing defaults would run them through our chunk kernels (chunk_impl=triton)
# or the recurrent extend kernel (requests of up to 64 tokens) in the interpreter, three quarters of
# the module's time, for steps it does not check. Decode and target_verify steps, what it checks,
# run the same kernels either way. The extend kernels are checked against the reference in
# tests/runtime/backends/test_triton_linear.py and test_triton_chunk.py.
PREFILL_ON_FAKE_FLA = "chunk_impl=fla,short_extend_tokens=0"


@pytest.fixture(scope="module")
def registry():
    return interpreted_linear_registry("tests/runtime/engine/test_speculative_triton_linear.py")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, registry):
    def compile_one(family, ckpt, out):  # `hgc compile --route OP=BACKEND` with the test's registry
        compile_linear_routed(ckpt, out, LINEAR_OPS[family], PREFILL_ON_FAKE_FLA, registry)

    # qwen3_next with one GDN layer and one full layer: every GDN layer's verify rows run the same
    # kernels, and the interpreter walks each layer's (the greedy runs' most of the module's time)
    return artifacts_by_family(tmp_path_factory.mktemp("spec-tl"), compile_one,
                               {"qwen3_next": dict(num_hidden_layers=2, full_attention_interval=2)})


@pytest.mark.parametrize("family", tuple(LINEAR_OPS))
def test_verify_rows_are_the_decode_steps_of_the_same_tokens(artifacts, registry, family):
    art, D = artifacts(family), 3
    kv = KVPool(art.registry, 4 * 3 + 1, 16)
    st = StatePool(art.registry, 4, draft_tokens=D, verify_rows=2)
    ops = BoundOps(art.backends(kv, st, registry).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(), extend_buckets=(),
                         max_pages_per_seq=3, extend_max_seqs=4)  # nothing captured: every step eager
    found = verify_against_decode(runner, int(art.manifest["model"]["vocab_size"]), [3, 18], D,
                                  torch.Generator().manual_seed(1))
    assert len(found["rows"]) == 2 * (D + 1)
    for row in found["rows"]:
        assert row["rel_err"] <= 1e-5 and row["argmax_equal"], row
    assert INTERPRETED_TRITON_LINEAR in ops.executed_backends()["0"]
    assert st.num_free == st.num_slots and kv.num_free == kv.num_pages


def run(engine) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(PROMPTS, NEW_TOKENS)]
    results = engine.run_until_done()
    stats = engine.stats()
    assert stats["free_slots"] == stats["total_slots"] and stats["free_pages"] == stats["total_pages"], stats
    return [list(results[i].output_ids) for i in ids]


def options(D: int) -> EngineOptions:
    return EngineOptions(slots=2, token_budget=16, speculative_tokens=D)


def test_greedy_tokens_with_drafts_are_plain_decodings(artifacts, registry):
    art = artifacts("qwen3_next")
    vocab = int(art.manifest["model"]["vocab_size"])
    plain = run(engine_for_artifact(art, options(0), MAX_LEN, registry=registry))
    references = {tuple(p): o for p, o in zip(PROMPTS, plain)}
    for D in (1, 3):
        engine = engine_for_artifact(art, options(D), MAX_LEN, registry=registry)
        assert run(engine) == plain, f"MTP draft, D = {D}"
        assert engine.stats()["spec_verify_steps"] > 0

    def engine_with(D, wrap):
        return engine_for_artifact(art, options(D), MAX_LEN, registry=registry, drafter_wrap=wrap)

    forced = engine_with(3, lambda mtp: ForcedDrafts(mtp, references))
    assert run(forced) == plain, "MTP draft forced to the plain continuation"
    assert forced.stats()["spec_tokens_per_verify"] > 2  # kept in full, but past each request's end
    refused = engine_with(3, lambda mtp: DisagreeingDrafter(references, 3, vocab))
    assert run(refused) == plain, "a drafter that always disagrees"
    assert refused.stats()["spec_accepted"] == 0
