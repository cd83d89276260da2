"""The few-row GEMV (runtime/backends/kernels/gemv.py) against the float32 product, its bits run to run.

On a machine without CUDA the kernel runs in Triton's interpreter: these are CPU tests of its logic
(both ways to multiply, the K loop and its one-step form, masks at odd sizes, strides, out=), not of
speed or of the GPU's tensor-core numerics. Every check draws fresh random inputs and compares with
x.float() @ w.float().T by ||y - ref|| / ||ref|| (16-bit outputs: one rounding, which the
interpreter truncates where a GPU rounds to nearest). N = 37 fills no column tile and K = 40 no
BLOCK_K of the loop configs; the even shape (32, 64) takes the unmasked loads.

The tests marked gpu run the compiled kernel at bench qwen3_next's shapes (bf16, M 1 to 16): close
to the float32 product, the same bits twice, and a captured call replayed.
"""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends.kernels import gemv as G  # noqa: E402
from runtime.backends.kernels.launch_math import cdiv  # noqa: E402
from testkit.helpers import assert_one_line_error  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# None: the table or default config; then the K loop (40 = 2 x 16 + 8), one step (K <= 64), tensor cores
CONFIGS = [None, G.GemvConfig(8, 16), G.GemvConfig(4, 64), G.GemvConfig(16, 16, num_stages=2, DOT=True)]
CONFIG_IDS = ["default", "fma-loop", "fma-one-step", "dot"]


