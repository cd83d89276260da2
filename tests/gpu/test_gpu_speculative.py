"""Speculative decoding on a CUDA GPU: target_verify and draft steps captured, parity-checked and exact.

Runs only on the GPU machine (`pytest -m gpu`); benchmarks/serving/spec_bench.py measures the costs.

1. bf16, the default routing (FlashInfer, the Triton linear kernels, the fused MoE): with three
   drafts the main runner captures target_verify buckets as whole-step graphs (every op of the
   verify plan in split.json is captured), the draft program gets its own runner over its own
   BackendSet (decode and verify-layout keys), start-up parity passes for every key, the graphs
   are replayed, and every slot and page is free afterwards. bf16 kernels of different shapes
   (FlashInfer's paged prefill for verify, its decode kernel for plain steps) may decide a near
   tie differently, so tokens are compared where such ties cannot move them: each request's
   first token (its prefill) and, with a drafter forced to agree, the count of kept drafts.
2. bf16 on a dense model (no router): each row of a replayed verify step equals the replayed
   decode step after the same tokens within the start-up parity tolerance (testkit/spec_checks.py).
   A fault in a backend's verify path shows here as a large error on every row, where greedy
   tokens of a random-weight bf16 model would only diverge at some near tie.
3. float32, full attention routed to torch_reference (FlashInfer has no float32 kernels), the
   linear layers and the MoE on their Triton kernels: greedy tokens with D = 1 and 3 are exactly
   plain decoding's for eight mixed-length requests, and a drafter proposing the plain
   continuation (testkit/spec_drafters.py, test-only) is kept, advancing D + 1 positions per step.
4. bf16 compiled with --batch-invariant: a verify step's rows are the decode steps' bits, and greedy
   tokens with D = 1, 3 and 7 drafts (the real MTP draft, and one forced to agree) are exactly
   plain decoding's for the eight requests, all admitted in one step and finishing at different
   steps (a prompt chunk's own result still depends on how the scheduler cut it; docs/DESIGN.md).
"""

from __future__ import annotations

import pytest
import torch

from hgc import main
from compiler.splitops import Mode
from runtime.engine.engine import SamplingParams
from runtime.artifact.loader import load_artifact
from runtime.assembly import EngineOptions, engine_for_artifact
from testkit.spec_drafters import GreedyContinuationDrafter

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(n)] for i, n in enumerate([1, 5, 17, 3, 9, 2, 12, 7])]
NEW_TOKENS = [9, 4, 14, 6, 11, 3, 8, 13]
MAX_LEN = 64


def _artifact(root, name: str, dtype: str, *routes: str, dense: bool = False, invariant: bool = False):
    """A tiny qwen3_next compiled for cuda; dense: every layer's MLP dense (mlp_only_layers), no router;
    invariant: compiled with --batch-invariant."""
    from testkit.helpers import tiny_checkpoint

    dense_mlps = {"mlp_only_layers": [0, 1, 2, 3]} if dense else {}  # tiny has 4 layers
    tiny_checkpoint("qwen3_next", root / f"{name}-c", 1, head_dim=64, **dense_mlps)  # FlashInfer: no head dim 32
    flags = [f"--route={r}" for r in routes] + (["--batch-invariant"] if invariant else [])
    assert main(["compile", str(root / f"{name}-c"), "-o", str(root / name), "--target", "cuda", "--no-inductor", "--dtype", dtype,
                 "--no-dumps", *flags]) == 0
    return load_artifact(root / name, "cuda")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gspec")
    return {"bf16": _artifact(root, "bf16", "bfloat16"),
            "dense": _artifact(root, "dense", "bfloat16", dense=True),
            "fp32": _artifact(root, "fp32", "float32", "gqa_attention=torch_reference")}


def options(D: int) -> EngineOptions:
    return EngineOptions(slots=4, token_budget=16, speculative_tokens=D, page_size=16)


def run(engine) -> tuple[list[list[int]], dict]:
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(PROMPTS, NEW_TOKENS)]
    results = engine.run_until_done()
    return [list(results[i].output_ids) for i in ids], engine.stats()


def all_free(stats: dict) -> bool:
    return stats["free_slots"] == stats["total_slots"] and stats["free_pages"] == stats["total_pages"]


def test_bf16_verify_and_draft_steps_are_captured_checked_and_replayed(artifacts):
    art, lines = artifacts["bf16"], []
    plain, _ = run(engine_for_artifact(art, options(0), MAX_LEN, device="cuda"))
    engine = engine_for_artifact(art, options(3), MAX_LEN, device="cuda", log=lines.append)
    main_runner, draft_runner = engine.runner, engine.spec.drafter.steps
    assert Mode.TARGET_VERIFY in main_runner.full_modes, "FlashInfer, Triton linear and MoE all capture verify"
    assert any(k.mode == Mode.TARGET_VERIFY for k in main_runner.keys)
    assert {k.mode for k in draft_runner.keys} >= {Mode.DECODE, Mode.TARGET_VERIFY}
    assert draft_runner.ops.backend is not main_runner.ops.backend  # the draft program's own BackendSet
    assert any("draft program" in line and "match eager" in line for line in lines)
    outputs, stats = run(engine)
    assert [len(o) for o in outputs] == NEW_TOKENS and all_free(stats), stats
    assert [o[0] for o in outputs] == [p[0] for p in plain]  # each request's prefill token
    assert main_runner.counters["graph_replays"] > 0 and draft_runner.counters["graph_replays"] > 0
    assert stats["spec_verify_steps"] > 0


