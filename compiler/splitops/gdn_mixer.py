"""The GDN mixer between its projections, stated once: the model runs it, the fusion pass traces it,
the CPU reference's gdn_fused op computes it.

    gdn_mixer_region(ops, qkv, z, b, a, conv_weight, A_log, dt_bias, norm, layer_id, k_heads, k_dim, scale)

1. short_conv(qkv) with silu into a fresh buffer (op `short_conv`);
2. q | k | v split of the conv's output, l2norm of q and k per key head (float32, cast back);
3. beta = sigmoid(b) in the activation dtype, g = -exp(A_log) * softplus(a + dt_bias) in float32;
4. the gated delta rule into a fresh buffer (op `gdn_core`);
5. `norm(core, z)`: the gated RMSNorm, `gated_rms_norm` with the layer's weight and eps.

`ops` is an op table (compiler/splitops/table.py): the model's (traced, or bound to a backend), or
the CPU reference's own methods. The op `gdn_fused` (ops.py) is this whole function as one node;
the fusion pass (compiler/passes/fusion.py) traces it on meta tensors to recognise the region in
a program, so a model whose mixer differs from it in any node is left unfused.

Lives on the ground floor because models/, the compiler and the runtime all read it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["l2norm", "gated_rms_norm", "gdn_mixer_region"]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) in float32, as transformers (and FLA) do: eps inside the root."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate) over the last dimension, in x's dtype."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # transformers casts back to the input dtype before the weight, then gates in float32.
    y = weight * xf.to(dtype)
    return (y * F.silu(gate.float())).to(dtype)


def gdn_mixer_region(ops, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                     conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     norm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], layer_id: int, k_heads: int,
                     k_dim: int, scale: float) -> torch.Tensor:
    """qkv [T, 2*Hk*Dk + Hv*Dv], z [T,Hv,Dv], b and a [T,Hv], conv_weight [C,1,K] or [C,K] -> the gated
    norm's output [T,Hv,Dv]."""
    v_heads, v_dim = z.shape[-2], z.shape[-1]
    mixed = torch.empty_like(qkv)
    # squeeze(1): the Conv1d's [C,1,K] weight as the op's [C,K] (a [C,K] weight, K >= 2, is kept as it is)
    ops.short_conv(qkv, conv_weight.squeeze(1), None, mixed, layer_id, True)
    kd = k_heads * k_dim
    q, k, v = mixed.split([kd, kd, v_heads * v_dim], dim=-1)
    q = l2norm(q.reshape(-1, k_heads, k_dim))  # [T,Hk,Dk]
    k = l2norm(k.reshape(-1, k_heads, k_dim))
    v = v.reshape(-1, v_heads, v_dim)  # [T,Hv,Dv]
    beta = b.sigmoid()  # [T,Hv]
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # [T,Hv] log-decay, float32
    core = torch.empty_like(v)
    ops.gdn_core(q, k, v, g, beta, core, layer_id, scale)
    return norm(core, z)  # [T,Hv,Dv]
