"""The split-K GEMM (runtime/backends/kernels/split_k.py) against the float32 product, in Triton's
interpreter on a machine without CUDA: masked rows, columns and K, more splits than K has blocks,
bf16 and float32 operands, the same bits from two calls, and every tile's counter left at zero.
Which glue calls take it: test_glue_kernels.py. The GPU side: benchmarks/probes/split_k_probe.py
checks every config it times, tests/gpu/test_gpu_glue_gemv.py the kernel at real dims.
"""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends.kernels import split_k as S  # noqa: E402
from runtime.backends.kernels.arrivals import arrival_counters  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

# (M, N, K, config): one split storing the product directly; two and three splits with K a multiple
# of their share and not; more splits than K has blocks (the launch takes fewer); rows, columns and
# K that fill no tile.
CASES = [(20, 48, 64, S.SplitKConfig(32, 16, 16, 1, 1, 1)), (32, 32, 128, S.SplitKConfig(32, 16, 32, 2, 1, 2)),
         (37, 50, 100, S.SplitKConfig(16, 32, 16, 3, 2, 2)), (17, 24, 40, S.SplitKConfig(32, 16, 16, 8, 1, 1))]


@in_process
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("M,N,K,cfg", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-s{c[3].SPLIT}" for c in CASES])
def test_split_k_linear_matches_the_float32_product(M, N, K, cfg, dtype):
    g = torch.Generator().manual_seed(M * N + K)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(DEVICE)
    y = S.split_k_linear(x, w, cfg)
    assert y.shape == (M, N) and y.dtype == dtype and y.is_contiguous()
    assert rel_err(y.float().cpu(), x.float().cpu() @ w.float().cpu().T) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(S.split_k_linear(x, w, cfg), y), "one order of sums: the same bits every call"
    counters = arrival_counters(x.device, 1, "split_k")
    assert counters.eq(0).all(), "each tile's last program zeroes its counter (a graph replays from there)"


def test_configs_are_checked():
    """Tiles are powers of two of at least 16 (a dot's side), at least one split."""
    with pytest.raises(ValueError, match="split-K config"):
        S.SplitKConfig(32, 8, 16, 2)
    with pytest.raises(ValueError, match="split-K config"):
        S.SplitKConfig(32, 16, 16, 0)
    assert S.row_bucket(20) == 32
