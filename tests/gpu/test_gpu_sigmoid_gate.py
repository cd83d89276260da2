"""hgc_glue::sigmoid_gate on a CUDA GPU (runtime/backends/glue_kernels.py, kernels/sigmoid_gate.py).

The registered CUDA kernel at bench qwen3_next's GQA layer (16 query heads of 256, each gate beside
its q in the projection's output, bf16) and in float32, at 1, 7, 512 and 4096 tokens, against the
op's CPU kernel (the traced glue's two ops) on fresh random inputs: the relative error of the norm
of the difference under the dtype's parity tolerance. A captured CUDA graph of the call replays
the bits of its eager run on fresh inputs. bench bailing_linear's Lightning gate, one [T, 2048] row
of every head, the same way. A compiled piece is not needed: the op is a call Inductor leaves.

Runs only on the GPU machine (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from compiler.splitops.glue_ops import SIGMOID_GATE
from runtime.graphs.parity import PARITY_RTOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, D = 16, 256


def gate_of(qkv: torch.Tensor) -> torch.Tensor:
    """The gate view of a projection's output [q | gate per head, k, v]."""
    return qkv[:, :H * 2 * D].view(qkv.shape[0], H, 2 * D)[..., D:]


def layer(T: int, seed: int, dtype=torch.bfloat16, device="cuda"):
    """(the attention output, the projection's output) on fresh random values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, D, generator=g).to(dtype).to(device)
    return x, (3 * torch.randn(T, H * 2 * D + 4 * D, generator=g)).to(dtype).to(device)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [1, 7, 512, 4096])
def test_the_kernel_is_the_traced_glue_at_bench_dims(T, dtype):
    from runtime.backends import glue_kernels

    glue_kernels.register()
    x, qkv = layer(T, seed=T, dtype=dtype)
    gate = gate_of(qkv)
    got = SIGMOID_GATE(x, gate)
    want = SIGMOID_GATE(x.cpu(), gate.cpu())  # the CPU kernel: the glue's own ops
    assert got.is_cuda and got.is_contiguous() and got.shape == want.shape and got.dtype == dtype
    assert rel_err(got.cpu(), want) < PARITY_RTOL[dtype]


@pytest.mark.parametrize("T", [1, 512, 4096])
def test_a_wide_row_of_every_head_at_bench_bailing_dims(T):
    """Ling's Lightning gate as its glue traces it: one [T, 2048] row of all 16 heads of 128, the
    gate a view of a wider projection output; the kernel runs it in heads of ROW_CHUNK channels."""
    from runtime.backends import glue_kernels

    glue_kernels.register()
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 2048, generator=g).to(torch.bfloat16).cuda()
    gate = (3 * torch.randn(T, 4 * 2048, generator=g)).to(torch.bfloat16).cuda()[:, 3 * 2048:]
    got = SIGMOID_GATE(x, gate)
    want = SIGMOID_GATE(x.cpu(), gate.cpu())
    assert got.shape == (T, 2048) and got.is_contiguous()
    assert rel_err(got.cpu(), want) < PARITY_RTOL[torch.bfloat16]


def test_a_captured_call_replays_its_eager_bits():
    """The gate read through the projection's strided view, as the glue calls it."""
    from runtime.backends import glue_kernels

    glue_kernels.register()
    static_x, static_qkv = layer(64, seed=1)
    SIGMOID_GATE(static_x, gate_of(static_qkv))  # warm-up: the kernel compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = SIGMOID_GATE(static_x, gate_of(static_qkv))
    for seed in (2, 3):
        fresh_x, fresh_qkv = layer(64, seed=seed)
        static_x.copy_(fresh_x)
        static_qkv.copy_(fresh_qkv)
        graph.replay()
        assert torch.equal(out, SIGMOID_GATE(static_x, gate_of(static_qkv)))
