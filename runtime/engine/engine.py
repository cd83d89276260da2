"""Engine: continuous batching with chunked prefill over a model callable, its BoundOps and the pools.

The engine owns requests (queue, progress, sampling state) and the scheduling policy. It works
with any `forward(input_ids [T], positions [T], logits_index [B]) -> logits [B, V]` that runs its
ops through `ops` (an eager family model, or a loaded artifact), and a backend that implements
the protocol (runtime/backends/protocol.py). A step:

1. `_schedule`: pick the work of this step under a token budget: a chunk of prompt for each
   request still prefilling (`prefill`), one token for each request decoding (`decode`), new
   requests admitted from the queue. Pages for the chosen tokens are taken here. With a prefix
   cache, an admitted request starts after the longest prefix the cache holds for it (its pages
   shared, its linear state copied from a snapshot), and chunks end where snapshots are due.
2. `_run`: lay the chosen tokens out as one batch (`build_step`), let the backend plan it
   (`init_step_metadata`, and `init_chunk_metadata` when prompt chunks are in it), run the forward.
   Then, with a prefix cache, requests that stopped at a snapshot point are snapshotted.
3. `_score_prompts`: requests that asked for their prompt's log-probabilities (echo) got logits
   rows for each prompt token of their chunk; those rows are scored on the device
   (runtime/engine/logprobs.py).
4. `_sample`: each request whose pending tokens are all in the cache now samples its next token
   from its own logits row and its own generator, after its logit_bias and penalties
   (runtime/engine/penalties.py); requests sharing its prompt are forked from it first (below).
5. `_retire`: requests that hit a stop token or max_new_tokens free their state slot and pages at
   once. (`cancel` frees them immediately, between steps.)

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

With `prompts_apart` (an artifact compiled with --batch-invariant), a step's prompt chunks and its
decodes run as two forwards, the chunks first, as they do with speculative decoding: a decoding
request's row then always goes through a decode step, whose rows are computed alike whatever
shares them, and never through a mixed step's prefill attention.

Timing: a step that carries prompt tokens (a prefill chunk, alone or mixed with decodes) counts as
prefill time; a step of decodes only counts as decode time. The step time ends after sampling, which reads
the logits on the host, so device work is included.

With a graph runner (runtime/graphs/runner.py, started before the engine serves), step 2 is the
runner's `execute`: it builds the step padded to a captured key and picks full graph, piecewise or
eager. The prefix cache's policy (what a request reuses, where its chunks end, when it snapshots)
is runtime/cache/prefix_cache.py's; the engine calls it.

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
runtime/engine/loop.py steps it on a background thread for the server.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from typing import Callable, Hashable, NamedTuple

import torch

from compiler.splitops import Mode
from runtime.engine.acceptance import dense_distribution, draft_counts, draw, greedy_accept, rejection_accept
from runtime.backends.protocol import check_backend, plan_eager_step
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.step.bound_ops import BoundOps
from runtime.step.host_copy import to_device
from runtime.cache.kv_pool import KVPool
from runtime.engine.logprobs import TokenLogprob, token_logprobs
from runtime.engine.penalties import PenaltyTables
from runtime.cache.prefix_cache import CacheHold, PrefixCache
from runtime.engine.sampling import SamplingParams, filtered_distribution, make_generator, sample_next
from runtime.engine.speculative import DraftChunk, SpeculativeDecoder
from runtime.cache.state_pool import StatePool

__all__ = ["Engine", "RequestResult", "StepOutput", "StepRecord", "EngineStalled", "SamplingParams"]


class EngineStalled(RuntimeError):
    """A step with queued or running requests scheduled nothing: a bug in the policy, never a state to wait in."""


class StepOutput(NamedTuple):
    request_id: Hashable
    token: int | None  # None: a request that generates nothing (max_new_tokens 0) has finished
    finished: bool
    logprob: TokenLogprob | None = None  # when the request asked for logprobs
    # The request's first output carries its prompt's log-probabilities, when it asked for them:
    # one entry for each prompt token after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclasses.dataclass(frozen=True)
class RequestResult:
    request_id: Hashable
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]  # a stop token, when one ended the request, is the last entry
    finish_reason: str  # "stop" | "length" | "cancelled"
    first_token_s: float | None  # from add_request to the first token
    total_s: float  # from add_request to the end
    preemptions: int
    logprobs: tuple[TokenLogprob, ...] = ()  # one per output token, when asked for
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # one per prompt token after the first, when asked for
    cached_tokens: int = 0  # prompt tokens the prefix cache gave it at its first admission


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
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # for tokens 1, 2, ...
    forks: list["_Request"] = dataclasses.field(default_factory=list)  # waiting to share this prompt's prefill
    fork_of: "_Request | None" = None  # while this request waits for that one's prefill
    cache: CacheHold | None = None  # while running with a prefix cache (admitted from the queue, not forked)
    cached_tokens: int | None = None  # prompt tokens from the prefix cache at its first admission
    matcher: object | None = None  # its grammar's matcher (runtime/engine/grammar.py), with structured output
    # Speculative decoding: the draft tokens proposed for its next verify step, the draft's
    # distribution each was drawn from (None: argmax, or a proposer that gives none), and how many
    # of them the matcher has taken ahead of the output (rolled back before verification).
    drafts: list[int] = dataclasses.field(default_factory=list)
    draft_q: list = dataclasses.field(default_factory=list)
    grammar_ahead: int = 0

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

    def logits_rows(self, n: int) -> int:
        """Logits rows this request needs from a chunk of its next n tokens, counted back from its
        last one: 1, or more while it scores prompt tokens. The row at position p predicts token
        p + 1; prompt tokens 1 .. len(prompt) - 1 are scored, those already scored are skipped
        (a preempted request re-prefills)."""
        if self.params.prompt_logprobs is None:
            return 1
        end = self.num_cached + n
        first = max(self.num_cached, len(self.prompt_logprobs))
        return end - first if first < min(end, len(self.prompt) - 1) else 1


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
                 device: torch.device | str = "cpu", recent_steps: int = 256, runner=None,
                 prefix_cache: PrefixCache | None = None, speculative: SpeculativeDecoder | None = None,
                 prompts_apart: bool = False):
        """runner: a started GraphRunner (runtime/graphs/runner.py) over the same ops and pools; each
        step then goes through its dispatcher (full graph, piecewise or eager) instead of `forward`,
        which may be None. Build it with chunk_size=max_tokens_per_step.
        prefix_cache: a PrefixCache over the same pools (None: every request prefills its whole prompt).
        speculative: a SpeculativeDecoder over the same pools (its main steps are the runner's, when
        there is one); the main program then runs through it and `forward` is not used.
        prompts_apart: prompt chunks and decodes of one step run as two forwards, the chunks first (as
        with speculative decoding), so a decoding request's row goes through a decode step, never
        a mixed one. An artifact compiled with --batch-invariant asks for it: its decode rows are
        computed alike in every decode and verify step, and a mixed step's attention is not."""
        check_backend(ops.backend)  # the hooks are called below without guards
        if runner is not None and (runner.ops is not ops or runner.kv_pool is not kv_pool
                                   or runner.state_pool is not state_pool):
            raise ValueError("Engine: the graph runner must run the engine's own op table and pools")
        if prefix_cache is not None and (prefix_cache.kv_pool is not kv_pool
                                         or prefix_cache.state_pool is not state_pool):
            raise ValueError("Engine: the prefix cache must hold the engine's own pools")
        if speculative is not None and (speculative.state_pool is not state_pool
                                        or (runner is not None and speculative.main is not runner)):
            raise ValueError("Engine: the speculative decoder must hold the engine's state pool and run its main "
                             "program through the engine's graph runner")
        self.spec = speculative
        self.prompts_apart = prompts_apart
        lookahead = speculative.draft_tokens if speculative is not None else 0
        self.prefix_cache = prefix_cache
        if max_tokens_per_step < 1:
            raise ValueError(f"Engine: max_tokens_per_step must be >= 1 (got {max_tokens_per_step})")
        self.forward = forward
        self.runner = runner
        # after start-up, with a compiled bundle: names kernels built while serving (runtime/artifact/bundle.ServingWatch)
        self.kernel_watch = None
        self.ops = ops
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.device = device
        self.max_tokens_per_step = max_tokens_per_step
        self.max_running = min(max_running or state_pool.num_slots, state_pool.num_slots,
                               speculative.max_verify if speculative is not None else state_pool.num_slots)
        # A verify step writes D positions past a request's next token: a request must fit with them.
        capacity = kv_pool.num_pages * kv_pool.page_size - lookahead
        self.max_seq_len = min(max_seq_len or capacity, capacity)  # longer could never finish
        self._ids = itertools.count()
        self._live: dict[Hashable, _Request] = {}
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []  # admission order: oldest first
        self._results: dict[Hashable, RequestResult] = {}
        self._recent: collections.deque[StepRecord] = collections.deque(maxlen=recent_steps)
        self._totals = collections.Counter()  # counts and seconds, see timing() / stats()
        self._penalties: PenaltyTables | None = None  # made when a request with a penalty or bias first samples
        # Tensor parallel, rank 0: called with each step's (seq_items, logits_rows) before it runs,
        # to send it to the other ranks (runtime/dist/distributed.py). None on one device.
        self.broadcast: Callable | None = None

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
        req = _Request(request_id, prompt, params, make_generator(params), time.perf_counter())
        if params.grammar is not None:
            req.matcher = params.grammar.matcher()
        self._live[request_id] = req
        if parent is not None:
            req.fork_of = parent
            parent.forks.append(req)
        else:
            self._waiting.append(req)
        return request_id

    def cancel(self, request_id: Hashable) -> bool:
        """End a queued or running request now, freeing its slot and pages. False if it is not live."""
        req = self._live.get(request_id)
        if req is None:
            return False
        if req.fork_of is not None:
            req.fork_of.forks.remove(req)
        elif req.seq is None:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
            self._release(req)
        self._queue_forks(req)  # they prefill by themselves now
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
        if self.spec is None and not self.prompts_apart:
            mode, outputs, _ = self._forward_and_sample(items)  # prefill chunks and decodes in one forward
        else:  # prompt chunks alone first (the draft then runs over the same positions), then the decodes
            mode, outputs = None, []
            if plan.prefill:
                mode, outputs, _ = self._forward_and_sample(plan.prefill, drafts=self.spec is not None)
            if plan.decode and self.spec is not None:  # every decoding request: drafts, one verify step
                outputs += self._verify(plan.decode)
                mode = mode or Mode.TARGET_VERIFY
            elif plan.decode:  # prompts_apart: a decode step of their own
                decode_mode, decoded, _ = self._forward_and_sample([(req, 1) for req in plan.decode])
                outputs += decoded
                mode = mode or decode_mode
        self._retire([self._live[out.request_id] for out in outputs if out.finished])  # forks included
        self._record(plan, mode, sum(out.token is not None for out in outputs), time.perf_counter() - start)
        if self.kernel_watch is not None:
            self.kernel_watch.check()
        return outputs

    def _forward_and_sample(self, items: list[tuple[_Request, int]], drafts: bool = False):
        """Steps 2-4 for these requests: one forward, prompt scores, samples; with `drafts`, the
        drafter's pass over the same positions after. (mode, outputs, hidden states or None)."""
        rows = [req.logits_rows(n) for req, n in items]
        mode, logits, hidden = self._run(items, rows)  # logits [sum(rows), V]
        if self.prefix_cache is not None:  # before sampling retires anyone: the slots hold the states
            self.prefix_cache.after_step([(req.cache, req.seq, req.prompt, req.output) for req, _ in items
                                          if req.cache is not None])
        last_rows = list(itertools.accumulate(rows, initial=-1))[1:]  # each request's last logits row
        self._score_prompts(items, rows, last_rows, logits)
        forked: list[tuple[_Request, _Request]] = []
        outputs = self._sample(items, last_rows, logits, forked)  # for every request with nothing left pending
        if drafts:
            chunks = self._draft_chunks(items, forked)
            self.spec.timed(self.spec.drafter.after_prefill, chunks, hidden, self._choose)
        return mode, outputs, hidden

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
            n = self._fit(req, want)
            while n == 0 and self._running[-1] is not req:
                victim = self._running[-1]
                self._preempt(victim)
                plan.preempted.append(victim)
                n = self._fit(req, want)
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
            hold = None
            # A request scoring its prompt needs the logits of every prompt position, which a cached
            # prefix does not keep: it prefills the whole prompt.
            if self.prefix_cache is not None and req.params.prompt_logprobs is None:
                hold = self.prefix_cache.take(req.prompt + req.output, len(req.prompt))
            cached = 0 if hold is None else hold.tokens
            n = min(req.num_tokens - cached, budget)
            if hold is not None:
                n = self.prefix_cache.chunk(hold, cached, n, req.num_tokens)
            need = self.kv_pool.pages_for(cached + n) - self.kv_pool.pages_for(cached)
            if not self._free_pages(need):
                if hold is not None:
                    self.prefix_cache.drop(hold)
                return  # the head waits for pages; the queue waits behind it
            self._waiting.popleft()
            req.seq = SeqState(self.state_pool.alloc())  # alloc zeroes the slot: no state from its last owner
            if hold is not None:
                self.prefix_cache.attach(hold, req.seq, req.num_tokens)  # shared pages, the snapshot in its slot
            req.cache = hold
            if req.cached_tokens is None:
                req.cached_tokens = min(cached, len(req.prompt))
            self._running.append(req)
            self._take_pages(req, n)
            budget -= n
            plan.prefill.append((req, n))

    def _run(self, items: list[tuple[_Request, int]], rows: list[int]) -> tuple[Mode, torch.Tensor, torch.Tensor | None]:
        """One forward over every scheduled token (prefill chunks and decodes together); `rows[b]`
        logits rows for request b (its last ones). (mode, logits, the hidden states of every token
        with speculative decoding, else None)."""
        seq_items = [(req.seq, req.next_tokens(n)) for req, n in items]
        logits_rows = rows if any(r > 1 for r in rows) else None
        if self.broadcast is not None:  # tensor parallel: the other ranks run the same step
            self.broadcast(seq_items, logits_rows)
        return self.execute(seq_items, logits_rows)

    def execute(self, seq_items, logits_rows: list[int] | None) -> tuple[Mode, torch.Tensor, torch.Tensor | None]:
        """Run one step's forward: (request state, new token ids) per request. The other ranks of a
        tensor-parallel run call this with the steps rank 0 broadcasts (runtime/dist/distributed.py)."""
        if self.spec is not None:
            mode, logits, hidden = self.spec.run_main(seq_items, logits_rows)
            commit_step(seq_items)
            return mode, logits, hidden
        if self.runner is not None:
            mode, logits = self.runner.execute(seq_items, logits_rows)
            commit_step(seq_items)
            return mode, logits, None
        if self.forward is None:
            raise RuntimeError("Engine: no forward callable and no graph runner to run the step")
        step = build_step(seq_items, self.kv_pool, self.device, logits_rows=logits_rows)
        plan_eager_step(self.ops.backend, step.ctx, self.max_tokens_per_step)
        with self.ops.step(step.ctx), torch.no_grad():
            logits = self.forward(step.input_ids, step.positions, step.logits_index)  # [B, V]
        commit_step(seq_items)
        return step.ctx.mode, logits, None

    def _score_prompts(self, items: list[tuple[_Request, int]], rows: list[int], last_rows: list[int],
                       logits: torch.Tensor) -> None:
        """Score the prompt tokens whose predicting rows this step computed, for requests that asked."""
        picks, targets, ks, owners = [], [], [], []
        for (req, n), count, last in zip(items, rows, last_rows):
            if req.params.prompt_logprobs is None:
                continue
            end = req.num_cached  # committed: the chunk's positions are end - n .. end - 1
            for position in range(max(end - count, len(req.prompt_logprobs)), min(end, len(req.prompt) - 1)):
                picks.append(last - (end - 1 - position))
                targets.append(req.prompt[position + 1])
                ks.append(req.params.prompt_logprobs)
                owners.append(req)
        if picks:
            index = torch.tensor(picks, device=logits.device)
            for req, entry in zip(owners, token_logprobs(logits[index], targets, ks)):
                req.prompt_logprobs.append(entry)

    def _sample(self, items: list[tuple[_Request, int]], last_rows: list[int],
                logits: torch.Tensor, forked: list | None = None) -> list[StepOutput]:
        """logits [R, V] where the step ran; `last_rows[b]` is request b's row for its next token.
        `forked` (if given) gets (child, parent) for each request forked from a parent's prefill.

        Only what sampling reads crosses to the host: the chosen ids of greedy requests (at 128
        requests and a 152k vocabulary the whole matrix would be 78 MB a step), the float32 rows of
        requests that draw, and the log-probabilities asked for (runtime/engine/logprobs.py)."""
        now = time.perf_counter()
        ready = []  # (request, its logits row); a prompt chunk that is not the last is not ready
        for (req, _), row in zip(items, last_rows):
            if req.num_pending == 0:
                ready.append((req, row))
                children = self._fork(req)
                ready += [(child, row) for child in children]
                if forked is not None:
                    forked += [(child, req) for child in children]
        drawing = [(req, row) for req, row in ready if req.params.max_new_tokens > 0]
        tokens = dict(zip((req.request_id for req, _ in drawing), self._draw(drawing, logits)))
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
                req.stop_reason = self._stop_reason(req, token)
            prompt_logprobs = tuple(req.prompt_logprobs) if first and req.params.prompt_logprobs is not None else None
            outputs.append(StepOutput(req.request_id, token, req.stop_reason is not None,
                                      req.logprobs[-1] if token is not None and req.params.logprobs is not None
                                      else None, prompt_logprobs))
        return outputs

    def _draw(self, batch: list[tuple[_Request, int]], logits: torch.Tensor) -> list[int]:
        """The next token of each (request, logits row): argmax or the request's own draw, from
        the logits after its bias and penalties; records the log-probabilities asked for."""
        if not batch:
            return []
        reqs = [req for req, _ in batch]
        raw = logits[torch.tensor([row for _, row in batch], device=logits.device)]  # [B, V]
        if self._penalties is None and any(req.params.changes_logits for req in reqs):
            self._penalties = PenaltyTables(self.state_pool.num_slots + 1, raw.shape[1], raw.device)
        processed, slots = raw, None
        if self._penalties is not None:
            # Once the tables exist every request has a row (neutral without penalties): one batched op.
            for req in reqs:
                self._penalties.load(req.seq.slot, req, req.params, req.prompt, req.output)
            slots = torch.tensor([req.seq.slot for req in reqs], device=raw.device)
            processed = self._penalties.apply(raw, slots)
        processed = self._constrain(reqs, raw, processed)
        drawn = [b for b, req in enumerate(reqs) if not req.params.greedy]
        greedy_ids = processed.argmax(-1).tolist() if len(drawn) < len(reqs) else None
        rows = dict(zip(drawn, processed[drawn].float().cpu())) if drawn else {}
        tokens = [sample_next(rows[b], req.params, req.generator) if b in rows else greedy_ids[b]
                  for b, req in enumerate(reqs)]
        if self._penalties is not None:
            self._penalties.record(slots, torch.tensor(tokens, device=raw.device))
        for req, token in zip(reqs, tokens):
            self._follow_grammar(req, token)
        scored = [b for b, req in enumerate(reqs) if req.params.logprobs is not None]
        if scored:
            entries = token_logprobs(raw[scored], [tokens[b] for b in scored], [reqs[b].params.logprobs for b in scored])
            for b, entry in zip(scored, entries):
                reqs[b].logprobs.append(entry)
        return tokens

    # -- structured output ------------------------------------------------------------------

    @staticmethod
    def _constrain(reqs: list[_Request], raw: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
        """processed [B, V] with each grammar request's disallowed tokens at -inf (a copy when it
        would change `raw`, whose rows the log-probabilities read)."""
        ruled = [b for b, req in enumerate(reqs) if req.matcher is not None]
        if not ruled:
            return processed
        from runtime.engine.grammar import apply_bitmask, new_bitmask

        bitmask = new_bitmask(len(reqs), processed.shape[1])
        for b in ruled:
            reqs[b].matcher.fill(bitmask, b)
        processed = processed.to(torch.float32, copy=processed is raw)
        apply_bitmask(processed, bitmask)
        return processed

    @staticmethod
    def _follow_grammar(req: _Request, token: int) -> None:
        """A token the request emits advances its matcher; one its grammar refuses is a bug, not a state."""
        if req.matcher is not None and not req.matcher.terminated and not req.matcher.accept(token):
            raise RuntimeError(f"request {req.request_id!r}: token {token} was chosen against its grammar "
                               f"({req.params.grammar})")

    # -- speculative decoding --------------------------------------------------------------

    @staticmethod
    def _drop_drafts(req: _Request) -> None:
        """Forget the request's drafts; its matcher gives back the ones it took ahead."""
        if req.matcher is not None:
            req.matcher.rollback(req.grammar_ahead)
        req.grammar_ahead = 0
        req.drafts, req.draft_q = [], []

    def _draft_chunks(self, items: list[tuple[_Request, int]], forked: list[tuple[_Request, _Request]]) -> list[DraftChunk]:
        """What the draft runs after a prefill step: each chunk's positions again, each with the
        token one ahead, and for a request that decodes next, its first draft from the last
        position. A request that finished has no draft; one forked from a parent gets the
        parent's last chunk (its pages came before the draft wrote it) with its own sample last."""
        chunks, of_parent, end = [], {}, 0
        for req, n in items:
            end += n
            start = req.num_cached - n
            ids = (req.prompt + req.output)[start + 1:start + n + 1]
            rows = torch.arange(end - n, end)
            of_parent[id(req)] = (start, ids, rows)
            if req.stop_reason is None:
                chunks.append(DraftChunk(req.seq, start, ids, rows, req if req.num_pending == 1 else None))
        for child, parent in forked:
            if child.stop_reason is None and child.seq is not None:
                start, ids, rows = of_parent[id(parent)]
                chunks.append(DraftChunk(child.seq, start, ids[:-1] + [child.output[-1]], rows, child))
        return chunks

    def _choose(self, reqs: list[_Request], logits: torch.Tensor, position: int) -> None:
        """The draft token at `position` (0 .. D-1) of each request from the draft's logits [B, V]:
        its grammar applied, then argmax or a draw from the request's filtered distribution (kept
        as q for rejection sampling). Position 0 starts a new set of drafts."""
        for req in reqs:
            if position == 0:
                self._drop_drafts(req)
            assert len(req.drafts) == position, f"request {req.request_id!r}: draft {position} after {req.drafts}"
        processed = self._constrain(reqs, logits, logits)
        greedy = [req.params.greedy for req in reqs]
        ids = processed.argmax(-1).tolist() if any(greedy) else None
        for b, req in enumerate(reqs):
            q = None
            if greedy[b]:
                token = ids[b]
            else:
                q = dense_distribution(*filtered_distribution(processed[b].float().cpu(), req.params),
                                       processed.shape[1])
                token = draw(q, req.generator)
            self._add_draft(req, token, q)

    @staticmethod
    def _drafts_by_argmax(req: _Request) -> bool:
        """Whether `_choose` takes the request's drafts as the draft logits' argmax, unchanged: it is
        greedy (no draw) and has no grammar (whose bitmask is the one change `_choose` makes to
        draft logits; penalties and bias apply to the target's rows only, in `_accept_drafts`).
        When it holds for every request of a round, the drafter chooses on the device
        (`propose_on_device`) and the tokens come back in one read (`_take_drafts`)."""
        return req.params.greedy and req.matcher is None

    def _take_drafts(self, reqs: list[_Request], tokens: list[list[int]], position: int) -> None:
        """Drafts the drafter chose as the draft logits' argmax (`_drafts_by_argmax` holds for
        every request): tokens[b] appended to request b's drafts from `position` on, as `_choose`
        appends them."""
        assert all(self._drafts_by_argmax(req) for req in reqs)
        for req, chosen in zip(reqs, tokens):
            assert len(req.drafts) == position, f"request {req.request_id!r}: draft {position} after {req.drafts}"
            for token in chosen:
                self._add_draft(req, token, None)

    @staticmethod
    def _add_draft(req: _Request, token: int, q) -> None:
        """The bookkeeping of one chosen draft: the token, its distribution (None: argmax), the matcher ahead."""
        req.drafts.append(token)
        req.draft_q.append(q)
        if req.matcher is not None and req.matcher.accept(token):
            req.grammar_ahead += 1

    def _verify(self, reqs: list[_Request]) -> list[StepOutput]:
        """One round for the decoding requests: drafts, a target_verify step, the tokens each keeps.

        A request's d_1 is on the host (its drafts hold it: chosen after its prefill, or after a
        round with a request that needs the host) or only on the device (the drafter's `first`).
        When every request's drafts are the draft's argmax, the drafter chains on the device; when
        no request's logits change either, the round reads the device once (`_verify_on_device`)."""
        spec, D = self.spec, self.spec.draft_tokens
        if all(self._drafts_by_argmax(req) for req in reqs):
            drafts = spec.timed(spec.drafter.propose_on_device, reqs)
            if not any(req.params.changes_logits for req in reqs):
                return self._verify_on_device(reqs, drafts)
            tokens = drafts.tolist()  # penalties and bias: the target's rows are processed on the host
            for req in reqs:
                self._drop_drafts(req)
            self._take_drafts(reqs, tokens, 0)
        else:
            on_device = [req for req in reqs if not req.drafts]  # their d_1 the argmax, left on the device
            if on_device:
                self._take_drafts(on_device, [[t] for t in spec.drafter.first_drafts(on_device)], 0)
            spec.timed(spec.drafter.propose, reqs, self._choose)
        bad = [req.request_id for req in reqs if len(req.drafts) != D]
        if bad:
            raise RuntimeError(f"the drafter proposed no {D} drafts for request(s) {bad[:3]}")
        starts = [req.seq.num_cached for req in reqs]
        begin = time.perf_counter()
        logits, hidden = spec.verify([(req.seq, req.next_tokens(1) + req.drafts) for req in reqs])
        kept = self._accept_drafts(reqs, logits)
        return self._finish_round(reqs, starts, kept, logits, hidden, begin, self._choose)

    def _verify_on_device(self, reqs: list[_Request], drafts: torch.Tensor) -> list[StepOutput]:
        """A round of greedy requests with no grammar, penalty or bias: the verify step takes the
        drafts [B, D] from the device, and one read brings them back with the target's argmax.
        The draft after it runs before that read, from what the device holds
        (`after_verify_on_device`), and leaves each next d_1 on the device. So the host never
        waits for the device between the round's steps but once, and lays each step out while
        the device runs the one before."""
        spec, D = self.spec, self.spec.draft_tokens
        starts = [req.seq.num_cached for req in reqs]
        begin = time.perf_counter()
        last = to_device([req.next_tokens(1)[0] for req in reqs], drafts.device)
        ids = torch.cat([last[:, None], drafts], 1).flatten()
        logits, hidden = spec.verify([(req.seq, [0] * (D + 1)) for req in reqs], input_ids=ids)
        target = logits.argmax(-1).view(len(reqs), D + 1)
        if spec.draft_before_read:
            drafting = spec.draft_s
            spec.timed(spec.drafter.after_verify_on_device, reqs, starts, drafts, target, hidden)
            begin += spec.draft_s - drafting  # the drafter's time counts as drafting, not as verify time
        read = torch.cat([drafts, target], 1).tolist()  # the round's one read
        for req in reqs:
            self._drop_drafts(req)  # a d_1 chosen on the host after a prefill is the same argmax
        self._take_drafts(reqs, [row[:D] for row in read], 0)
        kept = [greedy_accept(req.drafts, row[D:]) for req, row in zip(reqs, read)]
        return self._finish_round(reqs, starts, kept, logits, hidden, begin, None, drafted=spec.draft_before_read)

    def _finish_round(self, reqs: list[_Request], starts: list[int], kept: list[list[int]], logits: torch.Tensor,
                      hidden: torch.Tensor, begin: float, choose, drafted: bool = False) -> list[StepOutput]:
        """After a verify step: emit the kept tokens, keep their states, and run the draft over the
        kept positions for the requests that go on (choose None: their next d_1 stays on the
        device), unless it ran already (`drafted`: `after_verify_on_device`)."""
        spec, D = self.spec, self.spec.draft_tokens
        outputs = self._emit(reqs, kept, logits)
        self._totals["spec_verify_s"] += time.perf_counter() - begin
        self._totals["spec_steps"] += 1
        self._totals["spec_verified"] += len(reqs)
        self._totals["spec_drafted"] += len(reqs) * D
        self._totals["spec_accepted"] += sum(len(k) - 1 for k in kept)
        spec.keep([req.seq for req in reqs], [len(k) for k in kept])
        for req in reqs:
            self._drop_drafts(req)
        going = [b for b, req in enumerate(reqs) if req.stop_reason is None]
        if going and not drafted:
            rows = hidden.view(len(reqs), D + 1, -1)
            rows = (rows if len(going) == len(reqs) else rows[to_device(going, hidden.device)]).flatten(0, 1)
            spec.timed(spec.drafter.after_verify, [reqs[b] for b in going], [starts[b] for b in going],
                       [kept[b] for b in going], rows, choose)
        return outputs

    def _accept_drafts(self, reqs: list[_Request], logits: torch.Tensor) -> list[list[int]]:
        """logits [B * (D + 1), V] of a verify step -> the tokens each request keeps: the target's
        rows after penalties (row j counting d_1 .. d_j as generated), bias and grammar (row j
        masked after d_1 .. d_j, a draft the grammar refuses ending the walk), then the greedy or
        the rejection-sampling rule."""
        B, width, V = len(reqs), self.spec.draft_tokens + 1, logits.shape[1]
        processed = logits
        if self._penalties is None and any(req.params.changes_logits for req in reqs):
            self._penalties = PenaltyTables(self.state_pool.num_slots + 1, V, logits.device)
        if self._penalties is not None:
            for req in reqs:
                self._penalties.load(req.seq.slot, req, req.params, req.prompt, req.output)
            slots = torch.tensor([req.seq.slot for req in reqs], device=logits.device).repeat_interleave(width)
            processed = self._penalties.apply(logits, slots, draft_counts([req.drafts for req in reqs], V,
                                                                          logits.device))
        ruled = [b for b, req in enumerate(reqs) if req.matcher is not None]
        if ruled:
            from runtime.engine.grammar import apply_bitmask, new_bitmask, verify_masks

            bitmask = new_bitmask(B * width, V)
            for b in ruled:
                req = reqs[b]
                req.matcher.rollback(req.grammar_ahead)  # the drafts it took ahead: walked again below
                req.grammar_ahead = 0
                verify_masks(req.matcher, req.drafts, bitmask, b * width)
            processed = processed.to(torch.float32, copy=processed is logits)
            apply_bitmask(processed, bitmask)
        greedy = [req.params.greedy for req in reqs]
        argmax = processed.argmax(-1).view(B, width).tolist() if any(greedy) else None
        kept = []
        for b, req in enumerate(reqs):
            if greedy[b]:
                kept.append(greedy_accept(req.drafts, argmax[b]))
                continue
            rows = processed[b * width:(b + 1) * width].float().cpu()
            p = [dense_distribution(*filtered_distribution(rows[j], req.params), V) for j in range(width)]
            q = [req.draft_q[j] if j < len(req.draft_q) else None for j in range(width - 1)]
            kept.append(rejection_accept(req.drafts, q, p, req.generator))
        return kept

    def _emit(self, reqs: list[_Request], kept: list[list[int]], logits: torch.Tensor) -> list[StepOutput]:
        """Append each request's kept tokens to its output, up to a stop token or max_new_tokens,
        with their log-probabilities (the target's raw rows) and penalty counts; one StepOutput each."""
        width = self.spec.draft_tokens + 1
        emitted = []  # (request, verify row, token)
        for b, (req, tokens) in enumerate(zip(reqs, kept)):
            for j, token in enumerate(tokens):
                req.output.append(token)
                self._follow_grammar(req, token)
                req.stop_reason = self._stop_reason(req, token)
                emitted.append((req, b * width + j, token))
                if req.stop_reason is not None:
                    break
        if self._penalties is not None:
            self._penalties.record(torch.tensor([req.seq.slot for req, _, _ in emitted], device=logits.device),
                                   torch.tensor([t for _, _, t in emitted], device=logits.device))
        scored = [(req, row, token) for req, row, token in emitted if req.params.logprobs is not None]
        if scored:
            rows = torch.tensor([row for _, row, _ in scored], device=logits.device)
            entries = token_logprobs(logits[rows], [t for _, _, t in scored], [r.params.logprobs for r, _, _ in scored])
            for (req, _, _), entry in zip(scored, entries):
                req.logprobs.append(entry)
        result = []
        counts = collections.Counter(req.request_id for req, _, _ in emitted)
        done = collections.Counter()
        for req, _, token in emitted:  # the last token of a request that stopped ends it
            done[req.request_id] += 1
            final = done[req.request_id] == counts[req.request_id] and req.stop_reason is not None
            index = len(req.output) - counts[req.request_id] + done[req.request_id] - 1
            logprob = req.logprobs[index] if req.params.logprobs is not None else None
            result.append(StepOutput(req.request_id, token, final, logprob))
        return result

    def _fork(self, req: _Request) -> list[_Request]:
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
            if len(self._running) >= self.max_running or not self.state_pool.num_free or pages > self.kv_pool.num_free:
                self._waiting.appendleft(child)
                self._totals["prefills_recomputed"] += 1
                continue
            child.seq = SeqState(self.state_pool.alloc(), self.kv_pool.alloc(pages), req.seq.num_cached)
            self.state_pool.copy_slot(req.seq.slot, child.seq.slot)
            self.kv_pool.copy_pages(req.seq.pages, child.seq.pages)
            self._running.append(child)
            self._totals["prefills_shared"] += 1
            forked.append(child)
        return forked

    def _queue_forks(self, req: _Request) -> None:
        """A request that leaves before its prompt is cached hands its waiting forks to the queue's front."""
        for child in reversed(req.forks):
            child.fork_of = None
            self._waiting.appendleft(child)
        req.forks = []

    def _retire(self, finished: list[_Request]) -> None:
        for req in finished:
            if req.seq is not None:  # a fork that only scored its prompt never held a slot
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

    def _free_pages(self, need: int) -> bool:
        """Whether `need` pages are free, after the prefix cache gave back unused ones if it had to."""
        if self.prefix_cache is not None:
            self.prefix_cache.reclaim(need)
        return need <= self.kv_pool.num_free

    def _lookahead(self, req: _Request) -> int:
        """Positions a step writes past the request's next tokens: D for a request that decodes
        with D drafts (its verify step writes them, then the draft's step after it)."""
        return self.spec.draft_tokens if self.spec is not None and req.decoding else 0

    def _fit(self, req: _Request, want: int) -> int:
        """Tokens (at most `want`) the running request can feed this step: as many as its pages
        allow (with its lookahead), its chunk ending where the prefix cache wants a snapshot. A
        request forked from another's prefill holds nothing of the cache (its prompt went in with
        the other's)."""
        ahead = self._lookahead(req)
        if self.prefix_cache is None or req.cache is None:
            if self.prefix_cache is not None:
                self._free_pages(self.kv_pool.pages_for(req.num_cached + want + ahead) - len(req.seq.pages))
            return max(0, min(want, self._room(req) - ahead))
        start, total = req.num_cached, req.num_tokens
        want = self.prefix_cache.chunk(req.cache, start, want, total)
        self._free_pages(self.kv_pool.pages_for(start + want + ahead) - len(req.seq.pages))
        n = max(0, min(want, self._room(req) - ahead))
        return n if n == want else self.prefix_cache.chunk(req.cache, start, n, total)

    def _take_pages(self, req: _Request, n: int) -> None:
        # Taken here rather than in build_step, so the schedule's page accounting is the truth.
        need = self.kv_pool.pages_for(req.seq.num_cached + n + self._lookahead(req)) - len(req.seq.pages)
        if need > 0:
            req.seq.pages.extend(self.kv_pool.alloc(need))

    def _release(self, req: _Request) -> None:
        self.kv_pool.free(req.seq.pages)  # pages shared with the prefix cache stay there
        self.state_pool.free(req.seq.slot)
        req.seq = None
        req.cache = None

    def _preempt(self, req: _Request) -> None:
        self._running.remove(req)
        self._release(req)
        self._drop_drafts(req)  # they are proposed again after its re-prefill
        req.preemptions += 1
        self._totals["preemptions"] += 1
        self._waiting.appendleft(req)  # it was admitted before anything still queued

    def _finish(self, req: _Request, reason: str) -> None:
        del self._live[req.request_id]
        self._results[req.request_id] = RequestResult(
            req.request_id, tuple(req.prompt), tuple(req.output), reason, req.first_token_s,
            time.perf_counter() - req.arrival_s, req.preemptions, tuple(req.logprobs), tuple(req.prompt_logprobs),
            req.cached_tokens or 0)
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
            **({"speculative": self.speculation()} if self.spec is not None else {}),
        }

    def speculation(self) -> dict:
        """Speculative decoding's numbers, for `hgc run --json` and /metrics.

        acceptance_rate: drafts kept / drafts proposed. tokens_per_verify: tokens a request gains
        from one verify step (kept drafts + the target's token; 1 to D + 1, before a stop cuts it).
        draft_s: seconds in the drafter; verify_s: seconds in verify steps and choosing what is kept."""
        t = self._totals
        return {
            "draft_tokens": self.spec.draft_tokens,
            "verify_steps": t["spec_steps"],
            "verified_requests": t["spec_verified"],
            "drafted": t["spec_drafted"],
            "accepted": t["spec_accepted"],
            "acceptance_rate": t["spec_accepted"] / t["spec_drafted"] if t["spec_drafted"] else None,
            "tokens_per_verify": (t["spec_accepted"] + t["spec_verified"]) / t["spec_verified"]
            if t["spec_verified"] else None,
            "draft_s": self.spec.draft_s,
            "verify_s": t["spec_verify_s"],
        }

    def cached_tokens(self, request_id: Hashable) -> int | None:
        """Prompt tokens a live or finished request got from the prefix cache; None before its admission."""
        req = self._live.get(request_id)
        if req is not None:
            return req.cached_tokens
        result = self._results.get(request_id)
        return None if result is None else result.cached_tokens

    def stats(self) -> dict:
        """free_pages counts the pages a request can take: free ones and those only the prefix cache holds."""
        last = self._recent[-1] if self._recent else None
        cache = self.prefix_cache
        return {
            "queue_depth": len(self._waiting),
            "running": len(self._running),
            "free_slots": self.state_pool.num_free,
            "total_slots": self.state_pool.num_slots,
            "free_pages": self.kv_pool.num_free + (cache.tree.reclaimable_pages() if cache is not None else 0),
            "total_pages": self.kv_pool.num_pages,
            "tokens_generated": self._totals["tokens_generated"],
            "requests_finished": self._totals["requests_finished"],
            "preemptions": self._totals["preemptions"],
            # requests that shared another's prefill (forked), and those that found no room to
            "prefills_shared": self._totals["prefills_shared"],
            "prefills_recomputed": self._totals["prefills_recomputed"],
            "steps": self._totals["steps"],
            "last_step_s": last.seconds if last else None,
            "recent_steps": [dataclasses.asdict(r) for r in self._recent],  # JSON-ready for a server
            **self.timing(),
            "prefix_cache": cache is not None,
            **(cache.stats() if cache is not None else {}),
            # graph_replays / piecewise_steps / eager_steps, when a graph runner dispatches the steps
            **(dict(self.runner.counters) if self.runner is not None else {}),
            **({f"spec_{k}": v for k, v in self.speculation().items()} if self.spec is not None else {}),
            **({"kernels_built_serving": len(self.kernel_watch.builds)} if self.kernel_watch is not None else {}),
        }

    def step_records(self) -> list[StepRecord]:
        """The most recent steps (up to `recent_steps` of them), oldest first."""
        return list(self._recent)


# -- driving the engine from a server ------------------------------------------------------------
