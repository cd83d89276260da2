"""Triton MLA kernel: absorbed multi-head latent attention over the paged latent cache.

The fallback (and cross-check) for FlashInfer's `BatchMLAPagedAttentionWrapper`, chosen with
`FlashInferAttentionBackend(mla_impl="triton")`. Same contract as the `mla_attention` op: the
cache keeps [c | k_rope] per token; score = q_latent.c + q_rope.k_rope; out = softmax(scale *
score) @ c.

Three ways to find a row's keys (constexpr switches of the split pass):

- row arrays (`triton_mla_attention`): FlashInfer's page lists per request (kv_indptr,
  kv_indices) and each row's request and position, built on the host for any step (extend and
  mixed steps, requests of any lengths);
- the page table (`triton_mla_attention_paged`): a decode or target_verify step whose requests
  all have the same n rows reads the step's `page_table` [B, width] and `seq_lens` [B] as they
  are: row t is request t // n at position seq_lens - n + t % n. Nothing is built on the host, so
  a captured decode graph replays with no plan at all (runtime/backends/kernels/gqa.py does the
  same for GQA);
- the page table with query offsets (`triton_mla_attention_varlen`): an extend or mixed step,
  requests of different lengths, reads `query_start_loc` [B+1] besides: row t's request is the
  one whose rows hold it (a binary search over the offsets, so no per-step constexpr), at position
  seq_lens[b] - q_len_b + (t - query_start_loc[b]); rows from query_start_loc[B] on are padding,
  see no key and get zeros. Nothing is built on the host either, so a captured extend bucket
  replays it for any layout of its rows (gqa.py's varlen kernel is the GQA counterpart).

1. Split pass, grid (rows, head blocks, splits): each program takes one query row, BLOCK_H heads
   and its split of the keys that row may see (causal: positions 0..its position; one contiguous
   share, or with fixed splits chunks of SPLIT_TOKENS keys at fixed positions), walks it BLOCK_N
   tokens at a time through the page indices, and keeps an online softmax in float32. It writes
   its normalised partial output and its log-sum-exp (base 2).
2. Combine pass, grid (rows, heads; `combine_splits` of triton_split_kv.py, shared with the GQA kernel): merges the
   splits by their log-sum-exp.

The number of splits depends only on the number of rows and heads (fixed splits: always
MAX_SPLITS), so a captured decode graph replays the same launch for any context length. With
`fixed_splits=True` a row's output depends only on its query, its keys and its position: the same
bits in a decode, verify, extend or mixed step of any batch, from the page table or the row
arrays (triton_split_kv.py says how). Every query row reads its keys again, so for
long extends this kernel moves far more bytes than a prefill kernel would: it is a decode kernel
that also computes extend correctly, not a prefill kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv
from runtime.backends.kernels.pdl import launch_args, pdl_wait
from runtime.backends.kernels.sm_count import num_sms
from runtime.backends.kernels.split_kv import (LOG2E, combine_splits, num_splits_for, paged_tile, round_keys,
                                              softmax_step, split_chunks, split_layout, split_result)

__all__ = ["triton_mla_attention", "triton_mla_attention_paged", "triton_mla_attention_varlen"]


# s_pt (the page table's width follows the longest request allowed) and num_splits (the
# launch's rows) are never specialized: see triton_split_kv.MAX_SPLITS.
@triton.jit(do_not_specialize=["s_pt", "num_splits", "num_seqs"])
def _mla_split_kernel(q_lat, q_rope, ckv, kpe, pages, kv_indptr, row_req, row_pos, seq_lens, part_o, part_lse,
                      s_ql_t, s_ql_h, s_qr_t, s_qr_h, s_c_page, s_c_tok, s_k_page, s_k_tok, s_pt,
                      rows_per_req, num_heads, page_size, scale_log2, num_splits, num_seqs,
                      R: tl.constexpr, P: tl.constexpr, P_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_N: tl.constexpr, SPLIT_TOKENS: tl.constexpr, PRECISION: tl.constexpr,
                      FROM_TABLE: tl.constexpr, VARLEN: tl.constexpr, USE_GDC: tl.constexpr):
    # FROM_TABLE: `pages` is the page table [B, s_pt] and `seq_lens` gives each row its position
    # (kv_indptr, row_req, row_pos unused); else `pages` is kv_indices, found through the row arrays.
    # VARLEN (with FROM_TABLE): `kv_indptr` is query_start_loc [num_seqs+1], which gives each row
    # its request; else every request of the table has rows_per_req rows.
    # SPLIT_TOKENS: 0, the default shares; else fixed splits (triton_split_kv.split_chunks).
    # USE_GDC: launched with PDL (pdl.py); the query, the cache and the tables are the step's: it waits first.
    pdl_wait(USE_GDC)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    if VARLEN:
        # the request whose rows hold t: the first whose end lies past t (num_seqs: the padding rows)
        lo = num_seqs * 0
        hi = num_seqs + 0
        while lo < hi:
            mid = (lo + hi) // 2
            past = tl.load(kv_indptr + mid + 1) <= t  # request mid ends at or before row t
            lo = tl.where(past, mid + 1, lo)
            hi = tl.where(past, hi, mid)
        real = lo < num_seqs
        first = tl.load(kv_indptr + lo)
        n_rows = tl.load(kv_indptr + lo + 1, mask=real, other=0) - first
        seq_len = tl.load(seq_lens + lo, mask=real, other=0)
        kv_len = tl.where(real, seq_len - n_rows + (t - first) + 1, 0)  # padding rows: no key
        page_row = pages + tl.minimum(lo, num_seqs - 1).to(tl.int64) * s_pt
    elif FROM_TABLE:
        req = t // rows_per_req
        kv_len = tl.load(seq_lens + req) - rows_per_req + t % rows_per_req + 1
        page_row = pages + req * s_pt
    else:
        req = tl.load(row_req + t)
        kv_len = tl.load(row_pos + t) + 1  # causal: the row sees keys 0..its own position
        page_row = pages + tl.load(kv_indptr + req)
    kv_len = tl.maximum(kv_len, 0)  # a padding request (seq_lens 0) sees no key: a zero output
    # Each row walks its own keys (one row per program): either way of finding them, in any step,
    # fixed splits give a row at one position the same tiles in the same order.
    width, rounds = split_chunks(kv_len, num_splits, SPLIT_TOKENS, BLOCK_N)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    r = tl.arange(0, R)
    p = tl.arange(0, P_PAD)  # a dot needs K >= 16: a narrower rope part is padded with zeros
    pmask = p < P
    q = tl.load(q_lat + t * s_ql_t + heads[:, None] * s_ql_h + r[None, :], mask=hmask[:, None], other=0.0)
    qr = tl.load(q_rope + t * s_qr_t + heads[:, None] * s_qr_h + p[None, :], mask=hmask[:, None] & pmask[None, :],
                 other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    for rnd in range(0, rounds):
        start, end = round_keys(split, rnd, num_splits, width, kv_len)
        for n0 in range(start, end, BLOCK_N):
            n, nmask, page, off = paged_tile(page_row, n0, end, page_size, BLOCK_N)
            c = tl.load(ckv + page[:, None] * s_c_page + off[:, None] * s_c_tok + r[None, :], mask=nmask[:, None],
                        other=0.0)
            kr = tl.load(kpe + page[:, None] * s_k_page + off[:, None] * s_k_tok + p[None, :],
                         mask=nmask[:, None] & pmask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(c), input_precision=PRECISION)
            s += tl.dot(qr, tl.trans(kr), input_precision=PRECISION)
            s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))
            m, alpha, w, l = softmax_step(m, l, s)
            acc = acc * alpha[:, None] + tl.dot(w.to(c.dtype), c, input_precision=PRECISION)

    o, lse = split_result(acc, m, l)
    idx = (t * num_heads + heads) * num_splits + split
    # A split that saw no key stores its -inf alone: the combine pass reads no output for it.
    tl.store(part_o + idx[:, None] * R + r[None, :], o, mask=(hmask & (lse > float("-inf")))[:, None])
    tl.store(part_lse + idx, lse, mask=hmask)


_MLA_SPLIT = Launcher(_mla_split_kernel)  # eager gaps repeat its arguments (launch_cache.py)


def triton_mla_attention(q_latent, q_rope, ckv, kpe, kv_indptr, kv_indices, row_req, row_pos, out, scale,
                         block_h: int = 16, block_n: int = 32, num_splits: int | None = None,
                         fixed_splits: bool = False, split_tokens: int | None = None) -> None:
    """q_latent [T,H,R], q_rope [T,H,P]; ckv [pages,page_size,R] and kpe [pages,page_size,P] (views
    with unit last stride); kv_indptr/kv_indices: FlashInfer's page lists per request; row_req /
    row_pos [T] int32: each row's request and position; out [T,H,R] written in place.

    num_splits: the default mode's split count (None: num_splits_for chooses from the rows).
    fixed_splits: a row's output depends only on its query, its keys and its position, the same
    bits in any step and either way of finding its keys (triton_split_kv's module docstring);
    split_tokens: its chunk (None: SPLIT_TOKENS; tests pass smaller ones). Not with num_splits."""
    # seq_lens is not read in this mode: any int32 tensor stands in for the pointer
    _launch(q_latent, q_rope, ckv, kpe, kv_indices, kv_indptr, row_req, row_pos, row_pos, 0, 1, False,
            out, scale, block_h, block_n, num_splits, fixed_splits, split_tokens)


def triton_mla_attention_varlen(q_latent, q_rope, ckv, kpe, page_table, seq_lens, query_start_loc, out, scale,
                                block_h: int = 16, block_n: int = 32, num_splits: int | None = None,
                                fixed_splits: bool = False, split_tokens: int | None = None) -> None:
    """As triton_mla_attention, for an extend or mixed step from the page table [B, width],
    seq_lens [B] (cached + new tokens) and query_start_loc [B+1] (request b: rows
    query_start_loc[b] .. query_start_loc[b+1] - 1; a padded request owns none), int32 on the
    device, read as they are. Rows from query_start_loc[B] to T - 1 are padding: zeros."""
    B = page_table.shape[0]
    if B == 0 or query_start_loc.shape[0] != B + 1 or seq_lens.shape[0] < B:
        raise ValueError(f"triton MLA (varlen): {B} requests need {B + 1} query offsets and {B} sequence lengths, "
                         f"got {query_start_loc.shape[0]} and {seq_lens.shape[0]}")
    assert page_table.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    # row_req and row_pos are not read in this mode: seq_lens stands in for the pointers
    _launch(q_latent, q_rope, ckv, kpe, page_table, query_start_loc, seq_lens, seq_lens, seq_lens,
            page_table.stride(0), 1, True, out, scale, block_h, block_n, num_splits, fixed_splits, split_tokens,
            varlen_seqs=B)


def triton_mla_attention_paged(q_latent, q_rope, ckv, kpe, page_table, seq_lens, rows_per_req, out, scale,
                               block_h: int = 16, block_n: int = 32, num_splits: int | None = None,
                               fixed_splits: bool = False, split_tokens: int | None = None) -> None:
    """As triton_mla_attention, for a step whose B requests all have rows_per_req (n) rows,
    T = B * n: page_table [B, width] and seq_lens [B] int32 on the device, read as they are."""
    B = page_table.shape[0]
    if q_latent.shape[0] != B * rows_per_req or seq_lens.shape[0] < B:
        raise ValueError(f"triton MLA: {q_latent.shape[0]} query rows for {B} requests of {rows_per_req} rows "
                         f"({seq_lens.shape[0]} sequence lengths)")
    assert page_table.dtype == torch.int32 and seq_lens.dtype == torch.int32
    # kv_indptr, row_req and row_pos are not read in this mode: seq_lens stands in for the pointers
    _launch(q_latent, q_rope, ckv, kpe, page_table, seq_lens, seq_lens, seq_lens, seq_lens, page_table.stride(0),
            rows_per_req, True, out, scale, block_h, block_n, num_splits, fixed_splits, split_tokens)


def _launch(q_latent, q_rope, ckv, kpe, pages, kv_indptr, row_req, row_pos, seq_lens, s_pt, rows_per_req,
            from_table, out, scale, block_h, block_n, num_splits, fixed_splits, split_tokens,
            varlen_seqs: int = 0) -> None:
    """varlen_seqs: the requests of a page-table step whose rows query_start_loc (in kv_indptr's
    place) gives; 0: every request has rows_per_req rows (or the row arrays' step)."""
    T, H, R = q_latent.shape
    P = q_rope.shape[-1]
    if T == 0:
        return
    assert ckv.stride(-1) == 1 and kpe.stride(-1) == 1 and q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1
    assert R & (R - 1) == 0 and P & (P - 1) == 0, f"triton MLA: R={R} and P={P} must be powers of two"
    assert R >= 16, f"triton MLA: a latent rank of {R} is below a dot's smallest width (16)"
    head_blocks = cdiv(H, block_h)
    num_splits, split_tokens = split_layout(num_splits, fixed_splits, split_tokens, block_n)
    if num_splits is None:
        num_splits = num_splits_for(T, head_blocks, num_sms(q_latent.device))
    part_o = torch.empty(T * H * num_splits, R, dtype=torch.float32, device=q_latent.device)
    part_lse = torch.empty(T * H * num_splits, dtype=torch.float32, device=q_latent.device)
    precision = "ieee" if q_latent.dtype == torch.float32 else "tf32"
    _MLA_SPLIT[(T, head_blocks, num_splits)](
        q_latent, q_rope, ckv, kpe, pages, kv_indptr, row_req, row_pos, seq_lens, part_o, part_lse,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        ckv.stride(0), ckv.stride(1), kpe.stride(0), kpe.stride(1), s_pt,
        rows_per_req, H, ckv.shape[1], scale * LOG2E, num_splits, varlen_seqs,
        R=R, P=P, P_PAD=max(16, P), BLOCK_H=block_h, BLOCK_N=block_n, SPLIT_TOKENS=split_tokens,
        PRECISION=precision, FROM_TABLE=from_table, VARLEN=varlen_seqs > 0, num_warps=8, num_stages=2,
        **launch_args(q_latent.device))
    combine_splits(part_o, part_lse, out, num_splits)
