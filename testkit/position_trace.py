"""Where two runs of one request first compute a position differently, op by op, over a whole run.

`PositionTrace(ops)` is a BoundOps observer for an engine that runs its main program eagerly (no
graph runner: a replayed graph calls no op). For every op call it keeps, for each row of the
step's one real request, a digest of the op's per-token inputs and of its output at that row,
under the row's position. A later step that computes a position again (a verify row that was
not kept, recomputed in the next round) replaces what an earlier one left, so each position ends
with the computation the request kept.

`first_position_parting(a, b)` walks two traces of the same request position by position and,
within a position, op by op: the first position where they differ, and there the first op handed
another input (the glue before it computed it differently) or the first op that computed another
output from the same inputs. Digests, not tensors: a whole run of a bench-size model stays small.

Used by benchmarks/probes/spec_text_probe.py (`--trace-ops`) to say where a speculative run's numbers
leave plain decoding's; one request at a time (a step of several real requests is refused).
"""

from __future__ import annotations

import hashlib
import operator
from typing import Callable

import torch

from compiler.splitops import op_spec
from runtime.graphs.parity import op_arg_positions

__all__ = ["PositionTrace", "entries_apart", "first_position_parting"]


def _digests(t: torch.Tensor, first: int, count: int) -> list[str]:
    """A short digest of each of rows first .. first + count - 1 of t (its bytes as stored)."""
    rows = t[first:first + count].detach().contiguous().cpu().reshape(count, -1)  # [rows, elements]
    raw = rows.view(torch.uint8) if rows.dtype != torch.bool else rows.to(torch.uint8)  # [rows, bytes]
    return [hashlib.blake2b(raw[i].numpy().tobytes(), digest_size=8).hexdigest() for i in range(count)]


class PositionTrace:
    def __init__(self, ops):
        """Observe `ops` (a BoundOps) from now on; `detach()` stops."""
        self.ops = ops
        # position -> [(layer, op, "input NAME" or "output", digest)] in the order of the step's ops
        self.by_position: dict[int, list[tuple[int, str, str, str]]] = {}
        self._ctx = None  # the step being recorded (held, so a new step is never the same object)
        ops.observer = self

    def detach(self) -> None:
        self.ops.observer = None

    def __call__(self, name: str, args: tuple) -> None:
        ctx = self.ops.ctx
        if ctx.num_real_seqs != 1:
            raise ValueError(f"PositionTrace follows one request; this step has {ctx.num_real_seqs}")
        (_, first, count, cached), = ctx.token_ranges()
        if ctx is not self._ctx:  # the step's first op: the positions it computes start afresh
            self._ctx = ctx
            for p in range(cached, cached + count):
                self.by_position[p] = []
        at = op_arg_positions(name)
        layer = int(args[at["layer_id"]])
        for what, tensor in [*((f"input {arg}", args[at[arg]]) for arg in op_spec(name).token_args),
                             ("output", args[at["out"]])]:
            for p, digest in zip(range(cached, cached + count), _digests(tensor, first, count)):
                self.by_position[p].append((layer, name, what, digest))


def entries_apart(a: list, b: list, same: Callable = operator.eq) -> dict | None:
    """Where two steps' ops first part, given each as entries (layer, op, "input NAME" or "output",
    value), an op's inputs then its output, in the order of the step's ops: {"entry" (its place in
    the lists), "index" (the op's place in the step), "layer", "op", "at"} of the first entry whose
    values are not `same`; {"other_ops": True} when the steps called other ops; None when all agree.
    Shared by first_position_parting (digests) and testkit/spec_checks.first_parting (tensors)."""
    if [e[:3] for e in a] != [e[:3] for e in b]:
        return {"other_ops": True}
    index = 0
    for entry, ((layer, op, at, x), (*_, y)) in enumerate(zip(a, b)):
        if not same(x, y):
            return {"entry": entry, "index": index, "layer": layer, "op": op, "at": at}
        index += at == "output"
    return None


def first_position_parting(a: PositionTrace, b: PositionTrace) -> dict | None:
    """{"position", "index" (the op's place in the step), "layer", "op", "at"} of the first difference
    between two traces of one request over the positions both computed, or {"position", "other_ops"}
    where the two steps there called other ops; None when every position agrees."""
    for p in sorted(set(a.by_position) & set(b.by_position)):
        found = entries_apart(a.by_position[p], b.by_position[p])
        if found is not None:
            found.pop("entry", None)
            return {"position": p, **found}
    return None
