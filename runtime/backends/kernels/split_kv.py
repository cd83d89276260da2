"""Split-KV attention pieces shared by the Triton attention kernels (triton_gqa.py, triton_mla.py).

Both kernels split each query row's keys over several programs, keep an online softmax in
float32 and base 2 inside each split, and merge the splits afterwards. What they share lives here,
once: the online-softmax step of one key tile, a split's normalised result, which keys each split
walks and where a tile of them sits in the paged cache, the number of splits for a launch, and the
combine pass.

Two ways to cut a row's keys into splits (`split_chunks`, `split_layout`):

- the default: `num_splits` follows the launch's rows (num_splits_for: about two waves of
  programs; one for the GQA varlen kernel's prompt-sized steps) and each split takes one
  contiguous share of ceil(kv_len / num_splits) keys, rounded up to the key tile. Fastest, but the same row at the same position is summed in another order
  in a step of another batch size, and (GQA) in a verify step, whose shares follow the request's
  last row.
- fixed splits (`fixed_splits=True` of the kernels): a row's result depends only on its query,
  its keys and its position, not on the batch, the rows per request or the step's longest row, so
  a decode step and a verify step of any batch give a row the same bits. Each choice removes one
  of those dependences:
  * split boundaries at fixed key positions, chunks of SPLIT_TOKENS keys: a share of kv_len moves
    with the row's length (GQA: the length of the request's last row) and with the split count;
  * always MAX_SPLITS programs: a count from the launch's rows would group the chunks by batch;
  * program `split` walks chunks split, split + MAX_SPLITS, split + 2 * MAX_SPLITS, ... in order:
    which chunks one program sums, and in which order, follows from their positions alone, and a
    context longer than MAX_SPLITS chunks adds rounds without regrouping the earlier chunks;
  * the combine pass always merges MAX_SPLITS partials, the empty ones adding exact zeros;
  * the GQA kernel takes its largest row tile whatever the rows per request (triton_gqa.py).
  The price: a row of L keys keeps ceil(L / SPLIT_TOKENS) of its MAX_SPLITS programs busy (a short
  context at a small batch gets fewer busy programs than the default would give it), and the
  partial buffers hold MAX_SPLITS entries per row and head (an empty split writes its -inf only).

It does not: address the paged cache (each kernel finds its keys its own way) or store K/V rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, next_pow2
from runtime.backends.kernels.pdl import launch_args, pdl_wait

__all__ = ["LOG2E", "MAX_SPLITS", "SPLIT_TOKENS", "combine_chunk", "combine_splits", "num_splits_for", "paged_tile",
           "round_keys", "softmax_step", "split_chunks", "split_layout", "split_result"]

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * LOG2E)


@triton.jit
def softmax_step(m, l, s):
    """One key tile of an online softmax in base 2: running max m [M] and sum l [M], this tile's
    scaled scores s [M, N] (-inf where a row sees no key) -> (new max, rescale of the old
    accumulator, the tile's weights [M, N], new sum)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so its weights are
    # exp2(-inf) = 0 rather than NaN.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_sub)
    w = tl.exp2(s - m_sub[:, None])
    return m_new, alpha, w, l * alpha + tl.sum(w, 1)


@triton.jit
def split_result(acc, m, l):
    """A split's normalised output and base-2 log-sum-exp (-inf and zeros where it saw no key)."""
    has = l > 0
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    return acc / tl.where(has, l, 1.0)[:, None], lse


# The split count is a run-time argument of every kernel here, never a specialization: it follows
# a launch's row count (num_splits_for), and an eager step's rows are any number, so as a constexpr
# (or a specialized int) it would make kernels that no build saw, built in the middle of serving and
# missing from the artifact's bundle. One kernel serves every count up to MAX_SPLITS.
MAX_SPLITS = 32
# Fixed splits: keys per chunk. A multiple of every key tile (BLOCK_N: 32 or 64 by default), so
# every chunk is whole tiles; several tiles per chunk keep a program's loop long enough to hide its
# loads, and MAX_SPLITS chunks of 256 keys (8192 keys) spread a long context over every program of
# a row before a second round starts (split_chunks). A constant, not a choice per step: another
# chunk would be another sum.
SPLIT_TOKENS = 256
# Partial rows the combine pass merges at a time (`_combine_kernel`): its [CHUNK, Dv] float32 tile
# is what a program holds, where a [MAX_SPLITS, Dv] tile (64 values a thread at Dv 256) left an SM
# room for a few programs; an extend step's combine (2 splits) took 21.7 us of a bench qwen3_next
# GQA layer's 51 us at 512 tokens on an H200 (step accounts of 2026-12-04/05). A row of MAX_SPLITS
# partials is merged in one tile instead: its chunks are iterations one after another, each waiting
# on its own loads, and a one-request decode step has few programs, so the wait is the launch's
# time. One H200 (benchmarks/probes/combine_chunk_probe.py, bench qwen3_next's 16 heads of 256,
# combine_chunk_probe_h200_2026-12-06.json), us a launch at chunks of 4 / 8 / 16 / 32: one request
# of 32 splits 4.66 / 3.53 / 3.34 / 2.56; 128 rows of 2 splits 5.03 / 5.42 / 5.74 / 7.14; 512 and
# 4096 rows of 2 splits 15.6 / 16.4 / 17.4 / 23.0 and 115 / 125 / 131 / 180.
COMBINE_CHUNK = 4


def combine_chunk(num_splits: int) -> int:
    """Partials `_combine_kernel` merges at a time for rows of `num_splits`: MAX_SPLITS (one tile)
    past half of it, else COMBINE_CHUNK. Two builds of the kernel in all; fixed splits always
    merge MAX_SPLITS partials, so a row's sums there never depend on the batch."""
    return MAX_SPLITS if num_splits > MAX_SPLITS // 2 else COMBINE_CHUNK


@triton.jit
def split_chunks(kv_len, num_splits, SPLIT_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Which of a row's kv_len keys program `split` walks: (chunk width, rounds). Round c covers
    chunk split + c * num_splits, keys [chunk * width, (chunk + 1) * width) below kv_len; rounds
    run in order, one online softmax through them.

    SPLIT_TOKENS 0, the default mode: one round, the keys cut into num_splits shares rounded up to
    BLOCK_N (the share follows kv_len). Else fixed splits: chunks of SPLIT_TOKENS keys at fixed
    positions and as many rounds as kv_len needs, so which keys a program sums, and in which order,
    never depends on kv_len, only on the key positions (keys past a row's own position add exact
    zeros: see the kernels)."""
    if SPLIT_TOKENS == 0:
        width = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        rounds = 1
    else:
        width = SPLIT_TOKENS
        rounds = tl.cdiv(kv_len, SPLIT_TOKENS * num_splits)
    return width, rounds


@triton.jit
def round_keys(split, rnd, num_splits, width, kv_len):
    """Round `rnd` of program `split` (split_chunks): its chunk's keys [start, end), end capped at kv_len
    (start >= end: nothing to walk)."""
    start = (split + rnd * num_splits) * width
    return start, tl.minimum(start + width, kv_len)


@triton.jit
def paged_tile(page_row, n0, end, page_size, BLOCK_N: tl.constexpr):
    """Keys n0 .. n0 + BLOCK_N - 1 below `end` of a row whose pages `page_row` lists: (positions,
    their mask, page ids and offsets in the page, both int64 for the cache's strides)."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < end
    page = tl.load(page_row + n // page_size, mask=nmask, other=0).to(tl.int64)
    return n, nmask, page, (n % page_size).to(tl.int64)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(part_o, part_lse, out, s_o_t, s_o_h, num_heads, num_splits,
                    R: tl.constexpr, MAX_SPLITS: tl.constexpr, CHUNK: tl.constexpr, HEADS: tl.constexpr,
                    USE_GDC: tl.constexpr):
    """Program (t, j) merges row t's heads j * HEADS .. (j + 1) * HEADS - 1 (HEADS divides the
    heads), one after another in the same code: a head's bits do not depend on HEADS."""
    pdl_wait(USE_GDC)  # launched with PDL (pdl.py): the partials are the split pass's
    t = tl.program_id(0).to(tl.int64)
    for i in tl.static_range(HEADS):
        _combine_head(part_o, part_lse, out, t, tl.program_id(1) * HEADS + i, s_o_t, s_o_h, num_heads, num_splits,
                      R, MAX_SPLITS, CHUNK)


@triton.jit
def _combine_head(part_o, part_lse, out, t, h, s_o_t, s_o_h, num_heads, num_splits,
                  R: tl.constexpr, MAX_SPLITS: tl.constexpr, CHUNK: tl.constexpr):
    base = (t * num_heads + h) * num_splits
    sp = tl.arange(0, MAX_SPLITS)
    m = tl.max(tl.load(part_lse + base + sp, mask=sp < num_splits, other=float("-inf")), 0)
    r = tl.arange(0, R)
    acc = tl.zeros([R], dtype=tl.float32)
    total = tl.sum(tl.zeros([CHUNK], dtype=tl.float32), 0)
    # The partial rows CHUNK at a time, in split order: a [CHUNK, R] tile in registers rather than
    # one of MAX_SPLITS rows, most of them masked, whose registers held an SM to a few programs.
    for first in range(0, num_splits, CHUNK):
        c = first + tl.arange(0, CHUNK)
        used = c < num_splits
        lse = tl.load(part_lse + base + c, mask=used, other=float("-inf"))
        live = lse > float("-inf")
        w = tl.where(live, tl.exp2(tl.where(live, lse - m, 0.0)), 0.0)
        # A split that saw no key stored no output (the split kernels skip it): read as zeros, as an
        # unused lane is. Its weight is exactly 0 and 0 * 0 adds +0 to the sums, and the max ignores
        # its -inf, so a row's extra empty splits (and the chunks of nothing but them) leave its
        # result bit for bit as it was: what fixed splits rely on (always MAX_SPLITS partials, most
        # of them empty for a short row).
        o = tl.load(part_o + (base + c)[:, None] * R + r[None, :], mask=(used & live)[:, None], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        total += tl.sum(w, 0)
    res = acc / tl.maximum(total, 1e-30)
    tl.store(out + t * s_o_t + h * s_o_h + r, res.to(out.dtype.element_ty))


_COMBINE = Launcher(_combine_kernel)  # eager gaps repeat its arguments (launch_cache.py)


def num_splits_for(rows: int, head_blocks: int, num_sms: int, waves: int = 2) -> int:
    """Splits per (row, head block): enough programs for about `waves` waves, a power of two <= 32."""
    want = max(1, -(-waves * num_sms // max(rows * head_blocks, 1)))
    splits = 1
    while splits < want and splits < MAX_SPLITS:
        splits *= 2
    return splits


def split_layout(num_splits: int | None, fixed_splits: bool, split_tokens: int | None,
                 block_n: int) -> tuple[int | None, int]:
    """A launch's (split count, SPLIT_TOKENS constexpr of its split kernel), from the caller's
    arguments. Fixed splits: (MAX_SPLITS, SPLIT_TOKENS or the caller's split_tokens, a multiple of
    block_n). The default: (num_splits as given, or None for num_splits_for to choose; 0)."""
    if not fixed_splits:
        if split_tokens is not None:
            raise ValueError("split-KV attention: split_tokens sets the chunk of fixed splits; pass fixed_splits=True")
        return num_splits, 0
    if num_splits is not None:
        raise ValueError(f"split-KV attention: num_splits={num_splits} sets the default mode's split count; "
                         f"fixed splits always launch {MAX_SPLITS}")
    tokens = SPLIT_TOKENS if split_tokens is None else split_tokens
    if tokens <= 0 or tokens % block_n:
        raise ValueError(f"split-KV attention: chunks of {tokens} keys are not a positive multiple of the "
                         f"{block_n}-key tile")
    return MAX_SPLITS, tokens


# Floats of a combine program's [CHUNK, Dv] tile a warp holds: a program (a row and head) merges a
# few rows of Dv floats, and more warps only hold more of the SM for the same loads. On an H100, at
# bench qwen3_next's GQA layer (16 heads of 256), one warp took 6.44 against four warps' 15.40 us at
# 512 rows of 2 splits, 53.2 against 114.5 at 4096, 2.68 against 4.99 at a 128-request decode, and
# 2.41 against 2.39 at one request, whose 32 splits make the largest tile measured (32 x 256); more
# heads a program gained at most 2 us at 512 rows and lost up to 14 at one request
# (benchmarks/results/combine_launch_probe_h100_2026-12-06.json, combine_chunk_probe.py --launches).
# A larger tile (an MLA latent of 512 in one chunk of 32) gets a warp per this many floats.
COMBINE_TILE_PER_WARP = 32 * 256


def combine_warps(num_splits: int, dv: int) -> int:
    """Warps of the combine's programs for rows of `num_splits` partials of `dv` floats."""
    tile = combine_chunk(num_splits) * dv
    return min(8, next_pow2(cdiv(tile, COMBINE_TILE_PER_WARP)))


def combine_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """Merge the split pass's partial outputs: part_o [(row * H + head) * splits + split, Dv] float32
    and their base-2 log-sum-exp part_lse (-inf: the split saw no key, and its part_o row is not
    read) into out [rows, H, Dv] (unit last stride). A row and head whose splits all saw no key
    gets zeros. A program a row and head, on `combine_warps` warps (benchmarks/probes/
    combine_chunk_probe.py --launches weighs other launches, several heads a program among them)."""
    T, H, DV = out.shape
    assert out.stride(-1) == 1
    assert 1 <= num_splits <= MAX_SPLITS, f"split-KV attention: {num_splits} splits (1 to {MAX_SPLITS})"
    _COMBINE[(T, H)](part_o, part_lse, out, out.stride(0), out.stride(1), H, num_splits,
                     R=DV, MAX_SPLITS=MAX_SPLITS, CHUNK=combine_chunk(num_splits), HEADS=1,
                     num_warps=combine_warps(num_splits, DV), **launch_args(out.device))
