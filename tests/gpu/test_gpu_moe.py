"""The fused Triton MoE on a CUDA GPU at real dimensions, bf16, against the float32 CPU oracle.

Run on the GPU machine: `python -m pytest -m gpu tests/gpu/test_gpu_moe.py`. The reference is
`moe_reference` on the CPU with the same bf16 values upcast to float32; the tolerance is a
relative error of norms <= 1e-2 (bf16 operands, bf16 intermediates h and y, bf16 output). Layers
come without a shared expert, with a gated one as wide as a routed expert (Qwen3-Next), an
ungated one twice as wide (Kimi-Linear with two shared experts) and a gated one of 640 channels
(two chunks, the last one masked past 128 of its 512).
"""

from __future__ import annotations

import types

import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton", reason="triton is not installed")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from compiler.splitops import Mode  # noqa: E402
from runtime.backends.cpu_reference import moe_reference, route_topk  # noqa: E402
from runtime.backends.kernels.moe_config import GemmConfig, MoEConfig  # noqa: E402
from runtime.backends.triton_moe import TritonMoEBackend  # noqa: E402
from runtime.backends.kernels.moe import fused_moe  # noqa: E402

DEV = torch.device("cuda")
D, I = 2048, 512
TOL = 1e-2


# Shared experts: (width S, gated).
SHARED = {"none": (0, False), "gated_S=I": (I, True), "ungated_S=2I": (2 * I, False), "gated_S=640": (640, True)}


