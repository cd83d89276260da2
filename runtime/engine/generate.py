"""A plain greedy loop over a model callable: prefill every prompt in one step, then decode.

This is the eager baseline's loop (`hgc generate`) and the simplest way to drive a compiled
artifact; the engine (continuous batching, chunked prefill, sampling) lives in runtime/engine/engine.py.
`forward(input_ids, positions, logits_index) -> logits [R, V]` runs under `ops.step(ctx)`.
"""

from __future__ import annotations

import torch

from compiler.splitops import LayerRegistry
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.step.bound_ops import BoundOps
from runtime.cache.kv_pool import KVPool, pages_for
from runtime.cache.state_pool import StatePool

__all__ = ["make_pools", "greedy_generate", "run_step"]


def make_pools(registry: LayerRegistry, max_tokens: int, num_seqs: int, page_size: int = 16,
               device="cpu", kv_dtype: torch.dtype | None = None) -> tuple[KVPool, StatePool]:
    """Pools big enough for `num_seqs` requests of up to `max_tokens` tokens each."""
    pages = num_seqs * pages_for(max_tokens, page_size)
    return (KVPool(registry, max(pages, 1), page_size, device, kv_dtype), StatePool(registry, num_seqs, device))


def run_step(forward, ops: BoundOps, items, kv_pool: KVPool, device="cpu") -> torch.Tensor:
    step = build_step(items, kv_pool, device)
    with ops.step(step.ctx), torch.no_grad():
        logits = forward(step.input_ids, step.positions, step.logits_index)
    commit_step(items)
    return logits


def greedy_generate(forward, ops: BoundOps, kv_pool: KVPool, state_pool: StatePool,
                    prompts: list[list[int]], max_new_tokens: int, stop_ids: frozenset[int] = frozenset(),
                    device="cpu") -> list[list[int]]:
    seqs = [SeqState(state_pool.alloc()) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = [list(p) for p in prompts]
    live = list(range(len(prompts)))
    try:
        while live and max_new_tokens > 0:
            logits = run_step(forward, ops, [(seqs[i], pending[i]) for i in live], kv_pool, device)
            next_ids = logits.argmax(-1).tolist()
            still = []
            for i, tok in zip(live, next_ids):
                outputs[i].append(tok)
                pending[i] = [tok]
                if len(outputs[i]) < max_new_tokens and tok not in stop_ids:
                    still.append(i)
            live = still
    finally:
        for seq in seqs:
            kv_pool.free(seq.pages)
            state_pool.free(seq.slot)
    return outputs
