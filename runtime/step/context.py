"""ExecContext: everything an op needs to know about one step, made by the runtime for that step.

Ops receive only compute tensors and their layer id (see compiler/splitops/ops.py); which token
belongs to which request, where each request's pages and state slot are, and which mode the step
is in, is here. There is no global "current step": the runtime hands the context to the bound
op table (`runtime/step/bound_ops.py`) for the duration of the step.

Layout (B requests, T tokens, tokens of a request contiguous and in request order)::

    query_start_loc [B+1] int32   request b's tokens are rows query_start_loc[b]:query_start_loc[b+1]
    seq_lens        [B]   int32   tokens in the cache after this step (cached + new)
    state_slots     [B]   int64   slot of each request in the state pool (padding rows: the reserved slot)
    page_table      [B,P] int32   KV page ids of each request, in order (unused entries: 0)
    slot_mapping    [T]   int64   flat KV index page*page_size+offset of each token (padding: -1)
    snapshot_rows   [B]   int64   in-step snapshot of each request: the state after its first r tokens
    snapshot_ids    [B]   int64   of the step goes to snapshot snapshot_ids[b] (r = snapshot_rows[b],
                                  0 < r < its tokens; -1 and 0: none). The prefix cache asks for them
                                  only of backends that write them (`writes_step_snapshots`,
                                  runtime/backends/protocol.py); None: a step made without them, none

`query_lens` / `cache_lens` repeat the per-request lengths as host ints, so reference
backends and planners never read them back from the device.
"""

from __future__ import annotations

import dataclasses

import torch

from compiler.splitops import Mode

__all__ = ["ExecContext"]


@dataclasses.dataclass
class ExecContext:
    mode: Mode
    query_lens: list[int]  # new tokens of each real request
    cache_lens: list[int]  # tokens each real request had in the cache before this step
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    state_slots: torch.Tensor
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    page_size: int
    num_tokens: int  # rows of the step's tensors, padding included
    num_seqs: int  # requests in the step, padding included
    snapshot_rows: torch.Tensor | None = None
    snapshot_ids: torch.Tensor | None = None

    @property
    def num_real_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_real_tokens(self) -> int:
        return sum(self.query_lens)

    def token_ranges(self):
        """(request index, first row, row count, cached tokens) of each real request."""
        start = 0
        for b, (n, cached) in enumerate(zip(self.query_lens, self.cache_lens)):
            yield b, start, n, cached
            start += n

    def check(self) -> None:
        """Invariants a step builder must keep; cheap enough to run on every CPU step."""
        assert len(self.query_lens) == len(self.cache_lens), "query_lens and cache_lens differ in length"
        assert self.num_real_tokens <= self.num_tokens, (
            f"{self.num_real_tokens} real tokens do not fit the step's {self.num_tokens} rows")
        assert self.num_real_seqs <= self.num_seqs
        assert self.slot_mapping.shape[0] == self.num_tokens, "slot_mapping needs one entry per row"
        assert self.state_slots.shape[0] == self.num_seqs and self.seq_lens.shape[0] == self.num_seqs
        assert self.snapshot_rows is None or self.snapshot_rows.shape[0] == self.snapshot_ids.shape[0] == self.num_seqs
        if self.mode == Mode.DECODE:
            assert all(n == 1 for n in self.query_lens), "a decode step has one token per request"