def inputs(M: int, N: int, K: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    return x.to(DEVICE), w.to(DEVICE)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.cpu().float() @ w.cpu().float().T


@in_process
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_matches_the_float32_product(dtype, M, config):
    x, w = inputs(M, 37, 40, dtype, seed=M)
    y = G.small_m_linear(x, w, config=config)
    assert y.dtype == dtype and y.shape == (M, 37)
    err = rel_err(y, reference(x, w))
    assert err <= TOL[dtype], f"M={M} {dtype} {config}: rel err {err:.2e}"


@in_process
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_even_shapes_take_the_unmasked_loads(config):
    """N a multiple of BLOCK_N and K of BLOCK_K: no mask on the weight's loads."""
    x, w = inputs(5, 32, 64, torch.bfloat16, seed=7)
    assert rel_err(G.small_m_linear(x, w, config=config), reference(x, w)) <= TOL[torch.bfloat16]


@in_process
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_row_strided_x_and_out(config):
    """x and out rows of a wider buffer (a projection's input is often a slice): out is the given
    tensor, and only its elements are written."""
    x_full, w = inputs(3, 37, 47, torch.float32, seed=3)
    x = x_full[:, :40]  # [3, 40], row stride 47
    buf = torch.full((3, 45), float("nan"), device=DEVICE)
    out = buf[:, :37]  # [3, 37], row stride 45
    assert G.small_m_linear(x, w[:, :40].contiguous(), out, config=config) is out
    assert rel_err(out, reference(x, w[:, :40])) <= TOL[torch.float32]
    assert buf[:, 37:].isnan().all(), "small_m_linear wrote outside out"


@in_process
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_two_calls_give_the_same_bits(config):
    x, w = inputs(8, 37, 40, torch.bfloat16, seed=11)
    first = G.small_m_linear(x, w, config=config)
    assert torch.equal(G.small_m_linear(x, w, config=config), first)


@in_process
def test_one_launch_per_call(monkeypatch):
    launches = []
    real = G._GEMV.launch
    monkeypatch.setattr(G._GEMV, "launch", lambda *a: launches.append(a[0]) or real(*a))
    x, w = inputs(3, 37, 40, torch.bfloat16, seed=5)
    G.small_m_linear(x, w)
    assert launches == [(cdiv(37, G.config_for(37, 40, 3).BLOCK_N),)]


@in_process
def test_empty_products():
    """M or N of 0: an empty result; K of 0: zeros."""
    w = torch.ones(5, 4, device=DEVICE)
    assert G.small_m_linear(torch.ones(0, 4, device=DEVICE), w).shape == (0, 5)
    assert G.small_m_linear(torch.ones(2, 4, device=DEVICE), torch.ones(0, 4, device=DEVICE)).shape == (2, 0)
    y = G.small_m_linear(torch.ones(2, 0, device=DEVICE), torch.ones(5, 0, device=DEVICE))
    assert torch.equal(y.cpu(), torch.zeros(2, 5))


def test_config_table_then_default(monkeypatch):
    """CONFIGS' entry for (N, K, M's bucket) wins; without one, default_config."""
    entry = G.GemvConfig(32, 128, 8, 3, True)
    monkeypatch.setitem(G.CONFIGS, (2048, 4096, 4), entry)
    assert G.config_for(2048, 4096, 3) is entry and G.config_for(2048, 4096, 4) is entry
    assert G.config_for(2048, 4096, 5) == G.default_config(2048, 4096, 8)
    assert [G.row_bucket(m) for m in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("N,K", [(12352, 2048), (9216, 2048), (2048, 4096), (151936, 2048), (37, 40), (5, 1)])
def test_default_configs_are_valid_and_fit(N, K):
    for rows in (1, 2, 4, 8, 16):
        c = G.default_config(N, K, rows)
        assert c.DOT or c.fma_fits(rows), f"({N}, {K}, {rows}): {c} outgrows the registers"


@pytest.mark.parametrize("kwargs", [dict(BLOCK_N=3, BLOCK_K=16), dict(BLOCK_N=8, BLOCK_K=16, DOT=True),
                                    dict(BLOCK_N=16, BLOCK_K=16, num_stages=0)], ids=["pow2", "dot-tile", "stages"])
def test_bad_configs_raise(kwargs):
    assert_one_line_error(lambda: G.GemvConfig(**kwargs), "bad GEMV config")


@pytest.mark.parametrize("call,names", [
    (lambda: G.small_m_linear(torch.ones(2, 40), torch.ones(5, 41)), "x (2, 40) and weight (5, 41) disagree on K"),
    (lambda: G.small_m_linear(torch.ones(17, 4), torch.ones(5, 4)), "x has M = 17 rows, past MAX_ROWS = 16"),
    (lambda: G.small_m_linear(torch.ones(2, 4, dtype=torch.int32), torch.ones(5, 4, dtype=torch.int32)),
     "x is torch.int32"),
    (lambda: G.small_m_linear(torch.ones(2, 4), torch.ones(5, 4, dtype=torch.float16)), "weight torch.float16"),
    (lambda: G.small_m_linear(torch.ones(2, 4, 1), torch.ones(5, 4)), "x must be [M, K]"),
    (lambda: G.small_m_linear(torch.ones(2, 4), torch.ones(4, 5).t()), "weight (5, 4) has strides (1, 5)"),
    (lambda: G.small_m_linear(torch.ones(4, 2).t(), torch.ones(5, 4)), "x (2, 4) has strides (1, 2)"),
    (lambda: G.small_m_linear(torch.ones(2, 4), torch.ones(5, 4), torch.ones(5, 2)), "out is (5, 2)"),
    (lambda: G.small_m_linear(torch.ones(2, 4), torch.ones(5, 4), torch.ones(2, 5, dtype=torch.float16)),
     "out is (2, 5) torch.float16"),
], ids=["K", "M", "dtype", "mixed", "rank", "weight-layout", "x-layout", "out-shape", "out-dtype"])
def test_bad_inputs_raise_a_value_error_naming_them(call, names):
    assert_one_line_error(call, names)


# ----------------------------------------------------------------------------- GPU, real dims

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N,K", [(12352, 2048), (9216, 2048), (2048, 4096), (151936, 2048)])
def test_gpu_bf16_close_to_float32_and_deterministic(N, K):
    g = torch.Generator(device="cuda").manual_seed(N + K)
    w = (torch.randn(N, K, generator=g, device="cuda") * K ** -0.5).bfloat16()
    for M in (1, 2, 3, 4, 8, 16):
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        y = G.small_m_linear(x, w)
        err = rel_err(y, x.float() @ w.float().T)
        assert err < 1e-2, f"N={N} K={K} M={M}: rel err {err:.2e}"
        assert torch.equal(G.small_m_linear(x, w), y), f"N={N} K={K} M={M}: bits differ run to run"


@pytest.mark.gpu
@needs_cuda
def test_gpu_captured_call_replays_the_eager_result():
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(2048, 4096, generator=g, device="cuda") * 4096 ** -0.5).bfloat16()
    x = torch.randn(4, 4096, generator=g, device="cuda").bfloat16()
    out = torch.empty(4, 2048, dtype=torch.bfloat16, device="cuda")
    G.small_m_linear(x, w, out)  # compiled and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        G.small_m_linear(x, w, out)
    new = torch.randn(4, 4096, generator=g, device="cuda").bfloat16()
    x.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, G.small_m_linear(new, w))
