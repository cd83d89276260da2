"""The norms folded into the GEMVs on a CUDA GPU (runtime/backends/glue_kernels.py, norm_gemv.py).

The registered CUDA kernels of hgc_glue::add_rms_norm_linear and rms_norm_linear, at bench
qwen3_next's input projections (K = 2048: the GDN input projection, N = 12352, at 1 to 8 rows and
GQA's q|k|v, N = 9216, at one row, the shapes gemv.CONFIGS lists), run the GEMV with the norm in its
prologue; more rows run the row kernel, then F.linear. Both against the traced glue's arithmetic
(glue_ops.rms_norm_rows, then the float32 product of the rounded normed row) on fresh random bf16
inputs: the relative error of the norm of the difference under bf16's parity tolerance, and summed
bit for bit (both round the float32 sum once). A captured CUDA graph of each path replays the bits
of its eager run, with programmatic dependent launch off and on.

hgc_glue::linear_add_rms_norm at bench qwen3_next's output projection (N 2048, K 4096, 1 to 8 rows)
runs the GEMV with the add in its epilogue and the norm in its last program: summed and the normed
row against the float32 product rounded to bf16, the add, and rms_norm_rows; a captured graph
replayed on fresh inputs three times gives each replay's eager bits (the last program to finish
normalised each replay's rows: the counter was back at zero).

Runs only on the GPU machine (`pytest -m gpu`).
"""

from __future__ import annotations

import pytest
import torch

from compiler.splitops.glue_ops import ADD_RMS_NORM_LINEAR, LINEAR_ADD_RMS_NORM, RMS_NORM_LINEAR, rms_norm_rows
from runtime.graphs.parity import PARITY_RTOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RTOL = PARITY_RTOL[torch.bfloat16]  # 2e-2
K = 2048
GEMV_SHAPES = [(12352, 1), (12352, 2), (12352, 4), (12352, 8), (9216, 1)]  # (N, M)


@pytest.fixture
def paths(monkeypatch):
    """The kernels registered, and the path of each norm op call: "gemv" or "rows"."""
    from runtime.backends import glue_kernels
    from runtime.backends.kernels import norm_gemv

    glue_kernels.register()
    taken = []
    for name, path in (("add_rms_norm_gemv", "gemv"), ("add_rms_norm_rows", "rows")):
        real = getattr(norm_gemv, name)
        monkeypatch.setattr(norm_gemv, name,
                            lambda *a, real=real, path=path, **kw: taken.append(path) or real(*a, **kw))
    return taken


