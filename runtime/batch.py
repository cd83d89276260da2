"""Turn "these requests add these tokens" into the tensors of one step and its ExecContext.

1. Each request holds a `SeqState`: its state slot, its KV pages and how many tokens are cached.
2. `build_step` grows each request's page list to fit the new tokens (pages come from the KV
   pool), lays the tokens out request after request, and fills the context tensors.
3. After the model ran, `commit_step` advances each request's cached-token count.

Padding (`pad_tokens_to`, `pad_seqs_to`) is done here and only here: padded tokens get position
0, slot_mapping -1 and no logits row; padded requests get the reserved state slot.
"""

from __future__ import annotations

import dataclasses

import torch

from compiler.splitops import Mode
from runtime.context import ExecContext
from runtime.kv_pool import KVPool
from runtime.state_pool import PADDING_SLOT

__all__ = ["SeqState", "StepInputs", "build_step", "commit_step", "step_mode"]


@dataclasses.dataclass
class SeqState:
    slot: int
    pages: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0


@dataclasses.dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_index: torch.Tensor  # [B] int64: the last row of each real request
    ctx: ExecContext


def step_mode(query_lens: list[int], cache_lens: list[int]) -> Mode:
    decoding = [n == 1 and c > 0 for n, c in zip(query_lens, cache_lens)]
    if all(decoding):
        return Mode.DECODE
    if not any(decoding):
        return Mode.EXTEND
    return Mode.MIXED


def build_step(items: list[tuple[SeqState, list[int]]], kv_pool: KVPool, device="cpu",
               mode: Mode | None = None, pad_tokens_to: int | None = None,
               pad_seqs_to: int | None = None, max_pages: int | None = None) -> StepInputs:
    """items: (request state, new token ids) for each request of the step, in order."""
    assert items, "a step needs at least one request"
    ps = kv_pool.page_size
    query_lens = [len(tokens) for _, tokens in items]
    cache_lens = [seq.num_cached for seq, _ in items]
    assert all(n > 0 for n in query_lens), "every request in a step adds at least one token"
    for seq, tokens in items:
        need = kv_pool.pages_for(seq.num_cached + len(tokens)) - len(seq.pages)
        if need > 0:
            seq.pages.extend(kv_pool.alloc(need))

    T = sum(query_lens)
    B = len(items)
    T_pad = max(T, pad_tokens_to or 0)
    B_pad = max(B, pad_seqs_to or 0)
    P = max(max_pages or 0, max(len(seq.pages) for seq, _ in items), 1)

    input_ids = torch.zeros(T_pad, dtype=torch.long)
    positions = torch.zeros(T_pad, dtype=torch.long)
    slot_mapping = torch.full((T_pad,), -1, dtype=torch.long)
    query_start_loc = torch.zeros(B_pad + 1, dtype=torch.int32)
    seq_lens = torch.zeros(B_pad, dtype=torch.int32)
    state_slots = torch.full((B_pad,), PADDING_SLOT, dtype=torch.long)
    page_table = torch.zeros(B_pad, P, dtype=torch.int32)
    logits_index = torch.zeros(B, dtype=torch.long)

    row = 0
    for b, (seq, tokens) in enumerate(items):
        n = len(tokens)
        pos = torch.arange(seq.num_cached, seq.num_cached + n)
        pages = torch.tensor(seq.pages, dtype=torch.long)
        input_ids[row:row + n] = torch.tensor(tokens, dtype=torch.long)
        positions[row:row + n] = pos
        slot_mapping[row:row + n] = pages[pos // ps] * ps + pos % ps
        seq_lens[b] = seq.num_cached + n
        state_slots[b] = seq.slot
        page_table[b, : len(seq.pages)] = pages.to(torch.int32)
        row += n
        query_start_loc[b + 1] = row
        logits_index[b] = row - 1
    query_start_loc[B + 1:] = row  # padded requests own no rows

    ctx = ExecContext(
        mode=mode or step_mode(query_lens, cache_lens), query_lens=query_lens, cache_lens=cache_lens,
        query_start_loc=query_start_loc.to(device), seq_lens=seq_lens.to(device),
        state_slots=state_slots.to(device), page_table=page_table.to(device),
        slot_mapping=slot_mapping.to(device), page_size=ps, num_tokens=T_pad, num_seqs=B_pad,
    )
    ctx.check()
    return StepInputs(input_ids.to(device), positions.to(device), logits_index.to(device), ctx)


def commit_step(items: list[tuple[SeqState, list[int]]]) -> None:
    for seq, tokens in items:
        seq.num_cached += len(tokens)
