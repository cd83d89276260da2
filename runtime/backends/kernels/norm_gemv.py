"""A layer's RMSNorms (with the residual adds beside them) and the projections beside them.

The CUDA side of hgc_glue::add_rms_norm_linear, rms_norm_linear and linear_add_rms_norm
(compiler/splitops/glue_ops.py; runtime/backends/glue_kernels.py picks per call). For an input
norm the glue computes, for rows a and b [M, K] of the activation dtype A: summed = a + b in A (the
residual stream, which it carries on); the RMSNorm of summed (models/common.py): its float32 rows
times rsqrt(mean of their squares + eps), times (w + 1) or w in float32, rounded to A; then the
projection of that row. Without b the norm's input is a itself (the embedding's output) and there
is no summed. For a post-attention norm the projection comes first and its rounded output is b.

1. `add_rms_norm_gemv`: M <= gemv.MAX_ROWS rows in one launch, with a config of its own where
   NORM_CONFIGS has one (`norm_config_for`), else that of gemv.py's plain GEMV of the same shape
   (`gemv.config_for`; FMA or DOT as that config says). One program
   per BLOCK_N output columns reads its weight tile and the rows, and computes the norm itself in
   its prologue: every program sums a and b, takes the mean square over the whole K in float32,
   scales and rounds to A as the glue does (the glue rounds the normed row before its linear),
   then takes the products. Program 0 also stores summed. In one step (FMA, K <= BLOCK_K) the
   weight tile and the norm weight are loaded before the PDL wait, the rows after it (pdl.py's
   rule); otherwise (over K in steps, or DOT) a first pass over the rows takes the statistics
   (program 0 storing summed) and the loop sums a and b again tile by tile (they are in the
   cache), after the wait, as gemv.py's loops wait. The price of the launch it saves (the glue's
   norm kernel): at one row each program reads a, b and the norm weight, three vectors of K from
   L2, where the plain GEMV reads one, and reduces the row itself.
2. `add_rms_norm_rows`: summed and the normed row for any number of rows, one program per row in
   one launch (the traced glue's Inductor kernel was one launch too: an extend step of thousands of
   rows must not pay a chain of eager ops); the caller then runs F.linear on the normed rows.
3. `gemv_add_rms_norm` (linear_add_rms_norm: a layer's output projection, then the residual add
   and the post-attention norm): M <= gemv.MAX_ROWS rows in one launch with the plain GEMV's config
   and code (`gemv.gemv_sums`). Each program rounds its columns of the product to A, adds the
   residual's (rounded to A, as torch adds two tensors of A) and stores them in summed, then
   counts itself in (runtime/backends/kernels/arrivals.py); the last to finish reads the rows of
   summed back from L2 and normalises them into normed, in one order of sums whatever order the
   programs finished in, and zeroes the counter. The price of the launch it saves: an atomic per
   program, and the last program's pass over the rows after the slowest program.

CPU reference: glue_ops' CompositeExplicitAutograd kernels, the traced glue's own ops.
Not done here: choosing the path (glue_kernels.py), other norms (Kimi's KimiRMSNorm rounds before
it scales: the rewrite leaves it), bias.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.arrivals import arrival_counters, last_to_arrive
from runtime.backends.kernels.gemv import (MAX_ROWS, GemvConfig, _fma_products, _fma_sum, _load_tile, config_for,
                                           gemv_sums, launch_constants, row_bucket)
from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, next_pow2
from runtime.backends.kernels.pdl import launch_args, pdl_wait

__all__ = ["add_rms_norm_gemv", "add_rms_norm_rows", "gemv_add_rms_norm", "ROW_BLOCK_MAX", "EPILOGUE_BLOCK",
           "NORM_CONFIGS", "norm_config_for"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROW_BLOCK_MAX = 8192  # the row kernel's widest tile: a row of K up to it is read once, wider ones in steps
# The elements (rows x columns) the epilogue's last program reads at a time: one row of bench's
# hidden size in one step, more rows in narrower steps (the tile stays in registers).
EPILOGUE_BLOCK = 2048

# (N, K, M bucket) -> the input-norm GEMV's config where it is not the plain GEMV's, from
# `benchmarks/kernels/norm_gemv_bench.py --sweep --rows 1` on an H100, bf16, 2026-12-06
# (benchmarks/results/norm_gemv_sweep_h100_2026-12-06.json). The plain GEMV's one column a program
# suits the weight stream; fused, each program also reads the row, its residual and the norm weight
# from L2 and reduces the row, three vectors of K per column of weight at one column: at the GDN
# in_proj 20.27 us against the unfused pair's 19.09, at 2 columns on 8 warps 18.25; GQA's q, k, v
# 15.93 against 15.36, at 2 columns 14.24.
NORM_CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (12352, 2048, 1): GemvConfig(BLOCK_N=2, BLOCK_K=2048, num_warps=8, num_stages=1, DOT=False),
    (9216, 2048, 1): GemvConfig(BLOCK_N=2, BLOCK_K=2048, num_warps=8, num_stages=1, DOT=False),
}


def norm_config_for(N: int, K: int, M: int) -> GemvConfig:
    """`add_rms_norm_gemv`'s config: NORM_CONFIGS' entry for (N, K, M's bucket), else the plain GEMV's."""
    return NORM_CONFIGS.get((N, K, row_bucket(M))) or config_for(N, K, M)


@triton.jit
def _load_vector(ptrs, k_ok, K_MASK: tl.constexpr):
    """The norm weight's [BK] slice in float32, kept in the cache (every program reads it); masked
    only where K does not fill the tile."""
    if K_MASK:
        v = tl.load(ptrs, mask=k_ok, other=0.0, eviction_policy="evict_last")
    else:
        v = tl.load(ptrs, eviction_policy="evict_last")
    return v.to(tl.float32)


@triton.jit
def _summed_rows(a_ptrs, b_ptrs, row_ok, k_ok, HAS_B: tl.constexpr, ROW_MASK: tl.constexpr, K_MASK: tl.constexpr,
                 POLICY: tl.constexpr):
    """The norm's input rows [ROWS, BK] in A: a + b summed in float32 and rounded once, as torch adds
    two tensors of A (a alone without b). Rows and columns outside the tile read 0."""
    s = _load_tile(a_ptrs, row_ok, k_ok, ROW_MASK, K_MASK, POLICY)
    if HAS_B:
        bt = _load_tile(b_ptrs, row_ok, k_ok, ROW_MASK, K_MASK, POLICY)
        s = (s.to(tl.float32) + bt.to(tl.float32)).to(s.dtype)
    return s


@triton.jit
def _squares(s):
    """Each row's sum of squares [ROWS] of rows s [ROWS, BK] of A, in float32."""
    sf = s.to(tl.float32)
    return tl.sum(sf * sf, axis=1)


@triton.jit
def _inv_rms(squares, K, eps):
    """rsqrt(mean square + eps) per row from the rows' float32 sums of squares over all K."""
    return tl.math.rsqrt(squares / K + eps)


@triton.jit
def _normed_rows(s, inv_rms, wn, UNIT_OFFSET: tl.constexpr):
    """RMSNorm of rows s [ROWS, BK] of A, given their inv_rms [ROWS] and the norm weight's slice wn
    [BK] in float32, in the glue's order: x * inv_rms, times (w + 1) or w, rounded to A."""
    x = s.to(tl.float32) * inv_rms[:, None]
    if UNIT_OFFSET:
        wn = wn + 1.0
    return (x * wn[None, :]).to(s.dtype)


@triton.jit
def _statistics(a_ptrs, b_ptrs, s_ptrs, row_ok, rk, K, eps, store_summed, ROWS: tl.constexpr,
                BLOCK_K: tl.constexpr, HAS_B: tl.constexpr, ROW_MASK: tl.constexpr, K_MASK: tl.constexpr):
    """A first pass over the rows, BLOCK_K at a time: their inv_rms [ROWS]; summed stored where
    store_summed (a runtime flag: one program of the GEMV stores it)."""
    squares = tl.zeros([ROWS], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk < K - k0
        s = _summed_rows(a_ptrs + k0, b_ptrs + k0, row_ok, k_ok, HAS_B, ROW_MASK, K_MASK, "evict_last")
        if HAS_B:
            if store_summed:
                tl.store(s_ptrs + k0, s, mask=row_ok[:, None] & k_ok[None, :])
        squares += _squares(s)
    return _inv_rms(squares, K, eps)


@triton.jit(do_not_specialize=["M"])
def _norm_gemv_kernel(a, b, nw, w, out, summed, M, N, K, s_am, s_bm, s_wn, s_om, s_sm, eps,
                      HAS_B: tl.constexpr, UNIT_OFFSET: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, DOT: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr,
                      ONE_STEP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, USE_GDC: tl.constexpr):
    """out[:M, cols] = RMSNorm(a + b)[:M] @ w[cols]^T for this program's BLOCK_N columns (step 1 of
    the module docstring); program 0 stores summed = a + b. ROWS >= M rows in the tile. HAS_B: b
    given (else the norm's input is a). USE_GDC: launched with PDL (pdl.py): the one-step FMA path
    reads its weight tile and the norm weight before the wait, the others wait before any load."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, ROWS)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    rows = rm.to(tl.int64)[:, None]
    w_ptrs = w + rn.to(tl.int64)[:, None] * s_wn + rk[None, :]  # [BN, BK]; 64-bit: weights past 2**31 elements
    a_ptrs = a + rows * s_am + rk[None, :]  # [ROWS, BK]
    b_ptrs = b + rows * s_bm + rk[None, :]
    s_ptrs = summed + rows * s_sm + rk[None, :]
    nw_ptrs = nw + rk
    if ONE_STEP and not DOT:  # K <= BLOCK_K: every load issued before the first product
        k_ok = rk < K
        wt = _load_tile(w_ptrs, n_ok, k_ok, MASK_N, MASK_K, "evict_first")
        wn = _load_vector(nw_ptrs, k_ok, MASK_K)
        # the weights stream in while the previous kernel drains; a and b are the step's activations
        pdl_wait(USE_GDC)
        s = _summed_rows(a_ptrs, b_ptrs, m_ok, k_ok, HAS_B, True, MASK_K, "evict_last")
        if HAS_B:
            if pid == 0:
                tl.store(s_ptrs, s, mask=m_ok[:, None] & k_ok[None, :])
        xn = _normed_rows(s, _inv_rms(_squares(s), K, eps), wn, UNIT_OFFSET)
        total = _fma_sum(_fma_products(wt, xn, ROWS), ROWS)
        o_ptrs = out + rows * s_om + rn[None, :]
        tl.store(o_ptrs, total.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        pdl_wait(USE_GDC)
        inv_rms = _statistics(a_ptrs, b_ptrs, s_ptrs, m_ok, rk, K, eps, pid == 0, ROWS, BLOCK_K, HAS_B, True, MASK_K)
        if DOT:
            acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
        elif ROWS == 1:
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # from 0, BLOCK_K at a time: one order, every call
            k_ok = rk < K - k0
            wt = _load_tile(w_ptrs, n_ok, k_ok, MASK_N, MASK_K, "evict_first")
            s = _summed_rows(a_ptrs, b_ptrs, m_ok, k_ok, HAS_B, True, MASK_K, "evict_last")
            xn = _normed_rows(s, inv_rms, _load_vector(nw_ptrs, k_ok, MASK_K), UNIT_OFFSET)
            if DOT:
                if UPCAST:  # the interpreter's 16-bit dots are wrong (launch_math.triton_interpreted)
                    wt = wt.to(tl.float32)
                    xn = xn.to(tl.float32)
                acc = tl.dot(wt, tl.trans(xn), acc, input_precision=PRECISION)  # [BN, ROWS]
            else:
                acc += _fma_products(wt, xn, ROWS)
            w_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        if DOT:
            o_ptrs = out + rm.to(tl.int64)[None, :] * s_om + rn[:, None]
            tl.store(o_ptrs, acc.to(out.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
        else:
            o_ptrs = out + rows * s_om + rn[None, :]
            tl.store(o_ptrs, _fma_sum(acc, ROWS).to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _add_rms_norm_rows_kernel(a, b, nw, summed, normed, K, s_am, s_bm, s_sm, s_nm, eps,
                              HAS_B: tl.constexpr, UNIT_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr,
                              ONE_STEP: tl.constexpr, MASK_K: tl.constexpr, USE_GDC: tl.constexpr):
    """Step 2, one row per program: summed = a + b (HAS_B) and normed = RMSNorm(summed or a), both
    in A. USE_GDC: launched with PDL (pdl.py): it waits before any load."""
    pdl_wait(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    one = tl.arange(0, 1) < 1  # the tile's one row, always there: the helpers take [rows, BK] tiles
    a_ptrs = a + row * s_am + rk[None, :]
    b_ptrs = b + row * s_bm + rk[None, :]
    s_ptrs = summed + row * s_sm + rk[None, :]
    n_ptrs = normed + row * s_nm + rk[None, :]
    if ONE_STEP:  # the row read once
        k_ok = rk < K
        s = _summed_rows(a_ptrs, b_ptrs, one, k_ok, HAS_B, False, MASK_K, "evict_first")
        if HAS_B:
            tl.store(s_ptrs, s, mask=k_ok[None, :])
        xn = _normed_rows(s, _inv_rms(_squares(s), K, eps), _load_vector(nw + rk, k_ok, MASK_K), UNIT_OFFSET)
        tl.store(n_ptrs, xn, mask=k_ok[None, :])
    else:
        inv_rms = _statistics(a_ptrs, b_ptrs, s_ptrs, one, rk, K, eps, True, 1, BLOCK_K, HAS_B, False, MASK_K)
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0
            s = _summed_rows(a_ptrs + k0, b_ptrs + k0, one, k_ok, HAS_B, False, MASK_K, "evict_first")
            xn = _normed_rows(s, inv_rms, _load_vector(nw + k0 + rk, k_ok, MASK_K), UNIT_OFFSET)
            tl.store(n_ptrs + k0, xn, mask=k_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _gemv_add_norm_kernel(x, w, res, nw, normed, summed, arrived, M, N, K, s_xm, s_wn, s_rm, s_nm, s_sm, eps,
                          UNIT_OFFSET: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, DOT: tl.constexpr, MASK_N: tl.constexpr, MASK_K: tl.constexpr,
                          ONE_STEP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                          NORM_BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """Step 3 of the module docstring: summed[:M, cols] = res + x @ w[cols]^T for this program's
    BLOCK_N columns (the GEMV's sums rounded to A, then the add rounded to A); the last program to
    finish (arrivals.py) normalises the M rows of summed into normed, NORM_BLOCK columns at a time,
    and zeroes the counter. USE_GDC: launched with PDL (pdl.py), the GEMV waiting as gemv.py's does."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, ROWS)
    m_ok = rm < M
    sums = gemv_sums(x, w, M, N, K, s_xm, s_wn, rn, n_ok, rm, m_ok, ROWS, BLOCK_N, BLOCK_K, DOT, MASK_N, MASK_K,
                     ONE_STEP, UPCAST, PRECISION, USE_GDC)
    if DOT:
        sums = tl.trans(sums)  # [ROWS, BN]
    act = summed.dtype.element_ty
    rows = rm.to(tl.int64)[:, None]
    tile = m_ok[:, None] & n_ok[None, :]
    r = tl.load(res + rows * s_rm + rn[None, :], mask=tile, other=0.0)
    s = (r.to(tl.float32) + sums.to(act).to(tl.float32)).to(act)  # the projection in A, then the add in A
    tl.store(summed + rows * s_sm + rn[None, :], s, mask=tile)
    if last_to_arrive(arrived, tl.num_programs(0)):
        cols = tl.arange(0, NORM_BLOCK)
        squares = tl.zeros([ROWS], dtype=tl.float32)
        for n0 in range(0, N, NORM_BLOCK):
            ok = m_ok[:, None] & (cols[None, :] < N - n0)
            # from L2 (.cg): arrivals.py says why
            row = tl.load(summed + rows * s_sm + n0 + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            squares += _squares(row)
        inv_rms = _inv_rms(squares, N, eps)
        for n0 in range(0, N, NORM_BLOCK):
            n_in = cols < N - n0
            ok = m_ok[:, None] & n_in[None, :]
            row = tl.load(summed + rows * s_sm + n0 + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            wn = tl.load(nw + n0 + cols, mask=n_in, other=0.0).to(tl.float32)
            tl.store(normed + rows * s_nm + n0 + cols[None, :], _normed_rows(row, inv_rms, wn, UNIT_OFFSET), mask=ok)
        tl.store(arrived, 0)


_NORM_GEMV = Launcher(_norm_gemv_kernel)  # decode's eager gaps repeat its arguments (launch_cache.py)
_ROWS = Launcher(_add_rms_norm_rows_kernel)
_GEMV_NORM = Launcher(_gemv_add_norm_kernel)


def _check(a: torch.Tensor, b: Optional[torch.Tensor], norm_weight: torch.Tensor,
           weight: Optional[torch.Tensor], what: str) -> None:
    """What the kernels take, or a one-line ValueError naming the argument at fault."""
    if a.dim() != 2 or (b is not None and b.shape != a.shape):
        raise ValueError(f"{what}: a must be [M, K] and b None or of a's shape, got a {tuple(a.shape)}"
                         + (f" and b {tuple(b.shape)}" if b is not None else ""))
    K = a.shape[1]
    if K == 0 or norm_weight.shape != (K,):
        raise ValueError(f"{what}: norm_weight must be [K] = [{K}] (K >= 1), got {tuple(norm_weight.shape)}")
    if weight is not None and (weight.dim() != 2 or weight.shape[1] != K or weight.shape[0] == 0):
        raise ValueError(f"{what}: weight must be [N, {K}] with N >= 1, got {tuple(weight.shape)}")
    if a.dtype not in _DTYPES or (b is not None and b.dtype != a.dtype) or \
            (weight is not None and weight.dtype != a.dtype) or not norm_weight.dtype.is_floating_point:
        raise ValueError(f"{what}: a, b and weight must share one of float32, float16, bfloat16 and norm_weight "
                         f"be a float; got a {a.dtype}, b {b.dtype if b is not None else None}, weight "
                         f"{weight.dtype if weight is not None else None}, norm_weight {norm_weight.dtype}")
    if a.shape[0] > MAX_ROWS and weight is not None:
        raise ValueError(f"{what}: a has M = {a.shape[0]} rows, past MAX_ROWS = {MAX_ROWS} (the caller runs the "
                         "row kernel and torch there)")
    for name, t in (("a", a), ("b", b), ("norm_weight", norm_weight), ("weight", weight)):
        if t is None:
            continue
        if t.device != a.device:
            raise ValueError(f"{what}: a on {a.device}, {name} on {t.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{what}: {name} {tuple(t.shape)} has strides {t.stride()}: its last dimension must "
                             "be contiguous")


def add_rms_norm_gemv(a: torch.Tensor, b: Optional[torch.Tensor], norm_weight: torch.Tensor, weight: torch.Tensor,
                      eps: float, unit_offset: bool, *,
                      config: Optional[GemvConfig] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out [M, N], summed [M, K] or None without b) in A, float32 sums: step 1 of the module
    docstring. M <= MAX_ROWS; a and b any row stride with a contiguous last dimension, weight
    row-major (nn.Linear's layout). `config` overrides norm_config_for (the tests)."""
    _check(a, b, norm_weight, weight, "add_rms_norm_gemv")
    M, K = a.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    summed = torch.empty(M, K, dtype=a.dtype, device=a.device) if b is not None else None
    if M == 0:
        return out, summed
    cfg = config or norm_config_for(N, K, M)
    other = b if b is not None else a  # never read without b (HAS_B False), nor is summed's stand-in written
    into = summed if summed is not None else out
    _NORM_GEMV[(cdiv(N, cfg.BLOCK_N),)](
        a, other, norm_weight, weight, out, into, M, N, K, a.stride(0), other.stride(0), weight.stride(0),
        out.stride(0), into.stride(0), float(eps), HAS_B=b is not None, UNIT_OFFSET=bool(unit_offset),
        **launch_constants(cfg, M, N, K, a.dtype), **launch_args(a.device))
    return out, summed


def add_rms_norm_rows(a: torch.Tensor, b: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                      unit_offset: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(normed [M, K], summed [M, K] or None without b) in A: step 2 of the module docstring, any M."""
    _check(a, b, norm_weight, None, "add_rms_norm_rows")
    M, K = a.shape
    normed = torch.empty(M, K, dtype=a.dtype, device=a.device)
    summed = torch.empty(M, K, dtype=a.dtype, device=a.device) if b is not None else None
    if M == 0:
        return normed, summed
    block = min(next_pow2(K), ROW_BLOCK_MAX)
    other = b if b is not None else a  # never read without b, nor is summed's stand-in written
    into = summed if summed is not None else normed
    _ROWS[(M,)](a, other, norm_weight, into, normed, K, a.stride(0), other.stride(0), into.stride(0),
                normed.stride(0), float(eps), HAS_B=b is not None, UNIT_OFFSET=bool(unit_offset), BLOCK_K=block,
                ONE_STEP=K <= block, MASK_K=K % block != 0, num_warps=4 if block <= 2048 else 8,
                **launch_args(a.device))
    return normed, summed


def gemv_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float, unit_offset: bool, *,
                      config: Optional[GemvConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed [M, N], summed [M, N]) in A: step 3 of the module docstring, summed = residual + x @
    weight^T, normed = RMSNorm(summed). M <= MAX_ROWS; x and residual any row stride with a
    contiguous last dimension, weight row-major. `config` overrides gemv.config_for (the tests)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or \
            tuple(residual.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"gemv_add_rms_norm: x must be [M, K], weight [N, K] and residual [M, N], got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}, residual {tuple(residual.shape)}")
    _check(residual, None, norm_weight, None, "gemv_add_rms_norm")  # the norm's row: the residual's
    M, K = x.shape
    N = weight.shape[0]
    if M > MAX_ROWS or x.dtype != residual.dtype or weight.dtype != x.dtype or weight.device != x.device or \
            residual.device != x.device or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv_add_rms_norm: x {tuple(x.shape)} {x.dtype} on {x.device} (strides {x.stride()}), "
                         f"weight {weight.dtype}, residual {residual.dtype}: at most {MAX_ROWS} rows, one dtype, "
                         "one device, contiguous last dimensions")
    normed = torch.empty(M, N, dtype=x.dtype, device=x.device)
    summed = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return normed, summed
    cfg = config or config_for(N, K, M)
    constants = launch_constants(cfg, M, N, K, x.dtype)
    arrived = arrival_counters(x.device, 1, "gemv_add_rms_norm")
    _GEMV_NORM[(cdiv(N, cfg.BLOCK_N),)](
        x, weight, residual, norm_weight, normed, summed, arrived, M, N, K, x.stride(0), weight.stride(0),
        residual.stride(0), normed.stride(0), summed.stride(0), float(eps), UNIT_OFFSET=bool(unit_offset),
        NORM_BLOCK=min(next_pow2(N), max(128, EPILOGUE_BLOCK // constants["ROWS"])), **constants,
        **launch_args(x.device))
    return normed, summed
