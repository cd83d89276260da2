"""Last-to-arrive counters: one launch's programs hand a small final step to whichever finishes last.

A decode step's short kernels often end in a step that needs every program's result: the routing
of a token after the router's GEMV programs wrote its logits, the norm of a row after the GEMV
programs wrote its columns. Run as a kernel of its own, that step costs a launch and its gap (~2
us in a replayed batch-1 graph) for well under a microsecond of work. Here each program stores its
result, then counts itself in on a counter in device memory; the one that counts last sees every
other program's stores and runs the final step, then sets the counter back to zero. No program
waits on another, so nothing depends on which programs are resident at once.

1. `last_to_arrive(counter_ptr, expected)`, called in a kernel after the program's stores: a CTA
   barrier (every thread's stores are issued before the one thread that does the atomic releases
   them), then an acquire-release atomic add at GPU scope; True in the program that counts
   `expected`-th. That program reads the others' stores from L2 (`cache_modifier=".cg"`: its SM's
   L1 holds no line of them, so never a stale one) and zeroes the counter when done (a CUDA
   graph's replay starts where the last one left).
2. `arrival_counters(device, count, user)`: a user's zeroed int32 counters on the device, at least
   `count` of them, shared by every launch of that user (a kernel family: USERS). Sharing is safe
   because one user's launches run in stream order (with PDL, each waits for the one before:
   pdl.py) and each leaves every counter it touched at zero; each user has counters of its own, so
   launches of two users on two streams at once (a side stream of `hgc compile --overlap`) never
   meet on one. They grow only outside a CUDA graph capture: an allocation inside one would be the
   graph's, and its zeroing a node replayed over live counters. A grown-out buffer stays
   referenced: a graph captured over it replays into memory nothing else was handed.

Users (USERS): the MoE router's one launch (moe.py), the post-attention norm in the output
projection's GEMV (norm_gemv.py), the GDN split in one launch (gdn_fused.py: a key head's conv
history rolled by its last program), the split-K GEMM (split_k.py: a tile's partials summed by its
last program), the MoE's experts in one launch (moe.py `_experts_token_kernel`: its down programs
wait on a token's count of gate-up programs, the one kernel here whose programs wait, on programs
started before them). gdn_fused.py's split decode also counts its value blocks in the same way
on counters of its own (they sit beside the workspace the blocks park their outputs in).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["USERS", "arrival_counters", "last_to_arrive"]

# The kernel families that count on these counters, each on its own.
USERS = ("moe router", "gemv_add_rms_norm", "gdn_fused split", "split_k", "moe experts")


@triton.jit
def last_to_arrive(counter_ptr, expected):
    """Count this program in on *counter_ptr after its stores; whether it is the `expected`-th (the last)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == expected - 1


_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def arrival_counters(device, count: int, user: str) -> torch.Tensor:
    """`user`'s counters on `device` (int32, zero between launches), at least `count` of them."""
    if user not in USERS:
        raise ValueError(f"arrival counters: unknown user {user!r} (users: {', '.join(USERS)})")
    device = torch.device(device)
    have = _COUNTERS.get((device, user))
    if have is not None and have.numel() >= count:
        return have
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        held = 0 if have is None else have.numel()
        raise RuntimeError(f"{user}: its arrival counters on {device} hold {held}; this launch needs {count}. "
                           "They grow only outside a CUDA graph capture: run a step of this size before capturing")
    if have is not None:
        _RETIRED.append(have)
    fresh = torch.zeros(max(count, 64 if have is None else 2 * have.numel()), dtype=torch.int32, device=device)
    _COUNTERS[(device, user)] = fresh
    return fresh
