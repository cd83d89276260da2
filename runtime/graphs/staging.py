"""Static step staging: the device buffers every captured graph reads a step's inputs from.

`StepStaging` holds them (two packed blocks, one per dtype, filled by one host-to-device copy
each, and the draft program's hidden states); `stage` copies a step padded to its capture key in
and refuses one that does not fit. `step_on_device` moves an eager step's own tensors instead (no
graph reads them, so they may be of any size). The graph runner decides which of the two a step
gets. `hidden_input_spec` reads the width and dtype of the draft program's hidden-state input, the
one input a step does not lay out itself; `StepStaging.with_random_hidden` makes it up for a step
whose contents do not matter (a capture's, the start-up parity check's).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from runtime.cache.batch import StepInputs
from runtime.graphs.buckets import CaptureKey
from runtime.graphs.cuda_graphs import CaptureError
from runtime.step.context import ExecContext
from runtime.step.host_copy import tensor_to_device

__all__ = ["StepStaging", "step_on_device", "hidden_input_spec"]


class StepStaging:
    """The static step buffers: two device blocks (int64, int32), each filled by one host-to-device copy.

    A replayed step's metadata is eight small tensors. Copied one by one from pageable host
    memory, each copy is a synchronous driver call of its own; here they are laid out back to
    back in a host block (pinned on CUDA) and the block's used prefix goes over in one
    asynchronous copy per dtype. The layout is packed per step shape (T tokens, B requests), so
    the prefix holds exactly that step's fields: every capture key has its own views into the
    same blocks, which is safe because one step runs at a time and each fills all of its views.

    The host block is written again only once the previous copy has left it (an event on CUDA;
    on the CPU the copy is synchronous). Rows a step does not fill are padding: build_step pads
    every field but logits_index, whose spare rows read row 0, and page_table's spare columns.
    """

    INT64 = ("input_ids", "positions", "slot_mapping", "logits_index", "state_slots")
    INT32 = ("query_start_loc", "seq_lens", "page_table")
    PER_TOKEN = ("input_ids", "positions", "slot_mapping")

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, device: torch.device,
                 hidden: tuple[int, torch.dtype] | None = None):
        """hidden: (width, dtype) of the program's hidden-state input (the draft's, `hidden_input_spec`),
        which gets a static buffer [max_tokens, width] of its own; None: the program takes none."""
        self.max_tokens, self.max_seqs, self.max_pages, self.device = max_tokens, max_seqs, max_pages, device
        cuda = device.type == "cuda"
        sizes = {torch.int64: self._size(self.INT64, max_tokens, max_seqs),
                 torch.int32: self._size(self.INT32, max_tokens, max_seqs)}
        self.host = {dt: torch.zeros(n, dtype=dt, pin_memory=cuda) for dt, n in sizes.items()}
        self.dev = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in sizes.items()}
        self._event = torch.cuda.Event() if cuda else None
        # The device's index, resolved once: Event.record() without a stream looks the current
        # device and stream up through torch's Python helpers, a measurable share of a replayed
        # decode step's host time (benchmarks/probes/replay_host_probe.py).
        self._device_index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
        self._views: dict[tuple[int, int, int], tuple[dict, dict, dict]] = {}
        self.hidden = torch.zeros(max_tokens, hidden[0], dtype=hidden[1], device=device) if hidden else None

    def shape(self, name: str, T: int, B: int, R: int | None = None) -> tuple[int, ...]:
        """The field's shape for T tokens, B requests and R logits rows (default B)."""
        if name in self.PER_TOKEN:
            return (T,)
        if name == "query_start_loc":
            return (B + 1,)
        if name == "page_table":
            return (B, self.max_pages)
        if name == "logits_index":
            return (B if R is None else R,)
        return (B,)

    def _size(self, names, T: int, B: int) -> int:
        # logits rows are at most T (one per token: a target_verify step checks every token)
        return sum(math.prod(self.shape(n, T, B, max(T, B))) for n in names)

    def views(self, T: int, B: int, R: int | None = None) -> tuple[dict, dict, dict]:
        """(host numpy views, device views, used length per dtype) of the layout for T tokens, B
        requests and R logits rows (default B)."""
        R = B if R is None else R
        if (T, B, R) not in self._views:
            host, dev, used = {}, {}, {}
            for dt, names in ((torch.int64, self.INT64), (torch.int32, self.INT32)):
                at = 0
                for name in names:
                    shape = self.shape(name, T, B, R)
                    n = math.prod(shape)
                    host[name] = self.host[dt][at: at + n].view(shape).numpy()
                    dev[name] = self.dev[dt][at: at + n].view(shape)
                    at += n
                used[dt] = at
            self._views[(T, B, R)] = (host, dev, used)
        return self._views[(T, B, R)]

    def fill(self, T: int, B: int, sources: dict[str, torch.Tensor], R: int | None = None) -> dict[str, torch.Tensor]:
        """Copy a step's host tensors in and send them over; returns the device views."""
        host, dev, used = self.views(T, B, R)
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy has left the host block
        for name, src in sources.items():
            a, h = src.numpy(), host[name]
            if name == "page_table":  # as wide as the longest request: the columns after it are 0
                h[:, : a.shape[1]] = a
                h[:, a.shape[1]:] = 0
            else:
                h[: a.shape[0]] = a
                h[a.shape[0]:] = 0  # only logits_index comes short: its padded rows read row 0
        for dt, n in used.items():
            self.dev[dt][:n].copy_(self.host[dt][:n], non_blocking=True)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self._device_index))
        return dev

    def stage(self, step: StepInputs, key: CaptureKey) -> tuple[dict[str, torch.Tensor], ExecContext]:
        """Copy a host-built step padded to `key` in: (its inputs as device views sized to the key, by
        input name, the hidden states included where the program takes them; the step's context on
        the static views). A step larger than the buffers or not padded to the key is refused."""
        ctx = step.ctx
        T, B, R = key.tokens, key.seqs, key.logits_rows
        if T > self.max_tokens or B > self.max_seqs:
            raise CaptureError(f"step does not fit {key}: the buffers hold {self.max_tokens} tokens, {self.max_seqs} requests")
        pages = ctx.page_table.shape[1]
        if pages > self.max_pages:
            raise CaptureError(f"a request holds {pages} pages; the runner was built for {self.max_pages}")
        sources = {"input_ids": step.input_ids, "positions": step.positions, "slot_mapping": ctx.slot_mapping,
                   "logits_index": step.logits_index, "state_slots": ctx.state_slots,
                   "query_start_loc": ctx.query_start_loc, "seq_lens": ctx.seq_lens, "page_table": ctx.page_table}
        for name, src in sources.items():
            rows = self.shape(name, T, B, R)[0]
            # build_step pads every field to the key; only logits_index has a row per real request
            if src.shape[0] > rows or (src.shape[0] != rows and name != "logits_index"):
                raise CaptureError(f"step does not fit {key}: {name} has {src.shape[0]} rows for {rows}")
        v = self.fill(T, B, sources, R)
        static_ctx = dataclasses.replace(
            ctx, query_start_loc=v["query_start_loc"], seq_lens=v["seq_lens"], state_slots=v["state_slots"],
            page_table=v["page_table"], slot_mapping=v["slot_mapping"], num_tokens=T, num_seqs=B)
        inputs = {name: v[name] for name in ("input_ids", "positions", "logits_index")}
        if self.hidden is not None:
            if step.hidden is None:
                raise CaptureError("the program takes hidden states: build the step with them (StepInputs.hidden)")
            hidden = inputs["hidden"] = self.hidden[:T]
            n = step.hidden.shape[0]
            hidden[:n].copy_(step.hidden, non_blocking=True)
            hidden[n:].zero_()  # padding rows: finite values a padded op may read
        return inputs, static_ctx

    def with_random_hidden(self, step: StepInputs, generator: torch.Generator) -> StepInputs:
        """The step with random hidden states for its real tokens (zeros for padding rows), if the
        program takes them: for a step whose contents do not matter."""
        if self.hidden is None:
            return step
        hidden = torch.zeros(step.ctx.num_tokens, self.hidden.shape[1], dtype=self.hidden.dtype)
        hidden[: step.ctx.num_real_tokens] = torch.randn(step.ctx.num_real_tokens, hidden.shape[1], generator=generator)
        return dataclasses.replace(step, hidden=hidden)


