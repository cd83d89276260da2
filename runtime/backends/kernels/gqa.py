"""Triton paged GQA attention addressed by the page table: decode and target_verify steps, and
extend and mixed steps (requests of different lengths).

The decode and target_verify kernel of `FlashInferAttentionBackend(decode_impl="triton")`, and its
extend and mixed kernel with `extend_impl="triton"`. It reads the step's `page_table` [B, width] and
`seq_lens` [B] (and, for requests of different lengths, `query_start_loc` [B+1]; int32, on the
device) as they are: no page lists, no indptr, no host-built array, no plan. That is what lets a
captured graph replay it with nothing done on the host but filling the step's buffers.

Steps it serves: every request has the same n query rows (decode: n = 1; target_verify: n = D + 1
for D drafts). Row t belongs to request t // n, sits at position seq_lens[req] - n + t % n and sees
keys 0..that position (causal). A padding request (seq_lens 0) or a row whose position is
negative sees no key and gets a zero output.

1. Split pass, grid (requests, kv heads x row blocks, splits): one program takes the query rows of
   one kv head for one request (its n rows times the group's query heads, padded to >= 16 rows
   for tl.dot) and its split of the request's keys (one contiguous share; with fixed splits,
   chunks of SPLIT_TOKENS keys at fixed positions), walks it BLOCK_N tokens at a time through the
   page table, and keeps an online softmax in float32 (base 2). It writes its normalised partial
   output and its log-sum-exp. The n rows of a request share every key tile, so a verify step
   reads its cache once, not n times.
2. Combine pass (triton_split_kv.combine_splits): merges the splits by their log-sum-exp.

The number of splits depends only on the number of requests and heads (fixed splits: always
MAX_SPLITS), so a captured graph replays one launch for any context length. With
`fixed_splits=True` a row's output does not depend on the batch or on n: a verify row at position
p gets the bits a decode step at p gives it (triton_split_kv.py says how).

Requests of different lengths (`triton_gqa_attention_varlen`, a kernel of its own beside the
uniform one, sharing split_kv.py's helpers, so the uniform path stays as it was bit for bit):
request b owns rows query_start_loc[b] .. query_start_loc[b+1] - 1, as build_step and the graph
staging lay them out (a padded request owns none), and its row r sits at position
seq_lens[b] - q_len_b + r, seeing keys 0..that position (causal; the cache already holds this
step's keys). The grid is (B + 1 requests, kv heads x row blocks, splits), the row blocks sized
for the most rows a request can own (`max_rows`: a captured bucket's token count, or an eager
step's longest request), so a captured bucket launches one fixed grid: a program past its
request's rows returns at once. The one request more owns the padding rows past
query_start_loc[B], which see no key and get zeros. A row block walks keys only up to its last
row's position; the splits follow the launch's rows (or are fixed, as above).

It does not: store this step's K/V rows (the backend's store kernel does, before) or zero padding
rows beyond the launched requests of a uniform step (the backend does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, next_pow2
from runtime.backends.kernels.pdl import launch_args, pdl_wait
from runtime.backends.kernels.sm_count import num_sms
from runtime.backends.kernels.split_kv import (LOG2E, combine_splits, num_splits_for, paged_tile, round_keys,
                                              softmax_step, split_chunks, split_layout, split_result)

__all__ = ["triton_gqa_attention", "triton_gqa_attention_varlen", "gqa_head_dim_refusal"]

_MAX_BLOCK_M = 64  # query rows per program: a larger n x group is split over several programs
# The varlen kernel's launch. A [64, 256] float32 accumulator over 4 warps is 128 registers a
# thread before the query tile and the key and value tiles (bench qwen3_next's head dim 256), but no
# other launch was faster at every step size on an H100 (gqa_extend_sweep.py --tiles: 13.7 against
# 17.5 us at 128 tokens on 8 warps, 37.8 against 41.1 at 512 on 128 rows and 8 warps, within 1 us at
# 256 and 4 x 128; benchmarks/results/gqa_extend_sweep_tiles_h100_2026-12-06.json).
VARLEN_WARPS = 4
VARLEN_STAGES = 2


def gqa_head_dim_refusal(head_dim: int) -> str | None:
    """Why the kernel cannot take this head dim, or None (it tiles a head whole: tl.arange and tl.dot)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the Triton GQA kernel takes head dims that are powers of two >= 16, not {head_dim}"
    return None


