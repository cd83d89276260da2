"""Turn "these requests add these tokens" into the tensors of one step and its ExecContext.

1. Each request holds a `SeqState`: its state slot, its KV pages and how many tokens are cached.
2. `build_step` grows each request's page list to fit the new tokens (pages come from the KV
   pool, `take_pages`), lays the tokens out request after request and fills the context fields
   (`lay_out`, into arrays of the step's own), and makes them tensors. A step replayed from a
   captured graph is laid out by the same `lay_out` straight into the static buffers' host
   block instead (runtime/graphs/staging.py, `StepStaging.lay_out`).
3. After the model ran, `commit_step` advances each request's cached-token count.

A step's layout does not depend on its tokens' values, so a step may be built with placeholder
tokens and get its real ids on the device just before it runs (`write_rows`): the draft's
chained steps feed the previous step's argmax without reading it back (runtime/engine/speculative.py),
and the engine's overlapped steps feed each decoding request the token the step before chose on
the device (`PLACEHOLDER_TOKEN` on the host, its real id written at its row: `RowsAt`).
Its logits rows may come from the device the same way (the draft step after a verify step, whose
row per request is the last kept position, known on the device before the host reads it).

Padding (`pad_tokens_to`, `pad_seqs_to`, or the shapes of the arrays laid out into) is done here
and only here: `lay_out` states its rules.
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

__all__ = ["SeqState", "StepInputs", "build_step", "lay_out", "step_lengths", "take_pages", "FIELD_DTYPES",
           "PageTableTooNarrow", "commit_step", "step_mode", "write_rows", "RowsAt", "PLACEHOLDER_TOKEN"]

# A token whose id is only on the device yet (the engine's overlapped steps): never a real id, so
# one that reached a model's embedding unreplaced fails there instead of feeding a wrong token.
PLACEHOLDER_TOKEN = -1


@dataclasses.dataclass
class SeqState:
    slot: int
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0
    # (position, snapshot id): the request's next step also writes the linear state after its first
    # `position` tokens, a point inside that step's chunk, into that snapshot (the prefix cache's
    # in-step snapshot, runtime/cache/prefix_cache.py); None: none
    snapshot: tuple[int, int] | None = None


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


def step_lengths(items: list[tuple[SeqState, list[int]]]) -> tuple[list[int], list[int]]:
    """(new tokens, cached tokens) of each request of a step."""
    return [len(tokens) for _, tokens in items], [seq.num_cached for seq, _ in items]


def take_pages(items: list[tuple[SeqState, list[int]]], query_lens: list[int], kv_pool: KVPool) -> None:
    """Grow each request's page list to hold its new tokens (the scheduler usually took them already)."""
    ps = kv_pool.page_size
    for (seq, _), n in zip(items, query_lens):
        if seq.num_cached + n > len(seq.pages) * ps:
            seq.pages.extend(kv_pool.alloc(kv_pool.pages_for(seq.num_cached + n) - len(seq.pages)))


# Each field's dtype, as the step's tensors (and the static buffers) hold it.
FIELD_DTYPES = {"input_ids": np.int64, "positions": np.int64, "slot_mapping": np.int64, "logits_index": np.int64,
                "state_slots": np.int64, "snapshot_rows": np.int64, "snapshot_ids": np.int64,
                "query_start_loc": np.int32, "seq_lens": np.int32, "page_table": np.int32}


class PageTableTooNarrow(ValueError):
    """A request holds more pages than the page table it is laid out into has columns."""


