"""The Triton linear kernels on a real CUDA GPU at real model dims, against the CPU reference.

Marked gpu (CI deselects them). Dims: Qwen3-Next GDN (Hk 16 -> Hv 32, D 128), Kimi-Linear KDA
(H 32, D 128), Bailing Lightning (H 16, D 128), Qwen3-Next conv (C 8192, K 4). Inputs bf16,
padding rows at the end pointing at the padding slot, two consecutive steps from a random
non-zero state, outputs poisoned before each run. One test captures the backend's decode ops
in a CUDA graph and replays it for new slots and inputs through the protocol hooks. One runs a
target_verify step against the decode steps of the same tokens (outputs, the intermediate
states speculative decoding keeps, final states). The extend conv kernel is checked on its own at
the bench models' widths (Qwen3-Next 8192, Kimi-Linear 3 x 4096 channels, K 4) over requests of 1,
K-2, K-1, K and 1000 tokens, in both layouts (tile, row streaming), and row streaming against the
tile bit for bit. The last test runs extend, mixed and target-verify steps (FLA's chunk
kernels, the extend conv, the verify kernels) through a chain of steps on one pool, outputs and
states against the reference; another captures an extend step of our chunk kernels and the extend
conv in a CUDA graph and replays it for steps of other lengths.

The kernels module is imported inside the tests, never at collection: on a CPU machine
tests/runtime/backends/test_triton_linear.py must be the first to import it (after setting TRITON_INTERPRET).
"""

from __future__ import annotations

import os

import pytest
import torch

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.state_pool import PADDING_SLOT, StatePool
from testkit.linear_cases import (check_conv_extend, column_slice, conv_extend_launch, conv_extend_ok, decode_ctx,
                                random_inputs, rel_err, step_ctx)

# HGC_GPU_TESTS_DEVICE=cpu (with TRITON_INTERPRET=1) walks these tests through the interpreter on a
# CPU, to check the test code itself without a GPU: `-k "not 64 and not graph"` keeps it short.
DEV = os.environ.get("HGC_GPU_TESTS_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONV_C, CONV_K = 8192, 4
SPECS = {  # op -> (layer kind, Hk, Hv, Dk, Dv)
    "gdn_core": (LayerKind.GDN, 16, 32, 128, 128),
    "kda_core": (LayerKind.KDA, 32, 32, 128, 128),
    "lightning_core": (LayerKind.LIGHTNING, 16, 16, 128, 128),
    "short_conv": (LayerKind.GDN, 0, 0, 0, 0),
}


def registry_for(op: str, dims: tuple[int, int, int, int] | None = None,
                 state_dtype: str = "float32") -> LayerRegistry:
    """dims: (Hk, Hv, Dk, Dv) in place of SPECS[op]'s; state_dtype: the recurrent state's."""
    kind, hk, hv, dk, dv = SPECS[op][:1] + (dims or SPECS[op][1:])
    state = ({"conv": TensorSpec((CONV_C, CONV_K - 1), "float32")} if op == "short_conv"
             else {"recurrent": TensorSpec((hv, dk, dv), state_dtype)})
    return LayerRegistry([LayerSpec(0, kind, state=state)])


VERIFY = dict(draft_tokens=3, verify_rows=4)  # target_verify steps of up to 4 requests x 4 tokens


def pools(op: str, num_slots: int, seed: int, dims=None, state_dtype="float32") -> tuple[StatePool, StatePool]:
    """Two pools with the same random states (and room for a target_verify step's intermediate states)."""
    reg = registry_for(op, dims, state_dtype)
    ref, dev = StatePool(reg, num_slots, **VERIFY), StatePool(reg, num_slots, DEV, **VERIFY)
    g = torch.Generator().manual_seed(seed)
    for name, t in ref.layer(0).items():
        t.copy_(torch.randn(t.shape, generator=g) * 0.5)
        dev.layer(0)[name].copy_(t)
    return ref, dev


def inputs(op: str, B: int, num_real: int, dtype, g: torch.Generator, dims=None) -> dict[str, torch.Tensor]:
    return random_inputs(op, B, num_real, dims or SPECS[op][1:], CONV_C, dtype, g, k_scale=0.1)


CONSTS = {
    "weight": torch.randn(CONV_C, CONV_K, generator=torch.Generator().manual_seed(1)) * 0.5,
    "bias": torch.randn(CONV_C, generator=torch.Generator().manual_seed(2)),
    "decay": -torch.linspace(0.01, 1.0, SPECS["lightning_core"][2]),
}
_CONST_CACHE: dict = {}


def const(name: str, device, dtype) -> torch.Tensor:
    """Weights live on the device before any capture: a host copy cannot be captured."""
    key = (name, str(device), dtype)
    if key not in _CONST_CACHE:
        _CONST_CACHE[key] = CONSTS[name].to(device=device, dtype=dtype)
    return _CONST_CACHE[key]


def call(backend, ctx, op: str, x: dict, out: torch.Tensor) -> None:
    dev, dtype = out.device, next(iter(x.values())).dtype
    _, hk, hv, dk, dv = SPECS[op]
    if op == "short_conv":
        backend.short_conv(ctx, x["x"], const("weight", dev, dtype), const("bias", dev, dtype), out, 0, True)
    elif op == "gdn_core":
        backend.gdn_core(ctx, x["q"], x["k"], x["v"], x["g"], x["beta"], out, 0, dk ** -0.5)
    elif op == "kda_core":
        backend.kda_core(ctx, x["q"], x["k"], x["v"], x["g"], x["beta"], out, 0, dk ** -0.5)
    else:
        backend.lightning_core(ctx, x["q"], x["k"], x["v"], const("decay", dev, torch.float32), out, 0, dk ** -0.5)


def out_like(op: str, B: int, dtype, device) -> torch.Tensor:
    _, hk, hv, dk, dv = SPECS[op]
    shape = (B, CONV_C) if op == "short_conv" else (B, hv, dv)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def slots_for(B: int, num_slots: int, seed: int) -> tuple[list[int], int]:
    num_real = B if B == 1 else B - max(1, B // 8)
    perm = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed)) + 1
    return perm[:num_real].tolist() + [PADDING_SLOT] * (B - num_real), num_real


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"], ids=["state_f32", "state_bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("op", list(SPECS))
def test_kernels_match_reference_at_real_dims(op, B, dtype, state_dtype):
    """Decode steps against the reference; bfloat16 states (--state-dtype) rounded on both sides
    after each step, with bfloat16 inputs."""
    from runtime.backends.triton_linear import TritonLinearBackend

    if dtype == torch.float32 and B != 8:
        pytest.skip("float32 inputs are checked at batch 8 only")
    if state_dtype == "bfloat16" and (op == "short_conv" or dtype == torch.float32):
        pytest.skip("bfloat16 states are the recurrent cores', checked with bfloat16 inputs")
    num_slots = B + 3
    ref_pool, dev_pool = pools(op, num_slots, seed=B, state_dtype=state_dtype)
    ref = CPUReferenceBackend(None, ref_pool)
    tri = TritonLinearBackend(dev_pool)
    entry = "conv" if op == "short_conv" else "recurrent"
    slots, num_real = slots_for(B, num_slots, seed=B)
    touched = slots[:num_real]
    untouched = [s for s in range(num_slots + 1) if s not in touched]
    before = dev_pool.layer(0)[entry][untouched].clone()
    g = torch.Generator().manual_seed(100 + B)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for _ in range(2):
        x = inputs(op, B, num_real, dtype, g)
        out_ref = out_like(op, B, dtype, "cpu")
        call(ref, decode_ctx(slots, num_real, "cpu"), op, x, out_ref)
        out = out_like(op, B, dtype, DEV)
        call(tri, decode_ctx(slots, num_real, DEV), op, {n: t.to(DEV) for n, t in x.items()}, out)
        out = out.cpu()  # synchronises
        assert torch.isfinite(out).all(), "every output element must be written"
        assert out[num_real:].eq(0).all(), "padding rows must be zero"
        assert rel_err(out[:num_real], out_ref[:num_real]) <= tol
        state_tol = 1e-2 if state_dtype == "bfloat16" else 1e-4  # one bfloat16 step apart at most
        assert rel_err(dev_pool.layer(0)[entry][touched], ref_pool.layer(0)[entry][touched]) <= state_tol
    assert torch.equal(dev_pool.layer(0)[entry][untouched], before), "padding slot or a free slot was written"


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"], ids=["state_f32", "state_bf16"])
@pytest.mark.parametrize("op", [op for op in SPECS if op != "short_conv"])
def test_walking_decode_matches_reference_and_the_one_tile_kernel(op, state_dtype):
    """decode_tiles="walk" at 128 requests (a few programs an SM walking the tiles, loads pipelined):
    two steps against the reference, padding rows zero and free slots untouched, and each step's
    outputs and states bit for bit those of the one-tile kernel at the walk's tile."""
    import dataclasses

    from runtime.backends.kernels import linear as TL
    from runtime.backends.triton_linear import TritonLinearBackend

    B, num_slots = 128, 131
    _, hk, hv, dk, dv = SPECS[op]
    walk = TL.walk_recurrent_config(B, hv, dk, dv, torch.device(DEV))
    assert walk.walk, f"{op}: 128 requests must walk ({walk})"
    ref_pool, dev_pool = pools(op, num_slots, seed=7, state_dtype=state_dtype)
    one_pool = pools(op, num_slots, seed=7, state_dtype=state_dtype)[1]
    ref = CPUReferenceBackend(None, ref_pool)
    walker = TritonLinearBackend(dev_pool, decode_tiles="walk")
    one = TritonLinearBackend(one_pool, recurrent_config=dataclasses.replace(walk, walk=0))
    slots, num_real = slots_for(B, num_slots, seed=7)
    touched = slots[:num_real]
    untouched = [s for s in range(num_slots + 1) if s not in touched]
    before = dev_pool.layer(0)["recurrent"][untouched].clone()
    g = torch.Generator().manual_seed(700)
    for _ in range(2):
        x = inputs(op, B, num_real, torch.bfloat16, g)
        out_ref = out_like(op, B, torch.bfloat16, "cpu")
        call(ref, decode_ctx(slots, num_real, "cpu"), op, x, out_ref)
        outs = []
        for backend in (walker, one):
            out = out_like(op, B, torch.bfloat16, DEV)
            call(backend, decode_ctx(slots, num_real, DEV), op, {n: t.to(DEV) for n, t in x.items()}, out)
            outs.append(out.cpu())
        out = outs[0]
        assert torch.isfinite(out).all() and out[num_real:].eq(0).all()
        assert rel_err(out[:num_real], out_ref[:num_real]) <= 1e-2
        state_tol = 1e-2 if state_dtype == "bfloat16" else 1e-4
        assert rel_err(dev_pool.layer(0)["recurrent"][touched], ref_pool.layer(0)["recurrent"][touched]) <= state_tol
        assert torch.equal(out, outs[1]), "a walked tile computes what one program a tile computes"
        assert torch.equal(dev_pool.layer(0)["recurrent"], one_pool.layer(0)["recurrent"])
    assert torch.equal(dev_pool.layer(0)["recurrent"][untouched], before), "padding slot or a free slot was written"