@triton.jit
def _attend_split(q, k_cache, v_cache, pages, part_o, part_lse, row, head, live, pos, kv_len, kvh, split,
                  s_q_t, s_q_h, s_k_page, s_k_tok, s_k_head, s_v_page, s_v_tok, s_v_head,
                  num_q_heads, page_size, scale_log2, num_splits,
                  D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLIT_TOKENS: tl.constexpr, PRECISION: tl.constexpr):
    """One program's tile of query rows (row, head; live where real) over its split of the first
    kv_len keys of its request's pages, each row seeing keys 0..pos: the partial output and
    log-sum-exp of that split (both kernels below). A row whose position is before a tile scores
    it -inf: its max stays, alpha = exp2(0) = 1, its weights are 0 and add exact zeros, so tiles
    past a row's position leave its sums bit for bit as a decode step at its position leaves them."""
    width, rounds = split_chunks(kv_len, num_splits, SPLIT_TOKENS, BLOCK_N)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    qt = tl.load(q + row[:, None] * s_q_t + head[:, None] * s_q_h + d[None, :], mask=live[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    for rnd in range(0, rounds):
        start, end = round_keys(split, rnd, num_splits, width, kv_len)
        for n0 in range(start, end, BLOCK_N):
            n, nmask, page, off = paged_tile(pages, n0, end, page_size, BLOCK_N)
            kt = tl.load(k_cache + page[:, None] * s_k_page + off[:, None] * s_k_tok + kvh * s_k_head + d[None, :],
                         mask=nmask[:, None], other=0.0)
            s = tl.dot(qt, tl.trans(kt), input_precision=PRECISION)
            sees = nmask[None, :] & (n[None, :] <= pos[:, None]) & live[:, None]
            s = tl.where(sees, s * scale_log2, float("-inf"))  # a row before this tile: all -inf
            m, alpha, w, l = softmax_step(m, l, s)
            vt = tl.load(v_cache + page[:, None] * s_v_page + off[:, None] * s_v_tok + kvh * s_v_head + dv[None, :],
                         mask=nmask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(w.to(vt.dtype), vt, input_precision=PRECISION)

    o, lse = split_result(acc, m, l)
    idx = (row * num_q_heads + head) * num_splits + split
    # A split that saw no key stores its -inf alone: the combine pass reads no output for it.
    tl.store(part_o + idx[:, None] * DV + dv[None, :], o, mask=(live & (lse > float("-inf")))[:, None])
    tl.store(part_lse + idx, lse, mask=live)


# s_pt (the page table's width follows the longest request allowed) and num_splits (the
# launch's rows) are never specialized: see triton_split_kv.MAX_SPLITS.
@triton.jit(do_not_specialize=["s_pt", "num_splits"])
def _gqa_split_kernel(q, k_cache, v_cache, page_table, seq_lens, part_o, part_lse,
                      s_q_t, s_q_h, s_k_page, s_k_tok, s_k_head, s_v_page, s_v_tok, s_v_head, s_pt,
                      rows_per_req, num_q_heads, page_size, scale_log2, num_splits,
                      GROUP: tl.constexpr, ROW_BLOCKS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
                      PRECISION: tl.constexpr, USE_GDC: tl.constexpr):
    # SPLIT_TOKENS: 0, the default shares; else fixed splits (triton_split_kv.split_chunks).
    # USE_GDC: launched with PDL (pdl.py); the query, the cache and the tables are the step's: it waits first.
    pdl_wait(USE_GDC)
    req = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1) // ROW_BLOCKS
    block = tl.program_id(1) % ROW_BLOCKS
    split = tl.program_id(2)

    # Tile row m: row m // GROUP of the request, query head kvh * GROUP + m % GROUP.
    m_idx = block * BLOCK_M + tl.arange(0, BLOCK_M)
    r = m_idx // GROUP
    live = r < rows_per_req
    head = kvh * GROUP + m_idx % GROUP
    row = req * rows_per_req + r
    seq_len = tl.load(seq_lens + req)
    pos = seq_len - rows_per_req + r  # keys 0..pos; negative (padding): none
    kv_len = tl.maximum(seq_len, 0)  # the request's last row sees them all
    # The n rows share kv_len, their last row's: an earlier row walks tiles past its own position.
    _attend_split(q, k_cache, v_cache, page_table + req * s_pt, part_o, part_lse, row, head, live, pos, kv_len,
                  kvh, split, s_q_t, s_q_h, s_k_page, s_k_tok, s_k_head, s_v_page, s_v_tok, s_v_head,
                  num_q_heads, page_size, scale_log2, num_splits,
                  D, DV, BLOCK_M, BLOCK_N, SPLIT_TOKENS, PRECISION)


_GQA_SPLIT = Launcher(_gqa_split_kernel)  # eager gaps repeat its arguments (launch_cache.py)


def triton_gqa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         seq_lens: torch.Tensor, rows_per_req: int, out: torch.Tensor, scale: float,
                         num_splits: int | None = None, block_n: int | None = None, fixed_splits: bool = False,
                         split_tokens: int | None = None) -> None:
    """q [B*n, Hq, D]; k_cache [pages, page_size, Hkv, D] and v_cache [.., Hkv, Dv] (the pool's NHD
    layout, unit last stride); page_table [B, width] and seq_lens [B] int32 on q's device; out
    [B*n, Hq, Dv] written in place (any row and head strides, unit last stride). n = rows_per_req.

    num_splits: the default mode's split count (None: num_splits_for chooses from the requests).
    fixed_splits: a row's output the same bits in a decode step of any batch and in a verify step
    (triton_split_kv's module docstring); split_tokens: its chunk (None: SPLIT_TOKENS; tests pass
    smaller ones). Not with num_splits."""
    T, Hq, D = q.shape
    Hkv, DV = k_cache.shape[2], v_cache.shape[3]
    if T == 0:
        return
    for dim in (D, DV):
        why = gqa_head_dim_refusal(dim)
        if why is not None:
            raise ValueError(why)
    if Hq % Hkv:
        raise ValueError(f"triton GQA: {Hq} query heads are not a multiple of {Hkv} kv heads")
    B = page_table.shape[0]
    if T != B * rows_per_req or seq_lens.shape[0] < B:
        raise ValueError(f"triton GQA: {T} query rows for {B} requests of {rows_per_req} rows "
                         f"({seq_lens.shape[0]} sequence lengths)")
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and out.stride(-1) == 1
    assert page_table.dtype == torch.int32 and seq_lens.dtype == torch.int32
    group = Hq // Hkv
    tile_rows = rows_per_req * group
    if block_n is None:
        block_n = 64 if max(D, DV) <= 64 else 32
    num_splits, split_tokens = split_layout(num_splits, fixed_splits, split_tokens, block_n)
    # Fixed splits take the largest tile whatever n is: a decode row (n = 1) and a verify row
    # (n = D + 1) then go through the same tensor-core tiles (shape and instructions), only at
    # another row of them; the default mode takes the smallest tile that holds the n x group rows.
    block_m = _MAX_BLOCK_M if fixed_splits else min(max(16, next_pow2(tile_rows)), _MAX_BLOCK_M)
    row_blocks = cdiv(tile_rows, block_m)
    if num_splits is None:
        num_splits = num_splits_for(B, Hkv * row_blocks, num_sms(q.device))
    part_o = torch.empty(T * Hq * num_splits, DV, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(T * Hq * num_splits, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only applies to float32 operands
    _GQA_SPLIT[(B, Hkv * row_blocks, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        rows_per_req, Hq, k_cache.shape[1], scale * LOG2E, num_splits,
        GROUP=group, ROW_BLOCKS=row_blocks, D=D, DV=DV, BLOCK_M=block_m, BLOCK_N=block_n,
        SPLIT_TOKENS=split_tokens, PRECISION=precision, num_warps=4, num_stages=2, **launch_args(q.device))
    combine_splits(part_o, part_lse, out, num_splits)


# Counts that change from step to step (requests, rows, row blocks, splits) are never specialized:
# an eager step's are any number, and a captured bucket's are fixed by its shape.
@triton.jit(do_not_specialize=["s_pt", "num_seqs", "num_rows", "row_blocks", "num_splits"])
def _gqa_varlen_kernel(q, k_cache, v_cache, page_table, seq_lens, query_start_loc, part_o, part_lse,
                       s_q_t, s_q_h, s_k_page, s_k_tok, s_k_head, s_v_page, s_v_tok, s_v_head, s_pt,
                       num_seqs, num_rows, row_blocks, num_q_heads, page_size, scale_log2, num_splits,
                       GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLIT_TOKENS: tl.constexpr, PRECISION: tl.constexpr,
                       FLAT: tl.constexpr):
    if FLAT:
        # Program p of the step's row blocks (`flat_grid`): request b owns programs F(b) ..
        # F(b+1) - 1, F(b) = b + query_start_loc[b] * GROUP // BLOCK_M (at least the blocks its rows
        # fill), found by a binary search over the offsets (F grows with b).
        flat = tl.program_id(0)
        lo = num_seqs * 0  # an int32 like hi: the loop carries both
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            start = mid + tl.load(query_start_loc + mid) * GROUP // BLOCK_M
            lo = tl.where(start <= flat, mid, lo)
            hi = tl.where(start <= flat, hi, mid - 1)
        req = lo
        block = flat - (req + tl.load(query_start_loc + req) * GROUP // BLOCK_M)
        kvh = tl.program_id(1)
    else:
        req = tl.program_id(0)
        kvh = tl.program_id(1) // row_blocks
        block = tl.program_id(1) % row_blocks
    split = tl.program_id(2)
    # Request num_seqs is the padding rows past query_start_loc[num_seqs]: no key, zero output.
    real = req < num_seqs
    first = tl.load(query_start_loc + req)
    n_rows = tl.where(real, tl.load(query_start_loc + req + 1, mask=real, other=0), num_rows) - first
    seq_len = tl.where(real, tl.load(seq_lens + req, mask=real, other=0), 0)
    if block * BLOCK_M >= n_rows * GROUP:  # past the request's rows (a padded request owns none)
        return

    # Tile row m: row m // GROUP of the request, query head kvh * GROUP + m % GROUP.
    m_idx = block * BLOCK_M + tl.arange(0, BLOCK_M)
    r = m_idx // GROUP
    live = r < n_rows
    head = kvh * GROUP + m_idx % GROUP
    row = first.to(tl.int64) + r
    pos = seq_len - n_rows + r  # keys 0..pos; negative (padding rows): none
    # The block's last row sees the most keys: the walk stops there (causal), and an earlier row
    # scores the keys past its own position -inf, adding exact zeros as in the uniform kernel.
    last_row = tl.minimum(((block + 1) * BLOCK_M - 1) // GROUP, n_rows - 1)
    kv_len = tl.maximum(seq_len - n_rows + last_row + 1, 0)
    pages = page_table + tl.minimum(req, num_seqs - 1).to(tl.int64) * s_pt  # padding rows read no page
    _attend_split(q, k_cache, v_cache, pages,
                  part_o, part_lse, row, head, live, pos, kv_len, kvh, split,
                  s_q_t, s_q_h, s_k_page, s_k_tok, s_k_head, s_v_page, s_v_tok, s_v_head,
                  num_q_heads, page_size, scale_log2, num_splits,
                  D, DV, BLOCK_M, BLOCK_N, SPLIT_TOKENS, PRECISION)


_GQA_VARLEN = Launcher(_gqa_varlen_kernel)  # eager gaps repeat its arguments (launch_cache.py)


def triton_gqa_attention_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                page_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                                out: torch.Tensor, scale: float, max_rows: int | None = None,
                                num_splits: int | None = None, block_n: int | None = None,
                                fixed_splits: bool = False, split_tokens: int | None = None,
                                flat_grid: bool = False, block_m: int | None = None, num_warps: int | None = None,
                                num_stages: int | None = None) -> None:
    """Requests of different lengths (the module docstring): q [T, Hq, D]; k_cache, v_cache as for
    triton_gqa_attention; page_table [B, width], seq_lens [B] and query_start_loc [B+1] int32 on q's
    device (request b: rows query_start_loc[b] .. query_start_loc[b+1] - 1, cached + new tokens
    seq_lens[b]; rows from query_start_loc[B] to T - 1 are padding and get zeros); out [T, Hq, Dv]
    written in place (unit last stride).

    max_rows: at least the rows of every request and the padding rows (default T): it sizes the
    grid, so a captured bucket passes its token count and an eager step its longest request.
    num_splits, fixed_splits, split_tokens, block_n: as for triton_gqa_attention.
    flat_grid: one program per row block the step's rows can fill (B + 1 + T * group // 64 of them,
    each finding its request by a binary search over the offsets) in place of every request's
    blocks of the longest one ((B + 1) * max_rows * group / 64): the same programs do the work, bit
    for bit, and a bucket laid out for many requests launches few empty ones. Not the default: it
    is weighed in benchmarks/kernels/gqa_extend_sweep.py first.
    block_m, num_warps, num_stages: the program's tile of query rows (a power of two >= 16) and its
    launch (default _MAX_BLOCK_M, VARLEN_WARPS, VARLEN_STAGES); gqa_extend_sweep.py --tiles weighs them."""
    T, Hq, D = q.shape
    Hkv, DV = k_cache.shape[2], v_cache.shape[3]
    if T == 0:
        return
    for dim in (D, DV):
        why = gqa_head_dim_refusal(dim)
        if why is not None:
            raise ValueError(why)
    if Hq % Hkv:
        raise ValueError(f"triton GQA: {Hq} query heads are not a multiple of {Hkv} kv heads")
    B = page_table.shape[0]
    if B == 0 or query_start_loc.shape[0] != B + 1 or seq_lens.shape[0] < B:
        raise ValueError(f"triton GQA (varlen): {B} requests need {B + 1} query offsets and {B} sequence lengths, "
                         f"got {query_start_loc.shape[0]} and {seq_lens.shape[0]}")
    max_rows = T if max_rows is None else max_rows
    if not 1 <= max_rows <= T:
        raise ValueError(f"triton GQA (varlen): max_rows {max_rows} for a step of {T} rows")
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and out.stride(-1) == 1
    assert page_table.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    group = Hq // Hkv
    if block_n is None:
        block_n = 64 if max(D, DV) <= 64 else 32
    num_splits, split_tokens = split_layout(num_splits, fixed_splits, split_tokens, block_n)
    # One tile height for every step: the rows a request brings change from step to step, and a
    # tile chosen from them would be a kernel built in the middle of serving.
    block_m = _MAX_BLOCK_M if block_m is None else block_m
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"triton GQA (varlen): block_m {block_m} is not a power of two >= 16")
    row_blocks = cdiv(max_rows * group, block_m)
    if num_splits is None:  # by the blocks the step's rows fill, not the grid's idle ones
        # One wave, not decode's two: a prompt's row blocks already fill much of the card, and each
        # split more writes float32 partial rows the combine pass reads back. On an H200 (bench
        # qwen3_next's layer, 16 / 2 heads of 256) one wave's count was the fastest of 1-8 splits, or
        # within 3% of it, at 128, 256 and 512 tokens and 4 x 128: 1.13x to 1.28x the two waves'
        # (benchmarks/kernels/gqa_extend_sweep.py, history/linear_extend.md).
        num_splits = num_splits_for(1, Hkv * cdiv(T * group, block_m), num_sms(q.device), waves=1)
    part_o = torch.empty(T * Hq * num_splits, DV, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(T * Hq * num_splits, dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # tf32 only applies to float32 operands
    grid = (B + 1 + T * group // block_m, Hkv, num_splits) if flat_grid else (B + 1, Hkv * row_blocks, num_splits)
    _GQA_VARLEN[grid](
        q, k_cache, v_cache, page_table, seq_lens, query_start_loc, part_o, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), page_table.stride(0),
        B, T, row_blocks, Hq, k_cache.shape[1], scale * LOG2E, num_splits,
        GROUP=group, D=D, DV=DV, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_TOKENS=split_tokens,
        PRECISION=precision, FLAT=flat_grid, num_warps=num_warps or VARLEN_WARPS,
        num_stages=num_stages or VARLEN_STAGES)
    combine_splits(part_o, part_lse, out, num_splits)
