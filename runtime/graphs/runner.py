"""GraphRunner: captured CUDA graphs per bucket, and the one place that picks full, piecewise or eager.

The runner owns the captured keys, the static buffers and the padding; each role has its module:

- runtime/graphs/buckets.py: the capture keys, which key a step goes to, and which modes are whole-step graphs;
- runtime/graphs/staging.py: the static buffers a replayed step is copied into;
- runtime/graphs/cuda_graphs.py: how one piece is captured and replayed (torch.cuda, or a CPU stand-in);
- runtime/graphs/startup_parity.py: the start-up check of the captured keys against eager;
- here: the lifecycle below: dispatch a step to a whole-step graph, captured pieces or eager, and capture.

Lifecycle:

1. Construction: static device buffers for the largest bucket (input ids, positions, logits
   rows and every ExecContext tensor; `StepStaging`). Each step that replays graphs has its
   host-built tensors copied into them in place (one copy of one packed block, never
   reassigned), so every captured kernel reads the same addresses; an eager step uses its own
   tensors and may be of any size.
2. `capture()` (start-up only): `backend.init_capture_state`, then (`tuning_step`, a build's
   start-up) the largest extend bucket's step eagerly, where Inductor's kernels then time their
   candidate launch configurations, then for each decode bucket, largest first, one graph of the
   whole step when the artifact's decode plan (split.json) is one captured piece, or piecewise
   graphs otherwise; the same for each target_verify bucket
   (speculative decoding: `verify_tokens` tokens per request, so a bucket of B requests is
   B * verify_tokens rows; whole-step graphs where split.json's target_verify plan is one captured
   piece); then each extend token bucket, largest first: one whole-step graph where split.json's
   extend and mixed plans both allow it at the bucket's tokens (`buckets.whole_step`: no gap, as
   with `gqa_attention=flashinfer[extend_impl=triton]`, or gaps whose ops their backends capture in
   steps that large, `SplitPlan.whole_up_to`: FlashInfer's GQA up to `whole_extend_tokens`, the
   default; the graph then runs the pieces and the gap ops in order, and every backend is told
   with init_replay_state), piecewise graphs otherwise. Mixed steps replay the extend keys. All graphs share one memory pool. Padded rows point at the reserved
   state slot and write no KV. After `capture()` the runner is sealed: a capture at any later time
   is an error. Decode graphs are piecewise too when asked (`decode_graphs="piecewise"`: the
   extend plan's pieces, the baseline of the full graph).
3. `build(items)` + `run(step, key)` per step (`execute(items)` does both for the engine):
   decode steps go to the smallest decode bucket that holds them, extend and mixed steps to the
   smallest extend bucket that holds their tokens, anything larger runs eagerly. The backend is
   told first: `init_replay_state` for a full graph (recorded in the graph instead, for the
   backends whose `replay_state_in_graph` says so: a replay then does no host work for them);
   `init_step_metadata` (+ `init_chunk_metadata` outside decode) for an eager step; both, then
   `init_replay_state`, for a piecewise step, whose captured pieces read per-step values from the
   static buffers that hook fills (the backend set forwards it only to the instances with a node
   inside a captured piece of the step's mode).
4. `start(vocab)` is capture + start-up parity (runtime/graphs/startup_parity.py, `check_parity`):
   each captured key replayed padded against eager runs of the same real requests, padded and
   unpadded; a mismatch raises ParityError and the runner refuses to serve. What it found stays in
   `parity` (a ParityRecord). runtime/assembly.py starts the engine's runner, with the
   artifact's buckets clipped to its limits.

The same runner serves either program of an artifact: the main program, or the draft (MTP)
program, whose `hidden` input (the previous position's hidden states) is one more static buffer.
`run_outputs` gives every output of a step (logits, and the hidden states where the program
returns them); `run` the logits. Two runners over the same backend instances (main and draft)
share their static buffers: the main runner's `init_capture_state` sizes them for both, and the
draft captures with `capture(init_backend=False)` (runtime/engine/speculative.py does).
Side streams: with `hgc compile --overlap`, split.json gives captured pieces side branches; the
loader hands the runner those pieces already rewritten to fork each branch onto a second CUDA stream
and join it back inside the piece (runtime/graphs/side_stream.py, which states the capture rule), so full
and piecewise captures record both streams and eager steps run them too. Nothing here changes.

It does not build requests or sample (the engine does) and does not choose kernels (routing did:
which nodes sit in captured pieces is split.json's decision, read here through the program's plans).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from compiler.splitops import Mode
from compiler.splitops.artifact import (CAPTURED, DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS,
                                        PROGRAM_INPUTS, piece_module_names, whole_bound_refusal)
from runtime.cache.batch import RowsAt, SeqState, StepInputs, build_step, step_lengths, step_mode, write_rows
from runtime.backends.protocol import plan_eager_step
from runtime.step.bound_ops import BoundOps, backend_name
from runtime.graphs.buckets import Buckets, CaptureKey, buckets_for, piecewise_plan_mode, whole_step, whole_step_modes
from runtime.graphs.cuda_graphs import CaptureError, CapturedPiece, CaptureState, CudaGraphs
from runtime.step.context import ExecContext
from runtime.cache.kv_pool import KVPool
from runtime.graphs.parity import OpRecord, OpTrace, ParityError
from runtime.cache.state_pool import PADDING_SLOT, StatePool
from runtime.graphs.staging import StepStaging, hidden_input_spec, step_on_device
from runtime.graphs.startup_parity import ParityRecord, check_parity
from runtime.graphs.step_runner import run_step

__all__ = ["GraphRunner", "ParityError", "KERNEL_VARIANT_TOKENS", "KERNEL_VARIANT_REQUEST_TOKENS",
           # the roles' own names, as the runner's users know them
           "CaptureKey", "buckets_for", "CaptureError", "CudaGraphs", "CapturedPiece", "StepStaging", "step_on_device"]


# Eager steps of up to this many tokens (or the step budget, if larger) launch at start-up every
# kernel variant the backends pick by token count (`_launch_kernel_variants`). The fused MoE's
# choices stop changing below it for the released shapes (its last default tile change is at a mean
# of 48 pairs per expert: 2458 tokens for 512 experts, top-10).
KERNEL_VARIANT_TOKENS = 8192
# Tokens per request of those steps: a fixed length, so a build and a run lay the same steps out.
KERNEL_VARIANT_REQUEST_TOKENS = 64


class GraphRunner:
    def __init__(self, program, ops: BoundOps, kv_pool: KVPool, state_pool: StatePool, device: torch.device | str, *,
                 decode_buckets=DEFAULT_DECODE_BATCH_SIZES, extend_buckets=DEFAULT_EXTEND_TOKEN_COUNTS,
                 max_pages_per_seq: int, extend_max_seqs: int = 16, chunk_size: Optional[int] = None,
                 decode_graphs: str = "full", debug: bool = False, graphs=None,
                 verify_buckets=(), verify_tokens: int = 0, verify_logits_rows: Optional[int] = None,
                 tuning_step: bool = False):
        """program: a loaded ProgramRunner (runtime/artifact/loader.py): `name`, `module_for(mode)`, `weights`, `plans`.

        kv_pool / state_pool: the caches the ops read and write (the parity check saves and
        restores the rows a step touches). chunk_size: what `init_chunk_metadata` is told (the
        engine's token budget; default: the largest extend bucket). graphs: how graphs are
        captured and replayed (default CudaGraphs()). decode_graphs: "full" (one graph per decode
        or target_verify bucket when that mode's plan is one captured piece) or "piecewise"
        (decode steps run the extend plan's pieces, attention ops in eager gaps: what a backend
        that cannot be captured in decode would get, and the baseline the full graph is
        measured against).
        verify_buckets / verify_tokens: target_verify steps of B requests (B in verify_buckets)
        with verify_tokens tokens each (speculative decoding: D + 1); verify_logits_rows: logits
        rows per request in such a step (the main program: every token, the default; the draft:
        1, the last accepted position). The state pool's intermediate states must hold the
        largest verify bucket (`StatePool.verify_rows`).
        tuning_step: `capture()` first runs the largest extend bucket's step eagerly, so that the
        kernels which choose a launch configuration by timing candidates at their first launch
        choose it there (`_tuning_step`); for a start-up that may tune (a build), not one that loads
        the choices.
        """
        if decode_graphs not in ("full", "piecewise"):
            raise ValueError(f"decode_graphs must be 'full' or 'piecewise', not {decode_graphs!r}")
        self.program, self.ops, self.kv_pool, self.state_pool = program, ops, kv_pool, state_pool
        self.device = torch.device(device)
        self.graphs = graphs if graphs is not None else CudaGraphs()
        self.buckets = Buckets(tuple(decode_buckets), tuple(extend_buckets), extend_max_seqs,
                               tuple(verify_buckets), verify_tokens, verify_logits_rows or 0)
        if self.verify_buckets and program.name == "main" and self.verify_buckets[-1] > state_pool.verify_rows:
            raise CaptureError(f"target_verify bucket {self.verify_buckets[-1]} holds more requests than the state "
                               f"pool's {state_pool.verify_rows} rows of intermediate states; keep verify buckets at "
                               f"or below them (runtime/cache/memory_planner.py)")
        self.max_pages = max_pages_per_seq
        self.debug = debug
        self.state = CaptureState(self.graphs)
        self.sealed = False
        self.counters = {"graph_replays": 0, "piecewise_steps": 0, "eager_steps": 0}
        # Key modes whose steps are one whole-step graph at every size: every op of the mode's plan
        # (split.json) captured; for extend keys, of the mixed plan too (mixed steps replay them:
        # buckets.py). Piecewise decode runs the extend plan's pieces, which then stay pieces too.
        self.full_modes = whole_step_modes(program.plans) if decode_graphs == "full" else frozenset()
        # The keys captured whole: those modes' keys, and the extend keys small enough for the plans'
        # gaps to be captured too (SplitPlan.whole_up_to); the larger ones are pieces.
        refusal = whole_bound_refusal(program.plans, self.buckets.extend) if Mode.EXTEND in program.plans else None
        if refusal:
            raise CaptureError(f"{program.name} program: {refusal}; recompile with that bound among the extend "
                               f"buckets (or above them), or run with extend buckets that hold it")
        self.whole_keys = frozenset(k for k in self.buckets.capture_keys() if whole_step(program.plans, k)
                                    ) if decode_graphs == "full" else frozenset()
        self.keys: list[CaptureKey] = []
        self.chunk_size = chunk_size or self.max_tokens
        # Plans only the eager gaps read wait for their backend's first op of the step (_plan); False
        # makes them precede the step's first launch, as before (step_account.py --timeline times both).
        self.defer_gap_plans = True
        self.input_names = PROGRAM_INPUTS[program.name]
        # Static buffers: the only tensors a captured graph reads besides weights, caches and its pool
        # (the draft program's hidden states among them).
        self.staging = StepStaging(self.max_tokens, self.max_seqs, self.max_pages, self.device,
                                   hidden_input_spec(program.program) if "hidden" in self.input_names else None)
        self._modules: dict[Mode, torch.nn.Module] = {}
        self._full_graphs: dict[CaptureKey, tuple[object, list]] = {}  # whole-step graphs and their static outputs
        self.op_outs: dict[CaptureKey, list[OpRecord]] = {}  # each op's `out` in the key's graphs
        self.parity = ParityRecord()  # what start-up parity found (runtime/graphs/startup_parity.py)
        self.variant_steps: tuple[tuple[int, ...], float] = ((), 0.0)  # (token counts, seconds): capture's last
        self.tuning_step = tuning_step
        self.tuned_on: Optional[CaptureKey] = None  # the key whose step ran first (`_tuning_step`), if one did

    # -- what the buckets and the backend say (derived, not kept) ---------------------------

    @property
    def backend(self):
        return self.ops.backend

    @property
    def max_tokens(self) -> int:
        return self.buckets.max_tokens

    @property
    def max_seqs(self) -> int:
        return self.buckets.max_seqs

    @property
    def extend_buckets(self) -> tuple[int, ...]:
        return self.buckets.extend

    @property
    def extend_max_seqs(self) -> int:
        return self.buckets.extend_max_seqs

    @property
    def verify_buckets(self) -> tuple[int, ...]:
        return self.buckets.verify

    @property
    def full_decode(self) -> bool:
        return Mode.DECODE in self.full_modes

    # -- keys and padding ------------------------------------------------------------------

    def _is_full(self, key: Optional[CaptureKey]) -> bool:
        return key in self.whole_keys

    def key_for(self, mode: Mode, num_tokens: int, num_seqs: int) -> Optional[CaptureKey]:
        """The smallest captured key that holds this step, or None (eager; always, before capture)."""
        return self.buckets.key_for(mode, num_tokens, num_seqs) if self.sealed else None

    def _fill(self, step: StepInputs, key: Optional[CaptureKey], input_ids: Optional[torch.Tensor | RowsAt] = None,
              logits_index: Optional[torch.Tensor] = None) -> tuple[tuple, ExecContext]:
        """The program's inputs (in its own order) and context for a host-built step: copied into the
        static buffers as views sized to the key (`StepStaging.stage`); then `input_ids` and
        `logits_index` (on the device, if given) over its first rows' ids and logits rows (`write_rows`).

        An eager step (no key) reads no graph, so it needs no static address and may be larger
        than the buffers: its own tensors are moved to the device instead."""
        if key is None:
            self.staging.release(step)  # moved as it is: out of the host block the next step reuses
            inputs, ctx = step_on_device(step, self.device, self.input_names)
            by_name = dict(zip(self.input_names, inputs))
        else:
            by_name, ctx = self.staging.stage(step, key)
        # after the copy, on the same stream
        write_rows(by_name["input_ids"], input_ids, step.ctx.num_real_tokens, "input ids")
        write_rows(by_name["logits_index"], logits_index, step.logits_index.shape[0], "logits rows")
        return tuple(by_name[name] for name in self.input_names), ctx

    def build(self, items: list[tuple[SeqState, list[int]]], mode: Optional[Mode] = None,
              logits_rows: Optional[list[int]] = None) -> tuple[StepInputs, Optional[CaptureKey]]:
        """Lay a step out on the host, padded to the key that will run it: a step with a key straight
        into the static buffers' host block (`StepStaging.lay_out`; the step's tensors are views of
        it, valid until this runner lays out its next step or copies one in), an eager one in
        tensors of its own (`build_step`).

        A step that asks for more logits rows of a request than its key was captured with (a
        prompt being scored) runs eagerly."""
        query_lens, cache_lens = step_lengths(items)
        mode = mode or step_mode(query_lens, cache_lens)
        key = self.key_for(mode, sum(query_lens), len(items))
        if key is not None and logits_rows is not None:
            per_seq = self.buckets.verify_logits_rows if mode == Mode.TARGET_VERIFY else 1
            if any(r != per_seq for r in logits_rows):
                key = None
        if key is None:
            return build_step(items, self.kv_pool, "cpu", mode=mode, max_pages=self.max_pages,
                              logits_rows=logits_rows), None
        # laid out in the static buffers' host block: `run` only sends it over
        return self.staging.lay_out(items, key, mode, query_lens, cache_lens, self.kv_pool, logits_rows), key

    # -- running ---------------------------------------------------------------------------

    def _module(self, mode: Mode, whole: bool = False) -> torch.nn.Module:
        """The split module of a mode with its captured pieces wrapped (built once, reused).

        A plan that is one captured piece is captured whole (one graph per bucket), so its module
        stays unwrapped: eager steps and the whole-step capture both run it as is. Extend and
        mixed steps run the extend plan. `whole`: for a whole-step graph of a key whose plan has
        gaps (small extend buckets); the module may be the one whose pieces are wrapped for the
        larger keys, whose wrappers then run their pieces as they are (no key is set for them)."""
        key_mode = Mode.EXTEND if mode == Mode.MIXED else mode
        if whole or key_mode in self.full_modes:  # captured whole
            return self.program.module_for(key_mode)
        plan_mode = piecewise_plan_mode(self.program.plans, mode)
        if plan_mode not in self._modules:
            split = self.program.module_for(plan_mode)
            # Modes whose plans have the same pieces share one split module (ProgramRunner.module_for):
            # its pieces are wrapped once. A piece wrapped twice would capture its own graph inside
            # the outer piece's capture, which CUDA refuses. A piece's graphs are kept per key, and a
            # key names its mode, so one wrapper serves every mode that shares the module.
            if not any(wrapped is split for wrapped in self._modules.values()):
                plan = self.program.plans[plan_mode]
                for piece, name in zip(plan.pieces, piece_module_names(plan)):
                    if piece.kind == CAPTURED:
                        setattr(split, name, CapturedPiece(getattr(split, name), piece.index, self.state, self.debug,
                                                           first=piece is plan.pieces[0]))
            self._modules[plan_mode] = split
        return self._modules[plan_mode]

    def _call(self, module, inputs) -> list:
        """Every user output of the program: [logits] or [logits, hidden]."""
        outputs = module(*self.program.weights, *inputs)
        return list(outputs)[self.program.num_mutations:]

    def _plan(self, ctx: ExecContext, key: Optional[CaptureKey]) -> None:
        """Tell the backend about a step before its first op: the protocol's order for each kind of step."""
        if self._is_full(key):
            # a whole-step graph: nothing is planned eagerly, and what the graph refills itself
            # (replay_state_in_graph) is not done here either
            self.backend.replay_state_on_host(ctx, key.seqs)
            return
        if key is None:
            plan_eager_step(self.backend, ctx, self.chunk_size)
            return
        # Piecewise: the ops inside captured pieces read their per-step values (the MoE's real
        # token count, decode slot ids) from the static buffers init_replay_state fills, not from
        # launch arguments frozen at capture; the eager gaps run on the eager plan made first.
        # Where the plan opens with a captured piece (CapturedPiece's `first`), that piece's graph
        # stages what it may (stage_in_first_piece, recorded at capture): host time before the
        # step's first launch, while the device waits, is what a piecewise step pays over a
        # whole-step graph.
        # In a replayed step the plans only the gaps read wait for their backend's first op
        # (BoundOps.before_first_call), so the pieces before it are launched first and the device
        # runs them meanwhile: at 4096 tokens FlashInfer's prefill plan took about 0.5 ms of host
        # time before the first launch, the device idle (benchmarks/history/linear_extend.md, "Where
        # a long extend step waits on the host"); run right after the first piece, the plans of
        # several gap backends still left the device idle when that piece was short (a GDN layer's
        # input projection: benchmarks/results/step_account_flashinfer_core_ab_h100_2026-12-06.md).
        plan_mode = piecewise_plan_mode(self.program.plans, key.mode)
        staged = self.program.plans[plan_mode].pieces[0].kind == CAPTURED
        deferred: dict = {}
        defer = self.defer_gap_plans and not self.state.capturing
        self.backend.plan_piecewise_step(ctx, key.seqs, self.chunk_size, plan_mode, first_piece_stages=staged,
                                         defer_gaps=deferred.__setitem__ if defer else None)
        self.ops.before_first_call = deferred or None
        if staged and self.state.capturing:
            self.state.prologue = lambda: self.backend.stage_in_first_piece(ctx, key.seqs, plan_mode)

    @torch.no_grad()
    def run_outputs(self, step: StepInputs, key: Optional[CaptureKey],
                    input_ids: Optional[torch.Tensor | RowsAt] = None,
                    logits_index: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Run one built step; returns [logits of the real rows [R, V]] and, where the program
        returns them, the hidden states of the real tokens [T, D] after it. input_ids: int64 ids
        on the device that replace the first rows' ids the step was built with (its placeholders),
        or those of the rows a `RowsAt` names;
        logits_index likewise replaces its first logits rows.

        For a full graph they are views of the graph's static outputs: the next replay of that
        key overwrites them, so read (or clone) them before the next step."""
        inputs, ctx = self._fill(step, key, input_ids, logits_index)
        real = [step.logits_index.shape[0], step.ctx.num_real_tokens]
        self._plan(ctx, key)
        if self._is_full(key):
            graph, outputs = self._full_graphs[key]
            with self.ops.step(ctx):  # a real replay calls no op; a CPU stand-in reruns them
                graph.replay()
            self.counters["graph_replays"] += 1
            return [out[:n] for out, n in zip(outputs, real)]
        self.state.key = key
        try:
            with self.ops.step(ctx):
                outputs = self._call(self._module(ctx.mode), inputs)
            if self.ops.before_first_call is not None:  # a plan no gap op of the step was there to read
                raise CaptureError(f"{key}: the plans deferred to the first ops of "
                                   f"{sorted(backend_name(b) for b in self.ops.before_first_call)} never ran")
        finally:
            self.state.key, self.ops.before_first_call = None, None
        self.counters["piecewise_steps" if key else "eager_steps"] += 1
        return [out[:n] for out, n in zip(outputs, real)]

    def run(self, step: StepInputs, key: Optional[CaptureKey]) -> torch.Tensor:
        """run_outputs' logits [R, V] alone."""
        return self.run_outputs(step, key)[0]

    def execute(self, items: list[tuple[SeqState, list[int]]], logits_rows: Optional[list[int]] = None,
                input_ids: Optional[RowsAt] = None) -> tuple[Mode, torch.Tensor, Optional[torch.Tensor]]:
        """The engine's step (runtime/graphs/step_runner.StepRunner): build, dispatch and run."""
        return run_step(self, items, logits_rows, input_ids)

    # -- capture ---------------------------------------------------------------------------

    def _dummy_step(self, key: CaptureKey) -> StepInputs:
        """A step of the key's shape on the padding slot and page 0, writing no KV (contents do not matter).

        Its requests are as long as a request may be (max_pages_per_seq pages); tokens beyond
        what they hold are padding rows. Their page lists are set here, so no page is taken from
        the pool: a capture works on a pool of any size.
        """
        cap = self.max_pages * self.kv_pool.page_size
        if key.mode == Mode.DECODE:
            lens, cached = [1] * key.seqs, 1
        elif key.mode == Mode.TARGET_VERIFY:
            lens, cached = [self.buckets.verify_tokens] * key.seqs, 1
        else:
            left, lens, cached = key.tokens, [], 0
            for b in range(key.seqs):
                n = min(cap, max(1, left // (key.seqs - b)))
                lens.append(n)
                left -= n
        items = [(SeqState(PADDING_SLOT, pages=[0] * self.kv_pool.pages_for(cached + n), num_cached=cached), [0] * n)
                 for n in lens]
        rows = [self.buckets.verify_logits_rows] * key.seqs if key.mode == Mode.TARGET_VERIFY else None
        step = build_step(items, self.kv_pool, "cpu", mode=key.mode, pad_tokens_to=key.tokens,
                          pad_seqs_to=key.seqs, max_pages=self.max_pages, logits_rows=rows)
        step.ctx.slot_mapping.fill_(-1)  # capture writes no KV
        return self.staging.with_random_hidden(step, torch.Generator().manual_seed(0))

    def capture_keys(self) -> list[CaptureKey]:
        """What `capture()` captures, in capture order (largest first)."""
        return self.buckets.capture_keys()

    @torch.no_grad()  # a graph captured with autograd on would record its bookkeeping too
    def capture(self, init_backend: bool = True, pool=None, progress=None) -> None:
        """Every key, largest first. init_backend=False: the backends' static buffers were allocated
        by the caller (sized for every runner sharing them); pool: a graph pool to share. The first
        capture of each mode also builds the kernels its steps call (Triton compiles, library JIT):
        `progress` shows that wait as a bar over keys."""
        if self.sealed:
            raise CaptureError("capture after start-up: graphs are captured once, before serving")
        self.graphs.check_device(self.device)
        if init_backend:
            self.backend.init_capture_state(self.max_tokens, self.max_seqs)
        self.state.pool = pool if pool is not None else self.graphs.new_pool()
        keys = self.capture_keys()
        if self.tuning_step:
            self._tuning_step(keys)
        for key in progress(keys, desc="capture CUDA graphs (and build kernels)", unit="graph") if progress else keys:
            inputs, ctx = self._fill(self._dummy_step(key), key)
            # Every op's `out` as the graph leaves it: the parity check compares them layer by layer.
            # Holding them keeps their memory from being reused by a later capture in the pool.
            sink = OpTrace(key.tokens, copy=False, skip=lambda: self.state.silent)
            self.ops.observer = sink
            try:
                if self._is_full(key):
                    # every member, for the warm-up (in a set, also those whose ops sit in the plan's
                    # gaps: a whole-step graph captures those too); no key for the pieces, which run
                    # inside this graph as they are
                    self.backend.replay_state_on_host(ctx, key.seqs)
                    self.backend.replay_state_captured(ctx, key.seqs)
                    module = self._module(key.mode, whole=True)
                    with self.ops.step(ctx):
                        self.state.silent = True
                        try:
                            self._call(module, inputs)  # warm-up: Triton compiles, lazy allocations
                        finally:
                            self.state.silent = False
                        self._full_graphs[key] = self.graphs.capture(
                            lambda module=module, inputs=inputs, ctx=ctx, key=key: self._whole_step(module, inputs, ctx,
                                                                                                key),
                            self.state.pool)
                else:
                    self.state.key = key
                    self.state.capturing = True  # before _plan: it leaves the first piece a prologue to record
                    self._plan(ctx, key)
                    with self.ops.step(ctx):
                        self._call(self._module(key.mode), inputs)
            finally:
                self.state.key, self.state.capturing, self.state.prologue = None, False, None
                self.ops.observer = None
            self.op_outs[key] = sink.records
            self.keys.append(key)
        self._launch_kernel_variants()
        self.graphs.synchronize(self.device)
        self.sealed = True

    def _launch_kernel_variants(self) -> None:
        """One eager extend step (dummy, like a capture's) of each token count the backends name
        (`kernel_variant_tokens`): every kernel variant an eager step may pick is then built at
        start-up (by `hgc build`, into the bundle) or found there (a run), never first built while
        serving. Counts up to KERNEL_VARIANT_TOKENS whatever the step budget, since a build's budget
        (its largest extend bucket) is no bound on a run's. The steps must be the same in the build
        and in a run under other limits (a kernel may also choose by its requests' lengths and
        count), so a step of T tokens has ceil(T / KERNEL_VARIANT_REQUEST_TOKENS) requests sharing
        them evenly; more only where the budget holds less (then the run's start-up names what it
        builds). Not fewer tokens where a run's requests are shorter (`hgc run` sizes max_seq_len to
        its prompts): the kernels pick by the step's padded shape, tokens and requests, and a
        dummy request longer than a request may be is cut to that length, the rest padding rows."""
        per_request = min(self.chunk_size, KERNEL_VARIANT_REQUEST_TOKENS)
        t0 = time.perf_counter()
        counts = self.backend.kernel_variant_tokens(max(self.chunk_size, KERNEL_VARIANT_TOKENS))
        for tokens in counts:
            self._eager_dummy_step(CaptureKey(Mode.EXTEND, tokens, -(-tokens // per_request)))
        self.variant_steps = (counts, time.perf_counter() - t0)

    def _tuning_step(self, keys: list[CaptureKey]) -> None:
        """The largest extend key's step, eagerly, before any capture (`tuning_step`).

        Why: Inductor's Triton kernels choose their launch configuration (block sizes, warps) by
        timing each candidate at their first launch, with that launch's sizes, and keep the choice
        for every size after it, since a compiled piece serves every token count; the build writes
        the choice into the bundle and a run loads it. Captures run the largest decode bucket first,
        where a glue kernel takes 1 to 4 us of device time, less than the autotuner's own Python
        launch of each timed call, so the timings measure the launches and the pick is almost at
        random; a choice that costs nothing there can take twice the time of another on a long
        prompt: the same glue kernels of bench qwen3_next's GQA layers took 48.5 or 85.8
        and 41.2 or 80.6 us at 4096 tokens (6.6 or 11.3, 6.0 or 10.9 at 512) in builds of the same
        code (H200 step accounts of 2026-12-02 to 12-05, benchmarks/results/), and the choice that
        won at 4096 won at 128 too. A long step is where the candidates differ most, and where a
        wrong choice costs the most time. Kernels that only decode steps launch still tune on the
        largest decode bucket."""
        extend = [k for k in keys if k.mode == Mode.EXTEND]
        if extend:
            self.tuned_on = max(extend, key=lambda k: (k.tokens, k.seqs))
            self._eager_dummy_step(self.tuned_on)

    def _eager_dummy_step(self, key: CaptureKey) -> None:
        """An eager step of `key`'s shape (`_dummy_step`: the padding slot, no KV written)."""
        inputs, ctx = self._fill(self._dummy_step(key), None)
        self._plan(ctx, None)
        with self.ops.step(ctx):
            self._call(self._module(key.mode), inputs)

    def _whole_step(self, module, inputs, ctx: ExecContext, key: CaptureKey) -> list:
        """What a whole-step graph records: the backends' replay state where the graph holds it
        (replay_state_in_graph: device copies from the step buffers), then the step."""
        self.backend.replay_state_captured(ctx, key.seqs)
        return self._call(module, inputs)

    def start(self, vocab_size: int, log: Callable[[str], None] = lambda line: None,
              progress=None) -> dict[str, float]:
        """Start-up: capture every key, then check each against eager (runtime/graphs/startup_parity.py);
        raises ParityError before serving on a mismatch. `progress`: a tqdm-like factory, for a bar over
        the captures (a cold start builds kernels here). Returns the logits' relative error per key."""
        t0 = time.perf_counter()
        self.capture(progress=progress)
        log(f"captured {len(self.keys)} graphs ({', '.join(map(str, self.keys))}) in {time.perf_counter() - t0:.1f} s")
        if self.tuned_on is not None:
            log(f"tuning step: {self.tuned_on} ran first, eagerly: kernels that time their launch configurations "
                f"at first launch chose them there")
        counts, seconds = self.variant_steps
        if counts:
            log(f"kernel variants: eager steps of {', '.join(map(str, counts))} tokens in {seconds:.2f} s")
        return check_parity(self, vocab_size=vocab_size, log=log)