@pytest.fixture
def pdl_switch():
    from runtime.backends.kernels import pdl

    before = pdl.enabled()
    yield pdl
    pdl.enable(before)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def operands(N: int, M: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    b = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    norm_weight = (torch.randn(K, device="cuda", generator=g) * 0.2).bfloat16()
    weight = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
    return a, b, norm_weight, weight


def reference(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The glue's normed row (rounded to bf16), then its product in float32."""
    return rms_norm_rows(x, norm_weight, 1e-6, True).float() @ weight.float().T


@pytest.mark.parametrize("N,M", GEMV_SHAPES, ids=[f"{n}x{K}-m{m}" for n, m in GEMV_SHAPES])
def test_a_measured_shape_runs_the_gemv_with_the_norm_in_its_prologue(paths, N, M):
    from runtime.backends.kernels.gemv import CONFIGS, row_bucket

    assert (N, K, row_bucket(M)) in CONFIGS
    a, b, norm_weight, weight = operands(N, M, seed=M)
    out, summed = ADD_RMS_NORM_LINEAR(a, b, norm_weight, weight, 1e-6, True)
    alone = RMS_NORM_LINEAR(a, norm_weight, weight, 1e-6, True)
    assert paths == ["gemv", "gemv"]
    assert out.shape == (M, N) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(summed, a + b)
    for got, row in ((out, a + b), (alone, a)):
        err = rel_err(got, reference(row, norm_weight, weight))
        assert err < RTOL, f"{N}x{K}, {M} rows: relative error {err:.2e}"


@pytest.mark.parametrize("M", [32, 300])
def test_more_rows_run_the_row_kernel_then_torch(paths, M):
    a, b, norm_weight, weight = operands(12352, M, seed=M)
    out, summed = ADD_RMS_NORM_LINEAR(a, b, norm_weight, weight, 1e-6, True)
    assert paths == ["rows"]
    assert torch.equal(summed, a + b)
    assert rel_err(out, reference(a + b, norm_weight, weight)) < RTOL


@pytest.mark.parametrize("M", [1, 32], ids=["gemv", "rows"])
def test_a_captured_call_replays_its_eager_bits_with_pdl_off_and_on(paths, pdl_switch, M):
    """Eager and replayed outputs the same bits, PDL off and on (the waits change no arithmetic)."""
    first, static = operands(12352, M, seed=1), operands(12352, M, seed=2)
    results = []
    for on in (False, True):
        pdl_switch.enable(on)
        eager = ADD_RMS_NORM_LINEAR(*first, 1e-6, True)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ADD_RMS_NORM_LINEAR(*static, 1e-6, True)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ADD_RMS_NORM_LINEAR(*static, 1e-6, True)
        for dst, src in zip(static, first):  # the replay reads the captured tensors
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        results.append([t.clone() for t in eager])
        static = operands(12352, M, seed=2)
    for off, on in zip(*results):
        torch.testing.assert_close(on, off, rtol=0, atol=0)
    assert set(paths) == {"gemv" if M == 1 else "rows"}


@pytest.mark.parametrize("M", [1, 2, 4, 8])
def test_the_output_projection_takes_the_epilogue_where_it_takes_the_gemv(monkeypatch, M):
    from runtime.backends import glue_kernels
    from runtime.backends.kernels import norm_gemv

    glue_kernels.register()
    taken = []
    real = norm_gemv.gemv_add_rms_norm
    monkeypatch.setattr(norm_gemv, "gemv_add_rms_norm", lambda *a, **kw: taken.append(M) or real(*a, **kw))
    N, KO = 2048, 4096
    g = torch.Generator(device="cuda").manual_seed(40 + M)
    x = torch.randn(M, KO, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(N, KO, device="cuda", generator=g) * KO ** -0.5).bfloat16()
    residual = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    norm_weight = (torch.randn(N, device="cuda", generator=g) * 0.2).bfloat16()
    normed, summed = LINEAR_ADD_RMS_NORM(x, weight, residual, norm_weight, 1e-6, True)
    # the epilogue where `project` takes the GEMV (a tuned config for the shape and row count), else
    # F.linear and the row kernel
    assert taken == ([M] if glue_kernels.takes_gemv(x, weight) else []), (M, taken)
    assert (M == 1) <= bool(taken) and normed.shape == summed.shape == (M, N) and normed.is_contiguous()
    want_summed = residual + (x.float() @ weight.float().T).bfloat16()
    assert rel_err(summed, want_summed) < RTOL
    assert rel_err(normed, rms_norm_rows(want_summed, norm_weight, 1e-6, True)) < RTOL


@pytest.mark.parametrize("M", [1, 4])
def test_the_epilogue_replays_fresh_inputs_as_its_eager_calls(pdl_switch, M):
    from runtime.backends import glue_kernels
    from runtime.backends.kernels.arrivals import arrival_counters

    glue_kernels.register()
    N, KO = 2048, 4096

    def fresh(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return (torch.randn(M, KO, device="cuda", generator=g).bfloat16(),
                (torch.randn(N, KO, device="cuda", generator=g) * KO ** -0.5).bfloat16(),
                torch.randn(M, N, device="cuda", generator=g).bfloat16(),
                (torch.randn(N, device="cuda", generator=g) * 0.2).bfloat16())

    for on in (False, True):
        pdl_switch.enable(on)
        static = fresh(0)
        LINEAR_ADD_RMS_NORM(*static, 1e-6, True)  # compiles and allocates the counters outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = LINEAR_ADD_RMS_NORM(*static, 1e-6, True)
        for seed in (1, 2, 3):
            given = fresh(seed)
            for dst, src in zip(static, given):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            for got, want in zip(captured, LINEAR_ADD_RMS_NORM(*given, 1e-6, True)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert int(arrival_counters("cuda", 1, "gemv_add_rms_norm")[0]) == 0
