"""Test-only drafters for speculative decoding: one that always agrees with the target, one that never does.

A random-weight MTP layer almost never proposes what the random target then picks, so the
engine's acceptance path (several positions kept per step, states of the last kept position
handed back, KV of rejected positions never read) would go untested with the real draft alone.

`GreedyContinuationDrafter` proposes the target's own greedy continuation: each request's
reference output (from a run without speculation) from where the request stands. Every draft is
then the target's argmax, the verify step keeps all D of them, and a request advances D + 1
positions per step, with exactly the reference tokens if acceptance is right.
`DisagreeingDrafter` proposes the reference token plus one (mod V) at every position: nothing is
ever kept, one token per step, the same tokens.

Both propose without a distribution (q = None: deterministic), follow the drafter interface of
runtime/engine/speculative.py (`after_prefill`, `propose`, `propose_on_device`, `first_drafts`,
`after_verify`, `after_verify_on_device`) and need no program.

`ForcedDrafts` runs a real drafter (the MTP program: its steps, its cost) and then replaces each
token it chose with the reference's: full acceptance at the real draft's cost, what
benchmarks/serving/spec_bench.py times against plain decoding. (A chain kept on the device, greedy
requests, feeds each step the draft's own argmax, not the forced token: the cost is the same.)
"""

from __future__ import annotations

import torch

from runtime.step.host_copy import to_device


class GreedyContinuationDrafter:
    def __init__(self, references: dict[tuple[int, ...], list[int]], draft_tokens: int, vocab_size: int,
                 shift: int = 0, device: "str | torch.device" = "cpu"):
        """references: prompt -> its greedy output without speculation; shift: added (mod V) to each
        proposed token (0: agree); device: where `propose_on_device` leaves the drafts (the
        engine's: a round that reads the device once takes them from there, as the MTP drafter's)."""
        self.references, self.draft_tokens, self.vocab_size, self.shift = references, draft_tokens, vocab_size, shift
        self.device = torch.device(device)
        self.proposed = 0

    def after_prefill(self, chunks, main_hidden, choose) -> None:
        """Nothing to run: the proposals come from the references."""

    def after_verify(self, requests, starts, kept, verify_hidden, choose=None) -> None:
        """Nothing to run: the proposals come from the references."""

    def after_verify_on_device(self, requests, starts, drafts, target, verify_hidden) -> None:
        """Nothing to run: the proposals come from the references."""

    def _ahead(self, req) -> list[int]:
        reference = self.references[tuple(req.prompt)]
        ahead = reference[len(req.output):len(req.output) + self.draft_tokens]
        ahead += [0] * (self.draft_tokens - len(ahead))  # past the reference's end: anything
        return [(t + self.shift) % self.vocab_size for t in ahead]

    def propose(self, requests, choose) -> None:
        for req in requests:
            req.drafts, req.draft_q = self._ahead(req), []
            self.proposed += self.draft_tokens

    def propose_on_device(self, requests) -> torch.Tensor:
        self.proposed += self.draft_tokens * len(requests)
        return to_device([self._ahead(req) for req in requests], self.device)

    def first_drafts(self, requests) -> list[int]:
        return [self._ahead(req)[0] for req in requests]


def DisagreeingDrafter(references, draft_tokens: int, vocab_size: int,
                       device: "str | torch.device" = "cpu") -> GreedyContinuationDrafter:
    """Proposes the reference token plus one at every position: never the target's argmax."""
    return GreedyContinuationDrafter(references, draft_tokens, vocab_size, shift=1, device=device)


class ForcedDrafts:
    def __init__(self, drafter, references: dict[tuple[int, ...], list[int]]):
        self.drafter, self.references = drafter, references

    def _force(self, requests, positions) -> None:
        for req in requests:
            reference = self.references[tuple(req.prompt)]
            for position in positions:
                at = len(req.output) + position  # the drafts follow the output
                if at < len(reference):
                    req.drafts[position] = reference[at]

    def _forced(self, choose):
        def forced(requests, logits, position):
            choose(requests, logits, position)
            self._force(requests, [position])
        return forced

    def _reference_ahead(self, requests, width: int) -> list[list[int]]:
        """Each request's next `width` reference tokens from where it stands (-1 past the reference)."""
        rows = []
        for req in requests:
            reference, at = self.references[tuple(req.prompt)], len(req.output)
            rows.append([reference[at + j] if at + j < len(reference) else -1 for j in range(width)])
        return rows

    def after_prefill(self, chunks, main_hidden, choose) -> None:
        self.drafter.after_prefill(chunks, main_hidden, self._forced(choose))

    def propose(self, requests, choose) -> None:
        self.drafter.propose(requests, self._forced(choose))

    def propose_on_device(self, requests) -> torch.Tensor:
        """The drafter's chain ran on its own argmax; the drafts it hands over are replaced on the device."""
        own = self.drafter.propose_on_device(requests)
        forced = to_device(self._reference_ahead(requests, own.shape[1]), own.device)
        return torch.where(forced >= 0, forced, own)

    def first_drafts(self, requests) -> list[int]:
        own = self.drafter.first_drafts(requests)
        return [f if f >= 0 else o for o, (f,) in zip(own, self._reference_ahead(requests, 1))]

    def after_verify(self, requests, starts, kept, verify_hidden, choose=None) -> None:
        self.drafter.after_verify(requests, starts, kept, verify_hidden,
                                  self._forced(choose) if choose is not None else None)

    def after_verify_on_device(self, requests, starts, drafts, target, verify_hidden) -> None:
        self.drafter.after_verify_on_device(requests, starts, drafts, target, verify_hidden)
