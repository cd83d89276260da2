"""hgc.gdn_fused's checks, shared by its CPU tests, its GPU tests and its benchmark: fresh inputs
laid out as one projection row hands them over (`gdn_inputs`), the unfused sequence the op must
equal (`unfused_gdn`: models/qwen3_next.py GatedDeltaNetBase.forward between its projections, over
any backend's short_conv and gdn_core), and its registry and pools (`gdn_registry`, `gdn_pools`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, TensorSpec
from models.qwen3_next import GatedRMSNorm, l2norm
from runtime.cache.state_pool import StatePool

__all__ = ["GdnShape", "BENCH_GDN", "gdn_registry", "gdn_pools", "GdnParams", "gdn_params", "gdn_inputs",
           "unfused_gdn", "fused_gdn", "DECODE_PATHS", "take_decode_path"]


@dataclasses.dataclass(frozen=True)
class GdnShape:
    hk: int
    hv: int
    dk: int
    dv: int
    kernel_width: int = 4

    @property
    def channels(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv

    @property
    def scale(self) -> float:
        return self.dk ** -0.5


BENCH_GDN = GdnShape(16, 32, 128, 128, 4)  # Qwen3-Next / Qwen3.5 at one rank: the decode bench's dims

# The op's decode paths (runtime/backends/kernels/gdn_fused.py decode_launches), each by its
# launches and the (SPLIT_DECODE_MAX_ROWS, ONE_LAUNCH_MAX_ROWS) that give it at every batch.
DECODE_PATHS = {"split": (2, (1 << 20, 1 << 20)), "one": (1, (0, 1 << 20)), "four": (4, (0, 0))}


def take_decode_path(monkeypatch, path: str, batch: int) -> None:
    """Make a decode step of `batch` requests take `path` of DECODE_PATHS; skips the test where the
    op's own choice at that batch is already that path (its own-choice case runs it)."""
    import pytest

    from runtime.backends.kernels import gdn_fused as GF

    launches, (split, one) = DECODE_PATHS[path]
    if GF.decode_launches(batch) == launches:
        pytest.skip(f"the op's own choice at batch {batch} is the {path} path")
    monkeypatch.setattr(GF, "SPLIT_DECODE_MAX_ROWS", split)
    monkeypatch.setattr(GF, "ONE_LAUNCH_MAX_ROWS", one)


def gdn_registry(layers: dict[int, GdnShape]) -> LayerRegistry:
    return LayerRegistry([
        LayerSpec(lid, LayerKind.GDN, state={"recurrent": TensorSpec((s.hv, s.dk, s.dv), "float32"),
                                             "conv": TensorSpec((s.channels, s.kernel_width - 1), "float32")})
        for lid, s in layers.items()])


def gdn_pools(layers: dict[int, GdnShape], num_slots: int, device, seed: int, verify: dict | None = None,
              copies: int = 2, state_dtype: str = "float32") -> list[StatePool]:
    """`copies` pools (the first on the host, the others on `device`) with the same random non-zero
    states; `verify`: StatePool's draft_tokens / verify_rows, for target-verify steps; recurrent
    states in `state_dtype`."""
    reg = gdn_registry(layers).with_state_dtype(state_dtype)
    pools = [StatePool(reg, num_slots, **(verify or {}))]
    pools += [StatePool(reg, num_slots, device, **(verify or {})) for _ in range(copies - 1)]
    g = torch.Generator().manual_seed(seed)
    for lid, entries in pools[0].buffers.items():
        for name, t in entries.items():
            t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            for other in pools[1:]:
                other.buffers[lid][name].copy_(t)
    return pools


