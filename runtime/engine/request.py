"""A request as the engine keeps it, what it hands back, and the plan of one step.

`Request` is the engine's record of one request: its prompt and output, sampling state, the
state slot and pages it holds while running (`seq`), its prefix-cache hold, its grammar matcher,
its speculative drafts, and the requests waiting to share its prefill (forks). `StepPlan` is what
the scheduler chose for one step (runtime/engine/scheduler.py). `StepOutput` and `RequestResult`
are what the engine hands back (runtime/engine/engine.py).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, NamedTuple

import torch

from runtime.cache.batch import SeqState
from runtime.cache.prefix_cache import CacheHold
from runtime.engine.logprobs import TokenLogprob
from runtime.engine.sampling import SamplingParams

__all__ = ["StepOutput", "RequestResult", "Request", "StepPlan"]


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


@dataclasses.dataclass
class Request:
    request_id: Hashable
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival_s: float
    # Its generated tokens; with the overlapped schedule the last one or two may be placeholders
    # (runtime/cache/batch.PLACEHOLDER_TOKEN: chosen on the device, not read yet), replaced in place
    # when the engine reads them (runtime/engine/engine.py).
    output: list[int] = dataclasses.field(default_factory=list)
    seq: SeqState | None = None  # None while queued (never admitted, or preempted)
    first_token_s: float | None = None
    preemptions: int = 0
    stop_reason: str | None = None  # set by the step that samples its last token
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # for tokens 1, 2, ...
    forks: list["Request"] = dataclasses.field(default_factory=list)  # waiting to share this prompt's prefill
    fork_of: "Request | None" = None  # while this request waits for that one's prefill
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
        # num_tokens - num_cached, spelled out: every step asks this of every request
        return len(self.prompt) + len(self.output) - (0 if self.seq is None else self.seq.num_cached)

    @property
    def decoding(self) -> bool:
        """One pending token, and it is the request's own last sample: a decode, not a prompt chunk."""
        return self.num_pending == 1 and len(self.output) > 0 and self.seq.num_cached > 0  # pending 1 with output: seq set

    @property
    def awaits_last_token(self) -> bool:
        """Its output is full, the last token still on the device: nothing more to feed, it finishes
        when that token is read (the scheduler gives it no step meanwhile)."""
        return 0 < self.params.max_new_tokens <= len(self.output)

    def next_tokens(self, n: int) -> list[int]:
        start, end, p = self.num_cached, self.num_cached + n, len(self.prompt)
        # Slices of each list, not of their concatenation: a step must not copy a long request's history.
        tokens = self.output[start - p:end - p] if start >= p else self.prompt[start:end] + self.output[:max(0, end - p)]
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

    def drop_drafts(self) -> None:
        """Forget the drafts; the matcher gives back the ones it took ahead."""
        if self.matcher is not None:
            self.matcher.rollback(self.grammar_ahead)
        self.grammar_ahead = 0
        self.drafts, self.draft_q = [], []

    def add_draft(self, token: int, q) -> None:
        """The bookkeeping of one chosen draft: the token, its distribution (None: argmax), the matcher ahead."""
        self.drafts.append(token)
        self.draft_q.append(q)
        if self.matcher is not None and self.matcher.accept(token):
            self.grammar_ahead += 1


@dataclasses.dataclass
class StepPlan:
    prefill: list[tuple[Request, int]]  # (request, prompt tokens fed this step)
    decode: list[Request]  # one token each
    preempted: list[Request]

    def items(self) -> list[tuple[Request, int]]:
        return self.prefill + [(req, 1) for req in self.decode]


def stop_reason(req: Request, token: int, emitted: int | None = None) -> str | None:
    """Why the request ends after emitting `token`, its `emitted`-th output token (default: the
    last of its output): a stop token, or max_new_tokens reached; None: it goes on."""
    if token in req.params.stop_token_ids:
        return "stop"
    if (len(req.output) if emitted is None else emitted) >= req.params.max_new_tokens:
        return "length"
    return None
