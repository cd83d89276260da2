"""hgc.gdn_fused on triton_linear (runtime/backends/kernels/gdn_fused.py) against the unfused ops.

The reference is the model's own sequence (testkit/gdn_cases.py `unfused_gdn`: the CPU reference
backend's short_conv and gdn_core, float32 inside, with the model's l2norm, gates and
GatedRMSNorm between them) on a host copy of the same pools; the kernels run in Triton's
interpreter on the CPU (testkit/triton_interpreter.py). Every check draws fresh random inputs as
views of one wider projection row (strided qkv, z, b, a), poisons outputs and padding rows, starts
from non-zero states, and compares the real rows' outputs and the touched slots' conv and
recurrent states by ||x - ref|| / ||ref||; padding rows must come out zero and no other slot may
change. (The interpreter truncates float32 to bfloat16 where torch rounds to nearest, so in bf16
the kernels' own roundings of q, k, v, beta and the norm sit up to one bf16 step from the
reference's, every one biased the same way: interpreted bf16 tolerances are a few bf16 steps,
float32 ones the float32 noise of another order of sums.) The GPU versions at the bench dims are
tests/gpu/test_gpu_gdn_fused.py.
"""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, INTERPRETED, interpreter_or_fresh_process  # noqa: E402,F401

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from compiler.splitops import Mode, OpCapture  # noqa: E402
from runtime.backends.cpu_reference import CPUReferenceBackend  # noqa: E402
from runtime.backends.kernels import gdn_fused as GF  # noqa: E402
from runtime.backends.protocol import check_backend, plan_eager_step  # noqa: E402
from runtime.backends.triton_linear import TritonLinearBackend  # noqa: E402
from runtime.cache.state_pool import PADDING_SLOT  # noqa: E402
from testkit.gdn_cases import (BENCH_GDN, DECODE_PATHS, GdnShape, fused_gdn, gdn_inputs, gdn_params,  # noqa: E402
                               gdn_pools, take_decode_path, unfused_gdn)
from testkit.linear_cases import FakeFLA, FakeFlashInferGdn, decode_ctx, rel_err, step_ctx  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

LAYERS = {
    0: GdnShape(2, 4, 16, 16),  # two value heads per key head
    1: GdnShape(2, 4, 12, 20),  # head dims that are no powers of two: masked tails
    2: GdnShape(4, 4, 16, 16),  # one value head per key head
}
NUM_SLOTS = 10
EPS = 1e-6
VERIFY = dict(draft_tokens=3, verify_rows=4)
# bf16 in the interpreter: each of the chain's roundings (conv output, q, k, beta, core, norm,
# weight * norm, out) truncates there, a bias of half a bf16 step each against torch's rounding
BF16_STEPS = 4 if INTERPRETED else 1
OUT_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2 * BF16_STEPS}
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3 * BF16_STEPS}


class Case:
    """One layer's reference and device pools and backends, stepped together."""

    def __init__(self, layer_id: int, dtype, seed: int, backend_kwargs=None, norm_dtype=None, shape=None,
                 state_dtype="float32"):
        self.layer_id, self.dtype = layer_id, dtype
        self.shape = shape or LAYERS[layer_id]
        self.ref_pool, self.dev_pool = gdn_pools({layer_id: self.shape}, NUM_SLOTS, DEVICE, seed, VERIFY,
                                                 state_dtype=state_dtype)
        for pool in (self.ref_pool, self.dev_pool):
            for t in pool.layer(layer_id).values():
                t[4].zero_()  # slot 4: a request that starts from the empty state
        self.before = {name: t.cpu().clone() for name, t in self.dev_pool.layer(layer_id).items()}
        self.ref = CPUReferenceBackend(None, self.ref_pool)
        self.tri = TritonLinearBackend(self.dev_pool, fla=FakeFLA(), **(backend_kwargs or {}))
        self.params = gdn_params(self.shape, dtype, seed + 1, norm_dtype=norm_dtype)
        self.g = torch.Generator().manual_seed(seed + 2)
        self.touched: set[int] = set()

    def step(self, ctx_ref, ctx_dev, slots_used, prepare=None) -> None:
        """One step on both sides: outputs, padding rows, states."""
        R, T = ctx_ref.num_real_tokens, ctx_ref.num_tokens
        x = gdn_inputs(self.shape, T, R, self.dtype, self.g)
        s = self.shape
        out_ref = torch.full((T, s.hv, s.dv), float("nan"), dtype=self.dtype)
        unfused_gdn(self.ref, ctx_ref, x, self.params, out_ref, self.layer_id, s, EPS)
        if prepare is not None:
            prepare(self.tri, ctx_dev)
        out = torch.full((T, s.hv, s.dv), float("nan"), dtype=self.dtype, device=DEVICE)
        fused_gdn(self.tri, ctx_dev, {k: v.to(DEVICE) for k, v in x.items()}, self.params.to(DEVICE), out,
                  self.layer_id, s, EPS)
        out = out.cpu()
        what = f"layer {self.layer_id} {self.dtype} {ctx_ref.mode} {ctx_ref.query_lens}"
        assert torch.isfinite(out).all(), f"{what}: rows left unwritten (NaN poison survived)"
        real = real_rows(ctx_ref)
        assert out[~real].eq(0).all(), f"{what}: padding rows must be zero"
        err = rel_err(out[real], out_ref[real])
        assert err <= OUT_TOL[self.dtype], f"{what}: out rel err {err:.2e}"
        self.touched |= set(slots_used)
        rows = sorted(self.touched)
        for entry in ("conv", "recurrent"):
            s_err = rel_err(self.dev_pool.layer(self.layer_id)[entry].cpu()[rows],
                            self.ref_pool.layer(self.layer_id)[entry][rows])
            assert s_err <= STATE_TOL[self.dtype], f"{what}: {entry} state rel err {s_err:.2e}"

    def check_untouched(self) -> None:
        untouched = [s for s in range(NUM_SLOTS + 1) if s not in self.touched]
        assert PADDING_SLOT in untouched
        for name, t in self.dev_pool.layer(self.layer_id).items():
            assert torch.equal(t.cpu()[untouched], self.before[name][untouched]), f"a free slot's {name} written"
            assert not torch.equal(t.cpu()[sorted(self.touched)], self.before[name][sorted(self.touched)])


def real_rows(ctx) -> torch.Tensor:
    """[T] bool: the rows of real requests' tokens (the step's first rows)."""
    mask = torch.zeros(ctx.num_tokens, dtype=torch.bool)
    mask[:ctx.num_real_tokens] = True
    return mask


# (rows, real requests, slots): slots out of row order, padding rows at the end
DECODES = {1: ([5], 1), 3: ([7, 2, PADDING_SLOT], 2), 6: ([4, 9, 1, 6, PADDING_SLOT, PADDING_SLOT], 4)}