def step_on_device(step: StepInputs, device,
                   names: tuple[str, ...] = ("input_ids", "positions", "logits_index")) -> tuple[tuple, ExecContext]:
    """An eager step's inputs named `names` (a program's PROGRAM_INPUTS: the draft's include its
    hidden states) and context on `device`: its own tensors, so it may be of any size (no graph
    reads them). Copied from pinned memory on CUDA: a pageable copy would wait for the queued steps."""
    ctx = step.ctx
    moved = {name: tensor_to_device(getattr(ctx, name), device)
             for name in ("query_start_loc", "seq_lens", "state_slots", "page_table", "slot_mapping")}
    tensors = {"input_ids": step.input_ids, "positions": step.positions, "logits_index": step.logits_index,
               "hidden": step.hidden}
    missing = [name for name in names if tensors.get(name) is None]
    if missing:
        raise ValueError(f"the step has no {missing[0]} (StepInputs.{missing[0]}), which the program takes")
    inputs = tuple(tensor_to_device(tensors[name], device) for name in names)
    return inputs, dataclasses.replace(ctx, **moved)


def hidden_input_spec(exported) -> tuple[int, torch.dtype]:
    """(width, dtype) of an exported program's `hidden` input, from its placeholder's recorded value."""
    node = next(n for n in exported.graph.nodes if n.op == "placeholder" and n.name == "hidden")
    value = node.meta["val"]
    return int(value.shape[1]), value.dtype
