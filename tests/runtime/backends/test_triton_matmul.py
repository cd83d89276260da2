"""The batch-invariant matmul (runtime/backends/kernels/matmul.py) against torch, and its rows across M.

On a machine without CUDA the kernel runs in Triton's interpreter: these are CPU tests of the
kernel logic (strides, masks at odd sizes, the bias epilogue, out=), not of speed or of the GPU's
tensor-core numerics. Every check draws fresh random inputs and compares with torch on the CPU in
float32 by ||x - ref|| / ||ref|| (16-bit outputs: one rounding, and the interpreter truncates
where a GPU rounds to nearest, so up to one bf16 step per element). Row invariance is checked
exactly: a prefix of A's rows, or A's rows permuted, give the same rows bit for bit. One test
registers the functions for the CPU dispatch key for its duration, to check the aten wiring that
batch_invariant_aten.install() does for CUDA (argument passing, out=, no recursion into torch's mm).

The tests marked gpu run the compiled kernel at real dims (K 2048, N 2048 and 8192, M 1 to 512):
close to cuBLAS, rows exact across M, torch's own calls routed after install(), and a captured
torch.mm replayed. The interpreter must be switched on before triton is first imported
(testkit/triton_interpreter.py says why and what happens otherwise).
"""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, INTERPRETED, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends import batch_invariant_aten as BI  # noqa: E402
from runtime.backends.kernels import matmul as TM  # noqa: E402
from testkit.helpers import assert_one_line_error  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["f32", "bf16", "f16"]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# (M, N, K): one row, a few, more than one 64-row tile; 3 and 65 columns; K below, at and past a tile
SHAPES = [(1, 3, 1), (5, 65, 17), (70, 3, 130), (70, 65, 130), (1, 65, 130), (5, 3, 1)]


