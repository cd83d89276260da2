"""Capture keys and buckets: which captured graphs exist, and which one a step goes to.

1. `CaptureKey(mode, tokens, seqs, rows)` names one captured shape: a decode bucket (one row per
   request), a target_verify bucket (speculative decoding: `verify_tokens` rows per request, and
   `rows` logits rows) or an extend bucket (its token rows and its request rows, `extend_rows`:
   min(extend_max_seqs, tokens), since every request brings at least one token; mixed steps use
   the extend graphs). A bucket of at most SOLO_EXTEND_TOKENS tokens has a second, one-request key
   beside that one (`extend_seq_rows`): a fresh prompt or a prefix hit's suffix replays it.
2. `Buckets(decode, extend, extend_max_seqs, verify, verify_tokens, verify_logits_rows)`:
   `capture_keys()` in capture order (largest first, so smaller graphs reuse the pool's memory),
   `key_for(mode, tokens, seqs)` the smallest key that holds a step (fewest tokens, then fewest
   request rows) or None (an eager step), and the largest step the static buffers must hold.
3. `buckets_for`: the artifact's recorded buckets clipped to the steps an engine can send;
   `extend_seqs`: how many requests the largest extend graphs hold.
4. `one_captured_piece`, `whole_step_modes`, `whole_step` and `piecewise_plan_mode`: what the
   program's split plans (split.json) say about a mode's graphs, or one key's: whole-step (its plan
   is one captured piece; for extend keys, the extend and the mixed plan both, since mixed steps
   replay them, or both plans' gaps are captured at the key's tokens: `SplitPlan.whole_up_to`), or
   pieces with eager gaps, and whose plan's pieces those are.

The artifact's default buckets are the format's (compiler/splitops/artifact.py). This module
captures nothing (runtime/graphs/cuda_graphs.py) and pads nothing (runtime/graphs/staging.py).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from compiler.splitops import Mode
from compiler.splitops.artifact import CAPTURED

__all__ = ["SOLO_EXTEND_TOKENS", "CaptureKey", "Buckets", "buckets_for", "extend_seqs", "one_captured_piece", "whole_step_modes",
           "whole_step", "piecewise_plan_mode"]


# Extend buckets of at most this many tokens are also captured for one request. The kernels of a
# step size their grids by its key's request rows (the chunk kernels' and the short convolution's
# programs run per request row), so a one-request step replayed in a bucket that holds one row per
# token pays for every empty row: measured on an H200 (bench qwen3_next, a 32-token prompt in a key
# of 32 request rows against one of 1), about 19 us a layer, 0.17 ms of a 1.5 ms step. One prompt
# on an idle engine and a prefix hit's suffix are such steps, and short prompts run to 128 tokens;
# above that the empty rows are a small share of the step and a key would only cost capture time.
SOLO_EXTEND_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class CaptureKey:
    mode: Mode  # DECODE, TARGET_VERIFY or EXTEND (full or piecewise; an EXTEND key also serves MIXED steps)
    tokens: int  # rows of the step, padding included
    seqs: int  # requests of the step, padding included
    rows: int = 0  # logits rows, padding included (0: one per request)

    @property
    def logits_rows(self) -> int:
        return self.rows or self.seqs

    def __str__(self) -> str:
        rows = f", rows={self.rows}" if self.rows else ""
        return f"{self.mode.value}[tokens={self.tokens}, seqs={self.seqs}{rows}]"


@dataclasses.dataclass(frozen=True)
class Buckets:
    decode: tuple[int, ...]  # padded request counts of the decode graphs
    extend: tuple[int, ...]  # padded token counts of the extend graphs
    extend_max_seqs: int  # request rows of the extend graphs that hold that many tokens (extend_rows)
    verify: tuple[int, ...] = ()  # padded request counts of the target_verify graphs
    verify_tokens: int = 0  # tokens per request of a target_verify step (D + 1; 0: none)
    verify_logits_rows: int = 0  # logits rows per request of such a step (0: every token)

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode", tuple(sorted(self.decode)))
        object.__setattr__(self, "extend", tuple(sorted(self.extend)))
        object.__setattr__(self, "verify", tuple(sorted(self.verify)) if self.verify_tokens else ())
        object.__setattr__(self, "verify_logits_rows", self.verify_logits_rows or self.verify_tokens)

    @property
    def max_tokens(self) -> int:
        return max(self.decode[-1] if self.decode else 1, self.extend[-1] if self.extend else 1,
                   self.verify[-1] * self.verify_tokens if self.verify else 1)

    @property
    def max_seqs(self) -> int:
        return max(self.decode[-1] if self.decode else 1, self.extend_max_seqs, self.verify[-1] if self.verify else 1)

    def extend_rows(self, tokens: int) -> int:
        """Request rows of the extend bucket of `tokens` tokens: extend_max_seqs, but never more than
        its tokens (each request brings one at least), so a 16-token bucket does not cap the
        requests of the larger ones and holds no rows no step can fill."""
        return max(1, min(self.extend_max_seqs, tokens))

    def extend_seq_rows(self, tokens: int) -> tuple[int, ...]:
        """Request rows of the extend keys of the bucket of `tokens` tokens, fewest first: its full
        rows (`extend_rows`), and one row beside them for a bucket of at most SOLO_EXTEND_TOKENS."""
        full = self.extend_rows(tokens)
        return (1, full) if full > 1 and tokens <= SOLO_EXTEND_TOKENS else (full,)

    def verify_key(self, bucket: int) -> CaptureKey:
        return CaptureKey(Mode.TARGET_VERIFY, bucket * self.verify_tokens, bucket, bucket * self.verify_logits_rows)

    def key_for(self, mode: Mode, num_tokens: int, num_seqs: int) -> Optional[CaptureKey]:
        """The smallest key that holds this step, or None (eager)."""
        if mode == Mode.DECODE:
            bucket = next((b for b in self.decode if b >= num_seqs), None)
            return CaptureKey(Mode.DECODE, bucket, bucket) if bucket else None
        if mode == Mode.TARGET_VERIFY:
            bucket = next((b for b in self.verify if b >= num_seqs), None)
            if bucket is None or num_tokens != num_seqs * self.verify_tokens:
                return None
            return self.verify_key(bucket)
        for bucket in self.extend:
            rows = next((r for r in self.extend_seq_rows(bucket) if r >= num_seqs), None)
            if bucket >= num_tokens and rows:
                return CaptureKey(Mode.EXTEND, bucket, rows)
        return None

    def capture_keys(self) -> list[CaptureKey]:
        """Every key, in capture order (largest first)."""
        keys = [CaptureKey(Mode.DECODE, b, b) for b in reversed(self.decode)]
        keys += [self.verify_key(b) for b in reversed(self.verify)]
        keys += [CaptureKey(Mode.EXTEND, t, rows) for t in reversed(self.extend) for rows in reversed(self.extend_seq_rows(t))]
        return keys


def buckets_for(decode_sizes, extend_sizes, *, max_running: int, token_budget: int,
                max_seq_len: Optional[int] = None) -> tuple[tuple, tuple]:
    """The artifact's buckets, clipped to the steps an engine can send.

    A decode step has at most max_running requests and an extend step at most token_budget
    tokens (and at most max_running x max_seq_len): keep every bucket up to the first one that
    holds that many; larger ones would only cost capture time and memory.
    """
    if max_seq_len is not None:
        token_budget = min(token_budget, max_running * max_seq_len)
    def clip(sizes, limit):
        sizes = sorted(set(int(s) for s in sizes))
        cover = next((s for s in sizes if s >= limit), None)
        return tuple(s for s in sizes if s < limit) + ((cover,) if cover else ())
    return clip(decode_sizes, max_running), clip(extend_sizes, token_budget)


def extend_seqs(largest_decode: int, extend_buckets) -> int:
    """Requests the largest extend graphs hold (`Buckets.extend_max_seqs`): as many as the largest
    recorded decode bucket (under load most prefill chunks ride in mixed steps beside every running
    decode, and a graph that holds fewer leaves those steps eager), and no more than the largest
    extend bucket's tokens (one token each); each smaller bucket holds min(this, its tokens)
    (`Buckets.extend_rows`). Taken from the artifact's recorded buckets, not an engine's limits, so
    `hgc build` and every run capture the same shapes and find the same kernels."""
    return max(1, min(largest_decode, max(extend_buckets, default=largest_decode)))


def one_captured_piece(plan) -> bool:
    """Whether a split plan (split.json) is one captured piece: its mode's steps may be one whole-step graph."""
    return len(plan.pieces) == 1 and plan.pieces[0].kind == CAPTURED


