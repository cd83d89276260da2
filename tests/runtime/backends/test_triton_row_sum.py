"""The batch-invariant sum and mean (runtime/backends/kernels/row_sum.py) against torch, and their
rows across row counts.

On a machine without CUDA the kernel runs in Triton's interpreter: CPU tests of the host logic
(dims moved last, keepdim, dtypes, empty tensors, errors) and of the aten wiring (registered for
the CPU key while a test runs, as batch_invariant_aten.install() does for CUDA). Every check draws
fresh random inputs and compares with torch in float64 by ||x - ref|| / ||ref||; integer sums
exactly.

The tests marked gpu run the compiled kernel at the glue's real shapes: each row of [M, K] the
same bits as the row alone for M up to 32 (torch's own reduction is counted beside it: the reason
for the module), the RMSNorm and L2 norm of the models the same bits row by row once installed,
and a captured mean replayed. The interpreter must be switched on before triton is first imported
(testkit/triton_interpreter.py says why and what happens otherwise).
"""

from __future__ import annotations

import pytest
import torch

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import DEVICE, INTERPRETED, interpreter_or_fresh_process  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")

from runtime.backends import batch_invariant_aten as BI  # noqa: E402
from runtime.backends.kernels import row_sum as RS  # noqa: E402
from testkit.helpers import assert_one_line_error  # noqa: E402
from testkit.linear_cases import rel_err  # noqa: E402

in_process, test_in_a_fresh_interpreter_process = interpreter_or_fresh_process(__file__)

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-12}
# (shape, dim): the last dim (the norms), a middle one, several, all (None), a length past one block
CASES = [((5, 300), [-1]), ((3, 4, 7), [1]), ((3, 4, 7), [0, 2]), ((6, 9), None), ((2, 2500), [-1]),
         ((4, 3, 1), [-1]), ((7,), [0])]


def randn(*shape, dtype=torch.float32, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@in_process
@pytest.mark.parametrize("keepdim", [False, True], ids=["drop", "keep"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=["f32", "bf16", "f16", "f64"])
@pytest.mark.parametrize("shape,dim", CASES)
def test_sum_and_mean_match_torch(shape, dim, dtype, keepdim):
    x = randn(*shape, dtype=dtype, seed=sum(shape))
    dims = tuple(range(len(shape))) if dim is None else tuple(dim)
    for fn, ref in ((RS.sum_dim, torch.sum), (RS.mean_dim, torch.mean)):
        got = fn(x.to(DEVICE), dim, keepdim)
        want = ref(x.double(), dims, keepdim)
        assert got.dtype == dtype and got.shape == want.shape, f"{fn.__name__}: {got.dtype} {tuple(got.shape)}"
        err = rel_err(got, want)
        assert err <= TOL[dtype], f"{fn.__name__} {shape} dim={dim} {dtype}: rel err {err:.2e}"


@in_process
def test_integer_and_bool_sums_are_torch_s():
    g = torch.Generator().manual_seed(3)
    ints = torch.randint(-1000, 1000, (4, 33), generator=g)
    for x in (ints, ints.int(), ints.to(torch.int8), ints > 0):
        got = RS.sum_dim(x.to(DEVICE), [-1])
        want = torch.sum(x, -1)
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got.cpu(), want), f"{x.dtype}"
    got = RS.sum_dim(ints.to(DEVICE), [0], dtype=torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), ints.sum(0, dtype=torch.int32))


@in_process
def test_a_given_dtype_casts_the_input_first():
    x = randn(3, 40, seed=4)
    got = RS.sum_dim(x.to(DEVICE), [-1], dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, x.bfloat16().double().sum(-1)) <= TOL[torch.bfloat16]
    got = RS.mean_dim(x.bfloat16().to(DEVICE), [-1], True, dtype=torch.float64)
    assert got.dtype == torch.float64 and rel_err(got, x.bfloat16().double().mean(-1, True)) <= 1e-12


@in_process
def test_empty_and_0_dim_tensors_are_torch_s():
    assert torch.equal(RS.sum_dim(torch.zeros(3, 0, device=DEVICE), [1]).cpu(), torch.zeros(3))
    assert RS.mean_dim(torch.zeros(3, 0, device=DEVICE), [1]).isnan().all()
    assert RS.sum_dim(torch.zeros(0, 5, device=DEVICE), [1], True).shape == (0, 1)
    scalar = torch.tensor(2.5, device=DEVICE)
    for dim in ([0], [-1], None):
        got = RS.sum_dim(scalar, dim)
        assert got.shape == () and got.item() == 2.5, f"dim={dim}"


@in_process
def test_each_row_is_the_same_bits_in_a_prefix_or_permuted():
    """Rows of a [M, K] call against the first rows alone and against the rows permuted (in the
    interpreter the order is the kernel's own; the GPU test below checks it compiled)."""
    x = randn(9, 2100, seed=5).to(DEVICE)
    full = RS.sum_dim(x, [-1])
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(1))
    assert torch.equal(RS.sum_dim(x[perm.to(DEVICE)], [-1]), full[perm.to(DEVICE)])
    for M in (1, 4):
        assert torch.equal(RS.sum_dim(x[:M], [-1]), full[:M]), f"M={M}"


