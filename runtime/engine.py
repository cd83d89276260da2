"""Engine: continuous batching with chunked prefill over a model callable, its BoundOps and the pools.

The engine owns requests (queue, progress, sampling state) and the scheduling policy. It works
with any `forward(input_ids [T], positions [T], logits_index [B]) -> logits [B, V]` that runs its
ops through `ops` (an eager family model, or a loaded artifact), and a backend that implements
the protocol (runtime/backends/protocol.py). A step:

1. `_schedule`: pick the work of this step under a token budget: a chunk of prompt for each
   request still prefilling (`prefill`), one token for each request decoding (`decode`), new
   requests admitted from the queue. Pages for the chosen tokens are taken here.
2. `_run`: lay the chosen tokens out as one batch (`build_step`), let the backend plan it
   (`init_step_metadata`, and `init_chunk_metadata` when prompt chunks are in it), run the forward.
3. `_sample`: each request whose pending tokens are all in the cache now samples its next token
   from its own logits row and its own generator.
4. `_retire`: requests that hit a stop token or max_new_tokens free their state slot and pages at
   once. (`cancel` frees them immediately, between steps.)

A request's tokens are its prompt followed by what it generated; the cache holds the first
`num_cached` of them. Prefill and decode are the same thing at different lengths: feed the tokens
not yet cached, sample when none are left. That is also how a preempted request resumes.

Scheduling policy (deterministic; nothing is random but the requests' own generators):

- Order. Running requests are served oldest-admitted first, then the queue is admitted in FIFO
  order. Each request gets min(its pending tokens, the budget left) tokens; the head of the queue
  blocks the queue (no skipping ahead, so a long prompt is not starved).
- Admission. The head of the queue is admitted when a running place (max_running), a state slot
  and the pages for its first chunk are all free. No admission in a step that preempted.
- Growth. A running request that needs pages takes them from the pool; if the pool is short it
  takes a shorter chunk. If not even one token fits, the youngest running request is preempted
  (slot and pages freed, progress dropped, put back at the front of the queue with its generated
  tokens and its generator, to re-prefill prompt + output later), repeatedly, until one token fits.
  A request that is itself the youngest waits this step instead, keeping its pages.
- No deadlock: `add_request` refuses a request longer than the KV pool, so the oldest running
  request can always grow after preempting every younger one; it finishes, and the next-oldest
  becomes the oldest. With nothing running, the whole pool is free and the queue's head is
  admitted. `step()` raises EngineStalled if a step with work to do schedules nothing.

Timing: a step that carries prompt tokens (a prefill chunk, alone or mixed with decodes) counts as
prefill time; a step of decodes only counts as decode time. The step time ends after sampling, which reads
the logits on the host, so device work is included.

With a graph runner (runtime/graph_runner.py, started before the engine serves), step 2 is the
runner's `execute`: it builds the step padded to a captured key and picks full graph, piecewise or
eager. The engine does not capture graphs itself, run speculative decoding, or cache prefixes, and
it runs on the caller's thread: runtime/engine_loop.py steps it on a background thread for the server.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Hashable, NamedTuple

import torch

from compiler.splitops import Mode
from runtime.backends.protocol import check_backend, plan_eager_step
from runtime.batch import SeqState, build_step, commit_step
from runtime.bound_ops import BoundOps
from runtime.kv_pool import KVPool
from runtime.sampling import SamplingParams, make_generator, sample_next
from runtime.state_pool import StatePool

__all__ = ["Engine", "RequestResult", "StepOutput", "StepRecord", "EngineStalled", "SamplingParams"]


class EngineStalled(RuntimeError):
    """A step with queued or running requests scheduled nothing: a bug in the policy, never a state to wait in."""


class StepOutput(NamedTuple):
    request_id: Hashable
    token: int
    finished: bool


@dataclasses.dataclass(frozen=True)
class RequestResult:
    request_id: Hashable
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # a stop token, when one ended the request, is the last entry
    finish_reason: str  # "stop" | "length" | "cancelled"
    first_token_s: float | None  # from add_request to the first token
    total_s: float  # from add_request to the end
    preemptions: int


@dataclasses.dataclass(frozen=True)
class StepRecord:
    mode: Mode
    num_seqs: int
    prefill_tokens: int  # prompt (or re-prefill) tokens fed this step
    decode_tokens: int  # single-token decodes fed this step
    sampled: int  # tokens produced this step
    seconds: float


@dataclasses.dataclass
class _Request:
    request_id: Hashable
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival_s: float
    output: list[int] = dataclasses.field(default_factory=list)
    seq: SeqState | None = None  # None while queued (never admitted, or preempted)
    first_token_s: float | None = None
    preemptions: int = 0
    stop_reason: str | None = None  # set by the step that samples its last token

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_cached(self) -> int:
        return 0 if self.seq is None else self.seq.num_cached

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_cached

    @property
    def decoding(self) -> bool:
        """One pending token, and it is the request's own last sample: a decode, not a prompt chunk."""
        return self.num_pending == 1 and self.num_cached > 0 and len(self.output) > 0

    def next_tokens(self, n: int) -> list[int]:
        start = self.num_cached
        tokens = (self.prompt + self.output)[start:start + n]
        assert len(tokens) == n, f"request {self.request_id}: asked {n} tokens, {self.num_pending} pending"
        return tokens


