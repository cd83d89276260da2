"""The extend path's tables of a captured step, made on the device from the step's query offsets.

What this module owns: `fill_extend_tables`, one launch that writes the tables the linear backend's
captured extend and mixed steps read (runtime/backends/triton_linear.py, `_StaticExtendPlan`, which
states their layout) from the step's `query_start_loc` [B+1] int32 on the device, and the padding
slot as the slot of request B (the always-empty one; a larger bucket's step may have left a real
slot id there), which would otherwise take a fill launch of its own in every step:

- bounds [B+3]: query_start_loc, then its last entry again (the always-empty request B), then T
  (request B+1 owns the padding rows);
- chunks [n_chunks, 2]: `launch_math.token_blocks` of the B+2 requests' lengths (the last the
  padding rows) in blocks of `chunk` rows, then (B, 0) rows (the empty request: their programs do
  nothing);
- conv blocks [n_blocks, 2]: the same in blocks of `conv_block` rows.

Why on the device: made on the host (numpy, then one copy from pinned memory) they took about
0.45 ms of a replayed short extend's host time on an H200 (benchmarks/host/prompt_host_bench.py's
profile), before the graph could start, on a 2 ms step; on the device they are one launch inside the
graph, which reads the offsets the graph runner staged, so a replay does no host work for them.

Each program takes ROWS rows of both tables; every program recomputes the per-request block counts
and their running sum (B+3 integers) rather than sharing them, which is cheaper than a second launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_math import cdiv, next_pow2
from runtime.cache.state_pool import PADDING_SLOT

__all__ = ["fill_extend_tables"]

ROWS = 16  # table rows a program writes, per table; [ROWS, requests] comparison tiles stay small


@triton.jit
def _block_rows(out_ptr, lens, rows, empty, j, SIZE: tl.constexpr, BR: tl.constexpr):
    """Rows j of a (request, block) table over `lens` [BR] in blocks of SIZE; rows past the real
    blocks name `empty` with block 0."""
    counts = (lens + SIZE - 1) // SIZE
    ends = tl.cumsum(counts, 0)  # one past each request's last row
    firsts = ends - counts
    total = tl.sum(counts, 0)
    r = tl.arange(0, BR)
    seq = tl.sum((ends[None, :] <= j[:, None]).to(tl.int32), 1)  # requests that end at or before row j
    first = tl.sum(tl.where(r[None, :] == seq[:, None], firsts[None, :], 0), 1)
    live = j < total
    seq = tl.where(live, seq, empty)
    block = tl.where(live, j - first, 0)
    keep = j < rows
    tl.store(out_ptr + 2 * j, seq.to(tl.int64), mask=keep)
    tl.store(out_ptr + 2 * j + 1, block.to(tl.int64), mask=keep)


@triton.jit
def _extend_tables_kernel(qsl_ptr, out_ptr, slots_ptr, B, T, bounds_at, chunks_at, n_chunks, blocks_at, n_blocks,
                          CHUNK: tl.constexpr, CONV: tl.constexpr, BR: tl.constexpr, ROWS_: tl.constexpr,
                          PAD_SLOT: tl.constexpr):
    r = tl.arange(0, BR)
    starts = tl.load(qsl_ptr + tl.minimum(r, B), mask=r < B + 3, other=0)  # r >= B: the last offset
    real = tl.load(qsl_ptr + B)
    ends = tl.load(qsl_ptr + tl.minimum(r + 1, B), mask=r < B, other=0)
    lens = tl.where(r < B, ends - starts, tl.where(r == B + 1, T - real, 0))  # request B+1: the padding rows
    if tl.program_id(0) == 0:
        tl.store(out_ptr + bounds_at + r, tl.where(r == B + 2, T, starts).to(tl.int64), mask=r < B + 3)
        tl.store(slots_ptr + B + r, tl.full([BR], PAD_SLOT, tl.int64), mask=r < 1)
    j = tl.program_id(0) * ROWS_ + tl.arange(0, ROWS_)
    _block_rows(out_ptr + chunks_at, lens, n_chunks, B, j, CHUNK, BR)
    _block_rows(out_ptr + blocks_at, lens, n_blocks, B, j, CONV, BR)


def fill_extend_tables(query_start_loc: torch.Tensor, out: torch.Tensor, slots: torch.Tensor, tokens: int,
                       seqs: int, spans: list[tuple[int, tuple[int, ...]]], chunk: int, conv_block: int) -> None:
    """Write a step's tables into `out` (int64, on the device) at `spans`: (offset, shape) of bounds
    [B+3], chunks [n_chunks, 2] and conv blocks [n_blocks, 2], as `_StaticExtendPlan._layout` places
    them, and PADDING_SLOT into slots[B] (slots: int64, at least B+1, the step's ids in the first B).
    query_start_loc [B+1] int32 on the same device (padded
    requests own no rows: their offsets repeat the last real one). No host read, no host copy."""
    B, T = seqs, tokens
    if query_start_loc.shape[0] != B + 1 or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be [{B + 1}] int32, got {tuple(query_start_loc.shape)} "
                         f"{query_start_loc.dtype}")
    if slots.shape[0] <= B or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 with room for {B + 1} requests, got {tuple(slots.shape)} {slots.dtype}")
    (bd, _), (ch, (n_chunks, _)), (bl, (n_blocks, _)) = spans
    grid = (cdiv(max(n_chunks, n_blocks), ROWS),)
    _extend_tables_kernel[grid](query_start_loc, out, slots, B, T, bd, ch, n_chunks, bl, n_blocks,
                                CHUNK=chunk, CONV=conv_block, BR=next_pow2(B + 3), ROWS_=ROWS, PAD_SLOT=PADDING_SLOT)