def lay_out(items: list[tuple[SeqState, list[int]]], query_lens: list[int], cache_lens: list[int],
            page_size: int, out: dict[str, np.ndarray], logits_rows: list[int] | None = None) -> None:
    """Write a step's layout into `out` (FIELD_DTYPES' arrays, their shapes the padded step's:
    input_ids [T], positions [T], slot_mapping [T], logits_index [R], state_slots [B],
    snapshot_rows [B], snapshot_ids [B], query_start_loc [B + 1], seq_lens [B], page_table [B, P]),
    every element of them, padding included, so arrays reused from an earlier step keep nothing of it.

    The layout rules, stated here alone: request after request, a request's tokens contiguous;
    padded tokens get id 0, position 0 and slot_mapping -1; padded requests own no rows (their
    query_start_loc repeats the real token count), length 0 and the reserved state slot; a
    request's page_table row holds its pages, then 0; logits_index holds each request's logits
    rows (`logits_rows`: how many of its last rows, default 1), then rows that read row 0; a
    request with an in-step snapshot (`SeqState.snapshot`) has its row in the step (0 < row < its
    tokens) in snapshot_rows and its id in snapshot_ids, any other request -1 and 0.
    Pages must have been taken (`take_pages`).
    """
    assert query_lens and min(query_lens) > 0, "a step needs at least one request, each adding a token"
    ids, pos, slot_mapping, logits_index = out["input_ids"], out["positions"], out["slot_mapping"], out["logits_index"]
    state_slots, starts, seq_lens, page_table = out["state_slots"], out["query_start_loc"], out["seq_lens"], out["page_table"]
    snapshot_rows, snapshot_ids = out["snapshot_rows"], out["snapshot_ids"]
    B, T = len(items), sum(query_lens)
    P = page_table.shape[1]
    page_table.fill(0)
    if B == 1:  # one request (an idle engine's prompt, or its one decode): scalars and slices
        seq, tokens = items[0]
        pages, cached = seq.pages, cache_lens[0]
        if len(pages) > P:
            raise PageTableTooNarrow(f"a request holds {len(pages)} pages; the page table has {P} columns")
        page_table[0, :len(pages)] = pages
        starts[0] = 0
        starts[1:] = T
        seq_lens[0] = cached + T
        state_slots[0] = seq.slot
        ids[:T] = tokens
        if T == 1:
            pos[0] = cached
            slot_mapping[0] = pages[cached // page_size] * page_size + cached % page_size
        else:
            here = np.arange(cached, cached + T)
            pos[:T] = here
            slot_mapping[:T] = page_table[0, here // page_size].astype(np.int64) * page_size + here % page_size
        ends = T
    else:
        page_lens = [len(seq.pages) for seq, _ in items]
        if max(page_lens) > P:
            raise PageTableTooNarrow(f"a request holds {max(page_lens)} pages; the page table has {P} columns")
        # Every request's pages in one flat array, scattered into the rows' first len(pages) columns
        # (row-major order of the mask is request order, then page order).
        flat = np.fromiter(itertools.chain.from_iterable(seq.pages for seq, _ in items), np.int64, sum(page_lens))
        page_table[:B][np.arange(P) < np.array(page_lens)[:, None]] = flat
        q_lens = np.array(query_lens, dtype=np.int64)
        cached = np.array(cache_lens, dtype=np.int64)
        ends = q_lens.cumsum()
        starts[0] = 0
        starts[1:B + 1] = ends
        starts[B + 1:] = T  # padded requests own no rows
        seq_lens[:B] = cached + q_lens
        state_slots[:B] = [seq.slot for seq, _ in items]
        if T == B:  # one token per request (decode): row b is request b
            pos[:B] = cached
            slot_mapping[:B] = (page_table[np.arange(B), cached // page_size].astype(np.int64) * page_size
                                + cached % page_size)
            ids[:B] = [tokens[0] for _, tokens in items]
        else:
            row_req = np.repeat(np.arange(B), q_lens)
            here = np.arange(T) + (cached - (ends - q_lens))[row_req]
            pos[:T] = here
            slot_mapping[:T] = page_table[row_req, here // page_size].astype(np.int64) * page_size + here % page_size
            ids[:T] = np.fromiter(itertools.chain.from_iterable(tokens for _, tokens in items), np.int64, T)
    pos[T:] = 0
    slot_mapping[T:] = -1
    ids[T:] = 0
    seq_lens[B:] = 0
    state_slots[B:] = PADDING_SLOT
    snapshot_rows.fill(-1)
    snapshot_ids.fill(0)
    if T > B:  # a step of one token per request has no row inside a request to snapshot at
        for b in [b for b, (seq, _) in enumerate(items) if seq.snapshot is not None]:  # a few, if any
            position, snapshot = items[b][0].snapshot
            snapshot_rows[b], snapshot_ids[b] = position - cache_lens[b], snapshot
            assert 0 < position - cache_lens[b] < query_lens[b], f"in-step snapshot at {position}, outside the step"

    if logits_rows is None:
        R = B
        logits_index[:B] = ends - 1
    else:
        rows = np.array(logits_rows, dtype=np.int64)
        assert rows.shape == (B,) and (rows >= 1).all() and (rows <= np.array(query_lens)).all(), (logits_rows, query_lens)
        R = int(rows.sum())
        # row r of request b: ends[b] - rows[b] + r, for r < rows[b]
        logits_index[:R] = np.repeat(ends - rows, rows) + np.arange(R) - np.repeat(rows.cumsum() - rows, rows)
    logits_index[R:] = 0


def build_step(items: list[tuple[SeqState, list[int]]], kv_pool: KVPool, device="cpu",
               mode: Mode | None = None, pad_tokens_to: int | None = None,
               pad_seqs_to: int | None = None, max_pages: int | None = None,
               logits_rows: list[int] | None = None) -> StepInputs:
    """items: (request state, new token ids) for each request of the step, in order.

    logits_rows: for each request, how many of its last rows get logits (default 1: the row that
    predicts its next token). A request scoring its prompt asks for more; its rows stay in order,
    so each request's last logits row is still the one its next token is sampled from.

    The step's own arrays, laid out by `lay_out` (which states the layout and padding rules), as
    tensors on `device`. A replayed step is laid out straight into the static buffers' host block
    instead (runtime/graphs/staging.py, `StepStaging.lay_out`).

    Every step of the engine passes through here on the host, so the layout is computed with
    whole-array numpy operations (one per field) rather than per-request torch calls: at 128
    decoding requests that is the difference between a fraction of a millisecond and several.
    """
    assert items, "a step needs at least one request"
    device = torch.device(device)
    query_lens, cache_lens = step_lengths(items)
    take_pages(items, query_lens, kv_pool)
    B, T = len(items), sum(query_lens)
    T_pad = max(T, pad_tokens_to or 0)
    B_pad = max(B, pad_seqs_to or 0)
    P = max(max_pages or 0, max(len(seq.pages) for seq, _ in items), 1)
    R = B if logits_rows is None else sum(logits_rows)
    shapes = {"input_ids": (T_pad,), "positions": (T_pad,), "slot_mapping": (T_pad,), "logits_index": (R,),
              "state_slots": (B_pad,), "snapshot_rows": (B_pad,), "snapshot_ids": (B_pad,),
              "query_start_loc": (B_pad + 1,), "seq_lens": (B_pad,), "page_table": (B_pad, P)}
    out = {name: np.empty(shape, dtype=FIELD_DTYPES[name]) for name, shape in shapes.items()}
    lay_out(items, query_lens, cache_lens, kv_pool.page_size, out, logits_rows)
    # queued from pinned memory on cuda: a pageable copy would wait for every queued kernel
    t = {name: array_to_device(a, device) for name, a in out.items()}
    ctx = ExecContext(
        mode=mode or step_mode(query_lens, cache_lens), query_lens=query_lens, cache_lens=cache_lens,
        query_start_loc=t["query_start_loc"], seq_lens=t["seq_lens"], state_slots=t["state_slots"],
        page_table=t["page_table"], slot_mapping=t["slot_mapping"], page_size=kv_pool.page_size, num_tokens=T_pad,
        num_seqs=B_pad, snapshot_rows=t["snapshot_rows"], snapshot_ids=t["snapshot_ids"],
    )
    ctx.check()
    return StepInputs(t["input_ids"], t["positions"], t["logits_index"], ctx)


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
