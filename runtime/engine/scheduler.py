"""Scheduling and page policy: which requests run in a step, with how many tokens, on which pages.

The scheduler holds the queue and the running set (the engine adds requests to the queue and
retires them from the running set). `schedule()` makes a step's StepPlan under the token budget:

1. `_grow_running`: running requests, oldest-admitted first (but one whose last token is still
   on the device, `awaits_last_token`: it only waits to finish), each get min(its pending tokens,
   the budget left) tokens, as many as its pages allow (`fit`). A request short of pages takes
   them from the pool; if the pool is short, the prefix cache gives back pages no request uses
   (least recently used first), and if it is still short the request takes a shorter chunk. If not
   even one token fits, the youngest running request is preempted (`preempt`: slot and pages
   freed, progress dropped, put back at the front of the queue), repeatedly, until one token fits;
   a request that is itself the youngest waits this step instead, keeping its pages.
2. `_admit_waiting` (not in a step that preempted: it could hand the pages just freed straight
   back): the head of the queue is admitted when a running place (max_running), a state slot and
   the pages for its first chunk are all free, after the longest prefix the prefix cache holds for
   it (its pages shared, its linear state copied from a snapshot); the head blocks the queue.

Pages are taken here rather than when the step is laid out, so the schedule's page accounting is
the truth. A request that decodes with D drafts reserves D positions past its next token
(`lookahead`: its verify step writes them, then the draft's step after it). The prefix cache's
policy (what a request reuses, where its chunks end) is runtime/cache/prefix_cache.py's.

It does not run steps or sample (the engine does); the policy is the engine's docstring's.
"""

from __future__ import annotations

import collections

from runtime.cache.batch import SeqState
from runtime.cache.kv_pool import KVPool
from runtime.cache.prefix_cache import PrefixCache
from runtime.cache.state_pool import StatePool
from runtime.engine.request import Request, StepPlan

__all__ = ["Scheduler"]


