"""x @ weight.T for a few rows in one Triton launch: decode's projections.

At batch-1 decode a projection is a matrix-vector product: a step reads each weight once and does
two flops per weight element, so its time is the weight's bytes over the memory's rate. cuBLAS runs
these as a tiled GEMM (an input projection) or as split-K, a partial-sum kernel and a reduction
kernel (an output projection, K 4096). `small_m_linear` runs each as one launch that streams the
weight once, with no second kernel and no atomics: a row's sum over K is taken in one fixed order,
so two calls give the same bits.

One call (x [M, K], weight [N, K] in nn.Linear's layout, M <= MAX_ROWS):

1. The launch config comes from CONFIGS, keyed by (N, K, M bucket) with M's bucket the power of two
   >= M; a shape missing from it takes `default_config`. benchmarks/kernels/gemv_bench.py times
   candidate configs against cuBLAS and prints the entries it would choose.
2. One program per BLOCK_N output columns: it owns those columns for all M rows (padded to the
   bucket, rows past M masked) and walks K from 0, BLOCK_K at a time, reading its BLOCK_N weight
   rows once and x's rows (small, from the cache) with them. Two ways to multiply, per config:
   - FMA (DOT False): float32 products accumulated element-wise in a [rows, BLOCK_N, BLOCK_K] tile
     ([BLOCK_N, BLOCK_K] for one row), summed over BLOCK_K once after the loop. Its loads feed no
     dot, so Triton does not software-pipeline them: bytes stay in flight through many narrow
     programs and a BLOCK_K close to K (a reduction of one step runs with no loop, ONE_STEP).
   - DOT: tensor cores on weight [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, rows], rows padded to 16 (a
     dot's smallest side): the weight is the dot's wide operand, so a tile of 16 columns or more
     suits M from 1 up, and its loads are pipelined over num_stages.
3. The float32 sums are rounded once to x's dtype and stored to `out` [M, N] (any row stride).

CPU reference: x.float() @ weight.float().T (the tests and the bench compare with it).
Not done here: bias, M > MAX_ROWS (the caller uses torch: tiles of 16 rows and more are GEMMs,
cuBLAS's ground), other dtypes (integers, float8: a ValueError), batch invariance across M buckets
(a row's bits may change with the bucket's config; matmul.py is the batch-invariant product).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, next_pow2, triton_interpreted
from runtime.backends.kernels.pdl import launch_args, pdl_wait

__all__ = ["CONFIGS", "GemvConfig", "MAX_ROWS", "config_for", "default_config", "row_bucket", "small_m_linear"]

MAX_ROWS = 16  # the largest M taken: past it the caller runs torch
DOT_ROWS = 16  # a dot's smallest side: the DOT path pads its rows to it
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# float32 accumulator elements a thread may hold in the FMA path (rows x BLOCK_N x BLOCK_K over the
# program's threads): past about 64 registers of it the kernel spills.
_FMA_ACC_PER_THREAD = 64


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """One launch config. BLOCK_N and BLOCK_K powers of two; DOT takes tensor cores (BLOCK_N,
    BLOCK_K >= 16), else element-wise float32 products."""

    BLOCK_N: int
    BLOCK_K: int
    num_warps: int = 4
    num_stages: int = 1
    DOT: bool = False

    def __post_init__(self):
        def pow2(v):
            return v >= 1 and v & (v - 1) == 0
        ok = (pow2(self.BLOCK_N) and pow2(self.BLOCK_K) and pow2(self.num_warps) and self.num_stages >= 1
              and (not self.DOT or (self.BLOCK_N >= 16 and self.BLOCK_K >= 16)))
        if not ok:
            raise ValueError(f"bad GEMV config {self}: BLOCK_N, BLOCK_K and num_warps are powers of two, "
                             "num_stages >= 1, and a DOT config has BLOCK_N and BLOCK_K >= 16")

    def fma_fits(self, rows: int) -> bool:
        """Whether the FMA path's accumulator for `rows` (the bucket) stays in registers."""
        return rows * self.BLOCK_N * self.BLOCK_K <= _FMA_ACC_PER_THREAD * 32 * self.num_warps