def verify_rows_against_decode(art, D: int, bucket: int, histories=(5, 37, 70), trace_ops: bool = False) -> dict:
    """testkit/spec_checks.verify_against_decode over a started runner of the main program with one
    decode and one verify bucket, for requests of these history lengths (crossing page boundaries);
    trace_ops: every step eager, each row's first parting op named."""
    from runtime.step.bound_ops import BoundOps
    from runtime.graphs.runner import GraphRunner
    from runtime.cache.kv_pool import KVPool
    from runtime.cache.state_pool import StatePool
    from testkit.spec_checks import verify_against_decode

    vocab = int(art.manifest["model"]["vocab_size"])
    pages = -(-(max(histories) + 2 * (D + 1)) // 16)
    kv = KVPool(art.registry, 2 * bucket * pages + 1, 16, "cuda")
    st = StatePool(art.registry, 2 * bucket, "cuda", draft_tokens=D, verify_rows=bucket)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cuda", decode_buckets=(bucket,), extend_buckets=(),
                         verify_buckets=(bucket,), verify_tokens=D + 1, max_pages_per_seq=pages,
                         extend_max_seqs=2 * bucket)
    runner.start(vocab)
    return verify_against_decode(runner, vocab, list(histories), D, torch.Generator().manual_seed(3),
                                 trace_ops=trace_ops)


def test_bf16_verify_rows_are_the_decode_steps_to_rounding(artifacts):
    """Row j of a replayed target_verify step against the replayed decode step after the same j
    tokens (testkit/spec_checks.py: twin requests from one prefill), bf16, the default routing
    (FlashInfer's paged prefill for verify, its decode kernel for decode, the Triton linear
    kernels), 3 requests in buckets of 4, histories crossing page boundaries. The model is dense
    (no random router to flip an expert on rounding), so every row must agree within the start-up
    parity tolerance for bf16; a fault in a verify path (state, KV, rows) moves every row by far more."""
    from runtime.graphs.parity import rtol_for

    D, bucket = 3, 4
    found = verify_rows_against_decode(artifacts["dense"], D, bucket)
    rows = bucket * (D + 1)
    assert [str(k) for k in found["keys"]] == ([f"target_verify[tokens={rows}, seqs={bucket}, rows={rows}]"]
                                               + [f"decode[tokens={bucket}, seqs={bucket}]"] * (D + 1))
    worst = max(found["rows"], key=lambda r: r["rel_err"])
    assert worst["rel_err"] <= rtol_for(torch.bfloat16), worst


def engine_with_drafter(art, D: int, drafter):
    # the main program's captured steps, `drafter` in place of the artifact's
    return engine_for_artifact(art, options(D), MAX_LEN, device="cuda", drafter_wrap=lambda mtp: drafter)


@pytest.mark.parametrize("draft_tokens", (1, 3))
def test_fp32_greedy_tokens_with_drafts_are_plain_decodings(artifacts, draft_tokens):
    art = artifacts["fp32"]
    plain, _ = run(engine_for_artifact(art, options(0), MAX_LEN, device="cuda"))
    outputs, stats = run(engine_for_artifact(art, options(draft_tokens), MAX_LEN, device="cuda"))
    assert outputs == plain
    assert stats["spec_verify_steps"] > 0 and all_free(stats), stats


def test_fp32_a_forced_agreeing_drafter_is_kept_in_full(artifacts):
    art, D = artifacts["fp32"], 3
    plain, _ = run(engine_for_artifact(art, options(0), MAX_LEN, device="cuda"))
    drafter = GreedyContinuationDrafter({tuple(p): o for p, o in zip(PROMPTS, plain)}, D,
                                        int(art.manifest["model"]["vocab_size"]), device="cuda")
    outputs, stats = run(engine_with_drafter(art, D, drafter))
    assert outputs == plain and all_free(stats)
    assert stats["spec_acceptance_rate"] > 0.5 and stats["spec_tokens_per_verify"] > 2


# -- --batch-invariant -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def invariant(tmp_path_factory):
    """The bf16 artifact compiled with --batch-invariant; loading it routes the process's CUDA matrix
    products and sums to the batch-invariant kernels, taken back afterwards for the other modules."""
    from runtime.backends import batch_invariant_aten

    art = _artifact(tmp_path_factory.mktemp("gspec_bi"), "invariant", "bfloat16", invariant=True)
    assert art.batch_invariant and batch_invariant_aten.installed()
    yield art
    batch_invariant_aten.uninstall()


