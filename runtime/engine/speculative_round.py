"""The speculative round: drafts for every decoding request, one verify step, the tokens each keeps.

`SpeculativeRound` is the engine's side of a SpeculativeDecoder (runtime/engine/speculative.py),
one per engine with speculative decoding:

1. after a step of prompt chunks, `after_prefill` runs the draft over the same positions
   (`draft_chunks`), which proposes each new decoding request's first draft;
2. `verify(requests)`: the drafter proposes D tokens each (chained on the device when every
   request's drafts are the draft's argmax), one target_verify step checks them, and each request
   keeps what its rule accepts plus one token of the target's (Choices.accept_drafts);
   `_verify_on_device` is the round that reads the device once (greedy, no grammar, penalty or
   bias: docs/DESIGN.md, "Speculative decoding");
3. `_finish_round`: the kept tokens are emitted (`_emit`), their states kept, and the draft runs
   over the kept positions for the requests that go on.

Its numbers (verify steps, drafted, accepted, verify seconds) go into the engine's totals.
It does not schedule (runtime/engine/scheduler.py reserves the D positions past a decoding
request's next token) and does not pick tokens itself (runtime/engine/choices.py does).
"""

from __future__ import annotations

import collections
import time

import torch

from runtime.engine.acceptance import greedy_accept
from runtime.engine.choices import Choices
from runtime.engine.logprobs import token_logprobs
from runtime.engine.request import Request, StepOutput, stop_reason
from runtime.engine.speculative import DraftChunk, SpeculativeDecoder
from runtime.step.host_copy import to_device

__all__ = ["SpeculativeRound"]


class SpeculativeRound:
    def __init__(self, spec: SpeculativeDecoder, choices: Choices, totals: collections.Counter):
        self.spec, self.choices, self.totals = spec, choices, totals

    def after_prefill(self, items: list[tuple[Request, int]], forked: list[tuple[Request, Request]],
                      hidden: torch.Tensor) -> None:
        """The draft over a prompt step's positions: each new decoding request's first draft."""
        self.spec.timed(self.spec.drafter.after_prefill, self.draft_chunks(items, forked), hidden, self.choices.choose)

    @staticmethod
    def draft_chunks(items: list[tuple[Request, int]], forked: list[tuple[Request, Request]]) -> list[DraftChunk]:
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

    def verify(self, reqs: list[Request]) -> list[StepOutput]:
        """One round for the decoding requests: drafts, a target_verify step, the tokens each keeps.

        A request's d_1 is on the host (its drafts hold it: chosen after its prefill, or after a
        round with a request that needs the host) or only on the device (the drafter's `first`).
        When every request's drafts are the draft's argmax, the drafter chains on the device; when
        no request's logits change either, the round reads the device once (`_verify_on_device`)."""
        spec, D, choices = self.spec, self.spec.draft_tokens, self.choices
        if all(choices.drafts_by_argmax(req) for req in reqs):
            drafts = spec.timed(spec.drafter.propose_on_device, reqs)
            if not any(req.params.changes_logits for req in reqs):
                return self._verify_on_device(reqs, drafts)
            tokens = drafts.tolist()  # penalties and bias: the target's rows are processed on the host
            for req in reqs:
                req.drop_drafts()
            choices.take_drafts(reqs, tokens, 0)
        else:
            on_device = [req for req in reqs if not req.drafts]  # their d_1 the argmax, left on the device
            if on_device:
                choices.take_drafts(on_device, [[t] for t in spec.drafter.first_drafts(on_device)], 0)
            spec.timed(spec.drafter.propose, reqs, choices.choose)
        bad = [req.request_id for req in reqs if len(req.drafts) != D]
        if bad:
            raise RuntimeError(f"the drafter proposed no {D} drafts for request(s) {bad[:3]}")
        starts = [req.seq.num_cached for req in reqs]
        begin = time.perf_counter()
        logits, hidden = spec.verify([(req.seq, req.next_tokens(1) + req.drafts) for req in reqs])
        kept = choices.accept_drafts(reqs, logits, D)
        return self._finish_round(reqs, starts, kept, logits, hidden, begin, choices.choose)

    def _verify_on_device(self, reqs: list[Request], drafts: torch.Tensor) -> list[StepOutput]:
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
            req.drop_drafts()  # a d_1 chosen on the host after a prefill is the same argmax
        self.choices.take_drafts(reqs, [row[:D] for row in read], 0)
        kept = [greedy_accept(req.drafts, row[D:]) for req, row in zip(reqs, read)]
        return self._finish_round(reqs, starts, kept, logits, hidden, begin, None, drafted=spec.draft_before_read)

    def _finish_round(self, reqs: list[Request], starts: list[int], kept: list[list[int]], logits: torch.Tensor,
                      hidden: torch.Tensor, begin: float, choose, drafted: bool = False) -> list[StepOutput]:
        """After a verify step: emit the kept tokens, keep their states, and run the draft over the
        kept positions for the requests that go on (choose None: their next d_1 stays on the
        device), unless it ran already (`drafted`: `after_verify_on_device`)."""
        spec, D = self.spec, self.spec.draft_tokens
        outputs = self._emit(reqs, kept, logits)
        self.totals["spec_verify_s"] += time.perf_counter() - begin
        self.totals["spec_steps"] += 1
        self.totals["spec_verified"] += len(reqs)
        self.totals["spec_drafted"] += len(reqs) * D
        self.totals["spec_accepted"] += sum(len(k) - 1 for k in kept)
        spec.keep([req.seq for req in reqs], [len(k) for k in kept])
        for req in reqs:
            req.drop_drafts()
        going = [b for b, req in enumerate(reqs) if req.stop_reason is None]
        if going and not drafted:
            rows = hidden.view(len(reqs), D + 1, -1)
            rows = (rows if len(going) == len(reqs) else rows[to_device(going, hidden.device)]).flatten(0, 1)
            spec.timed(spec.drafter.after_verify, [reqs[b] for b in going], [starts[b] for b in going],
                       [kept[b] for b in going], rows, choose)
        return outputs

    def _emit(self, reqs: list[Request], kept: list[list[int]], logits: torch.Tensor) -> list[StepOutput]:
        """Append each request's kept tokens to its output, up to a stop token or max_new_tokens,
        with their log-probabilities (the target's raw rows) and penalty counts; one StepOutput each."""
        width = self.spec.draft_tokens + 1
        emitted = []  # (request, verify row, token)
        for b, (req, tokens) in enumerate(zip(reqs, kept)):
            for j, token in enumerate(tokens):
                req.output.append(token)
                self.choices.follow_grammar(req, token)
                req.stop_reason = stop_reason(req, token)
                emitted.append((req, b * width + j, token))
                if req.stop_reason is not None:
                    break
        penalties = self.choices.penalties
        if penalties is not None:
            penalties.record(torch.tensor([req.seq.slot for req, _, _ in emitted], device=logits.device),
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
