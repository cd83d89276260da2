"""hgc.gdn_fused on a CUDA GPU at the bench dims (Hk 16, Hv 32, Dk = Dv = 128, K 4) against the
unfused ops on the same device (testkit/gdn_cases.py `unfused_gdn`: triton_linear's short_conv and
gdn_core with the model's torch glue between them), each on its own copy of the same random
non-zero pools.

Marked gpu (CI deselects them). bf16 and float32; decode at batch 1, 8 and 128 (padding rows
pointing at the padding slot), each on the op's choice of launches and on the two-launch split, extend steps of one 512-token request and of 4 x 100 tokens on our
chunk kernels (and on FLA's where it is installed), a target-verify step of 4 requests x 4 tokens,
extend and mixed steps past 512 tokens on FlashInfer's kernel (chunk_impl=flashinfer, sm90);
outputs and the touched slots' conv and recurrent states by relative error of the norm, padding
rows zero. The last test captures the fused decode path in a CUDA graph and replays it for steps
of other slots and inputs against the same steps run eagerly.

The kernels module is imported inside the tests, never at collection (tests/gpu/test_gpu_linear_kernels.py says why).
"""

from __future__ import annotations

import os

import pytest
import torch

from compiler.splitops import Mode
from runtime.cache.state_pool import PADDING_SLOT
from testkit.gdn_cases import (BENCH_GDN, DECODE_PATHS, fused_gdn, gdn_inputs, gdn_params, gdn_pools,
                               take_decode_path, unfused_gdn)
from testkit.linear_cases import decode_ctx, rel_err, step_ctx

DEV = os.environ.get("HGC_GPU_TESTS_DEVICE", "cuda")  # cpu (with TRITON_INTERPRET=1): walks the test code
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]

S = BENCH_GDN
EPS = 1e-6
NUM_SLOTS = 160
VERIFY = dict(draft_tokens=3, verify_rows=8)
# Both sides round the same values in the same dtype; they differ by the order of float32 sums
# (l2norm, the norm, the recurrence's reductions), which flips a bf16 rounding here and there.
# (Walked through the interpreter, which truncates where a GPU rounds to nearest: a few bf16 steps.)
BF16_STEPS = 4 if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else 1
OUT_TOL = {torch.bfloat16: 1e-2 * BF16_STEPS, torch.float32: 1e-4}
STATE_TOL = {torch.bfloat16: 5e-3 * BF16_STEPS, torch.float32: 1e-5}
# FLA's chunk kernels take float32 products as tf32 (a 10-bit mantissa): inputs that differ in their
# last bits (the l2norm's and the gates' float32 sums in another order) reach the state of four
# 100-token requests 2.5e-5 apart on an H200, where our kernels keep float32 products (1e-5 holds).
FLA_STATE_TOL_F32 = 1e-4


def backends(dtype, seed: int, state_dtype: str = "float32", **kwargs):
    """Two triton_linear backends over two device pools with the same states (recurrent ones in
    `state_dtype`), and the layer's weights."""
    from runtime.backends.triton_linear import TritonLinearBackend

    _, fused_pool, unfused_pool = gdn_pools({0: S}, NUM_SLOTS, DEV, seed, VERIFY, copies=3, state_dtype=state_dtype)
    for pool in (fused_pool, unfused_pool):
        for t in pool.layer(0).values():
            t[1].zero_()  # slot 1: a request that starts from the empty state
    return (TritonLinearBackend(fused_pool, **kwargs), TritonLinearBackend(unfused_pool, **kwargs),
            gdn_params(S, dtype, seed + 1).to(DEV))


def compare(fused, unfused, p, ctx, dtype, g, slots_used, what: str, state_tol: float | None = None) -> None:
    R, T = ctx.num_real_tokens, ctx.num_tokens
    x = gdn_inputs(S, T, R, dtype, g, DEV)
    outs = []
    for backend, run in ((fused, fused_gdn), (unfused, unfused_gdn)):
        out = torch.full((T, S.hv, S.dv), float("nan"), dtype=dtype, device=DEV)
        run(backend, ctx, x, p, out, 0, S, EPS)
        outs.append(out.float().cpu())
    got, want = outs
    assert torch.isfinite(got).all() and got[R:].eq(0).all(), f"{what}: rows unwritten or padding rows not zero"
    err = rel_err(got[:R], want[:R])
    assert err <= OUT_TOL[dtype], f"{what}: out rel err {err:.2e}"
    rows = sorted(set(slots_used))
    for entry in ("conv", "recurrent"):
        s_err = rel_err(fused.state_pool.layer(0)[entry][rows], unfused.state_pool.layer(0)[entry][rows])
        assert s_err <= (state_tol or STATE_TOL[dtype]), f"{what}: {entry} state rel err {s_err:.2e}"


