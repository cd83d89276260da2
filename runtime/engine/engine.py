"""Engine: continuous batching with chunked prefill over a model callable, its BoundOps and the pools.

The engine owns requests (queue, progress, sampling state) and the scheduling policy. It runs every
step of the main program through one step runner over its op table (runtime/graphs/step_runner.py),
whose backend implements the protocol (runtime/backends/protocol.py). A step:

1. `_schedule`: pick the work of this step under a token budget: a chunk of prompt for each
   request still prefilling (`prefill`), one token for each request decoding (`decode`), new
   requests admitted from the queue. Pages for the chosen tokens are taken here. With a prefix
   cache, an admitted request starts after the longest prefix the cache holds for it (its pages
   shared, its linear state copied from a snapshot), and chunks end where snapshots are due (or
   pass them, where the step writes them itself: runtime/cache/prefix_cache.py, in-step).
2. `_run`: lay the chosen tokens out as one batch (`build_step`), let the backend plan it
   (`init_step_metadata`, and `init_chunk_metadata` when prompt chunks are in it), run the forward.
   Then, with a prefix cache, requests that stopped at a snapshot point are snapshotted, and the
   snapshots the step wrote go into the tree.
3. `_score_prompts`: requests that asked for their prompt's log-probabilities (echo) got logits
   rows for each prompt token of their chunk; those rows are scored on the device
   (runtime/engine/logprobs.py).
4. `_sample`: each request whose pending tokens are all in the cache now samples its next token
   from its own logits row and its own generator, after its logit_bias and penalties
   (runtime/engine/penalties.py); requests sharing its prompt are forked from it first (below).
5. `_retire`: requests that hit a stop token or max_new_tokens free their state slot and pages,
   at once unless a step still on the device runs them (below). `cancel` ends a request between
   steps, the same way.

A request's tokens are its prompt followed by what it generated; the cache holds the first
`num_cached` of them. Prefill and decode are the same thing at different lengths: feed the tokens
not yet cached, sample when none are left. That is also how a preempted request resumes.

Shared prefill (OpenAI's `n`): a request added with `prefill_from=` another request of the same
prompt waits, unqueued, until that request's prompt is in the cache. In that step it is forked:
it gets a slot and pages of its own holding copies of the first one's states and KV, samples
its first token from the same logits row (with its own generator), and decodes on its own. When
no slot, place or pages are free for it then, it is queued at the front instead and prefills
its prompt itself; the tokens are the same either way.

Scheduling policy (deterministic; nothing is random but the requests' own generators):

- Order. Running requests are served oldest-admitted first, then the queue is admitted in FIFO
  order. Each request gets min(its pending tokens, the budget left) tokens; the head of the queue
  blocks the queue (no skipping ahead, so a long prompt is not starved).
- Admission. The head of the queue is admitted when a running place (max_running), a state slot
  and the pages for its first chunk are all free. No admission in a step that preempted.
- Growth. A running request that needs pages takes them from the pool; if the pool is short, the
  prefix cache gives back pages that no request uses (least recently used first), and if it is
  still short the request takes a shorter chunk. If not even one token fits, the youngest running
  request is preempted (slot and pages freed, progress dropped, put back at the front of the
  queue with its generated tokens and its generator, to re-prefill prompt + output later),
  repeatedly, until one token fits.
  A request that is itself the youngest waits this step instead, keeping its pages.
- No deadlock: `add_request` refuses a request longer than the KV pool, so the oldest running
  request can always grow after preempting every younger one (every page the prefix cache holds
  and that request does not, the cache can give back); it finishes, and the next-oldest becomes
  the oldest. With nothing running, the whole pool is free (or the cache's) and the queue's head is
  admitted. `step()` raises EngineStalled if a step with work to do schedules nothing.

Decodes apart (`decodes_apart_from`, `hgc serve --decodes-apart-from`): a step with prompt chunks
and at least that many decodes runs them as two forwards of one step, the chunks first, then the
decodes through the decode graphs, their logits joined in the step's order; the rest of the step
(choices, overlap, statistics) is the one step's. In a mixed forward every decode is a request of
one token on the extend path: the linear layers' chunk kernels then spend a chunk on each. On one
H200 (bench qwen3_next, compiled bundle) 128 decodes and a 128-token prompt took 21.2 ms as one
mixed step against 3.4 + 3.6 ms apart, and 40.3 against 3.4 + 22.1 ms with a 3968-token prompt
(benchmarks/serving/bucket_costs.py, "mixed").

An artifact compiled with --batch-invariant runs with decodes apart from one decode
(runtime/assembly.py): a decoding request's row then always goes through a decode forward, whose
rows are computed alike whatever shares them, and never through a mixed step's prefill attention.

Overlap (`overlap=True`, the default of `--overlap-schedule` / `--no-overlap-schedule`): while the device runs
step N, the host schedules, lays out and launches step N+1; the only wait per step is for step N's
chosen ids. When every choice of step N can be made on the device (`Choices.choose_on_device`:
greedy, no grammar, penalties, bias or log-probabilities), its ids stay there: their copy to a
pinned host buffer is queued with an event, each request gets a placeholder token
(runtime/cache/batch.PLACEHOLDER_TOKEN) and `step()` returns without reading them. The next `step()`
schedules step N+1 with the placeholders (a decode of one is built with it, and its id is written
into that row on the device from step N's ids: `_placed_ids`, a `RowsAt`), launches its forward
and its choices, and only then reads step N's ids (`_read_inflight`): they replace the
placeholders, stop ids and max_new_tokens end requests, and step N's outputs are returned. So
`step()` returns each step's tokens one call late, and `has_work()` stays true while a step is in
flight: a call with nothing left to run reads it (the final drain). A request whose output is full
with its last token on the device is not scheduled again (`Request.awaits_last_token`).

The rules, kept simple rather than clever:

1. A step is synchronous (its ids read at once, as without overlap) unless every request that
   chooses in it chooses on the device, none is forked from it (n > 1), none scores its prompt
   (prompt logprobs, echo), the schedule preempted no one, and the engine has neither speculative
   decoding (its steps are always synchronous) nor tensor parallel (refused:
   its ranks replay rank 0's steps with the ids on the host). Draws with a request's own
   generator stay on the host, so their streams are exactly those without overlap.
2. Before a synchronous step chooses, and before a schedule that preempted is launched, the step
   in flight is read: grammars, penalties and preempted requests see every token on the host.
3. Before the prefix cache takes a request's generated tokens (an output snapshot, or a prompt
   insert past its prompt: `PrefixCache.reads_output`) while one is a placeholder, the step in
   flight is read first. Prompt-only snapshots never wait: overlap stays on with the prefix cache.
4. A request found finished when step N is read was already in step N+1: that output is dropped,
   never emitted, and its slot, pages and prefix-cache hold are released only when step N+1 ends
   (`_release`: a step's members keep them until its ids are read, so the device never writes a
   slot or page that has a new owner). A request cancelled while a step runs it is finished at
   once (its result is what was emitted; the token on the device is dropped) and its release
   waits for that step the same way. Nothing is ever emitted past a stop id, max_new_tokens or a
   cancel.

`Engine.stats()` counts the overlapped and the synchronous steps (`overlapped_steps`,
`synchronous_steps`), so a benchmark shows how often overlap applied.

Timing: a step that carries prompt tokens (a prefill chunk, alone or mixed with decodes) counts as
prefill time; a step of decodes only counts as decode time. A step's time ends when its ids are on
the host, so device work is included; with overlap, from the later of its start and the end of
the step before (runtime/engine/statistics.py).

Step 2 is the step runner's `execute` (runtime/graphs/step_runner.py): the engine holds one, an
EagerRunner over a bound forward, or a GraphRunner (runtime/graphs/runner.py, started before the
engine serves) that builds the step padded to a captured key and picks full graph, piecewise or
eager. The prefix cache's policy (what a request reuses, where its chunks end, when it snapshots)
is runtime/cache/prefix_cache.py's; the engine calls it.

The jobs have their modules: the request record (runtime/engine/request.py), scheduling and page
policy (runtime/engine/scheduler.py: step 1, preemption), sampling choices
(runtime/engine/choices.py: steps 3-4, drafts, acceptance), the speculative round
(runtime/engine/speculative_round.py) and the numbers (runtime/engine/statistics.py). runtime/assembly.py
builds an engine with its runner, drafter and prefix cache.

Speculative decoding (`speculative=`, a runtime/engine/speculative.py SpeculativeDecoder with D draft
tokens): prompt chunks run as in steps 1-5, without decodes beside them, and the draft then runs
over the same positions (`after_prefill`, which proposes each new decoding request's first
draft). Requests that decode are verified together after them (`_verify`): the drafter proposes
D tokens each, one target_verify step of the main program checks them, and each request keeps
the drafts its rule accepts plus one token of the target's (runtime/engine/acceptance.py: the longest
greedy prefix, or rejection sampling), all after its penalties, bias and grammar at every
verified position, so it emits 1 to D + 1 tokens in a step with the distribution it would have
without drafts. A decoding request needs pages for D positions past its next token.

Structured output (`SamplingParams.grammar`, runtime/engine/grammar.py): a request's matcher follows its
output; every choice (sampled, argmax, drafted, verified) is made with the grammar's bitmask
applied to the logits, and draft tokens the matcher took ahead are rolled back before they are
verified position by position.

The engine does not capture graphs itself, and it runs on the caller's thread:
runtime/engine/loop.py steps it on a background thread for the server, runtime/core/process.py in
the engine core's process; both step while `has_work()`, which counts the step in flight.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Hashable

import torch

from compiler.splitops import Mode
from runtime.backends.protocol import check_backend
from runtime.cache.batch import PLACEHOLDER_TOKEN, RowsAt, SeqState, commit_step
from runtime.cache.kv_pool import KVPool
from runtime.cache.prefix_cache import PrefixCache
from runtime.cache.state_pool import StatePool
from runtime.engine.choices import Choices
from runtime.engine.request import Request, RequestResult, StepOutput, StepPlan, stop_reason
from runtime.engine.sampling import SamplingParams, make_generator
from runtime.engine.speculative import SpeculativeDecoder
from runtime.engine.speculative_round import SpeculativeRound
from runtime.engine.scheduler import Scheduler
from runtime.engine.statistics import Statistics, StepRecord
from runtime.graphs.step_runner import StepRunner
from runtime.step.host_copy import HostCopy, to_device

__all__ = ["Engine", "RequestResult", "StepOutput", "StepRecord", "EngineStalled", "SamplingParams"]


class EngineStalled(RuntimeError):
    """A step with queued or running requests scheduled nothing: a bug in the policy, never a state to wait in."""


class Engine:
    """Continuous batching over one model. Not thread-safe: drive it from one thread (or an EngineLoop)."""

    def __init__(self, runner: StepRunner, kv_pool: KVPool, state_pool: StatePool, *, max_tokens_per_step: int = 512,
                 max_running: int | None = None, max_seq_len: int | None = None, device: torch.device | str = "cpu",
                 recent_steps: int = 256, prefix_cache: PrefixCache | None = None,
                 speculative: SpeculativeDecoder | None = None,
                 broadcast: Callable | None = None, kernel_watch=None, overlap: bool = True,
                 decodes_apart_from: int = 0):
        """runner: the step runner of the main program (runtime/graphs/step_runner.py) over the
        engine's pools; its op table is the engine's (`ops`). A GraphRunner is started before, built
        with chunk_size=max_tokens_per_step.
        prefix_cache: a PrefixCache over the same pools (None: every request prefills its whole prompt).
        speculative: a SpeculativeDecoder over the same pools whose main steps are `runner`.
        broadcast: tensor parallel, rank 0: called with each step's (seq_items, logits_rows) before it
        runs, to send it to the other ranks (runtime/dist/distributed.lead). None on one device.
        kernel_watch: with a compiled bundle on CUDA, names kernels built while serving
        (runtime/artifact/bundle.ServingWatch); checked after every step.
        overlap: the overlapped schedule ("Overlap" above; `hgc serve --no-overlap-schedule` turns it
        off). It never applies with speculative decoding (its steps are synchronous), and tensor
        parallel refuses it (the other ranks replay rank 0's steps as they are sent, ids included).
        decodes_apart_from: a step with prompt chunks and at least this many decodes runs them as
        two forwards in one step ("Decodes apart" above); 0: never."""
        check_backend(runner.ops.backend)  # the hooks are called below without guards
        if runner.kv_pool is not kv_pool:
            raise ValueError("Engine: the step runner must run over the engine's own KV pool")
        if prefix_cache is not None and (prefix_cache.kv_pool is not kv_pool
                                         or prefix_cache.state_pool is not state_pool):
            raise ValueError("Engine: the prefix cache must hold the engine's own pools")
        if speculative is not None and (speculative.state_pool is not state_pool or speculative.main is not runner):
            raise ValueError("Engine: the speculative decoder must hold the engine's state pool and run its main "
                             "program through the engine's step runner")
        if max_tokens_per_step < 1:
            raise ValueError(f"Engine: max_tokens_per_step must be >= 1 (got {max_tokens_per_step})")
        if overlap and broadcast is not None:
            raise ValueError("Engine: overlap=True with tensor parallel (broadcast): its ranks run rank 0's steps with "
                             "the ids on the host; pass overlap=False (--no-overlap-schedule)")
        self.runner, self.ops, self.spec = runner, runner.ops, speculative
        self.kv_pool, self.state_pool, self.prefix_cache = kv_pool, state_pool, prefix_cache
        if prefix_cache is not None:  # snapshots inside a chunk, where the backends write them in the step
            prefix_cache.in_step = runner.ops.backend.writes_step_snapshots(prefix_cache.snapshots)
        self.device = device
        if decodes_apart_from < 0:
            raise ValueError(f"Engine: decodes_apart_from must be >= 0 (got {decodes_apart_from})")
        self.decodes_apart_from = decodes_apart_from
        self.broadcast, self.kernel_watch = broadcast, kernel_watch
        self.max_tokens_per_step = max_tokens_per_step
        self.max_running = min(max_running or state_pool.num_slots, state_pool.num_slots,
                               speculative.max_verify if speculative is not None else state_pool.num_slots)
        lookahead = speculative.draft_tokens if speculative is not None else 0
        # A verify step writes D positions past a request's next token: a request must fit with them.
        capacity = kv_pool.num_pages * kv_pool.page_size - lookahead
        self.max_seq_len = min(max_seq_len or capacity, capacity)  # longer could never finish
        self.numbers = Statistics(recent_steps, speculative)
        self.scheduler = Scheduler(kv_pool, state_pool, prefix_cache, max_tokens_per_step=max_tokens_per_step,
                                   max_running=self.max_running, lookahead=lookahead, totals=self.numbers.totals)
        self.choices = Choices(state_pool.num_slots)
        self.round = SpeculativeRound(speculative, self.choices, self.numbers.totals) if speculative else None
        self._ids = itertools.count()
        self._live: dict[Hashable, Request] = {}
        self._results: dict[Hashable, RequestResult] = {}
        self.overlap = overlap and speculative is None
        self._launched: list[_Launch] = []  # steps queued on the device and not over yet, oldest first
        self._inflight: _Launch | None = None  # the one whose chosen ids are still on the device
        self._emitted: list[StepOutput] = []  # what the step() under way returns
        self._last_end = 0.0  # when the last step ended (its ids read): the statistics' clock

    # -- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: Hashable = None,
                    prefill_from: Hashable = None) -> Hashable:
        """Queue a request; it joins the batch at a later step. Returns its id.

        prefill_from: the id of a request with the same prompt that has not sampled yet; this one
        then shares its prefill (see "Shared prefill" above)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("Engine.add_request: the prompt is empty")
        parent = None
        if prefill_from is not None:
            parent = self._live.get(prefill_from)
            if (parent is None or parent.fork_of is not None or parent.output or parent.prompt != prompt
                    or parent.params.prompt_logprobs != params.prompt_logprobs):
                raise ValueError(f"Engine.add_request: request {prefill_from!r} is not a live request of the same "
                                 f"prompt (and prompt_logprobs) that has yet to sample: it cannot share its prefill")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"Engine.add_request: {len(prompt)} prompt + {params.max_new_tokens} new tokens exceed the "
                f"engine's {self.max_seq_len} tokens per request (KV pool: {self.kv_pool.num_pages} pages of "
                f"{self.kv_pool.page_size})")
        if request_id is None:
            request_id = next(self._ids)
            while request_id in self._live or request_id in self._results:
                request_id = next(self._ids)
        elif request_id in self._live or request_id in self._results:
            raise ValueError(f"Engine.add_request: request id {request_id!r} is already in use")
        req = Request(request_id, prompt, params, make_generator(params), time.perf_counter())
        if params.grammar is not None:
            req.matcher = params.grammar.matcher()
        self._live[request_id] = req
        if parent is not None:
            req.fork_of = parent
            parent.forks.append(req)
        else:
            self.scheduler.waiting.append(req)
        return request_id

    def cancel(self, request_id: Hashable) -> bool:
        """End a queued or running request now; False if it is not live. Its slot and pages are
        freed at once, or, when a step still running on the device holds them, when that step
        ends; a token of it still on the device is never emitted."""
        req = self._live.get(request_id)
        if req is None:
            return False
        if req.fork_of is not None:
            req.fork_of.forks.remove(req)
        elif req.seq is None:
            self.scheduler.waiting.remove(req)
        else:
            self.scheduler.running.remove(req)
            self._release(req)
        self._queue_forks(req)  # they prefill by themselves now
        self._finish(req, "cancelled")
        return True

    def has_work(self) -> bool:
        """Requests queued or running, or a step whose chosen ids are still on the device."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight)

    def settle(self) -> list[StepOutput]:
        """Read the step in flight, if any, launching nothing: its outputs (none for requests ended
        since). Afterwards no step holds a slot or page, so a driver that stops stepping leaves the
        pools as its requests leave them."""
        if self._inflight is not None:
            self._read_inflight()
        return self._take_emitted()

    def pop_result(self, request_id: Hashable) -> RequestResult:
        """The result of a finished request (kept until popped)."""
        return self._results.pop(request_id)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one step: schedule, run, sample, retire. Returns the new tokens the engine read in
        it: this step's, or with the overlapped schedule the step before's (and this one's when it
        was synchronous); a call with nothing left to run reads the step still on the device."""
        if not self.has_work():
            return []
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.preempted and self._inflight is not None:  # rule 2: the victims leave with their tokens
            self._read_inflight()
            plan = StepPlan([(req, n) for req, n in plan.prefill if self._is_live(req)],
                            [req for req in plan.decode if self._is_live(req)], plan.preempted)
        items = plan.items()
        if not items:
            if self._inflight is None:
                raise EngineStalled(f"Engine.step: nothing scheduled with {len(self.scheduler.waiting)} queued and "
                                    f"{len(self.scheduler.running)} running requests; {self.kv_pool.num_free} pages "
                                    f"and {self.state_pool.num_free} slots free")
            self._read_inflight()  # what is running waits for those ids (or finishes with them)
            return self._take_emitted()
        launch = _Launch(plan, start, {id(req): req for req, _ in items})
        self._launched.append(launch)
        if self.spec is None:  # prefill chunks and decodes in one step (one forward, or two: decodes apart)
            outputs = self._forward_and_sample(items, launch, apart=self._decodes_apart(plan))
        else:  # prompt chunks alone first (the draft then runs over the same positions), then drafts and
            outputs = []  # one verify step for every decoding request
            if plan.prefill:
                outputs = self._forward_and_sample(plan.prefill, launch, drafts=True)
            if plan.decode:
                outputs += self.round.verify(plan.decode)
                launch.mode = launch.mode or Mode.TARGET_VERIFY
        if outputs is not None:  # synchronous: its ids are read
            self._end(launch, outputs, overlapped=False)
        if self.kernel_watch is not None:
            self.kernel_watch.check()
        return self._take_emitted()

    def _take_emitted(self) -> list[StepOutput]:
        emitted, self._emitted = self._emitted, []
        return emitted

    def _is_live(self, req: Request) -> bool:
        return self._live.get(req.request_id) is req

    def _decodes_apart(self, plan: StepPlan) -> int:
        """How many items (the prompt chunks, first in the plan's items) run before the decodes in a
        forward of their own; 0: one forward for the step."""
        apart = plan.prefill and self.decodes_apart_from and len(plan.decode) >= self.decodes_apart_from
        return len(plan.prefill) if apart else 0

    def _forward_and_sample(self, items: list[tuple[Request, int]], launch: "_Launch",
                            drafts: bool = False, apart: int = 0) -> list[StepOutput] | None:
        """Steps 2-4 for these requests: one forward (two with `apart`: items[:apart], then the
        rest), prompt scores, samples; with `drafts`, the drafter's pass over the same positions
        after. The outputs, or None when the ids were left on the device (the step is in flight:
        `_read_inflight` reads them)."""
        rows = [req.logits_rows(n) for req, n in items]
        if apart:  # (no drafts here: speculative steps verify their decodes apart already)
            mode, chunks_logits, _ = self._run(items[:apart], rows[:apart])
            chunks_logits = chunks_logits.clone()  # a graph's outputs: the decodes' replay may reuse that memory
            logits, hidden = torch.cat([chunks_logits, self._run(items[apart:], rows[apart:])[1]]), None
        else:
            mode, logits, hidden = self._run(items, rows)  # logits [sum(rows), V]
        launch.mode = launch.mode or mode  # speculative: the step's prompt forward names it
        entries = []
        if self.prefix_cache is not None:
            entries = [(req.cache, req.seq, req.prompt, req.output) for req, _ in items if req.cache is not None]
            if self._inflight is not None and any(  # rule 3: the cache reads tokens still on the device
                    output[-1:] == [PLACEHOLDER_TOKEN] and self.prefix_cache.reads_output(hold, seq, len(prompt))
                    for hold, seq, prompt, output in entries):
                self._read_inflight()
        last_rows = list(itertools.accumulate(rows, initial=-1))[1:]  # each request's last logits row
        self.choices.score_prompts(items, rows, last_rows, logits)
        ready = [(req, row) for (req, _), row in zip(items, last_rows) if req.num_pending == 0]
        if self._can_overlap(launch, items, ready):
            # The ids' choice and copy are queued before the cache's snapshot copies, so a request's
            # first token waits for its step alone. The snapshots still precede the next step on the
            # stream, and the placeholders appended here lie past the tokens the cache reads.
            self._leave_on_device(launch, ready, logits)
            if entries:
                self.prefix_cache.after_step(entries)
            if self._inflight is not None:
                self._read_inflight()  # the step before: its ids were copied while this one was laid out
            self._inflight = launch
            return None
        if entries:  # before sampling retires anyone: the slots hold the states
            self.prefix_cache.after_step(entries)
        if self._inflight is not None:
            self._read_inflight()
            ready = [(req, row) for req, row in ready if self._is_live(req)]  # the step before ended some
        forked: list[tuple[Request, Request]] = []
        outputs = self._sample(ready, logits, forked)  # for every request with nothing left pending
        if drafts:
            self.round.after_prefill(items, forked, hidden)
        return outputs

    # -- the overlapped schedule ----------------------------------------------------------------

    def _can_overlap(self, launch: "_Launch", items: list[tuple[Request, int]],
                     ready: list[tuple[Request, int]]) -> bool:
        """Rule 1: every choice of the step can be made on the device and read later."""
        return (self.overlap and not launch.plan.preempted
                and all(req.params.prompt_logprobs is None for req, _ in items)
                and all(Choices.choose_on_device(req) and not req.forks for req, _ in ready))

    def _leave_on_device(self, launch: "_Launch", ready: list[tuple[Request, int]], logits: torch.Tensor) -> None:
        """The ready requests' next tokens chosen on the device and their copy to the host queued;
        each request's output gets a placeholder for its token, replaced when it is read."""
        launch.ids, launch.copy = self.choices.argmax_on_device(logits, [row for _, row in ready])
        launch.ready = [req for req, _ in ready]
        for req in launch.ready:
            launch.at.append(len(req.output))
            req.output.append(PLACEHOLDER_TOKEN)

    def _read_inflight(self) -> None:
        """Read the step in flight's ids (waiting for them alone) into its requests' outputs; stop
        ids and max_new_tokens end requests here. A request cancelled since gets nothing; one that
        ends drops the token the step after chose for it (a placeholder still)."""
        launch, self._inflight = self._inflight, None
        tokens = launch.copy.tolist()
        now = time.perf_counter()
        outputs = []
        for req, at, token in zip(launch.ready, launch.at, tokens):
            if not self._is_live(req):
                continue
            req.output[at] = token
            if req.first_token_s is None:
                req.first_token_s = now - req.arrival_s
            req.stop_reason = stop_reason(req, token, at + 1)  # one that ends drops the next token (_finish)
            outputs.append(StepOutput(req.request_id, token, req.stop_reason is not None))
        self._end(launch, outputs, overlapped=True)

    def _end(self, launch: "_Launch", outputs: list[StepOutput], overlapped: bool) -> None:
        """A step is over (its ids read): the requests it finished retire, those held for it are
        released, its numbers are recorded and its outputs go to the caller."""
        self._launched.remove(launch)
        self._retire([self._live[out.request_id] for out in outputs if out.finished])  # forks included
        for req in launch.held:
            self._release(req)
        now = time.perf_counter()
        seconds, self._last_end = now - max(launch.start, self._last_end), now
        self.numbers.record(launch.plan, launch.mode, sum(out.token is not None for out in outputs), seconds,
                            overlapped)
        self._emitted += outputs

    def _release(self, req: Request) -> None:
        """Free the request's slot and pages, or, while a step that runs it is not over (the device
        may still write them), hold them for that step's end."""
        for launch in reversed(self._launched):
            if launch.members.get(id(req)) is req:
                launch.held.append(req)
                return
        self.scheduler.release(req)

    def _placed_ids(self, items: list[tuple[Request, int]], seq_items) -> RowsAt | None:
        """Where this step feeds a token the step in flight chose on the device (a decode whose
        token is a placeholder): those rows and their ids, gathered on the device."""
        launch = self._inflight
        source = {id(req): b for b, req in enumerate(launch.ready)}
        at, src, offset = [], [], 0
        for (req, n), (_, tokens) in zip(items, seq_items):
            if tokens[-1] == PLACEHOLDER_TOKEN:  # only ever a request's last token (a decode's one)
                at.append(offset + n - 1)
                src.append(source[id(req)])
            offset += n
        if not at:
            return None
        index = to_device(at + src, launch.ids.device).view(2, -1)
        values = launch.ids if src == list(range(len(launch.ready))) else launch.ids.index_select(0, index[1])
        return RowsAt(index[0], values)

    # -- drivers --------------------------------------------------------------------------------

    def run_until_done(self) -> dict[Hashable, RequestResult]:
        """Step until nothing is queued, running or in flight; return (and pop) every finished request's result."""
        while self.has_work():
            self.step()
        results, self._results = self._results, {}
        return results

    def generate(self, prompt_ids, params: SamplingParams | None = None) -> RequestResult:
        """One request to completion (others already queued run along): the simplest driver."""
        request_id = self.add_request(prompt_ids, params)
        while request_id in self._live:
            self.step()
        return self.pop_result(request_id)

    def _run(self, items: list[tuple[Request, int]], rows: list[int]) -> tuple[Mode, torch.Tensor, torch.Tensor | None]:
        """One forward over every scheduled token (prefill chunks and decodes together); `rows[b]`
        logits rows for request b (its last ones). (mode, logits, the hidden states of every token
        where the program returns them, else None). A decode of a token still on the device is
        built with a placeholder and gets its id there (`_placed_ids`). With in-step snapshots the
        prefix cache first picks the ones this step writes (`PrefixCache.before_step`)."""
        cache = self.prefix_cache
        if cache is not None and cache.in_step:
            cache.before_step([(req.cache, req.seq, n) for req, n in items if n > 1 and req.cache is not None])
        seq_items = [(req.seq, req.next_tokens(n)) for req, n in items]
        logits_rows = rows if any(r > 1 for r in rows) else None
        input_ids = self._placed_ids(items, seq_items) if self._inflight is not None else None
        if self.broadcast is not None:  # tensor parallel: the other ranks run the same step
            self.broadcast(seq_items, logits_rows)
        return self.execute(seq_items, logits_rows, input_ids=input_ids)

    def execute(self, seq_items, logits_rows: list[int] | None,
                input_ids: RowsAt | None = None) -> tuple[Mode, torch.Tensor, torch.Tensor | None]:
        """Run one step's forward: (request state, new token ids) per request; `input_ids` the ids of
        its placeholder rows, on the device. The other ranks of a tensor-parallel run call this with
        the steps rank 0 broadcasts (runtime/dist/distributed.py)."""
        mode, logits, hidden = self.runner.execute(seq_items, logits_rows, input_ids)
        commit_step(seq_items)
        return mode, logits, hidden

    def _sample(self, ready: list[tuple[Request, int]], logits: torch.Tensor,
                forked: list | None = None) -> list[StepOutput]:
        """logits [R, V] where the step ran; `ready`: each request with nothing left pending and its
        row for its next token. `forked` (if given) gets (child, parent) for each request forked
        from a parent's prefill. The tokens are drawn on the device's rows by
        runtime/engine/choices.py (`Choices.draw`), and read at once."""
        now = time.perf_counter()
        ready = list(ready)
        for req, row in list(ready):
            children = self._fork(req)
            ready += [(child, row) for child in children]
            if forked is not None:
                forked += [(child, req) for child in children]
        drawing = [(req, row) for req, row in ready if req.params.max_new_tokens > 0]
        tokens = dict(zip((req.request_id for req, _ in drawing), self.choices.draw(drawing, logits)))
        outputs = []
        for req, _ in ready:
            first = req.first_token_s is None
            if req.first_token_s is None:
                req.first_token_s = now - req.arrival_s
            token = tokens.get(req.request_id)
            if token is None:  # nothing to generate: the prompt is scored, the request is done
                req.stop_reason = "length"
            else:
                req.output.append(token)
                req.stop_reason = stop_reason(req, token)
            prompt_logprobs = tuple(req.prompt_logprobs) if first and req.params.prompt_logprobs is not None else None
            outputs.append(StepOutput(req.request_id, token, req.stop_reason is not None,
                                      req.logprobs[-1] if token is not None and req.params.logprobs is not None
                                      else None, prompt_logprobs))
        return outputs

    def _fork(self, req: Request) -> list[Request]:
        """The requests waiting to share `req`'s prefill, now that its prompt is cached: each gets
        its own slot and pages with copies of req's states and KV, and the ones that do are
        returned (they sample from req's row this step). The others are queued to prefill alone."""
        forks, req.forks = req.forks, []
        forked = []
        for child in forks:
            child.fork_of = None
            child.prompt_logprobs = list(req.prompt_logprobs)
            if child.params.max_new_tokens == 0:
                forked.append(child)  # only the prompt's scores: nothing to copy
                continue
            pages = len(req.seq.pages)
            running = self.scheduler.running
            if len(running) >= self.max_running or not self.state_pool.num_free or pages > self.kv_pool.num_free:
                self.scheduler.waiting.appendleft(child)
                self.numbers.totals["prefills_recomputed"] += 1
                continue
            child.seq = SeqState(self.state_pool.alloc(), self.kv_pool.alloc(pages), req.seq.num_cached)
            self.state_pool.copy_slot(req.seq.slot, child.seq.slot)
            self.kv_pool.copy_pages(req.seq.pages, child.seq.pages)
            self.scheduler.running.append(child)
            self.numbers.totals["prefills_shared"] += 1
            forked.append(child)
        return forked

    def _queue_forks(self, req: Request) -> None:
        """A request that leaves before its prompt is cached hands its waiting forks to the queue's front."""
        for child in reversed(req.forks):
            child.fork_of = None
            self.scheduler.waiting.appendleft(child)
        req.forks = []

    def _retire(self, finished: list[Request]) -> None:
        for req in finished:
            if req.seq is not None:  # a fork that only scored its prompt never held a slot
                self.scheduler.running.remove(req)
                self._release(req)
            elif req in self.scheduler.waiting:  # preempted while its last token was on the device
                self.scheduler.waiting.remove(req)
            self._finish(req, req.stop_reason)

    def _finish(self, req: Request, reason: str) -> None:
        while req.output and req.output[-1] == PLACEHOLDER_TOKEN:  # tokens still on the device are dropped
            req.output.pop()
        del self._live[req.request_id]
        self._results[req.request_id] = RequestResult(
            req.request_id, tuple(req.prompt), tuple(req.output), reason, req.first_token_s,
            time.perf_counter() - req.arrival_s, req.preemptions, tuple(req.logprobs), tuple(req.prompt_logprobs),
            req.cached_tokens or 0)
        self.numbers.totals["requests_finished"] += 1

    def cached_tokens(self, request_id: Hashable) -> int | None:
        """Prompt tokens a live or finished request got from the prefix cache; None before its admission."""
        req = self._live.get(request_id)
        if req is not None:
            return req.cached_tokens
        result = self._results.get(request_id)
        return None if result is None else result.cached_tokens

    def timing(self) -> dict:
        """Per-phase times, for `hgc run --json` (runtime/engine/statistics.py)."""
        return self.numbers.timing()

    def speculation(self) -> dict:
        """Speculative decoding's numbers, for `hgc run --json` and /metrics (runtime/engine/statistics.py)."""
        return self.numbers.speculation()

    def stats(self) -> dict:
        """free_pages counts the pages a request can take: free ones and those only the prefix cache holds."""
        cache = self.prefix_cache
        return {
            "queue_depth": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "free_slots": self.state_pool.num_free,
            "total_slots": self.state_pool.num_slots,
            "free_pages": self.kv_pool.num_free + (cache.tree.reclaimable_pages() if cache is not None else 0),
            "total_pages": self.kv_pool.num_pages,
            **self.numbers.counts(),
            "prefix_cache": cache is not None,
            **(cache.stats() if cache is not None else {}),
            # graph_replays / piecewise_steps / eager_steps, when a graph runner dispatches the steps
            **self.runner.counters,
            **({f"spec_{k}": v for k, v in self.speculation().items()} if self.spec is not None else {}),
            **({"kernels_built_serving": len(self.kernel_watch.builds)} if self.kernel_watch is not None else {}),
        }

    def step_records(self) -> list[StepRecord]:
        """The most recent steps (up to `recent_steps` of them), oldest first."""
        return list(self.numbers.recent)


@dataclasses.dataclass
class _Launch:
    """One step from its launch to its end (its chosen ids read): what it ran, and what waits for it."""
    plan: StepPlan
    start: float  # when the step() that launched it began
    members: dict[int, Request]  # every request it runs, by id(): their slots and pages are in use until it ends
    mode: Mode | None = None
    held: list[Request] = dataclasses.field(default_factory=list)  # ended meanwhile: released at its end
    # Overlapped: the requests whose next token it chose on the device (in row order), each one's
    # output index of that token (a placeholder until read), the ids and their copy to the host.
    ready: list[Request] = dataclasses.field(default_factory=list)
    at: list[int] = dataclasses.field(default_factory=list)
    ids: torch.Tensor | None = None
    copy: HostCopy | None = None
