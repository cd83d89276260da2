"""The engine's numbers: step records, per-phase times, speculative decoding's counts.

`Statistics` holds the counters (`totals`, which the scheduler and the speculative round add to)
and the most recent steps. A step that carries prompt tokens (a prefill chunk, alone or mixed with
decodes) counts as prefill time; a step of decodes only counts as decode time. A step's time ends
when its chosen ids are on the host, so device work is included. With the overlapped schedule
(runtime/engine/engine.py) a step is laid out while the one before still runs, and the two share
that time: a step's seconds run from the later of its own start and the moment the step before
had its ids read, to the moment its own ids are read. So the steps' times add up to the engine's
busy time, and a decode step's time is the time between two tokens of a request, as without
overlap. `overlapped_steps` / `synchronous_steps` count the steps whose ids stayed on the device
until the next step was launched, and those read at once (the engine's docstring says when).

It does not time anything itself: the engine hands each step's seconds to `record`.
"""

from __future__ import annotations

import collections
import dataclasses

from compiler.splitops import Mode
from runtime.engine.request import StepPlan
from runtime.engine.speculative import SpeculativeDecoder

__all__ = ["StepRecord", "Statistics"]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    mode: Mode
    num_seqs: int
    prefill_tokens: int  # prompt (or re-prefill) tokens fed this step
    decode_tokens: int  # single-token decodes fed this step
    sampled: int  # tokens produced this step
    seconds: float


class Statistics:
    """recent_steps: how many StepRecords are kept. spec: the engine's speculative decoder, or None."""

    def __init__(self, recent_steps: int, spec: SpeculativeDecoder | None):
        self.spec = spec
        self.recent: collections.deque[StepRecord] = collections.deque(maxlen=recent_steps)
        self.totals = collections.Counter()  # counts and seconds, see timing() / Engine.stats()

    def record(self, plan: StepPlan, mode: Mode, sampled: int, seconds: float, overlapped: bool = False) -> None:
        prefill_tokens = sum(n for _, n in plan.prefill)
        record = StepRecord(mode, len(plan.prefill) + len(plan.decode), prefill_tokens, len(plan.decode),
                            sampled, seconds)
        self.recent.append(record)
        phase = "prefill" if plan.prefill else "decode"
        self.totals["steps"] += 1
        self.totals["overlapped_steps" if overlapped else "synchronous_steps"] += 1
        self.totals[f"{phase}_steps"] += 1
        self.totals[f"{phase}_s"] += seconds
        self.totals["prefill_tokens"] += prefill_tokens
        self.totals[f"{phase}_sampled"] += sampled
        self.totals["tokens_generated"] += sampled

    def timing(self) -> dict:
        """Per-phase times, for `hgc run --json`.

        prefill_s: seconds of steps carrying prompt tokens. decode_s_per_token: seconds per
        decode step, i.e. the time between two tokens of one request (gpt-fast's figure at
        batch 1). decode_tokens_per_s: tokens produced by decode steps per decode second.
        overlapped_steps / synchronous_steps: steps whose ids were read after the next step was
        launched, and steps whose ids were read at once (how often the overlapped schedule applied).
        """
        t = self.totals
        decode_steps, decode_s = t["decode_steps"], t["decode_s"]
        return {
            "prefill_s": t["prefill_s"],
            "prefill_steps": t["prefill_steps"],
            "prefill_tokens": t["prefill_tokens"],
            "decode_s": decode_s,
            "decode_steps": decode_steps,
            "decode_s_per_token": decode_s / decode_steps if decode_steps else None,
            "decode_tokens_per_s": t["decode_sampled"] / decode_s if decode_s > 0 else None,
            "overlapped_steps": t["overlapped_steps"],
            "synchronous_steps": t["synchronous_steps"],
            **({"speculative": self.speculation()} if self.spec is not None else {}),
        }

    def speculation(self) -> dict:
        """Speculative decoding's numbers, for `hgc run --json` and /metrics.

        acceptance_rate: drafts kept / drafts proposed. tokens_per_verify: tokens a request gains
        from one verify step (kept drafts + the target's token; 1 to D + 1, before a stop cuts it).
        draft_s: seconds in the drafter; verify_s: seconds in verify steps and choosing what is kept."""
        t = self.totals
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

    def counts(self) -> dict:
        """The engine-wide counts and times of Engine.stats: steps, tokens, requests, preemptions,
        shared prefills, the last step's seconds and the recent steps, the per-phase times."""
        t = self.totals
        last = self.recent[-1] if self.recent else None
        return {
            "tokens_generated": t["tokens_generated"],
            "requests_finished": t["requests_finished"],
            "preemptions": t["preemptions"],
            # requests that shared another's prefill (forked), and those that found no room to
            "prefills_shared": t["prefills_shared"],
            "prefills_recomputed": t["prefills_recomputed"],
            "steps": t["steps"],
            "last_step_s": last.seconds if last else None,
            "recent_steps": [dataclasses.asdict(r) for r in self.recent],  # JSON-ready for a server
            **self.timing(),
        }