# (N, K, M bucket) -> config, from a GPU run of benchmarks/kernels/gemv_bench.py, which prints these
# entries: the best config of each shape and bucket where it beat cuBLAS by 5% or more. bench
# qwen3_next's projections on an H200, bf16, 2026-12-03 (benchmarks/results/gemv_bench_h200_2026-12-03.md):
# the output projections (2048 x 4096) 1.58x / 1.10x cuBLAS at 1 / 2 rows (0.95x at 4 and 8: not
# here), the GQA q|k|v (9216 x 2048) 1.14x at 1 row (1.02-1.03x past it: not here), the GDN input
# projection (12352 x 2048) 1.12-1.21x and the logits head 1.06-1.08x at 1 to 8 rows.
CONFIGS: dict[tuple[int, int, int], GemvConfig] = {
    (2048, 4096, 1): GemvConfig(BLOCK_N=2, BLOCK_K=4096, num_warps=4, num_stages=1, DOT=False),
    (2048, 4096, 2): GemvConfig(BLOCK_N=4, BLOCK_K=1024, num_warps=8, num_stages=1, DOT=False),
    (9216, 2048, 1): GemvConfig(BLOCK_N=1, BLOCK_K=2048, num_warps=4, num_stages=1, DOT=False),
    (12352, 2048, 1): GemvConfig(BLOCK_N=1, BLOCK_K=2048, num_warps=4, num_stages=1, DOT=False),
    (12352, 2048, 2): GemvConfig(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOT=True),
    (12352, 2048, 4): GemvConfig(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOT=True),
    (12352, 2048, 8): GemvConfig(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOT=True),
    (151936, 2048, 1): GemvConfig(BLOCK_N=1, BLOCK_K=2048, num_warps=4, num_stages=1, DOT=False),
    (151936, 2048, 2): GemvConfig(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOT=True),
    (151936, 2048, 4): GemvConfig(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOT=True),
    (151936, 2048, 8): GemvConfig(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4, DOT=True),
}


def row_bucket(M: int) -> int:
    """The power of two >= M that keys CONFIGS and sizes the kernel's row tile."""
    return next_pow2(M)


def default_config(N: int, K: int, rows: int) -> GemvConfig:
    """The config of a shape CONFIGS lacks; a guess, not a measurement.

    Up to 2 rows, FMA: narrow column tiles (4 columns for 1 row, 2 for 2) that read up to 2048 of
    K per step (a reduction of K <= 2048 in one step), 4 warps: many programs, each with its whole
    share of the weight in flight at once (the MoE token path's GEMVs, runtime/backends/kernels/
    moe_config.py, won with the same shape on an H200). From 4 rows, DOT: 16 columns x 256 of K, 4
    stages, so the row tile's float32 products do not outgrow the registers.
    """
    if rows <= 2:
        block_k = min(next_pow2(K), 2048)
        block_n = max(1, min(4 // rows, _FMA_ACC_PER_THREAD * 128 // (rows * block_k)))
        return GemvConfig(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=1)
    return GemvConfig(BLOCK_N=16, BLOCK_K=min(256, max(16, next_pow2(K))), num_warps=4, num_stages=4, DOT=True)


def config_for(N: int, K: int, M: int) -> GemvConfig:
    """CONFIGS' entry for (N, K, M's bucket), else default_config."""
    rows = row_bucket(M)
    return CONFIGS.get((N, K, rows)) or default_config(N, K, rows)


@triton.jit
def _load_tile(ptrs, row_ok, k_ok, ROW_MASK: tl.constexpr, K_MASK: tl.constexpr, POLICY: tl.constexpr):
    """A [rows, BLOCK_K] tile; masked only where the rows or K do not fill it (unmasked loads vectorize freely)."""
    if ROW_MASK:
        if K_MASK:
            tile = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy=POLICY)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0, eviction_policy=POLICY)
    else:
        if K_MASK:
            tile = tl.load(ptrs, mask=k_ok[None, :], other=0.0, eviction_policy=POLICY)
        else:
            tile = tl.load(ptrs, eviction_policy=POLICY)
    return tile


