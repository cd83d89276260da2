"""The glue's projections as one GEMV launch on a CUDA GPU (runtime/backends/glue_kernels.py).

The registered CUDA kernel of hgc_glue::small_m_linear runs the one-launch GEMV for a shape CONFIGS
lists (bench qwen3_next's output projection, its GDN input projection, the logits head), close to
the float32 product (relative error of the norm under bf16's parity tolerance), and F.linear inside
torch_only(). A glue segment compiled by Inductor for cuda keeps the op as a call that runs the
GEMV, and a CUDA graph of the piece replays the bits it gives eagerly. tests/gpu/test_gpu_inductor.py
checks that a cuda bundle's pieces hold the op.

Runs only on the GPU machine (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from compiler.splitops.glue_ops import SMALL_M_LINEAR, use_small_m_linear
from runtime.graphs.parity import PARITY_RTOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RTOL = PARITY_RTOL[torch.bfloat16]  # 2e-2
SHAPES = [(2048, 4096, 1), (2048, 4096, 2), (12352, 2048, 1), (12352, 2048, 8), (151936, 2048, 4)]


@pytest.fixture
def gemv_calls(monkeypatch):
    """The kernel registered, and the rows of each small_m_linear call it makes."""
    from runtime.backends import glue_kernels
    from runtime.backends.kernels import gemv

    glue_kernels.register()
    calls = []
    real = gemv.small_m_linear

    def counted(x, weight, *args, **kwargs):
        calls.append(x.shape[0])
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(gemv, "small_m_linear", counted)
    return calls


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def operands(N: int, K: int, M: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    return x, w


@pytest.mark.parametrize("N,K,M", SHAPES, ids=[f"{n}x{k}-m{m}" for n, k, m in SHAPES])
def test_the_registered_kernel_runs_the_gemv_for_a_measured_shape(gemv_calls, N, K, M):
    from runtime.backends import glue_kernels
    from runtime.backends.kernels.gemv import CONFIGS, row_bucket

    assert (N, K, row_bucket(M)) in CONFIGS
    x, w = operands(N, K, M, seed=M)
    y = SMALL_M_LINEAR(x, w)
    assert gemv_calls == [M]
    assert y.shape == (M, N) and y.dtype == torch.bfloat16 and y.is_contiguous()
    err = rel_err(y, x.float() @ w.float().T)
    assert err < RTOL, f"{N}x{K}, {M} rows: relative error {err:.2e}"
    with glue_kernels.torch_only():
        torch.testing.assert_close(SMALL_M_LINEAR(x, w), F.linear(x, w), rtol=0, atol=0)
    assert gemv_calls == [M], "torch_only: F.linear"


def test_rows_past_the_measured_buckets_run_torch(gemv_calls):
    x, w = operands(2048, 4096, 32)
    torch.testing.assert_close(SMALL_M_LINEAR(x, w), F.linear(x, w), rtol=0, atol=0)
    assert gemv_calls == []


class OutProjection(torch.nn.Module):
    """An output projection's glue: the projection, the residual add and an RMSNorm of the sum."""

    def __init__(self):
        super().__init__()
        self.o_proj = torch.nn.Linear(4096, 2048, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(2048))

    def forward(self, core, residual):  # core [T, 4096], residual [T, 2048]
        h = residual + self.o_proj(core)
        normed = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return h, (normed * self.norm.float()).to(h.dtype)


def test_a_compiled_piece_calls_the_gemv_and_its_cuda_graph_replays_its_eager_bits(gemv_calls, tmp_path):
    from compiler.inductor_pieces import compile_piece
    from compiler.splitops.bundle import cache_env
    from compiler.splitops.glue import glue_segments, segment_module

    torch.manual_seed(0)
    model = OutProjection().cuda().bfloat16()
    T = Dim("T", min=1, max=256)
    example = (torch.randn(5, 4096, device="cuda").bfloat16(), torch.randn(5, 2048, device="cuda").bfloat16())
    gm = torch.export.export(model, example, dynamic_shapes=({0: T}, {0: T})).graph_module
    (segment,) = glue_segments(gm)
    reference, module = segment_module(gm, segment), segment_module(gm, segment)
    assert use_small_m_linear(module) == 1
    device = torch.device("cuda", torch.cuda.current_device())
    with cache_env({"inductor": tmp_path / "inductor"}):
        piece = compile_piece(module, device)
    sources = [p for p in (tmp_path / "inductor").rglob("*.py") if "hgc_glue.small_m_linear" in p.read_text()]
    assert sources, "Inductor kept the op as a call in the piece's code"

    params = {"p_o_proj_weight": model.o_proj.weight.detach(), "p_norm": model.norm.detach()}

    def inputs(rows: int, seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        given = {**params, "core": torch.randn(rows, 4096, device="cuda").bfloat16(),
                 "residual": torch.randn(rows, 2048, device="cuda").bfloat16()}
        return [given[name] for name in segment.inputs]

    first = inputs(1, seed=1)
    eager = piece(*first)
    assert gemv_calls == [1], "the piece's projection ran the GEMV"
    for got, want in zip(eager, reference(*first)):
        assert rel_err(got, want) < RTOL

    static = inputs(1, seed=2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        piece(*static)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = piece(*static)
    for dst, src in zip(static, first):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


SPLIT_CASES = [(2048, 4096, 128, (128, 64, 128, 4, 8, 3)), (2048, 4096, 32, (32, 32, 128, 4, 4, 4)),
               (12352, 2048, 128, (128, 64, 64, 2, 4, 4)), (9216, 2048, 64, (64, 64, 128, 1, 4, 4))]


@pytest.mark.parametrize("N,K,M,tiles", SPLIT_CASES, ids=[f"{n}x{k}-m{m}" for n, k, m, _ in SPLIT_CASES])
def test_the_split_k_gemm_at_real_dims_and_in_a_cuda_graph(N, K, M, tiles):
    """The split-K GEMM (runtime/backends/kernels/split_k.py) at bench qwen3_next's projections against
    the float32 product, and replayed from a CUDA graph with the bits of its eager call."""
    from runtime.backends.kernels.split_k import SplitKConfig, split_k_linear

    cfg = SplitKConfig(*tiles)
    g = torch.Generator().manual_seed(N + M)
    x = torch.randn(M, K, generator=g).bfloat16().cuda()
    w = (torch.randn(N, K, generator=g) * K ** -0.5).bfloat16().cuda()
    eager = split_k_linear(x, w, cfg)
    ref = x.float() @ w.float().T
    assert (eager.float() - ref).norm() / ref.norm() <= RTOL
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = split_k_linear(x, w, cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