@pytest.mark.parametrize("B", [1, 8])
def test_short_conv_decode_reads_a_column_slice_of_a_stacked_projection(B):
    """The conv's input as the q|k|v columns of a wider projection output (Kimi's KDA, Qwen3.5's
    GDN): rows further apart than their width, NaN between them."""
    from runtime.backends.triton_linear import TritonLinearBackend

    num_slots = B + 3
    ref_pool, dev_pool = pools("short_conv", num_slots, seed=B)
    ref, tri = CPUReferenceBackend(None, ref_pool), TritonLinearBackend(dev_pool)
    slots, num_real = slots_for(B, num_slots, seed=B)
    x = inputs("short_conv", B, num_real, torch.bfloat16, torch.Generator().manual_seed(7 + B))
    out_ref = out_like("short_conv", B, torch.bfloat16, "cpu")
    call(ref, decode_ctx(slots, num_real, "cpu"), "short_conv", x, out_ref)
    out = out_like("short_conv", B, torch.bfloat16, DEV)
    call(tri, decode_ctx(slots, num_real, DEV), "short_conv", {"x": column_slice(x["x"].to(DEV))}, out)
    out = out.cpu()
    assert torch.isfinite(out).all() and out[num_real:].eq(0).all()
    assert rel_err(out[:num_real], out_ref[:num_real]) <= 1e-2
    touched = slots[:num_real]
    assert rel_err(dev_pool.layer(0)["conv"][touched].cpu(), ref_pool.layer(0)["conv"][touched]) <= 1e-4


# The extend conv's two layouts (kernels/linear.py ConvConfig.rows): the [token block, channels]
# tile, and row streaming (the backend's conv_extend_rows; conv_extend_rows_config's tile).
CONV_LAYOUTS = pytest.mark.parametrize("rows", [False, True], ids=["tile", "rows"])