def randn(*shape, dtype=torch.float32, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def dev(*tensors):
    return [t.to(DEVICE) for t in tensors]


@in_process
@pytest.mark.parametrize("transposed", [True, False], ids=["weight-view", "contiguous"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_mm_matches_torch(M, N, K, dtype, transposed):
    """b a transposed [N, K] weight (strides (1, K)), as linear layers pass it, or a contiguous [K, N]."""
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    a = randn(M, K, dtype=dtype, g=g)
    b = randn(N, K, dtype=dtype, g=g).t() if transposed else randn(K, N, dtype=dtype, g=g)
    c = TM.mm(*dev(a, b))
    assert c.dtype == dtype and c.shape == (M, N)
    err = rel_err(c, a.float() @ b.float())
    assert err <= TOL[dtype], f"mm {M}x{N}x{K} {dtype}: rel err {err:.2e}"


@in_process
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("bias_shape,beta,alpha", [((65,), 1, 1), ((65,), 0.5, 2.0), ((1, 65), 1, -1),
                                                   ((70, 65), 2, 1), ((70, 1), 1, 0.5), ((), 1, 1)],
                         ids=["row", "row-scaled", "1xN", "MxN", "Mx1", "scalar"])
def test_addmm_matches_torch(bias_shape, beta, alpha, dtype):
    g = torch.Generator().manual_seed(len(bias_shape) * 7 + int(beta * 10))
    bias, a = randn(*bias_shape, dtype=dtype, g=g), randn(70, 130, dtype=dtype, g=g)
    w = randn(65, 130, dtype=dtype, g=g)
    c = TM.addmm(*dev(bias, a, w.t()), beta=beta, alpha=alpha)
    ref = torch.addmm(bias.float(), a.float(), w.float().t(), beta=beta, alpha=alpha)
    assert c.dtype == dtype
    assert rel_err(c, ref) <= TOL[dtype], f"addmm bias {bias_shape} beta {beta} alpha {alpha}"


@in_process
def test_addmm_with_beta_zero_ignores_the_bias():
    """torch.addmm's rule: beta 0 drops the bias, NaNs included."""
    g = torch.Generator().manual_seed(1)
    a, b = randn(5, 17, g=g), randn(17, 3, g=g)
    c = TM.addmm(*dev(torch.full((3,), float("nan")), a, b), beta=0, alpha=2)
    assert rel_err(c, 2 * (a @ b)) <= TOL[torch.float32]


@in_process
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bmm_matches_torch(dtype):
    g = torch.Generator().manual_seed(2)
    a, b = randn(3, 70, 17, dtype=dtype, g=g), randn(3, 65, 17, dtype=dtype, g=g).transpose(1, 2)
    c = TM.bmm(*dev(a, b))
    assert c.shape == (3, 70, 65) and c.dtype == dtype
    assert rel_err(c, torch.bmm(a.float(), b.float())) <= TOL[dtype]
    for i in range(3):  # each entry of the batch is what mm gives it
        assert torch.equal(c[i], TM.mm(*dev(a[i], b[i])))


@in_process
def test_bmm_batches_past_the_grid_limit_go_in_several_launches(monkeypatch):
    g = torch.Generator().manual_seed(6)
    a, b = dev(randn(5, 3, 17, g=g), randn(5, 17, 4, g=g))
    whole = TM.bmm(a, b)
    monkeypatch.setattr(TM, "_MAX_BATCH", 2)  # launches of 2, 2 and 1 entries
    assert torch.equal(TM.bmm(a, b), whole)


@in_process
def test_out_is_written_in_place():
    """out given: a strided view of a larger buffer (only its elements written), or an empty one (resized)."""
    g = torch.Generator().manual_seed(3)
    bias, a, w = randn(65, g=g), randn(5, 130, g=g), randn(65, 130, g=g)
    buf = torch.full((65, 12), float("nan"), device=DEVICE)
    out = buf.t()[:5]  # [5, 65], strides (1, 12)
    assert TM.mm(*dev(a, w.t()), out=out) is out
    assert rel_err(out, a @ w.t()) <= TOL[torch.float32]
    assert buf[:, 5:].isnan().all(), "mm wrote outside out"
    assert TM.addmm(*dev(bias, a, w.t()), out=out) is out
    assert rel_err(out, torch.addmm(bias, a, w.t())) <= TOL[torch.float32]
    empty = torch.empty(0, device=DEVICE)
    assert TM.bmm(*dev(a[None], w.t()[None]), out=empty).shape == (1, 5, 65)
    assert torch.equal(empty[0], TM.mm(*dev(a, w.t())))


@in_process
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rows_do_not_depend_on_the_other_rows(dtype):
    """mm(A[:m], B) is mm(A, B)[:m] bit for bit, and permuted rows give the same rows permuted."""
    g = torch.Generator().manual_seed(4)
    a, b = dev(randn(70, 130, dtype=dtype, g=g), randn(65, 130, dtype=dtype, g=g).t())
    bias = dev(randn(65, dtype=dtype, g=g))[0]
    full, full_bias = TM.mm(a, b), TM.addmm(bias, a, b)
    for m in (1, 5, 32, 64, 65):
        assert torch.equal(TM.mm(a[:m], b), full[:m]), f"mm rows 0..{m - 1} differ from the 70-row call"
        assert torch.equal(TM.addmm(bias, a[:m], b), full_bias[:m]), f"addmm rows 0..{m - 1}"
    perm = torch.randperm(70, generator=g).to(DEVICE)
    assert torch.equal(TM.mm(a[perm], b), full[perm])


@in_process
def test_empty_products():
    """M or N of 0: an empty result; K of 0: zeros, plus the bias."""
    assert TM.mm(*dev(torch.ones(0, 4), torch.ones(4, 3))).shape == (0, 3)
    assert TM.mm(*dev(torch.ones(2, 4), torch.ones(4, 0))).shape == (2, 0)
    assert TM.bmm(*dev(torch.ones(0, 2, 4), torch.ones(0, 4, 3))).shape == (0, 2, 3)
    assert torch.equal(TM.mm(*dev(torch.ones(2, 0), torch.ones(0, 3))).cpu(), torch.zeros(2, 3))
    c = TM.addmm(*dev(torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 0), torch.ones(0, 3)), beta=2)
    assert torch.equal(c.cpu(), torch.tensor([[2.0, 4.0, 6.0]] * 2))


@pytest.mark.parametrize("call,names", [
    (lambda: TM.mm(torch.ones(2, 3), torch.ones(4, 5)), "(2, 3) by (4, 5)"),
    (lambda: TM.mm(torch.ones(2, 3, 4), torch.ones(4, 5)), "(2, 3, 4) by (4, 5)"),
    (lambda: TM.bmm(torch.ones(2, 3, 4), torch.ones(3, 4, 5)), "(2, 3, 4) by (3, 4, 5)"),
    (lambda: TM.addmm(torch.ones(4), torch.ones(2, 3), torch.ones(3, 5)), "bias (4,)"),
    (lambda: TM.mm(torch.ones(2, 3), torch.ones(3, 5), out=torch.ones(5, 2)), "out is (5, 2)"),
    (lambda: TM.mm(torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 5, dtype=torch.int32)), "torch.int32"),
    (lambda: TM.mm(torch.ones(2, 3), torch.ones(3, 5, dtype=torch.bfloat16)), "torch.bfloat16"),
    (lambda: TM.mm(torch.ones(2, 3, dtype=torch.complex64), torch.ones(3, 5, dtype=torch.complex64)), "complex64"),
], ids=["inner", "rank", "batch", "bias", "out", "int", "mixed", "complex"])
def test_bad_inputs_raise_a_value_error_naming_them(call, names):
    assert_one_line_error(call, names)


@in_process
@pytest.mark.skipif(not INTERPRETED, reason="the CPU key can only run the kernel in the interpreter")
def test_aten_ops_reach_the_kernel_once_registered():
    """What install() does for CUDA, done for the CPU key while the test runs: torch's own mm, addmm
    (beta, alpha, out=), linear, matmul and bmm give exactly the module's results (computed before
    registering), an integer mm raises instead of computing, and torch's kernels come back after."""
    g = torch.Generator().manual_seed(5)
    x, w, bias = randn(5, 17, g=g), randn(65, 17, g=g), randn(65, g=g)
    x3, b3 = randn(2, 5, 17, g=g), randn(2, 17, 3, g=g)
    want = {"mm": TM.mm(x, w.t()), "addmm": TM.addmm(bias, x, w.t(), beta=0.5, alpha=2),
            "linear": TM.addmm(bias, x, w.t()), "bmm": TM.bmm(x3, b3),
            "linear3": TM.addmm(bias, x3.reshape(10, 17), w.t()).reshape(2, 5, 65)}
    lib = BI.register("CPU", TM.ATEN_IMPLS)
    try:
        got = {"mm": torch.mm(x, w.t()), "addmm": torch.addmm(bias, x, w.t(), beta=0.5, alpha=2),
               "linear": torch.nn.functional.linear(x, w, bias), "bmm": torch.bmm(x3, b3),
               "linear3": torch.nn.functional.linear(x3, w, bias)}
        out = torch.empty(5, 65)
        torch.mm(x, w.t(), out=out)
        got["mm.out"], want["mm.out"] = out.clone(), want["mm"]
        torch.addmm(bias, x, w.t(), beta=0.5, alpha=2, out=out)
        got["addmm.out"], want["addmm.out"] = out.clone(), want["addmm"]
        got["matmul"], want["matmul"] = x @ w.t(), want["mm"]
        with pytest.raises(ValueError, match="int32"):
            torch.mm(torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 5, dtype=torch.int32))
    finally:
        lib._destroy()
    for name in want:
        assert torch.equal(got[name], want[name]), f"torch's {name} did not run the kernel"
    ints = torch.mm(torch.ones(2, 3, dtype=torch.int32), torch.ones(3, 5, dtype=torch.int32))
    assert ints.eq(3).all(), "torch's own mm is back"


