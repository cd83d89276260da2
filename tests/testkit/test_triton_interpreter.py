"""testkit/triton_interpreter.py's vectorized XOR reductions: a kernel's `tl.xor_sum` at every axis,
with and without kept dimensions, gives the values of Triton's own element-by-element reduction, and
a kernel that sorts (tl.sort reduces with XOR) gives torch's order."""

from __future__ import annotations

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import INTERPRETED, _interpreter, vectorized_xor_reductions  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")
import triton.language as tl  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="the patch is for Triton's interpreter")

ROWS, COLS = 4, 8


@triton.jit
def _xor_kernel(x_ptr, out_ptr, AXIS: tl.constexpr, KEEP: tl.constexpr):
    rows, cols = tl.arange(0, 4), tl.arange(0, 8)
    x = tl.load(x_ptr + rows[:, None] * 8 + cols[None, :])
    if AXIS == 0:
        r = tl.xor_sum(x, axis=0, keep_dims=KEEP)
        tl.store(out_ptr + (cols[None, :] if KEEP else cols), r)
    elif AXIS == 1:
        r = tl.xor_sum(x, axis=1, keep_dims=KEEP)
        tl.store(out_ptr + (rows[:, None] if KEEP else rows), r)
    else:
        tl.store(out_ptr, tl.xor_sum(tl.reshape(x, [32]), axis=0))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("axis,keep", [(0, False), (0, True), (1, False), (1, True), (-1, False)])
def test_xor_sum_gives_the_element_by_element_values(monkeypatch, dtype, axis, keep):
    assert vectorized_xor_reductions()
    high = 255 if dtype == torch.uint8 else 2 ** 30
    x = torch.randint(0, high, (ROWS, COLS), generator=torch.Generator().manual_seed(axis + 5)).to(dtype)
    fast, slow = torch.zeros(COLS, dtype=dtype), torch.zeros(COLS, dtype=dtype)
    _xor_kernel[(1,)](x, fast, AXIS=axis, KEEP=keep)
    reduce_ops = _interpreter().ReduceOps
    monkeypatch.setattr(reduce_ops, "apply_impl", reduce_ops.apply_impl.original)
    _xor_kernel[(1,)](x, slow, AXIS=axis, KEEP=keep)
    assert torch.equal(fast, slow)
    assert fast.any(), "the kernel stored its reduction"


@triton.jit
def _sort_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.sort(tl.load(x_ptr + offs)))


def test_a_kernel_that_sorts_gives_torchs_order():
    assert vectorized_xor_reductions()
    x = torch.randint(-1000, 1000, (64,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    out = torch.empty_like(x)
    _sort_kernel[(1,)](x, out, N=64)
    assert torch.equal(out, torch.sort(x).values)