@CONV_LAYOUTS
def test_conv_extend_kernel_reads_a_column_slice_of_a_stacked_projection(rows):
    result = check_conv_extend(3 * 32 * 128, CONV_K, torch.bfloat16, DEV, many=300, seed=5, sliced=True, rows=rows)
    assert conv_extend_ok(result, out_tol=1e-2), result


def decode_setup(bucket: int, num_slots: int, seed: int):
    """GDN and conv pools (reference and device, same random states), a Triton backend over each
    with its static slot buffer, and static bf16 inputs and outputs on the GPU: what a captured or
    eager decode gap launches on, step after step."""
    from runtime.backends.triton_linear import TritonLinearBackend

    ref_g, dev_g = pools("gdn_core", num_slots, seed=seed)
    ref_c, dev_c = pools("short_conv", num_slots, seed=seed + 1)
    tri_g, tri_c = TritonLinearBackend(dev_g), TritonLinearBackend(dev_c)
    for tri in (tri_g, tri_c):
        tri.init_capture_state(max_tokens=bucket, max_seqs=bucket)
    static = {op: {n: t.cuda() for n, t in inputs(op, bucket, bucket, torch.bfloat16,
                                                   torch.Generator().manual_seed(seed + 2)).items()}
              for op in ("gdn_core", "short_conv")}
    outs = {op: out_like(op, bucket, torch.bfloat16, "cuda") for op in static}
    return (ref_g, dev_g, tri_g), (ref_c, dev_c, tri_c), static, outs


def test_decode_graph_capture_and_replay():
    """Capture gdn_core + short_conv once, replay for two steps with other slots and inputs."""
    if DEV != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    bucket, num_slots = 8, 20
    # static inputs and outputs the graph reads and writes
    (ref_g, dev_g, tri_g), (ref_c, dev_c, tri_c), static, outs = decode_setup(bucket, num_slots, seed=5)
    dummy = decode_ctx([PADDING_SLOT] * bucket, 0, "cuda")  # capture from a padding-only step
    for tri in (tri_g, tri_c):
        tri.init_replay_state(dummy, bucket)
    for tri, op in ((tri_g, "gdn_core"), (tri_c, "short_conv")):  # compile outside capture
        call(tri, dummy, op, static[op], outs[op])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for tri, op in ((tri_g, "gdn_core"), (tri_c, "short_conv")):
            call(tri, dummy, op, static[op], outs[op])
    g = torch.Generator().manual_seed(9)
    for step in range(2):
        slots, num_real = slots_for(bucket, num_slots, seed=50 + step)
        ctx = decode_ctx(slots, num_real, "cuda")
        for tri in (tri_g, tri_c):
            tri.init_replay_state(ctx, bucket)
        x = {op: inputs(op, bucket, num_real, torch.bfloat16, g) for op in static}
        for op in static:
            for n, t in x[op].items():
                static[op][n].copy_(t)
            outs[op].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for op, ref_pool, dev_pool, entry in (("gdn_core", ref_g, dev_g, "recurrent"),
                                              ("short_conv", ref_c, dev_c, "conv")):
            ref = CPUReferenceBackend(None, ref_pool)
            out_ref = out_like(op, bucket, torch.bfloat16, "cpu")
            call(ref, decode_ctx(slots, num_real, "cpu"), op, x[op], out_ref)
            out = outs[op].cpu()
            assert out[num_real:].eq(0).all() and torch.isfinite(out).all()
            assert rel_err(out[:num_real], out_ref[:num_real]) <= 1e-2
            touched = slots[:num_real]
            assert rel_err(dev_pool.layer(0)[entry][touched], ref_pool.layer(0)[entry][touched]) <= 1e-4


def test_eager_decode_steps_on_static_buffers_relaunch_the_compiled_kernels():
    """An eager gap of piecewise steps: decode launches on the same buffers step after step go
    through the Launcher's compiled kernel (runtime/backends/kernels/launch_cache.py) after the first,
    and each step's outputs and states still match the reference (new inputs and slots each step)."""
    from runtime.backends.kernels import linear as triton_linear

    if DEV != "cuda":
        pytest.skip("the Launcher's fast path needs compiled kernels (the interpreter has none)")
    bucket, num_slots, steps = 8, 20, 3
    (ref_g, dev_g, tri_g), (ref_c, dev_c, tri_c), static, outs = decode_setup(bucket, num_slots, seed=15)
    launchers = (triton_linear._RECURRENT_DECODE, triton_linear._SHORT_CONV_DECODE)
    hits_before = [launcher.hits for launcher in launchers]
    g = torch.Generator().manual_seed(19)
    for step in range(steps):
        slots, num_real = slots_for(bucket, num_slots, seed=70 + step)
        ctx = decode_ctx(slots, num_real, "cuda")
        x = {op: inputs(op, bucket, num_real, torch.bfloat16, g) for op in static}
        for (tri, op) in ((tri_g, "gdn_core"), (tri_c, "short_conv")):
            tri.init_replay_state(ctx, bucket)  # the slots into the backend's static buffer
            for n, t in x[op].items():
                static[op][n].copy_(t)
            outs[op].fill_(float("nan"))
            call(tri, ctx, op, static[op], outs[op])
        torch.cuda.synchronize()
        for op, ref_pool, dev_pool, entry in (("gdn_core", ref_g, dev_g, "recurrent"),
                                              ("short_conv", ref_c, dev_c, "conv")):
            out_ref = out_like(op, bucket, torch.bfloat16, "cpu")
            call(CPUReferenceBackend(None, ref_pool), decode_ctx(slots, num_real, "cpu"), op, x[op], out_ref)
            out = outs[op].cpu()
            assert out[num_real:].eq(0).all() and torch.isfinite(out).all()
            assert rel_err(out[:num_real], out_ref[:num_real]) <= 1e-2, (op, step)
            touched = slots[:num_real]
            assert rel_err(dev_pool.layer(0)[entry][touched], ref_pool.layer(0)[entry][touched]) <= 1e-4, (op, step)
    # every step after the first at least (the first may meet an argument list an earlier test left)
    assert all(launcher.hits - before >= steps - 1 for launcher, before in zip(launchers, hits_before))


