"""Logit bias and penalties: their definitions, and the per-slot device tables that feed them.

Definitions (logits [B, V] of the requests that sample this step, in this order, as vLLM does):

1. logit_bias (OpenAI): `logits[j] += bias[j]` for each token id the request names.
2. repetition_penalty r (CTRL, transformers, vLLM): for every token j seen in the prompt or in the
   output so far, `logits[j] /= r` where it is positive and `logits[j] *= r` where it is not.
3. frequency_penalty f and presence_penalty p (OpenAI's definition, on generated tokens only):
   `logits[j] -= c[j] * f + (c[j] > 0) * p`, where c[j] counts token j in the output so far.

`apply_penalties` is that, as whole-batch tensor operations: no branch on a value, no host
synchronisation, fixed shapes for a fixed batch. So it can run right after a captured decode
graph on the graph's own logits, or be captured itself, with every per-request value read from
device tensors rather than baked into a kernel launch.

`PenaltyTables` holds those tensors, one row per state slot (a request's slot is already the
per-request index of a step):

1. Made by the engine the first time a request with a penalty or a bias samples (a server that
   never sees one never allocates them): per slot the bias row, the output counts, the
   prompt-token mask [slots + 1, V] and the three penalty values.
2. `load(slot, owner, ...)` writes a request's row when it first samples in a slot: its
   parameters (neutral ones for a request without penalties), its prompt mask and the counts of
   what it generated so far (a preempted request comes back with output). A row stays its
   owner's until another request loads into that slot, so a request that comes back to the same
   slot finds its counts intact; a request that moved reloads.
3. `apply(logits, slots)` gathers the rows of the step's requests and applies the definitions.
   A speculative verify step checks several positions of a request at once: each row passes the
   counts of the draft tokens before its position as `extra_counts`, so row j is penalised as
   if d_1 .. d_j had been generated, as it would be without drafts.
4. `record(slots, tokens)` counts the tokens just sampled (an accumulate on the device).

Memory: 9 bytes per (slot, vocabulary entry); 64 slots of a 152k vocabulary take 88 MB.

It does not draw tokens (runtime/engine/sampling.py) or compute log-probabilities (runtime/engine/logprobs.py).
"""

from __future__ import annotations

import torch

from runtime.engine.sampling import SamplingParams

__all__ = ["apply_penalties", "PenaltyTables"]


def apply_penalties(logits: torch.Tensor, bias: torch.Tensor, counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits, bias [B, V] float; counts [B, V] int; prompt_mask [B, V] bool; presence, frequency,
    repetition [B] float -> processed logits [B, V] float32 (a new tensor)."""
    logits = logits.float() + bias
    generated = counts > 0
    seen = prompt_mask | generated
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * generated


class PenaltyTables:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.bias = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
        self.counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
        self.presence = torch.zeros(num_rows, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(num_rows, dtype=torch.float32, device=device)
        self.repetition = torch.ones(num_rows, dtype=torch.float32, device=device)
        self._owners: list[object | None] = [None] * num_rows

    def load(self, slot: int, owner: object, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
        """Make `slot`'s row `owner`'s, unless it already is."""
        if self._owners[slot] is owner:
            return
        device = self.bias.device
        self.bias[slot].zero_()
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias[slot, torch.tensor(ids, device=device)] = torch.tensor(values, device=device)
        self.counts[slot] = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=self.vocab_size).to(
            device, torch.int32)
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot, torch.tensor(prompt, device=device)] = True
        self.presence[slot] = params.presence_penalty
        self.frequency[slot] = params.frequency_penalty
        self.repetition[slot] = params.repetition_penalty
        self._owners[slot] = owner

    def apply(self, logits: torch.Tensor, slots: torch.Tensor, extra_counts: torch.Tensor | None = None) -> torch.Tensor:
        """logits [B, V] of the requests in `slots` [B] (device; a slot may repeat) -> processed logits
        [B, V] float32. extra_counts [B, V] int: tokens to count as generated besides the table's."""
        counts = self.counts[slots]
        if extra_counts is not None:
            counts = counts + extra_counts
        return apply_penalties(logits, self.bias[slots], counts, self.prompt_mask[slots],
                               self.presence[slots], self.frequency[slots], self.repetition[slots])

    def record(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one sampled token per request: slots, tokens [B] int64 on the tables' device."""
        self.counts.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