def _layer(E: int, seed: int, bias: bool = False, shared: str = "none"):
    """(router, bias, w13, w2, shared_w13, shared_w2, shared_gate) in the moe op's schema order."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    router = torch.randn(E, D, device=DEV, generator=g).mul_(D ** -0.5).bfloat16()
    b = (torch.randn(E, device=DEV, generator=g) * 0.05) if bias else None
    w13 = torch.randn(E, 2 * I, D, device=DEV, generator=g).mul_(D ** -0.5).bfloat16()
    w2 = torch.randn(E, D, I, device=DEV, generator=g).mul_(I ** -0.5).bfloat16()
    S, gated = SHARED[shared]
    sw13 = torch.randn(2 * S, D, device=DEV, generator=g).mul_(D ** -0.5).bfloat16() if S else None
    sw2 = torch.randn(D, S, device=DEV, generator=g).mul_(S ** -0.5).bfloat16() if S else None
    gate = torch.randn(1, D, device=DEV, generator=g).mul_(D ** -0.5).bfloat16() if gated else None
    return router, b, w13, w2, sw13, sw2, gate


def _reference(x, *layer_and_tail):
    layer, tail = layer_and_tail[:7], layer_and_tail[7:]
    cpu = [t.float().cpu() if t is not None else None for t in (x, *layer)]
    return moe_reference(*cpu, *tail)


def _rel(a, b) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


@pytest.mark.parametrize("T", [1, 7, 64, 513])
@pytest.mark.parametrize("shared", ["none", "gated_S=I", "ungated_S=2I"])
@pytest.mark.parametrize("E,top_k", [(16, 4), (512, 10)])
def test_matches_reference_in_bf16(E, top_k, shared, T):
    layer = _layer(E, seed=E + T, shared=shared)
    x = torch.randn(T, D, device=DEV).bfloat16()
    tail = (top_k, "softmax", True, 1.0, 1, 1)
    out = torch.full((T, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    TritonMoEBackend().moe(None, x, *layer, out, 0, *tail)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "rows left unwritten"
    err = _rel(out, _reference(x, *layer, *tail))
    assert err <= TOL, f"rel err {err:.2e}"


@pytest.mark.parametrize("shared", ["none", "gated_S=640"])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_token_and_sorted_paths_agree_with_reference(T, shared):
    layer = _layer(64, seed=3, bias=True, shared=shared)
    x = torch.randn(T, D, device=DEV).bfloat16()
    tail = (6, "sigmoid", True, 2.5, 8, 4)  # sigmoid, selection bias, 8 groups, 4 kept
    ref = _reference(x, *layer, *tail)
    for config in (MoEConfig(GemmConfig(1, 16, 256), GemmConfig(1, 16, 256)),
                   MoEConfig(GemmConfig(16, 64, 128, 1, 4, 4), GemmConfig(16, 64, 128, 1, 4, 4))):
        out = torch.full((T, D), float("nan"), device=DEV, dtype=torch.bfloat16)
        fused_moe(x, *layer, out, *tail, config)
        assert _rel(out, ref) <= TOL, f"{config.path}: rel err {_rel(out, ref):.2e}"


def test_captured_graph_replays_bit_for_bit_and_follows_the_real_token_count():
    E, top_k, T = 16, 4, 8
    layer = _layer(E, seed=5, shared="gated_S=I")
    x = torch.randn(T, D, device=DEV).bfloat16()
    # The step buffer the graph runner refills before each replay: one request of T rows, then a
    # padded request that owns none (the last offset is the real token count the kernels read).
    qsl = torch.tensor([0, T, T], dtype=torch.int32, device=DEV)
    ctx = types.SimpleNamespace(num_real_tokens=T, num_seqs=2, query_start_loc=qsl)
    tail = (top_k, "softmax", True, 1.0, 1, 1)
    backend = TritonMoEBackend()
    backend.init_capture_state(max_tokens=T, max_seqs=2)
    backend.init_replay_state(ctx, 2)
    eager = torch.empty(T, D, device=DEV, dtype=torch.bfloat16)
    backend.moe(ctx, x, *layer, eager, 0, *tail)  # also compiles before capture
    out = torch.full((T, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.moe(ctx, x, *layer, out, 0, *tail)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager), "graph replay differs from the eager call"
    # The next step has only 5 real rows: the runtime refills the step buffer, then replays; the
    # backend is not called at all (its replay state is in the graph).
    assert backend.replay_state_in_graph(Mode.DECODE)
    qsl.copy_(torch.tensor([0, 5, 5], dtype=torch.int32))
    x2 = torch.randn(T, D, device=DEV).bfloat16()
    x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert (out[5:] == 0).all()
    assert _rel(out[:5], _reference(x2[:5], *layer, *tail)) <= TOL


def _replays(backend, layer, tail, T: int, eager_backend=None):
    """`backend`'s moe captured on T bf16 rows, then three replays on fresh random inputs copied into
    the captured buffer: each replay's output is checked against `eager_backend`'s eager one (by
    default the default backend's; 1e-3: the routers' float32 sums may differ in order) and the CPU
    oracle's (TOL), then its inputs are yielded for the caller's own checks."""
    default = eager_backend or TritonMoEBackend()
    x = torch.randn(T, D, device=DEV).bfloat16()
    out = torch.full((T, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    backend.moe(None, x, *layer, out, 0, *tail)  # compiles, and allocates the counters, before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.moe(None, x, *layer, out, 0, *tail)
    for round_ in range(3):
        fresh = torch.randn(T, D, device=DEV).bfloat16()
        x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager = torch.empty_like(out)
        default.moe(None, fresh, *layer, eager, 0, *tail)
        assert _rel(out, eager) <= 1e-3, f"replay {round_}: {_rel(out, eager):.2e} from the eager step"
        assert _rel(out, _reference(fresh, *layer, *tail)) <= TOL
        yield fresh


@pytest.mark.parametrize("T", [1, 32, 256])
def test_the_one_launch_router_replays_with_fresh_inputs_as_the_eager_two_launches(T):
    """router="one_launch" captured at bench qwen3_next's MoE (16 experts of 512, top-4, a gated
    shared expert): each of three replays, on fresh random inputs copied into the captured buffer,
    gives the eager two-launch router's ids (the last program to finish routed that replay: its
    counter was back at zero) and the CPU oracle's output. T=1: the token path; 32: it sorts too;
    256: the backend takes the split router there, and route(one_launch=True) the GEMM's programs
    routing their own rows."""
    from runtime.backends.kernels.arrivals import arrival_counters
    from runtime.backends.kernels.moe import route

    E, top_k = 16, 4
    layer = _layer(E, seed=17, shared="gated_S=I")
    tail = (top_k, "softmax", True, 1.0, 1, 1)
    for fresh in _replays(TritonMoEBackend(router="one_launch"), layer, tail, T):
        ids, _ = route(fresh, layer[0], None, top_k, "softmax", True, 1.0, 1, 1, n_shared=1, shared_gate=layer[6])
        ids_one, _ = route(fresh, layer[0], None, top_k, "softmax", True, 1.0, 1, 1, n_shared=1,
                           shared_gate=layer[6], one_launch=True)
        assert torch.equal(ids_one, ids)
        assert int(arrival_counters(DEV, 1, "moe router")[0]) == 0


@pytest.mark.parametrize("T", [1, 2, 4])
def test_the_in_experts_router_replays_with_fresh_inputs_as_the_routing_kernel(T):
    """router="in_experts" captured at bench qwen3_next's MoE (16 experts of 512, top-4, a gated
    shared expert) on the token path (1, 2, 4 tokens): each of three replays, on fresh random
    inputs, gives the eager split router's output (1e-3: the routing kernel apart) and the CPU
    oracle's; route_in_gate_up's ids
    and h are the routing kernel's and gate_up_token's on them, exactly, and its weights to float32
    rounding (the routing runs on other warps)."""
    from runtime.backends.kernels.moe import gate_up_token, route, route_in_gate_up

    E, top_k = 16, 4
    layer = _layer(E, seed=19, shared="gated_S=I")
    tail = (top_k, "softmax", True, 1.0, 1, 1)
    backend = TritonMoEBackend(router="in_experts")
    config = backend.config_for(T, E, I, D, top_k, DEV)
    assert config.path == "token"
    for fresh in _replays(backend, layer, tail, T, eager_backend=TritonMoEBackend(router="split")):
        kw = dict(n_shared=1, shared_gate=layer[6])
        ids, weights = route(fresh, layer[0], None, *tail, **kw, logits_kernel="gemv")
        h = gate_up_token(fresh, layer[2], ids, config.gate_up, shared_w13=layer[4])
        got_ids, got_w, got_h = route_in_gate_up(fresh, layer[0], None, layer[2], *tail, config.gate_up, **kw,
                                                 shared_w13=layer[4])
        assert torch.equal(got_ids, ids) and torch.equal(got_h, h)
        assert torch.allclose(got_w, weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("T", [1, 2, 4])
def test_the_experts_in_one_launch_replay_with_fresh_inputs_as_the_two_launches(T):
    """experts="one_launch" captured at bench qwen3_next's MoE (16 experts of 512, top-4, a gated
    shared expert) on the token path (1, 2, 4 tokens): each of three replays, on fresh random
    inputs, gives the eager two launches' output (the default backend's) and the CPU oracle's, and
    leaves its counters at zero; thirty replays in a row give the same output bits each time (a
    down program that read h before its token's gate-up programs stored it would show there)."""
    from runtime.backends.kernels.arrivals import arrival_counters

    E, top_k = 16, 4
    layer = _layer(E, seed=23, shared="gated_S=I")
    tail = (top_k, "softmax", True, 1.0, 1, 1)
    backend = TritonMoEBackend(experts="one_launch")
    assert backend.config_for(T, E, I, D, top_k, DEV).path == "token"
    for _ in _replays(backend, layer, tail, T):
        assert not arrival_counters(DEV, 2 * T, "moe experts")[:2 * T].any()
    x = torch.randn(T, D, device=DEV).bfloat16()
    eager = torch.empty(T, D, device=DEV, dtype=torch.bfloat16)
    backend.moe(None, x, *layer, eager, 0, *tail)
    outs = torch.full((30, T, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for out in outs:
            backend.moe(None, x, *layer, out, 0, *tail)
    graph.replay()
    torch.cuda.synchronize()
    differ = [i for i, out in enumerate(outs) if not torch.equal(out, eager)]
    assert not differ, f"launches {differ} of 30 gave other bits than the eager one"
    assert not arrival_counters(DEV, 2 * T, "moe experts")[:2 * T].any()


@pytest.mark.parametrize("T", [256, 4096])
def test_the_split_router_and_counted_ranks_replay_as_the_defaults_route(T):
    """router="split" and sort_ranks="counted" captured at bench qwen3_next's MoE (16 experts of 512,
    top-4, a gated shared expert): on fresh random inputs each replay gives the eager step's output
    and the CPU oracle's to TOL; the split router's ids are the GEMM's and the routing kernel's but
    where a near tie flips (its float32 sums run in another order), every counter is back at zero,
    and the counted ranks lay the default router's ids out as the sort does."""
    from runtime.backends.kernels.arrivals import arrival_counters
    from runtime.backends.kernels.moe import route, sort_tokens, split_router_shape

    E, top_k = 16, 4
    layer = _layer(E, seed=19, shared="gated_S=I")
    tail = (top_k, "softmax", True, 1.0, 1, 1)
    blocks = split_router_shape(T, D)[0]
    options = dict(router="split", sort_ranks="counted")
    for fresh in _replays(TritonMoEBackend(**options), layer, tail, T, eager_backend=TritonMoEBackend(**options)):
        args = (fresh, layer[0], None, *tail)
        ids, _ = route(*args, n_shared=1, shared_gate=layer[6], logits_kernel="dot")
        ids_split, _ = route(*args, n_shared=1, shared_gate=layer[6], logits_kernel="split")
        same = (ids_split == ids).all(-1).float().mean().item()
        assert same >= 0.999, f"only {same:.4f} of tokens routed as the GEMM's logits route them (near ties)"
        assert not arrival_counters(DEV, blocks, "moe router")[:blocks].any()
        for block_m in (16, 64):
            counted, sorted_ = (sort_tokens(ids, E + 1, block_m, count_ranks=c) for c in (True, False))
            total = int(sorted_[2])
            assert int(counted[2]) == total and torch.equal(counted[0][:total], sorted_[0][:total])


@pytest.mark.parametrize("shared", ["gated_S=I", "gated_S=640"])
@pytest.mark.parametrize("T", [2048, 4096])
def test_the_split_down_replays_as_its_eager_step_and_the_oracle(T, shared, monkeypatch):
    """down="split" captured at bench qwen3_next's MoE (16 experts of 512, top-4) with a shared
    expert of one chunk and of two (the last masked): torch's grouped GEMM and the dense shared GEMM
    inside the graph, each replay on fresh inputs against the eager split step (1e-3) and the CPU
    oracle (TOL); the eager split against the sorted down (TOL); every step took the split down."""
    from runtime.backends.kernels import moe as kernels

    splits, real = [], kernels.down_split
    monkeypatch.setattr(kernels, "down_split", lambda *a, **k: splits.append(T) or real(*a, **k))
    E, top_k = 16, 4
    layer = _layer(E, seed=23, shared=shared)
    tail = (top_k, "softmax", True, 1.0, 1, 1)
    split = TritonMoEBackend(down="split")
    for fresh in _replays(TritonMoEBackend(down="split"), layer, tail, T, eager_backend=split):
        outs = [torch.empty(T, D, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
        split.moe(None, fresh, *layer, outs[0], 0, *tail)
        TritonMoEBackend().moe(None, fresh, *layer, outs[1], 0, *tail)
        assert _rel(outs[0], outs[1]) <= TOL
    # the warm-up and the capture, then two eager split steps a replay (the replays call no Python)
    assert len(splits) == 2 + 3 * 2, splits


def test_capture_without_replay_state_is_refused():
    from runtime.backends.triton_moe import CaptureError
    layer = _layer(16, seed=6)
    x = torch.randn(4, D, device=DEV).bfloat16()
    out = torch.empty_like(x)
    ctx = types.SimpleNamespace(num_real_tokens=3)
    backend = TritonMoEBackend()
    backend.init_step_metadata(ctx)
    backend.moe(ctx, x, *layer, out, 0, 4, "softmax", True, 1.0, 1, 1)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError, match="init_replay_state"):
        with torch.cuda.graph(graph):
            backend.moe(ctx, x, *layer, out, 0, 4, "softmax", True, 1.0, 1, 1)


def test_router_ids_match_the_reference_router():
    E, top_k, T = 512, 10, 256
    router = _layer(E, seed=9)[0]
    x = torch.randn(T, D, device=DEV).bfloat16()
    from runtime.backends.kernels.moe import route
    ids, w = route(x, router, None, top_k, "softmax", True, 1.0, 1, 1)
    rids, rw = route_topk(x.float().cpu(), router.float().cpu(), None, top_k, "softmax", True, 1.0, 1, 1)
    same = (ids.long().cpu() == rids).all(-1).float().mean().item()
    # Summation order differs (float32 either way): a near tie may flip on a rare token.
    assert same >= 0.99, f"only {same:.3f} of tokens routed identically"


# The bench layer (bench qwen3_next's MoE: E 16 top-4, a gated shared expert as wide as a routed
# one, so 5 slots and experts 0..16) at the token counts of a decode batch, a short and a long extend.
BENCH_TOKENS = [32, 512, 4096]


def _routed(E: int, top_k: int, T: int, seed: int, shared: str = "gated_S=I"):
    """(x, layer, tail, ids, weights, experts) with the router's ids; the last 3 rows are padding."""
    from runtime.backends.kernels.moe import route, shared_chunks
    layer = _layer(E, seed=seed, shared=shared)
    x = torch.randn(T, D, device=DEV).bfloat16()
    tail = (top_k, "softmax", True, 1.0, 1, 1)
    n_shared = shared_chunks(SHARED[shared][0], I)
    ids, weights = route(x, layer[0], None, *tail, n_real=T - 3, n_shared=n_shared, shared_gate=layer[6])
    return x, layer, tail, ids, weights, E + n_shared


@pytest.mark.parametrize("block_m", [16, 64, 128])
@pytest.mark.parametrize("T", BENCH_TOKENS)
@pytest.mark.parametrize("E,top_k", [(16, 4), (512, 10)])
@pytest.mark.parametrize("scan", [None, False])
def test_sort_tokens_gives_the_stable_layout_bit_for_bit(E, top_k, T, block_m, scan):
    """The default layouts (one launch at 32 tokens, 160 pairs; scanned blocks to 4096 pairs; a count
    then a sort of 512-pair blocks past that) and blocks counted first at every count; the layout
    is exactly the torch one: each expert's pairs in pair order, then the sentinel."""
    from runtime.backends.kernels.moe import sort_tokens
    from testkit.moe_checks import sorted_layout_reference
    _, _, _, ids, _, experts = _routed(E, top_k, T, seed=T + block_m)
    sorted_pairs, block_expert, total = sort_tokens(ids, experts, block_m, scan=scan)
    rows, blocks = sorted_layout_reference(ids, experts, block_m)
    total = int(total)
    assert total == rows.numel()
    assert torch.equal(sorted_pairs[:total].cpu(), rows)
    assert torch.equal(block_expert[:total // block_m].cpu(), blocks)


@pytest.mark.parametrize("n_real", ["host", "device"])
@pytest.mark.parametrize("T", [8, 32, 64, 65])
def test_route_sort_in_one_launch_gives_the_router_and_sort_results(T, n_real):
    """The bench layer's routing and sort in one launch (to 64 tokens) against the router's own
    launch and the torch layout of its ids: the same ids and layout exactly, weights to float32
    rounding (the one program sums a token's scores in another order); two launches at 65."""
    from runtime.backends.kernels.moe import route_sort, route_sort_folds
    from testkit.moe_checks import sorted_layout_reference
    x, layer, tail, ids, weights, experts = _routed(16, 4, T, seed=3 * T)
    count = T - 3 if n_real == "host" else torch.tensor([T - 3], dtype=torch.int32, device=DEV)
    assert route_sort_folds(T, 16, 5, "gemv") == (T <= 64)
    got = route_sort(x, layer[0], None, *tail, 16, n_real=count, n_shared=experts - 16, shared_gate=layer[6])
    assert torch.equal(got[0], ids)
    assert torch.allclose(got[1], weights, rtol=1e-6, atol=1e-7)
    rows, blocks = sorted_layout_reference(ids, experts, 16)
    total = int(got[4])
    assert total == rows.numel()
    assert torch.equal(got[2][:total].cpu(), rows)
    assert torch.equal(got[3][:total // 16].cpu(), blocks)


@pytest.mark.parametrize("T", BENCH_TOKENS)
def test_combine_is_the_slot_order_sum_bit_for_bit(T):
    from runtime.backends.kernels.moe import combine
    from testkit.moe_checks import combine_reference
    _, _, _, ids, _, experts = _routed(16, 4, T, seed=T)
    y = torch.randn(ids.numel(), D, device=DEV).bfloat16()
    y[ids.reshape(-1) == experts] = float("nan")  # padding slots' rows are never written, never read
    out = torch.full((T, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    combine(y, ids, out, experts)
    assert torch.equal(out, combine_reference(y, ids, experts, torch.bfloat16))


@pytest.mark.parametrize("T", BENCH_TOKENS)
def test_fused_moe_is_its_gemms_on_the_reference_layout_bit_for_bit(T):
    """The op's output equals the unchanged expert GEMMs run on the torch layout and summed by the
    torch combine, bit for bit (the bookkeeping changes no value), and the float32 oracle to 1e-2."""
    from runtime.backends.kernels.moe import down_sorted, gate_up_sorted, max_sorted_rows, route_sort
    from runtime.backends.kernels.moe_config import default_config
    from testkit.moe_checks import combine_reference, sorted_layout_reference
    x, layer, tail, _, _, experts = _routed(16, 4, T, seed=7 * T)
    config = default_config(T, 16, I, D, 4)
    # The router's results as the op computes them (in one launch with the sort up to 64 tokens).
    ids, weights = route_sort(x, layer[0], None, *tail, config.gate_up.BLOCK_M, n_real=T - 3,
                              n_shared=experts - 16, shared_gate=layer[6])[:2]
    out = torch.full((T, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    fused_moe(x, *layer, out, *tail, config, n_real=T - 3)
    bm = config.gate_up.BLOCK_M
    rows, blocks = sorted_layout_reference(ids, experts, bm)
    R = max_sorted_rows(ids.numel(), experts, bm)
    sorted_pairs = torch.full((R,), ids.numel(), dtype=torch.int32)
    sorted_pairs[:rows.numel()] = rows
    block_expert = torch.zeros(R // bm, dtype=torch.int32)
    block_expert[:blocks.numel()] = blocks
    total = torch.tensor([rows.numel()], dtype=torch.int32)
    sort = [t.to(DEV) for t in (sorted_pairs, block_expert, total)]
    h = gate_up_sorted(x, layer[2], *sort, ids.shape[1], config.gate_up, shared_w13=layer[4])
    y = down_sorted(h, layer[3], weights, *sort, config.down, shared_w2=layer[5])
    assert torch.equal(out, combine_reference(y, ids, experts, torch.bfloat16))
    assert (out[T - 3:] == 0).all()
    ref = _reference(x[:T - 3], *layer, *tail)
    assert _rel(out[:T - 3], ref) <= TOL