@pytest.mark.parametrize("op", list(SPECS))
def test_verify_launches_are_the_decode_launches_at_real_dims(op):
    """A target_verify step (3 requests x 4 tokens, padded to 4 requests) against 4 decode steps of
    the same tokens from the same states, both on the device in bf16. Outputs, the states after
    each token (the intermediate entries speculative decoding keeps) and the final states must
    agree to float32 rounding: the verify kernel computes each token as the decode kernel does. A
    fault in its row layout, in the state each token starts from or in the intermediate writes
    moves them by O(1)."""
    from runtime.backends.triton_linear import TritonLinearBackend

    n, bucket, num_real, num_slots = VERIFY["draft_tokens"] + 1, VERIFY["verify_rows"], 3, 6
    _, verify_pool = pools(op, num_slots, seed=41)
    _, decode_pool = pools(op, num_slots, seed=41)
    verifier, decoder = TritonLinearBackend(verify_pool), TritonLinearBackend(decode_pool)
    entry = "conv" if op == "short_conv" else "recurrent"
    slots = [5, 2, 4, PADDING_SLOT]
    before = verify_pool.layer(0)[entry].clone()
    x = {name: t.to(DEV) for name, t in inputs(op, bucket * n, num_real * n, torch.bfloat16,
                                                torch.Generator().manual_seed(42)).items()}
    out = out_like(op, bucket * n, torch.bfloat16, DEV)
    ctx = step_ctx(Mode.TARGET_VERIFY, [(s, 20 + 9 * i, n) for i, s in enumerate(slots[:num_real])], n, 1, DEV)
    verifier.init_step_metadata(ctx)
    call(verifier, ctx, op, x, out)
    kept = verify_pool.verify_buffers[0][entry]
    for t in range(n):
        step_out = out_like(op, bucket, torch.bfloat16, DEV)
        call(decoder, decode_ctx(slots, num_real, DEV), op, {name: v[t::n].contiguous() for name, v in x.items()},
             step_out)  # row b: token t of request b, as the verify step's launch t reads it
        got, want = out[t::n][:num_real], step_out[:num_real]
        assert torch.isfinite(got).all() and rel_err(got.float(), want.float()) <= 1e-3, f"token {t}: outputs"
        state = decode_pool.layer(0)[entry][slots[:num_real]]
        if t < n - 1:
            assert rel_err(kept[:num_real, t], state) <= 1e-6, f"the state after token {t}, kept for its rows"
    assert out[num_real * n:].eq(0).all(), "padding rows must be zero"
    assert rel_err(verify_pool.layer(0)[entry][slots[:num_real]], decode_pool.layer(0)[entry][slots[:num_real]]) <= 1e-6
    untouched = [s for s in range(num_slots + 1) if s not in slots[:num_real]]
    assert torch.equal(verify_pool.layer(0)[entry][untouched], before[untouched]), "padding slot or a free slot written"


def test_short_conv_verify_reads_a_column_slice_of_a_stacked_projection():
    """The target_verify conv reading its input as the q|k|v columns of a wider projection output
    (Qwen3-Next's and Qwen3.5's GDN, Kimi's KDA): the same bits as the same step on a contiguous
    copy, outputs, kept histories and final histories alike."""
    from runtime.backends.triton_linear import TritonLinearBackend

    n, bucket, num_real, num_slots = VERIFY["draft_tokens"] + 1, VERIFY["verify_rows"], 3, 6
    slots = [5, 2, 4, PADDING_SLOT]
    x = inputs("short_conv", bucket * n, num_real * n, torch.bfloat16, torch.Generator().manual_seed(43))["x"].to(DEV)
    results = []
    for fed in (x, column_slice(x)):
        _, pool = pools("short_conv", num_slots, seed=44)
        backend = TritonLinearBackend(pool)
        ctx = step_ctx(Mode.TARGET_VERIFY, [(s, 20 + 9 * i, n) for i, s in enumerate(slots[:num_real])], n, 1, DEV)
        backend.init_step_metadata(ctx)
        out = out_like("short_conv", bucket * n, torch.bfloat16, DEV)
        call(backend, ctx, "short_conv", {"x": fed}, out)
        results.append((out.cpu(), pool.layer(0)["conv"].cpu(), pool.verify_buffers[0]["conv"][:num_real].cpu()))
    for name, contiguous, sliced in zip(("outputs", "histories", "kept histories"), *results):
        assert torch.equal(contiguous, sliced), name


@CONV_LAYOUTS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("channels", [CONV_C, 3 * 32 * 128], ids=["qwen3_next", "kimi_linear"])
def test_conv_extend_kernel_at_real_dims(channels, dtype, rows):
    """The Triton extend conv against the reference: requests of 1, 2, 3, 4 and 1000 tokens (and one
    of none) in one step, then fewer than K-1 tokens on the same slots; padding rows zero, the
    padding slot, free slots and the token-less request's slot bit for bit as before."""
    if dtype == torch.float32 and channels != CONV_C:
        pytest.skip("float32 inputs are checked at Qwen3-Next's width only")
    result = check_conv_extend(channels, CONV_K, dtype, DEV, many=1000, seed=channels, rows=rows)
    assert conv_extend_ok(result, out_tol=1e-2 if dtype == torch.bfloat16 else 1e-6), result


def test_conv_extend_rows_equal_the_tile_bit_for_bit_at_real_dims():
    """Row streaming adds the taps in the tile kernel's order in float32 (and the compiler contracts
    them alike): outputs, new histories and snapshots as the tile kernel's, bit for bit, at C 8192,
    K 4, for the row-streaming tiles of 1024 (conv_extend_rows_config's), 512 and 256 channels."""
    from runtime.backends.kernels import linear as TL

    want = conv_extend_launch(TL.ConvConfig(128, 4), CONV_K, CONV_C, DEV)
    for config in (TL.ConvConfig(1024, 4, rows=True), TL.ConvConfig(512, 2, rows=True),
                   TL.ConvConfig(256, 1, rows=True)):
        got = conv_extend_launch(config, CONV_K, CONV_C, DEV)
        for name, a, b in zip(("outputs", "histories", "snapshots"), got, want):
            assert torch.equal(a, b), (config, name, rel_err(a, b))


# -- extend / mixed / target-verify (FLA chunk kernels, the extend conv, the verify kernels) ----


def _stub_einops() -> None:
    """fla-core imports einops for naive references the backend never calls; the GPU machine may lack it."""
    import sys
    import types
    try:
        __import__("einops")
    except ImportError:
        stub = types.ModuleType("einops")
        stub.rearrange = stub.repeat = stub.reduce = stub.einsum = lambda *a, **k: (_ for _ in ()).throw(
            NotImplementedError("einops stub"))
        sys.modules["einops"] = stub


EXTEND_STEPS = [  # slot 1 starts empty; step 2 continues its prompt next to decode rows and a new request
    (Mode.EXTEND, [(1, 0, 150), (2, 30, 67)], 5, 1),
    (Mode.MIXED, [(1, 150, 80), (2, 97, 1), (3, 0, 20), (4, 9, 1)], 3, 2),
    (Mode.TARGET_VERIFY, [(1, 230, 3), (3, 20, 3)], 3, 1),
    (Mode.TARGET_VERIFY, [(2, 98, 2), (4, 10, 4)], 0, 0),
]


