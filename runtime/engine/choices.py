"""Sampling choices: every token the engine picks, from the logits rows a step left on the device.

`Choices` holds what choosing needs across steps, the penalty tables (made when a request with a
penalty or bias first samples, runtime/engine/penalties.py), and makes each kind of choice:

- `draw`: a request's next token, argmax or its own draw, after its bias, penalties and grammar;
- `argmax_on_device`: the next tokens of requests that `choose_on_device` (greedy, nothing
  changing their logits, no log-probabilities), left on the device for the engine's next step
  and copied to the host behind it (the overlapped schedule, runtime/engine/engine.py);
- `score_prompts`: the log-probabilities of the prompt tokens a step's rows predict (echo);
- `choose` / `take_drafts`: a speculative request's draft tokens (its grammar, then argmax or a
  draw kept as q for rejection sampling), or the drafter's argmax taken as they are;
- `accept_drafts`: what a request keeps of a verify step (runtime/engine/acceptance.py), after
  penalties, bias and grammar at every verified position;
- `constrain` / `follow_grammar`: the grammar's bitmask on every choice, its matcher following the
  output (runtime/engine/grammar.py).

Only what a choice reads crosses to the host: the chosen ids of greedy requests (at 128 requests
and a 152k vocabulary the whole matrix would be 78 MB a step), the float32 rows of requests that
draw, and the log-probabilities asked for (runtime/engine/logprobs.py).

It does not schedule or run steps (the engine does).
"""

from __future__ import annotations

import torch

from runtime.engine.acceptance import dense_distribution, draft_counts, draw, greedy_accept, rejection_accept
from runtime.engine.logprobs import token_logprobs
from runtime.engine.penalties import PenaltyTables
from runtime.engine.request import Request
from runtime.engine.sampling import filtered_distribution, sample_next
from runtime.step.host_copy import HostCopy, to_device

__all__ = ["Choices"]