@triton.jit
def _fma_products(wt, xt, ROWS: tl.constexpr):
    """Element-wise float32 products of a weight tile [BN, BK] and x's rows [ROWS, BK]: [ROWS, BN, BK],
    or [BN, BK] for one row (a 2-D tile: the batch-1 case needs no third dimension)."""
    if ROWS == 1:
        prod = wt.to(tl.float32) * xt.to(tl.float32)  # xt [1, BK] broadcast over the columns
    else:
        prod = xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]
    return prod


@triton.jit
def _fma_sum(prod, ROWS: tl.constexpr):
    """The products summed over BLOCK_K: [ROWS, BN]."""
    if ROWS == 1:
        total = tl.sum(prod, axis=1)[None, :]
    else:
        total = tl.sum(prod, axis=2)
    return total


@triton.jit
def gemv_sums(x, w, M, N, K, s_xm, s_wn, rn, n_ok, rm, m_ok,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
              MASK_N: tl.constexpr, MASK_K: tl.constexpr, ONE_STEP: tl.constexpr, UPCAST: tl.constexpr,
              PRECISION: tl.constexpr, USE_GDC: tl.constexpr):
    """The float32 sums x[rows] @ w[cols]^T of one program's columns rn (rows rm): [BLOCK_N, ROWS]
    where DOT, else [ROWS, BLOCK_N] (`store_sums` stores either). With USE_GDC the one-step FMA path
    reads its weight tile before the PDL wait, the others wait before their loop."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w + rn.to(tl.int64)[:, None] * s_wn + rk[None, :]  # [BN, BK]; 64-bit: weights past 2**31 elements
    x_ptrs = x + rm.to(tl.int64)[:, None] * s_xm + rk[None, :]  # [ROWS, BK]
    if DOT:
        pdl_wait(USE_GDC)
        acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # from 0, BLOCK_K at a time: one order, every call
            k_ok = rk < K - k0
            wt = _load_tile(w_ptrs, n_ok, k_ok, MASK_N, MASK_K, "evict_first")
            xt = _load_tile(x_ptrs, m_ok, k_ok, True, MASK_K, "evict_last")
            if UPCAST:  # the interpreter's 16-bit dots are wrong (launch_math.triton_interpreted); float32 is exact
                wt = wt.to(tl.float32)
                xt = xt.to(tl.float32)
            acc = tl.dot(wt, tl.trans(xt), acc, input_precision=PRECISION)  # [BN, ROWS]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        total = acc
    else:
        if ONE_STEP:  # K <= BLOCK_K: straight-line code, every load issued before the first product
            k_ok = rk < K
            wt = _load_tile(w_ptrs, n_ok, k_ok, MASK_N, MASK_K, "evict_first")
            # the weight streams in while the previous kernel drains; x is that kernel's output
            pdl_wait(USE_GDC)
            xt = _load_tile(x_ptrs, m_ok, k_ok, True, MASK_K, "evict_last")
            total = _fma_sum(_fma_products(wt, xt, ROWS), ROWS)
        else:
            pdl_wait(USE_GDC)
            if ROWS == 1:
                acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            else:
                acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = rk < K - k0
                wt = _load_tile(w_ptrs, n_ok, k_ok, MASK_N, MASK_K, "evict_first")
                xt = _load_tile(x_ptrs, m_ok, k_ok, True, MASK_K, "evict_last")
                acc += _fma_products(wt, xt, ROWS)
                w_ptrs += BLOCK_K
                x_ptrs += BLOCK_K
            total = _fma_sum(acc, ROWS)  # over BLOCK_K once, after the loop
    return total


@triton.jit
def store_sums(out, s_om, sums, rn, n_ok, rm, m_ok, DOT: tl.constexpr):
    """`gemv_sums`' result rounded to out's dtype at out[rm, rn] (any row stride)."""
    if DOT:
        o_ptrs = out + rm.to(tl.int64)[None, :] * s_om + rn[:, None]
        tl.store(o_ptrs, sums.to(out.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])
    else:
        o_ptrs = out + rm.to(tl.int64)[:, None] * s_om + rn[None, :]
        tl.store(o_ptrs, sums.to(out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x, w, out, M, N, K, s_xm, s_wn, s_om,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
                 MASK_N: tl.constexpr, MASK_K: tl.constexpr, ONE_STEP: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, USE_GDC: tl.constexpr):
    """out[:M, cols] = x[:M] @ w[cols]^T for this program's BLOCK_N columns; ROWS >= M rows in the tile.
    MASK_N / MASK_K: N or K does not fill its last tile. USE_GDC: launched with PDL (pdl.py), as
    `gemv_sums` waits."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, ROWS)
    m_ok = rm < M
    sums = gemv_sums(x, w, M, N, K, s_xm, s_wn, rn, n_ok, rm, m_ok, ROWS, BLOCK_N, BLOCK_K, DOT, MASK_N, MASK_K,
                     ONE_STEP, UPCAST, PRECISION, USE_GDC)
    store_sums(out, s_om, sums, rn, n_ok, rm, m_ok, DOT)