EXTEND_PATHS = {  # the backend's extend paths for the recurrent cores: its constructor's arguments
    "fla": dict(short_extend_tokens=0),
    "recurrent_extend": dict(short_extend_tokens=256),
    "triton_chunk": dict(short_extend_tokens=0, chunk_impl="triton"),
}


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"], ids=["state_f32", "state_bf16"])
@pytest.mark.parametrize("path", list(EXTEND_PATHS))
@pytest.mark.parametrize("op", list(SPECS))
def test_extend_mixed_verify_steps_match_reference_at_real_dims(op, path, state_dtype):
    """The step chain through FLA's chunk kernels, again with every eager step's requests short
    enough for the recurrent extend kernel (triton_linear.recurrent_extend), and again through our
    chunk kernels (triton_chunk.chunk_extend, GDN and Lightning); over float32 and bfloat16 states."""
    from runtime.backends.triton_linear import TritonLinearBackend

    if state_dtype == "bfloat16" and op == "short_conv":
        pytest.skip("bfloat16 states are the recurrent cores'")
    if DEV != "cuda" and path != "triton_chunk":
        pytest.skip("the FLA chunk kernels need CUDA")
    if path != "fla" and op == "short_conv":
        pytest.skip("the short conv has one extend kernel")
    if path == "triton_chunk" and op == "kda_core":
        pytest.skip("KDA's per-channel gates keep FLA's chunk kernels")
    _stub_einops()
    num_slots = 6
    ref_pool, dev_pool = pools(op, num_slots, seed=31, state_dtype=state_dtype)
    entry = "conv" if op == "short_conv" else "recurrent"
    for pool in (ref_pool, dev_pool):
        pool.layer(0)[entry][1].zero_()
    before = dev_pool.layer(0)[entry].clone()
    ref = CPUReferenceBackend(None, ref_pool)
    tri = TritonLinearBackend(dev_pool, **EXTEND_PATHS[path])
    g = torch.Generator().manual_seed(32)
    touched = set()
    for mode, reqs, pad_t, pad_s in EXTEND_STEPS:
        ctx = step_ctx(mode, reqs, pad_t, pad_s, DEV)
        tri.init_step_metadata(ctx)
        if mode in (Mode.EXTEND, Mode.MIXED):
            tri.init_chunk_metadata(ctx, 256)
        R, T = ctx.num_real_tokens, ctx.num_tokens
        x = inputs(op, T, R, torch.bfloat16, g)
        if "g" in x:
            x["g"] = x["g"].float()  # the models pass float32 log-decays
        out_ref = out_like(op, T, torch.float32, "cpu")
        call(ref, step_ctx(mode, reqs, pad_t, pad_s, "cpu"), op, x, out_ref)  # float32 math on the same values
        out = out_like(op, T, torch.bfloat16, DEV)
        call(tri, ctx, op, {n: t.to(DEV) for n, t in x.items()}, out)
        out = out.float().cpu()
        assert torch.isfinite(out).all() and out[R:].eq(0).all(), f"{mode.value}: unwritten or non-zero padding rows"
        assert rel_err(out[:R], out_ref[:R]) <= 1e-2, f"{mode.value} {reqs}"
        touched |= {s for s, *_ in reqs}
        t = sorted(touched)
        assert rel_err(dev_pool.layer(0)[entry][t], ref_pool.layer(0)[entry][t]) <= 1e-2, f"{mode.value} state"
    untouched = [s for s in range(num_slots + 1) if s not in touched]
    assert torch.equal(dev_pool.layer(0)[entry][untouched], before[untouched]), "padding slot or a free slot written"


EXTEND_BUCKET = (512, 4)  # rows and requests of the captured extend graph below
REPLAYED_STEPS = [  # replayed in it: slots 1 and 3 start empty; decode rows beside prompt chunks
    (Mode.EXTEND, [(1, 0, 150), (2, 30, 67)]),
    (Mode.MIXED, [(1, 150, 80), (2, 97, 1), (3, 0, 300), (4, 9, 1)]),
]


@pytest.mark.parametrize("op,options", [("gdn_core", {}), ("lightning_core", {}), ("short_conv", {}),
                                        ("kda_core", {"kda_graph": "on"})], ids=["gdn", "lightning", "conv", "kda_graph"])
