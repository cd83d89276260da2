"""Log-probabilities of tokens, computed on the device from the model's logits rows.

1. The engine hands `token_logprobs` the logits rows it needs (the sampled rows of requests that
   asked for logprobs, or the prompt rows of requests that score their prompt), the token each
   row is scored against, and the largest number of alternatives any of them asked for.
2. On the device: log_softmax in float32, the target's entry, and the top k entries. Only those
   ([N] and [N, k] values and ids) cross to the host, in one transfer; the [N, V] matrix never does.
3. Each row becomes a `TokenLogprob`: the token, its log-probability, and its alternatives (most
   likely first), cut to what its own request asked for.

What the numbers are: the model's distribution, log_softmax of the raw logits, before temperature,
penalties and logit_bias (vLLM's default, "raw_logprobs"). So a prompt token's log-probability is
what a plain forward pass gives, which is what an evaluation harness compares, and a sampled
token's is the model's belief in it whatever the request did to the draw.

It does not format them for the API (runtime/server/logprobs.py does).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TokenLogprob", "token_logprobs"]


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), most likely first


def token_logprobs(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logits [N, V] (any float dtype, any device); targets and ks: N token ids and alternative counts."""
    assert logits.dim() == 2 and logits.shape[0] == len(targets) == len(ks), (tuple(logits.shape), len(targets))
    if not targets:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    index = torch.tensor(targets, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, index[:, None])  # [N, 1]
    k = min(max(ks), logprobs.shape[1])
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)  # [N, k], sorted
        packed = torch.cat([chosen, top_values, top_ids.to(logprobs.dtype)], dim=1).cpu()  # ids < 2^24: exact
    else:
        packed = chosen.cpu()
    rows = packed.tolist()
    out = []
    for target, want, row in zip(targets, ks, rows):
        want = min(want, k)
        values, ids = row[1:1 + k], row[1 + k:]
        out.append(TokenLogprob(target, row[0], tuple((int(ids[i]), values[i]) for i in range(want))))
    return out