def run_steps(fused, unfused, p, steps, dtype, seed: int, what: str, state_tol: float | None = None) -> None:
    """Each (mode, requests, padding rows, padding requests) step planned on both backends and compared."""
    g = torch.Generator().manual_seed(seed)
    touched = set()
    for mode, reqs, pad_t, pad_s in steps:
        ctx = step_ctx(mode, reqs, pad_t, pad_s, DEV)
        for backend in (fused, unfused):
            plan(backend, ctx)
        touched |= {slot for slot, _, n in reqs if n}
        compare(fused, unfused, p, ctx, dtype, g, touched, f"{what} {mode.value}", state_tol)


def plan(backend, ctx) -> None:
    from runtime.backends.protocol import plan_eager_step

    plan_eager_step(backend, ctx, 8192)


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"], ids=["state_f32", "state_bf16"])
@pytest.mark.parametrize("path", ["own_choice", *DECODE_PATHS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("B", [1, 8, 128])
def test_decode_matches_the_unfused_ops(B, dtype, path, state_dtype, monkeypatch):
    """The op's choice of launches at each batch (kernels/gdn_fused.py decode_launches), and each of
    its paths at every batch: the two-launch split, the one launch, the unfused kernels; bfloat16
    states (--state-dtype) on the op's own choice, with bfloat16 inputs."""
    if state_dtype == "bfloat16" and (path != "own_choice" or dtype != torch.bfloat16):
        pytest.skip("bfloat16 states on the op's own choice of launches, with bfloat16 inputs")
    if path != "own_choice":
        take_decode_path(monkeypatch, path, B)
    fused, unfused, p = backends(dtype, seed=B, state_dtype=state_dtype)
    g = torch.Generator().manual_seed(100 + B)
    num_real = max(1, B - B // 8)  # padding rows at the end, as the runtime pads to a bucket
    slots = list(torch.randperm(NUM_SLOTS, generator=g)[:num_real].add(1).tolist()) + [PADDING_SLOT] * (B - num_real)
    for step in range(2):
        ctx = decode_ctx(slots, num_real, DEV)
        for backend in (fused, unfused):
            plan(backend, ctx)
        compare(fused, unfused, p, ctx, dtype, g, slots[:num_real], f"decode B={B} {dtype} step {step}")


EXTENDS = {
    "one_512": [(Mode.EXTEND, [(1, 0, 512)], 0, 0), (Mode.DECODE, [(1, 512, 1)], 0, 0)],
    "four_100": [(Mode.EXTEND, [(1, 0, 100), (5, 30, 100), (9, 7, 100), (12, 0, 100)], 16, 1),
                 (Mode.MIXED, [(5, 130, 1), (9, 107, 60), (3, 0, 40)], 3, 1)],
    "verify_4x4": [(Mode.TARGET_VERIFY, [(1, 10, 4), (5, 12, 4), (9, 3, 4), (12, 40, 4)], 4, 1)],
}


def _fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        return True
    except ImportError:
        return False


# chunk_impl=flashinfer past its bound (512 tokens): one long request, then three requests (one
# with history) beside a mixed step whose decode rows are requests of one token
FLASHINFER_STEPS = [(Mode.EXTEND, [(1, 0, 1024)], 0, 0),
                    (Mode.EXTEND, [(5, 0, 600), (9, 50, 300), (12, 0, 200)], 24, 1),
                    (Mode.MIXED, [(1, 1024, 1), (5, 600, 1), (3, 0, 700)], 5, 1),
                    (Mode.DECODE, [(1, 1025, 1), (3, 700, 1)], 0, 0)]
# FlashInfer's kernel and ours each sit ~3e-3 from the reference recurrence in bf16 (their products
# in another order: benchmarks/probes/gdn_prefill_probe.py), so the two are compared at twice that
FLASHINFER_STATE_TOL = 1e-2


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"], ids=["state_f32", "state_bf16"])
def test_flashinfer_steps_match_our_chunk_kernels(state_dtype):
    """The fused mixer with chunk_impl=flashinfer (FlashInfer's SM90 kernel past 512 tokens, built
    by its JIT on first use) against the unfused ops on our chunk kernels, bf16, the bench dims."""
    if DEV != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("FlashInfer's GDN prefill kernel is built for sm_90a")
    pytest.importorskip("flashinfer")
    from runtime.backends.triton_linear import TritonLinearBackend

    fused, unfused, p = backends(torch.bfloat16, seed=17, state_dtype=state_dtype, chunk_impl="flashinfer")
    unfused = TritonLinearBackend(unfused.state_pool, chunk_impl="triton")
    run_steps(fused, unfused, p, FLASHINFER_STEPS, torch.bfloat16, 18, f"flashinfer {state_dtype}",
              FLASHINFER_STATE_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("chunk_impl", ["triton", "fla"])
@pytest.mark.parametrize("steps", list(EXTENDS))
def test_extend_mixed_verify_match_the_unfused_ops(steps, chunk_impl, dtype):
    if chunk_impl == "fla" and not _fla_available():
        pytest.skip("fla-core is not installed")
    fused, unfused, p = backends(dtype, seed=7, chunk_impl=chunk_impl)
    fla_f32 = chunk_impl == "fla" and dtype == torch.float32
    run_steps(fused, unfused, p, EXTENDS[steps], dtype, 8, f"{steps} {chunk_impl} {dtype}",
              FLA_STATE_TOL_F32 if fla_f32 else None)
    if steps == "verify_4x4":
        for entry in ("conv", "recurrent"):
            got = fused.state_pool.verify_buffers[0][entry][:4, :3]
            want = unfused.state_pool.verify_buffers[0][entry][:4, :3]
            assert rel_err(got, want) <= STATE_TOL[dtype], f"{entry} intermediate states"


EXTEND_FOLDS = {"norm": dict(extend_norm="in_output", decode_norm="in_recurrence"), "qk": dict(qk_gates="in_conv"),
                "all": dict(extend_norm="in_output", qk_gates="in_conv", decode_norm="in_recurrence")}
# a decode step of 128 requests (the unfused kernels, whose conv takes qk_gates=in_conv too)
FOLD_STEPS = {**EXTENDS, "decode_128": [(Mode.DECODE, [(1 + i, 20 + i, 1) for i in range(128)], 0, 0)]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("folds", list(EXTEND_FOLDS))
@pytest.mark.parametrize("steps", list(FOLD_STEPS))
def test_steps_with_the_extend_folds_match_the_unfused_ops(steps, folds, dtype):
    """extend_norm=in_output and decode_norm=in_recurrence (the gated norm applied by the chunk output
    kernel and by the decode recurrence, whole-row tiles) and qk_gates=in_conv (the q / k norm and
    gates in the conv's launch: extend steps and a decode of 128 requests), apart and together, at
    the bench dims against the unfused ops on our chunk kernels."""
    fused, unfused, p = backends(dtype, seed=27, chunk_impl="triton", **EXTEND_FOLDS[folds])
    run_steps(fused, unfused, p, FOLD_STEPS[steps], dtype, 28, f"{steps} folds {folds} {dtype}")


def test_decode_graph_capture_and_replay_matches_eager():
    """The fused decode op captured once (from a padding-only step) and replayed for two steps of
    other slots and inputs, against the same steps run eagerly on a copy of the pools."""
    from runtime.backends.triton_linear import TritonLinearBackend

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    bucket, dtype = 8, torch.bfloat16
    _, graph_pool, eager_pool = gdn_pools({0: S}, 20, DEV, seed=21, copies=3)
    replayed, eager = TritonLinearBackend(graph_pool), TritonLinearBackend(eager_pool)
    replayed.init_capture_state(max_tokens=bucket, max_seqs=bucket)
    p = gdn_params(S, dtype, 22).to(DEV)
    g = torch.Generator().manual_seed(23)
    static = gdn_inputs(S, bucket, bucket, dtype, g, DEV)
    out = torch.empty(bucket, S.hv, S.dv, dtype=dtype, device=DEV)
    dummy = decode_ctx([PADDING_SLOT] * bucket, 0, DEV)
    replayed.init_replay_state(dummy, bucket)
    before = graph_pool.layer(0)["recurrent"].clone()
    fused_gdn(replayed, dummy, static, p, out, 0, S, EPS)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_gdn(replayed, dummy, static, p, out, 0, S, EPS)
    torch.cuda.synchronize()
    assert torch.equal(graph_pool.layer(0)["recurrent"], before), "the padding-only step wrote a slot"
    for step, (slots, num_real) in enumerate([([3, 9, 14, 2, 7, PADDING_SLOT, PADDING_SLOT, PADDING_SLOT], 5),
                                              ([9, 4, 3, 11, 17, 6, 2, 1], 8)]):
        ctx = decode_ctx(slots, num_real, DEV)
        replayed.init_replay_state(ctx, bucket)
        x = gdn_inputs(S, bucket, num_real, dtype, g, DEV)
        for name in ("qkv", "z", "b", "a"):
            static[name].copy_(x[name])
        out.fill_(float("nan"))
        graph.replay()
        plan(eager, ctx)
        want = torch.full_like(out, float("nan"))
        fused_gdn(eager, ctx, x, p, want, 0, S, EPS)
        torch.cuda.synchronize()
        assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:])), f"step {step}: padding rows"
        assert torch.equal(out, want), f"step {step}: the replay differs from the eager run"
        for entry in ("conv", "recurrent"):
            assert torch.equal(graph_pool.layer(0)[entry], eager_pool.layer(0)[entry]), f"step {step}: {entry} states"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_the_split_in_one_launch_matches_the_unfused_ops(dtype):
    """split_decode="one_launch" at batch 1 over three steps (each step's conv reads the history the
    last program of each key head rolled in the step before), against the unfused ops."""
    fused, unfused, p = backends(dtype, seed=31, split_decode="one_launch")
    g = torch.Generator().manual_seed(32)
    for step, slot in enumerate((5, 5, 9)):
        ctx = decode_ctx([slot], 1, DEV)
        for backend in (fused, unfused):
            plan(backend, ctx)
        compare(fused, unfused, p, ctx, dtype, g, [5, 9][: 1 + (step == 2)], f"one-launch split {dtype} step {step}")


def test_the_split_in_one_launch_replays_fresh_steps_as_its_eager_runs():
    """Captured at bucket 1 and replayed for three steps of other slots and inputs: each replay the
    eager run's output and states bit for bit (the same kernel: its counters were back at zero)."""
    from runtime.backends.kernels.arrivals import arrival_counters
    from runtime.backends.triton_linear import TritonLinearBackend

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    dtype = torch.bfloat16
    _, graph_pool, eager_pool = gdn_pools({0: S}, 20, DEV, seed=33, copies=3)
    replayed = TritonLinearBackend(graph_pool, split_decode="one_launch")
    eager = TritonLinearBackend(eager_pool, split_decode="one_launch")
    replayed.init_capture_state(max_tokens=1, max_seqs=1)
    p = gdn_params(S, dtype, 34).to(DEV)
    g = torch.Generator().manual_seed(35)
    static = gdn_inputs(S, 1, 1, dtype, g, DEV)
    out = torch.empty(1, S.hv, S.dv, dtype=dtype, device=DEV)
    first = decode_ctx([7], 1, DEV)
    replayed.init_replay_state(first, 1)
    plan(eager, first)
    fused_gdn(replayed, first, static, p, out, 0, S, EPS)  # compiles and allocates outside the capture
    fused_gdn(eager, first, static, p, torch.empty_like(out), 0, S, EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_gdn(replayed, first, static, p, out, 0, S, EPS)
    for step, slot in enumerate((7, 12, 7)):
        ctx = decode_ctx([slot], 1, DEV)
        replayed.init_replay_state(ctx, 1)
        x = gdn_inputs(S, 1, 1, dtype, g, DEV)
        for name in ("qkv", "z", "b", "a"):
            static[name].copy_(x[name])
        graph.replay()
        plan(eager, ctx)
        want = torch.full_like(out, float("nan"))
        fused_gdn(eager, ctx, x, p, want, 0, S, EPS)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"step {step}: the replay differs from the eager run"
        for entry in ("conv", "recurrent"):
            assert torch.equal(graph_pool.layer(0)[entry], eager_pool.layer(0)[entry]), f"step {step}: {entry}"
        assert not arrival_counters(DEV, 1, "gdn_fused split").any()