@pytest.mark.parametrize("call,names", [
    (lambda: RS.sum_dim(torch.ones(3, dtype=torch.complex64), [0]), "complex"),
    (lambda: RS.mean_dim(torch.ones(3, dtype=torch.int64), [0]), "floating"),
    (lambda: RS.mean_dim(torch.ones(3), [0], dtype=torch.int32), "floating"),
    (lambda: RS.sum_dim(torch.ones(3, 4), [2]), "dim [2]"),
    (lambda: RS.sum_dim(torch.ones(3, 4), [1, -1]), "dim [1, -1]"),
], ids=["complex", "int-mean", "int-dtype-mean", "range", "repeated"])
def test_bad_inputs_raise_a_value_error_naming_them(call, names):
    assert_one_line_error(call, names)


@in_process
@pytest.mark.skipif(not INTERPRETED, reason="the CPU key can only run the kernel in the interpreter")
def test_aten_ops_reach_the_kernel_once_registered():
    """What install() does for CUDA, done for the CPU key while the test runs: torch.sum and
    torch.mean over dims, the tensor methods and the norms of the models give exactly the module's
    results (computed before registering), a mean of integers raises the module's ValueError, and
    torch's kernels come back after."""
    from models.common import RMSNorm
    from models.qwen3_next import l2norm

    x = randn(5, 3, 70, seed=6)
    norm = RMSNorm(70, unit_offset=True).requires_grad_(False)
    want = {"sum": RS.sum_dim(x, [-1]), "mean": RS.mean_dim(x, [-1], True), "sum02": RS.sum_dim(x, [0, 2]),
            "mean64": RS.mean_dim(x, [1], dtype=torch.float64), "bool": RS.sum_dim(x > 0, [-1])}
    lib = BI.register("CPU", RS.ATEN_IMPLS)
    try:
        got = {"sum": torch.sum(x, -1), "mean": x.mean(-1, keepdim=True), "sum02": x.sum((0, 2)),
               "mean64": torch.mean(x, 1, dtype=torch.float64), "bool": (x > 0).sum(-1)}
        registered_norm, registered_l2 = norm(x), l2norm(x)
        with pytest.raises(ValueError, match="floating"):
            torch.ones(3, dtype=torch.int64).mean(0)
    finally:
        lib._destroy()
    for name in want:
        assert torch.equal(got[name], want[name]), f"torch's {name} did not run the kernel"
    # the models' norms now differ from torch's own kernels' only by the order of the sum
    assert rel_err(registered_norm, norm(x)) < 1e-6 and rel_err(registered_l2, l2norm(x)) < 1e-6
    with pytest.raises(RuntimeError):
        torch.ones(3, dtype=torch.int64).mean(0)  # torch's own mean is back


# ----------------------------------------------------------------------------- GPU, real shapes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
M_MAX = 32


def _rows_apart(fn, x: torch.Tensor) -> int:
    """How many rows of fn(x[:M]) differ in bits from fn(x[i:i+1]), over M = 2 .. M_MAX."""
    alone = [fn(x[i:i + 1]) for i in range(x.shape[0])]
    return sum(int(not torch.equal(fn(x[:M])[i:i + 1], alone[i])) for M in range(2, M_MAX + 1) for i in range(M))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tail", [(2048,), (4096,), (2, 256), (16, 128)], ids=["2048", "4096", "2x256", "16x128"])
def test_gpu_rows_are_the_same_bits_at_every_row_count(tail):
    """x.pow(2).mean(-1) as the norms take it, bf16 activations in float32, scales varying by row."""
    g = torch.Generator().manual_seed(len(tail) * 10000 + tail[-1])
    scale = 1 + 10 * torch.rand(M_MAX, *tail[:-1], 1, generator=g)
    x = (torch.randn(M_MAX, *tail, generator=g) * scale).bfloat16().float().cuda()
    ours = _rows_apart(lambda t: RS.mean_dim(t.pow(2), [-1], True), x)
    torch_own = _rows_apart(lambda t: t.pow(2).mean(-1, keepdim=True), x)
    print(f"{tail}: rows apart from the row alone, M = 2 .. {M_MAX}: ours {ours}, torch's own {torch_own}")
    assert ours == 0
    err = rel_err(RS.mean_dim(x.pow(2), [-1], True), x.double().pow(2).mean(-1, keepdim=True))
    assert err < 1e-6, f"rel err {err:.2e} against float64"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("batch_invariant_installed")
def test_gpu_model_norms_are_the_same_bits_row_by_row_once_installed():
    from models.common import RMSNorm
    from models.qwen3_next import GatedRMSNorm, l2norm

    g = torch.Generator().manual_seed(7)
    x = (torch.randn(M_MAX, 2048, generator=g) * 4).bfloat16().cuda()
    heads = (torch.randn(M_MAX, 16, 128, generator=g) * 3).bfloat16().cuda()
    gate = torch.randn(M_MAX, 16, 128, generator=g).bfloat16().cuda()
    norm = RMSNorm(2048, unit_offset=True).cuda()
    gated = GatedRMSNorm(128, 1e-6).cuda()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(2048, generator=g) * 0.1)
        assert _rows_apart(norm, x) == 0, "RMSNorm"
        assert _rows_apart(l2norm, heads) == 0, "l2norm"
        both = torch.stack([heads, gate], 1)  # [M, 2, 16, 128]: a row and its gate sliced together
        assert _rows_apart(lambda t: gated(t[:, 0], t[:, 1]), both) == 0, "GatedRMSNorm"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.usefixtures("batch_invariant_installed")
def test_gpu_captured_mean_replays_the_eager_result():
    g = torch.Generator().manual_seed(8)
    a = torch.randn(64, 2048, generator=g).cuda()
    x = a[:8].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and load the kernel before capturing
        x.mean(-1, keepdim=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x.mean(-1, keepdim=True)
    x.copy_(a[40:48])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, RS.mean_dim(a[40:48], [-1], True))
