"""The step-runner interface the engine holds, and the eager step runner.

A step runner runs one program's steps over the engine's op table and pools. The engine holds
exactly one and calls `execute(seq_items, logits_rows) -> (mode, logits, hidden)` for every step of
the main program, whatever runs it:

- `GraphRunner` (runtime/graphs/runner.py): captured graphs per bucket, eager above them;
- `EagerRunner` (here): a bound forward, every step planned on the host and run eagerly.

Both lay a step out with `build(items, mode, logits_rows) -> (step, key)` and run it with
`run_outputs(step, key, input_ids=None, logits_index=None) -> [logits, hidden]`, which is what the
speculative decoder's drafter uses for the draft program (runtime/engine/speculative.py);
`execute` is those two calls (`run_step`), its `input_ids` (a `RowsAt`) the ids of the rows the
engine built with placeholders (an overlapped step: the step before chose them on the device).
`counters`: how many steps ran each way, for Engine.stats (a graph runner's graph_replays /
piecewise_steps / eager_steps; an eager runner keeps none: every step it runs is eager, and
/metrics counts those from the engine's steps).

It does not build requests or sample (the engine does) nor capture graphs (the graph runner does).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from compiler.splitops import Mode
from runtime.backends.protocol import plan_eager_step
from runtime.cache.batch import RowsAt, SeqState, StepInputs, build_step, write_rows
from runtime.cache.kv_pool import KVPool
from runtime.step.bound_ops import BoundOps

__all__ = ["StepRunner", "EagerRunner", "run_step"]


class StepRunner(Protocol):
    ops: BoundOps
    kv_pool: KVPool
    counters: dict

    def build(self, items: list[tuple[SeqState, list[int]]], mode: Optional[Mode] = None,
              logits_rows: Optional[list[int]] = None) -> tuple[StepInputs, object]: ...

    def run_outputs(self, step: StepInputs, key, input_ids: Optional[torch.Tensor | RowsAt] = None,
                    logits_index: Optional[torch.Tensor] = None) -> list[torch.Tensor]: ...

    def execute(self, items: list[tuple[SeqState, list[int]]], logits_rows: Optional[list[int]] = None,
                input_ids: Optional[RowsAt] = None) -> tuple[Mode, torch.Tensor, Optional[torch.Tensor]]: ...


def run_step(runner: StepRunner, items: list[tuple[SeqState, list[int]]], logits_rows: Optional[list[int]] = None,
             input_ids: Optional[RowsAt] = None) -> tuple[Mode, torch.Tensor, Optional[torch.Tensor]]:
    """The engine's step on `runner`: build and run; (the step's mode, logits [R, V], the hidden
    states of the real tokens [T, H] where the program returns them, else None). input_ids: ids on
    the device for the rows built with placeholders (the engine's overlapped steps).

    After a full graph the outputs are the graph's static buffers: read them before the next step."""
    step, key = runner.build(items, logits_rows=logits_rows)
    outputs = runner.run_outputs(step, key, input_ids=input_ids)
    return step.ctx.mode, outputs[0], outputs[1] if len(outputs) > 1 else None


class EagerRunner:
    """A program's steps without graphs: `build` lays a step out, `run_outputs` plans and runs it eagerly.

    forward(input_ids, positions, [hidden,] logits_index) returns logits or (logits, hidden) (an
    eager family model's forward, or a loaded artifact's bound program). chunk_size: what
    `init_chunk_metadata` is told (the engine's token budget)."""

    def __init__(self, forward: Callable, ops: BoundOps, kv_pool: KVPool, device, chunk_size: int,
                 takes_hidden: bool = False):
        self.forward, self.ops, self.kv_pool = forward, ops, kv_pool
        self.device, self.chunk_size, self.takes_hidden = device, chunk_size, takes_hidden
        self.counters: dict = {}

    def build(self, items, mode: Optional[Mode] = None, logits_rows=None) -> tuple[StepInputs, None]:
        return build_step(items, self.kv_pool, self.device, mode=mode, logits_rows=logits_rows), None

    @torch.no_grad()
    def run_outputs(self, step: StepInputs, key=None, input_ids: Optional[torch.Tensor | RowsAt] = None,
                    logits_index: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        plan_eager_step(self.ops.backend, step.ctx, self.chunk_size)
        write_rows(step.input_ids, input_ids, step.ctx.num_real_tokens, "input ids")  # the step's own tensor, on the device
        rows = step.logits_index.to(self.device)
        write_rows(rows, logits_index, rows.shape[0], "logits rows")
        inputs = (step.input_ids, step.positions)
        if self.takes_hidden:
            inputs += (step.hidden.to(self.device),)
        with self.ops.step(step.ctx):
            out = self.forward(*inputs, rows)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def execute(self, items, logits_rows=None, input_ids: Optional[RowsAt] = None
                ) -> tuple[Mode, torch.Tensor, Optional[torch.Tensor]]:
        return run_step(self, items, logits_rows, input_ids)
