"""hgc_glue::qk_norm_rope on a CUDA GPU (runtime/backends/glue_kernels.py, kernels/norm_rope.py).

The registered CUDA kernel at bench qwen3_next's GQA layer (16 query heads beside their gates, 2 key
heads, head dim 256, rotary dim 64, theta 1e7, bf16), at 1, 7, 512 and 4096 tokens, against the
op's CPU kernel (the traced glue's ops) on fresh random inputs: the relative error of the norm of
the difference under bf16's parity tolerance. A captured CUDA graph of the call replays the bits of
its eager run on fresh inputs. A compiled piece is not needed: the op is a call Inductor leaves.

Runs only on the GPU machine (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from compiler.splitops.glue_ops import QK_NORM_ROPE
from models.common import rope_inv_freq
from runtime.graphs.parity import PARITY_RTOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RTOL = PARITY_RTOL[torch.bfloat16]
H, HK, D, ROT = 16, 2, 256, 64


def layer(T: int, seed: int, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, H * 2 * D + 2 * HK * D, generator=g).bfloat16().to(device)
    q = qkv[:, :H * 2 * D].view(T, H, 2 * D)[..., :D]
    k = qkv[:, H * 2 * D:H * 2 * D + HK * D].view(T, HK, D)
    wq, wk = ((0.3 * torch.randn(D, generator=g)).bfloat16().to(device) for _ in range(2))
    positions = torch.randint(0, 200000, (T,), generator=g).to(device)
    return q, k, wq, wk, positions, rope_inv_freq(ROT, 1e7, torch.device(device))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("T", [1, 7, 512, 4096])
def test_the_kernel_is_the_traced_glue_at_bench_dims(T):
    from runtime.backends import glue_kernels

    glue_kernels.register()
    args = layer(T, seed=T)
    got = QK_NORM_ROPE(*args, 1e-6, True)
    want = QK_NORM_ROPE(*(a.cpu() for a in args), 1e-6, True)  # the CPU kernel: the glue's own ops
    for g, w in zip(got, want):
        assert g.is_cuda and g.is_contiguous() and g.shape == w.shape
        assert rel_err(g.cpu(), w) < RTOL


def test_a_captured_call_replays_its_eager_bits():
    from runtime.backends import glue_kernels

    glue_kernels.register()
    q, k, wq, wk, positions, inv = layer(64, seed=1)
    static = [t.clone() for t in (q, k, positions)]
    QK_NORM_ROPE(*static[:2], wq, wk, static[2], inv, 1e-6, True)  # warm-up: the kernel compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = QK_NORM_ROPE(*static[:2], wq, wk, static[2], inv, 1e-6, True)
    for seed in (2, 3):
        fresh = layer(64, seed=seed)
        for s, f in zip(static, (fresh[0], fresh[1], fresh[4])):
            s.copy_(f)
        graph.replay()
        eager = QK_NORM_ROPE(*static[:2], wq, wk, static[2], inv, 1e-6, True)
        assert all(torch.equal(a, b) for a, b in zip(outs, eager))
