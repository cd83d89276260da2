"""The Triton kernels (runtime/backends/kernels/linear.py) against the CPU reference backend.

On a machine without CUDA the kernels run in Triton's interpreter (numpy on the CPU): these are
CPU tests of the kernel logic (indexing, masks, padding, the in-place update), not of speed.
Dimensions stay small so the interpreter is quick. Extend, mixed and target-verify steps are
checked here too: the short conv's extend path is its own Triton kernel (also checked alone over
the request lengths that matter to it), target_verify runs the verify kernels (bit for bit what n
decode launches compute),
and the FLA chunk calls are stood in for by the reference recurrence (`FakeFLA`), which checks
the arguments the backend passes (gather, cu_seqlens, chunk indices, scatter). A last group
counts the host work of every op call after the step's hooks: none may scale with the step.
(The interpreter truncates float32 to bfloat16 where a GPU rounds to nearest, so interpreted bf16
outputs sit up to one bf16 step from the reference.) Every check draws fresh random inputs, starts
from a non-zero state, poisons the outputs, and compares outputs and updated states by
||x - ref|| / ||ref|| over several consecutive decode steps. The GPU versions at real dims are in
tests/gpu/test_gpu_linear_kernels.py (marked gpu).

The interpreter must be switched on before triton is first imported (testkit/triton_interpreter.py);
in a whole-suite run where another module imported triton compiled first, its tests are skipped
here and `test_in_a_fresh_interpreter_process` runs this file in a new process instead.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, INTERPRETED, interpreter_or_fresh_process  # noqa: E402,F401

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")


from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, Mode, TensorSpec  # noqa: E402
from runtime.backends.kernels import linear as TL  # noqa: E402
from runtime.backends.cpu_reference import CPUReferenceBackend, gated_recurrence  # noqa: E402
from runtime.backends.protocol import check_backend, plan_eager_step  # noqa: E402
from runtime.backends.triton_linear import (FLANotInstalled, TritonLinearBackend,  # noqa: E402
                                                    WrongModeError)
from runtime.cache.batch import SeqState, build_step  # noqa: E402
from runtime.cache.kv_pool import KVPool  # noqa: E402
from runtime.cache.state_pool import PADDING_SLOT, StatePool  # noqa: E402
from testkit.linear_cases import (FakeFLA, FakeFlashInferGdn, check_conv_extend, conv_extend_launch, conv_extend_ok,  # noqa: E402
                                  laid_out, random_inputs, rel_err)

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

D, C, KW = 16, 24, 4  # head dim, conv channels (not a power of two: masked tail), conv width
NUM_SLOTS = 10

# Layer id -> (kind, Hk, Hv, Dk, Dv). Two GDN layers: grouped value heads and Hk == Hv.
LAYERS = {
    0: ("gdn", 2, 4, D, D),
    1: ("gdn", 4, 4, D, D),
    2: ("kda", 4, 4, D, D),
    3: ("lightning", 4, 4, D, D),
    4: ("gdn", 2, 4, 12, 20),  # dims that are no power of two: masked key and value tails
}
REGISTRY = LayerRegistry([
    LayerSpec(lid, LayerKind(kind), state={"recurrent": TensorSpec((hv, dk, dv), "float32"),
                                           "conv": TensorSpec((C, KW - 1), "float32")})
    for lid, (kind, hk, hv, dk, dv) in LAYERS.items()
])
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
# Float32 states on both sides, computed from the same (rounded) inputs; bfloat16 states (--state-dtype)
# are rounded after each step on both sides, so an element may sit one bfloat16 step apart.
STATE_TOL = {"float32": 1e-4, "bfloat16": 1e-2}



VERIFY = dict(draft_tokens=3, verify_rows=4)  # target_verify steps of up to 4 requests x 4 tokens


def make_pools(seed: int, state_dtype: str = "float32") -> tuple[StatePool, StatePool]:
    """Two pools with the same random non-zero states: one for the reference, one for the kernels;
    recurrent states in `state_dtype`."""
    registry = REGISTRY.with_state_dtype(state_dtype)
    ref = StatePool(registry, NUM_SLOTS, **VERIFY)
    g = torch.Generator().manual_seed(seed)
    for entries in ref.buffers.values():
        for t in entries.values():
            t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    dev = StatePool(registry, NUM_SLOTS, DEVICE, **VERIFY)
    for lid, entries in ref.buffers.items():
        for name, t in entries.items():
            dev.buffers[lid][name].copy_(t)
    return ref, dev


def decode_step(slots: list[int], num_real: int):
    """A decode step as the runtime builds it: num_real requests, padded to len(slots) rows."""
    kv = KVPool(REGISTRY, 64, 16)
    items = [(SeqState(slot, num_cached=3), [0]) for slot in slots[:num_real]]
    step = build_step(items, kv, mode=Mode.DECODE, pad_tokens_to=len(slots), pad_seqs_to=len(slots))
    assert step.ctx.state_slots[num_real:].eq(PADDING_SLOT).all()
    return step.ctx


def step_inputs(op: str, layer_id: int, B: int, num_real: int, dtype: torch.dtype, g: torch.Generator):
    """Fresh random inputs of one step; padding rows hold NaN (they must never matter)."""
    _, hk, hv, dk, dv = LAYERS[layer_id]
    return random_inputs(op, B, num_real, (hk, hv, dk, dv), C, dtype, g, k_scale=0.3)


CONV_WEIGHT = torch.randn(C, KW, generator=torch.Generator().manual_seed(7))
CONV_BIAS = torch.randn(C, generator=torch.Generator().manual_seed(8))
DECAY = -torch.linspace(0.05, 1.0, 4)  # Lightning log-decay per head


def run_op(backend, ctx, op: str, layer_id: int, x: dict, out_dtype: torch.dtype, device: str,
           conv_bias=True, silu=True) -> torch.Tensor:
    """Call `op` on `backend` with inputs moved to `device`; returns the out tensor (poisoned first)."""
    x = {name: t.to(device) for name, t in x.items()}
    B = next(iter(x.values())).shape[0]
    kind, hk, hv, dk, dv = LAYERS[layer_id]
    if op == "short_conv":
        out = torch.full((B, C), float("nan"), dtype=out_dtype, device=device)
        w = CONV_WEIGHT.to(device=device, dtype=x["x"].dtype)
        bias = CONV_BIAS.to(device=device, dtype=x["x"].dtype) if conv_bias else None
        backend.short_conv(ctx, x["x"], w, bias, out, layer_id, silu)
        return out
    out = torch.full((B, hv, dv), float("nan"), dtype=out_dtype, device=device)
    scale = dk ** -0.5
    if op == "gdn_core":
        backend.gdn_core(ctx, x["q"], x["k"], x["v"], x["g"], x["beta"], out, layer_id, scale)
    elif op == "kda_core":
        backend.kda_core(ctx, x["q"], x["k"], x["v"], x["g"], x["beta"], out, layer_id, scale)
    else:
        backend.lightning_core(ctx, x["q"], x["k"], x["v"], DECAY.to(device), out, layer_id, scale)
    return out


def compare_steps(op: str, layer_id: int, slots: list[int], num_real: int, dtype: torch.dtype, steps: int,
                  seed: int, backend_kwargs=None, conv_bias=True, silu=True, state_dtype="float32"):
    """Run `steps` decode steps on both backends from the same pools; check everything each step."""
    ref_pool, dev_pool = make_pools(seed, state_dtype)
    kv = KVPool(REGISTRY, 4, 16)
    ref = CPUReferenceBackend(kv, ref_pool)
    tri = TritonLinearBackend(dev_pool, **(backend_kwargs or {}))
    entry = "conv" if op == "short_conv" else "recurrent"
    before = dev_pool.layer(layer_id)[entry].clone()
    touched = sorted(set(slots[:num_real]))
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in touched]
    assert PADDING_SLOT in untouched
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        ctx = decode_step(slots, num_real)
        x = step_inputs(op, layer_id, len(slots), num_real, dtype, g)
        out_ref = run_op(ref, ctx, op, layer_id, x, dtype, "cpu", conv_bias, silu)
        out = run_op(tri, ctx, op, layer_id, x, dtype, DEVICE, conv_bias, silu).cpu()
        assert torch.isfinite(out).all(), f"{op}: output rows left unwritten (NaN poison survived)"
        assert out[num_real:].eq(0).all(), f"{op}: padding rows must be zero"
        err = rel_err(out[:num_real], out_ref[:num_real])
        assert err <= TOL[dtype], f"{op} layer {layer_id} B={len(slots)} {dtype}: out rel err {err:.2e}"
        s_ref, s_dev = ref_pool.layer(layer_id)[entry], dev_pool.layer(layer_id)[entry].cpu()
        s_err = rel_err(s_dev[touched], s_ref[touched])
        assert s_err <= STATE_TOL[state_dtype], (
            f"{op} layer {layer_id} B={len(slots)} {dtype}: state rel err {s_err:.2e}")
    after = dev_pool.layer(layer_id)[entry]
    assert torch.equal(after[untouched], before[untouched]), "padding slot or a free slot was written"
    assert not torch.equal(after[touched], before[touched]), "the real slots were never updated"


# (B, real requests, slots): padding rows at the end, as build_step lays them out; slots are
# not in row order, so a kernel that indexes by row instead of by slot fails.
BATCHES = {1: [5], 3: [7, 2, PADDING_SLOT], 8: [4, 9, 1, 6, 3, 10, PADDING_SLOT, PADDING_SLOT]}
REAL = {1: 1, 3: 2, 8: 6}
OPS = [("gdn_core", 0), ("gdn_core", 1), ("kda_core", 2), ("lightning_core", 3), ("short_conv", 0)]
RECURRENT_OPS = [o for o in OPS if o[0] != "short_conv"]


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("op,layer_id", OPS, ids=[f"{op}-L{lid}" for op, lid in OPS])
def test_decode_steps_match_reference(op, layer_id, batch, dtype):
    compare_steps(op, layer_id, BATCHES[batch], REAL[batch], dtype, steps=2, seed=10 * batch + layer_id)


@in_process
def test_dims_that_are_not_powers_of_two():
    compare_steps("gdn_core", 4, BATCHES[3], REAL[3], torch.float32, steps=2, seed=3)


@in_process
@pytest.mark.parametrize("op,layer_id", RECURRENT_OPS, ids=[f"{op}-L{lid}" for op, lid in RECURRENT_OPS])
def test_bfloat16_states_decode_as_the_reference_rounds_them(op, layer_id):
    """Pools keeping recurrent states in bfloat16 (--state-dtype): the decode kernels read the
    state into float32 and round the new one, as the reference does after each step; outputs and
    states over two steps (the second from the first's rounded state), padding rows and untouched slots."""
    compare_steps(op, layer_id, BATCHES[8], REAL[8], torch.bfloat16, steps=2, seed=90 + layer_id,
                  state_dtype="bfloat16")


@in_process
@pytest.mark.parametrize("block_v,num_warps", [(4, 1), (16, 2)])
def test_every_tile_width_gives_the_same_result(block_v, num_warps):
    """Dv split into 4 tiles of 4, or one tile of 16: programs own disjoint columns of the state."""
    cfg = TL.RecurrentConfig(block_v, num_warps)
    compare_steps("kda_core", 2, BATCHES[3], REAL[3], torch.float32, steps=2, seed=4,
                  backend_kwargs={"recurrent_config": cfg})


@in_process
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op,layer_id", RECURRENT_OPS, ids=[f"{op}-L{lid}" for op, lid in RECURRENT_OPS])
def test_walking_programs_match_the_reference(monkeypatch, op, layer_id, state_dtype):
    """RecurrentConfig.walk: 2 programs (an SM of 2 stands in for the chip) walk the 8 requests' 16 to 32
    tiles, padding rows among them, and match the reference (outputs, states, zeros for padding,
    untouched slots) over two steps."""
    monkeypatch.setattr(TL, "num_sms", lambda device: 1)
    dtype = torch.float32 if state_dtype == "float32" else torch.bfloat16  # the interpreter truncates to bf16
    compare_steps(op, layer_id, BATCHES[8], REAL[8], dtype, steps=2, seed=60 + layer_id,
                  state_dtype=state_dtype, backend_kwargs={"recurrent_config": TL.RecurrentConfig(8, 1, walk=2)})


@in_process
@pytest.mark.parametrize("stages", [1, 3])
def test_a_walk_computes_each_tile_as_one_program_a_tile_does(monkeypatch, stages):
    """The walk changes which program runs a tile, not what the tile computes: its outputs and states
    equal the one-tile kernel's bit for bit at the same tile, a padding row between real rows
    (NaN inputs) included."""
    monkeypatch.setattr(TL, "num_sms", lambda device: 1)
    _, hk, hv, dk, dv = LAYERS[0]
    slots = torch.tensor([4, PADDING_SLOT, 9, 1, 6], dtype=torch.int64)
    g = torch.Generator().manual_seed(70 + stages)
    x = {n: torch.randn(shape, generator=g) for n, shape in
         (("q", (5, hk, dk)), ("k", (5, hk, dk)), ("v", (5, hv, dv)), ("g", (5, hv)), ("beta", (5, hv)))}
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    x["g"], x["beta"] = -x["g"].abs(), x["beta"].sigmoid()
    for t in x.values():
        t[1] = float("nan")
    state = torch.randn(NUM_SLOTS + 1, hv, dk, dv, generator=g)
    results = []
    for cfg in (TL.RecurrentConfig(4, 1), TL.RecurrentConfig(4, 1, walk=3, stages=stages)):
        s = state.clone().to(DEVICE)
        out = torch.full((5, hv, dv), float("nan"), device=DEVICE)
        TL.recurrent_decode(*(x[n].to(DEVICE) for n in ("q", "k", "v", "g", "beta")), out, s, slots.to(DEVICE),
                            dk ** -0.5, TL.GATE_PER_HEAD, cfg)
        results.append((out.cpu(), s.cpu()))
    (out_one, s_one), (out_walk, s_walk) = results
    assert out_walk[1].eq(0).all() and torch.isfinite(out_walk).all()
    assert torch.equal(out_walk, out_one) and torch.equal(s_walk, s_one)
    assert torch.equal(s_walk[PADDING_SLOT], state[PADDING_SLOT])


def test_walk_tiles_walk_only_where_each_program_gets_several_tiles():
    """decode_tiles="walk" at bench qwen3_next's GDN dims (32 value heads of 128, 132 SMs): one request
    and 8 keep the one-tile kernel; 128 requests (8192 tiles of 64 columns) walk them on 3 programs
    an SM."""
    dev = torch.device("cpu")
    assert TL.walk_recurrent_config(1, 32, 128, 128, dev) == TL.recurrent_config(1, 32, 128, 128, dev)
    assert TL.walk_recurrent_config(8, 32, 128, 128, dev).walk == 0
    walked = TL.walk_recurrent_config(128, 32, 128, 128, dev)
    assert walked == TL.RecurrentConfig(64, 4, walk=TL.WALK_PER_SM, stages=TL.WALK_STAGES)
    assert TL.walk_recurrent_config(24, 32, 128, 128, dev).walk == 0  # 1536 tiles: under 4 a program
    assert TL.walk_recurrent_config(25, 32, 128, 128, dev).walk == TL.WALK_PER_SM


@in_process
def test_walk_decode_tiles_is_a_routing_option(monkeypatch):
    """The backend built with decode_tiles="walk" asks walk_recurrent_config for its decode launches;
    the results match the reference."""
    launched = []
    real = TL.recurrent_decode
    monkeypatch.setattr(TL, "recurrent_decode", lambda *a: launched.append(a[-1]) or real(*a))
    monkeypatch.setattr(TL, "WALK_MIN_TILES", 0)  # a tiny layer's few tiles walk too
    TL.walk_recurrent_config.cache_clear()
    try:
        compare_steps("gdn_core", 0, BATCHES[8], REAL[8], torch.float32, steps=1, seed=8,
                      backend_kwargs={"decode_tiles": "walk"})
    finally:
        TL.walk_recurrent_config.cache_clear()
    _, _, hv, dk, dv = LAYERS[0]
    assert launched == [dataclasses.replace(TL.recurrent_config(8, hv, dk, dv, torch.device(DEVICE)),
                                            walk=TL.WALK_PER_SM, stages=TL.WALK_STAGES)]


@in_process
@pytest.mark.parametrize("op,layer_id", [("gdn_core", 0)])
def test_fixed_decode_tiles_launch_one_tile_at_any_batch(monkeypatch, op, layer_id):
    """decode_tiles="fixed" (hgc compile --batch-invariant): a decode step of one request and one of 8
    rows launch with the same tile (triton_linear.fixed_recurrent_config), so a request's state
    reduces in one order whatever shares its step; the results still match the reference. The
    default picks tiles by the request count (the launch's own choice). The conv's tile is a
    function of its channels alone (`conv_config`)."""
    kernel = "recurrent_decode"
    _, hk, hv, dk, dv = LAYERS[layer_id]
    fixed = TL.fixed_recurrent_config(hv, dk, dv, torch.device(DEVICE))
    launched = []
    real = getattr(TL, kernel)
    monkeypatch.setattr(TL, kernel, lambda *a: launched.append(a[-1]) or real(*a))
    for batch in (1, 8):
        compare_steps(op, layer_id, BATCHES[batch], REAL[batch], torch.float32, steps=1, seed=5,
                      backend_kwargs={"decode_tiles": "fixed"})
    assert launched == [fixed, fixed]
    compare_steps(op, layer_id, BATCHES[8], REAL[8], torch.float32, steps=1, seed=5)
    assert launched[2] is None, "by_batch leaves the choice to the launch (by its row count)"


def test_fixed_tiles_are_a_full_batchs_at_qwen3_next_dims():
    """The fixed recurrent tile is the one the by-batch rule gives a full device (wide Dv tiles, 4
    warps), not one request's (8 Dv columns, 1 warp), which cost 1.9x at batch 32 on an H200; the
    conv's tile is the same at every batch (256 channels on a warp)."""
    dev = torch.device("cpu")
    assert TL.fixed_recurrent_config(32, 128, 128, dev) == TL.recurrent_config(4096, 32, 128, 128, dev) == \
        TL.RecurrentConfig(64, 4)
    assert TL.conv_config(8192) == TL.ConvConfig(256, 1)
    assert TL.conv_config(48) == TL.ConvConfig(64, 1)  # a tiny layer: no tile wider than its channels


@in_process
@pytest.mark.parametrize("conv_bias,silu", [(False, False), (True, False)])
def test_short_conv_without_bias_or_silu(conv_bias, silu):
    compare_steps("short_conv", 1, BATCHES[3], REAL[3], torch.float32, steps=4, seed=5,
                  conv_bias=conv_bias, silu=silu, backend_kwargs={"conv_config": TL.ConvConfig(32, 1)})


@in_process
@pytest.mark.parametrize("config", [TL.ConvConfig(32, 1), TL.ConvConfig(64, 2)], ids=["32x1", "64x2"])
def test_decode_and_verify_convs_give_the_same_bits_on_either_history_layout(config):
    """The decode and target-verify convs read a history [slots, C, K-1] stored as is or stored
    [slots, K-1, C] (the state pool's layout) through its strides: outputs, rolled histories and the
    verify step's intermediate histories equal bit for bit; the padding request's row is zero and
    its slot untouched. 40 channels: a masked last tile at both tiles."""
    g = torch.Generator().manual_seed(7)
    B, C, K, n = 3, 40, 4, 3
    w, b = torch.randn(C, K, generator=g).to(DEVICE), torch.randn(C, generator=g).to(DEVICE)
    history = torch.randn(B + 2, C, K - 1, generator=g).to(DEVICE)
    slots = torch.tensor([2, PADDING_SLOT, 4], device=DEVICE)
    x1, xn = torch.randn(B, C, generator=g).to(DEVICE), torch.randn(B * n, C, generator=g).to(DEVICE)
    got = {}
    for last in (False, True):
        state = laid_out(history.clone(), last)
        inter = laid_out(torch.zeros(B, n - 1, C, K - 1, device=DEVICE), last)
        out1, outn = torch.full_like(x1, float("nan")), torch.full_like(xn, float("nan"))
        TL.short_conv_decode(x1, w, b, out1, state, slots, True, config=config)
        TL.short_conv_verify(xn, w, b, outn, state, slots, inter, n, True, config=config)
        got[last] = (out1.cpu(), outn.cpu(), state.contiguous().cpu(), inter.contiguous().cpu())
    for name, a, c in zip(("decode out", "verify out", "histories", "intermediates"), got[False], got[True]):
        assert torch.equal(a, c), name
    out1, outn, state, _ = got[True]
    assert out1[1].abs().sum() == 0 and outn[n:2 * n].abs().sum() == 0 and torch.isfinite(outn).all()
    assert torch.equal(state[PADDING_SLOT], history[PADDING_SLOT].cpu()) and not torch.equal(state[2], history[2].cpu())


@in_process
@pytest.mark.parametrize("rows", [False, True], ids=["tile", "rows"])
def test_extend_conv_gives_the_same_bits_on_either_history_layout(rows):
    """The extend conv (tile and row streaming) over histories and a snapshot pool stored [.., K-1, C]:
    outputs, new histories and snapshots equal those over [.., C, K-1] bit for bit."""
    config = TL.ConvConfig(32, 1, rows=rows)
    want = conv_extend_launch(config, 4, 40, DEVICE)
    got = conv_extend_launch(config, 4, 40, DEVICE, channels_last=True)
    assert want[2][1:].abs().sum() > 0
    for name, a, c in zip(("outputs", "histories", "snapshots"), got, want):
        assert torch.equal(a, c), name


@in_process
@pytest.mark.parametrize("op,layer_id", [("gdn_core", 0), ("short_conv", 0)])
def test_padding_row_between_real_rows(op, layer_id):
    """A padding row anywhere (not only at the end) reads nothing, writes zeros and no state."""
    ref_pool, dev_pool = make_pools(11)
    ref = CPUReferenceBackend(KVPool(REGISTRY, 4, 16), ref_pool)
    tri = TritonLinearBackend(dev_pool)
    entry = "conv" if op == "short_conv" else "recurrent"
    x = step_inputs(op, layer_id, 3, 3, torch.float32, torch.Generator().manual_seed(12))
    for t in x.values():
        t[1] = float("nan")
    ctx = decode_step([3, 8, 5], 3)
    ctx.state_slots[1] = PADDING_SLOT
    before = dev_pool.layer(layer_id)[entry].clone()
    out = run_op(tri, ctx, op, layer_id, x, torch.float32, DEVICE).cpu()
    compact = decode_step([3, 5], 2)
    out_ref = run_op(ref, compact, op, layer_id, {n: t[[0, 2]] for n, t in x.items()}, torch.float32, "cpu")
    assert out[1].eq(0).all()
    assert rel_err(out[[0, 2]], out_ref) <= 1e-4
    after = dev_pool.layer(layer_id)[entry].cpu()
    assert rel_err(after[[3, 5]], ref_pool.layer(layer_id)[entry][[3, 5]]) <= STATE_TOL["float32"]
    keep = [s for s in range(NUM_SLOTS + 1) if s not in (3, 5)]
    assert torch.equal(after[keep], before.cpu()[keep])


@in_process
def test_backend_follows_the_protocol_and_declares_every_mode():
    _, dev_pool = make_pools(0)
    tri = TritonLinearBackend(dev_pool)
    check_backend(tri)
    assert tri.supported_ops == {"gdn_core", "kda_core", "lightning_core", "short_conv", "gdn_fused"}
    cap = TritonLinearBackend.capability
    assert cap.ops == tri.supported_ops and cap.device == "cuda"
    assert cap.modes_supported == set(Mode)
    # extend / mixed run FLA's host-planned chunk kernels: eager; target_verify is one verify launch an op
    assert cap.modes_capturable == {Mode.DECODE, Mode.TARGET_VERIFY}


@in_process
def test_replayed_step_reads_slots_from_the_static_buffer():
    """Capture reads slot ids from one static buffer; init_replay_state refreshes it per step."""
    ref_pool, dev_pool = make_pools(21)
    ref = CPUReferenceBackend(KVPool(REGISTRY, 4, 16), ref_pool)
    tri = TritonLinearBackend(dev_pool)
    tri.init_capture_state(max_tokens=8, max_seqs=8)
    ctx = decode_step([6, 2, PADDING_SLOT], 2)
    tri.init_replay_state(ctx, bucket=3)
    assert tri._step_slots(ctx).data_ptr() == tri._static_slots.data_ptr()
    x = step_inputs("gdn_core", 0, 3, 2, torch.float32, torch.Generator().manual_seed(22))
    out = run_op(tri, ctx, "gdn_core", 0, x, torch.float32, DEVICE).cpu()
    out_ref = run_op(ref, ctx, "gdn_core", 0, x, torch.float32, "cpu")
    assert rel_err(out[:2], out_ref[:2]) <= 1e-4 and out[2].eq(0).all()
    with pytest.raises(RuntimeError, match="bucket"):
        tri.init_replay_state(ctx, bucket=4)
    tri.init_step_metadata(ctx)  # an eager step: back to ctx.state_slots
    assert tri._step_slots(ctx).data_ptr() != tri._static_slots.data_ptr()


@in_process
def test_row_count_must_match_the_step():
    _, dev_pool = make_pools(0)
    tri = TritonLinearBackend(dev_pool)
    ctx = decode_step([1, 2, PADDING_SLOT], 2)
    x = step_inputs("short_conv", 0, 2, 2, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="one row per request"):
        run_op(tri, ctx, "short_conv", 0, x, torch.float32, DEVICE)


@in_process
def test_default_tiles_keep_batch_one_spread_over_the_chip():
    """Batch 1 at Qwen3-Next dims must not run as a handful of programs (see recurrent_config)."""
    cfg = TL.recurrent_config(1, 32, 128, 128, torch.device("cpu"))
    assert (cfg.block_v, cfg.num_warps) == (8, 1) and 1 * 32 * (128 // cfg.block_v) == 512
    eight = TL.recurrent_config(8, 32, 128, 128, torch.device("cpu"))
    assert (eight.block_v, eight.num_warps) == (32, 4)
    big = TL.recurrent_config(64, 32, 128, 128, torch.device("cpu"))  # the H200 sweep's best from batch 32
    assert big.block_v == 64 and big.num_warps == 4


# -- extend, mixed and target-verify steps ------------------------------------------------------


def mode_step(mode: Mode, reqs: list[tuple[int, int, int]], pad_tokens: int = 0, pad_seqs: int = 0):
    """A step of `mode` over (slot, cached tokens, new tokens) requests, padded as the runtime pads."""
    kv = KVPool(REGISTRY, 64, 16)
    items = [(SeqState(slot, num_cached=cached), [0] * n) for slot, cached, n in reqs]
    T = sum(n for *_, n in reqs)
    step = build_step(items, kv, mode=mode, pad_tokens_to=T + pad_tokens, pad_seqs_to=len(reqs) + pad_seqs)
    step.ctx.check()
    return step.ctx


# Slot 4 starts empty (a new request), the others from random states. Step 2 continues slot 4's
# prompt in a second chunk, mixed with a decode row (slot 7) and a new extend (slot 2).
MODE_STEPS = [
    (Mode.EXTEND, [(4, 0, 6), (7, 9, 5)], 3, 1),
    (Mode.MIXED, [(4, 6, 4), (7, 14, 1), (2, 0, 3)], 2, 1),
    (Mode.TARGET_VERIFY, [(4, 10, 3), (7, 15, 3), (2, 3, 3)], 3, 1),  # uniform: the verify kernels
    (Mode.TARGET_VERIFY, [(4, 13, 2), (2, 6, 3)], 0, 0),  # ragged: the eager extend path
    (Mode.DECODE, [(2, 9, 1), (4, 15, 1)], 1, 1),
]


def compare_mode_steps(op: str, layer_id: int, steps, dtype=torch.float32, seed=0, silu=True, conv_bias=True,
                       qk_dtype=None, backend_kwargs=None, replayed=False, conv_extend_rows=False,
                       state_dtype="float32"):
    """replayed: extend and mixed steps run as a captured graph's would, over the static plan
    init_replay_state fills (each step's padding is its bucket); conv_extend_rows: the backend's
    extend conv streams rows (TritonLinearBackend.conv_extend_rows); state_dtype: the pools'
    recurrent states'."""
    ref_pool, dev_pool = make_pools(seed, state_dtype)
    for pool in (ref_pool, dev_pool):
        for t in pool.buffers[layer_id].values():
            t[4].zero_()  # slot 4: a request that starts from the empty state
    ref = CPUReferenceBackend(KVPool(REGISTRY, 4, 16), ref_pool)
    fake = FakeFLA()
    tri = TritonLinearBackend(dev_pool, fla=fake, **(backend_kwargs or {}))
    tri.conv_extend_rows = conv_extend_rows
    entry = "conv" if op == "short_conv" else "recurrent"
    before = dev_pool.layer(layer_id)[entry].clone()
    g = torch.Generator().manual_seed(seed + 1)
    touched = set()
    if replayed:
        tri.init_capture_state(max_tokens=max(sum(r[2] for r in reqs) + t for _, reqs, t, _ in steps),
                               max_seqs=max(len(reqs) + b for _, reqs, _, b in steps))
    for mode, reqs, pad_tokens, pad_seqs in steps:
        ctx = mode_step(mode, reqs, pad_tokens, pad_seqs)
        tri.init_step_metadata(ctx)
        if mode in (Mode.EXTEND, Mode.MIXED):
            tri.init_chunk_metadata(ctx, 64)
            if replayed:
                tri.init_replay_state(ctx, ctx.num_seqs)
                assert tri._step.extend.captured
        R, T = ctx.num_real_tokens, ctx.num_tokens
        x = step_inputs(op, layer_id, T, R, dtype, g)
        if qk_dtype is not None:
            x.update(q=x["q"].to(qk_dtype), k=x["k"].to(qk_dtype))
        out_ref = run_op(ref, ctx, op, layer_id, x, dtype, "cpu", conv_bias, silu)
        out = run_op(tri, ctx, op, layer_id, x, dtype, DEVICE, conv_bias, silu).cpu()
        what = f"{op} layer {layer_id} {mode.value} {reqs}"
        assert torch.isfinite(out).all(), f"{what}: output rows left unwritten (NaN poison survived)"
        assert out[R:].eq(0).all(), f"{what}: padding rows must be zero"
        err = rel_err(out[:R], out_ref[:R])
        assert err <= TOL[dtype], f"{what}: out rel err {err:.2e}"
        touched |= {slot for slot, *_ in reqs}
        rows = sorted(touched)
        s_err = rel_err(dev_pool.layer(layer_id)[entry].cpu()[rows], ref_pool.layer(layer_id)[entry][rows])
        assert s_err <= STATE_TOL[state_dtype], f"{what}: state rel err {s_err:.2e}"
        n = reqs[0][2]
        if mode == Mode.TARGET_VERIFY and all(new == n for *_, new in reqs):
            # the verify kernels keep the state after each of the first n - 1 tokens, per row
            got = dev_pool.verify_buffers[layer_id][entry].cpu()[:len(reqs), :n - 1]
            want = ref_pool.verify_buffers[layer_id][entry][:len(reqs), :n - 1]
            i_err = rel_err(got, want)
            assert i_err <= STATE_TOL[state_dtype] and want.abs().sum() > 0, (
                f"{what}: intermediate state rel err {i_err:.2e}")
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in touched]
    assert PADDING_SLOT in untouched
    assert torch.equal(dev_pool.layer(layer_id)[entry][untouched], before[untouched]), "padding or free slot written"
    return fake


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op,layer_id", OPS, ids=[f"{op}-L{lid}" for op, lid in OPS])
def test_a_verify_launch_is_n_decode_launches_bit_for_bit(op, layer_id, dtype):
    """recurrent_verify / short_conv_verify over B requests of n tokens (one on the padding slot)
    against n decode launches on the strided rows t, n+t, ... with the slot's state copied out after
    each (what target_verify ran before): outputs, the slots' final states and every intermediate
    state equal exactly; the padding request's rows are zero and its slot and rows untouched."""
    n, slots_list = 4, [3, PADDING_SLOT, 6]
    B = len(slots_list)
    _, pool_a = make_pools(80 + layer_id)
    _, pool_b = make_pools(80 + layer_id)
    entry = "conv" if op == "short_conv" else "recurrent"
    state_a, state_b = pool_a.layer(layer_id)[entry], pool_b.layer(layer_id)[entry]
    inter = pool_a.verify_buffers[layer_id][entry]
    inter.fill_(float("nan"))  # rows the padding request owns must stay unwritten
    slots = torch.tensor(slots_list, device=DEVICE)
    g = torch.Generator().manual_seed(layer_id)
    x = {k: v.to(DEVICE) for k, v in step_inputs(op, layer_id, B * n, B * n, dtype, g).items()}
    out_a = torch.full_like(x["v"] if op != "short_conv" else x["x"], float("nan"))
    out_b = out_a.clone()
    kept = []
    if op == "short_conv":
        w, bias = CONV_WEIGHT.to(DEVICE, x["x"].dtype), CONV_BIAS.to(DEVICE, x["x"].dtype)
        TL.short_conv_verify(x["x"], w, bias, out_a, state_a, slots, inter, n, True)
        for t in range(n):
            TL.short_conv_decode(x["x"][t::n], w, bias, out_b[t::n], state_b, slots, True)
            kept.append(state_b[slots].clone())
    else:
        gate_kind = {"gdn_core": TL.GATE_PER_HEAD, "kda_core": TL.GATE_PER_CHANNEL,
                     "lightning_core": TL.GATE_CONSTANT}[op]
        gate, beta = (DECAY.to(DEVICE), None) if op == "lightning_core" else (x["g"], x["beta"])
        TL.recurrent_verify(x["q"], x["k"], x["v"], gate, beta, out_a, state_a, slots, inter, n, 0.5, gate_kind)
        for t in range(n):
            rows = lambda a: a[t::n]  # noqa: E731
            TL.recurrent_decode(rows(x["q"]), rows(x["k"]), rows(x["v"]), gate if beta is None else rows(gate),
                                None if beta is None else rows(beta), rows(out_b), state_b, slots, 0.5, gate_kind)
            kept.append(state_b[slots].clone())
    assert torch.equal(out_a, out_b), f"{op}: verify outputs differ from the decode launches'"
    assert out_a[n:2 * n].eq(0).all(), "the padding request's rows are zero"
    assert torch.equal(state_a, state_b), f"{op}: the slots' states differ (or the padding slot was written)"
    for t in range(n - 1):
        for b in (0, 2):
            assert torch.equal(inter[b, t], kept[t][b]), f"{op}: intermediate state {t} of request {b}"
    assert inter[1].isnan().all(), "the padding request keeps nothing"


@in_process
def test_float32_q_k_with_bf16_v_as_kimi_passes_them():
    """Kimi's kda_core gets q, k in float32 (its l2norm's output) and v in bf16; FLA refuses a mix,
    so the extend path hands them over in v's dtype (FakeFLA checks) and still matches the reference."""
    compare_mode_steps("kda_core", 2, MODE_STEPS, dtype=torch.bfloat16, seed=50, qk_dtype=torch.float32)


@in_process
@pytest.mark.parametrize("op,layer_id", OPS, ids=[f"{op}-L{lid}" for op, lid in OPS])
def test_extend_mixed_and_verify_steps_match_reference(op, layer_id):
    fake = compare_mode_steps(op, layer_id, MODE_STEPS, seed=30 + layer_id)
    if op == "short_conv":
        assert fake.calls == []  # the conv's extend path is torch, no FLA
    else:
        # one chunk call per eager step over all its requests; the uniform verify step used none
        assert [c[1] for c in fake.calls] == [[0, 6, 11], [0, 4, 5, 8], [0, 2, 5]]


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op,layer_id", RECURRENT_OPS, ids=[f"{op}-L{lid}" for op, lid in RECURRENT_OPS])
def test_short_extends_run_the_recurrent_extend_kernel(op, layer_id, dtype):
    """Requests of at most 8 tokens: the extend, mixed and ragged verify steps take one recurrent
    extend launch (tokens in order through the slot's state), no FLA; outputs, states, padding rows
    and untouched slots as the reference has them."""
    fake = compare_mode_steps(op, layer_id, MODE_STEPS, dtype=dtype, seed=60 + layer_id,
                              backend_kwargs={"short_extend_tokens": 8})
    assert fake.calls == []


@in_process
def test_ops_captured_in_extend_take_their_graph_kernels_eagerly_too(monkeypatch):
    """chunk_impl="triton" makes GDN's and Lightning's extend steps capturable: their short eager steps
    run the chunk kernels a replay runs, not the recurrent extend kernel (which rounds differently),
    so eager and replayed steps agree; KDA, never captured in extend, keeps the short path."""
    import runtime.backends.kernels.linear as kernels

    _, dev_pool = make_pools(3)
    tri = TritonLinearBackend(dev_pool, fla=FakeFLA(), short_extend_tokens=64, chunk_impl="triton")
    short = []
    real = kernels.recurrent_extend
    monkeypatch.setattr(kernels, "recurrent_extend", lambda *a, **k: (short.append(a[-2]), real(*a, **k)))
    ctx = mode_step(Mode.EXTEND, [(4, 0, 6), (7, 9, 5)], 3, 1)
    tri.init_step_metadata(ctx)
    tri.init_chunk_metadata(ctx, 64)
    for op, layer_id in (("gdn_core", 0), ("lightning_core", 3), ("kda_core", 2)):
        run_op(tri, ctx, op, layer_id, step_inputs(op, layer_id, 14, 11, torch.float32,
                                                      torch.Generator().manual_seed(1)), torch.float32, DEVICE)
    assert short == [kernels.GATE_PER_CHANNEL], "only KDA took the recurrent extend kernel"


@in_process
def test_a_step_with_a_longer_request_takes_fla():
    """The limit is per request: the 6-token request sends its step to FLA, the 4- and 3-token
    steps after it run the recurrent extend kernel."""
    fake = compare_mode_steps("gdn_core", 0, MODE_STEPS, seed=70, backend_kwargs={"short_extend_tokens": 5})
    assert [c[1] for c in fake.calls] == [[0, 6, 11]]


# Steps past any short-extend limit: slot 4's new prompt of 70 tokens (a whole chunk of 64 and a
# partial one) beside a short request, then its next chunk in a mixed step, a ragged verify, a decode.
CHUNK_STEPS = [
    (Mode.EXTEND, [(4, 0, 70), (7, 9, 5)], 3, 1),
    (Mode.MIXED, [(4, 70, 4), (7, 14, 1), (2, 0, 3)], 2, 1),
    (Mode.TARGET_VERIFY, [(4, 74, 2), (2, 3, 3)], 0, 0),
    (Mode.DECODE, [(2, 6, 1), (4, 76, 1)], 1, 1),
]
CHUNK_OPS = [("gdn_core", 0), ("gdn_core", 1), ("gdn_core", 4), ("lightning_core", 3)]


@in_process
@pytest.mark.parametrize("path", ["fla", "recurrent_extend", "chunk"])
def test_bfloat16_states_through_every_extend_path(path):
    """Extend, mixed and verify steps over bfloat16 recurrent states (--state-dtype), on each path an
    extend takes: FLA's chunk call (handed a float32 initial state, its final state rounded back),
    the recurrent extend kernel and our chunk kernels; outputs and states as the reference has them."""
    kwargs = {"fla": {}, "recurrent_extend": {"short_extend_tokens": 8}, "chunk": {"chunk_impl": "triton"}}[path]
    steps = CHUNK_STEPS if path == "chunk" else MODE_STEPS
    fake = compare_mode_steps("gdn_core", 0, steps, dtype=torch.bfloat16, seed=95, backend_kwargs=kwargs,
                              state_dtype="bfloat16")
    assert bool(fake.calls) == (path == "fla")


@in_process
@pytest.mark.parametrize("op,layer_id", CHUNK_OPS, ids=[f"{op}-L{lid}" for op, lid in CHUNK_OPS])
def test_extends_run_our_chunk_kernels_with_chunk_impl_triton(op, layer_id):
    """chunk_impl="triton": GDN's and Lightning's extend, mixed and ragged verify steps run
    triton_chunk.chunk_extend (no FLA call) and match the reference: outputs, states, padding rows
    and untouched slots; grouped and ungrouped heads, dims that are not powers of two."""
    fake = compare_mode_steps(op, layer_id, CHUNK_STEPS, seed=80 + layer_id, backend_kwargs={"chunk_impl": "triton"})
    assert fake.calls == []


# Two steps of one bucket (128 rows, 4 requests): the second must not read what the first left in
# the static tables; a decode after them.
REPLAYED_STEPS = [
    (Mode.EXTEND, [(4, 0, 70), (7, 9, 5)], 53, 2),
    (Mode.MIXED, [(4, 70, 4), (7, 14, 1), (2, 0, 3)], 120, 1),
    (Mode.DECODE, [(2, 3, 1), (4, 74, 1)], 1, 1),
]
REPLAYED_OPS = [("gdn_core", 0), ("lightning_core", 3), ("short_conv", 0)]


@in_process
@pytest.mark.parametrize("op,layer_id", REPLAYED_OPS, ids=[f"{op}-L{lid}" for op, lid in REPLAYED_OPS])
def test_replayed_extend_steps_read_the_static_plan(op, layer_id):
    """Captured extend and mixed steps (chunk_impl="triton"): every table padded to the bucket in
    the static plan (the grid a graph keeps: chunk and conv-block rows for the most a step of the
    bucket can have, more requests than the step brings) gives the reference's outputs and states;
    padding rows zero, the padding slot and free slots untouched."""
    fake = compare_mode_steps(op, layer_id, REPLAYED_STEPS, seed=60 + layer_id, backend_kwargs={"chunk_impl": "triton"},
                              replayed=True)
    assert fake.calls == []


# Short buckets (32 rows, 4 requests; then 16 rows, 4 requests): chunks of the bucket's rows.
REPLAYED_SHORT_STEPS = [
    (Mode.EXTEND, [(4, 0, 20), (7, 9, 5)], 7, 2),
    (Mode.MIXED, [(4, 20, 4), (7, 14, 1), (2, 0, 3)], 8, 1),
]


@in_process
@pytest.mark.parametrize("op,layer_id", REPLAYED_OPS, ids=[f"{op}-L{lid}" for op, lid in REPLAYED_OPS])
def test_replayed_short_buckets_take_chunks_of_their_rows(monkeypatch, op, layer_id):
    """Captured steps of 32- and 16-row buckets: the chunk kernels take chunks of 32 and 16 rows
    (chunk_length of the bucket) over the static plan's 64-row table and give the reference's
    outputs and states."""
    from runtime.backends.kernels import chunk
    block_ts = []
    launch = chunk._CHUNK_OUTPUT.launch
    monkeypatch.setattr(chunk._CHUNK_OUTPUT, "launch",
                        lambda grid, args, kwargs: (block_ts.append(kwargs["BT"]), launch(grid, args, kwargs)))
    fake = compare_mode_steps(op, layer_id, REPLAYED_SHORT_STEPS, seed=65 + layer_id,
                              backend_kwargs={"chunk_impl": "triton"}, replayed=True)
    assert fake.calls == []
    assert block_ts == ([] if op == "short_conv" else [32, 16])


@in_process
@pytest.mark.parametrize("chunk_impl", ["triton", "fla"])
def test_an_op_in_an_eager_gap_beside_captured_ops_reads_the_eager_plan(chunk_impl):
    """A piecewise step where this instance has ops on both sides (Kimi's KDA in the eager gaps,
    its short conv captured): planned eagerly, then staged for the pieces (plan_piecewise_step's
    order), KDA's chunk call gets the eager plan's real requests and matches the reference; the
    captured conv's static plan is still the one the step keeps."""
    fake = compare_mode_steps("kda_core", 2, REPLAYED_STEPS, seed=70, backend_kwargs={"chunk_impl": chunk_impl},
                              replayed=True)
    assert [c[1] for c in fake.calls] == [[0, 70, 75], [0, 4, 5, 8]]


# Two buckets of 16 rows (3 and 4 requests), then one of 32 rows whose 20-token request is past
# the short-extend limit of 16, then a decode.
SHORT_REPLAYED_STEPS = [
    (Mode.EXTEND, [(4, 0, 6), (7, 9, 5)], 5, 1),
    (Mode.MIXED, [(4, 6, 4), (7, 14, 1), (2, 0, 3)], 8, 1),
    (Mode.EXTEND, [(4, 10, 20), (7, 15, 3)], 9, 0),
    (Mode.DECODE, [(2, 3, 1), (4, 30, 1)], 1, 1),
]
BOUNDED_OPS = [("kda_core", 2, "triton"), ("gdn_core", 0, "fla"), ("lightning_core", 3, "fla")]


@in_process
@pytest.mark.parametrize("op,layer_id,chunk_impl", BOUNDED_OPS, ids=[o[0] for o in BOUNDED_OPS])
def test_buckets_up_to_the_short_extend_limit_hold_the_other_cores_on_the_static_plan(monkeypatch, op, layer_id,
                                                                                      chunk_impl):
    """KDA (and GDN, Lightning under chunk_impl=fla) are captured in extend buckets of up to
    short_extend_tokens rows: replayed there, they launch the recurrent kernel over the static plan
    (bounds of the bucket's requests, the always-empty one and the padding rows) and match the
    reference; a larger bucket holds them in an eager gap, on the eager plan (FLA's chunk call
    for the 20-token request)."""
    bounds = []
    real = TL.recurrent_extend
    monkeypatch.setattr(TL, "recurrent_extend", lambda *a, **k: (bounds.append(a[8].shape[0]), real(*a, **k)))
    options = {"short_extend_tokens": 16, "chunk_impl": chunk_impl}
    tri = TritonLinearBackend(make_pools(0)[1], **options)
    assert tri._bounded_extend == {o: 16 for o, _, impl in BOUNDED_OPS if impl == chunk_impl or o == "kda_core"}
    fake = compare_mode_steps(op, layer_id, SHORT_REPLAYED_STEPS, seed=75, backend_kwargs=options, replayed=True)
    assert bounds == [3 + 3, 4 + 3], "the 16-row buckets: one launch each over the static bounds"
    assert [c[1] for c in fake.calls] == [[0, 20, 23]]


@in_process
@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
def test_kda_graph_captures_kdas_extends_on_flas_graph_form_at_every_size(monkeypatch, state_dtype):
    """kda_graph=on: KDA's extend and mixed steps are captured at every size. Replayed, each calls
    FLA's chunk_kda in its graph form over the static plan (cu_seqlens of the bucket's B + 1
    requests, the padding and spare ones empty at the tail; the bucket's rows, the stand-in leaving
    the padding rows NaN): outputs and states match the reference, padding rows are zeros, the
    padding slot and free slots keep what they held. Both buckets hold more rows than the
    short-extend limit, so its kernel is not taken (the steps within it: the test after next)."""
    short = []
    real = TL.recurrent_extend
    monkeypatch.setattr(TL, "recurrent_extend", lambda *a, **k: (short.append(1), real(*a, **k)))
    options = {"short_extend_tokens": 64, "kda_graph": "on"}
    tri = TritonLinearBackend(make_pools(0)[1], **options)
    assert "kda_core" in tri._captured_extend and "kda_core" not in tri._bounded_extend
    fake = compare_mode_steps("kda_core", 2, REPLAYED_STEPS, seed=77, backend_kwargs=options, replayed=True,
                              state_dtype=state_dtype)
    # the 128-row bucket of 4 requests: 5 requests in cu_seqlens; the 128-row bucket of 4 again
    assert fake.calls == [("kda", [0, 70, 75, 75, 75, 75], True), ("kda", [0, 4, 5, 8, 8, 8], True)]
    assert short == []


@in_process
def test_kda_graph_runs_eager_steps_on_the_graph_form_over_their_real_requests():
    """kda_graph=on, eager steps (the eager gaps' plan, no capture): the graph form over the step's
    real requests and rows (cu_seqlens on the device alone), whatever their length; outputs, states
    and padding rows as the reference has them. FLA's plain form is not called."""
    fake = compare_mode_steps("kda_core", 2, MODE_STEPS, seed=78, backend_kwargs={"kda_graph": "on"})
    assert fake.calls == [("kda", [0, 6, 11], True), ("kda", [0, 4, 5, 8], True), ("kda", [0, 2, 5], True)]


@in_process
@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
def test_kda_graph_keeps_steps_within_the_short_extend_limit_on_its_kernel(monkeypatch, replayed):
    """kda_graph=on with a short-extend limit: a step of at most that many rows (a bucket's, or an
    eager step's real rows) runs the short-extend kernel, a larger one the graph form; each matches
    the reference. Replayed: the two 16-row buckets on the kernel over their static bounds, the
    32-row one on the graph form over its B + 1 requests. Eager (limit 8): the 11-row extend step on
    the graph form, the 8-row mixed step and the 5-row ragged verify step on the kernel."""
    launches = []
    real = TL.recurrent_extend
    monkeypatch.setattr(TL, "recurrent_extend", lambda *a, **k: (launches.append(a[8].shape[0]), real(*a, **k)))
    short = 16 if replayed else 8
    options = {"short_extend_tokens": short, "kda_graph": "on"}
    fake = compare_mode_steps("kda_core", 2, SHORT_REPLAYED_STEPS if replayed else MODE_STEPS, seed=79,
                              backend_kwargs=options, replayed=replayed)
    if replayed:
        assert launches == [3 + 3, 4 + 3] and fake.calls == [("kda", [0, 20, 23, 23], True)]
    else:
        assert launches == [3 + 2, 2 + 2] and fake.calls == [("kda", [0, 6, 11], True)]


def test_kda_graph_is_a_routing_option_and_needs_flas_graph_form():
    from runtime.backends.protocol import BackendSetup

    assert dict(TritonLinearBackend.capability.options)["kda_graph"] == ("off", "on")
    _, dev_pool = make_pools(0)
    build = lambda options: TritonLinearBackend.build(BackendSetup(None, dev_pool, dev_pool.device, (), options))
    assert not build({}).kda_graph and build({"kda_graph": "on"}).kda_graph  # the default: off
    assert "kda_core" in build({"kda_graph": "on"})._captured_extend
    assert "kda_core" not in build({})._captured_extend
    with pytest.raises(ValueError, match="kda_graph"):
        TritonLinearBackend(dev_pool, kda_graph="yes")

    class PlainFLA(FakeFLA):  # an FLA before 0.6: chunk_kda without its graph form
        def kda(self, **kw):
            return self._run("kda", **kw)

    tri = TritonLinearBackend(dev_pool, fla=PlainFLA(), kda_graph="on")
    ctx = mode_step(Mode.EXTEND, [(4, 0, 6), (7, 9, 5)], 3, 1)
    tri.init_step_metadata(ctx)
    tri.init_chunk_metadata(ctx, 64)
    x = step_inputs("kda_core", 2, 14, 11, torch.float32, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="graph form"):
        run_op(tri, ctx, "kda_core", 2, x, torch.float32, DEVICE)


@in_process
def test_static_plan_tables_are_padded_to_the_bucket():
    """The layout a captured step's launches keep: slots and bounds for B+1 requests (the last one
    empty, on the padding slot), chunk rows T/64 + B and conv-block rows T/32 + B + 1, the rows past
    the step's own naming the empty request; the padding rows are request B+1 of both tables."""
    _, dev_pool = make_pools(0)
    tri = TritonLinearBackend(dev_pool, chunk_impl="triton")
    tri.init_capture_state(max_tokens=256, max_seqs=8)
    ctx = mode_step(Mode.MIXED, [(4, 6, 70), (7, 14, 1)], pad_tokens=57, pad_seqs=2)  # 128 rows, 4 requests
    tri.init_replay_state(ctx, bucket=4)
    plan = tri._step.extend
    assert plan.captured and plan.slots.tolist() == [4, 7, PADDING_SLOT, PADDING_SLOT, PADDING_SLOT]
    assert plan.cu_seqlens.tolist() == [0, 70, 71, 71, 71, 71]
    assert plan.padded_bounds.tolist() == [0, 70, 71, 71, 71, 71, 128]
    chunks = plan.chunk_indices.tolist()
    assert len(chunks) == 128 // 64 + 4
    assert chunks[:4] == [[0, 0], [0, 1], [1, 0], [5, 0]] and chunks[4:] == [[4, 0]] * 2
    blocks = plan.conv_blocks.tolist()
    assert len(blocks) == 128 // 32 + 4 + 1
    assert blocks[:6] == [[0, 0], [0, 1], [0, 2], [1, 0], [5, 0], [5, 1]] and blocks[6:] == [[4, 0]] * 3
    with pytest.raises(RuntimeError, match="static plan holds 256 and 8"):
        tri.init_replay_state(mode_step(Mode.EXTEND, [(4, 0, 300)]), bucket=1)


# Steps of one 32-row bucket of 4 requests on the static plan: (query_start_loc, slots) of the real
# requests. No real row, one request of one token, a few requests (a padded one among them), the
# bucket full, and a capture's placeholders (rows owned by requests on the padding slot).
SHORT_BUCKET = 32, 4
SHORT_BUCKET_STEPS = {
    "none": ([0, 0, 0, 0, 0], []),
    "one": ([0, 1, 1, 1, 1], [6]),
    "few": ([0, 5, 8, 17, 17], [6, 2, 9]),
    "full": ([0, 8, 16, 24, 32], [6, 2, 9, 1]),
    "placeholders": ([0, 8, 16, 24, 32], []),
}


@in_process
@pytest.mark.parametrize("case", list(SHORT_BUCKET_STEPS))
def test_the_recurrent_extend_kernel_over_a_bucket_static_plan(case):
    """The short-extend kernel as a captured KDA bucket launches it: over the static plan's tables
    (every request of the bucket, the always-empty one and the padding rows as one more), the
    outputs poisoned with NaN. Real rows are the eager launch's bits (real requests and bounds
    only) and the reference's; padding rows exactly zero; the real slots' states updated as the
    reference updates them; the padding slot and the other slots untouched."""
    from runtime.backends.triton_linear import _StaticExtendPlan

    T, B = SHORT_BUCKET
    starts, real_slots = SHORT_BUCKET_STEPS[case]
    R, rows = len(real_slots), (starts[len(real_slots)] if real_slots else 0)
    layer_id = 2
    _, hk, hv, dk, dv = LAYERS[layer_id]
    ref_pool, dev_pool = make_pools(11)
    eager_pool = make_pools(11)[1]
    x = {n: t.to(DEVICE) for n, t in step_inputs("kda_core", layer_id, T, T, torch.float32,
                                                  torch.Generator().manual_seed(12)).items()}
    scale = dk ** -0.5

    static_slots = torch.full((B + 1,), PADDING_SLOT, dtype=torch.int64, device=DEVICE)
    static_slots[:R] = torch.tensor(real_slots, dtype=torch.int64)
    static_slots[B] = 3  # a larger bucket's step left a real slot there: the plan puts the padding slot back
    ctx = types.SimpleNamespace(num_tokens=T, num_seqs=B, snapshot_rows=None, snapshot_ids=None,
                                query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE))
    plan = _StaticExtendPlan(64, 8, torch.device(DEVICE)).fill(ctx, static_slots)
    assert plan.slots.shape == (B + 1,) and plan.padded_bounds.shape == (B + 3,)
    before = dev_pool.layer(layer_id)["recurrent"].clone()
    out = torch.full((T, hv, dv), float("nan"), device=DEVICE)
    TL.recurrent_extend(x["q"], x["k"], x["v"], x["g"], x["beta"], out, dev_pool.layer(layer_id)["recurrent"],
                        plan.slots, plan.padded_bounds, scale, TL.GATE_PER_CHANNEL)
    out = out.cpu()
    assert out[rows:].eq(0).all(), f"{case}: padding rows must be exactly zero"

    eager = torch.full((T, hv, dv), float("nan"), device=DEVICE)
    bounds = torch.tensor(starts[:R + 1], dtype=torch.int64, device=DEVICE)
    TL.recurrent_extend(x["q"], x["k"], x["v"], x["g"], x["beta"], eager, eager_pool.layer(layer_id)["recurrent"],
                        static_slots[:R].clone(), bounds, scale, TL.GATE_PER_CHANNEL)
    assert torch.equal(out[:rows], eager.cpu()[:rows]), f"{case}: real rows differ from the eager launch's"

    state = ref_pool.layer(layer_id)["recurrent"]
    for r, slot in enumerate(real_slots):
        span = slice(starts[r], starts[r + 1])
        want = gated_recurrence(*(x[n][span].cpu() for n in ("q", "k", "v", "g", "beta")), state[slot], scale)
        assert rel_err(out[span], want) <= TOL[torch.float32], f"{case}: request {r} against the reference"
    after = dev_pool.layer(layer_id)["recurrent"].cpu()
    if real_slots:
        assert rel_err(after[real_slots], state[real_slots]) <= STATE_TOL["float32"], (
            f"{case}: states against the reference")
    untouched = [s for s in range(NUM_SLOTS + 1) if s not in real_slots]
    assert PADDING_SLOT in untouched and torch.equal(after[untouched], before.cpu()[untouched])


