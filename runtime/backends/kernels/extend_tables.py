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
and their running sum (B+3 integers, REQUESTS at a time) rather than sharing them, which is cheaper
than a second launch. The kernel's compile-time constants do not depend on the step's request count,
so one variant serves every bucket.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_math import cdiv
from runtime.cache.state_pool import PADDING_SLOT

__all__ = ["fill_extend_tables"]

ROWS = 16  # table rows a program writes, per table; [ROWS, REQUESTS] comparison tiles stay small
# Requests a program reads at a time, a fixed width: a width from the step's request count (its next
# power of two) would make one kernel variant per count, and a bundle built for one count of extend
# requests would lack the variant a runtime of another count launches (runtime/artifact/bundle.py
# refuses to build it at start-up).
REQUESTS = 64


@triton.jit
def _request_lens(qsl_ptr, r, B, T, real):
    """Rows r of the step's B+3 requests: start offsets (r >= B: the last offset) and lengths (request
    B+1 owns the padding rows T - real; B and B+2 are empty)."""
    starts = tl.load(qsl_ptr + tl.minimum(r, B), mask=r < B + 3, other=0)
    ends = tl.load(qsl_ptr + tl.minimum(r + 1, B), mask=r < B, other=0)
    return starts, tl.where(r < B, ends - starts, tl.where(r == B + 1, T - real, 0))


@triton.jit
def _block_rows(out_ptr, qsl_ptr, B, T, real, rows, j, SIZE: tl.constexpr, BR: tl.constexpr):
    """Rows j of a (request, block) table of the requests' lengths in blocks of SIZE; rows past the
    real blocks name request B (the empty one) with block 0. The requests go by in groups of BR:
    a row's request is the number of requests that end at or before it, and its first row the
    largest such end, both sums over the groups."""
    seq = tl.zeros(j.shape, tl.int32)
    first = tl.zeros(j.shape, tl.int32)
    total = tl.full([], 0, tl.int32)  # rows of the groups before
    for base in range(0, B + 2, BR):
        r = base + tl.arange(0, BR)
        _, lens = _request_lens(qsl_ptr, r, B, T, real)
        counts = (lens + SIZE - 1) // SIZE
        ends = total + tl.cumsum(counts, 0)  # one past each request's last row
        done = (ends[None, :] <= j[:, None]) & (r < B + 2)[None, :]
        seq += tl.sum(done.to(tl.int32), 1)
        first = tl.maximum(first, tl.max(tl.where(done, ends[None, :], 0), 1))
        total += tl.sum(counts, 0)
    live = j < total
    seq = tl.where(live, seq, B)
    block = tl.where(live, j - first, 0)
    keep = j < rows
    tl.store(out_ptr + 2 * j, seq.to(tl.int64), mask=keep)
    tl.store(out_ptr + 2 * j + 1, block.to(tl.int64), mask=keep)


@triton.jit
def _extend_tables_kernel(qsl_ptr, out_ptr, slots_ptr, B, T, bounds_at, chunks_at, n_chunks, blocks_at, n_blocks,
                          CHUNK: tl.constexpr, CONV: tl.constexpr, BR: tl.constexpr, ROWS_: tl.constexpr,
                          PAD_SLOT: tl.constexpr):
    real = tl.load(qsl_ptr + B)
    if tl.program_id(0) == 0:
        for base in range(0, B + 3, BR):
            r = base + tl.arange(0, BR)
            starts, _ = _request_lens(qsl_ptr, r, B, T, real)
            tl.store(out_ptr + bounds_at + r, tl.where(r == B + 2, T, starts).to(tl.int64), mask=r < B + 3)
        r = tl.arange(0, BR)
        tl.store(slots_ptr + B + r, tl.full([BR], PAD_SLOT, tl.int64), mask=r < 1)
    j = tl.program_id(0) * ROWS_ + tl.arange(0, ROWS_)
    _block_rows(out_ptr + chunks_at, qsl_ptr, B, T, real, n_chunks, j, CHUNK, BR)
    _block_rows(out_ptr + blocks_at, qsl_ptr, B, T, real, n_blocks, j, CONV, BR)


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
                                CHUNK=chunk, CONV=conv_block, BR=REQUESTS, ROWS_=ROWS, PAD_SLOT=PADDING_SLOT)