_GEMV = Launcher(_gemv_kernel)  # decode's eager gaps repeat its arguments (launch_cache.py)


def launch_constants(cfg: GemvConfig, M: int, N: int, K: int, dtype: torch.dtype) -> dict:
    """The constexprs and launch options of a GEMV call of M rows (`gemv_sums`' tile, masks, the
    interpreter's upcast and the dots' precision, the config's warps and stages): the plain GEMV's
    launches and norm_gemv.py's take the same."""
    upcast = triton_interpreted() and dtype != torch.float32
    # float32: no TF32 (torch's default for matmuls, allow_tf32 False); 16-bit operands ignore it.
    precision = "ieee" if dtype == torch.float32 or upcast else "tf32"
    return dict(ROWS=max(row_bucket(M), DOT_ROWS) if cfg.DOT else row_bucket(M), BLOCK_N=cfg.BLOCK_N,
                BLOCK_K=cfg.BLOCK_K, DOT=cfg.DOT, MASK_N=N % cfg.BLOCK_N != 0, MASK_K=K % cfg.BLOCK_K != 0,
                ONE_STEP=K <= cfg.BLOCK_K, UPCAST=upcast, PRECISION=precision, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def _check(x: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor]) -> None:
    """What the kernel takes, or a one-line ValueError naming the argument at fault."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"small_m_linear: x must be [M, K] and weight [N, K], got x {tuple(x.shape)} "
                         f"and weight {tuple(weight.shape)}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"small_m_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} disagree on K "
                         f"({x.shape[1]} vs {weight.shape[1]})")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"small_m_linear: x has M = {x.shape[0]} rows, past MAX_ROWS = {MAX_ROWS} "
                         "(the caller runs torch there)")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"small_m_linear: x is {x.dtype} and weight {weight.dtype}: both must be one of "
                         "float32, float16, bfloat16")
    if weight.device != x.device:
        raise ValueError(f"small_m_linear: x on {x.device}, weight on {weight.device}")
    for name, t in (("x", x), ("weight", weight)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"small_m_linear: {name} {tuple(t.shape)} has strides {t.stride()}: its last "
                             "dimension must be contiguous")
    if out is not None:
        shape = (x.shape[0], weight.shape[0])
        if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
            raise ValueError(f"small_m_linear: out is {tuple(out.shape)} {out.dtype} on {out.device}, "
                             f"the product {shape} {x.dtype} on {x.device}")
        if out.shape[1] > 1 and out.stride(1) != 1:
            raise ValueError(f"small_m_linear: out has strides {out.stride()}: its last dimension must be contiguous")


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                   config: Optional[GemvConfig] = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (into `out` when given), float32 sums.

    M <= MAX_ROWS; x and out any row stride with a contiguous last dimension, weight row-major
    (nn.Linear's layout). `config` overrides the table (the bench's sweep, the tests)."""
    _check(x, weight, out)
    M, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:  # no product: the kernel's K loop would not run either
        return out.zero_()
    cfg = config or config_for(N, K, M)
    _GEMV[(cdiv(N, cfg.BLOCK_N),)](x, weight, out, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
                                   **launch_constants(cfg, M, N, K, x.dtype), **launch_args(x.device))
    return out