@in_process
def test_captured_steps_keep_their_first_workspaces():
    """The chunk workspaces of captured steps are made once, for the first (the largest bucket's)
    step, and never regrown under a graph: a larger captured step is refused, naming the sizes."""
    _, dev_pool = make_pools(4)
    tri = TritonLinearBackend(dev_pool, chunk_impl="triton")
    tri.init_capture_state(max_tokens=256, max_seqs=8)
    g = torch.Generator().manual_seed(5)
    for T, refused in ((64, False), (64, False), (128, True)):
        ctx = mode_step(Mode.EXTEND, [(4, 0, 20), (7, 3, 9)], pad_tokens=T - 29, pad_seqs=2)
        tri.init_step_metadata(ctx)
        tri.init_replay_state(ctx, bucket=4)
        x = step_inputs("gdn_core", 0, T, 29, torch.float32, g)
        if refused:
            with pytest.raises(ValueError, match="workspaces hold 64 rows"):
                run_op(tri, ctx, "gdn_core", 0, x, torch.float32, DEVICE)
        else:
            run_op(tri, ctx, "gdn_core", 0, x, torch.float32, DEVICE)
    assert len(tri._graph_workspaces) == 1


@in_process
def test_chunk_impl_is_a_routing_option_kda_keeps_fla():
    from runtime.backends.protocol import BackendSetup

    from compiler.splitops.ops import CallFacts

    assert dict(TritonLinearBackend.capability.options)["chunk_impl"] == ("triton", "fla", "flashinfer")
    _, dev_pool = make_pools(0)
    build = lambda options, calls=(): TritonLinearBackend.build(BackendSetup(None, dev_pool, dev_pool.device, calls,
                                                                             options))
    # an entry routed before the option existed gets the declared default
    assert build({}).chunk_impl == "triton" and build({"chunk_impl": "fla"}).chunk_impl == "fla"
    # FlashInfer's one variant: a layer it cannot run is refused at build, named
    bench = CallFacts("gdn_core", 3, "bfloat16", {"q": (None, 16, 128), "v": (None, 32, 128)}, {})
    fused = CallFacts("gdn_fused", 5, "bfloat16", {"qkv": (None, 8192), "out": (None, 32, 128)}, {"k_heads": 16})
    assert build({"chunk_impl": "flashinfer"}, (bench, fused)).flashinfer_past == 512
    for call in (dataclasses.replace(bench, dtype="float32"), dataclasses.replace(fused, shapes={
            "qkv": (None, 6144), "out": (None, 32, 128)})):
        with pytest.raises(ValueError, match=f"hgc.{call.op} \\(layer {call.layer_id}\\): chunk_impl=flashinfer"):
            build({"chunk_impl": "flashinfer"}, (call,))
    with pytest.raises(ValueError, match="chunk_impl"):
        TritonLinearBackend(dev_pool, chunk_impl="ours")
    fake = compare_mode_steps("kda_core", 2, CHUNK_STEPS[:1], seed=90, backend_kwargs={"chunk_impl": "triton"})
    assert [c[1] for c in fake.calls] == [[0, 70, 75]]