def test_extend_graph_capture_and_replay(op, options):
    """An extend step captured once in a CUDA graph (our chunk kernels, the extend conv; KDA under
    kda_graph=on, FLA's chunk_kda in its graph form) from a placeholder step on the padding slot,
    then replayed for an extend and a mixed step of other lengths, slots and request counts through
    the static plan: outputs and states against the reference, padding rows zero, the padding slot
    and free slots untouched (the placeholder step's warm-up and capture included)."""
    from runtime.backends.triton_linear import TritonLinearBackend

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    T, B = EXTEND_BUCKET
    ref_pool, dev_pool = pools(op, 6, seed=41)
    entry = "conv" if op == "short_conv" else "recurrent"
    for pool in (ref_pool, dev_pool):
        pool.layer(0)[entry][[1, 3]] = 0  # new requests start from the empty state
    before = dev_pool.layer(0)[entry].clone()
    tri = TritonLinearBackend(dev_pool, chunk_impl="triton", **options)
    tri.init_capture_state(max_tokens=T, max_seqs=B)
    g = torch.Generator().manual_seed(42)

    def step_inputs(real: int) -> dict:
        x = inputs(op, T, real, torch.bfloat16, g)
        if "g" in x:
            x["g"] = x["g"].float()  # the models pass float32 log-decays
        return x

    def plan(ctx) -> None:  # what the graph runner does before a piecewise step
        tri.init_step_metadata(ctx)
        tri.init_chunk_metadata(ctx, T)
        tri.init_replay_state(ctx, B)

    static = {n: t.to(DEV) for n, t in step_inputs(T).items()}
    out = out_like(op, T, torch.bfloat16, DEV)
    placeholder = step_ctx(Mode.EXTEND, [(PADDING_SLOT, 0, T // B)] * B, 0, 0, DEV)
    plan(placeholder)
    call(tri, placeholder, op, static, out)  # warm-up outside the graph: compiles, workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(tri, placeholder, op, static, out)
    torch.cuda.synchronize()
    assert torch.equal(dev_pool.layer(0)[entry], before), "the placeholder step wrote a slot"
    ref = CPUReferenceBackend(None, ref_pool)
    touched = set()
    for mode, reqs in REPLAYED_STEPS:
        real = sum(n for *_, n in reqs)
        plan(step_ctx(mode, reqs, T - real, B - len(reqs), DEV))
        x = step_inputs(real)
        for n, t in x.items():
            static[n].copy_(t)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        out_ref = out_like(op, T, torch.float32, "cpu")
        call(ref, step_ctx(mode, reqs, T - real, B - len(reqs), "cpu"), op, x, out_ref)
        got = out.float().cpu()
        assert torch.isfinite(got).all() and got[real:].eq(0).all(), f"{mode.value}: unwritten or non-zero padding rows"
        assert rel_err(got[:real], out_ref[:real]) <= 1e-2, f"{mode.value} {reqs}"
        touched |= {slot for slot, *_ in reqs}
        rows = sorted(touched)
        assert rel_err(dev_pool.layer(0)[entry][rows].cpu(), ref_pool.layer(0)[entry][rows]) <= 1e-2, f"{mode.value} state"
    untouched = [s for s in range(7) if s not in touched]
    assert torch.equal(dev_pool.layer(0)[entry][untouched], before[untouched]), "padding slot or a free slot written"


SHORT_BUCKET = (64, 4)  # a bucket of at most short_extend_tokens rows: the recurrent kernel's graph
SHORT_REPLAYED_STEPS = [  # replayed in it: slots 1 and 3 start empty; decode rows beside prompt chunks
    (Mode.EXTEND, [(1, 0, 20), (2, 30, 17)]),
    (Mode.MIXED, [(1, 20, 5), (2, 47, 1), (3, 0, 30), (4, 9, 1)]),
    (Mode.EXTEND, [(3, 30, 64)]),
]


@pytest.mark.parametrize("op,chunk_impl", [("kda_core", "triton"), ("gdn_core", "fla")])
def test_short_extend_graph_capture_and_replay(op, chunk_impl):
    """The cores no chunk kernel of ours captures (KDA; GDN under chunk_impl=fla), captured in an
    extend bucket of at most short_extend_tokens rows: the recurrent extend kernel over the static
    plan, captured once from a placeholder step on the padding slot as a whole-step graph records it
    (init_replay_state alone, no eager plan), then replayed for steps of other lengths, slots and
    request counts: outputs and states against the reference, padding rows zero, the padding slot
    and free slots untouched."""
    from runtime.backends.triton_linear import TritonLinearBackend

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a CUDA device")
    T, B = SHORT_BUCKET
    ref_pool, dev_pool = pools(op, 6, seed=43)
    for pool in (ref_pool, dev_pool):
        pool.layer(0)["recurrent"][[1, 3]] = 0  # new requests start from the empty state
    before = dev_pool.layer(0)["recurrent"].clone()
    tri = TritonLinearBackend(dev_pool, short_extend_tokens=T, chunk_impl=chunk_impl)
    tri.init_capture_state(max_tokens=T, max_seqs=B)
    g = torch.Generator().manual_seed(44)

    def step_inputs(real: int) -> dict:
        x = inputs(op, T, real, torch.bfloat16, g)
        x["g"] = x["g"].float()  # the models pass float32 log-decays
        return x

    static = {n: t.to(DEV) for n, t in step_inputs(T).items()}
    out = out_like(op, T, torch.bfloat16, DEV)
    placeholder = step_ctx(Mode.EXTEND, [(PADDING_SLOT, 0, T // B)] * B, 0, 0, DEV)
    tri.init_replay_state(placeholder, B)
    call(tri, placeholder, op, static, out)  # warm-up outside the graph: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tri.init_replay_state(placeholder, B)  # the tables made inside the graph, as a whole-step graph does
        call(tri, placeholder, op, static, out)
    torch.cuda.synchronize()
    assert torch.equal(dev_pool.layer(0)["recurrent"], before), "the placeholder step wrote a slot"
    ref = CPUReferenceBackend(None, ref_pool)
    touched = set()
    for mode, reqs in SHORT_REPLAYED_STEPS:
        real = sum(n for *_, n in reqs)
        ctx = step_ctx(mode, reqs, T - real, B - len(reqs), DEV)
        placeholder.query_start_loc.copy_(ctx.query_start_loc)  # the staging the graph reads
        placeholder.state_slots.copy_(ctx.state_slots)
        x = step_inputs(real)
        for n, t in x.items():
            static[n].copy_(t)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        out_ref = out_like(op, T, torch.float32, "cpu")
        call(ref, step_ctx(mode, reqs, T - real, B - len(reqs), "cpu"), op, x, out_ref)
        got = out.float().cpu()
        assert torch.isfinite(got).all() and got[real:].eq(0).all(), f"{mode.value}: unwritten or non-zero padding rows"
        assert rel_err(got[:real], out_ref[:real]) <= 1e-2, f"{mode.value} {reqs}"
        touched |= {slot for slot, *_ in reqs}
        rows = sorted(touched)
        assert rel_err(dev_pool.layer(0)["recurrent"][rows].cpu(), ref_pool.layer(0)["recurrent"][rows]) <= 1e-2
    untouched = [s for s in range(7) if s not in touched]
    assert torch.equal(dev_pool.layer(0)["recurrent"][untouched], before[untouched]), "padding slot or a free slot written"


# -- our chunk kernels alone (triton_chunk.chunk_extend) ---------------------------------------------

CHUNK_LENS = [0, 1, 100, 64, 300, 1000]  # none, one row, partial, one whole chunk, several, many


def chunk_case(op: str, dtype, seed: int, dims=None, lens=CHUNK_LENS):
    """One chunk_extend launch's inputs (at real dims, or `dims` (Hk, Hv, Dk, Dv)): the requests of
    `lens` one after another then 5 NaN rows past bounds[R]; slots out of row order in a pool of
    random states; the tables."""
    import numpy as np
    from runtime.backends.kernels.launch_math import token_blocks

    T, R = sum(lens) + 5, len(lens)
    g = torch.Generator().manual_seed(seed)
    x = inputs(op, T, sum(lens), dtype, g, dims)
    if op == "lightning_core":
        x["g"] = const("decay", "cpu", torch.float32)
    else:
        x["g"] = x["g"].float()  # the models pass float32 log-decays
    ref_pool, dev_pool = pools(op, R + 3, seed=seed, dims=dims)
    slots = (torch.randperm(R + 3, generator=g) + 1)[:R].tolist()
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tables = dict(slots=torch.tensor(slots, device=DEV), bounds=torch.from_numpy(cu).to(DEV),
                  chunks=torch.from_numpy(token_blocks(np.array(lens), 64)).to(DEV))
    return x, ref_pool, dev_pool, slots, tables


def chunk_reference(op: str, x: dict, pool, slots, dims=None, lens=CHUNK_LENS) -> torch.Tensor:
    """gated_recurrence per request on the reference pool (in place); the outputs [rows, Hv, Dv]."""
    from runtime.backends.cpu_reference import gated_recurrence

    hk, hv, dk, dv = dims or SPECS[op][1:]
    out, at = torch.zeros(sum(lens), hv, dv), 0
    for n, slot in zip(lens, slots):
        rows = slice(at, at + n)
        q, k = (x[name][rows].float().repeat_interleave(hv // hk, dim=1) for name in ("q", "k"))
        gate = x["g"].expand(n, hv) if op == "lightning_core" else x["g"][rows]
        beta = x["beta"][rows] if "beta" in x else None  # Lightning: no delta rule
        out[rows] = gated_recurrence(q, k, x["v"][rows].float(), gate[..., None], beta,
                                     pool.layer(0)["recurrent"][slot], dk ** -0.5)
        at += n
    return out


def run_chunk_extend(op: str, x: dict, pool, tables: dict, out: torch.Tensor, config=None) -> None:
    from runtime.backends.kernels import chunk as triton_chunk
    from runtime.backends.kernels.linear import GATE_CONSTANT, GATE_PER_HEAD

    dk = x["q"].shape[-1]
    d = {n: t.to(DEV) for n, t in x.items()}
    triton_chunk.chunk_extend(d["q"], d["k"], d["v"], d["g"], d.get("beta"), out, pool.layer(0)["recurrent"],
                              tables["slots"], tables["bounds"], tables["chunks"], dk ** -0.5,
                              GATE_CONSTANT if op == "lightning_core" else GATE_PER_HEAD, config=config)


def check_chunk_extend(op: str, dtype, solve_in_registers: bool, dims=None, lens=CHUNK_LENS,
                       single_chunk: bool = False) -> None:
    """One chunk_extend launch against the recurrence: outputs and states per request, the padding
    slot, free slots, an idle request's slot and the rows past the last request untouched.
    single_chunk: chunk_config's tiles of a step of at most 64 rows."""
    import dataclasses

    from runtime.backends.kernels import chunk as triton_chunk

    hk, hv, dk, dv = dims or SPECS[op][1:]
    x, ref_pool, dev_pool, slots, tables = chunk_case(op, dtype, seed=81, dims=dims, lens=lens)
    config = dataclasses.replace(triton_chunk.chunk_config(len(lens), hv, dv, torch.device(DEV), single_chunk),
                                 solve_in_registers=solve_in_registers)
    before = dev_pool.layer(0)["recurrent"].clone()
    out_ref = chunk_reference(op, x, ref_pool, slots, dims, lens)
    T, real = x["q"].shape[0], sum(lens)
    out = torch.full((T, hv, dv), 7.0, dtype=dtype, device=DEV)
    run_chunk_extend(op, x, dev_pool, tables, out, config)
    out = out.float().cpu()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-3
    assert torch.isfinite(out).all() and out[real:].eq(7.0).all(), "rows past bounds[R] must not be written"
    at = 0
    for n, slot in zip(lens, slots):
        if n:
            err = rel_err(out[at:at + n], out_ref[at:at + n])
            assert err <= tol, f"{op} {dtype} {dims}: request of {n} rows, out rel err {err:.2e}"
        s_err = rel_err(dev_pool.layer(0)["recurrent"][slot].cpu(), ref_pool.layer(0)["recurrent"][slot])
        assert s_err <= tol, f"{op} {dtype} {dims}: request of {n} rows, state rel err {s_err:.2e}"
        at += n
    untouched = [s for s in range(len(slots) + 4) if s not in slots] + [slots[i] for i, n in enumerate(lens) if not n]
    assert torch.equal(dev_pool.layer(0)["recurrent"][untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("op,solve_in_registers", [("gdn_core", True), ("gdn_core", False), ("lightning_core", True)],
                         ids=["gdn", "gdn-scratch-solve", "lightning"])
def test_chunk_extend_kernels_match_reference_at_real_dims(op, solve_in_registers, dtype):
    """Requests of 0, 1, 100, 64, 300 and 1000 rows in one launch (chunks of 64, Dk = Dv = 128,
    Qwen3-Next's grouped heads for GDN). GDN's solve both in registers (the default) and through
    the matrix workspace."""
    check_chunk_extend(op, dtype, solve_in_registers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("solve_in_registers", [True, False], ids=["registers", "scratch"])
@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (2, 4, 32, 32), (4, 8, 64, 64)], ids=["d16", "d32", "d64"])
def test_chunk_extend_kernels_match_reference_at_small_head_dims(dims, solve_in_registers, dtype):
    """The small models of the tests (head dims 16 to 64, grouped heads): three short requests in
    one launch, as a prompt batch of the graph tests brings, then one of several chunks."""
    check_chunk_extend("gdn_core", dtype, solve_in_registers, dims, lens=[10, 7, 13, 300])


# Steps of at most 64 rows (5 NaN rows past the requests included) chunk by their rows
# (chunk.chunk_length): rows -> the requests' lengths
SHORT_CHUNK_STEPS = {16: [4, 7], 32: [1, 20, 3], 64: [40, 10]}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("op", ["gdn_core", "lightning_core"])
@pytest.mark.parametrize("rows", sorted(SHORT_CHUNK_STEPS))
def test_short_steps_take_chunks_of_their_rows_at_real_dims(rows, op, dtype):
    """A step of 16, 32 or 64 rows: chunks of that many rows with the tiles chunk_extend takes for
    it (16 and 32: the single-chunk tiles, Dv tiles of 32 and the solve's W and U columns split over
    two programs; 64: the long steps'), at bench dims."""
    from runtime.backends.kernels import chunk as triton_chunk

    step_rows = sum(SHORT_CHUNK_STEPS[rows]) + 5
    assert triton_chunk.chunk_length(step_rows) == rows
    check_chunk_extend(op, dtype, True, lens=SHORT_CHUNK_STEPS[rows],
                       single_chunk=triton_chunk.takes_short_tiles(step_rows))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [16, 32])
@pytest.mark.parametrize("dims", [(2, 4, 16, 16), (2, 4, 32, 32), (4, 8, 64, 64)], ids=["d16", "d32", "d64"])
def test_short_chunks_at_small_head_dims(dims, rows, dtype):
    """Chunks of 16 and 32 rows at the tests' small head dims, where 16-bit products with 16-wide
    tiles went wrong before (chunk.SOLVE_MIN_TILE): the solve's [16, 16] and [32, 32] T products."""
    check_chunk_extend("gdn_core", dtype, True, dims, lens=SHORT_CHUNK_STEPS[rows], single_chunk=True)


# (rows, requests) of a captured chunk step -> real rows -> the requests' lengths replayed in it
CAPTURED_CHUNK_BUCKETS = {
    (512, 4): {0: [], 1: [1], 64: [64], 65: [40, 25], 512: [300, 100, 100, 12]},
    (32, 32): {0: [], 1: [1], 20: [1, 16, 3], 32: [32], 31: [1] * 31},
    (16, 16): {0: [], 16: [5, 11], 15: [15]},
    # a served artifact's layout (256 request rows): the kernels walk the table (chunk._table_programs)
    (512, 256): {0: [], 300: [300], 511: [256] + [1] * 255, 64: [64]},
}


@pytest.mark.parametrize("bucket", list(CAPTURED_CHUNK_BUCKETS), ids=lambda b: f"{b[0]}x{b[1]}")
@pytest.mark.parametrize("op", ["gdn_core", "lightning_core"])
def test_a_captured_chunk_step_writes_zeros_over_its_padding_rows(op, bucket):
    """chunk_extend over tables padded to a bucket (512 rows and 4 requests, or 256 as a served
    artifact's, whose grids walk the table; the short buckets of 32 and 16 rows, one request row a
    row, in chunks of their rows), the padding rows the tables'
    last request (testkit.linear_cases.captured_chunk_tables, the backend's 64-row table), bf16 at
    bench dims, the backend's graph tiles and workspaces. On a GPU the launches are captured once
    in a CUDA graph from the step without real rows and replayed with steps of other real rows,
    the tables and inputs refilled in place and the output filled with NaN before each replay: real
    rows as the recurrence's, padding rows exactly zero, the states as the recurrence leaves them,
    the padding slot and free slots untouched."""
    from runtime.backends.kernels import chunk as triton_chunk
    from runtime.backends.kernels.linear import GATE_CONSTANT, GATE_PER_HEAD
    from testkit.linear_cases import captured_chunk_tables

    T, B = bucket
    _, hk, hv, dk, dv = SPECS[op]
    lightning = op == "lightning_core"
    num_slots = 12 + sum(len(lens) for lens in CAPTURED_CHUNK_BUCKETS[bucket].values())
    ref_pool, dev_pool = pools(op, num_slots, seed=83)
    state, before = dev_pool.layer(0)["recurrent"], dev_pool.layer(0)["recurrent"].clone()
    g = torch.Generator().manual_seed(84)

    def step(lens: list[int], slots: list[int]) -> tuple[dict, tuple]:
        x = inputs(op, T, sum(lens), torch.bfloat16, g)
        x["g"] = const("decay", "cpu", torch.float32) if lightning else x["g"].float()
        return x, captured_chunk_tables(lens, slots, T, B, 64, DEV)

    static_x, static_tables = step([], [])
    static_x = {n: t.to(DEV) for n, t in static_x.items()}
    out = out_like(op, T, torch.bfloat16, DEV)
    workspaces = triton_chunk.ChunkWorkspaces.allocate(T, static_tables[2].shape[0], hv, dk, dv, torch.bfloat16,
                                                       not lightning, torch.device(DEV))

    # the backend's graph tiles (triton_linear._graph_chunk_config): one request's, for the bucket's rows
    config = triton_chunk.chunk_config(1, hv, dv, torch.device(DEV), T <= triton_chunk.CHUNK_T)

    def launch() -> None:
        x = static_x
        triton_chunk.chunk_extend(x["q"], x["k"], x["v"], x["g"], x.get("beta"), out, state, *static_tables,
                                  dk ** -0.5, GATE_CONSTANT if lightning else GATE_PER_HEAD,
                                  config=config, workspaces=workspaces)

    replay = launch
    if DEV == "cuda":
        launch()  # warm-up outside the graph: compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        replay = graph.replay
    touched, at = set(), 0
    perm = (torch.randperm(num_slots, generator=g) + 1).tolist()
    for real, lens in CAPTURED_CHUNK_BUCKETS[bucket].items():
        slots, at = perm[at:at + len(lens)], at + len(lens)
        x, tables = step(lens, slots)
        for n, t in x.items():
            static_x[n].copy_(t)
        for static, t in zip(static_tables, tables):
            static.copy_(t)
        out.fill_(float("nan"))
        replay()
        got = out.float().cpu()
        assert torch.equal(got[real:], torch.zeros_like(got[real:])), f"{real} real rows: padding rows not zero"
        if real:
            want = chunk_reference(op, x, ref_pool, slots, lens=lens)
            err = rel_err(got[:real], want)
            assert err <= 1e-2, f"{op}, {real} real rows {lens}: out rel err {err:.2e}"
        touched |= set(slots)
        rows = sorted(touched)
        s_err = rel_err(state[rows].cpu(), ref_pool.layer(0)["recurrent"][rows])
        assert s_err <= 1e-2, f"{op}, {real} real rows: state rel err {s_err:.2e}"
    untouched = [s for s in range(num_slots + 1) if s not in touched]
    assert PADDING_SLOT in untouched
    assert torch.equal(state[untouched], before[untouched]), "the padding slot or a free slot was written"


def test_chunk_extend_relaunches_through_the_launcher_cache():
    """A second call with the same arguments (the same step on the same buffers and workspaces) takes
    the Launcher's compiled kernels, all three of them (solve, state, output)."""
    from runtime.backends.kernels import chunk as triton_chunk

    if DEV != "cuda":
        pytest.skip("the Launcher's fast path needs compiled kernels (the interpreter has none)")
    x, _, dev_pool, _, tables = chunk_case("gdn_core", torch.bfloat16, seed=82)
    x = {n: t.to(DEV) for n, t in x.items()}
    out = torch.empty(x["q"].shape[0], 32, 128, dtype=torch.bfloat16, device=DEV)
    launchers = (triton_chunk._CHUNK_SOLVE, triton_chunk._CHUNK_STATE, triton_chunk._CHUNK_OUTPUT)
    run_chunk_extend("gdn_core", x, dev_pool, tables, out)
    hits = [launcher.hits for launcher in launchers]
    run_chunk_extend("gdn_core", x, dev_pool, tables, out)
    torch.cuda.synchronize()
    assert [launcher.hits - h for launcher, h in zip(launchers, hits)] == [1, 1, 1]
