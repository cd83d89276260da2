"""A batch-invariant matrix product in Triton.

Batch-invariant: every row of C = A @ B is computed bit for bit the same whatever the number of
rows M of the call, so a decode step of 32 rows and a target_verify step of 128 rows give the same
bits for the same input row. cuBLAS does not: it picks its kernel (tiles, split-K) by the shape, M
included, and a row's sum over K is then taken in another order (or with another instruction) at
another M. Here one kernel with one launch configuration serves every M (see _CONFIG).

`mm`, `addmm` (torch.addmm's beta * bias + alpha * (a @ b)) and `bmm` take any strides (B is
usually a transposed weight view) in float32, float16 or bfloat16, accumulate in float32 and
return the inputs' dtype. `ATEN_IMPLS` names them as aten::mm, aten::addmm and aten::bmm (and
their out= forms): runtime/backends/batch_invariant_aten.py registers them for CUDA, process-wide,
to serve an artifact compiled with `hgc compile --batch-invariant`.

It does not: reach GEMMs that never go through those six aten ops (mv/addmv, baddbmm, Inductor's
own Triton templates under max-autotune, custom kernels), take other dtypes (integers, float8,
complex and float64 raise a ValueError, where cuBLAS would have computed them), or choose tiles
for speed: it is meant to give the same bits, not to be as fast as cuBLAS at every shape.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, triton_interpreted

__all__ = ["ATEN_IMPLS", "addmm", "bmm", "mm"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The one launch configuration, for every M, N, K and dtype. A row's result depends on the tile
# shape (the K steps its sum is taken in and the tensor-core instruction tl.dot lowers to for that
# tile) and on nothing else: the K loop always walks BLOCK_K columns at a time from 0, there is no
# split-K (it would sum K in pieces, a different order), and no tile is picked by M (a per-M
# choice, like cuBLAS's heuristics, would change the instruction and the order). Rows beyond M are
# masked to zero and only change which rows a program stores. 64 x 64 x 64 with 4 warps is one
# warpgroup's wgmma tile on Hopper and small enough that a decode step of a few rows wastes little;
# 3 stages keep two K tiles in flight (48 KiB of shared memory in 16-bit, 96 KiB in float32).
_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
# Programs walk 8 row tiles per column tile (L2 reuse); which program computes a tile never changes its bits.
_GROUP_M = 8
_MAX_BATCH = 65535  # CUDA's grid limit on axis 1: larger bmm batches go in several launches


# M is never specialized (Triton would compile another variant for M == 1 or M % 16 == 0), and mm
# passes batch strides of 0 (a [1, M, K] view's is M * K): nothing about mm's compiled kernel
# follows M. The other strides, N and K follow the layout and the weight; their divisibility lets
# Triton vectorize loads. (bmm's batch strides do follow M: that changes how tiles are loaded, not
# what a row sums or in which order.)
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a, b, c, bias, M, N, K,
                   s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cb, s_cm, s_cn, s_biasm, s_biasn,
                   alpha, beta,
                   HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    pid_n = (pid % (GROUP_M * tiles_n)) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)  # offsets of tensors past 2**31 elements
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    a_ptrs = a + batch * s_ab + rm64[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b + batch * s_bb + rk[:, None] * s_bk + rn64[None, :] * s_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # always from 0, BLOCK_K at a time: one order for every row
        k_ok = rk < K - k0
        at = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's 16-bit dots are wrong (launch_math.triton_interpreted); float32 is exact
            at = at.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(at, bt, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk

    acc = acc * alpha
    if HAS_BIAS:  # added in float32, before the one rounding to the output dtype
        bias_t = tl.load(bias + rm64[:, None] * s_biasm + rn64[None, :] * s_biasn,
                         mask=m_ok[:, None] & n_ok[None, :], other=0.0)
        acc += beta * bias_t.to(tl.float32)
    c_ptrs = c + batch * s_cb + rm64[:, None] * s_cm + rn64[None, :] * s_cn
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_MATMUL = Launcher(_matmul_kernel)  # eager gaps repeat its arguments (launch_cache.py)


def _launch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
            alpha: float, beta: float) -> None:
    """c[i] = alpha * a[i] @ b[i] (+ beta * bias) for a [G, M, K], b [G, K, N], c [G, M, N]; bias
    already expanded to [M, N] (stride 0 where broadcast). Every entry of the batch, every row and
    every column tile runs the same compiled kernel."""
    G, M, K = a.shape
    N = b.shape[2]
    if K == 0:  # no product: the kernel's K loop would not run either
        if bias is None:
            c.zero_()
        else:
            c.copy_((bias * beta).expand(c.shape))
        return
    upcast = triton_interpreted() and a.dtype != torch.float32
    # float32: no TF32 (torch's CUDA default, torch.backends.cuda.matmul.allow_tf32 False); 16-bit
    # operands ignore the precision.
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"
    has_bias = bias is not None
    bias_arg = bias if has_bias else c  # never read
    s_bias = (bias.stride(0), bias.stride(1)) if has_bias else (0, 0)
    tiles = cdiv(M, _CONFIG["BLOCK_M"]) * cdiv(N, _CONFIG["BLOCK_N"])
    batched = G > 1
    for g0 in range(0, G, _MAX_BATCH):
        ag, bg, cg = a[g0:g0 + _MAX_BATCH], b[g0:g0 + _MAX_BATCH], c[g0:g0 + _MAX_BATCH]
        strides = [(t.stride(0) if batched else 0, t.stride(1), t.stride(2)) for t in (ag, bg, cg)]
        _MATMUL[(tiles, ag.shape[0])](
            ag, bg, cg, bias_arg, M, N, K, *strides[0], *strides[1], *strides[2], *s_bias,
            float(alpha), float(beta),
            HAS_BIAS=has_bias, UPCAST=upcast, PRECISION=precision, GROUP_M=_GROUP_M, **_CONFIG)


def _check(op: str, a: torch.Tensor, b: torch.Tensor, dims: int) -> None:
    """Shapes, dtypes and devices the kernel takes, or a one-line ValueError naming them."""
    if a.dim() != dims or b.dim() != dims or a.shape[-1] != b.shape[-2] or a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"{op}: cannot multiply {tuple(a.shape)} by {tuple(b.shape)} "
                         f"(expected {'[B, M, K] and [B, K, N]' if dims == 3 else '[M, K] and [K, N]'})")
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise ValueError(f"{op}: the batch-invariant matmul takes float32, float16 or bfloat16 operands of one dtype, "
                         f"not {a.dtype} {tuple(a.shape)} and {b.dtype} {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"{op}: operands on {a.device} and {b.device}")


def _output(op: str, out: Optional[torch.Tensor], shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """`out` checked (an empty one is resized, as torch does), or a new tensor."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"{op}: out is {out.dtype} on {out.device}, the product {like.dtype} on {like.device}")
    if tuple(out.shape) != tuple(shape):
        if out.numel() != 0:
            raise ValueError(f"{op}: out is {tuple(out.shape)}, the product {tuple(shape)}")
        out.resize_(shape)
    return out


