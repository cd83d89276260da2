"""What one rank of a compile needs in memory, before any weight is read: `hgc lint` and
`hgc compile --plan-only` print it, and with `--memory-gb G` (one GPU's memory) they run the
runtime's memory planner on it, so a release that does not fit says by how much per rank before
anything is launched.

1. `memory_facts(traced, registry, tp)`: the weight bytes of one rank (its programs' parameters,
   each rank's part of a cut tensor, a replicated one whole) and of the whole model, the KV bytes
   one token costs and the state bytes one slot costs on a rank (its registry).
2. With a budget, `plan_memory` (runtime/cache/memory_planner.py) of one request of `max_model_len`
   tokens on one slot: its table when it fits, its error (the bytes missing per rank) when not.

It does not measure activations or graph pools (the planner's `reserved_bytes` stays 0), nor
decide anything: the runtime plans again at start-up with its own flags.
"""

from __future__ import annotations

import math

import torch

__all__ = ["memory_facts", "memory_lines"]

GiB = 1 << 30


def _weight_bytes(traced) -> tuple[int, int]:
    """(one rank's bytes, the whole model's bytes) over every checkpoint tensor the programs read."""
    rank, whole = {}, {}
    for source in traced.tensors.values():
        size = getattr(torch, source.dtype).itemsize
        for view in source.views:
            fact = traced.shard_facts.get(view.name)
            rank[view.name] = math.prod(view.shape) * size
            whole[view.name] = math.prod(fact.whole if fact is not None else view.shape) * size
    return sum(rank.values()), sum(whole.values())


def memory_facts(traced, registry, tp: int, memory_gb: float | None = None, max_model_len: int = 4096) -> dict:
    """Steps 1-2 of the module docstring, as one JSON-able dict."""
    from runtime.cache.memory_planner import CacheLayout, MemoryPlanError, plan_memory

    per_rank, whole = _weight_bytes(traced)
    layout = CacheLayout.from_registry(registry)
    facts = {"tp": tp, "weight_bytes": whole, "weight_bytes_per_rank": per_rank,
             "kv_bytes_per_token_per_rank": layout.kv_bytes_per_token,
             "state_bytes_per_slot_per_rank": layout.state_bytes_per_slot,
             "budget_bytes": None, "plan": None, "fits": None, "error": None}
    if memory_gb is not None:
        facts["budget_bytes"] = budget = int(memory_gb * GiB)
        try:
            plan = plan_memory(registry, budget_bytes=budget, weight_bytes=per_rank, max_seq_len=max_model_len,
                               num_slots=1, ranks=tp)
            facts.update(plan=plan.to_json(), fits=True, table=plan.table())
        except MemoryPlanError as e:
            facts.update(fits=False, error=str(e), missing_bytes=e.missing_bytes)
    return facts


def memory_lines(facts: dict) -> str:
    """The text report: one line of per-rank needs, then the plan's table or its shortfall."""
    from runtime.cache.memory_planner import format_bytes

    tp = facts["tp"]
    who = "one process" if tp == 1 else f"per rank of tensor parallel {tp}"
    line = (f"memory, {who}: weights {format_bytes(facts['weight_bytes_per_rank'])}"
            + ("" if tp == 1 else f" (whole model {format_bytes(facts['weight_bytes'])})")
            + f", KV {facts['kv_bytes_per_token_per_rank']:,} B/token, "
            f"state {facts['state_bytes_per_slot_per_rank']:,} B/slot")
    if facts["fits"] is None:
        return line
    return line + "\n" + (facts["table"] if facts["fits"] else f"does not fit: {facts['error']}")