def test_install_is_idempotent_and_undone():
    """install() keeps one registration (the CUDA key: on this machine no call reaches it)."""
    assert not BI.installed()
    lines = []
    try:
        BI.install(lines.append)
        BI.install(lines.append)
        assert BI.installed() and len(lines) == 1
    finally:
        BI.uninstall()
    assert not BI.installed()


def cuda_kernel_source(op: str) -> str:
    """Where the CUDA dispatch key's kernel of an aten op was registered (torch's dispatch table)."""
    lines = [line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("CUDA:")]
    return lines[0] if lines else "torch's own"


def test_products_to_torch_gives_the_products_back_for_a_while():
    """Inside: aten mm is torch's again, mean.dim still the row sum's; after: both routed again.
    With nothing installed it changes nothing."""
    ours = "batch_invariant_aten.py"
    with BI.products_to_torch():
        assert not BI.installed()
    try:
        BI.install()
        assert BI.products_routed() and ours in cuda_kernel_source("aten::mm")
        with BI.products_to_torch():
            assert BI.installed() and not BI.products_routed()
            assert ours not in cuda_kernel_source("aten::mm")
            assert ours in cuda_kernel_source("aten::mean.dim")
        assert BI.products_routed() and ours in cuda_kernel_source("aten::mm")
        assert ours in cuda_kernel_source("aten::mean.dim")
    finally:
        BI.uninstall()
    assert ours not in cuda_kernel_source("aten::mm") and ours not in cuda_kernel_source("aten::mean.dim")


