"""x @ weight.T for 17 to 128 rows with K split over several programs: decode's projections of a
batch of requests.

At 128 decoding requests a projection still reads each weight once for little arithmetic (128
products a weight element), so its time is the weight's bytes over the copy rate; cuBLAS ran bench
qwen3_next's output projections ([128, 4096] x [4096 -> 2048]) in a 64x32 tile, one program an SM
each streaming 768 KB of x and weight, at 36% of an H200's copy rate (11.2 us for 16.8 MB; the
step account of 2026-12-06). Splitting K gives each output tile SPLIT programs, each streaming a
share, so an SM holds several and keeps more bytes in flight.

One call (x [M, K], weight [N, K] in nn.Linear's layout, MIN_ROWS <= M <= MAX_ROWS):

1. The config comes from CONFIGS, keyed by (N, K, M bucket) with M's bucket the power of two >= M.
   It holds only shapes measured faster than cuBLAS (benchmarks/probes/split_k_probe.py prints the
   entries a run would add); none is listed yet, so the glue takes this kernel for no shape until a
   GPU run says where it wins.
2. One program per (BLOCK_N columns, split, BLOCK_M rows): it walks its split's share of K, BLOCK_K
   at a time, with tensor-core dots of x [BLOCK_M, BLOCK_K] and weight [BLOCK_N, BLOCK_K]^T, and
   stores its float32 partial tile; the last of a tile's programs to finish (a counter per tile,
   runtime/backends/kernels/arrivals.py) sums the partials in split order and stores the tile,
   rounded once to x's dtype: one launch, and a row's sums run in one order whichever program
   finishes last, so two calls give the same bits. SPLIT 1 stores the rounded product directly.

CPU reference: x.float() @ weight.float().T. Not done here: bias, other dtypes than the glue's, batch
invariance across M buckets (a bucket's config sets its order of sums; batch-invariant artifacts
never call the glue's projection op).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.arrivals import arrival_counters, last_to_arrive
from runtime.backends.kernels.launch_math import cdiv, next_pow2, triton_interpreted

__all__ = ["CONFIGS", "MAX_ROWS", "MIN_ROWS", "SplitKConfig", "row_bucket", "split_k_linear"]

MIN_ROWS = 17  # fewer rows take the one-launch GEMV (gemv.py MAX_ROWS) or torch
MAX_ROWS = 128  # past this a projection is a GEMM with enough tiles of its own


@dataclasses.dataclass(frozen=True)
class SplitKConfig:
    """One launch config: tiles (powers of two, at least 16: a dot's smallest side) and SPLIT, the
    programs that share one output tile's K."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT: int
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        tiles = (self.BLOCK_M, self.BLOCK_N, self.BLOCK_K)
        if not (all(t >= 16 and t & (t - 1) == 0 for t in tiles) and self.SPLIT >= 1 and self.num_stages >= 1
                and self.num_warps >= 1 and self.num_warps & (self.num_warps - 1) == 0):
            raise ValueError(f"bad split-K config {self}: tiles are powers of two >= 16, SPLIT >= 1, "
                             "num_warps a power of two")


# (N, K, M bucket) -> config: only shapes a GPU run measured faster than cuBLAS (none yet).
CONFIGS: dict[tuple[int, int, int], SplitKConfig] = {}


def row_bucket(M: int) -> int:
    """The power of two >= M that keys CONFIGS."""
    return next_pow2(M)


@triton.jit(do_not_specialize=["M"])
def _split_k_kernel(x_ptr, w_ptr, out_ptr, part_ptr, arrived_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr,
                    SPLITS: tl.constexpr, STAGES: tl.constexpr, DOT_FP32: tl.constexpr):
    """out[m, n] = sum over k of x[m, k] * w[n, k], rounded once to out's dtype. Program (n, s, m)
    sums split s of K for its tile; with SPLITS > 1 it stores that float32 partial tile in part
    [SPLITS, M, N], and the last of the tile's SPLITS programs to finish (arrivals.py) sums the
    partials in split order, stores the tile and zeroes its counter. M is not specialised on: every
    row count of a bucket launches the kernel the bundle built."""
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k0 = pid_s * K_SPLIT
    for k in tl.range(k0, k0 + K_SPLIT, BLOCK_K, num_stages=STAGES):
        kk = k + offs_k
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & (kk[None, :] < K),
                    other=0.0)
        if DOT_FP32:  # the interpreter (launch_math.triton_interpreted says why)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc)
    tile_mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLITS == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)
    else:
        cell = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]  # [M, N] contiguous partial tiles
        tl.store(part_ptr + pid_s * M * N + cell, acc, mask=tile_mask)
        counter = arrived_ptr + pid_m * tl.num_programs(0) + pid_n
        if last_to_arrive(counter, SPLITS):
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(SPLITS):  # split order, whichever program came last
                total += tl.load(part_ptr + j * M * N + cell, mask=tile_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=tile_mask)
            tl.store(counter, 0)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, config: SplitKConfig) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype (contiguous), by `config` (step 2)."""
    M, K = x.shape
    N = weight.shape[0]
    assert weight.shape[1] == K and x.stride(1) == 1 and weight.stride(1) == 1, (
        f"split_k_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} need a shared K of unit stride")
    cfg = config
    k_split = cdiv(cdiv(K, cfg.SPLIT), cfg.BLOCK_K) * cfg.BLOCK_K  # each split's share, whole BLOCK_Ks
    splits = cdiv(K, k_split)  # a share past K would sum nothing
    grid = (cdiv(N, cfg.BLOCK_N), splits, cdiv(M, cfg.BLOCK_M))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if splits == 1:  # no partials, no counters: any valid pointer stands in
        part, arrived = out, out
    else:
        part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
        arrived = arrival_counters(x.device, grid[0] * grid[2], "split_k")
    _split_k_kernel[grid](x, weight, out, part, arrived, M, N, K, x.stride(0), weight.stride(0), out.stride(0),
                          BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, K_SPLIT=k_split,
                          SPLITS=splits, STAGES=cfg.num_stages, DOT_FP32=triton_interpreted(),
                          num_warps=cfg.num_warps)
    return out