@dataclasses.dataclass
class _StepPlan:
    prefill: list[tuple[_Request, int]]  # (request, prompt tokens fed this step)
    decode: list[_Request]  # one token each
    preempted: list[_Request]

    def items(self) -> list[tuple[_Request, int]]:
        return self.prefill + [(req, 1) for req in self.decode]


class Engine:
    """Continuous batching over one model. Not thread-safe: drive it from one thread (or an EngineLoop)."""

    def __init__(self, forward: Callable, ops: BoundOps, kv_pool: KVPool, state_pool: StatePool, *,
                 max_tokens_per_step: int = 512, max_running: int | None = None, max_seq_len: int | None = None,
                 device: torch.device | str = "cpu", recent_steps: int = 256, runner=None):
        """runner: a started GraphRunner (runtime/graph_runner.py) over the same ops and pools; each
        step then goes through its dispatcher (full graph, piecewise or eager) instead of `forward`,
        which may be None. Build it with chunk_size=max_tokens_per_step."""
        check_backend(ops.backend)  # the hooks are called below without guards
        if runner is not None and (runner.ops is not ops or runner.kv_pool is not kv_pool
                                   or runner.state_pool is not state_pool):
            raise ValueError("Engine: the graph runner must run the engine's own op table and pools")
        if max_tokens_per_step < 1:
            raise ValueError(f"Engine: max_tokens_per_step must be >= 1 (got {max_tokens_per_step})")
        self.forward = forward
        self.runner = runner
        self.ops = ops
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.device = device
        self.max_tokens_per_step = max_tokens_per_step
        self.max_running = min(max_running or state_pool.num_slots, state_pool.num_slots)
        capacity = kv_pool.num_pages * kv_pool.page_size
        self.max_seq_len = min(max_seq_len or capacity, capacity)  # longer could never finish
        self._ids = itertools.count()
        self._live: dict[Hashable, _Request] = {}
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []  # admission order: oldest first
        self._results: dict[Hashable, RequestResult] = {}
        self._recent: collections.deque[StepRecord] = collections.deque(maxlen=recent_steps)
        self._totals = collections.Counter()  # counts and seconds, see timing() / stats()

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: Hashable = None) -> Hashable:
        """Queue a request; it joins the batch at a later step. Returns its id."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("Engine.add_request: the prompt is empty")
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
        req = _Request(request_id, prompt, params, make_generator(params), time.perf_counter())
        self._live[request_id] = req
        self._waiting.append(req)
        return request_id

    def cancel(self, request_id: Hashable) -> bool:
        """End a queued or running request now, freeing its slot and pages. False if it is not live."""
        req = self._live.get(request_id)
        if req is None:
            return False
        if req.seq is None:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
            self._release(req)
        self._finish(req, "cancelled")
        return True

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def pop_result(self, request_id: Hashable) -> RequestResult:
        """The result of a finished request (kept until popped)."""
        return self._results.pop(request_id)

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one step: schedule, run, sample, retire. Returns this step's new tokens."""
        if not self.has_work():
            return []
        start = time.perf_counter()
        plan = self._schedule()
        items = plan.items()
        if not items:
            raise EngineStalled(f"Engine.step: nothing scheduled with {len(self._waiting)} queued and "
                                f"{len(self._running)} running requests; {self.kv_pool.num_free} pages and "
                                f"{self.state_pool.num_free} slots free")
        mode, logits = self._run(items)  # prefill chunks and decodes in one forward
        outputs = self._sample(items, logits)  # for every request with nothing left pending
        self._retire([req for req, _ in items if req.stop_reason is not None])
        self._record(plan, mode, len(outputs), time.perf_counter() - start)
        return outputs

    def run_until_done(self) -> dict[Hashable, RequestResult]:
        """Step until nothing is queued or running; return (and pop) every finished request's result."""
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

    def _schedule(self) -> _StepPlan:
        plan = _StepPlan([], [], [])
        budget = self._grow_running(plan, self.max_tokens_per_step)
        if not plan.preempted:  # admitting now could hand the pages just freed straight back
            self._admit_waiting(plan, budget)
        return plan

    def _grow_running(self, plan: _StepPlan, budget: int) -> int:
        """Give running requests, oldest first, their next tokens; preempt the youngest when none fit."""
        i = 0
        while i < len(self._running) and budget > 0:  # preemption only removes requests after i
            req = self._running[i]
            i += 1
            want = min(req.num_pending, budget)
            n = min(want, self._room(req))
            while n == 0 and self._running[-1] is not req:
                victim = self._running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                n = min(want, self._room(req))
            if n == 0:
                continue  # the youngest cannot grow: it waits; older requests finish or preempt it
            self._take_pages(req, n)
            budget -= n
            if req.decoding:
                plan.decode.append(req)
            else:
                plan.prefill.append((req, n))
        return budget

    def _admit_waiting(self, plan: _StepPlan, budget: int) -> None:
        """Admit queued requests in FIFO order while a place, a slot and their first chunk's pages are free."""
        while self._waiting and budget > 0 and len(self._running) < self.max_running and self.state_pool.num_free:
            req = self._waiting[0]
            n = min(req.num_pending, budget)
            if self.kv_pool.pages_for(n) > self.kv_pool.num_free:
                return  # the head waits for pages; the queue waits behind it
            self._waiting.popleft()
            req.seq = SeqState(self.state_pool.alloc())  # alloc zeroes the slot: no state from its last owner
            self._running.append(req)
            self._take_pages(req, n)
            budget -= n
            plan.prefill.append((req, n))

    def _run(self, items: list[tuple[_Request, int]]) -> tuple[Mode, torch.Tensor]:
        """One forward over every scheduled token (prefill chunks and decodes together)."""
        seq_items = [(req.seq, req.next_tokens(n)) for req, n in items]
        if self.runner is not None:
            mode, logits = self.runner.execute(seq_items)
            commit_step(seq_items)
            return mode, logits
        if self.forward is None:
            raise RuntimeError("Engine: no forward callable and no graph runner to run the step")
        step = build_step(seq_items, self.kv_pool, self.device)
        plan_eager_step(self.ops.backend, step.ctx, self.max_tokens_per_step)
        with self.ops.step(step.ctx), torch.no_grad():
            logits = self.forward(step.input_ids, step.positions, step.logits_index)  # [B, V]
        commit_step(seq_items)
        return step.ctx.mode, logits

    def _sample(self, items: list[tuple[_Request, int]], logits: torch.Tensor) -> list[StepOutput]:
        """logits [B, V] where the step ran. Only what sampling reads crosses to the host: B argmax
        ids for greedy requests (at 128 requests and a 152k vocabulary the whole matrix would be
        78 MB a step), and the float32 rows of requests that sample."""
        outputs = []
        now = time.perf_counter()
        ready = [b for b, (req, _) in enumerate(items) if req.num_pending == 0]
        sampled = [b for b in ready if not items[b][0].params.greedy]
        greedy_ids = logits.argmax(-1).tolist() if len(sampled) < len(ready) else None
        rows = dict(zip(sampled, logits[sampled].float().cpu())) if sampled else {}
        for b in ready:
            req = items[b][0]
            # (a prompt chunk that is not the last is not ready: its row predicts a token we already have)
            token = greedy_ids[b] if req.params.greedy else sample_next(rows[b], req.params, req.generator)
            req.output.append(token)
            if req.first_token_s is None:
                req.first_token_s = now - req.arrival_s
            req.stop_reason = self._stop_reason(req, token)
            outputs.append(StepOutput(req.request_id, token, req.stop_reason is not None))
        return outputs

    def _retire(self, finished: list[_Request]) -> None:
        for req in finished:
            self._running.remove(req)
            self._release(req)
            self._finish(req, req.stop_reason)

    @staticmethod
    def _stop_reason(req: _Request, token: int) -> str | None:
        if token in req.params.stop_token_ids:
            return "stop"
        if len(req.output) >= req.params.max_new_tokens:
            return "length"
        return None

    # -- pages, slots, retirement ---------------------------------------------------------------

    def _room(self, req: _Request) -> int:
        """Tokens the request can add now: its pages' free tail plus every free page."""
        return (len(req.seq.pages) + self.kv_pool.num_free) * self.kv_pool.page_size - req.seq.num_cached

    def _take_pages(self, req: _Request, n: int) -> None:
        # Taken here rather than in build_step, so the schedule's page accounting is the truth.
        need = self.kv_pool.pages_for(req.seq.num_cached + n) - len(req.seq.pages)
        if need > 0:
            req.seq.pages.extend(self.kv_pool.alloc(need))

    def _release(self, req: _Request) -> None:
        self.kv_pool.free(req.seq.pages)
        self.state_pool.free(req.seq.slot)
        req.seq = None

    def _preempt(self, req: _Request) -> None:
        self._running.remove(req)
        self._release(req)
        req.preemptions += 1
        self._totals["preemptions"] += 1
        self._waiting.appendleft(req)  # it was admitted before anything still queued

    def _finish(self, req: _Request, reason: str) -> None:
        del self._live[req.request_id]
        self._results[req.request_id] = RequestResult(
            req.request_id, tuple(req.prompt), tuple(req.output), reason, req.first_token_s,
            time.perf_counter() - req.arrival_s, req.preemptions)
        self._totals["requests_finished"] += 1

    # -- numbers --------------------------------------------------------------------------------

    def _record(self, plan: _StepPlan, mode: Mode, sampled: int, seconds: float) -> None:
        prefill_tokens = sum(n for _, n in plan.prefill)
        record = StepRecord(mode, len(plan.prefill) + len(plan.decode), prefill_tokens, len(plan.decode),
                            sampled, seconds)
        self._recent.append(record)
        phase = "prefill" if plan.prefill else "decode"
        self._totals["steps"] += 1
        self._totals[f"{phase}_steps"] += 1
        self._totals[f"{phase}_s"] += seconds
        self._totals["prefill_tokens"] += prefill_tokens
        self._totals[f"{phase}_sampled"] += sampled
        self._totals["tokens_generated"] += sampled

    def timing(self) -> dict:
        """Per-phase times, for `hgc run --json`.

        prefill_s: seconds of steps carrying prompt tokens. decode_s_per_token: seconds per
        decode step, i.e. the time between two tokens of one request (gpt-fast's figure at
        batch 1). decode_tokens_per_s: tokens produced by decode steps per decode second.
        """
        t = self._totals
        decode_steps, decode_s = t["decode_steps"], t["decode_s"]
        return {
            "prefill_s": t["prefill_s"],
            "prefill_steps": t["prefill_steps"],
            "prefill_tokens": t["prefill_tokens"],
            "decode_s": decode_s,
            "decode_steps": decode_steps,
            "decode_s_per_token": decode_s / decode_steps if decode_steps else None,
            "decode_tokens_per_s": t["decode_sampled"] / decode_s if decode_s > 0 else None,
        }

    def stats(self) -> dict:
        last = self._recent[-1] if self._recent else None
        return {
            "queue_depth": len(self._waiting),
            "running": len(self._running),
            "free_slots": self.state_pool.num_free,
            "total_slots": self.state_pool.num_slots,
            "free_pages": self.kv_pool.num_free,
            "total_pages": self.kv_pool.num_pages,
            "tokens_generated": self._totals["tokens_generated"],
            "requests_finished": self._totals["requests_finished"],
            "preemptions": self._totals["preemptions"],
            "steps": self._totals["steps"],
            "last_step_s": last.seconds if last else None,
            "recent_steps": [dataclasses.asdict(r) for r in self._recent],  # JSON-ready for a server
            **self.timing(),
            # graph_replays / piecewise_steps / eager_steps, when a graph runner dispatches the steps
            **(dict(self.runner.counters) if self.runner is not None else {}),
        }

    def step_records(self) -> list[StepRecord]:
        """The most recent steps (up to `recent_steps` of them), oldest first."""
        return list(self._recent)


# -- driving the engine from a server ------------------------------------------------------------