# ----------------------------------------------------------------------------- GPU, real dims

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
K_REAL = 2048
M_REAL = (1, 7, 32, 128, 512)


def real_inputs(N: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = randn(max(M_REAL), K_REAL, dtype=torch.bfloat16, g=g).cuda()
    w = (randn(N, K_REAL, dtype=torch.bfloat16, g=g) * K_REAL ** -0.5).cuda()
    bias = randn(N, dtype=torch.bfloat16, g=g).cuda()
    return a, w, bias


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [2048, 8192])
def test_gpu_bf16_close_to_cublas_and_rows_exact_across_m(N):
    a, w, bias = real_inputs(N, seed=N)
    full, full_bias = TM.mm(a, w.t()), TM.addmm(bias, a, w.t())
    for M in M_REAL:
        c = TM.mm(a[:M], w.t())
        err = rel_err(c, torch.mm(a[:M], w.t()))  # cuBLAS: not installed here
        assert err < 1e-2, f"M={M} N={N}: rel err {err:.2e} against cuBLAS"
        assert torch.equal(c, full[:M]), f"M={M} N={N}: rows differ from the {max(M_REAL)}-row call"
        assert torch.equal(TM.addmm(bias, a[:M], w.t()), full_bias[:M]), f"addmm M={M} N={N}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("batch_invariant_installed")
def test_gpu_torch_gemms_run_the_kernel_once_installed():
    """torch.mm, addmm, linear and bmm on CUDA give the module's own bits, rows exact across M."""
    a, w, bias = real_inputs(2048, seed=1)
    assert BI.installed()
    full, full_bias, full_bmm = TM.mm(a, w.t()), TM.addmm(bias, a, w.t()), TM.bmm(a[None], w.t()[None])
    for M in M_REAL:
        assert torch.equal(torch.mm(a[:M], w.t()), full[:M]), f"torch.mm M={M}"
        assert torch.equal(torch.addmm(bias, a[:M], w.t()), full_bias[:M]), f"torch.addmm M={M}"
        assert torch.equal(torch.nn.functional.linear(a[:M], w, bias), full_bias[:M]), f"F.linear M={M}"
        assert torch.equal(torch.nn.functional.linear(a[:M], w), full[:M]), f"F.linear without bias M={M}"
        assert torch.equal(torch.bmm(a[None, :M], w.t()[None]), full_bmm[:, :M]), f"torch.bmm M={M}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("batch_invariant_installed")
def test_gpu_captured_mm_replays_the_eager_result():
    a, w, _ = real_inputs(2048, seed=2)
    x = a[:32].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and load the kernel before capturing
        torch.mm(x, w.t())
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.mm(x, w.t())
    x.copy_(a[100:132])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.mm(a[100:132], w.t()))
    assert torch.equal(y, TM.mm(a[100:132], w.t()))

