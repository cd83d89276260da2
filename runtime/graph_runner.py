"""GraphRunner: captured CUDA graphs per bucket, and the one place that picks full, piecewise or eager.

The runner owns the captured keys, the static buffers and the padding; how one piece is captured
and replayed is `CapturedPiece`'s business, and what the ops do is the backend's. Lifecycle:

1. Construction: static device buffers for the largest bucket (input ids, positions, logits
   rows and every ExecContext tensor). Each step's host-built tensors are copied into them in
   place (`copy_`, never reassigned), so every captured kernel reads the same addresses.
2. `capture()` (start-up only): `backend.init_capture_state`, then for each decode bucket,
   largest first, one graph of the whole step when every op's decode policy allows it (the
   artifact's decode plan is one captured piece) or piecewise graphs otherwise; then piecewise
   graphs for each extend token bucket, largest first. All graphs share one memory pool. Padded
   rows point at the reserved state slot and write no KV. After `capture()` the runner is sealed:
   a capture at any later time is an error.
3. `run(step_items)` per step: decode steps go to the smallest decode bucket that holds them,
   extend and mixed steps to the smallest extend bucket that holds their tokens, anything larger
   runs eagerly. The backend is told first (`init_replay_state` for a full graph,
   `init_step_metadata` + `init_chunk_metadata` before a piecewise or eager step).
4. `check_parity()` (start-up, after capture): each captured key is run once eagerly and once
   from its graphs on the same inputs and the same starting caches and states; a mismatch names
   the mode, the bucket and the first layer whose op output differs, and the runner refuses to serve.

Piecewise graphs need no copies between pieces: every op is "with output", so the `out` an eager
gap writes was allocated by the captured piece before it, inside the graph pool, at an address
the next piece was captured with.

It does not build requests or sample (the engine does) and does not choose kernels (routing did).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from compiler.splitops import Mode, op_spec
from runtime.batch import SeqState, StepInputs, build_step
from runtime.bound_ops import BoundOps
from runtime.context import ExecContext
from runtime.kv_pool import KVPool
from runtime.state_pool import PADDING_SLOT

__all__ = ["GraphRunner", "CaptureKey", "CaptureError", "ParityError", "CapturedPiece", "DEFAULT_DECODE_BUCKETS",
           "DEFAULT_EXTEND_BUCKETS"]

DEFAULT_DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_EXTEND_BUCKETS = (256, 512, 1024, 2048, 4096)


class CaptureError(RuntimeError):
    pass


class ParityError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class CaptureKey:
    mode: Mode  # DECODE (full or piecewise) or EXTEND (piecewise; also serves MIXED steps)
    tokens: int  # rows of the step, padding included
    seqs: int  # requests of the step, padding included (logits rows)

    def __str__(self) -> str:
        return f"{self.mode.value}[tokens={self.tokens}, seqs={self.seqs}]"


class _Capturing:
    """Which key the pieces are capturing or replaying now: shared by the runner and its pieces."""

    def __init__(self):
        self.key: Optional[CaptureKey] = None
        self.capturing = False
        self.pool = None


class CapturedPiece(torch.nn.Module):
    """One captured piece of a split program: a CUDA graph per key, replayed with the inputs it was captured with."""

    def __init__(self, piece: torch.nn.Module, index: int, state: _Capturing, debug: bool = False):
        super().__init__()
        self.piece, self.index, self.state, self.debug = piece, index, state, debug
        self.graphs: dict[CaptureKey, tuple[torch.cuda.CUDAGraph, object, list[int]]] = {}

    def forward(self, *args):
        key = self.state.key
        if key is None:  # an eager step: no graph at all
            return self.piece(*args)
        if self.state.capturing and key not in self.graphs:
            self.piece(*args)  # warm-up outside the graph: lazy init, autotuning
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.state.pool):
                out = self.piece(*args)
            self.graphs[key] = (graph, out, [a.data_ptr() for a in args if isinstance(a, torch.Tensor)])
            graph.replay()  # the capture did not run the kernels; the step needs their results
            return out
        if key not in self.graphs:
            raise CaptureError(f"piece {self.index}: no graph for {key}; captures happen at start-up only")
        graph, out, addresses = self.graphs[key]
        if self.debug:
            now = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
            if now != addresses:
                bad = next(i for i, (a, b) in enumerate(zip(now, addresses)) if a != b)
                raise CaptureError(f"piece {self.index} {key}: input {bad} moved: captured at {addresses[bad]:#x}, "
                                   f"got {now[bad]:#x}; every input must be a static buffer")
        graph.replay()
        return out


class GraphRunner:
    def __init__(self, program, ops: BoundOps, kv_pool: KVPool, device: torch.device | str, *,
                 decode_buckets=DEFAULT_DECODE_BUCKETS, extend_buckets=DEFAULT_EXTEND_BUCKETS,
                 max_pages_per_seq: int, extend_max_seqs: int = 16, debug: bool = False):
        """program: a loaded ProgramRunner (runtime/loader.py): `module_for(mode)`, `weights`, `plans`."""
        self.program, self.ops, self.kv_pool = program, ops, kv_pool
        self.backend = ops.backend
        self.device = torch.device(device)
        self.decode_buckets = tuple(sorted(decode_buckets))
        self.extend_buckets = tuple(sorted(extend_buckets))
        self.extend_max_seqs = extend_max_seqs
        self.max_pages = max_pages_per_seq
        self.debug = debug
        self.state = _Capturing()
        self.sealed = False
        self.counters = {"graph_replays": 0, "piecewise_steps": 0, "eager_steps": 0}
        self.full_decode = self._plan_is_one_captured_piece(Mode.DECODE)
        self.keys: list[CaptureKey] = []
        max_tokens = max(self.decode_buckets[-1], self.extend_buckets[-1] if self.extend_buckets else 0)
        max_seqs = max(self.decode_buckets[-1], extend_max_seqs)
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        # Static buffers: the only tensors a captured graph reads besides weights, caches and its pool.
        d = self.device
        self.buf = {
            "input_ids": torch.zeros(max_tokens, dtype=torch.long, device=d),
            "positions": torch.zeros(max_tokens, dtype=torch.long, device=d),
            "logits_index": torch.zeros(max_seqs, dtype=torch.long, device=d),
            "slot_mapping": torch.full((max_tokens,), -1, dtype=torch.long, device=d),
            "query_start_loc": torch.zeros(max_seqs + 1, dtype=torch.int32, device=d),
            "seq_lens": torch.zeros(max_seqs, dtype=torch.int32, device=d),
            "state_slots": torch.full((max_seqs,), PADDING_SLOT, dtype=torch.long, device=d),
            "page_table": torch.zeros(max_seqs, self.max_pages, dtype=torch.int32, device=d),
        }
        self._modules: dict[Mode, torch.nn.Module] = {}
        self._outputs: dict[CaptureKey, object] = {}  # full graphs: their static logits
        self._full_graphs: dict[CaptureKey, torch.cuda.CUDAGraph] = {}
        self._op_outs: dict[CaptureKey, list[tuple[int, str, torch.Tensor]]] = {}

    # -- keys and padding ------------------------------------------------------------------

    def _plan_is_one_captured_piece(self, mode: Mode) -> bool:
        pieces = self.program.plans[mode].pieces
        return len(pieces) == 1 and pieces[0].kind == "captured"

    def key_for(self, mode: Mode, num_tokens: int, num_seqs: int) -> Optional[CaptureKey]:
        """The smallest captured key that holds this step, or None (eager)."""
        if not self.sealed:
            return None
        if mode == Mode.DECODE:
            bucket = next((b for b in self.decode_buckets if b >= num_seqs), None)
            return CaptureKey(Mode.DECODE, bucket, bucket) if bucket else None
        if num_seqs > self.extend_max_seqs:
            return None
        bucket = next((b for b in self.extend_buckets if b >= num_tokens), None)
        return CaptureKey(Mode.EXTEND, bucket, self.extend_max_seqs) if bucket else None

    def _fill(self, step: StepInputs, key: Optional[CaptureKey]) -> tuple[tuple, ExecContext]:
        """Copy a host-built step into the static buffers; views sized to the key (or the step)."""
        ctx = step.ctx
        T = key.tokens if key else ctx.num_tokens
        B = key.seqs if key else ctx.num_seqs
        R = key.seqs if key else step.logits_index.shape[0]
        b = self.buf
        for name, src, n in (("input_ids", step.input_ids, T), ("positions", step.positions, T),
                             ("slot_mapping", ctx.slot_mapping, T), ("seq_lens", ctx.seq_lens, B),
                             ("state_slots", ctx.state_slots, B), ("query_start_loc", ctx.query_start_loc, B + 1)):
            if src.shape[0] > n or n > b[name].shape[0]:
                raise CaptureError(f"step does not fit {key}: {name} has {src.shape[0]} rows for {n}")
            b[name][: src.shape[0]].copy_(src, non_blocking=True)
        pages = ctx.page_table.shape[1]
        if pages > self.max_pages:
            raise CaptureError(f"a request holds {pages} pages; the runner was built for {self.max_pages}")
        b["page_table"][: ctx.page_table.shape[0], :pages].copy_(ctx.page_table, non_blocking=True)
        b["page_table"][: ctx.page_table.shape[0], pages:].zero_()
        b["logits_index"][: step.logits_index.shape[0]].copy_(step.logits_index, non_blocking=True)
        b["logits_index"][step.logits_index.shape[0]:R].zero_()  # padded logits rows read row 0
        static_ctx = dataclasses.replace(
            ctx, query_start_loc=b["query_start_loc"][: B + 1], seq_lens=b["seq_lens"][:B],
            state_slots=b["state_slots"][:B], page_table=b["page_table"][:B], slot_mapping=b["slot_mapping"][:T],
            num_tokens=T, num_seqs=B)
        inputs = (b["input_ids"][:T], b["positions"][:T], b["logits_index"][:R])
        return inputs, static_ctx

    def build(self, items: list[tuple[SeqState, list[int]]], mode: Optional[Mode] = None) -> tuple[StepInputs, Optional[CaptureKey]]:
        """Lay a step out on the host, padded to the key that will run it."""
        probe = build_step(items, self.kv_pool, "cpu", mode=mode, max_pages=self.max_pages)
        key = self.key_for(probe.ctx.mode, probe.ctx.num_tokens, probe.ctx.num_seqs)
        if key is None:
            return probe, None
        return build_step(items, self.kv_pool, "cpu", mode=probe.ctx.mode, pad_tokens_to=key.tokens,
                          pad_seqs_to=key.seqs, max_pages=self.max_pages), key

    # -- running ---------------------------------------------------------------------------

    def _module(self, mode: Mode) -> torch.nn.Module:
        """The split module of a mode with its captured pieces wrapped (built once, reused)."""
        plan_mode = Mode.DECODE if mode == Mode.DECODE else Mode.EXTEND
        if plan_mode not in self._modules:
            split = self.program.module_for(plan_mode)
            pieces = self.program.plans[plan_mode].pieces
            for piece in pieces:
                if piece.kind == "captured":
                    name = f"submod_{piece.index}"
                    setattr(split, name, CapturedPiece(getattr(split, name), piece.index, self.state, self.debug))
            self._modules[plan_mode] = split
        return self._modules[plan_mode]

    def _call(self, module, inputs):
        outputs = module(*self.program.weights, *inputs)
        return list(outputs)[self.program.num_mutations:][0]

    def _plan_piecewise(self, ctx: ExecContext, key: Optional[CaptureKey]) -> None:
        """Tell the backend about an eager or piecewise step, before its first piece runs.

        Every child plans the step eagerly (`init_step_metadata`, plus `init_chunk_metadata`
        outside decode). In a piecewise step (a key), the children whose declared capability
        captures this mode also get `init_replay_state`: their ops sit inside captured pieces,
        and a captured op must read its per-step values (the MoE's real token count, decode
        slot ids) from the static buffers that hook fills, not from launch arguments frozen at
        capture. A child that does not capture the mode (FlashInfer or FLA in an extend) runs in
        the eager gaps on its eager plan; calling its replay hook would be refused or, worse,
        would make it treat the eager step as a replayed one.
        """
        self.backend.init_step_metadata(ctx)
        if ctx.mode != Mode.DECODE:
            self.backend.init_chunk_metadata(ctx, ctx.num_tokens)
        if key is None:
            return
        for child in tuple(getattr(self.backend, "children", ())) or (self.backend,):
            capability = getattr(type(child), "capability", None)
            if capability is not None and Mode(ctx.mode) in capability.modes_capturable:
                child.init_replay_state(ctx, key.seqs)

    @torch.no_grad()
    def run(self, step: StepInputs, key: Optional[CaptureKey]) -> torch.Tensor:
        """Run one built step; returns logits of the real requests [B, V].

        For a full graph the rows are a view of the graph's static output: the next replay of
        that key overwrites them, so read (or clone) them before the next step."""
        inputs, ctx = self._fill(step, key)
        real = step.logits_index.shape[0]
        if key is not None and key.mode == Mode.DECODE and self.full_decode:
            self.backend.init_replay_state(ctx, key.seqs)
            self._full_graphs[key].replay()
            self.counters["graph_replays"] += 1
            return self._outputs[key][:real]
        self._plan_piecewise(ctx, key)
        self.state.key = key
        try:
            with self.ops.step(ctx):
                logits = self._call(self._module(ctx.mode), inputs)
        finally:
            self.state.key = None
        self.counters["piecewise_steps" if key else "eager_steps"] += 1
        return logits[:real]

    # -- capture ---------------------------------------------------------------------------

    def _dummy_step(self, key: CaptureKey) -> tuple[StepInputs, list[SeqState]]:
        """A step of the key's shape on scratch pages and the padding slot (contents do not matter)."""
        per_seq = max(1, key.tokens // key.seqs) if key.mode != Mode.DECODE else 1
        seqs = [SeqState(PADDING_SLOT, num_cached=1 if key.mode == Mode.DECODE else 0) for _ in range(key.seqs)]
        items = [(s, [0] * per_seq) for s in seqs]
        items[-1] = (seqs[-1], [0] * (key.tokens - per_seq * (key.seqs - 1)))
        step = build_step(items, self.kv_pool, "cpu", mode=key.mode, pad_tokens_to=key.tokens,
                          pad_seqs_to=key.seqs, max_pages=self.max_pages)
        step.ctx.slot_mapping.fill_(-1)  # capture writes no KV
        return step, seqs

    def _record_op_outs(self, sink: list):
        """An observer for BoundOps: remember (layer id, op, out) of each op call."""
        def observe(name: str, args: tuple):
            positions = _arg_positions(name)
            sink.append((int(args[positions["layer_id"]]), name, args[positions["out"]]))
        return observe

    @torch.no_grad()  # a graph captured with autograd on would record its bookkeeping too
    def capture(self) -> None:
        if self.sealed:
            raise CaptureError("capture after start-up: graphs are captured once, before serving")
        if self.device.type != "cuda":
            raise CaptureError(f"CUDA graphs need a CUDA device; this runner is on {self.device}")
        self.backend.init_capture_state(self.max_tokens, self.max_seqs)
        self.state.pool = torch.cuda.graph_pool_handle()
        keys = [CaptureKey(Mode.DECODE, b, b) for b in reversed(self.decode_buckets)]
        keys += [CaptureKey(Mode.EXTEND, t, self.extend_max_seqs) for t in reversed(self.extend_buckets)
                 if t >= self.extend_max_seqs]
        for key in keys:
            step, seqs = self._dummy_step(key)
            inputs, ctx = self._fill(step, key)
            sink: list = []
            self.ops.observer = self._record_op_outs(sink)
            try:
                if key.mode == Mode.DECODE and self.full_decode:
                    self.backend.init_replay_state(ctx, key.seqs)
                    module = self.program.module_for(Mode.DECODE)
                    with self.ops.step(ctx):
                        self._call(module, inputs)  # warm-up
                        # The warm-up's op outputs are not the graph's: keep only the captured ones,
                        # which the replay overwrites and the parity check compares layer by layer.
                        sink.clear()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=self.state.pool):
                            self._outputs[key] = self._call(module, inputs)
                    self._full_graphs[key] = graph
                else:
                    self._plan_piecewise(ctx, key)
                    self.state.key, self.state.capturing = key, True
                    with self.ops.step(ctx):
                        self._call(self._module(key.mode), inputs)
            finally:
                self.state.key, self.state.capturing = None, False
                self.ops.observer = None
                for seq in seqs:
                    self.kv_pool.free(seq.pages)
            self._op_outs[key] = sink
            self.keys.append(key)
        torch.cuda.synchronize(self.device)
        self.sealed = True

    # -- start-up parity -------------------------------------------------------------------

    def check_parity(self, make_items: Callable[[CaptureKey], list[tuple[SeqState, list[int]]]],
                     rtol: float = 2e-2) -> dict[str, float]:
        """Replay each key against eager on the same inputs; raise ParityError naming the first bad layer.

        make_items(key) returns real requests (slots and pages of their own) that fill the key.
        Caches and states touched by the step are saved before the eager run and restored before
        the replay, so both start from the same state.
        """
        report = {}
        for key in self.keys:
            items = make_items(key)
            step = build_step(items, self.kv_pool, "cpu", mode=key.mode, pad_tokens_to=key.tokens,
                              pad_seqs_to=key.seqs, max_pages=self.max_pages)
            saved = self._snapshot(step.ctx)
            eager_outs: list = []
            self.ops.observer = lambda name, args: eager_outs.append(
                (int(args[_arg_positions(name)["layer_id"]]), name, args[_arg_positions(name)["out"]].clone()))
            sealed, self.sealed = self.sealed, False  # route this one step eagerly
            try:
                eager_logits = self.run(step, None).clone()
            finally:
                self.sealed, self.ops.observer = sealed, None
            self._restore(saved)
            graph_logits = self.run(step, key).clone()
            replay_outs = [(l, n, o.clone()) for l, n, o in self._op_outs[key]]
            if key.mode != Mode.DECODE or not self.full_decode:
                replay_outs = None  # piecewise: eager gaps ran again; compare the logits only
            err = _rel_err(graph_logits, eager_logits)
            report[str(key)] = err
            if not math.isfinite(err) or err > rtol:
                where = _first_bad_layer(eager_outs, replay_outs, rtol) if replay_outs else "logits"
                raise ParityError(f"start-up parity: {key} replay differs from eager (rel err {err:.3g}); "
                                  f"first differing: {where}; refusing to serve")
        return report

    def _snapshot(self, ctx: ExecContext) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        slots = ctx.state_slots[: ctx.num_real_seqs].to(self.device)
        pages = torch.unique(ctx.page_table[: ctx.num_real_seqs].flatten()).to(self.device).long()
        saved = []
        for entries in self.backend_state_pool().buffers.values():
            saved += [(t, slots, t[slots].clone()) for t in entries.values()]
        for entries in self.kv_pool.buffers.values():
            saved += [(t, pages, t[pages].clone()) for t in entries.values()]
        return saved

    @staticmethod
    def _restore(saved) -> None:
        for tensor, index, values in saved:
            tensor[index] = values

    def backend_state_pool(self):
        pools = [getattr(self.backend, "state_pool", None)] + [getattr(c, "state_pool", None)
                                                                  for c in getattr(self.backend, "children", ())]
        pool = next((p for p in pools if p is not None), None)
        if pool is None:
            raise CaptureError("parity check: the backend exposes no state_pool")
        return pool


def _arg_positions(op: str) -> dict[str, int]:
    schema = getattr(torch.ops.hgc, op_spec(op).name).default._schema
    return {a.name: i for i, a in enumerate(schema.arguments)}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _first_bad_layer(eager, replay, rtol) -> str:
    for (layer, name, e), (_, _, r) in zip(eager, replay):
        err = _rel_err(r, e)
        if not math.isfinite(err) or err > rtol:
            return f"layer {layer} ({name}, rel err {err:.3g})"
    return "no single op output (the difference is in the pieces between ops)"
