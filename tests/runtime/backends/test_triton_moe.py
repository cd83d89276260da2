"""The fused Triton MoE (runtime/backends/kernels/moe.py, its backend triton_moe.py) against the CPU oracle, in float32.

Without CUDA the kernels run in Triton's interpreter (numpy on the CPU; tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton, and so does this module when run alone). With
CUDA (the GPU machine, where all test modules are collected in one process) the interpreter stays
off and the same checks run on the GPU: float32 dots use input_precision "ieee" there, so the
tolerance is the same. Dimensions are small and deliberately not multiples of the tiles (D=48,
I=24 with 16/32 tiles) so the masked edges run. Each check draws fresh random inputs (on the CPU,
then moved) and poisons `out` with NaN first. Shared experts come gated and ungated, as wide as
one routed expert, two, and 40 channels (two chunks, the last one 16 wide: its masked tail runs).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (as conftest.py does)

import inspect
import json
import types

import pytest

pytest.importorskip("triton", reason="triton is not installed: the fused MoE kernels cannot run")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
    pytest.skip("no CUDA and TRITON_INTERPRET is off: the kernels cannot run", allow_module_level=True)

from runtime.backends.cpu_reference import CPUReferenceBackend, moe_reference, route_topk  # noqa: E402
from runtime.backends.kernels.moe_config import GemmConfig, MoEConfig, config_file_name, default_config  # noqa: E402
from runtime.backends.triton_moe import TritonMoEBackend  # noqa: E402
from testkit.moe_checks import combine_reference, sorted_layout_reference  # noqa: E402
from runtime.backends.kernels.moe import (  # noqa: E402
    combine, down_token, fused_moe, gate_up_token, route, route_in_gate_up, route_sort, route_sort_folds,
    shared_chunks, sort_tokens,
)

DEV = torch.device("cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "cuda")
D, I = 48, 24
SORTED = MoEConfig(GemmConfig(16, 16, 32), GemmConfig(16, 16, 32))
TOKEN = MoEConfig(GemmConfig(1, 16, 32), GemmConfig(1, 16, 32))
TOKEN_NARROW = MoEConfig(GemmConfig(1, 2, 64), GemmConfig(1, 4, 16))  # the shape that wins at batch 1

# (scoring, bias, groups, topk_groups) per expert count: plain softmax, and sigmoid with a
# selection bias and grouped selection.
ROUTINGS = {
    "softmax": lambda E: ("softmax", False, 1, 1),
    "sigmoid_bias_grouped": lambda E: ("sigmoid", True, E // 2, 2 if E == 8 else 1),
}


# Shared experts: (width S, gated). S = I is one chunk, 2I two, 40 two with a 16-channel tail.
SHARED = {"none": (0, False), "gated_S=I": (I, True), "ungated_S=2I": (2 * I, False), "gated_S=40": (40, True)}


def _layer(g: torch.Generator, E: int, bias: bool, shared: str = "none"):
    """(router, bias, w13, w2, shared_w13, shared_w2, shared_gate): the moe op's weights in schema order."""
    router = torch.randn(E, D, generator=g) * 0.3
    b = torch.randn(E, generator=g) * 0.1 if bias else None
    w13 = torch.randn(E, 2 * I, D, generator=g) * 0.2
    w2 = torch.randn(E, D, I, generator=g) * 0.2
    S, gated = SHARED[shared]
    sw13 = torch.randn(2 * S, D, generator=g) * 0.2 if S else None
    sw2 = torch.randn(D, S, generator=g) * 0.2 if S else None
    gate = torch.randn(1, D, generator=g) * 0.3 if gated else None
    return router, b, w13, w2, sw13, sw2, gate


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _on(*tensors):
    """The tensors on the device the kernels run on (None stays None)."""
    return [None if t is None else t.to(DEV) for t in tensors]


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("E", [4, 8])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_fused_moe_matches_reference(T, E, top_k, routing):
    g = torch.Generator().manual_seed(1000 * T + 10 * E + top_k + len(routing))
    scoring, bias, groups, topk_groups = ROUTINGS[routing](E)
    layer = _layer(g, E, bias)
    x = torch.randn(T, D, generator=g)
    tail = (top_k, scoring, True, 2.5, groups, topk_groups)
    ref = moe_reference(x, *layer, *tail)
    for config in _configs(T):
        out = torch.full((T, D), float("nan"), device=DEV)
        fused_moe(*_on(x, *layer, out), *tail, config)
        assert torch.isfinite(out).all(), f"{config.path}: rows left unwritten"
        assert _rel(out, ref) <= 1e-4, f"{config.path}: rel err {_rel(out, ref):.2e}"


def _configs(T: int) -> list:
    """T=1 runs both paths; larger T the sorted path (and the token path at T=3)."""
    return [TOKEN, TOKEN_NARROW, SORTED] if T == 1 else ([SORTED, TOKEN] if T == 3 else [SORTED])


# bf16: operands, h, y and out rounded to bf16 (the interpreter truncates), against float32 math
# on the same bf16 values.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shared", [s for s in SHARED if s != "none"])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_fused_moe_with_a_shared_expert_matches_reference(T, shared, dtype):
    g = torch.Generator().manual_seed(100 * T + len(shared))
    E, top_k = 8, 2
    layer = [t if t is None else t.to(dtype) for t in _layer(g, E, True, shared)]
    x = torch.randn(T, D, generator=g).to(dtype)
    tail = (top_k, "sigmoid", True, 2.5, 4, 2)
    ref = moe_reference(*[t if t is None else t.float() for t in (x, *layer)], *tail)
    for config in _configs(T):
        out = torch.full((T, D), float("nan"), device=DEV, dtype=dtype)
        fused_moe(*_on(x, *layer, out), *tail, config)
        err = _rel(out, ref)
        print(f"shared {shared} T={T} {dtype} {config.path}: rel err {err:.2e}")
        assert torch.isfinite(out).all(), f"{config.path}: rows left unwritten"
        assert err <= TOLERANCE[dtype], f"{config.path}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shared", sorted(SHARED))
def test_the_split_down_gives_the_sorted_downs_output(shared, dtype, monkeypatch):
    """fused_moe(split_down=True): the routed experts' down projections as one grouped GEMM over the
    sorted rows, the shared expert's gate-up rows by token and its down as one dense GEMM, the
    combine through the sort's inverse map; padding tokens (n_real) zero. Against the sorted down
    and the CPU oracle, with and without a shared expert (one chunk, two, a masked tail); bf16 (what
    a GPU splits) rounds the grouped GEMM's rows where the sorted down rounds weighted ones."""
    if DEV.type == "cuda" and dtype == torch.float32:
        pytest.skip("torch's grouped GEMM takes bf16 on a GPU (splits_down never asks for float32 there)")
    g = torch.Generator().manual_seed(77 + len(shared))
    E, top_k, T, n_real = 8, 2, 21, 17
    layer = [t if t is None else t.to(dtype) for t in _layer(g, E, True, shared)]
    x = torch.randn(T, D, generator=g).to(dtype)
    tail = (top_k, "sigmoid", True, 2.5, 4, 2)
    ref = moe_reference(*[t if t is None else t.float() for t in (x[:n_real], *layer)], *tail)
    from runtime.backends.kernels import moe as kernels

    downs = []  # which down each call took
    for name in ("down_split", "down_sorted"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _f=real, _name=name, **k: downs.append(_name) or _f(*a, **k))
    outs = {}
    for split in (False, True):
        out = torch.full((T, D), float("nan"), device=DEV, dtype=dtype)
        fused_moe(*_on(x, *layer, out), *tail, SORTED, n_real=n_real, split_down=split)
        outs[split] = out.cpu()
        err = _rel(outs[split][:n_real], ref)
        assert (outs[split][n_real:] == 0).all(), f"split {split}: padding rows must be zero"
        assert err <= TOLERANCE[dtype], f"split {split}: rel err {err:.2e}"
    # float32: the same sums to rounding; bf16: each rounds its own intermediates (about 4e-3 apart)
    assert _rel(outs[True], outs[False]) <= (1e-5 if dtype == torch.float32 else TOLERANCE[dtype])
    assert downs == ["down_sorted", "down_split"]


