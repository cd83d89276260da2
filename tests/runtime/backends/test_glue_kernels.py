"""The CUDA kernel of hgc_glue::small_m_linear (runtime/backends/glue_kernels.py): which calls take the GEMV.

On a machine without CUDA the GEMV runs in Triton's interpreter and `project` is called directly
(the dispatcher sends CPU tensors to the op's F.linear): a bf16 call of a few rows whose shape
CONFIGS lists runs small_m_linear, one of 17 to 128 rows whose shape split_k's CONFIGS lists
split_k_linear, and every other call F.linear, as does every call inside torch_only().
tests/gpu/test_gpu_glue_gemv.py runs the registered kernel through the op on the GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends import glue_kernels  # noqa: E402
from runtime.backends.kernels import gemv as G  # noqa: E402
from runtime.backends.kernels import split_k as SK  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

N, K = 24, 32  # a shape of our own, put into CONFIGS for 1 and 2 rows


@pytest.fixture
def measured(monkeypatch):
    """CONFIGS with (N, K) at buckets 1 and 2, and a count of small_m_linear's calls."""
    monkeypatch.setitem(G.CONFIGS, (N, K, 1), G.GemvConfig(BLOCK_N=4, BLOCK_K=32))
    monkeypatch.setitem(G.CONFIGS, (N, K, 2), G.GemvConfig(BLOCK_N=8, BLOCK_K=16))
    calls = []
    real = G.small_m_linear

    def counted(x, weight, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(G, "small_m_linear", counted)
    return calls


def operands(M: int, n: int = N, k: int = K, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).to(DEVICE)
    return x, w


@in_process
@pytest.mark.parametrize("M", [1, 2])
def test_a_measured_shape_of_a_few_bf16_rows_runs_the_gemv(measured, M):
    x, w = operands(M, seed=M)
    assert glue_kernels.takes_gemv(x, w)
    y = glue_kernels.project(x, w)
    assert measured == [(M, K)]
    assert y.shape == (M, N) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert rel_err(y, x.float() @ w.float().T) <= 1e-2


@in_process
@pytest.mark.parametrize("case", ["bucket not measured", "shape not measured", "past MAX_ROWS", "float32",
                                  "strided x", "no rows", "3-D x"])
def test_every_other_call_runs_f_linear(measured, case):
    x, w = operands({"bucket not measured": 3, "past MAX_ROWS": G.MAX_ROWS + 1, "no rows": 0}.get(case, 1),
                    **({"n": N + 1} if case == "shape not measured" else {}),
                    **({"dtype": torch.float32} if case == "float32" else {}))
    if case == "strided x":
        x = torch.cat([x, x], dim=1)[:, ::2]
    if case == "3-D x":
        x = x[None]
    assert not glue_kernels.takes_gemv(x, w)
    y = glue_kernels.project(x, w)
    assert measured == []
    torch.testing.assert_close(y, F.linear(x, w), rtol=0, atol=0)


@pytest.fixture
def measured_split(monkeypatch):
    """split_k's CONFIGS with (N, K) at bucket 32, and a count of split_k_linear's calls."""
    monkeypatch.setitem(SK.CONFIGS, (N, K, 32), SK.SplitKConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, SPLIT=2,
                                                                num_warps=1, num_stages=1))
    calls = []
    real = SK.split_k_linear
    monkeypatch.setattr(SK, "split_k_linear", lambda x, w, cfg: calls.append(tuple(x.shape)) or real(x, w, cfg))
    return calls


@in_process
@pytest.mark.parametrize("M", [17, 32])
def test_a_measured_shape_of_17_to_128_bf16_rows_runs_the_split_k_gemm(measured, measured_split, M):
    x, w = operands(M, seed=M)
    assert glue_kernels.takes_split_k(x, w) and not glue_kernels.takes_gemv(x, w)
    y = glue_kernels.project(x, w)
    assert measured_split == [(M, K)] and measured == []
    assert y.shape == (M, N) and y.dtype == torch.bfloat16 and y.is_contiguous()
    assert rel_err(y, x.float() @ w.float().T) <= 1e-2


@in_process
@pytest.mark.parametrize("case", ["16 rows", "bucket not measured", "past MAX_ROWS", "float32", "torch_only"])
def test_other_calls_of_many_rows_run_f_linear(measured_split, case):
    M = {"16 rows": 16, "bucket not measured": 33, "past MAX_ROWS": SK.MAX_ROWS + 1}.get(case, 20)
    x, w = operands(M, **({"dtype": torch.float32} if case == "float32" else {}))
    with glue_kernels.torch_only() if case == "torch_only" else contextlib.nullcontext():
        assert not glue_kernels.takes_split_k(x, w)
        torch.testing.assert_close(glue_kernels.project(x, w), F.linear(x, w), rtol=0, atol=0)
    assert measured_split == []


@in_process
def test_torch_only_takes_f_linear_inside_the_block_and_the_gemv_after(measured):
    x, w = operands(1)
    with glue_kernels.torch_only():
        with glue_kernels.torch_only():
            pass
        assert not glue_kernels.takes_gemv(x, w), "an inner block's end leaves the outer one on"
        torch.testing.assert_close(glue_kernels.project(x, w), F.linear(x, w), rtol=0, atol=0)
    assert measured == []
    glue_kernels.project(x, w)
    assert measured == [(1, K)]


def test_register_installs_the_cuda_kernel_once():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    glue_kernels.register()
    glue_kernels.register()  # a second bundle's load: nothing more
    assert glue_kernels.registered() and has("hgc_glue::small_m_linear", "CUDA")
    # the CPU keeps the op's F.linear
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    torch.testing.assert_close(torch.ops.hgc_glue.small_m_linear(x, w), F.linear(x, w), rtol=0, atol=0)
