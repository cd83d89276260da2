"""Which draft tokens a target_verify step keeps: greedy prefix matching and rejection sampling.

A request verified with drafts d_1 .. d_D has D + 1 rows of the target's distribution: row j
predicts the token after d_1 .. d_j (row 0: the token after the request's last one). It keeps
the drafts the rule accepts, in order, then one token of the target's own, so every verify step
gives 1 to D + 1 tokens.

1. Greedy (`greedy_accept`): keep the longest prefix of drafts equal to the target's argmax at
   their rows, then the target's argmax at the first row that differs (or at row D). The tokens
   are exactly those of greedy decoding without drafts.
2. Sampling (`rejection_accept`), the rule of Leviathan et al. (2023) and Chen et al. (2023):
   draft d_j, drawn from the draft's distribution q_j, is kept with probability
   min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token is drawn from the normalised
   residual max(0, p_j - q_j) and the step ends; if every draft is kept, one more token is drawn
   from p_D. Each output token is then distributed as p, the target's distribution after the
   request's temperature, top-k / top-p, penalties, bias and grammar, exactly as without drafts.
   A draft proposed without a distribution (q_j = None: a deterministic proposer) counts as q_j
   one-hot on d_j: kept with probability p_j(d_j), else the residual is p_j without d_j.

Every draw takes one uniform number from the request's own generator, so a seeded request is
reproducible (its tokens differ from those of the same seed without drafts, their distribution
does not).

It does not compute distributions (runtime/engine/sampling.py `filtered_distribution` does) or run
anything on the device.
"""

from __future__ import annotations

import torch

__all__ = ["greedy_accept", "rejection_accept", "dense_distribution", "draw", "draft_counts"]


def greedy_accept(drafts: list[int], target: list[int]) -> list[int]:
    """drafts d_1 .. d_D and the target's argmax at rows 0 .. D -> the tokens kept (1 .. D + 1)."""
    assert len(target) == len(drafts) + 1, (len(drafts), len(target))
    kept = []
    for j, d in enumerate(drafts):
        if d != target[j]:
            break
        kept.append(d)
    return kept + [target[len(kept)]]


def dense_distribution(ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """filtered_distribution's (ids [K], probs [K]) as a float64 vector [V] (zeros elsewhere)."""
    dense = torch.zeros(vocab_size, dtype=torch.float64)
    dense[ids] = probs.double()
    return dense


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from an unnormalised float64 distribution [V], by inverse CDF with one uniform."""
    cdf = torch.cumsum(probs, 0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), probs.shape[0] - 1)


def rejection_accept(drafts: list[int], q: list[torch.Tensor | None], p: list[torch.Tensor],
                     generator: torch.Generator) -> list[int]:
    """drafts d_1 .. d_D, the draft's distributions q_1 .. q_D ([V] float64 each, or None: one-hot on
    the draft), the target's p_0 .. p_D ([V] float64, each summing to 1) -> the tokens kept."""
    assert len(p) == len(drafts) + 1 and len(q) == len(drafts), (len(drafts), len(q), len(p))
    kept = []
    for j, d in enumerate(drafts):
        target = p[j]
        proposed = q[j]
        q_d = 1.0 if proposed is None else float(proposed[d])
        p_d = float(target[d])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if q_d > 0 and u * q_d < p_d:  # accept with probability min(1, p/q)
            kept.append(d)
            continue
        if proposed is None:
            residual = target.clone()
            residual[d] = 0.0
        else:
            residual = (target - proposed).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere means p == q: a rejection cannot happen
            residual = target  # (reached only through rounding): draw from p itself
        return kept + [draw(residual, generator)]
    return kept + [draw(p[len(drafts)], generator)]


def draft_counts(drafts: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """[B * (D + 1), V] int32: row j of request b counts d_1 .. d_j of its drafts (row 0: none), the
    tokens a penalty at that verified position treats as generated besides the request's output."""
    B, D = len(drafts), len(drafts[0]) if drafts else 0
    counts = torch.zeros(B, D + 1, vocab_size, dtype=torch.int32, device=device)
    if D:
        ids = torch.tensor(drafts, dtype=torch.int64, device=device)  # [B, D]
        counts[:, 1:].scatter_(2, ids[:, :, None], 1)  # row j + 1 marks d_{j+1}
        counts = counts.cumsum(1, dtype=torch.int32)
    return counts.view(B * (D + 1), vocab_size)
