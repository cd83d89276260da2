"""Turn "these requests add these tokens" into the tensors of one step and its ExecContext.

1. Each request holds a `SeqState`: its state slot, its KV pages and how many tokens are cached.
2. `build_step` grows each request's page list to fit the new tokens (pages come from the KV
   pool), lays the tokens out request after request, and fills the context tensors.
3. After the model ran, `commit_step` advances each request's cached-token count.

A step's layout does not depend on its tokens' values, so a step may be built with placeholder
tokens and get its real ids on the device just before it runs (`write_rows`): the draft's
chained steps feed the previous step's argmax without reading it back (runtime/engine/speculative.py),
and the engine's overlapped steps feed each decoding request the token the step before chose on
the device (`PLACEHOLDER_TOKEN` on the host, its real id written at its row: `RowsAt`).
Its logits rows may come from the device the same way (the draft step after a verify step, whose
row per request is the last kept position, known on the device before the host reads it).

Padding (`pad_tokens_to`, `pad_seqs_to`) is done here and only here: padded tokens get position
0, slot_mapping -1 and no logits row; padded requests get the reserved state slot.
"""

from __future__ import annotations

import dataclasses
import itertools
import typing

import numpy as np
import torch

from compiler.splitops import Mode
from runtime.step.context import ExecContext
from runtime.step.host_copy import array_to_device
from runtime.cache.kv_pool import KVPool
from runtime.cache.state_pool import PADDING_SLOT

__all__ = ["SeqState", "StepInputs", "build_step", "commit_step", "step_mode", "write_rows", "RowsAt",
           "PLACEHOLDER_TOKEN"]

# A token whose id is only on the device yet (the engine's overlapped steps): never a real id, so
# one that reached a model's embedding unreplaced fails there instead of feeding a wrong token.
PLACEHOLDER_TOKEN = -1


@dataclasses.dataclass
class SeqState:
    slot: int
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0


@dataclasses.dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_index: torch.Tensor  # [R] int64: the last row of each real request (R == B), or more (logits_rows)
    ctx: ExecContext
    # [T_real, D]: the draft program's input, the hidden state each real token's draft reads (set by
    # the caller: runtime/engine/speculative.py); None for the main program
    hidden: torch.Tensor | None = None


def step_mode(query_lens: list[int], cache_lens: list[int]) -> Mode:
    decoding = [n == 1 and c > 0 for n, c in zip(query_lens, cache_lens)]
    if all(decoding):
        return Mode.DECODE
    if not any(decoding):
        return Mode.EXTEND
    return Mode.MIXED