@in_process
def test_gdn_core_alone_takes_flashinfer_past_its_bound():
    """chunk_impl=flashinfer on an unfused GDN layer's core (a route naming gdn_core keeps the region
    unfused): the 11-row extend step past a bound of 8 through FlashInfer's launch (a stand-in over
    the reference, testkit.linear_cases.FakeFlashInferGdn), the 8-row mixed step and the ragged
    verify step on our chunk kernels; outputs, padding rows and states as the reference has them."""
    stand_in = FakeFlashInferGdn()
    fake = compare_mode_steps("gdn_core", 0, MODE_STEPS, seed=91,
                              backend_kwargs={"chunk_impl": "flashinfer", "flashinfer_past": 8, "flashinfer": stand_in})
    assert stand_in.calls == [[0, 6, 11]] and fake.calls == []


# The extend conv's two layouts (ConvConfig.rows): the [token block, channels] tile and row streaming.
CONV_LAYOUTS = pytest.mark.parametrize("rows", [False, True], ids=["tile", "rows"])


@in_process
@CONV_LAYOUTS
@pytest.mark.parametrize("conv_bias,silu", [(False, False), (True, False)])
def test_conv_extend_without_bias_or_silu(conv_bias, silu, rows):
    compare_mode_steps("short_conv", 1, MODE_STEPS[:2], seed=41, conv_bias=conv_bias, silu=silu,
                       conv_extend_rows=rows)