def mm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] in a's dtype (into `out` when given)."""
    _check("mm", a, b, 2)
    c = _output("mm", out, (a.shape[0], b.shape[1]), a)
    if c.numel():
        _launch(a.unsqueeze(0), b.unsqueeze(0), c.unsqueeze(0), None, 1.0, 0.0)
    return c


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """beta * bias + alpha * (a [M, K] @ b [K, N]), bias broadcastable to [M, N] (a [N] bias is the
    usual one), all in float32 before one rounding; beta == 0 ignores bias (NaNs included), as torch."""
    _check("addmm", a, b, 2)
    M, N = a.shape[0], b.shape[1]
    if bias.dtype != a.dtype or bias.device != a.device:
        raise ValueError(f"addmm: bias is {bias.dtype} on {bias.device}, the operands {a.dtype} on {a.device}")
    if bias.dim() > 2 or any(s not in (1, t) for s, t in zip(bias.shape[::-1], (N, M))):
        raise ValueError(f"addmm: bias {tuple(bias.shape)} does not broadcast to the product {(M, N)}")
    c = _output("addmm", out, (M, N), a)
    if c.numel():
        full = bias.expand(M, N) if beta != 0 else None
        _launch(a.unsqueeze(0), b.unsqueeze(0), c.unsqueeze(0), full, alpha, beta)
    return c


def bmm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N], each entry of the batch by the same kernel as mm."""
    _check("bmm", a, b, 3)
    c = _output("bmm", out, (a.shape[0], a.shape[1], b.shape[2]), a)
    if c.numel():
        _launch(a, b, c, None, 1.0, 0.0)
    return c


# aten overload -> function, for batch_invariant_aten.register (the out= forms take out by keyword)
ATEN_IMPLS = (("mm", mm), ("mm.out", mm), ("addmm", addmm), ("addmm.out", addmm), ("bmm", bmm), ("bmm.out", bmm))