def build_step(items: list[tuple[SeqState, list[int]]], kv_pool: KVPool, device="cpu",
               mode: Mode | None = None, pad_tokens_to: int | None = None,
               pad_seqs_to: int | None = None, max_pages: int | None = None,
               logits_rows: list[int] | None = None) -> StepInputs:
    """items: (request state, new token ids) for each request of the step, in order.

    logits_rows: for each request, how many of its last rows get logits (default 1: the row that
    predicts its next token). A request scoring its prompt asks for more; its rows stay in order,
    so each request's last logits row is still the one its next token is sampled from.

    Every step of the engine passes through here on the host, so the layout is computed with
    whole-array numpy operations (one per field) rather than per-request torch calls: at 128
    decoding requests that is the difference between a fraction of a millisecond and several.
    """
    assert items, "a step needs at least one request"
    ps = kv_pool.page_size
    device = torch.device(device)
    seqs = [seq for seq, _ in items]
    query_lens = [len(tokens) for _, tokens in items]
    cache_lens = [seq.num_cached for seq in seqs]
    assert min(query_lens) > 0, "every request in a step adds at least one token"
    for seq, n in zip(seqs, query_lens):
        if seq.num_cached + n > len(seq.pages) * ps:  # the scheduler usually took them already
            seq.pages.extend(kv_pool.alloc(kv_pool.pages_for(seq.num_cached + n) - len(seq.pages)))

    B, T = len(items), sum(query_lens)
    T_pad = max(T, pad_tokens_to or 0)
    B_pad = max(B, pad_seqs_to or 0)
    page_lens = [len(seq.pages) for seq in seqs]
    P = max(max_pages or 0, max(page_lens), 1)

    q_lens = np.asarray(query_lens, dtype=np.int64)
    cached = np.asarray(cache_lens, dtype=np.int64)
    starts = np.zeros(B_pad + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:B + 1])
    starts[B + 1:] = T  # padded requests own no rows
    page_table = np.zeros((B_pad, P), dtype=np.int64)
    # Every request's pages in one flat array, scattered into the rows' first len(pages) columns
    # (row-major order of the mask is request order, then page order).
    flat_pages = np.fromiter(itertools.chain.from_iterable(seq.pages for seq in seqs), np.int64, sum(page_lens))
    page_table[:B][np.arange(P) < np.asarray(page_lens)[:, None]] = flat_pages
    row_req = np.repeat(np.arange(B), q_lens)
    positions = np.zeros(T_pad, dtype=np.int64)
    positions[:T] = np.arange(T) - starts[row_req] + cached[row_req]
    slot_mapping = np.full(T_pad, -1, dtype=np.int64)
    slot_mapping[:T] = page_table[row_req, positions[:T] // ps] * ps + positions[:T] % ps
    input_ids = np.zeros(T_pad, dtype=np.int64)
    input_ids[:T] = np.fromiter(itertools.chain.from_iterable(tokens for _, tokens in items), np.int64, T)
    seq_lens = np.zeros(B_pad, dtype=np.int32)
    seq_lens[:B] = cached + q_lens
    state_slots = np.full(B_pad, PADDING_SLOT, dtype=np.int64)
    state_slots[:B] = [seq.slot for seq in seqs]

    def dev(a: np.ndarray, dtype=None) -> torch.Tensor:
        # queued from pinned memory on cuda: a pageable copy would wait for every queued kernel
        return array_to_device(a if dtype is None else a.astype(dtype), device)

    ctx = ExecContext(
        mode=mode or step_mode(query_lens, cache_lens), query_lens=query_lens, cache_lens=cache_lens,
        query_start_loc=dev(starts, np.int32), seq_lens=dev(seq_lens), state_slots=dev(state_slots),
        page_table=dev(page_table, np.int32), slot_mapping=dev(slot_mapping), page_size=ps, num_tokens=T_pad,
        num_seqs=B_pad,
    )
    ctx.check()
    ends = starts[1:B + 1]
    if logits_rows is None:
        logits_index = ends - 1
    else:
        rows = np.asarray(logits_rows, dtype=np.int64)
        assert rows.shape == (B,) and (rows >= 1).all() and (rows <= q_lens).all(), (logits_rows, query_lens)
        # row r of request b: ends[b] - rows[b] + r, for r < rows[b]
        logits_index = np.repeat(ends - rows, rows) + np.arange(rows.sum()) - np.repeat(np.cumsum(rows) - rows, rows)
    return StepInputs(dev(input_ids), dev(positions), dev(logits_index), ctx)


def commit_step(items: list[tuple[SeqState, list[int]]]) -> None:
    for seq, tokens in items:
        seq.num_cached += len(tokens)


class RowsAt(typing.NamedTuple):
    """Device-resident values for chosen rows of a step's tensor: values[i] goes to row index[i]."""
    index: torch.Tensor  # [k] int64, on the device
    values: torch.Tensor  # [k], on the device


def write_rows(dst: torch.Tensor, rows: torch.Tensor | RowsAt | None, limit: int, what: str) -> None:
    """Write device-resident values (token ids, logits row indices) over rows of a step's tensor on
    the device, in place (a step built with placeholders there): a tensor over its first rows, or
    `RowsAt` at the rows it names (which must be real: the host cannot check them without waiting
    for the device); the other rows, padding included, keep theirs. `limit`: how many rows are
    real; `what` names them in the error. None: nothing."""
    if rows is None:
        return
    count = rows.values.shape[0] if isinstance(rows, RowsAt) else rows.shape[0]
    if count > limit:
        raise ValueError(f"{count} {what} for a step of {limit}")
    if isinstance(rows, RowsAt):
        dst.index_copy_(0, rows.index, rows.values)
    else:
        dst[:count].copy_(rows)