class Choices:
    """num_slots: the state pool's slots (the penalty tables hold a row per slot, and the padding slot's)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.penalties: PenaltyTables | None = None

    def _penalty_tables(self, reqs: list[Request], vocab: int, device) -> PenaltyTables | None:
        """The penalty tables, made when a request that changes its logits first needs them."""
        if self.penalties is None and any(req.params.changes_logits for req in reqs):
            self.penalties = PenaltyTables(self.num_slots + 1, vocab, device)
        return self.penalties

    def score_prompts(self, items: list[tuple[Request, int]], rows: list[int], last_rows: list[int],
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

    @staticmethod
    def choose_on_device(req: Request) -> bool:
        """Whether the request's next token is the argmax of its raw logits row, with nothing read
        on the host to choose it or to record after: greedy, no grammar, no penalties or bias, no
        log-probabilities, of its output or of its prompt, and a token to choose at all."""
        params = req.params
        return (params.greedy and req.matcher is None and not params.changes_logits and params.logprobs is None
                and params.prompt_logprobs is None and params.max_new_tokens > 0)

    @staticmethod
    def argmax_on_device(logits: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, HostCopy]:
        """The argmax of logits rows `rows` (requests that `choose_on_device`): (the ids [B] on the
        device, their copy to the host, queued behind them). The ids are a tensor of their own, so
        the next step may overwrite the logits (a full graph's static outputs)."""
        if rows == list(range(logits.shape[0])):
            ids = logits.argmax(-1)
        else:
            ids = logits.index_select(0, to_device(rows, logits.device)).argmax(-1)
        return ids, HostCopy(ids)

    def draw(self, batch: list[tuple[Request, int]], logits: torch.Tensor) -> list[int]:
        """The next token of each (request, logits row): argmax or the request's own draw, from
        the logits after its bias and penalties; records the log-probabilities asked for."""
        if not batch:
            return []
        reqs = [req for req, _ in batch]
        raw = logits[to_device([row for _, row in batch], logits.device)]  # [B, V]
        penalties = self._penalty_tables(reqs, raw.shape[1], raw.device)
        processed, slots = raw, None
        if penalties is not None:
            # Once the tables exist every request has a row (neutral without penalties): one batched op.
            for req in reqs:
                penalties.load(req.seq.slot, req, req.params, req.prompt, req.output)
            slots = to_device([req.seq.slot for req in reqs], raw.device)
            processed = penalties.apply(raw, slots)
        processed = self.constrain(reqs, raw, processed)
        drawn = [b for b, req in enumerate(reqs) if not req.params.greedy]
        greedy_ids = processed.argmax(-1).tolist() if len(drawn) < len(reqs) else None
        rows = dict(zip(drawn, processed[drawn].float().cpu())) if drawn else {}
        tokens = [sample_next(rows[b], req.params, req.generator) if b in rows else greedy_ids[b]
                  for b, req in enumerate(reqs)]
        if penalties is not None:
            penalties.record(slots, torch.tensor(tokens, device=raw.device))
        for req, token in zip(reqs, tokens):
            self.follow_grammar(req, token)
        scored = [b for b, req in enumerate(reqs) if req.params.logprobs is not None]
        if scored:
            entries = token_logprobs(raw[scored], [tokens[b] for b in scored], [reqs[b].params.logprobs for b in scored])
            for b, entry in zip(scored, entries):
                reqs[b].logprobs.append(entry)
        return tokens

    # -- structured output ------------------------------------------------------------------

    @staticmethod
    def constrain(reqs: list[Request], raw: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
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
    def follow_grammar(req: Request, token: int) -> None:
        """A token the request emits advances its matcher; one its grammar refuses is a bug, not a state."""
        if req.matcher is not None and not req.matcher.terminated and not req.matcher.accept(token):
            raise RuntimeError(f"request {req.request_id!r}: token {token} was chosen against its grammar "
                               f"({req.params.grammar})")

    # -- drafts -----------------------------------------------------------------------------

    def choose(self, reqs: list[Request], logits: torch.Tensor, position: int) -> None:
        """The draft token at `position` (0 .. D-1) of each request from the draft's logits [B, V]:
        its grammar applied, then argmax or a draw from the request's filtered distribution (kept
        as q for rejection sampling). Position 0 starts a new set of drafts."""
        for req in reqs:
            if position == 0:
                req.drop_drafts()
            assert len(req.drafts) == position, f"request {req.request_id!r}: draft {position} after {req.drafts}"
        processed = self.constrain(reqs, logits, logits)
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
            req.add_draft(token, q)

    @staticmethod
    def drafts_by_argmax(req: Request) -> bool:
        """Whether `choose` takes the request's drafts as the draft logits' argmax, unchanged: it is
        greedy (no draw) and has no grammar (whose bitmask is the one change `choose` makes to
        draft logits; penalties and bias apply to the target's rows only, in `accept_drafts`).
        When it holds for every request of a round, the drafter chooses on the device
        (`propose_on_device`) and the tokens come back in one read (`take_drafts`)."""
        return req.params.greedy and req.matcher is None

    def take_drafts(self, reqs: list[Request], tokens: list[list[int]], position: int) -> None:
        """Drafts the drafter chose as the draft logits' argmax (`drafts_by_argmax` holds for
        every request): tokens[b] appended to request b's drafts from `position` on, as `choose`
        appends them."""
        assert all(self.drafts_by_argmax(req) for req in reqs)
        for req, chosen in zip(reqs, tokens):
            assert len(req.drafts) == position, f"request {req.request_id!r}: draft {position} after {req.drafts}"
            for token in chosen:
                req.add_draft(token, None)

    def accept_drafts(self, reqs: list[Request], logits: torch.Tensor, draft_tokens: int) -> list[list[int]]:
        """logits [B * (D + 1), V] of a verify step -> the tokens each request keeps: the target's
        rows after penalties (row j counting d_1 .. d_j as generated), bias and grammar (row j
        masked after d_1 .. d_j, a draft the grammar refuses ending the walk), then the greedy or
        the rejection-sampling rule."""
        B, width, V = len(reqs), draft_tokens + 1, logits.shape[1]
        processed = logits
        penalties = self._penalty_tables(reqs, V, logits.device)
        if penalties is not None:
            for req in reqs:
                penalties.load(req.seq.slot, req, req.params, req.prompt, req.output)
            slots = torch.tensor([req.seq.slot for req in reqs], device=logits.device).repeat_interleave(width)
            processed = penalties.apply(logits, slots, draft_counts([req.drafts for req in reqs], V, logits.device))
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