def test_the_split_downs_layout_maps_are_made_on_the_device_from_the_sort(monkeypatch):
    """split_maps: each expert's segment end (blocks past total and foreign ids left out; an expert
    without rows ends where the one before does) and each pair's sorted row (padding rows and rows
    past total write nothing), with rows and blocks in several passes of the kernel."""
    from runtime.backends.kernels import moe

    monkeypatch.setattr(moe, "MAPS_BLOCK", 4)  # 10 rows: three row programs; 7 blocks: two passes
    block_expert = torch.tensor([0, 0, 2, 3, 3, 1, 7], dtype=torch.int32)  # blocks 5, 6 past total
    sorted_pairs = torch.tensor([3, 0, 5, 5, 1, 2, 4, 5, 9, 9], dtype=torch.int32)  # pair 5: padding
    ends, inv = moe.split_maps(sorted_pairs, block_expert, torch.tensor([5 * 4], dtype=torch.int32), 4, 4, 5)
    assert ends.tolist() == [8, 8, 12, 20]
    assert inv.tolist() == [1, 4, 5, 0, 6]
    ends, inv = moe.split_maps(sorted_pairs, block_expert, torch.tensor([4], dtype=torch.int32), 4, 4, 5)
    assert ends.tolist() == [4, 4, 4, 4]
    assert inv[[0, 3]].tolist() == [1, 0]  # pairs 1, 2 and 4 sit past total: their entries unspecified


@pytest.mark.parametrize("inter,shared_width", [(16, 16), (24, 40)], ids=["whole_tile", "masked_tail"])
def test_the_token_down_projection_without_its_loop_sums_as_the_loop_does(inter, shared_width):
    """A reduction of one tile runs as straight-line code: the same float32 sums as the one-trip
    loop it replaces, bit for bit, with I equal to the tile and with I and a shared tail under it."""
    g = torch.Generator().manual_seed(inter)
    E, T, k, Dm = 6, 2, 3, 32
    w13 = torch.randn(E, 2 * inter, Dm, generator=g) * 0.2
    w2 = torch.randn(E, Dm, inter, generator=g) * 0.2
    sw13 = torch.randn(2 * shared_width, Dm, generator=g) * 0.2
    sw2 = torch.randn(Dm, shared_width, generator=g) * 0.2
    x, router, gate = torch.randn(T, Dm, generator=g), torch.randn(E, Dm, generator=g), torch.randn(1, Dm, generator=g)
    n_shared = shared_chunks(shared_width, inter)
    ids, weights = route(*_on(x, router), None, k, "softmax", True, 1.0, 1, 1, n_shared=n_shared,
                         shared_gate=gate.to(DEV))
    cfg = GemmConfig(1, 4, 16 if inter == 16 else 32)
    x, w13, w2, sw13, sw2 = _on(x, w13, w2, sw13, sw2)
    h = gate_up_token(x, w13, ids, cfg, shared_w13=sw13)
    outs = []
    for one_step in (None, False):
        out = torch.full((T, Dm), float("nan"), device=DEV)
        down_token(h, w2, ids, weights, out, cfg, shared_w2=sw2, one_step=one_step)
        outs.append(out.cpu())
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


