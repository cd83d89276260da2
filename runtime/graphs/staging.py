"""Static step staging: the device buffers every captured graph reads a step's inputs from.

`StepStaging` holds them (one packed block, its int64 fields then its int32 ones, filled by one
host-to-device copy, and the draft program's hidden states); `lay_out` writes a step straight
into the host block's views for its capture key (the graph runner's steps) and `stage` sends it
over, or copies a step built elsewhere (`build_step`'s own tensors) in and refuses one that does
not fit. `step_on_device` moves an eager step's own tensors instead (no graph reads them, so they
may be of any size). The graph runner decides which of the two a step gets. `hidden_input_spec`
reads the width and dtype of the draft program's hidden-state input, the one input a step does
not lay out itself; `StepStaging.with_random_hidden` makes it up for a step whose contents do not
matter (a capture's, the start-up parity check's).
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch

from compiler.splitops import Mode
from runtime.cache.batch import FIELD_DTYPES, PageTableTooNarrow, SeqState, StepInputs, lay_out, take_pages
from runtime.cache.kv_pool import KVPool
from runtime.graphs.buckets import CaptureKey
from runtime.graphs.cuda_graphs import CaptureError
from runtime.step.context import ExecContext
from runtime.step.host_copy import tensor_to_device

__all__ = ["StepStaging", "step_on_device", "hidden_input_spec"]

# The ExecContext's tensors, a step's tables besides its inputs.
CONTEXT_TABLES = ("query_start_loc", "seq_lens", "state_slots", "page_table", "slot_mapping", "snapshot_rows",
                  "snapshot_ids")


# Every field of a block starts on a multiple of FIELD_ALIGN bytes, as a tensor of its own would: Triton
# specialises a kernel on whether each pointer it takes is 16-byte aligned, so a table at an odd
# 8-byte offset (a one-request key's snapshot ids, say) would launch another build of the kernel than
# the same table elsewhere does, one that a bundle built without that layout lacks.
FIELD_ALIGN = 16


def _field_bytes(n: int, dtype: torch.dtype) -> int:
    """Bytes a field of n elements takes in the block, padding to the next field included."""
    return -(-n * dtype.itemsize // FIELD_ALIGN) * FIELD_ALIGN


class StepStaging:
    """The static step buffers: one device block of bytes, filled by one host-to-device copy.

    A replayed step's metadata is ten small tensors. Copied one by one from pageable host
    memory, each copy is a synchronous driver call of its own; here they are laid out back to
    back in a host block (pinned on CUDA), the int64 fields first, then the int32 ones, each a
    view of the block's bytes in its dtype, and the block's used prefix goes over in one
    asynchronous copy (one per dtype before: a replayed decode step's two copies, each a driver
    call on the host and a copy on the device before the graph's first kernel). The layout is
    packed per step shape (T tokens, B requests), so the prefix holds exactly that step's fields:
    every capture key has its own views into the same block, which is safe because one step runs
    at a time and each fills all of its views.

    The host block is written again only once the previous copy has left it (an event on CUDA;
    on the CPU the copy is synchronous).

    A step the graph runner builds for a key is laid out in the host block itself (`lay_out`:
    no arrays of its own, no tensors made per field); its StepInputs' tensors are the block's
    host views, valid while the block holds it. Laying another step out over a step still
    referenced copies that one's fields out first (`_detach`), so it stays whole and is copied
    in again when run (`fill`); the engine drops each step before it builds the next, so its
    steps never pay that copy.
    """

    INT64 = ("input_ids", "positions", "slot_mapping", "logits_index", "state_slots", "snapshot_rows", "snapshot_ids")
    INT32 = ("query_start_loc", "seq_lens", "page_table")
    PER_TOKEN = ("input_ids", "positions", "slot_mapping")

    def __init__(self, max_tokens: int, max_seqs: int, max_pages: int, device: torch.device,
                 hidden: tuple[int, torch.dtype] | None = None):
        """hidden: (width, dtype) of the program's hidden-state input (the draft's, `hidden_input_spec`),
        which gets a static buffer [max_tokens, width] of its own; None: the program takes none."""
        self.max_tokens, self.max_seqs, self.max_pages, self.device = max_tokens, max_seqs, max_pages, device
        cuda = device.type == "cuda"
        size = self._size(max_tokens, max_seqs)
        self.host = torch.zeros(size, dtype=torch.uint8, pin_memory=cuda)
        self.dev = torch.zeros(size, dtype=torch.uint8, device=device)
        self._event = torch.cuda.Event() if cuda else None
        # The device's index, resolved once: Event.record() without a stream looks the current
        # device and stream up through torch's Python helpers, a measurable share of a replayed
        # decode step's host time (benchmarks/probes/replay_host_probe.py).
        self._device_index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
        self._views: dict[tuple[int, int, int], tuple[dict, dict, dict]] = {}
        self.hidden = torch.zeros(max_tokens, hidden[0], dtype=hidden[1], device=device) if hidden else None
        self._keys: dict[CaptureKey, _KeyLayout] = {}
        # The step laid out in the host block (`lay_out`), weakly (once its caller drops it nothing
        # need be kept), and its key.
        self._resident: weakref.ref | None = None
        self._resident_key: CaptureKey | None = None

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

    def _fields(self):
        """(name, dtype) of every field in block order: the int64 ones, then the int32 ones."""
        return [(n, torch.int64) for n in self.INT64] + [(n, torch.int32) for n in self.INT32]

    def _size(self, T: int, B: int) -> int:
        # logits rows are at most T (one per token: a target_verify step checks every token)
        return sum(_field_bytes(math.prod(self.shape(n, T, B, max(T, B))), dt) for n, dt in self._fields())

    def views(self, T: int, B: int, R: int | None = None) -> tuple[dict, dict, int]:
        """(host numpy views, device views, used bytes of the block) of the layout for T tokens, B
        requests and R logits rows (default B)."""
        R = B if R is None else R
        if (T, B, R) not in self._views:
            host, dev, at = {}, {}, 0
            for name, dt in self._fields():
                shape = self.shape(name, T, B, R)
                n = math.prod(shape)
                end = at + n * dt.itemsize
                host[name] = self.host[at:end].view(dt).view(shape).numpy()
                dev[name] = self.dev[at:end].view(dt).view(shape)
                at += _field_bytes(n, dt)
            self._views[(T, B, R)] = (host, dev, at)
        return self._views[(T, B, R)]

    def _claim_host(self) -> None:
        """Before the host block is written: the step laid out in it is copied out if still
        referenced, and the previous step's copy has left it."""
        if self._resident is not None:
            self._detach()
        if self._event is not None:
            self._event.synchronize()

    def _send(self, prefix: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The block's used prefix (device, host) over in one copy (queued on CUDA)."""
        dev, host = prefix
        dev.copy_(host, non_blocking=True)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self._device_index))

    def _prefix(self, used: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dev[:used], self.host[:used]

    def fill(self, T: int, B: int, sources: dict[str, torch.Tensor], R: int | None = None) -> dict[str, torch.Tensor]:
        """Copy a step's host tensors in and send them over; returns the device views."""
        host, dev, used = self.views(T, B, R)
        self._claim_host()
        for name, src in sources.items():
            a, h = src.numpy(), host[name]
            # a host-built step's fields come as lay_out makes them for its own shape: its
            # page_table as wide as its longest request, its logits_index a row per real logits
            # row; the rest of the key's view is padded as lay_out pads it (0)
            if name == "page_table":
                h[:, : a.shape[1]] = a
                h[:, a.shape[1]:] = 0
            else:
                h[: a.shape[0]] = a
                h[a.shape[0]:] = 0
        self._send(self._prefix(used))
        return dev

    def _key_layout(self, key: CaptureKey) -> _KeyLayout:
        """The key's views and copies (made once), or CaptureError for a key larger than the buffers."""
        layout = self._keys.get(key)
        if layout is None:
            T, B, R = key.tokens, key.seqs, key.logits_rows
            if T > self.max_tokens or B > self.max_seqs:
                raise CaptureError(f"step does not fit {key}: the buffers hold {self.max_tokens} tokens, "
                                   f"{self.max_seqs} requests")
            host, dev, used = self.views(T, B, R)
            layout = self._keys[key] = _KeyLayout(key, host, dev, self._prefix(used), self.hidden)
        return layout

    def lay_out(self, items: list[tuple[SeqState, list[int]]], key: CaptureKey, mode: Mode,
                query_lens: list[int], cache_lens: list[int], kv_pool: KVPool,
                logits_rows: list[int] | None = None) -> StepInputs:
        """A step padded to `key`, laid out straight into the host block's views for it
        (runtime/cache/batch.py `lay_out`: the same values `build_step` gives, padding included).
        Its StepInputs' tensors are those host views; `stage` then only sends them over.
        query_lens / cache_lens: the requests' (`step_lengths`), which the caller had to choose the key."""
        layout = self._key_layout(key)
        T, B = sum(query_lens), len(items)
        if T > key.tokens or B > key.seqs:
            raise CaptureError(f"step of {T} tokens, {B} requests does not fit {key}")
        take_pages(items, query_lens, kv_pool)
        self._claim_host()
        try:
            lay_out(items, query_lens, cache_lens, kv_pool.page_size, layout.host, logits_rows)
        except PageTableTooNarrow as e:
            raise CaptureError(f"{e}; the runner was built for {self.max_pages}") from None
        assert mode != Mode.DECODE or T == B, "a decode step has one token per request"
        h = layout.host_t
        ps = kv_pool.page_size
        step = StepInputs(h["input_ids"], h["positions"],
                          h["logits_index"] if logits_rows is None and B == key.logits_rows
                          else h["logits_index"][: B if logits_rows is None else sum(logits_rows)],
                          ExecContext(mode, query_lens, cache_lens, page_size=ps, num_tokens=key.tokens,
                                      num_seqs=key.seqs, **{name: h[name] for name in CONTEXT_TABLES}))
        self._resident, self._resident_key = weakref.ref(step), key
        return step

    def _detach(self) -> None:
        """The step laid out in the host block gets copies of its fields (its StepInputs and context
        changed in place, for whoever holds them), so a step laid out next may overwrite the block."""
        step = self._resident()
        self._resident = self._resident_key = None
        if step is None:
            return
        step.input_ids, step.positions, step.logits_index = (
            step.input_ids.clone(), step.positions.clone(), step.logits_index.clone())
        ctx = step.ctx
        for name in CONTEXT_TABLES:
            setattr(ctx, name, getattr(ctx, name).clone())

    def release(self, step: StepInputs) -> None:
        """Copy the step's fields out of the host block if they are laid out there (a step about to be
        moved as it is, not through `stage`)."""
        if self._resident is not None and self._resident() is step:
            self._detach()

    def stage(self, step: StepInputs, key: CaptureKey) -> tuple[dict[str, torch.Tensor], ExecContext]:
        """Copy a host-built step padded to `key` in: (its inputs as device views sized to the key, by
        input name, the hidden states included where the program takes them; the step's context on
        the static views). A step larger than the buffers or not padded to the key is refused."""
        if self._resident is not None and self._resident() is step:
            if self._resident_key == key:  # laid out in place (`lay_out`): send it as it is
                layout, ctx = self._keys[key], step.ctx
                self._send(layout.prefix)
                inputs = dict(layout.inputs)
                if self.hidden is not None:
                    self._stage_hidden(step, inputs["hidden"])
                d = layout.dev  # a context of its own per run, as for a copied-in step
                return inputs, ExecContext(ctx.mode, ctx.query_lens, ctx.cache_lens, page_size=ctx.page_size,
                                           num_tokens=key.tokens, num_seqs=key.seqs,
                                           **{name: d[name] for name in CONTEXT_TABLES})
            self._detach()  # laid out for another key: copied in as a host-built step
        ctx = step.ctx
        T, B, R = key.tokens, key.seqs, key.logits_rows
        self._key_layout(key)  # refuses a key the buffers do not hold
        pages = ctx.page_table.shape[1]
        if pages > self.max_pages:
            raise CaptureError(f"a request holds {pages} pages; the runner was built for {self.max_pages}")
        sources = {"input_ids": step.input_ids, "positions": step.positions, "logits_index": step.logits_index,
                   **{name: getattr(ctx, name) for name in CONTEXT_TABLES}}
        for name, src in sources.items():
            rows = self.shape(name, T, B, R)[0]
            # build_step pads every field to the key; only logits_index has a row per real request
            if src.shape[0] > rows or (src.shape[0] != rows and name != "logits_index"):
                raise CaptureError(f"step does not fit {key}: {name} has {src.shape[0]} rows for {rows}")
        v = self.fill(T, B, sources, R)
        static_ctx = dataclasses.replace(ctx, num_tokens=T, num_seqs=B, **{name: v[name] for name in CONTEXT_TABLES})
        inputs = {name: v[name] for name in ("input_ids", "positions", "logits_index")}
        if self.hidden is not None:
            inputs["hidden"] = self.hidden[:T]
            self._stage_hidden(step, inputs["hidden"])
        return inputs, static_ctx

    @staticmethod
    def _stage_hidden(step: StepInputs, hidden: torch.Tensor) -> None:
        if step.hidden is None:
            raise CaptureError("the program takes hidden states: build the step with them (StepInputs.hidden)")
        n = step.hidden.shape[0]
        hidden[:n].copy_(step.hidden, non_blocking=True)
        hidden[n:].zero_()  # padding rows: finite values a padded op may read

    def with_random_hidden(self, step: StepInputs, generator: torch.Generator) -> StepInputs:
        """The step with random hidden states for its real tokens (zeros for padding rows), if the
        program takes them: for a step whose contents do not matter."""
        if self.hidden is None:
            return step
        hidden = torch.zeros(step.ctx.num_tokens, self.hidden.shape[1], dtype=self.hidden.dtype)
        hidden[: step.ctx.num_real_tokens] = torch.randn(step.ctx.num_real_tokens, hidden.shape[1], generator=generator)
        return dataclasses.replace(step, hidden=hidden)


class _KeyLayout:
    """What a key's steps use at every step, resolved once: the host views (numpy, for `lay_out`,
    and as tensors, a laid-out step's own), the device views, the used block prefix (device, host)
    `_send` copies and the program's inputs as device views."""

    def __init__(self, key: CaptureKey, host: dict, dev: dict, prefix: tuple, hidden: torch.Tensor | None):
        for name, a in host.items():
            assert a.dtype == FIELD_DTYPES[name], (name, a.dtype)
        self.host, self.dev, self.prefix = host, dev, prefix
        self.host_t = {name: torch.from_numpy(a) for name, a in host.items()}
        self.inputs = {name: dev[name] for name in ("input_ids", "positions", "logits_index")}
        if hidden is not None:
            self.inputs["hidden"] = hidden[: key.tokens]


def step_on_device(step: StepInputs, device,
                   names: tuple[str, ...] = ("input_ids", "positions", "logits_index")) -> tuple[tuple, ExecContext]:
    """An eager step's inputs named `names` (a program's PROGRAM_INPUTS: the draft's include its
    hidden states) and context on `device`: its own tensors, so it may be of any size (no graph
    reads them). Copied from pinned memory on CUDA: a pageable copy would wait for the queued steps."""
    ctx = step.ctx
    moved = {name: tensor_to_device(getattr(ctx, name), device) for name in CONTEXT_TABLES}
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
