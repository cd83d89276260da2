"""The shared expert's math, stated once: the CPU reference's moe op computes it, and the shared-expert
pass (compiler/passes/shared_expert.py) traces it into a graph.

A MoE block's shared expert is a SwiGLU MLP every token goes through, scaled where the family
has a gate by g = sigmoid(x . shared_gate) (computed in float32, like the router's logits).
The `moe` op (compiler/splitops/ops.py) adds it to the routed experts' sum; with `--overlap` the
shared-expert pass takes it out of the op and puts `add_shared_expert` in the graph instead, so
the overlap pass can run it on a second stream beside the routed experts.

1. `swiglu_expert(x, w13, w2)`: one SwiGLU expert, routed or shared, [T,D] -> [T,D] float32.
2. `shared_expert(x, shared_w13, shared_w2, shared_gate)`: the gated shared expert, float32.
3. `add_shared_expert(routed, x, ...)`: routed (the op's `out`) + the shared expert, in routed's
   dtype. In float32 it is bit for bit the op's own sum (the reference adds the shared expert to
   the routed float32 sum last, and so does this); in bfloat16 the routed sum is rounded once
   more, when the op writes it, than inside the op.

What it does not do: route tokens or check shapes (`moe_shared_width` in ops.py does that).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu_expert", "shared_expert", "add_shared_expert"]


def swiglu_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """w2 (silu(gate rows of w13 . x) * (up rows of w13 . x)): x [T,D], w13 [2I,D], w2 [D,I] -> [T,D] float32.

    The matmuls run in the inputs' dtype (float32 when the CPU reference is the oracle: tests
    upcast bf16 values first); sums over experts are float32."""
    inter = w2.shape[-1]
    h = F.linear(x, w13)
    h = F.silu(h[:, :inter]) * h[:, inter:]
    return F.linear(h, w2).float()


def shared_expert(x: torch.Tensor, shared_w13: torch.Tensor, shared_w2: torch.Tensor,
                  shared_gate: torch.Tensor | None) -> torch.Tensor:
    """[T,D] float32: the shared expert times sigmoid(x . shared_gate) (float32), or alone without a gate.

    No size of x appears in the computation, so a trace of it holds for every token count."""
    y = swiglu_expert(x, shared_w13, shared_w2)
    if shared_gate is None:
        return y
    return y * torch.sigmoid(F.linear(x.float(), shared_gate.float()))


def add_shared_expert(routed: torch.Tensor, x: torch.Tensor, shared_w13: torch.Tensor, shared_w2: torch.Tensor,
                      shared_gate: torch.Tensor | None) -> torch.Tensor:
    """routed [T,D] (what a moe op without its shared expert wrote) + the shared expert, in routed's dtype."""
    return (routed.float() + shared_expert(x, shared_w13, shared_w2, shared_gate)).to(routed.dtype)