@in_process
@pytest.mark.parametrize("choice", ["own", *DECODE_PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("batch", list(DECODES))
@pytest.mark.parametrize("layer_id", list(LAYERS))
def test_decode_steps_match_the_unfused_ops(layer_id, batch, dtype, choice, monkeypatch):
    """Each batch on the op's own choice of launches, and on each of its paths: the two-launch
    split, the one launch, the four launches of the unfused kernels."""
    if choice != "own":
        if dtype == torch.bfloat16:
            pytest.skip("each path in float32; bf16 on the op's own choice")
        take_decode_path(monkeypatch, choice, batch)
    slots, num_real = DECODES[batch]
    case = Case(layer_id, dtype, seed=10 * layer_id + batch)
    for _ in range(2):  # the second step from the states the first wrote
        case.step(decode_ctx(slots, num_real, "cpu"), decode_ctx(slots, num_real, DEVICE), slots[:num_real])
    case.check_untouched()


@in_process
@pytest.mark.parametrize("choice", list(DECODE_PATHS))
def test_decode_paths_over_bfloat16_states(choice, monkeypatch):
    """Recurrent states kept in bfloat16 (--state-dtype) on each decode path: every kernel reads the
    state into float32 and rounds the one it stores, as the unfused ops over the reference do."""
    slots, num_real = DECODES[6]
    if GF.decode_launches(6) != DECODE_PATHS[choice][0]:  # else the op's own choice is this path
        take_decode_path(monkeypatch, choice, 6)
    case = Case(0, torch.bfloat16, seed=70, state_dtype="bfloat16")
    for _ in range(2):  # the second step from the state the first rounded
        case.step(decode_ctx(slots, num_real, "cpu"), decode_ctx(slots, num_real, DEVICE), slots[:num_real])
    case.check_untouched()


@in_process
def test_decode_with_a_float32_norm_weight_keeps_the_product_in_float32():
    """torch multiplies a float32 weight by the bf16 norm in float32 (no rounding to bf16 between)."""
    case = Case(0, torch.bfloat16, seed=3, norm_dtype=torch.float32)
    slots = [3, 8]
    case.step(decode_ctx(slots, 2, "cpu"), decode_ctx(slots, 2, DEVICE), slots)


@in_process
def test_padding_row_between_real_rows():
    """A padding row anywhere (not only at the end) is zero and keeps its inputs unread."""
    case = Case(0, torch.float32, seed=5)
    slots = [7, PADDING_SLOT, 2]
    ctx = decode_ctx(slots, 3, DEVICE)
    x = gdn_inputs(case.shape, 3, 3, torch.float32, case.g, DEVICE)
    x["qkv"][1] = float("nan")
    x["z"][1] = float("nan")
    out = torch.full((3, case.shape.hv, case.shape.dv), float("nan"), device=DEVICE)
    fused_gdn(case.tri, ctx, x, case.params.to(DEVICE), out, 0, case.shape, EPS)
    assert out[1].eq(0).all() and torch.isfinite(out).all()


@in_process
def test_decode_at_the_bench_dims_in_bf16():
    """One decode step at Qwen3-Next's dims (Hk 16, Hv 32, D 128, K 4), batch 1, bf16."""
    case = Case(0, torch.bfloat16, seed=7, shape=BENCH_GDN)
    case.step(decode_ctx([3], 1, "cpu"), decode_ctx([3], 1, DEVICE), [3])


# The split's value blocks: each (request, value head) over v_blocks programs of Dv / v_blocks
# columns, the last to finish normalising the head (None: the op's default, 1 at these Dv)
V_BLOCKS = [1, 2, 4, None]


def _split_with_v_blocks(monkeypatch, v_blocks) -> list:
    """Every decode step from here on takes the two-launch split with `v_blocks`; returns the core
    launches' grids."""
    monkeypatch.setattr(GF, "SPLIT_DECODE_MAX_ROWS", 1 << 20)
    real = GF.gdn_fused_decode
    monkeypatch.setattr(GF, "gdn_fused_decode", lambda *a, **kw: real(*a, **kw, v_blocks=v_blocks))
    grids = []
    launch = GF._SPLIT_CORE.launch
    monkeypatch.setattr(GF._SPLIT_CORE, "launch", lambda *a: (grids.append(a[0]), launch(*a))[1])
    return grids


def _counters_zero() -> bool:
    return all(not scratch.arrived.any() for scratch in GF._SPLIT_SCRATCH.values())


@in_process
@pytest.mark.parametrize("v_blocks", V_BLOCKS, ids=lambda n: f"v{n}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layer_id", [0, 1])
def test_split_decode_over_value_blocks_matches_the_unfused_ops(layer_id, dtype, v_blocks, monkeypatch):
    """The split in two launches (split_decode=two_launches): outputs and states against the
    reference, padding rows zero, over consecutive steps (each launch finds the counters its
    predecessor left at zero); Dv 20 in blocks of 10 and 5 columns."""
    grids = _split_with_v_blocks(monkeypatch, v_blocks)
    s = LAYERS[layer_id]
    case = Case(layer_id, dtype, seed=40 + layer_id, backend_kwargs={"split_decode": "two_launches"})
    for slots, num_real in (DECODES[3], DECODES[6], DECODES[3]):
        case.step(decode_ctx(slots, num_real, "cpu"), decode_ctx(slots, num_real, DEVICE), slots[:num_real])
        assert _counters_zero(), "a launch left a counter non-zero"
    case.check_untouched()
    blocks = v_blocks or GF.default_v_blocks(3, s.hv, s.dv, 132)
    assert [g[2] if len(g) == 3 else 1 for g in grids] == [blocks] * 3


@in_process
@pytest.mark.parametrize("v_blocks", [2, None], ids=lambda n: f"v{n}")
def test_split_decode_by_default_splits_wide_heads(v_blocks, monkeypatch):
    """Dv 64 at three requests, the split in two launches: by default 2 blocks of 32 columns (24
    programs, fewer than the SMs)."""
    grids = _split_with_v_blocks(monkeypatch, v_blocks)
    case = Case(0, torch.float32, seed=47, shape=GdnShape(2, 4, 16, 64),
                backend_kwargs={"split_decode": "two_launches"})
    for _ in range(2):
        slots, num_real = DECODES[3]
        case.step(decode_ctx(slots, num_real, "cpu"), decode_ctx(slots, num_real, DEVICE), slots[:num_real])
    assert grids == [(3, 4, 2)] * 2 and _counters_zero()


@in_process
def test_split_value_blocks_padding_row_between_real_rows(monkeypatch):
    """A padding row's blocks write zeros, read nothing and count nothing in."""
    _split_with_v_blocks(monkeypatch, 4)
    case = Case(0, torch.float32, seed=5)
    x = gdn_inputs(case.shape, 3, 3, torch.float32, case.g, DEVICE)
    x["qkv"][1] = float("nan")
    x["z"][1] = float("nan")
    out = torch.full((3, case.shape.hv, case.shape.dv), float("nan"), device=DEVICE)
    fused_gdn(case.tri, decode_ctx([7, PADDING_SLOT, 2], 3, DEVICE), x, case.params.to(DEVICE), out, 0, case.shape, EPS)
    assert out[1].eq(0).all() and torch.isfinite(out).all() and _counters_zero()


def _conv_counters_zero() -> bool:
    from runtime.backends.kernels.arrivals import arrival_counters

    return not arrival_counters(DEVICE, 1, "gdn_fused split").any()


# (layer, dtype, value blocks, split_decode): two value heads a key head in blocks and whole, masked
# head dims, one value head a key head, and bf16 on the default blocks; the early gates on two of them
SPLIT_ONE_CASES = [(0, torch.float32, 2, "one_launch"), (0, torch.bfloat16, None, "one_launch"),
                   (1, torch.float32, None, "one_launch"), (2, torch.float32, 1, "one_launch"),
                   (0, torch.bfloat16, 2, "one_launch_early"), (1, torch.float32, None, "one_launch_early")]


@in_process
@pytest.mark.parametrize("layer_id,dtype,v_blocks,split_decode", SPLIT_ONE_CASES,
                         ids=[f"layer{c[0]}-{str(c[1])[6:]}-v{c[2]}-{c[3]}" for c in SPLIT_ONE_CASES])
def test_the_split_in_one_launch_matches_the_unfused_ops(layer_id, dtype, v_blocks, split_decode, monkeypatch):
    """split_decode="one_launch" (and "one_launch_early", its gates loaded first): each program of
    the second launch does the first's conv and l2norm for what it reads, the last of a key head's
    programs rolling its q and k history. Outputs and both states against the reference over
    consecutive steps (each step's conv reads the history the one before rolled), padding rows zero,
    no other slot written, every counter back at zero; one kernel launched a step, none of the
    split's two, with the route's order of the gates' loads."""
    grids = _split_with_v_blocks(monkeypatch, v_blocks)
    counts = _count_launches(monkeypatch)
    one = []
    launch = GF._SPLIT_ONE.launch
    monkeypatch.setattr(GF._SPLIT_ONE, "launch", lambda *a: (one.append(a[2]["EARLY_GATES"]), launch(*a))[1])
    case = Case(layer_id, dtype, seed=60 + layer_id, backend_kwargs={"split_decode": split_decode})
    steps = (DECODES[3], DECODES[6], DECODES[3])
    for slots, num_real in steps:
        case.step(decode_ctx(slots, num_real, "cpu"), decode_ctx(slots, num_real, DEVICE), slots[:num_real])
        assert _counters_zero() and _conv_counters_zero(), "a launch left a counter non-zero"
    case.check_untouched()
    assert counts["prep"] == counts["core"] == grids == []
    assert one == [split_decode == "one_launch_early"] * len(steps), "the route's gates order not launched"


@in_process
@pytest.mark.parametrize("v_blocks", [1, 4])
def test_the_split_in_one_launch_gives_the_splits_bits(v_blocks):
    """The same step through the split's two launches, its one launch and its one launch with the
    gates loaded first (early_gates), on copies of the same states: the output and both states the
    same bits (the same rounding at the same places)."""
    case = Case(0, torch.float32, seed=71)
    s, p = case.shape, case.params.to(DEVICE)
    x = gdn_inputs(s, 3, 3, torch.float32, case.g, DEVICE)
    slots = torch.tensor([7, PADDING_SLOT, 2], device=DEVICE)
    layer = case.dev_pool.layer(0)
    results = []
    for merged, early in ((False, False), (True, False), (True, True)):
        conv, state = layer["conv"].clone(), layer["recurrent"].clone()
        out = torch.full((3, s.hv, s.dv), float("nan"), device=DEVICE)
        GF.gdn_fused_decode(x["qkv"], x["z"], x["b"], x["a"], p.conv_weight, p.A_log, p.dt_bias, p.norm_weight, out,
                            conv, state, slots, s.hk, s.scale, EPS, launches=2, v_blocks=v_blocks,
                            merged_split=merged, early_gates=early)
        results.append((out.cpu(), conv.cpu(), state.cpu()))
    assert not torch.equal(results[0][2], layer["recurrent"].cpu()), "the step changed the states"
    for name, split, merged, early in zip(("out", "conv", "state"), *results):
        assert torch.equal(merged, split) and torch.equal(early, split), name
    assert results[0][0][1].eq(0).all(), "the padding row"
    with pytest.raises(ValueError, match="merged_split merges the split's two launches; this call takes 1"):
        GF.gdn_fused_decode(x["qkv"], x["z"], x["b"], x["a"], p.conv_weight, p.A_log, p.dt_bias, p.norm_weight, out,
                            conv, state, slots, s.hk, s.scale, EPS, launches=1, merged_split=True)
    with pytest.raises(ValueError, match="early_gates is the merged split's"):
        GF.gdn_fused_decode(x["qkv"], x["z"], x["b"], x["a"], p.conv_weight, p.A_log, p.dt_bias, p.norm_weight, out,
                            conv, state, slots, s.hk, s.scale, EPS, launches=2, early_gates=True)
    with pytest.raises(ValueError, match="split_decode must be one of"):
        Case(0, torch.float32, seed=1, backend_kwargs={"split_decode": "fused"})


def test_default_v_blocks_fill_the_sms_with_blocks_of_at_least_32_columns():
    assert GF.default_v_blocks(1, 32, 128, 132) == 4  # bench qwen3_next at batch 1: 128 programs, the most
    assert GF.default_v_blocks(2, 32, 128, 132) == 4  # 64 whole heads: the fewest blocks past 132 programs
    assert GF.default_v_blocks(3, 32, 128, 132) == 2
    assert GF.default_v_blocks(8, 32, 128, 132) == 1
    assert GF.default_v_blocks(1, 4, 96, 132) == 2  # 48 columns; 24 would be too narrow
    assert GF.default_v_blocks(1, 4, 20, 132) == 1


@in_process
@pytest.mark.parametrize("v_blocks, launches", [(3, 2), (0, 2), (2, 1)])
def test_value_blocks_that_do_not_divide_dv_or_without_the_split_are_refused(v_blocks, launches):
    case = Case(0, torch.float32, seed=1)
    s, p = case.shape, case.params.to(DEVICE)
    x = gdn_inputs(s, 1, 1, torch.float32, case.g, DEVICE)
    layer = case.dev_pool.layer(0)
    with pytest.raises(ValueError, match=f"v_blocks {v_blocks}: .*divides Dv {s.dv}"):
        GF.gdn_fused_decode(x["qkv"], x["z"], x["b"], x["a"], p.conv_weight, p.A_log, p.dt_bias, p.norm_weight,
                            torch.empty(1, s.hv, s.dv, device=DEVICE), layer["conv"], layer["recurrent"],
                            torch.tensor([3], device=DEVICE), s.hk, s.scale, EPS, launches=launches, v_blocks=v_blocks)


def test_split_scratch_is_allocated_zeroed_grown_and_never_grown_under_capture(monkeypatch):
    monkeypatch.setattr(GF, "_SPLIT_SCRATCH", {})
    monkeypatch.setattr(GF, "_RETIRED_SCRATCH", [])
    first = GF.split_scratch(DEVICE, 8, 16)
    assert first.arrived.shape == (8,) and first.arrived.dtype == torch.int32 and not first.arrived.any()
    assert first.o_ws.shape == (8 * 16,) and first.o_ws.dtype == torch.float32
    assert GF.split_scratch(DEVICE, 4, 16) is first  # room enough: the same buffers
    monkeypatch.setattr(GF, "_capturing", lambda device: True)
    with pytest.raises(RuntimeError, match=r"hold 8 pairs, 128 workspace floats; this step needs 16 .* 16 columns"):
        GF.split_scratch(DEVICE, 16, 16)
    assert GF.split_scratch(DEVICE, 8, 16) is first  # no growth: fine under capture
    monkeypatch.setattr(GF, "_capturing", lambda device: False)
    grown = GF.split_scratch(DEVICE, 16, 16)
    assert grown.arrived.shape == (16,) and grown.o_ws.shape == (256,)
    assert GF._RETIRED_SCRATCH == [first]  # a graph captured over it keeps its memory


def _count_launches(monkeypatch, unfused_ok: bool = False) -> dict:
    """Launches per decode kernel of the op from here on; the l2norm-and-gates and norm kernels
    (the four-launch path's) fail the test unless `unfused_ok`."""
    counts = {"one": [], "prep": [], "core": [], "gates": [], "norm": []}
    launchers = [("one", GF._GDN_FUSED_DECODE), ("prep", GF._SPLIT_PREP), ("core", GF._SPLIT_CORE)]
    if unfused_ok:
        launchers += [("gates", GF._QK_GATES), ("norm", GF._GATED_RMSNORM)]
    else:
        for name in ("_QK_GATES", "_GATED_RMSNORM"):
            monkeypatch.setattr(getattr(GF, name), "launch",
                                lambda *a: pytest.fail("a non-decode kernel in a decode step"))
    for name, launcher in launchers:
        real = launcher.launch
        monkeypatch.setattr(launcher, "launch", lambda *a, _n=name, _r=real: (counts[_n].append(a[0]), _r(*a))[1])
    return counts


@in_process
@pytest.mark.parametrize("decode_tiles", ["by_batch", "fixed"])
def test_one_request_takes_the_split_unless_tiles_are_fixed(monkeypatch, decode_tiles):
    """Batch 1 (SPLIT_DECODE_MAX_ROWS) with split_decode=two_launches: the split's two launches,
    (request, q|k|v head) then (request, value head); with fixed tiles (batch-invariant) the one
    launch, as at every batch."""
    assert GF.SPLIT_DECODE_MAX_ROWS >= 1
    counts = _count_launches(monkeypatch)
    case = Case(0, torch.float32, seed=11,
                backend_kwargs={"decode_tiles": decode_tiles, "split_decode": "two_launches"})
    case.step(decode_ctx([6], 1, "cpu"), decode_ctx([6], 1, DEVICE), [6])
    s = case.shape
    want = ({"one": [], "prep": [(1, 2 * s.hk + s.hv)], "core": [(1, s.hv)]} if decode_tiles == "by_batch"
            else {"one": [(1, s.hk)], "prep": [], "core": []})
    assert counts == {**want, "gates": [], "norm": []}


@in_process
def test_two_requests_up_to_the_one_launch_bound_take_it(monkeypatch):
    monkeypatch.setattr(GF, "ONE_LAUNCH_MAX_ROWS", 2)
    counts = _count_launches(monkeypatch)
    case = Case(0, torch.float32, seed=9)
    slots = [5, 2]
    case.step(decode_ctx(slots, 2, "cpu"), decode_ctx(slots, 2, DEVICE), slots)
    assert counts == {"one": [(2, 2)], "prep": [], "core": [], "gates": [], "norm": []}  # (requests, key heads)


@in_process
@pytest.mark.parametrize("decode_tiles", ["by_batch", "fixed"])
def test_many_requests_take_the_unfused_kernels_unless_tiles_are_fixed(monkeypatch, decode_tiles):
    """Past ONE_LAUNCH_MAX_ROWS requests: the decode conv, the l2norm and gates over every row, the
    recurrent decode kernel, the gated norm over every (rows, value head); with fixed tiles the one launch."""
    monkeypatch.setattr(GF, "ONE_LAUNCH_MAX_ROWS", 2)
    counts = _count_launches(monkeypatch, unfused_ok=True)
    case = Case(0, torch.float32, seed=13, backend_kwargs={"decode_tiles": decode_tiles})
    slots = [5, 2, PADDING_SLOT]
    case.step(decode_ctx(slots, 2, "cpu"), decode_ctx(slots, 2, DEVICE), slots[:2])
    s = case.shape
    blocks = -(-3 // GF.BLOCK_ROWS)  # the rows' blocks: programs take BLOCK_ROWS rows
    want = ({"one": [], "prep": [], "core": [], "gates": [(blocks, s.hk)], "norm": [(blocks, s.hv)]}
            if decode_tiles == "by_batch" else {"one": [(3, s.hk)], "prep": [], "core": [], "gates": [], "norm": []})
    assert counts == want


# Extend, mixed and target-verify steps: (mode, (slot, cached, new tokens) requests, padding rows,
# padding requests). Slot 4 starts empty; step 2 continues its prompt beside a decode row and a
# new request; the verify steps are uniform (the verify kernels) and ragged (the extend path).
MODE_STEPS = [
    (Mode.EXTEND, [(4, 0, 6), (7, 9, 5), (2, 3, 9)], 3, 1),
    (Mode.MIXED, [(4, 6, 4), (7, 14, 1), (9, 0, 3)], 2, 1),
    (Mode.TARGET_VERIFY, [(4, 10, 3), (7, 15, 3), (9, 3, 3)], 3, 1),
    (Mode.TARGET_VERIFY, [(4, 13, 2), (2, 12, 3)], 0, 0),
    (Mode.DECODE, [(2, 15, 1), (4, 15, 1)], 1, 1),
]


def run_mode_steps(layer_id: int, dtype, backend_kwargs=None, replayed=False, seed=0, gap_only=False):
    """gap_only: each step planned as a piecewise step plans a backend whose nodes all sit in its
    gaps (plan_gap_step, after init_capture_state); `case.gap_plans` then lists each step's mode and
    whether its gap ops ran on the static tables."""
    case = Case(layer_id, dtype, seed, backend_kwargs)
    case.gap_plans = []
    if replayed or gap_only:
        case.tri.init_capture_state(max_tokens=64, max_seqs=8)

    def prepare(tri, ctx):
        if gap_only:
            tri.plan_gap_step(ctx, ctx.num_seqs, 64)
            case.gap_plans.append((ctx.mode, tri._step.eager_extend is not None and tri._step.eager_extend.captured))
            return
        plan_eager_step(tri, ctx, 64)
        if replayed and ctx.mode in (Mode.EXTEND, Mode.MIXED):
            tri.init_replay_state(ctx, ctx.num_seqs)
            assert tri._step.extend.captured

    for mode, reqs, pad_t, pad_s in MODE_STEPS:
        case.step(step_ctx(mode, reqs, pad_t, pad_s, "cpu"), step_ctx(mode, reqs, pad_t, pad_s, DEVICE),
                  [slot for slot, _, n in reqs if n], prepare)
        n = reqs[0][2]
        if mode == Mode.TARGET_VERIFY and all(new == n for *_, new in reqs):
            for entry in ("conv", "recurrent"):  # the states after each of the first n - 1 tokens
                got = case.dev_pool.verify_buffers[layer_id][entry].cpu()[:len(reqs), :n - 1]
                want = case.ref_pool.verify_buffers[layer_id][entry][:len(reqs), :n - 1]
                assert rel_err(got, want) <= STATE_TOL[dtype] and want.abs().sum() > 0, f"{entry} intermediate states"
    case.check_untouched()
    return case


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layer_id", [0, 1])
def test_extend_mixed_and_verify_steps_on_fla(layer_id, dtype):
    case = run_mode_steps(layer_id, dtype)
    assert case.tri._fla.calls, "the extend steps ran FLA's (stand-in) chunk kernels"


@in_process
def test_extend_steps_on_our_chunk_kernels():
    run_mode_steps(0, torch.float32, backend_kwargs=dict(chunk_impl="triton"))


@in_process
def test_replayed_extend_steps_read_the_static_plan():
    """A captured extend or mixed step: the padding rows come from the static plan's bounds."""
    run_mode_steps(0, torch.float32, backend_kwargs=dict(chunk_impl="triton"), replayed=True)


def spy(monkeypatch, name: str, label) -> list:
    """label(args, kwargs) of every call of gdn_fused's `name` from here on (the backend looks it up
    in the module at each call)."""
    seen, real = [], getattr(GF, name)

    def counted(*args, **kwargs):
        seen.append(label(args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(GF, name, counted)
    return seen


def norm_launches(monkeypatch) -> list:
    """How each gated_rmsnorm launch from here on finds its padding rows: "slots" or "bounds"."""
    return spy(monkeypatch, "gated_rmsnorm", lambda args, kwargs: "slots" if kwargs.get("slots") is not None
               else "bounds")


@in_process
@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layer_id", [0, 1])
def test_extend_steps_with_the_norm_in_the_output_kernel(layer_id, dtype, replayed, monkeypatch):
    """extend_norm=in_output on our chunk kernels: the extend, mixed and ragged verify steps (the
    extend path) launch no norm kernel (the output kernel normalises its rows), the uniform verify
    step and the decode step (the unfused decode kernels at two requests) still do; outputs, padding
    rows (zero) and states are the reference's (Case.step), eager and on a captured step's tables."""
    modes = norm_launches(monkeypatch)
    run_mode_steps(layer_id, dtype, backend_kwargs=dict(chunk_impl="triton", extend_norm="in_output"),
                   replayed=replayed)
    assert modes == ["slots", "slots"], "only the uniform verify step and the decode step launch the norm"


@in_process
def test_the_norm_stays_apart_by_default_and_where_flashinfer_runs_the_core(monkeypatch):
    """extend_norm's default keeps the norm's launch in every step that runs one; under
    chunk_impl=flashinfer (bound 8) the 20-row extend step past the bound runs FlashInfer's kernel
    and the norm apart even with in_output, and the mixed and ragged verify steps, on our chunk
    kernels, fold it."""
    modes = norm_launches(monkeypatch)
    run_mode_steps(0, torch.float32, backend_kwargs=dict(chunk_impl="triton"))
    assert modes == ["bounds", "bounds", "slots", "bounds", "slots"]
    modes.clear()
    stand_in = FakeFlashInferGdn()
    run_mode_steps(0, torch.float32, backend_kwargs=dict(chunk_impl="flashinfer", flashinfer_past=8,
                                                         flashinfer=stand_in, extend_norm="in_output"))
    assert stand_in.calls == [[0, 6, 11, 20]]
    assert modes == ["bounds", "slots", "slots"]


def qk_gates_launches(monkeypatch) -> list:
    """The rows of each qk_gates launch from here on."""
    return spy(monkeypatch, "qk_gates", lambda args, kwargs: args[0].shape[0])


@in_process
@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layer_id", [0, 2])
def test_steps_with_the_q_k_norm_and_gates_in_the_conv(layer_id, dtype, replayed, monkeypatch):
    """qk_gates=in_conv (with the norm in the output kernel too): the extend, mixed and ragged verify
    steps and the decode step of two requests (the unfused kernels), whose conv tiles hold whole key
    heads at these dims, launch no qk_gates; the uniform verify step does, and it and the decode
    step launch the norm; outputs, padding rows and states are the reference's (Case.step), eager
    and on a captured step's tables."""
    calls = qk_gates_launches(monkeypatch)
    modes = norm_launches(monkeypatch)
    run_mode_steps(layer_id, dtype, backend_kwargs=dict(chunk_impl="triton", qk_gates="in_conv",
                                                        extend_norm="in_output"), replayed=replayed)
    assert calls == [12], "only the uniform verify step (12 rows) runs qk_gates"
    assert modes == ["slots", "slots"]


@in_process
@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layer_id", [0, 1])
def test_every_fold_at_once(layer_id, dtype, replayed, monkeypatch):
    """qk_gates=in_conv, extend_norm=in_output and decode_norm=in_recurrence together: only the uniform
    verify step launches the norm (the decode step of two requests normalises in its recurrence on
    whole-row tiles); outputs, padding rows and states are the reference's (Case.step)."""
    modes = norm_launches(monkeypatch)
    run_mode_steps(layer_id, dtype, backend_kwargs=dict(chunk_impl="triton", qk_gates="in_conv",
                                                        extend_norm="in_output", decode_norm="in_recurrence"),
                   replayed=replayed)
    assert modes == ["slots"], "only the uniform verify step launches the norm"


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_decode_recurrence_applies_the_norm_as_the_norm_launch_does(dtype):
    """recurrent_decode with GatedNorm on whole-row tiles against recurrent_decode then gated_rmsnorm,
    three requests and a padding row, from the same states: the same outputs (the order of a row's
    sums aside), the padding row zero, the same states bit for bit; a walked or narrower tile refused."""
    from runtime.backends.kernels import linear as TL

    hk, hv, dk, dv, B = 2, 4, 16, 32, 4
    g = torch.Generator().manual_seed(51)
    q = torch.nn.functional.normalize(torch.randn(B, hk, dk, generator=g), dim=-1).to(dtype).to(DEVICE)
    k = torch.nn.functional.normalize(torch.randn(B, hk, dk, generator=g), dim=-1).to(dtype).to(DEVICE)
    v = torch.randn(B, hv, dv, generator=g).to(dtype).to(DEVICE)
    gate = (-torch.rand(B, hv, generator=g)).to(DEVICE)
    beta = torch.rand(B, hv, generator=g).to(dtype).to(DEVICE)
    z = torch.randn(B, hv, dv + 8, generator=g).to(dtype)[..., :dv].to(DEVICE)
    weight = (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype).to(DEVICE)
    state = torch.randn(6, hv, dk, dv, generator=g).to(DEVICE)
    slots = torch.tensor([3, 1, PADDING_SLOT, 5], device=DEVICE)
    gated = TL.GatedNorm(z, weight, EPS)
    outs, states = [], []
    for fold in (True, False):
        pool, out = state.clone(), torch.full((B, hv, dv), float("nan"), dtype=dtype, device=DEVICE)
        config = TL.whole_row_config(dk, dv)
        if fold:
            TL.recurrent_decode(q, k, v, gate, beta, out, pool, slots, dk ** -0.5, TL.GATE_PER_HEAD, config,
                                gated_norm=gated)
        else:
            core = torch.empty_like(out)
            TL.recurrent_decode(q, k, v, gate, beta, core, pool, slots, dk ** -0.5, TL.GATE_PER_HEAD, config)
            GF.gated_rmsnorm(core, z, weight, out, EPS, slots=slots, rows_per_slot=1)
        outs.append(out.float().cpu())
        states.append(pool.cpu())
    assert outs[0][2].eq(0).all() and torch.isfinite(outs[0]).all()
    assert rel_err(outs[0], outs[1]) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(outs[0], torch.zeros_like(outs[0])) > 0.5  # normalised rows, not zeros
    assert torch.equal(states[0], states[1])
    for config in (TL.RecurrentConfig(16, 1), TL.RecurrentConfig(32, 4, walk=2)):
        with pytest.raises(ValueError, match="whole Dv row"):
            TL.recurrent_decode(q, k, v, gate, beta, torch.empty_like(v), state.clone(), slots, 0.25,
                                TL.GATE_PER_HEAD, config, gated_norm=gated)


@in_process
def test_a_conv_tile_that_would_split_a_key_head_keeps_qk_gates(monkeypatch):
    """qk_gates=in_conv over key heads of 12 channels, which no power-of-two channel tile holds whole:
    every step launches qk_gates as by default (the extend, mixed, uniform and ragged verify and decode
    steps), with the reference's outputs and states."""
    calls = qk_gates_launches(monkeypatch)
    run_mode_steps(1, torch.float32, backend_kwargs=dict(chunk_impl="triton", qk_gates="in_conv"))
    assert calls == [23, 10, 12, 5, 3]


@pytest.mark.parametrize("option", ["extend_norm", "qk_gates", "decode_norm"])
def test_an_unknown_extend_fold_choice_is_refused_naming_the_option(option):
    pool, _ = gdn_pools({0: LAYERS[0]}, NUM_SLOTS, "cpu", 0, VERIFY)
    with pytest.raises(ValueError, match=f"{option} must be one of"):
        TritonLinearBackend(pool, fla=FakeFLA(), **{option: "inside"})


@in_process
@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_steps_past_the_bound_on_flashinfer_shorter_ones_on_our_chunk_kernels(dtype, replayed):
    """chunk_impl=flashinfer with a bound of 8 tokens: the 20-row extend step runs FlashInfer's
    launch (a stand-in over the reference recurrence, in its layout and conventions) on its three
    requests, eagerly in a replayed step too (its bucket is past the bound: an eager gap), and the
    mixed step of 8 real rows and the ragged verify step our chunk kernels; outputs, padding rows and
    every state as the reference has them, free slots untouched (run_mode_steps)."""
    stand_in = FakeFlashInferGdn()
    run_mode_steps(0, dtype, backend_kwargs=dict(chunk_impl="flashinfer", flashinfer_past=8, flashinfer=stand_in),
                   replayed=replayed)
    assert stand_in.calls == [[0, 6, 11, 20]]


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_gap_only_flashinfer_step_runs_on_the_static_tables_without_a_host_plan(dtype, monkeypatch):
    """plan_gap_step under chunk_impl=flashinfer (bound 8): the 20-row extend step's gap ops (the conv,
    FlashInfer's launch on its three real requests, the gates and the norm) run on the static tables
    made from the staged step, with no table built on the host, and give the reference's outputs,
    padding rows and states; the mixed step of 8 real rows (not past the bound) and the verify and
    decode steps plan an eager step as before (run_mode_steps checks each against the reference)."""
    stand_in = FakeFlashInferGdn()
    made = []
    eager_plan = TritonLinearBackend._make_extend_plan

    def counted(self, step):
        made.append(Mode(step.ctx.mode))
        return eager_plan(self, step)

    monkeypatch.setattr(TritonLinearBackend, "_make_extend_plan", counted)
    case = run_mode_steps(0, dtype, backend_kwargs=dict(chunk_impl="flashinfer", flashinfer_past=8,
                                                        flashinfer=stand_in), gap_only=True)
    assert stand_in.calls == [[0, 6, 11, 20]]
    assert case.gap_plans[0] == (Mode.EXTEND, True) and not any(static for _, static in case.gap_plans[1:])
    assert Mode.EXTEND not in made and Mode.MIXED in made


@in_process
def test_a_buckets_flashinfer_gap_steps_launch_alike_whatever_their_real_rows(monkeypatch):
    """Two steps of one bucket (32 rows, 4 request rows) on the static gap tables, with 22 and 15
    real rows of two requests: every Triton launch of the gap (conv, gates, state copies, the
    route's gates, gated norm) gets the same grid and the same non-tensor arguments in both, so on a
    GPU the Launcher finds each again (the route's gates once took the real rows' grid and missed
    every new count). The core's padding rows are not zeroed (the gated norm writes zeros there),
    and the outputs, padding rows and states are the reference's (Case.step)."""
    from runtime.backends.kernels.launch_cache import Launcher

    pytest.importorskip("runtime.backends.kernels.flashinfer_gdn")  # its Launchers made before they are patched
    launches, zeroed = [], []
    real_zero = torch.Tensor.zero_

    def recorded(launcher, real):
        def launch(grid, args, kwargs):
            launches.append((launcher.kernel.__name__, grid, tuple(str(a.dtype) if isinstance(a, torch.Tensor) else a
                                                                   for a in args), tuple(sorted(kwargs.items()))))
            return real(grid, args, kwargs)
        return launch

    def counted_zero(t):
        zeroed.append(tuple(t.shape))
        return real_zero(t)

    for launcher in Launcher.made:  # each one's own (another test's patch may have left one there)
        monkeypatch.setattr(launcher, "launch", recorded(launcher, launcher.launch))
    stand_in = FakeFlashInferGdn()
    case = Case(0, torch.float32, 0, dict(chunk_impl="flashinfer", flashinfer_past=8, flashinfer=stand_in))
    case.tri.init_capture_state(max_tokens=64, max_seqs=8)
    def gap_step(tri, ctx):  # after the reference's step: from here on the backend's alone
        launches.clear()
        monkeypatch.setattr(torch.Tensor, "zero_", counted_zero)
        tri.plan_gap_step(ctx, ctx.num_seqs, 64)

    seen = []
    for reqs, pad_t in (([(4, 0, 10), (7, 3, 12)], 10), ([(4, 10, 6), (7, 15, 9)], 17)):
        case.step(step_ctx(Mode.EXTEND, reqs, pad_t, 2, "cpu"), step_ctx(Mode.EXTEND, reqs, pad_t, 2, DEVICE),
                  [slot for slot, _, n in reqs if n], gap_step)
        monkeypatch.setattr(torch.Tensor, "zero_", real_zero)
        assert case.tri._step.eager_extend is not None and case.tri._step.eager_extend.captured
        seen.append(list(launches))
    assert stand_in.calls == [[0, 10, 22], [0, 6, 15]]
    assert {name for name, *_ in seen[0]} >= {"_gates_kernel", "_states_in_kernel", "_qk_gates_kernel",
                                               "_gated_rmsnorm_kernel"}
    assert seen[0] == seen[1]
    assert not zeroed, f"padding rows zeroed on the host: {zeroed}"


def test_flashinfer_bounds_the_gdn_ops_capture_and_serves_gdn_layers_only():
    cap = TritonLinearBackend.capability
    for past in ("256", "512", "2048"):
        options = {"chunk_impl": "flashinfer", "flashinfer_past": past}
        for op in ("gdn_core", "gdn_fused"):
            assert cap.capture_tokens(op, Mode.EXTEND, options) == int(past)
            assert cap.capture_tokens(op, Mode.MIXED, options) == int(past)
            assert cap.choice_refusal(op, options) is None
    for op in ("kda_core", "lightning_core"):
        assert "GDN layers" in cap.choice_refusal(op, {"chunk_impl": "flashinfer"})


def test_flashinfer_refuses_a_layer_its_variant_cannot_run_naming_it():
    fi = pytest.importorskip("runtime.backends.kernels.flashinfer_gdn")
    fi.check_layer("bfloat16", 16, 32, 128, 128, "layer 0")  # bench qwen3_next's: runs
    for args, why in [(("float32", 16, 32, 128, 128), "float32"), (("bfloat16", 16, 32, 64, 64), "64 / 64"),
                      (("bfloat16", 16, 16, 128, 128), "16 value heads"),
                      (("bfloat16", 16, 40, 128, 128), "40 value heads"), ((None, 16, 32, 128, 128), "unknown")]:
        with pytest.raises(ValueError, match=f"layer 3: .*{why}.*chunk_impl=triton"):
            fi.check_layer(*args, "layer 3")


@in_process
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_flashinfer_route_copies_states_and_gates_in_its_layouts(state_dtype):
    """The route's three Triton copies around FlashInfer's launch, against torch on fresh random
    inputs: the requests' states gathered by slot into [R, Hv, Dv, Dk] float32, the gates as
    exp(g) and beta in float32 from strided rows, and the final states put back transposed into
    the pool's dtype at the same slots; no other slot touched. The launch stands in as a copy of
    the initial states plus one, so the put-back is checked against what it was handed."""
    fi = pytest.importorskip("runtime.backends.kernels.flashinfer_gdn")
    gen = torch.Generator().manual_seed(7)
    T, Hk, Hv, D, slots_n = 12, 2, 4, 128, 6
    states = torch.randn(slots_n, Hv, D, D, generator=gen).to(state_dtype)
    before = states.clone()
    slots = torch.tensor([4, 1, 3])
    q, k = torch.randn(T, Hk, D, generator=gen), torch.randn(T, Hk, D, generator=gen)
    v = torch.randn(T, Hv, 2 * D, generator=gen)[:, :, :D]  # the conv's strided values
    mixed = torch.randn(T, 3 * Hv, generator=gen)  # g and beta as column slices of one tensor
    g, beta = -mixed[:, :Hv].abs(), mixed[:, Hv:2 * Hv].sigmoid()
    out = torch.zeros(T, Hv, D)
    seen = {}

    def launch(q, k, v, alpha, beta32, scale, h0, cu, o, ht):
        seen.update(alpha=alpha.clone(), beta=beta32.clone(), h0=h0.clone())
        ht.copy_(h0 + 1)

    cu = torch.tensor([0, 4, 9, 10])
    fi.chunk_into_pool(launch, q, k, v, g, beta, out, states, slots, cu, 10, 0.1)
    want_h0 = before[slots].float().transpose(-1, -2)
    assert torch.equal(seen["h0"], want_h0)
    assert torch.allclose(seen["alpha"], torch.exp(g[:10]), rtol=1e-6) and torch.equal(seen["beta"], beta[:10])
    put_back = (want_h0 + 1).transpose(-1, -2)
    if state_dtype == torch.float32:
        assert torch.equal(states[slots], put_back)
    else:  # within one bfloat16 step: the interpreter's float-to-bfloat16 rounding is not torch's
        assert torch.allclose(states[slots].float(), put_back, rtol=2 ** -7, atol=0)
    others = [s for s in range(slots_n) if s not in slots.tolist()]
    assert torch.equal(states[others], before[others])
    assert torch.equal(out[10:], torch.zeros(2, Hv, D))


def test_flashinfer_refuses_a_card_or_an_installation_it_cannot_build_for(monkeypatch):
    """At build, one line: a card that is not Hopper (the library is sm_90a code), or no FlashInfer
    (its JIT builds the library). The card's answers are stood in for: no GPU here."""
    import importlib.util

    fi = pytest.importorskip("runtime.backends.kernels.flashinfer_gdn")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match="sm_90a.*A100 is not one.*chunk_impl=triton"):
        fi.check_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="FlashInfer is not installed"):
        fi.check_device(torch.device("cuda"))


@in_process
def test_short_extends_take_the_recurrent_extend_kernel():
    run_mode_steps(2, torch.float32, backend_kwargs=dict(short_extend_tokens=16))


@in_process
@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "replayed"])
def test_steps_launch_qk_gates_and_the_norm_once_each(monkeypatch, replayed):
    """And the norm's padding marker is always a 16-byte aligned tensor (the plan's bounds or the
    step's slots, never a view into them), so Triton builds no new variant for another request count."""
    counts = {"_QK_GATES": 0, "_GATED_RMSNORM": 0}
    markers = []
    for name in counts:
        launcher = getattr(GF, name)
        real = launcher.launch

        def counted(grid, args, kwargs, name=name, real=real):
            counts[name] += 1
            if name == "_GATED_RMSNORM":
                markers.append(args[4].data_ptr() % 16)
            return real(grid, args, kwargs)
        monkeypatch.setattr(launcher, "launch", counted)
    run_mode_steps(0, torch.float32, backend_kwargs=dict(chunk_impl="triton"), replayed=replayed)
    # every step: the decode one's requests are more than ONE_LAUNCH_MAX_ROWS (the unfused kernels)
    assert counts == {"_QK_GATES": 5, "_GATED_RMSNORM": 5}
    assert markers == [0] * 5


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [1, 4, GF.BLOCK_ROWS])
def test_row_block_kernels_match_the_torch_ops_over_partial_blocks_and_padding(dtype, block_rows):
    """qk_gates and gated_rmsnorm over 37 rows (a partial last block at every block size): each row's
    heads as the mixer's torch ops compute them; rows at or past the plan's real count (bounds) and
    rows of the padding slot come out zero."""
    from compiler.splitops.gdn_mixer import gated_rms_norm, l2norm
    s = LAYERS[0]
    T, real = 37, 30
    g = torch.Generator().manual_seed(5)
    dims = GF.GdnDims(s.hk, s.hv, s.dk, s.dv, 2 * s.hk * s.dk + s.hv * s.dv, 4)
    mixed = torch.randn(T, dims.channels, generator=g).to(dtype)
    b, a = torch.randn(T, s.hv, generator=g).to(dtype), torch.randn(T, s.hv, generator=g).to(dtype)
    A_log, dt_bias = torch.randn(s.hv, generator=g), torch.randn(s.hv, generator=g)
    on = [t.to(DEVICE) for t in (mixed, b, a, A_log, dt_bias)]
    q, k, v, gate, beta = (t.cpu() for t in GF.qk_gates(*on, dims, block_rows=block_rows))
    kd = s.hk * s.dk
    tol = OUT_TOL[dtype]
    assert rel_err(q.float(), l2norm(mixed[:, :kd].reshape(T, s.hk, s.dk)).float()) < tol
    assert rel_err(k.float(), l2norm(mixed[:, kd:2 * kd].reshape(T, s.hk, s.dk)).float()) < tol
    assert rel_err(gate, -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)) < 1e-5
    assert rel_err(beta.float(), b.sigmoid().float()) < tol
    core, z = torch.randn(T, s.hv, s.dv, generator=g).to(dtype), torch.randn(T, s.hv, s.dv, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(s.dv, generator=g)).to(dtype)
    want = gated_rms_norm(core, z, weight, EPS)
    bounds = torch.tensor([0, real, T], dtype=torch.int32)  # one request of `real` rows, then the step's rows
    slots = torch.tensor([3] * 6 + [PADDING_SLOT] + [1] * 6, dtype=torch.int32)  # rows_per_slot 3: rows 18..20 pad
    for marker, kept in ((dict(bounds=bounds.to(DEVICE)), torch.arange(T) < real),
                         (dict(slots=slots.to(DEVICE), rows_per_slot=3), torch.arange(T) // 3 != 6)):
        out = torch.full((T, s.hv, s.dv), 7.0, dtype=dtype, device=DEVICE)
        GF.gated_rmsnorm(core.to(DEVICE), z.to(DEVICE), weight.to(DEVICE), out, EPS, block_rows=block_rows, **marker)
        out = out.cpu()
        assert rel_err(out[kept].float(), want[kept].float()) < tol
        assert not out[~kept].any()


def test_capability_serves_gdn_fused_where_gdn_core_is_served():
    cap = TritonLinearBackend.capability
    assert "gdn_fused" in cap.ops
    for mode in Mode:
        for impl in ("triton", "fla", "flashinfer"):
            options = {"chunk_impl": impl}
            assert cap.capturable("gdn_fused", mode, options) == cap.capturable("gdn_core", mode, options), (mode, impl)
    assert any(isinstance(c, OpCapture) and c.op == "gdn_fused" for c in cap.op_capture)


@in_process
def test_backend_implements_the_op():
    case = Case(0, torch.float32, seed=1)
    check_backend(case.tri)


@in_process
def test_shapes_that_disagree_are_refused_naming_the_argument():
    case = Case(0, torch.float32, seed=1)
    s = case.shape
    x = gdn_inputs(s, 1, 1, torch.float32, case.g, DEVICE)
    out = torch.empty(1, s.hv, s.dv, device=DEVICE)
    p = case.params.to(DEVICE)
    p.norm_weight = p.norm_weight[:-1]
    with pytest.raises(ValueError, match="norm_weight"):
        fused_gdn(case.tri, decode_ctx([3], 1, DEVICE), x, p, out, 0, s, EPS)


def conv_qk_launch(config, dtype, qk_in_conv: bool, seed: int = 40):
    """One extend conv launch over a GDN layer's channels (Hk 2, Dk 16, Hv 4, Dv 16: q | k | v, 128
    channels, K 4) for requests of 0, 1, 2, 70 and 33 tokens and 5 padding rows, then the q / k
    norm and gates: in the conv's launch (ConvQk) or by qk_gates after it. Returns the outputs
    (q, k, g, beta, the v channels, the histories) on the host."""
    from runtime.backends.kernels.launch_math import token_blocks
    from runtime.backends.kernels.linear import CONV_EXTEND_BLOCK_T, ConvQk, short_conv_extend

    hk, dk, hv, dv, K = 2, 16, 4, 16, 4
    C = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(seed)
    lens, pad = [0, 1, 2, 70, 33], 5
    R, rows = len(lens), sum(lens) + pad
    x = torch.randn(rows, C, generator=g).to(dtype)
    x[sum(lens):] = float("nan")
    w = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    state = torch.randn(R + 2, C, K - 1, generator=g).to(dtype).to(DEVICE)
    ba = torch.randn(rows, 2, hv + 3, generator=g).to(dtype)  # b and a as strided views of one projection
    b, a = ba[:, 0, :hv].to(DEVICE), ba[:, 1, 1:hv + 1].to(DEVICE)
    A_log, dt_bias = torch.randn(hv, generator=g).to(DEVICE), torch.randn(hv, generator=g).to(DEVICE)
    bounds = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist(), rows], dtype=torch.int64, device=DEVICE)
    blocks = torch.from_numpy(token_blocks(__import__("numpy").asarray(lens + [pad]), CONV_EXTEND_BLOCK_T))
    mixed = torch.full((rows, C), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.tensor([2, 5, 1, 4, 3], device=DEVICE)
    if qk_in_conv:
        q = torch.full((rows, hk, dk), float("nan"), dtype=dtype, device=DEVICE)
        k = torch.full_like(q, float("nan"))
        gate = torch.full((rows, hv), float("nan"), device=DEVICE)
        beta = torch.full((rows, hv), float("nan"), dtype=dtype, device=DEVICE)
        qk = ConvQk(q, k, gate, beta, b, a, A_log, dt_bias, GF.L2NORM_EPS, GF.SOFTPLUS_THRESHOLD)
        short_conv_extend(x.to(DEVICE), w.to(DEVICE), None, mixed, state, slots, bounds, blocks.to(DEVICE), True,
                          config=config, qk=qk)
    else:
        short_conv_extend(x.to(DEVICE), w.to(DEVICE), None, mixed, state, slots, bounds, blocks.to(DEVICE), True,
                          config=config)
        q, k, _, gate, beta = GF.qk_gates(mixed, b, a, A_log, dt_bias, GF.GdnDims(hk, hv, dk, dv, C, K))
    host = lambda t: t.float().cpu()  # noqa: E731
    return dict(q=host(q), k=host(k), g=host(gate), beta=host(beta), v=host(mixed[:, 2 * hk * dk:]),
                history=host(state))


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["tile16", "tile64", "rows128"])
def test_the_extend_conv_computes_the_q_k_norm_and_gates_as_qk_gates_does(layout, dtype):
    """ConvQk: the extend conv's launch computes q and k l2-normalised and both gates, in the tile
    layout (a head a program; q, k and v heads in one) and the row-streaming one (every channel in
    one program), against the conv and qk_gates
    after it: every row (padding rows' q and k zero, their gates from their b and a), the v channels
    and the histories. The same values up to the order of a head's sum (bf16: a rounding step)."""
    from runtime.backends.kernels.linear import ConvConfig

    config = {"tile16": ConvConfig(16, 1), "tile64": ConvConfig(64, 2), "rows128": ConvConfig(128, 1, rows=True)}[layout]
    got, want = conv_qk_launch(config, dtype, True), conv_qk_launch(config, dtype, False)
    for name in want:
        assert torch.isfinite(got[name]).all(), f"{name}: rows left unwritten"
        err = rel_err(got[name], want[name])
        assert err <= (1e-6 if dtype == torch.float32 else 1e-2), f"{name}: rel err {err:.2e}"
    assert torch.equal(got["v"], want["v"]) and torch.equal(got["history"], want["history"])
    assert got["q"][-5:].eq(0).all() and got["k"][-5:].eq(0).all()


def test_the_extend_conv_refuses_a_tile_that_splits_a_key_head():
    from runtime.backends.kernels.linear import ConvConfig, conv_qk_fits

    assert conv_qk_fits(ConvConfig(128, 4), 128) and conv_qk_fits(ConvConfig(1024, 4, rows=True), 128)
    assert not conv_qk_fits(ConvConfig(64, 2), 128)  # half a head