def test_router_appends_the_shared_chunks_with_the_gate_weight():
    g = torch.Generator().manual_seed(21)
    E, T, k, n_real = 8, 6, 2, 4
    router, b, _, _, sw13, _, gate = _layer(g, E, True, "gated_S=40")
    n_shared = shared_chunks(sw13.shape[0] // 2, I)
    assert n_shared == 2
    x = torch.randn(T, D, generator=g)
    ids, w = (t.cpu() for t in route(*_on(x, router, b), k, "sigmoid", True, 2.5, 4, 2, n_real=n_real,
                                     n_shared=n_shared, shared_gate=gate.to(DEV)))
    rids, rw = route_topk(x[:n_real], router, b, k, "sigmoid", True, 2.5, 4, 2)
    assert ids.shape == w.shape == (T, k + n_shared)
    assert torch.equal(ids[:n_real, :k].long(), rids) and torch.allclose(w[:n_real, :k], rw, rtol=1e-5, atol=1e-7)
    # Slots k.. name chunks E, E+1 with weight sigmoid(x . gate); padding rows the sentinel, weight 0.
    assert (ids[:n_real, k:] == torch.tensor([E, E + 1], dtype=torch.int32)).all()
    g_ref = torch.sigmoid(x[:n_real] @ gate[0])
    assert torch.allclose(w[:n_real, k:], g_ref[:, None].expand(n_real, n_shared), rtol=1e-5, atol=1e-7)
    assert (ids[n_real:] == E + n_shared).all() and (w[n_real:] == 0).all()


def test_router_matches_route_topk_ids_and_weights():
    g = torch.Generator().manual_seed(7)
    E, T = 8, 9
    x, router, b = torch.randn(T, D, generator=g), torch.randn(E, D, generator=g), torch.randn(E, generator=g) * 0.2
    for scoring, groups, tg, renorm in [("softmax", 1, 1, False), ("sigmoid", 4, 2, True), ("sigmoid", 8, 3, False)]:
        ids, w = route(*_on(x, router, b), 3, scoring, renorm, 1.5, groups, tg)
        rids, rw = route_topk(x, router, b, 3, scoring, renorm, 1.5, groups, tg)
        assert torch.equal(ids.long().cpu(), rids), (scoring, groups)
        assert torch.allclose(w.cpu(), rw, rtol=1e-5, atol=1e-7), (scoring, groups)


def test_router_picks_like_route_topk_at_512_experts_and_breaks_ties_by_lowest_id():
    """Qwen3-Next-80B's router (512 experts, top 10, softmax) and Kimi-Linear's (sigmoid + bias,
    top 8 of 256): the same ids and weights as the reference; scores that tie (a zero router: every
    logit 0) pick the lowest ids, as torch.topk over the reference's scores does."""
    g = torch.Generator().manual_seed(11)
    T, Dr = 3, 64
    for E, k, scoring, bias in [(512, 10, "softmax", None), (256, 8, "sigmoid", torch.randn(256, generator=g) * 0.2)]:
        x, router = torch.randn(T, Dr, generator=g), torch.randn(E, Dr, generator=g)
        ids, w = route(*_on(x, router, bias), k, scoring, True, 2.5, 1, 1)
        rids, rw = route_topk(x, router, bias, k, scoring, True, 2.5, 1, 1)
        assert torch.equal(ids.long().cpu(), rids), (E, scoring)
        assert torch.allclose(w.cpu(), rw, rtol=1e-5, atol=1e-7), (E, scoring)
        ids, w = route(*_on(x, torch.zeros(E, Dr), None), k, scoring, True, 1.0, 1, 1)
        assert ids.long().cpu().tolist() == [list(range(k))] * T, (E, scoring)
        assert torch.allclose(w.cpu(), torch.full((T, k), 1.0 / k)), (E, scoring)


@pytest.mark.parametrize("logits_kernel,E", [("fused", 40), ("gemv", 40), ("gemv", 72), ("dot", 40), ("split", 40)])
def test_every_router_logits_kernel_matches_route_topk(logits_kernel, E):
    """Each logits kernel, with and without a gated shared expert (whose logit the GEMV computes in
    a program of its own, the others in the routing kernel): the reference's ids and weights."""
    g = torch.Generator().manual_seed(9)
    T, Dr = 19, 80  # E, D and T off the tile sizes (the GEMV takes 1 expert per program up to 64, then 4)
    x, router, gate = torch.randn(T, Dr, generator=g), torch.randn(E, Dr, generator=g), torch.randn(1, Dr, generator=g)
    rids, rw = route_topk(x, router, None, 4, "softmax", True, 1.0, 1, 1)
    for shared in ({}, {"n_shared": 1, "shared_gate": gate.to(DEV)}):
        ids, w = route(*_on(x, router), None, 4, "softmax", True, 1.0, 1, 1, logits_kernel=logits_kernel, **shared)
        ids, w = ids.cpu(), w.cpu()
        assert torch.equal(ids[:, :4].long(), rids)
        assert torch.allclose(w[:, :4], rw, rtol=1e-5, atol=1e-7)
        if shared:
            assert (ids[:, 4] == E).all()
            assert torch.allclose(w[:, 4], torch.sigmoid(x @ gate[0]), rtol=1e-5, atol=1e-6)


def test_router_marks_rows_past_the_real_count_as_padding():
    g = torch.Generator().manual_seed(8)
    x, router = _on(torch.randn(5, D, generator=g), torch.randn(4, D, generator=g))
    for n_real in (3, torch.tensor([3], dtype=torch.int32, device=DEV)):
        ids, w = route(x, router, None, 2, "softmax", True, 1.0, 1, 1, n_real=n_real)
        assert (ids[3:] == 4).all() and (w[3:] == 0).all()
        assert (ids[:3] < 4).all()


# (T, routing, shared, n_real): both sides of the one-launch limit at E=8 (route_tile_rows: 64
# tokens), one token, and padding rows (a host count and a device count).
ROUTE_SORT_CASES = [(1, "softmax", "none", None), (17, "sigmoid_bias_grouped", "gated_S=40", 13),
                    (64, "softmax", "gated_S=I", "device 50"), (65, "softmax", "gated_S=I", "device 50"),
                    (64, "sigmoid_bias_grouped", "ungated_S=2I", None)]


def _route_sort_case(T: int, routing: str, shared: str, n_real, seed: int) -> tuple:
    """(route's arguments at E=8, top-2, the keyword arguments: n_real, n_shared, shared_gate) of a
    ROUTE_SORT_CASES row; n_real "device N" is a one-element device tensor."""
    g = torch.Generator().manual_seed(seed)
    scoring, bias, groups, topk_groups = ROUTINGS[routing](8)
    router, b, _, _, sw13, _, gate = _layer(g, 8, bias, shared)
    x = torch.randn(T, D, generator=g)
    if isinstance(n_real, str):
        n_real = torch.tensor([int(n_real.split()[1])], dtype=torch.int32, device=DEV)
    n_shared = shared_chunks(0 if sw13 is None else sw13.shape[0] // 2, I)
    extra = dict(n_real=n_real, n_shared=n_shared, shared_gate=None if gate is None else gate.to(DEV))
    return (*_on(x, router, b), 2, scoring, True, 2.5, groups, topk_groups), extra


@pytest.mark.parametrize("T,routing,shared,n_real", ROUTE_SORT_CASES)
def test_route_sort_in_one_launch_gives_the_router_and_sort_results(T, routing, shared, n_real):
    """route_sort's one launch (T <= 64 here) and its separate launches (always available): the
    router's ids exactly and weights to float32 rounding, and the sorted layout of those ids exactly."""
    E, k, block_m = 8, 2, 16
    args, extra = _route_sort_case(T, routing, shared, n_real, seed=T + len(routing))
    n_shared = extra["n_shared"]
    folds = route_sort_folds(T, E, k + n_shared, "gemv")
    assert folds == (T <= 64)
    ids, w = (t.cpu() for t in route(*args, **extra))
    for fold in ([True, False] if folds else [False]):
        got = [t.cpu() for t in route_sort(*args, block_m, **extra, fold=fold)]
        assert torch.equal(got[0], ids), f"fold={fold}: ids"
        assert torch.allclose(got[1], w, rtol=1e-6, atol=1e-7), f"fold={fold}: weights"
        rows, blocks = sorted_layout_reference(ids, E + n_shared, block_m)
        total = int(got[4])
        assert total == rows.numel() and torch.equal(got[2][:total], rows), f"fold={fold}: sorted rows"
        assert torch.equal(got[3][:total // block_m], blocks), f"fold={fold}: block experts"
    if not folds:
        with pytest.raises(ValueError, match="one launch"):
            route_sort(*args, block_m, **extra, fold=True)


@pytest.mark.parametrize("T,E,logits", [(1, 8, "gemv"), (3, 72, "gemv"), (5, 40, "gemv"), (70, 16, "dot"),
                                        (130, 40, "dot")])
def test_the_one_launch_router_routes_as_its_two_launches_do(T, E, logits):
    """route(one_launch=True): after the GEMV, its programs write the logits and the last to finish
    routes every token; after the GEMM, each program routes its own rows. The two-launch router's
    ids exactly and weights to float32 rounding (the GEMM sums the shared gate's logit in other
    steps), with and without a gated shared expert, one expert a GEMV program and four (E=72), and
    the shared counter back at zero after each launch (a replay starts from it)."""
    from runtime.backends.kernels.arrivals import arrival_counters

    g = torch.Generator().manual_seed(T + E)
    Dr = 80
    x, router, gate = torch.randn(T, Dr, generator=g), torch.randn(E, Dr, generator=g), torch.randn(1, Dr, generator=g)
    bias = torch.randn(E, generator=g) * 0.1
    routing = ("sigmoid", True, 2.5, 4, 2) if E == 8 else ("softmax", True, 1.0, 1, 1)
    for shared in ({}, {"n_shared": 1, "shared_gate": gate.to(DEV)}):
        args = (*_on(x, router, bias if E == 8 else None), 2, *routing)
        ids, w = (t.cpu() for t in route(*args, **shared, logits_kernel=logits))
        got_ids, got_w = (t.cpu() for t in route(*args, **shared, logits_kernel=logits, one_launch=True))
        assert torch.equal(got_ids, ids)
        assert torch.allclose(got_w, w, rtol=1e-6, atol=1e-7)
        assert int(arrival_counters(DEV, 1, "moe router")[0]) == 0


@pytest.mark.parametrize("E,routing", [(40, ("softmax", True, 1.0, 1, 1)), (8, ("sigmoid", True, 2.5, 4, 2))])
def test_the_split_router_routes_as_the_reference_does(E, routing):
    """The split router (slices of D, the last slice of a row block routing it) over three row
    blocks with padding rows (a device count), with and without a gated shared expert: the
    reference router's ids exactly and its weights to float32 rounding; a token's weights the same
    bits at two step sizes; every counter back at zero after the launch."""
    from runtime.backends.kernels.arrivals import arrival_counters
    from runtime.backends.kernels.moe import split_router_shape

    g = torch.Generator().manual_seed(E)
    T, Dr = 150, 200  # three row blocks (the last short), D in four slices of 64 (the last short)
    assert split_router_shape(T, Dr) == (3, 4, 64)
    x, router, gate = torch.randn(T, Dr, generator=g), torch.randn(E, Dr, generator=g), torch.randn(1, Dr, generator=g)
    x = x * Dr ** -0.5  # logits of order one: softmax weights keep float32's relative rounding
    bias = torch.randn(E, generator=g) * 0.1 if E == 8 else None
    rids, rw = route_topk(x[:141], router, bias, 2, *routing)
    n_real = torch.tensor([141], dtype=torch.int32, device=DEV)
    for shared in ({}, {"n_shared": 1, "shared_gate": gate.to(DEV)}):
        args = (*_on(x, router, bias), 2, *routing)
        got_ids, got_w = (t.cpu() for t in route(*args, **shared, n_real=n_real, logits_kernel="split"))
        assert torch.equal(got_ids[:141, :2].long(), rids)
        assert torch.allclose(got_w[:141, :2], rw, rtol=1e-5, atol=1e-7)
        if shared:
            assert torch.allclose(got_w[:141, 2], torch.sigmoid(x[:141] @ gate[0]), rtol=1e-5, atol=1e-6)
        assert (got_ids[141:] == E + len(shared) // 2).all() and (got_w[141:] == 0).all()
        assert not arrival_counters(DEV, 3, "moe router")[:3].any()
        fewer_ids, fewer_w = (t.cpu() for t in route(args[0][:70], *args[1:], **shared, logits_kernel="split"))
        assert torch.equal(fewer_ids, got_ids[:70]) and torch.equal(fewer_w, got_w[:70])
    with pytest.raises(ValueError, match="split router"):
        route(x.to(DEV), torch.randn(64, Dr).to(DEV), None, 2, "softmax", True, 1.0, 1, 1, logits_kernel="split")


@pytest.mark.parametrize("T,routing,shared,n_real", ROUTE_SORT_CASES[:3])
def test_the_one_launch_router_sorts_as_the_folded_routing_does(T, routing, shared, n_real):
    """route_sort(one_launch=True): the router's last program routes and sorts, the layout of the
    one-program routing and sort (the same code after the same logits) exactly; refused with a
    one-line error where the step does not fold."""
    block_m = 16
    args, extra = _route_sort_case(T, routing, shared, n_real, seed=T + 3)
    args = (*args, block_m)
    folded = [t.cpu() for t in route_sort(*args, **extra, fold=True)]
    one = [t.cpu() for t in route_sort(*args, **extra, one_launch=True)]
    total = int(folded[4])
    assert int(one[4]) == total and torch.equal(one[0], folded[0])
    assert torch.allclose(one[1], folded[1], rtol=1e-6, atol=1e-7)
    assert torch.equal(one[2][:total], folded[2][:total]) and torch.equal(one[3][:total // block_m],
                                                                          folded[3][:total // block_m])
    with pytest.raises(ValueError, match="one launch"):
        route_sort(*args, **extra, fold=False, one_launch=True)
    wide = torch.randn(65, D).to(DEV)
    with pytest.raises(ValueError, match="one launch"):
        route(wide, *args[1:-1], one_launch=True)
    many = torch.randn(72, D).to(DEV)  # past one GEMM tile of experts
    with pytest.raises(ValueError, match="one launch"):
        route(wide, many, None, 2, "softmax", True, 1.0, 1, 1, logits_kernel="dot", one_launch=True)


@pytest.mark.parametrize("T,config,one_launch", [(64, "sorted", False), (65, "sorted", False), (3, "token", True),
                                                 (17, "sorted", True)])
def test_fused_moe_matches_reference_on_both_sides_of_the_one_launch_routing(T, config, one_launch):
    """Both sides of the 64 tokens one routing tile holds at E=8, the routing and sort in one launch
    or two; one_launch_router: in the GEMV's launch, on the token path and the sorted one (past the
    tile the router keeps its two launches)."""
    g = torch.Generator().manual_seed(T + 40 * one_launch)
    E, top_k = 8, 2
    layer = _layer(g, E, True, "gated_S=40")
    x = torch.randn(T, D, generator=g)
    tail = (top_k, "sigmoid", True, 2.5, 4, 2)
    ref = moe_reference(x, *layer, *tail)
    out = torch.full((T, D), float("nan"), device=DEV)
    n_real = max(1, T - 3)
    fused_moe(*_on(x, *layer, out), *tail, TOKEN if config == "token" else SORTED, n_real=n_real,
              one_launch_router=one_launch)
    assert torch.isfinite(out).all() and (out[n_real:] == 0).all()
    assert _rel(out[:n_real], ref[:n_real]) <= 1e-4


# (top_k, routing, shared): top-3 pads the routed slots to 4 columns, the first shared slot's index
# among them; two shared chunks (S=40) put slots past the pad.
IN_EXPERTS_CASES = [(2, "softmax", "none"), (3, "sigmoid_bias_grouped", "gated_S=I"), (1, "softmax", "ungated_S=2I"),
                    (3, "softmax", "gated_S=40")]


# The gate-up tile of the routing-in-experts check: TOKEN_NARROW's BLOCK_K, wider columns.
IN_EXPERTS_TILE = GemmConfig(1, 16, 64)


@pytest.mark.parametrize("top_k,routing,shared", IN_EXPERTS_CASES)
def test_routing_in_the_gate_up_kernel_gives_the_routing_kernels_slots_and_rows(top_k, routing, shared):
    """route_in_gate_up (the router option "in_experts"): every gate-up program picks its pair's
    slot from the GEMV's logits itself, and the first column tile's programs write the ids and
    weights. Against the GEMV, the routing kernel and gate_up_token on its ids: the same ids, the
    weights to float32 rounding, the same h rows, with padding rows (a host count and a device one)
    on the sentinel with weight 0 and zero rows. Column tiles of 16, two per pair (the second masked
    past I=24): every program routes its token anew, which twelve tiles of 2 repeated six times over
    (the narrow token config routes in its experts in the fused_moe test below)."""
    g = torch.Generator().manual_seed(top_k * 7 + len(shared))
    E = 8
    scoring, bias, groups, topk_groups = ROUTINGS[routing](E)
    router, b, w13, _, sw13, _, gate = _layer(g, E, bias, shared)
    T = 5
    x = torch.randn(T, D, generator=g)
    n_shared = shared_chunks(SHARED[shared][0], I)
    tail = (top_k, scoring, True, 2.5, groups, topk_groups)
    for n_real in (T, 3, torch.tensor([4], dtype=torch.int32)):
        dev_real = n_real.to(DEV) if isinstance(n_real, torch.Tensor) else n_real
        kw = dict(n_real=dev_real, n_shared=n_shared, shared_gate=None if gate is None else gate.to(DEV))
        args = _on(x, router, b)
        ids, w = route(*args, *tail, **kw, logits_kernel="gemv")
        h = gate_up_token(args[0], w13.to(DEV), ids, IN_EXPERTS_TILE, shared_w13=None if sw13 is None else
                          sw13.to(DEV))
        got_ids, got_w, got_h = route_in_gate_up(*args, w13.to(DEV), *tail, IN_EXPERTS_TILE, **kw,
                                                 shared_w13=None if sw13 is None else sw13.to(DEV))
        real = int(n_real)
        assert torch.equal(got_ids.cpu(), ids.cpu()) and (got_ids[real:].cpu() == E + n_shared).all()
        assert torch.allclose(got_w.cpu(), w.cpu(), rtol=1e-6, atol=1e-7) and (got_w[real:].cpu() == 0).all()
        assert torch.equal(got_h.cpu(), h.cpu()) and (got_h.view(T, -1)[real:].cpu() == 0).all()


def test_fused_moe_routing_in_its_experts_launches_no_routing_kernel(monkeypatch):
    """fused_moe(route_in_experts=True) on the token path matches the CPU oracle without the routing
    kernel's launch; a sorted step keeps its routing (the option applies to token steps only)."""
    import runtime.backends.kernels.moe as moe

    launched = []

    class Spy:
        def __init__(self, name):
            self.name, self.kernel = name, getattr(moe, name)

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in ("_route_kernel", "_route_sort_kernel"):
        monkeypatch.setattr(moe, name, Spy(name))
    g = torch.Generator().manual_seed(17)
    layer = _layer(g, 8, True, "gated_S=40")
    tail = (2, "sigmoid", True, 2.5, 4, 2)
    for T, config in ((3, TOKEN_NARROW), (9, SORTED)):
        x = torch.randn(T, D, generator=g)
        ref = moe_reference(x, *layer, *tail)
        out = torch.full((T, D), float("nan"), device=DEV)
        fused_moe(*_on(x, *layer, out), *tail, config, n_real=T - 1, route_in_experts=True)
        assert (out[T - 1:] == 0).all() and _rel(out[:T - 1], ref[:T - 1]) <= 1e-4
    assert launched == ["_route_sort_kernel"], (
        "the token step routes in its gate-up kernel; the sorted one launches its routing and sort")


# The experts-in-one-launch check's tiles: gate-up columns in tiles of 8 (three a pair: the
# interpreter's time goes by programs), a down tile whose BLOCK_K covers I=24 in one step (the
# option's condition) and 16 columns of D=48 (three tiles a token).
ONE_LAUNCH_TILES = MoEConfig(GemmConfig(1, 8, 64), GemmConfig(1, 16, 32))


@pytest.mark.parametrize("top_k,routing,shared", IN_EXPERTS_CASES)
def test_experts_in_one_launch_give_the_two_launches_output(top_k, routing, shared):
    """experts_token (the experts option "one_launch"): gate-up and down as one launch, whose down
    programs load their weights, then wait for their token's gate-up programs. Against the two
    launches of route_in_gate_up and down_token on the same GEMV logits: the same ids, weights and
    h, the output to float32 summation order, and the CPU oracle; padding rows (a host count and a
    device one) zero. The counters are back at zero after every call (a replay starts from them)."""
    from runtime.backends.kernels.arrivals import arrival_counters
    from runtime.backends.kernels.moe import experts_token

    g = torch.Generator().manual_seed(top_k * 11 + len(shared))
    E = 8
    scoring, bias, groups, topk_groups = ROUTINGS[routing](E)
    layer = _layer(g, E, bias, shared)
    router, b, w13, w2, sw13, sw2, gate = layer
    T = 5
    x = torch.randn(T, D, generator=g)
    n_shared = shared_chunks(SHARED[shared][0], I)
    tail = (top_k, scoring, True, 2.5, groups, topk_groups)
    ref = moe_reference(x, *layer, *tail)
    x_d, router_d, b_d, w13_d, w2_d, sw13_d, sw2_d, gate_d = _on(x, *layer)
    for n_real in (T, 3, torch.tensor([4], dtype=torch.int32)):
        dev_real = n_real.to(DEV) if isinstance(n_real, torch.Tensor) else n_real
        kw = dict(n_real=dev_real, n_shared=n_shared, shared_gate=gate_d)
        ids, w, h = route_in_gate_up(x_d, router_d, b_d, w13_d, *tail, ONE_LAUNCH_TILES.gate_up, **kw, shared_w13=sw13_d)
        two = torch.full((T, D), float("nan"), device=DEV)
        down_token(h, w2_d, ids, w, two, ONE_LAUNCH_TILES.down, shared_w2=sw2_d)
        one = torch.full((T, D), float("nan"), device=DEV)
        got_ids, got_w = experts_token(x_d, w13_d, w2_d, one, ONE_LAUNCH_TILES, (router_d, b_d, *tail), **kw,
                                       shared_w13=sw13_d, shared_w2=sw2_d)
        real = int(n_real)
        assert torch.equal(got_ids.cpu(), ids.cpu()) and torch.equal(got_w.cpu(), w.cpu())
        assert (one[real:].cpu() == 0).all() and _rel(one[:real], two[:real]) <= 1e-6
        assert _rel(one[:real], ref[:real]) <= 1e-4
        assert not arrival_counters(DEV, 2 * T, "moe experts").any(), "counters left for the next launch"


def _routed_ids(g, T, k, E, padding_tokens=0, skewed=False):
    """[T, k] distinct experts per token, the last `padding_tokens` rows the sentinel E. skewed:
    expert 0 in every token and the others drawn from experts 1..min(E, 2k)-1 (ragged counts, and
    experts with no pairs)."""
    if skewed:
        rest = [torch.randperm(min(E, 2 * k) - 1, generator=g)[:k - 1] + 1 for _ in range(T)]
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), r]) for r in rest])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids = ids.to(torch.int32)
    if padding_tokens:
        ids[-padding_tokens:] = E
    return ids


# (T, k, E, block_m, block_p): one block of every pair (one launch), blocks whose programs scan
# every pair for their counts (one launch; the default from 257 pairs to SCAN_MAX_PAIRS) and
# blocks counted first (two launches; the default past it), with P not a multiple of block_p, a
# block of one pair, and power-of-two E (the sentinel past the last histogram bin) and odd E;
# ranks counted in chunks (E = 17: 256 pairs a chunk; E = 64, the widest count: 128) and sorted
# (E = 100, past COUNT_RANKS_MAX_EXPERTS).
SORT_CASES = [(37, 3, 8, 16, None), (1, 1, 4, 16, None), (90, 3, 9, 16, None), (300, 5, 17, 32, None),
              (37, 3, 8, 16, 16), (200, 3, 9, 16, 32), (50, 4, 16, 128, 64), (33, 2, 8, 16, 1),
              (200, 6, 64, 16, None), (60, 6, 100, 16, None), (1100, 4, 16, 16, None)]


@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("T,k,E,block_m,block_p", SORT_CASES)
def test_sort_tokens_matches_the_stable_layout_in_torch(T, k, E, block_m, block_p, skewed):
    """Ranks counted (the default up to 64 bins) and sorted, blocks counted first and scanned: the
    same layout."""
    from runtime.backends.kernels.moe_config import COUNT_RANKS_MAX_EXPERTS

    g = torch.Generator().manual_seed(T * 131 + E)
    ids = _routed_ids(g, T, k, E, padding_tokens=T // 9, skewed=skewed)
    rows, blocks = sorted_layout_reference(ids, E, block_m)
    counts = [True, False] if E <= COUNT_RANKS_MAX_EXPERTS else [False]
    for count_ranks in counts:
        for scan in (None, False, True):
            sorted_pairs, block_expert, total = (t.cpu() for t in sort_tokens(
                ids.to(DEV), E, block_m, block_p=block_p, count_ranks=count_ranks, scan=scan))
            total = int(total)
            assert total == rows.numel() <= sorted_pairs.numel() and sorted_pairs.numel() % block_m == 0
            assert torch.equal(sorted_pairs[:total], rows), (
                f"count_ranks={count_ranks} scan={scan}: each expert's pairs in pair order, then the sentinel")
            # Only experts that received pairs own blocks, so only their weights are ever read.
            assert torch.equal(block_expert[:total // block_m], blocks)
    if counts == [False]:
        with pytest.raises(ValueError, match="too many to count ranks"):
            sort_tokens(ids.to(DEV), E, block_m, count_ranks=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,slots,width", [(5, 3, 48), (3, 5, 2048), (2, 2, 2100), (1, 1, 16)])
def test_combine_sums_live_slots_in_slot_order_bit_for_bit(T, slots, width, dtype):
    """Rows of padding slots are never written (NaN here) and never read; padding tokens give 0;
    columns past a multiple of the tile run masked (2100)."""
    g = torch.Generator().manual_seed(T * slots)
    sentinel = 6
    ids = torch.randint(0, sentinel, (T, slots), generator=g, dtype=torch.int32)
    ids[0, -1] = sentinel
    ids[-1] = sentinel if T > 1 else ids[-1]
    y = (torch.randn(T * slots, width, generator=g) * 10).to(dtype)
    y[(ids.reshape(-1) == sentinel)] = float("nan")
    out = torch.full((T, width), float("nan"), device=DEV)
    combine(*_on(y, ids), out, sentinel)
    assert torch.equal(out.cpu(), combine_reference(y, ids, sentinel))


def test_sorts_of_a_few_hundred_to_scan_max_pairs_pairs_scan_in_one_launch(monkeypatch):
    """sort_blocks: one program up to 256 pairs; blocks of SCAN_BLOCK_P whose programs count every
    pair themselves to SCAN_MAX_PAIRS (128 decoding requests of bench qwen3_next's MoE: 640 pairs, 5
    programs); past it blocks of COUNTED_BLOCK_P counted first, the count kernel's launch before the
    sort's."""
    from runtime.backends.kernels import moe as M

    assert M.sort_blocks(256) == (256, False)
    assert M.sort_blocks(640) == (M.SCAN_BLOCK_P, True) == (128, True)
    assert M.sort_blocks(M.SCAN_MAX_PAIRS) == (128, True)
    assert M.sort_blocks(M.SCAN_MAX_PAIRS + 1) == (M.COUNTED_BLOCK_P, False) == (512, False)
    counted = []
    real = M._align_count_kernel
    monkeypatch.setattr(M, "_align_count_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: counted.append(grid) or real[grid](*a, **kw))})())
    g = torch.Generator().manual_seed(3)
    sort_tokens(_routed_ids(g, 128, 5, 17, 0, False).to(DEV), 17, 16)
    assert counted == []
    sort_tokens(_routed_ids(g, 1000, 5, 17, 0, False).to(DEV), 17, 16)
    assert counted == [(-(-5000 // M.COUNTED_BLOCK_P),)]


def test_sort_tokens_bound_is_static_and_holds_for_one_expert_or_all():
    E, bm = 8, 16
    for ids in (torch.zeros(5, 2, dtype=torch.int32), torch.arange(8, dtype=torch.int32).view(4, 2)):
        sorted_pairs, _, total = sort_tokens(ids.to(DEV), E, bm)
        P = ids.numel()
        assert sorted_pairs.numel() >= int(total)
        assert sorted_pairs.numel() == -(-(P + min(E, P) * (bm - 1)) // bm) * bm


def test_unused_experts_weights_never_reach_the_output():
    g = torch.Generator().manual_seed(11)
    E, T, k = 8, 3, 2
    router, _, w13, w2, sw13, sw2, gate = _layer(g, E, False, "gated_S=I")
    x = torch.randn(T, D, generator=g)
    ids, _ = route_topk(x, router, None, k, "softmax", True, 1.0, 1, 1)
    unused = [e for e in range(E) if e not in ids.unique().tolist()]
    assert unused
    w13[unused], w2[unused] = float("nan"), float("nan")
    layer = (router, None, w13, w2, sw13, sw2, gate)
    ref = moe_reference(x, *layer, k, "softmax", True, 1.0, 1, 1)
    for config in (SORTED, TOKEN):
        out = torch.full((T, D), float("nan"), device=DEV)
        fused_moe(*_on(x, *layer, out), k, "softmax", True, 1.0, 1, 1, config)
        assert torch.isfinite(out).all() and _rel(out, ref) <= 1e-4


def _ctx(query_lens, num_tokens):
    qsl = torch.zeros(len(query_lens) + 2, dtype=torch.int32)
    qsl[1:len(query_lens) + 1] = torch.tensor(query_lens).cumsum(0)
    qsl[len(query_lens) + 1:] = sum(query_lens)  # a padded request owns no rows
    # on the kernels' device: a replayed step's kernels read the real count there
    return types.SimpleNamespace(num_real_tokens=sum(query_lens), num_tokens=num_tokens, query_start_loc=qsl.to(DEV),
                                 num_seqs=len(query_lens) + 1)


@pytest.mark.parametrize("shared", ["none", "gated_S=40"])
@pytest.mark.parametrize("replayed", [False, True])
def test_backend_zeroes_padding_rows_like_the_cpu_reference(replayed, shared):
    g = torch.Generator().manual_seed(12)
    E, T = 4, 6
    op_args = _layer(g, E, True, shared)
    x = torch.randn(T, D, generator=g)
    ctx = _ctx([2, 2], T)
    tail = (0, 2, "sigmoid", True, 1.0, 2, 1)
    expected = torch.full((T, D), float("nan"))
    CPUReferenceBackend.moe(None, ctx, x, *op_args, expected, *tail)
    backend = TritonMoEBackend(device=DEV)
    if replayed:  # a graph step: the count comes from the static buffer the kernels read
        backend.init_capture_state(max_tokens=T, max_seqs=ctx.num_seqs)
        backend.init_replay_state(ctx, ctx.num_seqs)
    else:
        backend.init_step_metadata(ctx)
    for config in (SORTED, TOKEN):
        out = torch.full((T, D), float("nan"), device=DEV)
        backend.moe(ctx, *_on(x, *op_args, out), *tail, config=config)
        assert (out[4:] == 0).all(), "padding rows must be zero"
        assert _rel(out[:4], expected[:4]) <= 1e-4


def test_backend_declares_its_capability_and_keeps_the_protocol():
    from compiler.splitops import MODES
    from runtime.backends.protocol import BackendHooks, check_backend
    backend = TritonMoEBackend(device=DEV)
    check_backend(backend)
    assert isinstance(backend, BackendHooks) and backend.supported_ops == frozenset({"moe"})
    cap = TritonMoEBackend.capability
    assert cap.device == "cuda" and cap.ops == frozenset({"moe"})
    assert cap.modes_capturable == frozenset(MODES), "the moe op is capturable in every mode"


def _moe_call(E=8, I=32, D=64, top_k=2, S=32, dtype="bfloat16"):
    """The CallFacts routing reads off a moe node (token dimension dynamic)."""
    from compiler.splitops import CallFacts
    shapes = {"x": (None, D), "router_weight": (E, D), "w13": (E, 2 * I, D), "w2": (E, D, I), "out": (None, D)}
    if S:
        shapes.update(shared_w13=(2 * S, D), shared_w2=(D, S), shared_gate=(1, D))
    return CallFacts("moe", 1, dtype, shapes, {"layer_id": 1, "top_k": top_k})


def test_kernel_variant_tokens_name_the_first_count_of_each_launch_variant(monkeypatch):
    """E=8 experts, top-2 and one shared chunk (3 slots per token), D=64, no tuned table: the default
    config's token path to T=2 (2 columns) and T=4 (4), sorted tiles of BLOCK_M 16 from T=5 (a
    mean of T/4 pairs per expert: <= 10), 32 from 41, 64 from 97, 128 from 193; routing and sort
    in one launch to T=64, two from 65; the router's GEMV to T=128, a dot past it; the sort's wider
    block past 256 pairs (T=86: blocks of SCAN_BLOCK_P scanned); with down=split, its first count. A
    count of each, the smallest, and nothing under the interpreter."""
    import runtime.backends.triton_moe as backend_module
    from runtime.backends.triton_moe import MoELayerShape
    layer = MoELayerShape.of(_moe_call())
    assert layer == MoELayerShape(experts=8, inter=32, hidden=64, top_k=2, slots=3, dtype="bfloat16")
    backend = TritonMoEBackend(device="cpu", layers=(layer, layer))
    monkeypatch.setattr(backend_module, "triton_interpreted", lambda: False)
    assert backend.kernel_variant_tokens(256) == (1, 3, 5, 41, 65, 86, 97, 129, 193)
    assert backend.kernel_variant_tokens(64) == (1, 3, 5, 41)
    # the scanned blocks hold to SCAN_MAX_PAIRS (4096 pairs, T=1365); past it (T=1366) the sort counts
    # its blocks first: one more variant
    assert backend.kernel_variant_tokens(512) == (1, 3, 5, 41, 65, 86, 97, 129, 193)
    assert backend.kernel_variant_tokens(2048)[-1] == 1366
    # a second layer shape adds its own first counts (no shared expert: 2 slots, wider block at T=129)
    other = MoELayerShape.of(_moe_call(S=0))
    both = TritonMoEBackend(device="cpu", layers=(layer, other))
    assert set(both.kernel_variant_tokens(256)) == {1, 3, 5, 41, 65, 86, 97, 129, 193}
    # the one-launch router folds where the routing and sort fold (to T=64): no count of its own
    one = TritonMoEBackend(device="cpu", layers=(layer,), router="one_launch")
    assert one.kernel_variant_tokens(256) == (1, 3, 5, 41, 65, 86, 97, 129, 193)
    # the split down adds its first count (SPLIT_DOWN_MIN_TOKENS, lowered here to 100)
    monkeypatch.setattr(backend_module._kernels(), "SPLIT_DOWN_MIN_TOKENS", 100)
    split = TritonMoEBackend(device="cpu", layers=(layer,), down="split")
    assert split.kernel_variant_tokens(256) == (1, 3, 5, 41, 65, 86, 97, 100, 129, 193)
    monkeypatch.setattr(backend_module, "triton_interpreted", lambda: True)
    assert backend.kernel_variant_tokens(256) == ()
    assert TritonMoEBackend(device="cpu").kernel_variant_tokens(256) == (), "no layer shapes: nothing to name"


BACKEND_TAIL = (0, 2, "sigmoid", True, 1.0, 4, 2)  # layer id, top-2, grouped sigmoid routing with a bias


def _backend_layer():
    """The backend tests' layer: 8 experts with a router bias and a gated shared expert of 40 channels."""
    return _layer(torch.Generator().manual_seed(5), 8, True, "gated_S=40")


def _spy_on_route(monkeypatch, what) -> list:
    """The list that what(args, kwargs) of each `_route` call (the kernels module's) is appended to."""
    import runtime.backends.triton_moe as backend_module

    kernels = backend_module._kernels()
    asked, real_route = [], kernels._route
    monkeypatch.setattr(kernels, "_route", lambda *a, **k: asked.append(what(a, k)) or real_route(*a, **k))
    return asked


def _backend_steps(backend, counts, seed: int):
    """(T, backend's output, the CPU oracle's) for a step of each token count on `_backend_layer`."""
    g = torch.Generator().manual_seed(seed)
    op_args = _backend_layer()
    for T in counts:
        x = torch.randn(T, D, generator=g)
        out = torch.full((T, D), float("nan"), device=DEV)
        backend.moe(None, *_on(x, *op_args, out), *BACKEND_TAIL)
        expected = torch.full((T, D), float("nan"))
        CPUReferenceBackend.moe(None, None, x, *op_args, expected, *BACKEND_TAIL)
        yield T, out, expected


def test_the_router_option_runs_the_router_in_one_launch_where_the_step_folds(monkeypatch):
    """router="one_launch" (--route 'moe=triton_moe[router=one_launch]'): the backend's steps launch
    the router kernel where the GEMV's step folds, and past 128 tokens the split router (one launch
    too, and faster than the GEMM routing its own rows), and match the CPU oracle; a bad choice is a
    one-line error."""
    asked = _spy_on_route(monkeypatch, lambda a, k: (a[10], k.get("one_launch")))  # a[10]: the logits kernel
    backend = TritonMoEBackend(device=DEV, router="one_launch")
    for T, out, expected in _backend_steps(backend, (1, 9, 70, 130), seed=23):
        assert _rel(out, expected) <= 1e-4
    assert asked == [("gemv", True), ("gemv", True), ("gemv", False), ("split", False)], (
        "one launch to 64 tokens (a routing tile at 8 experts) after the GEMV, two past it; the split router "
        "past 128")
    with pytest.raises(ValueError, match="router must be one of"):
        TritonMoEBackend(device="cpu", router="fused")


def test_the_in_experts_router_option_routes_token_steps_in_the_gate_up_kernel(monkeypatch):
    """router="in_experts" (--route 'moe=triton_moe[router=in_experts]'): token-path steps (T 1 and
    3, the default configs' token path) route in their gate-up kernel and call no router, a sorted
    step (9) routes as "split" does; each matches the CPU oracle, and the token steps' launch
    variants differ from the default router's (a bundle builds both)."""
    import runtime.backends.triton_moe as backend_module

    asked = _spy_on_route(monkeypatch, lambda a, k: a[0].shape[0])
    backend = TritonMoEBackend(device=DEV, router="in_experts")
    for T, out, expected in _backend_steps(backend, (1, 3, 9), seed=31):
        assert _rel(out, expected) <= 1e-4
    assert asked == [9]
    kernels = backend_module._kernels()
    token = backend.config_for(1, 8, 32, 64, 2, torch.device("cpu"))
    assert token.path == "token"
    assert kernels.launch_variant(1, 8, 64, 3, token, route_in_experts=True) != kernels.launch_variant(1, 8, 64, 3,
                                                                                                        token)


def test_the_experts_option_runs_token_steps_gate_up_and_down_in_one_launch(monkeypatch):
    """experts="one_launch" (--route 'moe=triton_moe[experts=one_launch]'): token-path steps (T 1
    and 3) run `experts_token`, a sorted step (9) does not; each matches the CPU oracle, the token
    steps' launch variants differ from the two launches' (a bundle builds both), and a bad choice
    is a one-line error."""
    import runtime.backends.triton_moe as backend_module

    kernels = backend_module._kernels()
    asked, real = [], kernels.experts_token
    monkeypatch.setattr(kernels, "experts_token", lambda x, *a, **k: asked.append(x.shape[0]) or real(x, *a, **k))
    backend = TritonMoEBackend(device=DEV, experts="one_launch")
    for T, out, expected in _backend_steps(backend, (1, 3, 9), seed=37):
        assert _rel(out, expected) <= 1e-4
    assert asked == [1, 3]
    token = backend.config_for(1, 8, 32, 64, 2, torch.device("cpu"))
    assert kernels.launch_variant(1, 8, 64, 3, token, route_in_experts=True, experts_one_launch=True) != (
        kernels.launch_variant(1, 8, 64, 3, token, route_in_experts=True))
    with pytest.raises(ValueError, match="experts must be one of"):
        TritonMoEBackend(device="cpu", experts="three_launches")

def test_the_split_router_and_counted_ranks_options_serve_as_the_defaults(monkeypatch):
    """router="split" (past 128 tokens the router GEMM in slices, the last slice routing) and
    sort_ranks="counted" (each block's ranks counted, not sorted): the CPU oracle's output at a
    step the GEMV routes (one launch sorting, T 9), one it routes then sorts (70) and one past 128
    tokens (130); the backend asks for what its options say; bad choices are one-line errors."""
    asked = _spy_on_route(monkeypatch, lambda a, k: (a[10], k.get("count_ranks")))  # a[10]: the logits kernel
    backend = TritonMoEBackend(device=DEV, router="split", sort_ranks="counted")
    for T, out, expected in _backend_steps(backend, (9, 70, 130), seed=29):
        assert _rel(out, expected) <= 1e-4
    assert asked == [("gemv", True), ("gemv", True), ("split", True)]
    with pytest.raises(ValueError, match="sort_ranks must be one of"):
        TritonMoEBackend(device="cpu", sort_ranks="bitonic")


def test_the_default_router_routes_token_steps_in_experts_then_the_gemv_then_the_split_router(monkeypatch):
    """With no router option (ROUTERS' first choice, in_experts) a token-path step routes in its
    gate-up kernel and calls no router, a step up to 128 tokens takes the GEMV and a step past it
    the split router, against the CPU oracle; router=two_launches keeps the GEMM."""
    asked = _spy_on_route(monkeypatch, lambda a, k: a[10])  # a[10]: the logits kernel
    assert TritonMoEBackend(device=DEV).route_in_experts
    for T, out, expected in _backend_steps(TritonMoEBackend(device=DEV), (1, 70, 130), seed=41):
        assert _rel(out, expected) <= 1e-4
    assert asked == ["gemv", "split"]
    asked.clear()
    list(_backend_steps(TritonMoEBackend(device=DEV, router="two_launches"), (130,), seed=41))
    assert asked == ["dot"]
    assert not TritonMoEBackend(device=DEV, gemm_tiles="fixed").split_router, "fixed tiles keep one router"


def test_the_down_option_splits_the_down_of_long_sorted_steps(monkeypatch):
    """down="split" (--route 'moe=triton_moe[down=split]'): sorted steps from SPLIT_DOWN_MIN_TOKENS
    (lowered here to 64: the interpreter would take minutes at 2048) take the split down and match
    the CPU oracle; shorter ones and fixed tiles keep the sorted down; on a GPU only bf16 splits;
    a bad choice is a one-line error."""
    import runtime.backends.triton_moe as backend_module

    if DEV.type == "cuda":  # these float32 steps would not split there: tests/gpu/test_gpu_moe.py runs bf16
        pytest.skip("the backend's float32 steps split only under the interpreter")
    kernels = backend_module._kernels()
    monkeypatch.setattr(kernels, "SPLIT_DOWN_MIN_TOKENS", 64)
    splits, real = [], kernels.down_split
    monkeypatch.setattr(kernels, "down_split", lambda *a, **k: splits.append(a[0].shape[0]) or real(*a, **k))
    for T, out, expected in _backend_steps(TritonMoEBackend(device=DEV, down="split"), (9, 70), seed=31):
        assert _rel(out, expected) <= 1e-4, T
    assert len(splits) == 1, "70 tokens split (the h of its sorted rows), 9 do not"
    for T, out, expected in _backend_steps(TritonMoEBackend(device=DEV, down="split", gemm_tiles="fixed"), (70,), 37):
        assert _rel(out, expected) <= 1e-4
    assert len(splits) == 1, "fixed tiles never split: a token's bits would change with the step's size"
    cuda = torch.device("cuda")  # the rule alone: nothing runs there
    assert kernels.splits_down(64, torch.bfloat16, cuda) and not kernels.splits_down(64, torch.float32, cuda)
    assert not kernels.splits_down(63, torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="down must be one of"):
        TritonMoEBackend(device="cpu", down="grouped")


def test_counted_ranks_refuse_more_than_64_experts():
    from runtime.backends.kernels.moe import route_sort
    from runtime.backends.triton_moe import MoELayerShape

    wide = MoELayerShape(experts=64, inter=I, hidden=D, top_k=2, slots=3, dtype="bfloat16")
    with pytest.raises(ValueError, match="too many to count ranks"):
        TritonMoEBackend(device="cpu", layers=(wide,), sort_ranks="counted")
    x, router = _on(torch.randn(80, D), torch.randn(72, D))
    with pytest.raises(ValueError, match="too many to count ranks"):
        route_sort(x, router, None, 2, "softmax", True, 1.0, 1, 1, 16, count_ranks=True)


def test_importing_the_backend_needs_no_triton():
    import subprocess
    import sys
    code = "import sys, runtime.backends.triton_moe as m; m.TritonMoEBackend.capability; print('triton' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    from testkit.helpers import ROOT  # the repository root: its packages import from there without an install
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "False"


def test_backend_moe_has_the_cpu_reference_signature():
    ours = list(inspect.signature(TritonMoEBackend.moe).parameters)
    ref = list(inspect.signature(CPUReferenceBackend.moe).parameters)
    assert ours[: len(ref)] == ref


def test_results_are_deterministic_bit_for_bit():
    g = torch.Generator().manual_seed(13)
    E, T = 8, 17
    layer = _layer(g, E, False, "ungated_S=2I")
    x = torch.randn(T, D, generator=g)
    outs = []
    for _ in range(2):
        out = torch.empty(T, D, device=DEV)
        fused_moe(*_on(x, *layer, out), 2, "softmax", True, 1.0, 1, 1, SORTED)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_config_files_are_found_by_expert_count_width_and_device(tmp_path):
    table = {"meta": {"E": 8, "I": 24},
             "buckets": {"1": {"gate_up": TOKEN.gate_up.to_dict(), "down": TOKEN.down.to_dict()},
                         "16": SORTED.gate_up.to_dict()}}
    (tmp_path / config_file_name(8, 24, "cpu")).write_text(json.dumps(table))
    backend = TritonMoEBackend(config_dir=tmp_path, device="cpu")
    cpu = torch.device("cpu")
    assert backend.config_for(1, 8, 24, D, 2, cpu).path == "token"
    assert backend.config_for(2, 8, 24, D, 2, cpu) == SORTED  # smallest bucket >= T
    assert backend.config_for(500, 8, 24, D, 2, cpu) == SORTED  # past the last bucket: the last
    # No file for this width: the documented default.
    assert backend.config_for(64, 8, 32, D, 2, cpu) == default_config(64, 8, 32, D, 2)
    (tmp_path / config_file_name(4, 24, "cpu")).write_text("{not json")
    with pytest.raises(ValueError, match="E=4,I=24,device=cpu.json"):
        backend.config_for(1, 4, 24, D, 2, cpu)


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="BLOCK_M"):
        MoEConfig(GemmConfig(16, 16, 32), GemmConfig(32, 16, 32))
    with pytest.raises(ValueError, match="powers of two"):
        GemmConfig(24, 16, 32)
    with pytest.raises(ValueError, match="unknown MoE config keys"):
        GemmConfig.from_dict({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "BLOCK_Q": 1})


def test_bad_routing_arguments_are_refused_with_a_message():
    x, router = torch.randn(2, D), torch.randn(6, D)
    with pytest.raises(ValueError, match="do not split into 4 groups"):
        route(x, router, None, 2, "softmax", True, 1.0, 4, 1)
    with pytest.raises(ValueError, match="top_k 3"):
        route(x, router, None, 3, "softmax", True, 1.0, 3, 1)
    with pytest.raises(ValueError, match="unknown scoring"):
        route(x, router, None, 1, "relu", True, 1.0, 1, 1)


def test_float32_configs_are_fitted_to_shared_memory_and_bf16_ones_kept():
    """The 128 x 128 x 64 tile at 4 stages asked an H200 for 294,912 bytes of shared memory in float32
    (232,448 there): fitted, it takes fewer stages; every default bf16 config is returned unchanged."""
    from runtime.backends.kernels.moe_config import SHARED_MEMORY_BUDGET, default_config, fit_shared_memory

    def need(c, itemsize):
        return max(1, c.num_stages - 1) * (c.BLOCK_M + 2 * c.BLOCK_N) * c.BLOCK_K * itemsize

    big = default_config(256, 16, 1024, 2304, 8)
    assert need(big.gate_up, 4) == 294912
    fitted = fit_shared_memory(big, 4)
    assert need(fitted.gate_up, 4) <= SHARED_MEMORY_BUDGET and need(fitted.down, 4) <= SHARED_MEMORY_BUDGET
    assert fitted.gate_up.BLOCK_M == big.gate_up.BLOCK_M  # the sorted layout is unchanged
    for T in (1, 8, 32, 128, 512, 4096):
        c = default_config(T, 16, 512, 2048, 4)
        assert fit_shared_memory(c, 2) == c


def test_a_replayed_step_reads_its_real_token_count_from_the_step_buffer():
    """No count is written before a replay: the kernels read query_start_loc's last offset, so a
    whole-step graph needs no call on this backend, and a count of another dtype is refused."""
    backend = TritonMoEBackend(device=DEV)
    ctx = _ctx([2, 1], 4)
    backend.init_replay_state(ctx, ctx.num_seqs)
    count = backend._planned[1]
    assert count.data_ptr() == ctx.query_start_loc[ctx.num_seqs:].data_ptr() and int(count) == 3
    assert all(backend.replay_state_in_graph(m) for m in TritonMoEBackend.capability.modes_capturable)
    wide = types.SimpleNamespace(num_seqs=ctx.num_seqs, query_start_loc=ctx.query_start_loc.long())
    with pytest.raises(RuntimeError, match="query_start_loc must be int32"):
        backend.init_replay_state(wide, ctx.num_seqs)


def test_fixed_tiles_give_a_token_the_same_bits_whatever_shares_its_step(monkeypatch):
    """gemm_tiles="fixed" (hgc compile --batch-invariant): one config and one router kernel for every
    token count, so token t's output in a step of 1 token equals its row in a step of 9 bit for bit,
    and both match the CPU oracle. The tuned choice would switch paths between these counts (token
    path to T=4, sorted tiles past it; the router's GEMV to 128, a dot past it; routing and sort in
    one launch to 64), which is what made a decode row and a verify row of one token differ."""
    import runtime.backends.triton_moe as backend_module
    from runtime.backends.kernels.moe_config import FIXED_CONFIG, FIXED_LOGITS_KERNEL
    from runtime.backends.triton_moe import MoELayerShape

    g = torch.Generator().manual_seed(21)
    E, T = 8, 9
    op_args = _layer(g, E, True, "gated_S=40")
    x = torch.randn(T, D, generator=g)
    tail = (0, 2, "sigmoid", True, 1.0, 4, 2)
    backend = TritonMoEBackend(device=DEV, gemm_tiles="fixed")
    assert backend.config_for(1, E, I, D, 2, DEV) == backend.config_for(512, E, I, D, 2, DEV) == FIXED_CONFIG
    launched = []  # (logits kernel, routed and sorted in one launch) of each router launch
    real_route = backend_module._kernels()._route
    monkeypatch.setattr(backend_module._kernels(), "_route",
                        lambda *a, **k: launched.append((a[10], k.get("sort_block_m") is not None))
                        or real_route(*a, **k))
    rows = {}
    for n in (1, T):
        out = torch.full((n, D), float("nan"), device=DEV)
        backend.moe(None, *_on(x[:n], *op_args, out), *tail)
        rows[n] = out.cpu()
    assert launched == [(FIXED_LOGITS_KERNEL, False)] * 2, "fixed tiles never route and sort in one launch"
    assert torch.equal(rows[1][0], rows[T][0]), "token 0 alone and among 9 must give the same bits"
    expected = torch.full((T, D), float("nan"))
    CPUReferenceBackend.moe(None, None, x, *op_args, expected, *tail)
    assert _rel(rows[T], expected) <= 1e-4
    # one launch variant below the sort's wider block: start-up builds a kernel set, not one per bucket
    layer = MoELayerShape.of(_moe_call())
    fixed = TritonMoEBackend(device="cpu", layers=(layer,), gemm_tiles="fixed")
    monkeypatch.setattr(backend_module, "triton_interpreted", lambda: False)
    assert fixed.kernel_variant_tokens(256) == (1, 86)
    with pytest.raises(ValueError, match="gemm_tiles"):
        TritonMoEBackend(device="cpu", gemm_tiles="tiny")
