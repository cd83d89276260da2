"""The bytes and FLOPs one op node of a step must move and compute: the arithmetic of step_account.py.

Everything here is shapes in, numbers out (no device, no profiler), so tests check it against
hand-computed values. An op's cost is a dict:

    {"flops": ..., "bytes": ..., "weights": ..., "states": ..., "kv": ...}

`bytes` is the total (weights + states + KV + activations read and written); the other keys say
where it comes from. FLOPs count multiply-adds as two. What is counted:

- GEMMs (a projection, the logits head): the weight once, the activations in and out; 2*m*n*k.
- MoE: the router's weight, the routed experts a step can touch (min(E, tokens * top_k): the upper
  bound of distinct experts hit, every expert's gate-up and down once), the shared expert; FLOPs of
  the router, of top_k SwiGLU experts per token (gate-up 2*2I*D, down 2*D*I) and of the shared one.
- Full attention (GQA, MLA): this step's K/V written once; every request's cached and new keys
  read once; causal FLOPs 2 * pairs * heads * (key width + value width), pairs = sum over requests
  of new * cached + new * (new + 1) / 2.
- Linear attention cores (GDN, KDA, Lightning): the layer's recurrent state read and written once
  per request, activations; FLOPs per token and head estimated in `linear_core_flops`.
- The short convolution: its state read and written once per request; 2 * K FLOPs per channel and token.
- Glue (norms, gates, rotary, residuals, copies): the weights it reads (norm scales); the
  activations between glue ops are intermediates a fused kernel need not write, so what the traced
  ops read and write is reported apart (`unfused`), not in `bytes`. FLOPs not counted (elementwise
  work is far below the matrix rate's reach).
"""

from __future__ import annotations

__all__ = ["KEYS", "cost", "add_costs", "gemm_cost", "moe_cost", "attention_pairs", "attention_cost",
           "linear_core_flops", "linear_core_cost", "short_conv_cost", "CHUNK"]

CHUNK = 64  # the chunk length of the linear cores' extend kernels (runtime/backends/kernels/chunk.py)


KEYS = ("flops", "bytes", "weights", "states", "kv", "activations", "unfused")


def cost(flops: float = 0, weights: int = 0, states: int = 0, kv: int = 0, activations: int = 0,
         unfused: int = 0) -> dict:
    """`unfused`: what glue moves between its own unfused ops (intermediates a fused kernel keeps in
    registers); reported apart, never part of `bytes`."""
    return {"flops": float(flops), "bytes": int(weights + states + kv + activations), "weights": int(weights),
            "states": int(states), "kv": int(kv), "activations": int(activations), "unfused": int(unfused)}


def add_costs(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in KEYS}


def gemm_cost(m: int, n: int, k: int, weight_itemsize: int, act_itemsize: int, bias: bool = False) -> dict:
    """x [m, k] @ W[n, k]^T (+ b) -> [m, n]: W (and b) read once, x read, the output written."""
    weights = (n * k + (n if bias else 0)) * weight_itemsize
    return cost(2 * m * n * k, weights=weights, activations=(m * k + m * n) * act_itemsize)


def moe_cost(tokens: int, hidden: int, inter: int, experts: int, top_k: int, weight_itemsize: int,
             act_itemsize: int, shared: int = 0, shared_gate: bool = False) -> dict:
    """The moe op of `tokens` rows: w13 [E, 2I, D] and w2 [E, D, I] per expert touched, the router
    [E, D], a shared expert of width `shared` (and its [1, D] gate)."""
    touched = min(experts, tokens * top_k)
    per_expert = 3 * inter * hidden  # gate and up rows, then down
    shared_weights = 3 * shared * hidden + (hidden if shared_gate else 0)
    weights = (experts * hidden + touched * per_expert + shared_weights) * weight_itemsize
    flops = 2 * tokens * (experts * hidden + top_k * per_expert + shared_weights)
    return cost(flops, weights=weights, activations=2 * tokens * hidden * act_itemsize)


def attention_pairs(query_lens, cache_lens) -> int:
    """Query-key pairs of a causal step: each new token sees the cache and the new tokens up to itself."""
    return sum(n * c + n * (n + 1) // 2 for n, c in zip(query_lens, cache_lens))


def attention_cost(query_lens, cache_lens, heads: int, key_width: int, value_width: int, kv_bytes_per_token: int,
                   act_bytes: int) -> dict:
    """A full attention layer's step: K/V of the new tokens written, every key of every request read
    once (cached and new), `act_bytes` of q/k/v in and out; QK^T and PV over the causal pairs."""
    new = sum(query_lens)
    kv = kv_bytes_per_token * (new + sum(n + c for n, c in zip(query_lens, cache_lens)))
    flops = 2 * attention_pairs(query_lens, cache_lens) * heads * (key_width + value_width)
    return cost(flops, kv=kv, activations=act_bytes)


def linear_core_flops(kind: str, query_lens, heads: int, dk: int, dv: int) -> float:
    """An estimate of a linear-attention core's FLOPs (state [dk, dv] per head).

    A request of one token (decode) is the recurrence: read out q^T S (2 dk dv), and for the delta
    rule (gdn, kda) also S^T k and the rank-one update (4 dk dv more); lightning adds k v^T (2 dk dv).
    A longer request runs by chunks of CHUNK tokens (WY form): per token the inter-chunk products
    with the state (q S, and k S for the delta rule) and the state update, 2 dk dv each, plus the
    intra-chunk products over its chunk, 2 * CHUNK * (dk + dv) (scores and their values), plus for
    the delta rule the (I + A)^-1 solve and W, U = T [k, v], 2 * CHUNK * (dk + dv) again."""
    delta = kind in ("gdn", "kda")
    total = 0.0
    for n in query_lens:
        if n == 1:
            total += (6 if delta else 4) * dk * dv
        else:
            per_token = (3 if delta else 2) * 2 * dk * dv + 2 * CHUNK * (dk + dv) * (2 if delta else 1)
            total += n * per_token
    return total * heads


def linear_core_cost(kind: str, query_lens, heads: int, dk: int, dv: int, state_bytes: int, act_bytes: int) -> dict:
    """The core's step: its recurrent state (`state_bytes` a request) read and written once per request."""
    return cost(linear_core_flops(kind, query_lens, heads, dk, dv), states=2 * state_bytes * len(query_lens),
                activations=act_bytes)


def short_conv_cost(tokens: int, channels: int, width: int, requests: int, state_bytes: int, weight_bytes: int,
                    act_bytes: int) -> dict:
    return cost(2 * tokens * channels * width, weights=weight_bytes, states=2 * state_bytes * requests,
                activations=act_bytes)