def invariant_options(D: int) -> EngineOptions:
    """Every request admitted in the first step (eight slots, a budget over the 56 prompt tokens)."""
    return EngineOptions(slots=8, token_budget=64, speculative_tokens=D, page_size=16)


@pytest.mark.parametrize("bucket,histories", [(4, (5, 37, 70)), (4, (255, 300, 700)), (1, (284,))],
                         ids=["one-split", "past-256-keys", "one-request-past-256-keys"])
def test_batch_invariant_verify_rows_are_the_decode_steps_bit_for_bit(invariant, bucket, histories):
    """Histories past SPLIT_TOKENS (256 keys) put a row's keys in several fixed splits."""
    D = 3
    found = verify_rows_against_decode(invariant, D, bucket, histories)
    assert len(found["rows"]) == len(histories) * (D + 1)
    parted = [r for r in found["rows"] if r["rel_err"]]
    if parted:  # the same twins eager, op by op: where each row's bits first part
        traced = verify_rows_against_decode(invariant, D, bucket, histories, trace_ops=True)["rows"]
        parted = [{**r, "eager_parting": t["parting"]} for r, t in zip(found["rows"], traced) if r["rel_err"]]
    assert not parted, parted


@pytest.mark.parametrize("draft_tokens", (1, 3, 7))
def test_batch_invariant_bf16_greedy_tokens_with_drafts_are_plain_decodings(invariant, draft_tokens):
    art = invariant
    plain, _ = run(engine_for_artifact(art, invariant_options(0), MAX_LEN, device="cuda"))
    engine = engine_for_artifact(art, invariant_options(draft_tokens), MAX_LEN, device="cuda")
    outputs, stats = run(engine)
    assert outputs == plain
    assert stats["spec_verify_steps"] > 0 and all_free(stats), stats
    assert engine.runner.counters["graph_replays"] > 0


def test_batch_invariant_a_forced_agreeing_drafter_is_kept_with_plain_tokens(invariant):
    art, D = invariant, 3
    plain, _ = run(engine_for_artifact(art, invariant_options(0), MAX_LEN, device="cuda"))
    drafter = GreedyContinuationDrafter({tuple(p): o for p, o in zip(PROMPTS, plain)}, D,
                                        int(art.manifest["model"]["vocab_size"]), device="cuda")
    engine = engine_for_artifact(art, invariant_options(D), MAX_LEN, device="cuda", drafter_wrap=lambda mtp: drafter)
    outputs, stats = run(engine)
    assert outputs == plain and all_free(stats)
    # as the float32 test: drafts past a request's last token propose padding, which is rejected
    assert stats["spec_acceptance_rate"] > 0.5 and stats["spec_tokens_per_verify"] > 2


@pytest.mark.parametrize("draft_tokens", (1, 3))
def test_batch_invariant_long_request_greedy_tokens_with_drafts_are_plain_decodings(invariant, draft_tokens):
    """One request whose context grows past SPLIT_TOKENS (256 keys) while it decodes."""
    from runtime.engine.engine import SamplingParams

    prompt = [(11 * j) % 200 + 3 for j in range(200)]

    def text(D: int) -> list[int]:
        engine = engine_for_artifact(invariant, EngineOptions(slots=1, token_budget=256, speculative_tokens=D,
                                                              page_size=16), 400, device="cuda")
        rid = engine.add_request(prompt, SamplingParams(max_new_tokens=150))
        return list(engine.run_until_done()[rid].output_ids)

    plain, drafted = text(0), text(draft_tokens)
    first = next((i for i, (a, b) in enumerate(zip(plain, drafted)) if a != b), min(len(plain), len(drafted)))
    assert plain == drafted, (f"D = {draft_tokens}: tokens part at {first} (position {len(prompt) + first}); "
                              f"{len(plain)} plain, {len(drafted)} with drafts")


def test_batch_invariant_draft_steps_run_torchs_products_and_verify_steps_the_fixed_order_ones(invariant):
    """The draft's numbers pick proposals only (runtime/engine/speculative.py): its graphs are captured with
    torch's products. So a round (D = 3: draft steps, the verify step, the draft's step after it)
    launches the fixed-order kernel (`_matmul_kernel`) exactly as often as a plain decode step, whose
    products the verify step shares."""
    from runtime.engine.engine import SamplingParams

    def products_launched(D: int) -> int:
        engine = engine_for_artifact(invariant, EngineOptions(slots=1, token_budget=64, speculative_tokens=D,
                                                              page_size=16), MAX_LEN, device="cuda")
        engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=24))
        for _ in range(len(PROMPTS[2]) + 2):  # through the prompt
            engine.step()
            if not engine.step_records()[-1].prefill_tokens:
                break
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        engine.run_until_done()
        return sum("_matmul_kernel" in e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)

    plain, round_ = products_launched(0), products_launched(3)
    assert plain > 0 and round_ == plain, (plain, round_)