class Scheduler:
    """The queue, the running set and the page policy over one engine's pools.

    lookahead: D, the draft tokens of a speculative decoder (0 without one). totals: the engine's
    counters, where preemptions are counted."""

    def __init__(self, kv_pool: KVPool, state_pool: StatePool, prefix_cache: PrefixCache | None, *,
                 max_tokens_per_step: int, max_running: int, lookahead: int, totals: collections.Counter):
        self.kv_pool, self.state_pool, self.prefix_cache = kv_pool, state_pool, prefix_cache
        self.max_tokens_per_step, self.max_running, self.lookahead = max_tokens_per_step, max_running, lookahead
        self.totals = totals
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: oldest first

    def schedule(self) -> StepPlan:
        plan = StepPlan([], [], [])
        budget = self._grow_running(plan, self.max_tokens_per_step)
        if not plan.preempted:  # admitting now could hand the pages just freed straight back
            self._admit_waiting(plan, budget)
        return plan

    def _grow_running(self, plan: StepPlan, budget: int) -> int:
        """Give running requests, oldest first, their next tokens; preempt the youngest when none fit."""
        i = 0
        page_size = self.kv_pool.page_size
        while i < len(self.running) and budget > 0:  # preemption only removes requests after i
            req = self.running[i]
            i += 1
            if req.awaits_last_token:  # its last token is on the device: it only waits to finish
                continue
            seq = req.seq
            pending = len(req.prompt) + len(req.output) - seq.num_cached
            if pending == 1:  # a decode (or a prompt's last token): most of a step's requests
                decoding = seq.num_cached > 0 and len(req.output) > 0  # Request.decoding, inlined
                if seq.num_cached + 1 + (self.lookahead if decoding else 0) <= len(seq.pages) * page_size:
                    # It fits the pages it holds: `fit` gives it its token and takes no page (a
                    # one-token chunk that finishes the request is never cut by the prefix cache).
                    budget -= 1
                    if decoding:
                        plan.decode.append(req)
                    else:
                        plan.prefill.append((req, 1))
                    continue
            want = min(pending, budget)
            n = self.fit(req, want)
            while n == 0 and self.running[-1] is not req:
                victim = self.running[-1]
                self.preempt(victim)
                plan.preempted.append(victim)
                n = self.fit(req, want)
            if n == 0:
                continue  # the youngest cannot grow: it waits; older requests finish or preempt it
            self.take_pages(req, n)
            budget -= n
            if req.decoding:
                plan.decode.append(req)
            else:
                plan.prefill.append((req, n))
        return budget

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        """Admit queued requests in FIFO order while a place, a slot and their first chunk's pages are free."""
        while self.waiting and budget > 0 and len(self.running) < self.max_running and self.state_pool.num_free:
            req = self.waiting[0]
            hold = None
            # A request scoring its prompt needs the logits of every prompt position, which a cached
            # prefix does not keep: it prefills the whole prompt.
            if self.prefix_cache is not None and req.params.prompt_logprobs is None:
                hold = self.prefix_cache.take(req.prompt + req.output, len(req.prompt), req.params.max_new_tokens)
            cached = 0 if hold is None else hold.tokens
            n = min(req.num_tokens - cached, budget)
            if hold is not None:
                n = self.prefix_cache.chunk(hold, cached, n, req.num_tokens)
            need = self.kv_pool.pages_for(cached + n) - self.kv_pool.pages_for(cached)
            if not self.free_pages(need):
                if hold is not None:
                    self.prefix_cache.drop(hold)
                return  # the head waits for pages; the queue waits behind it
            self.waiting.popleft()
            req.seq = SeqState(self.state_pool.alloc())  # a zero slot: no state from its last owner
            if hold is not None:
                self.prefix_cache.attach(hold, req.seq, req.num_tokens)  # shared pages, the snapshot in its slot
            req.cache = hold
            if req.cached_tokens is None:
                req.cached_tokens = min(cached, len(req.prompt))
            self.running.append(req)
            self.take_pages(req, n)
            budget -= n
            plan.prefill.append((req, n))

    # -- pages, slots -----------------------------------------------------------------------

    def _room(self, req: Request) -> int:
        """Tokens the request can add now: its pages' free tail plus every free page."""
        return (len(req.seq.pages) + self.kv_pool.num_free) * self.kv_pool.page_size - req.seq.num_cached

    def free_pages(self, need: int) -> bool:
        """Whether `need` pages are free, after the prefix cache gave back unused ones if it had to."""
        if self.prefix_cache is not None:
            self.prefix_cache.reclaim(need)
        return need <= self.kv_pool.num_free

    def _lookahead(self, req: Request) -> int:
        """Positions a step writes past the request's next tokens: D for a request that decodes
        with D drafts (its verify step writes them, then the draft's step after it)."""
        return self.lookahead if req.decoding else 0

    def fit(self, req: Request, want: int) -> int:
        """Tokens (at most `want`) the running request can feed this step: as many as its pages
        allow (with its lookahead), its chunk ending where the prefix cache wants a snapshot. A
        request forked from another's prefill holds nothing of the cache (its prompt went in with
        the other's)."""
        ahead = self._lookahead(req)
        if self.prefix_cache is None or req.cache is None:
            if self.prefix_cache is not None:
                self.free_pages(self.kv_pool.pages_for(req.num_cached + want + ahead) - len(req.seq.pages))
            return max(0, min(want, self._room(req) - ahead))
        start, total = req.num_cached, req.num_tokens
        want = self.prefix_cache.chunk(req.cache, start, want, total)
        self.free_pages(self.kv_pool.pages_for(start + want + ahead) - len(req.seq.pages))
        n = max(0, min(want, self._room(req) - ahead))
        return n if n == want else self.prefix_cache.chunk(req.cache, start, n, total)

    def take_pages(self, req: Request, n: int) -> None:
        need = self.kv_pool.pages_for(req.seq.num_cached + n + self._lookahead(req)) - len(req.seq.pages)
        if need > 0:
            req.seq.pages.extend(self.kv_pool.alloc(need))

    def release(self, req: Request) -> None:
        """Free the request's pages and slot (pages shared with the prefix cache stay there), and an
        in-step snapshot id its step did not put in the tree."""
        if self.prefix_cache is not None:
            self.prefix_cache.drop_step_snapshot(req.seq)
        self.kv_pool.free(req.seq.pages)
        self.state_pool.free(req.seq.slot)
        req.seq = None
        req.cache = None

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.drop_drafts()  # they are proposed again after its re-prefill
        req.preemptions += 1
        self.totals["preemptions"] += 1
        self.waiting.appendleft(req)  # it was admitted before anything still queued