@dataclasses.dataclass
class GdnParams:
    conv_weight: torch.Tensor  # [C, K]
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    norm_weight: torch.Tensor  # [Dv]

    def to(self, device) -> "GdnParams":
        return GdnParams(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def gdn_params(s: GdnShape, dtype, seed: int, norm_dtype=None, a_log_dtype=None) -> GdnParams:
    """A layer's weights in `dtype` (norm_weight in norm_dtype, A_log in a_log_dtype where given:
    checkpoints keep some of them in float32)."""
    g = torch.Generator().manual_seed(seed)
    return GdnParams(
        conv_weight=(torch.randn(s.channels, s.kernel_width, generator=g) * 0.5).to(dtype),
        A_log=torch.log(torch.rand(s.hv, generator=g) * 15 + 1).to(a_log_dtype or dtype),
        dt_bias=(torch.randn(s.hv, generator=g) * 0.5).to(dtype),
        norm_weight=(1 + 0.2 * torch.randn(s.dv, generator=g)).to(norm_dtype or dtype))


def gdn_inputs(s: GdnShape, rows: int, num_real: int, dtype, g: torch.Generator, device="cpu",
               extra: int = 8) -> dict[str, torch.Tensor]:
    """qkv [T, C], z [T, Hv, Dv], b and a [T, Hv] as views of one projection output
    [T, C + Hv*Dv + 2*Hv + extra] (q | k | v | z | b | a, rows wider than any view, as the model's
    FusedLinear hands them over); rows from num_real on are NaN (they must never matter)."""
    C, vd = s.channels, s.hv * s.dv
    proj = torch.randn(rows, C + vd + 2 * s.hv + extra, generator=g)
    proj[:, :C] *= 2.0  # conv inputs of a realistic spread (the l2norm and silu see both signs)
    proj[:, C + vd + s.hv:] *= 2.0
    proj[num_real:] = float("nan")
    proj = proj.to(dtype).to(device)
    return {"qkv": proj[:, :C], "z": proj[:, C:C + vd].view(rows, s.hv, s.dv),
            "b": proj[:, C + vd:C + vd + s.hv], "a": proj[:, C + vd + s.hv:C + vd + 2 * s.hv]}


def unfused_gdn(ops, ctx, x: dict, p: GdnParams, out: torch.Tensor, layer_id: int, s: GdnShape, eps: float) -> None:
    """What hgc.gdn_fused must compute, as the model computes it with the unfused ops: `ops`'
    short_conv and gdn_core (a backend: the CPU reference, or triton_linear on the device) with the
    model's own glue between them (models/qwen3_next.py GatedDeltaNetBase.forward). Writes `out`
    (padding rows: whatever the glue makes of them; compare real rows only)."""
    qkv = x["qkv"]
    mixed = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    ops.short_conv(ctx, qkv, p.conv_weight, None, mixed, layer_id, True)
    kd = s.hk * s.dk
    q, k, v = mixed.split([kd, kd, s.hv * s.dv], dim=-1)
    q = l2norm(q.reshape(-1, s.hk, s.dk))
    k = l2norm(k.reshape(-1, s.hk, s.dk))
    v = v.reshape(-1, s.hv, s.dv)
    beta = x["b"].sigmoid()
    g = -p.A_log.float().exp() * F.softplus(x["a"].float() + p.dt_bias)
    core = torch.empty_like(v)
    ops.gdn_core(ctx, q, k, v, g, beta, core, layer_id, s.scale)
    norm = GatedRMSNorm(s.dv, eps).to(out.device)
    norm.weight = torch.nn.Parameter(p.norm_weight, requires_grad=False)
    with torch.no_grad():
        out.copy_(norm(core, x["z"]))


def fused_gdn(backend, ctx, x: dict, p: GdnParams, out: torch.Tensor, layer_id: int, s: GdnShape, eps: float) -> None:
    """The op on `backend`, with the arguments in schema order."""
    backend.gdn_fused(ctx, x["qkv"], x["z"], x["b"], x["a"], p.conv_weight, p.A_log, p.dt_bias, p.norm_weight, out,
                      layer_id, s.hk, s.scale, eps)