@in_process
@CONV_LAYOUTS
def test_conv_extend_in_bf16(rows):
    compare_mode_steps("short_conv", 0, MODE_STEPS[:2], dtype=torch.bfloat16, seed=42, conv_extend_rows=rows)


@in_process
@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
def test_conv_extend_rows_over_extend_mixed_and_verify_steps(replayed):
    """The row-streaming extend conv through the backend's step chain (eager: extend, mixed, the
    ragged verify step on the extend path; replayed: the static plan's padded table, whose rows past
    a step's blocks return), against the reference; padding rows zero, free slots untouched."""
    steps = REPLAYED_STEPS if replayed else MODE_STEPS
    compare_mode_steps("short_conv", 0, steps, seed=43, backend_kwargs={"chunk_impl": "triton"}, replayed=replayed,
                       conv_extend_rows=True)


@in_process
def test_extend_without_fla_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla -> ImportError, whatever is installed
    for name in [m for m in sys.modules if m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    _, dev_pool = make_pools(0)
    tri = TritonLinearBackend(dev_pool)
    ctx = mode_step(Mode.EXTEND, [(3, 0, 4)])
    x = step_inputs("gdn_core", 0, 4, 4, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(FLANotInstalled, match=r"gpu extra.*fla-core"):
        run_op(tri, ctx, "gdn_core", 0, x, torch.float32, DEVICE)
    run_op(tri, ctx, "short_conv", 0, step_inputs("short_conv", 0, 4, 4, torch.float32,
                                                  torch.Generator().manual_seed(0)), torch.float32, DEVICE)


@in_process
@pytest.mark.parametrize("mode", [Mode.EXTEND, Mode.MIXED])
def test_extend_steps_are_refused_inside_a_replayed_step(mode):
    _, dev_pool = make_pools(0)
    tri = TritonLinearBackend(dev_pool, fla=FakeFLA())
    tri.init_capture_state(max_tokens=8, max_seqs=2)
    ctx = mode_step(mode, [(3, 0, 4), (5, 2, 1)])
    tri.init_replay_state(ctx, bucket=2)
    x = step_inputs("gdn_core", 0, 5, 5, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(WrongModeError, match="run eagerly"):
        run_op(tri, ctx, "gdn_core", 0, x, torch.float32, DEVICE)


@in_process
def test_replayed_verify_step_reads_the_static_slots():
    """target_verify is captured: slots come from the static buffer, n strided launches per op."""
    ref_pool, dev_pool = make_pools(51)
    ref = CPUReferenceBackend(KVPool(REGISTRY, 4, 16), ref_pool)
    tri = TritonLinearBackend(dev_pool, fla=FakeFLA())
    tri.init_capture_state(max_tokens=16, max_seqs=4)
    ctx = mode_step(Mode.TARGET_VERIFY, [(6, 5, 2), (1, 3, 2)], pad_tokens=2, pad_seqs=1)
    tri.init_replay_state(ctx, bucket=3)
    assert tri._step_slots(ctx).data_ptr() == tri._static_slots.data_ptr()
    x = step_inputs("kda_core", 2, 6, 4, torch.float32, torch.Generator().manual_seed(52))
    out = run_op(tri, ctx, "kda_core", 2, x, torch.float32, DEVICE).cpu()
    out_ref = run_op(ref, ctx, "kda_core", 2, x, torch.float32, "cpu")
    assert rel_err(out[:4], out_ref[:4]) <= 1e-4 and out[4:].eq(0).all()
    assert tri._fla.calls == []
    kept, want = dev_pool.verify_buffers[2]["recurrent"].cpu()[:2, :1], ref_pool.verify_buffers[2]["recurrent"][:2, :1]
    assert rel_err(kept, want) <= STATE_TOL["float32"], "the state after each request's first token, in its row"
    ragged = mode_step(Mode.TARGET_VERIFY, [(6, 7, 1), (1, 5, 3)])
    tri.init_replay_state(ragged, bucket=2)
    with pytest.raises(WrongModeError, match="same number of rows"):
        run_op(tri, ragged, "kda_core", 2, step_inputs("kda_core", 2, 4, 4, torch.float32,
                                                       torch.Generator().manual_seed(0)), torch.float32, DEVICE)


# -- the extend conv kernel ---------------------------------------------------------------------

CONV_KERNEL_CASES = {  # id: (K, dtype, bias, silu, sliced, row streaming)
    "K4-f32": (4, torch.float32, True, True, False, False),
    "K4-bf16": (4, torch.bfloat16, True, True, False, False),
    "K4-f32-sliced": (4, torch.float32, True, True, True, False),
    "K6-f32-plain": (6, torch.float32, False, False, False, False),
    "K6-bf16-nobias": (6, torch.bfloat16, False, True, False, False),
    "rows-K4-f32": (4, torch.float32, True, True, False, True),
    "rows-K4-bf16": (4, torch.bfloat16, True, True, False, True),
    "rows-K4-f32-sliced": (4, torch.float32, True, True, True, True),
    "rows-K3-f32-plain": (3, torch.float32, False, False, False, True),
    "rows-K2-bf16-nobias": (2, torch.bfloat16, False, True, False, True),
}


@in_process
@pytest.mark.parametrize("K,dtype,bias,silu,sliced,rows", CONV_KERNEL_CASES.values(), ids=CONV_KERNEL_CASES.keys())
def test_conv_extend_kernel_matches_reference(K, dtype, bias, silu, sliced, rows):
    """The Triton extend conv against the reference's short convolution: requests of 1, K-2, K-1, K
    and three token blocks' worth of tokens in one step, then fewer than K-1 tokens on the same slots;
    40 channels (the tile kernel: two tiles, the second masked; row streaming: one tile of 64, masked).
    States are float32 copies of the inputs on both sides. `sliced`: x a column slice of a wider tensor."""
    many = 2 * TL.CONV_EXTEND_BLOCK_T + 5
    result = check_conv_extend(40, K, dtype, DEVICE, many, seed=60 + K, bias=bias, silu=silu, sliced=sliced,
                               rows=rows)
    assert conv_extend_ok(result, out_tol=1e-6 if dtype == torch.float32 else 1e-2), result


@in_process
@pytest.mark.parametrize("K", [2, 3, 4])
def test_conv_extend_rows_equal_the_tile_bit_for_bit(K):
    """Row streaming adds the taps in the tile kernel's order in float32: outputs, new histories and
    snapshots equal the tile kernel's bit for bit, whatever the channel tile (two tiles of 32, one
    of 256 mostly masked, conv_extend_rows_config's), for a column-sliced x too."""
    want = conv_extend_launch(TL.ConvConfig(32, 1), K, 40, DEVICE)
    assert torch.isfinite(want[0]).all() and want[2][1:].abs().sum() > 0
    for config, sliced in ((TL.ConvConfig(32, 1, rows=True), False), (TL.ConvConfig(256, 1, rows=True), True),
                           (TL.conv_extend_rows_config(40), False)):
        got = conv_extend_launch(config, K, 40, DEVICE, sliced=sliced)
        for name, a, b in zip(("outputs", "histories", "snapshots"), got, want):
            assert torch.equal(a, b), (config, sliced, name)


@in_process
def test_conv_extend_rows_write_snapshots_as_a_launch_of_the_prefix_alone(monkeypatch):
    """testkit's snapshot check of the extend conv (tests/runtime/backends/test_triton_step_snapshots.py)
    with the row-streaming kernel as the launcher's choice."""
    from testkit.snapshot_cases import check_conv_snapshots

    monkeypatch.setattr(TL, "conv_extend_config", lambda blocks, channels, device: TL.conv_extend_rows_config(channels))
    got = check_conv_snapshots(24, 4, torch.float32, DEVICE)
    assert got == {"outputs_same": True, "slots_same": True, "snapshots_exact": True, "unasked_ids_zero": True}


@in_process
def test_conv_extend_rows_refuse_a_kernel_wider_than_4_the_tile_takes_it():
    """Row streaming keeps K-1 <= 3 earlier inputs in registers: K 5 is refused in one line naming
    the width and the layer; the tile kernel runs it (ones in, sums of up to 5 ones out)."""
    with pytest.raises(ValueError, match=r"^layer 3: kernel width 5 is not supported by the row-streaming") as err:
        TL.short_conv_extend(torch.zeros(4, 8), torch.zeros(8, 5), None, torch.zeros(4, 8), torch.zeros(2, 8, 4),
                             torch.tensor([1]), torch.tensor([0, 4, 4]), torch.tensor([[0, 0]]), True,
                             what="layer 3", config=TL.ConvConfig(32, 1, rows=True))
    assert "\n" not in str(err.value)
    out = torch.full((4, 8), float("nan"), device=DEVICE)
    TL.short_conv_extend(torch.ones(4, 8, device=DEVICE), torch.ones(8, 5, device=DEVICE), None, out,
                         torch.zeros(2, 8, 4, device=DEVICE), torch.tensor([1], device=DEVICE),
                         torch.tensor([0, 4, 4], device=DEVICE), torch.tensor([[0, 0]], device=DEVICE), False,
                         config=TL.ConvConfig(32, 1))
    assert out[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_row_streaming_tiles_are_1024_channels_or_the_layers_width():
    """8 channels a thread, a warp per 256 channels; a layer narrower than 1024 its own width."""
    cpu = torch.device("cpu")
    assert TL.conv_extend_rows_config(8192) == TL.ConvConfig(1024, 4, rows=True)
    assert TL.conv_extend_rows_config(300) == TL.ConvConfig(512, 2, rows=True)  # next_pow2(300) = 512
    assert TL.conv_extend_rows_config(24) == TL.ConvConfig(32, 1, rows=True)  # a tiny layer: its own width
    assert TL.conv_extend_config(129, 8192, cpu) == TL.ConvConfig(128, 4)  # the launcher's own default: the tile
    assert TritonLinearBackend.conv_extend_rows is None  # the backend's: by the step's length


class CountingKernel:
    """Stands in for a @triton.jit kernel's `kernel[grid]`: records each grid, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def _conv_extend_step():
    """(backend, ctx, inputs) of a planned 44-row extend step: requests of 40 and 1 new tokens, 3 padding rows."""
    _, dev_pool = make_pools(0)
    tri = TritonLinearBackend(dev_pool)
    ctx = mode_step(Mode.EXTEND, [(3, 0, 40), (5, 2, 1)], pad_tokens=3, pad_seqs=1)
    plan_eager_step(tri, ctx, 64)
    return tri, ctx, step_inputs("short_conv", 1, 44, 41, torch.float32, torch.Generator().manual_seed(0))


@in_process
def test_conv_extend_is_one_launch_and_refuses_what_it_cannot_run_naming_the_layer(monkeypatch):
    launches = CountingKernel(TL._SHORT_CONV_EXTEND)  # the backend's layout for a short step
    monkeypatch.setattr(TL, "_SHORT_CONV_EXTEND", launches)
    tri, ctx, x = _conv_extend_step()
    run_op(tri, ctx, "short_conv", 1, x, torch.float32, DEVICE)
    # (2 blocks of request 0, 1 of request 1, 1 of padding rows) x one tile of 24 channels
    assert launches.grids == [(4, 1)]
    with pytest.raises(ValueError, match=r"hgc.short_conv \(layer 1\).*kernel width 34"):
        tri.short_conv(ctx, x["x"].to(DEVICE), torch.zeros(C, TL.CONV_EXTEND_BLOCK_T + 2, device=DEVICE), None,
                       torch.empty(44, C, device=DEVICE), 1, True)
    with pytest.raises(ValueError, match=r"hgc.short_conv \(layer 2\) got 40 rows for a step of 44"):
        tri.short_conv(ctx, x["x"][:40].to(DEVICE), CONV_WEIGHT.to(DEVICE), None, torch.empty(40, C, device=DEVICE),
                       2, True)
    assert len(launches.grids) == 1


@in_process
def test_a_step_of_conv_extend_rows_min_tokens_rows_takes_the_row_streaming_conv(monkeypatch):
    """The backend's default layout by the step's padded rows: the same 44-row step as above (4 block
    rows for 2 filled) takes the row-streaming kernel once the bound is 44 (CONV_EXTEND_ROWS_MIN_TOKENS),
    the tile below it."""
    rows, tile = CountingKernel(TL._SHORT_CONV_EXTEND_ROWS), CountingKernel(TL._SHORT_CONV_EXTEND)
    monkeypatch.setattr(TL, "_SHORT_CONV_EXTEND_ROWS", rows)
    monkeypatch.setattr(TL, "_SHORT_CONV_EXTEND", tile)
    tri, ctx, x = _conv_extend_step()
    for bound in (45, 44):
        monkeypatch.setattr(TL, "CONV_EXTEND_ROWS_MIN_TOKENS", bound)
        run_op(tri, ctx, "short_conv", 1, x, torch.float32, DEVICE)
    assert tile.grids == [(4, 1)] and rows.grids == [(4, 1)]


@in_process
def test_a_short_step_over_a_table_of_many_block_rows_takes_the_row_streaming_conv(monkeypatch):
    """Five one-token requests and three padding rows: 8 rows fill one block, the table has 6 block
    rows (one a request, one the padding's), so the short step takes the row-streaming kernel, and
    gives what the tile kernel gives."""
    rows, tile = CountingKernel(TL._SHORT_CONV_EXTEND_ROWS), CountingKernel(TL._SHORT_CONV_EXTEND)
    monkeypatch.setattr(TL, "_SHORT_CONV_EXTEND_ROWS", rows)
    monkeypatch.setattr(TL, "_SHORT_CONV_EXTEND", tile)
    outs = []
    for layout in (None, False):
        _, dev_pool = make_pools(0)
        tri = TritonLinearBackend(dev_pool)
        tri.conv_extend_rows = layout
        ctx = mode_step(Mode.EXTEND, [(slot, 3, 1) for slot in (1, 2, 4, 5, 7)], pad_tokens=3, pad_seqs=1)
        plan_eager_step(tri, ctx, 64)
        x = step_inputs("short_conv", 1, 8, 5, torch.float32, torch.Generator().manual_seed(1))
        outs.append((run_op(tri, ctx, "short_conv", 1, x, torch.float32, DEVICE).cpu(),
                     dev_pool.buffers[1]["conv"].cpu().clone()))
    assert rows.grids == [(6, 1)] and tile.grids == [(6, 1)]
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_extend_conv_takes_rows_by_the_steps_rows_and_its_tables_length():
    """The measured layouts of bench qwen3_next's 512-token bucket: 273 block rows (256 requests) take
    the row kernel, 18 (one request) the tile; 4096 rows the row kernel whatever the table; a kernel
    wider than CONV_EXTEND_ROWS_MAX_K never."""
    assert TL.conv_extend_takes_rows(512, 273, 4) and not TL.conv_extend_takes_rows(512, 18, 4)
    assert TL.conv_extend_takes_rows(4096, 130, 4) and TL.conv_extend_takes_rows(2048, 66, 2)
    assert not TL.conv_extend_takes_rows(512, 273, TL.CONV_EXTEND_ROWS_MAX_K + 1)
    assert not TL.conv_extend_takes_rows(512, 32, 4) and TL.conv_extend_takes_rows(512, 33, 4)


# -- host work per layer ---------------------------------------------------------------------------

# and the host-to-device helpers the backend copies its plan with (runtime/step/host_copy.py)
BACKEND_FILES = {str(Path(TL.__file__).resolve()),
                 str(Path(sys.modules[TritonLinearBackend.__module__].__file__).resolve()),
                 str(Path(sys.modules["runtime.step.host_copy"].__file__).resolve())}


class HostWork:
    """Counts, by kind, the host work the backend's own code does (its module and the kernels' launchers;
    not Triton's interpreter or the FLA stand-in): host tensors made, device moves, device reads, and
    walks over the step's per-request lists."""

    KINDS = {"host tensor": [(torch, "tensor"), (torch, "as_tensor"), (torch, "from_numpy")],
             "device read": [(torch.Tensor, n) for n in ("tolist", "item", "cpu", "numpy", "__int__", "__index__",
                                                         "__bool__", "__float__", "__iter__")]}

    def __init__(self, monkeypatch):
        self.counts: dict[str, int] = {}
        for kind, targets in self.KINDS.items():
            for owner, name in targets:
                monkeypatch.setattr(owner, name, self._counting(kind, getattr(owner, name)))
        to = torch.Tensor.to

        def moving_to(t, *args, **kw):
            if "device" in kw or any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args):
                self._note("device move")
            return to(t, *args, **kw)
        monkeypatch.setattr(torch.Tensor, "to", moving_to)

    def _note(self, kind: str) -> None:
        if sys._getframe(2).f_code.co_filename in BACKEND_FILES:
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def _counting(self, kind, fn):
        def wrapper(*args, **kw):
            self._note(kind)
            return fn(*args, **kw)
        return wrapper

    def take(self) -> dict[str, int]:
        counts, self.counts = self.counts, {}
        return counts


class WalkCountingList(list):
    """A per-request list of the step that counts every walk over it (len() is free)."""

    def __init__(self, items, work: HostWork):
        super().__init__(items)
        self.work = work

    def __iter__(self):
        self.work.counts["request walk"] = self.work.counts.get("request walk", 0) + 1
        return super().__iter__()

    def __getitem__(self, i):
        self.work.counts["request walk"] = self.work.counts.get("request walk", 0) + 1
        return super().__getitem__(i)


def host_work_of_a_step(monkeypatch, mode: Mode, reqs, pad_tokens: int, pad_seqs: int, **backend_kwargs):
    """Plan one step of `reqs` on the backend, then run every linear op of every layer: the plan's
    host work, and each op call's."""
    _, dev_pool = make_pools(70)
    tri = TritonLinearBackend(dev_pool, fla=FakeFLA(), **backend_kwargs)
    ctx = mode_step(mode, reqs, pad_tokens, pad_seqs)
    R, T = ctx.num_real_tokens, ctx.num_tokens
    inputs = {(op, lid): step_inputs(op, lid, T, R, torch.float32, torch.Generator().manual_seed(lid))
              for op, lid in OPS + [("short_conv", lid) for lid in LAYERS if lid != 0]}
    work = HostWork(monkeypatch)
    ctx.query_lens = WalkCountingList(ctx.query_lens, work)
    ctx.cache_lens = WalkCountingList(ctx.cache_lens, work)
    plan_eager_step(tri, ctx, 64)
    plan = work.take()
    per_op = {}
    for (op, lid), x in inputs.items():
        run_op(tri, ctx, op, lid, x, torch.float32, DEVICE)
        per_op[(op, lid)] = work.take()
    return plan, per_op


@in_process
@pytest.mark.parametrize("mode,reqs,pad_tokens,pad_seqs", [
    (Mode.EXTEND, [(4, 0, 6)], 2, 1),
    (Mode.EXTEND, [(4, 0, 6), (7, 9, 5), (2, 3, 70), (9, 0, 1)], 3, 1),
    (Mode.MIXED, [(4, 6, 4), (7, 14, 1), (2, 0, 3), (9, 5, 1)], 2, 1),
    (Mode.TARGET_VERIFY, [(4, 13, 2), (2, 6, 3), (7, 1, 1), (9, 0, 4)], 0, 0),  # ragged: the extend path
    (Mode.TARGET_VERIFY, [(4, 13, 2), (2, 6, 2)], 0, 0),  # uniform: decode kernels (slow in the interpreter)
], ids=["extend-1", "extend-4", "mixed-4", "verify-ragged-4", "verify-uniform-2"])
def test_op_calls_do_no_host_work_that_scales_with_the_step(monkeypatch, mode, reqs, pad_tokens, pad_seqs):
    """Plan once per step, launch lean: after the step's hooks, no op call of any layer makes a host
    tensor, moves one to the device, reads the device or walks the step's requests; the plan makes
    its tables with one copy to the device, whatever the batch."""
    plan, per_op = host_work_of_a_step(monkeypatch, mode, reqs, pad_tokens, pad_seqs)
    assert all(work == {} for work in per_op.values()), {k: v for k, v in per_op.items() if v}
    assert len(per_op) == len(LAYERS) + len(OPS) - 1
    extend_path = mode != Mode.TARGET_VERIFY or len({n for *_, n in reqs}) > 1
    assert plan.get("device move", 0) == (1 if extend_path else 0), plan


@in_process
def test_our_chunk_kernels_do_no_host_work_that_scales_with_the_step(monkeypatch):
    """chunk_impl="triton": the chunk table is one more part of the plan's one copy; op calls stay lean."""
    plan, per_op = host_work_of_a_step(monkeypatch, Mode.EXTEND, [(4, 0, 6), (7, 9, 5), (2, 3, 70), (9, 0, 1)], 3, 1,
                                       chunk_impl="triton")
    assert all(work == {} for work in per_op.values()), {k: v for k, v in per_op.items() if v}
    assert plan.get("device move", 0) == 1, plan