def whole_step_modes(plans) -> frozenset[Mode]:
    """The capture-key modes whose steps are one whole-step graph at every size, from a program's
    split plans (by mode): decode and target_verify where their plan is one captured piece; extend
    where the extend plan and the mixed plan both are, since a mixed step replays an extend key's
    graph. Extend keys may also be whole up to some tokens only (`whole_step`)."""
    whole = {m for m in (Mode.DECODE, Mode.TARGET_VERIFY) if m in plans and one_captured_piece(plans[m])}
    if all(m in plans and one_captured_piece(plans[m]) for m in (Mode.EXTEND, Mode.MIXED)):
        whole.add(Mode.EXTEND)
    return frozenset(whole)


def whole_step(plans, key: CaptureKey) -> bool:
    """Whether a key's steps are one whole-step graph, from the program's split plans (by mode): a
    decode or target_verify key where its mode's plan is one captured piece; an extend key where the
    extend plan and the mixed plan (mixed steps replay it) both allow one at the key's tokens
    (`SplitPlan.whole_at`: no gap, or gaps whose every op its backend captures in steps that large;
    each bucket above pieces, its gaps eager)."""
    if key.mode == Mode.EXTEND:
        return all(m in plans and plans[m].whole_at(key.tokens) for m in (Mode.EXTEND, Mode.MIXED))
    return key.mode in plans and one_captured_piece(plans[key.mode])


def piecewise_plan_mode(plans, mode: Mode) -> Mode:
    """The mode whose split plan (of `plans`, by mode) a piecewise step of `mode` runs: its own, but
    a decode plan that is one captured piece has no gaps, so piecewise decode (asked for) runs the
    extend plan's pieces and gaps. Extend and mixed steps run the extend plan."""
    if mode == Mode.DECODE and one_captured_piece(plans[Mode.DECODE]):
        return Mode.EXTEND
    return mode if mode in (Mode.DECODE, Mode.TARGET_VERIFY) else Mode.EXTEND
