"""testkit/triton_interpreter.py's patches of Triton's interpreter:

- vectorized XOR reductions: a kernel's `tl.xor_sum` at every axis, with and without kept
  dimensions, gives the values of Triton's own element-by-element reduction, and a kernel that
  sorts (tl.sort reduces with XOR) gives torch's order;
- bfloat16 casts by shifts: every bfloat16 value to float32, and float32 values of every exponent
  (subnormals, zeros, infinities and NaNs among them) to bfloat16, give the bits of Triton's own
  converter, and a kernel's casts give torch's values;
- the language patched once a launch: a launch whose kernel calls @jit functions leaves
  triton.language as it found it, and a second launch computes what the first did;
- operands of one type as they are: a binary op's operand checks give what Triton's own give, for
  operands alike and not (shapes, dtypes, scalars, pointers, Python numbers)."""

from __future__ import annotations

# before triton: testkit/triton_interpreter.py says why
from testkit.triton_interpreter import (INTERPRETED, _interpreter, bfloat16_casts_by_shifts,  # noqa: E402
                                       languages_by_identity, operands_of_one_type_as_they_are,
                                       vectorized_xor_reductions)

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


def test_bfloat16_casts_give_the_bits_of_tritons_converter():
    import numpy as np

    assert bfloat16_casts_by_shifts()
    convert = _interpreter()._convert_float
    every_bf16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    bits = np.random.default_rng(0).integers(0, 1 << 32, size=(256, 64), dtype=np.uint64).astype(np.uint32)
    bits = (bits & np.uint32(0x807FFFFF)) | (np.arange(256, dtype=np.uint32)[:, None] << np.uint32(23))  # every exponent
    bits[:4, :4] = 0  # zeros among the subnormal row
    f32 = bits.view(np.float32)
    normal_bf16 = every_bf16[(every_bf16 & 0x7F80 != 0) | (every_bf16 & 0x7F == 0)]
    normal_f32 = f32[(bits & 0x7F800000 != 0) | (bits & 0x7FFFFF == 0)]
    rtz = _interpreter()._ir.ROUNDING_MODE.RTZ
    cases = [(a, tl.bfloat16, tl.float32, None) for a in (every_bf16, normal_bf16, normal_bf16[:7], every_bf16[3, 5])]
    cases += [(a, tl.float32, tl.bfloat16, mode) for a in (f32, normal_f32, f32[200:201, :9], f32[9, 2])
              for mode in (None, rtz)]
    for data, src, dst, mode in cases:
        fast, slow = convert(data, src, dst, mode), convert.original(data, src, dst, mode)
        assert fast.dtype == slow.dtype and fast.shape == slow.shape and np.array_equal(fast, slow), (src, dst, mode)


@triton.jit
def _round_trip_kernel(x_ptr, up_ptr, down_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(up_ptr + offs, tl.load(x_ptr + offs).to(tl.float32))  # bfloat16 -> float32
    tl.store(down_ptr + offs, tl.load(up_ptr + offs).to(tl.bfloat16, fp_downcast_rounding="rtz"))


def test_a_kernels_bfloat16_casts_give_torchs_values():
    assert bfloat16_casts_by_shifts()
    x = torch.randn(64, generator=torch.Generator().manual_seed(1)).bfloat16()
    up, down = torch.empty(64), torch.empty(64, dtype=torch.bfloat16)
    _round_trip_kernel[(1,)](x, up, down, N=64)
    assert torch.equal(up, x.float()) and torch.equal(down, x)


@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _scaled(x, K: tl.constexpr):
    for _ in tl.static_range(K):
        x = _twice(x)
    return x


@triton.jit
def _nested_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.sum(_scaled(tl.load(x_ptr + offs), 3)[None, :], axis=0))


def test_a_launch_with_nested_calls_leaves_the_language_as_it_found_it():
    assert languages_by_identity()
    names = ("range", "static_range", "reduce", "associative_scan", "multiple_of", "static_assert")
    before = {n: getattr(tl, n) for n in names} | {"core." + n: getattr(tl.core, n) for n in names}
    before["tensor.__index__"] = getattr(tl.core.tensor, "__index__", None)
    x = torch.arange(16, dtype=torch.float32)
    outs = [torch.empty(16), torch.empty(16)]
    for out in outs:
        _nested_kernel[(2,)](x, out, N=16)
    after = {n: getattr(tl, n) for n in names} | {"core." + n: getattr(tl.core, n) for n in names}
    after["tensor.__index__"] = getattr(tl.core.tensor, "__index__", None)
    assert after == before
    assert torch.equal(outs[0], x * 8) and torch.equal(outs[1], outs[0])


def test_binary_op_operands_are_those_tritons_checks_give():
    import numpy as np

    assert operands_of_one_type_as_they_are()
    interpreter = _interpreter()
    semantic = interpreter.interpreter_semantic
    check = type(semantic).binary_op_type_checking_impl

    def block(dtype, np_dtype, shape):
        data = np.arange(int(np.prod(shape)), dtype=np_dtype).reshape(shape)
        return tl.tensor(interpreter.TensorHandle(data, dtype), tl.block_type(dtype, list(shape)))

    def scalar(dtype, np_dtype, value):
        return tl.tensor(interpreter.TensorHandle(np.array([value], dtype=np_dtype), dtype), dtype)

    f32, f16, i32, i64 = (tl.float32, np.float32), (tl.float16, np.float16), (tl.int32, np.int32), (tl.int64, np.int64)
    pointers = tl.tensor(interpreter.TensorHandle(np.zeros(4, dtype=np.uint64), tl.pointer_type(tl.float32)),
                         tl.block_type(tl.pointer_type(tl.float32), [4]))
    pairs = [(block(*f32, (4, 8)), block(*f32, (4, 8)), {}), (block(*i32, (4,)), block(*i32, (4,)), {}),
             (scalar(*f32, 1.5), scalar(*f32, 2.0), {}), (block(*f32, (4, 8)), block(*f32, (1, 8)), {}),
             (block(*f32, (4,)), block(*f16, (4,)), {}), (block(*i32, (4,)), block(*i64, (4,)), {}),
             (block(*f32, (4,)), scalar(*f32, 3.0), {}), (block(*f32, (4,)), 2.5, {}), (3, block(*i32, (4,)), {}),
             (block(*i32, (4,)), block(*i32, (4,)), {"div_or_mod": True}),
             (block(*f16, (4,)), block(*f16, (4,)), {"div_or_mod": True}),
             (block(*i32, (4,)), block(*i32, (4,)), {"arithmetic_check": False}),
             (pointers, block(*i32, (4,)), {"allow_lhs_ptr": True})]
    for lhs, rhs, flags in pairs:
        got, want = check(semantic, lhs, rhs, **flags), check.original(semantic, lhs, rhs, **flags)
        for g, w in zip(got, want):
            assert str(g.type) == str(w.type) and g.handle.data.dtype == w.handle.data.dtype, (lhs, rhs, flags)
            assert np.array_equal(g.handle.data, w.handle.data), (lhs, rhs, flags)
    lhs, rhs = pairs[0][:2]
    assert check(semantic, lhs, rhs) == (lhs, rhs)  # alike: the operands themselves
    with pytest.raises(Exception) as fast:
        check(semantic, block(*f32, (4,)), pointers)
    with pytest.raises(Exception) as slow:
        check.original(semantic, block(*f32, (4,)), pointers)
    assert type(fast.value) is type(slow.value)
