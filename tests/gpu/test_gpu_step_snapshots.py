"""In-step snapshots of the Triton kernels at real dims on the GPU (testkit/snapshot_cases.py; the
interpreter's twin is tests/runtime/backends/test_triton_step_snapshots.py).

Bench qwen3_next's GDN layer (16 key heads, 32 value heads, Dk = Dv = 128; its conv over 8192
channels, K = 4) and bench bailing_linear's Lightning layer (16 heads of 128), bfloat16 (the
serving dtype: 16-bit products) and float32, chunks of 64 rows (long steps) and 16 (short ones):

- the snapshot after a request's first r rows against a launch of those rows alone (same chunk
  length and tiles) and against the float32 reference recurrence;
- the step's outputs and slots against the same launch without snapshots;
- ids not asked for untouched, every asked one written.

On the GPU the snapshot's chunk step is compiled apart from the walk's loop, so the comparisons
are relative errors of the norm (the interpreter's twin asserts bit for bit)."""

from __future__ import annotations

import pytest
import torch

from testkit.snapshot_cases import BLOCK_T, CHUNK_REQUESTS, LONG_CHUNK_REQUESTS, check_chunk_snapshots, check_conv_snapshots

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GDN, LIGHTNING = (16, 32, 128, 128), (16, 16, 128, 128)
# (snapshot against its rows alone, against the reference) per dtype: the reference bound is the
# chunk kernels' own (tests/gpu/test_gpu_linear_kernels.py)
BOUNDS = {torch.bfloat16: (1e-3, 1e-2), torch.float32: (1e-5, 1e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("block_t,requests", [(64, LONG_CHUNK_REQUESTS), (BLOCK_T, CHUNK_REQUESTS)], ids=["c64", "c16"])
@pytest.mark.parametrize("dims,delta", [(GDN, True), (LIGHTNING, False)], ids=["gdn", "lightning"])
def test_chunk_snapshots_at_real_dims(dims, delta, block_t, requests, dtype):
    got = check_chunk_snapshots(dims, delta, dtype, "cuda", seed=3, requests=requests, block_t=block_t)
    alone, ref = BOUNDS[dtype]
    assert got["outputs_vs_plain"] <= 1e-6 and got["slots_vs_plain"] <= 1e-6, got
    assert got["snapshot_vs_prefix_launch"] <= alone and got["snapshot_vs_reference"] <= ref, got
    assert got["unasked_ids_zero"] and got["none_zero"], got
    print(dims, delta, block_t, dtype, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_conv_snapshots_at_real_dims(dtype):
    got = check_conv_snapshots(8192, 4, dtype, "cuda", seed=5)
    assert got == {"outputs_same": True, "slots_same": True, "snapshots_exact": True, "unasked_ids_zero": True}
