"""Qwen3-Next (family `qwen3_next`) and the pieces Qwen3.5 (models/qwen3_5.py) shares with it.

The architecture: a stack of decoder layers, each a token mixer plus an MLP, pre-norm with
zero-centred RMSNorms (scale 1 + w). Mixers are

- Gated DeltaNet (`linear_attn.*`, LayerKind.GDN): projections -> causal depthwise conv (op
  `short_conv`) -> l2-normalised q/k -> gated delta rule (op `gdn_core`) -> RMSNorm gated by
  silu(z) -> out_proj. Qwen3-Next's checkpoint packs q|k|v|z and b|a per key-head group
  (`in_proj_qkvz`, `in_proj_ba`), which the model holds flat, q|k|v|z|b|a (`gdn_row_orders`);
  Qwen3.5 stores them as separate flat projections (its own module, same core).
- gated GQA (`self_attn.*`, LayerKind.FULL_GQA): q_proj yields query and an output gate per head,
  q_norm / k_norm per head, partial NeoX rotary, op `gqa_attention`, output * sigmoid(gate).

MLPs are one `moe` op (softmax-routed experts plus a sigmoid-gated shared expert) or a dense SwiGLU.

Config normalisation happens once, in `parse_dims`: it validates config.json and turns the
interval / list / sparse-step quirks into explicit per-layer tuples, which `qwen_registry` writes
into the LayerRegistry. Models build their layers from that registry, never from the raw config.

MTP rule. The Qwen3-Next checkpoint ships one MTP layer (`mtp.*`) but its published config has
no field for it, and transformers ignores those tensors. hgc builds the draft only when the
config asks for it, through `num_nextn_predict_layers` (the name vLLM / SGLang read for
Qwen3-Next) or `mtp_num_hidden_layers` (Qwen3.5's name; both present must agree). Without either,
the registry has no draft layer and `mtp.*` tensors are left unread; with it, they are required.
The registry depends on config.json only, never on which tensors a checkpoint happens to hold.
The draft layer gets id num_hidden_layers and is a gated-GQA layer with the family's MLP.

Draft forward (vLLM's Qwen3-Next MTP): x = fc([norm_e(embed(ids)), norm_h(hidden)]), one decoder
layer, a final norm, the main model's lm_head. `hidden` is the main model's final hidden state
(after model.norm, what `forward_hidden` returns) at the same positions.

Tensor parallelism: `shard_dims(dims, tp)` divides the heads (KV heads replicated when there are
fewer than ranks), the linear-attention heads and the MLP / expert widths; a rank model is built
from those dims like any other (models/common.py).

Tensor names equal the checkpoint's: `model.layers.{i}.*`, `model.embed_tokens`, `model.norm`,
`lm_head`, `mtp.*` (routed experts stacked by MoEBlock, written per expert or fused by its style).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.splitops import GroupedRows, LayerKind, LayerRegistry, LayerSpec, TensorSpec, split_count
from compiler.splitops.gdn_mixer import gated_rms_norm, gdn_mixer_region, l2norm
from models.common import (CheckpointError, FusedLinear, HybridLM, MoEBlock, RMSNorm, SwiGLU, apply_rotary,
                           init_weights_, lm_head_rows)
from models.families import Family

__all__ = ["QwenDims", "parse_dims", "shard_dims", "qwen_registry", "QwenHybridLM", "Qwen3NextForCausalLM",
           "GatedDeltaNetBase", "Qwen3NextGDN", "gdn_row_orders", "QwenGatedAttention", "QwenSparseMoe", "QwenMTP",
           "GatedRMSNorm", "l2norm", "init_qwen_weights", "make_config", "FAMILY", "TENSOR_PREFIX_KEY"]

# The flat text config of a VL checkpoint (models/qwen3_5.py) records where the text model's
# tensors live; absent means "model.".
TENSOR_PREFIX_KEY = "hgc_tensor_prefix"
VL_PREFIX = "model.language_model."

_LINEAR, _FULL = "linear_attention", "full_attention"
_DTYPES = ("float32", "bfloat16", "float16")
_MISSING = object()


# ---------------------------------------------------------------------------------------------
# Config: validation and normalisation
# ---------------------------------------------------------------------------------------------

class _Fields:
    """Typed reads of config fields; every error names the file and the field's path."""

    def __init__(self, cfg: dict, source: str, path: str):
        self.cfg, self.source, self.path = cfg, source, path

    def fail(self, name: str, msg: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: field {self.path + name!r}: {msg}")

    def get(self, name, default=_MISSING):
        if name not in self.cfg or self.cfg[name] is None:
            if default is _MISSING:
                raise self.fail(name, "missing (required for this model)")
            return default
        return self.cfg[name]

    def int(self, name, default=_MISSING, minimum: int = 1) -> int:
        v = self.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.fail(name, f"expected an integer >= {minimum}, got {v!r}")
        return v

    def float(self, name, default=_MISSING) -> float:
        v = self.get(name, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(name, f"expected a number, got {v!r}")
        return float(v)

    def bool(self, name, default=_MISSING) -> bool:
        v = self.get(name, default)
        if not isinstance(v, bool):
            raise self.fail(name, f"expected true or false, got {v!r}")
        return v


@dataclasses.dataclass(frozen=True)
class QwenDims:
    """Everything a Qwen hybrid model's shapes and layout depend on, validated."""

    hidden: int
    vocab: int
    num_layers: int
    layer_kinds: tuple[LayerKind, ...]  # per main layer: GDN or FULL_GQA
    mlp_kinds: tuple[str, ...]  # per main layer: "moe" or "dense"
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attention_bias: bool
    eps: float
    k_heads: int  # linear_num_key_heads
    v_heads: int  # linear_num_value_heads
    k_dim: int
    v_dim: int
    conv_kernel: int
    num_experts: int
    top_k: int
    moe_inter: int
    shared_inter: int
    inter: int  # dense MLP width (0 when no layer is dense)
    norm_topk: bool
    num_mtp: int  # draft layers: 0 or 1
    mtp_mlp: str  # "moe" or "dense"
    dtype: str
    tie_embeddings: bool
    prefix: str  # tensor-name prefix of the text model: "model." or "model.language_model."

    @property
    def conv_channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


def _layer_kinds(f: _Fields, n: int) -> tuple[LayerKind, ...]:
    """`layer_types` if given (checked against `full_attention_interval` when both are), else the interval."""
    interval = f.int("full_attention_interval", None) if f.cfg.get("full_attention_interval") is not None else None
    from_interval = [_FULL if (i + 1) % (interval or 4) == 0 else _LINEAR for i in range(n)]
    types = f.cfg.get("layer_types")
    if types is None:
        types = from_interval  # transformers' default interval is 4
    else:
        if not isinstance(types, list):
            raise f.fail("layer_types", f"expected a list of layer type names, got {type(types).__name__}")
        if len(types) != n:
            raise f.fail("layer_types", f"has {len(types)} entries but num_hidden_layers is {n}")
        for i, t in enumerate(types):
            if t not in (_LINEAR, _FULL):
                raise f.fail(f"layer_types[{i}]", f"{t!r} is not {_LINEAR!r} or {_FULL!r}")
        if interval is not None and types != from_interval:
            full = [i for i, t in enumerate(types) if t == _FULL]
            raise f.fail("full_attention_interval",
                         f"{interval} puts full attention on other layers than layer_types does "
                         f"(layer_types: {full}); drop one of the two fields or make them agree")
    return tuple(LayerKind.FULL_GQA if t == _FULL else LayerKind.GDN for t in types)


def _mtp_layers(f: _Fields, names: tuple[str, ...]) -> int:
    given = {name: f.int(name, minimum=0) for name in names if f.cfg.get(name) is not None}
    if len(set(given.values())) > 1:
        raise f.fail(names[0], f"disagrees with another MTP field: {given}")
    num = next(iter(given.values()), 0)
    if num > 1:
        raise f.fail(next(iter(given)), f"{num} MTP layers; hgc supports 0 or 1")
    if f.cfg.get("mtp_use_dedicated_embeddings"):
        raise f.fail("mtp_use_dedicated_embeddings", "true is not supported (the draft shares embed_tokens)")
    return num


def _rope(f: _Fields, head_dim: int) -> tuple[int, float]:
    """(rotary_dim, theta) from `rope_parameters` (transformers 5) or top-level keys (older files)."""
    params = f.get("rope_parameters", {})
    if not isinstance(params, dict):
        raise f.fail("rope_parameters", f"expected an object, got {params!r}")
    scaling = f.cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise f.fail("rope_scaling", f"expected an object or null, got {scaling!r}")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise f.fail("rope_scaling", f"{scaling!r}: only default RoPE is supported")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise f.fail("rope_parameters", f"rope_type {rope_type!r}: only 'default' is supported")
    theta = params.get("rope_theta", f.cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", f.cfg.get("partial_rotary_factor", 0.25))
    rotary_dim = int(head_dim * factor)  # transformers truncates the same way
    if not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise f.fail("partial_rotary_factor", f"{factor} x head_dim {head_dim} = {rotary_dim} rotary channels; "
                                              "needs an even number in 1..head_dim")
    # mrope_section / mrope_interleaved (Qwen3.5) are accepted: with text-only positions the three
    # M-RoPE position streams are equal and M-RoPE is exactly 1-D RoPE.
    return rotary_dim, float(theta)


def parse_dims(cfg: dict, variant: str, source: str = "config.json") -> QwenDims:
    """Validate a flat text config. variant: "next" (Qwen3-Next), "dense" or "moe" (Qwen3.5)."""
    prefix = cfg.get(TENSOR_PREFIX_KEY, "model.")
    f = _Fields(cfg, source, "text_config." if prefix == VL_PREFIX else "")
    hidden, n, vocab = f.int("hidden_size"), f.int("num_hidden_layers"), f.int("vocab_size")
    heads, kv_heads, head_dim = f.int("num_attention_heads"), f.int("num_key_value_heads"), f.int("head_dim")
    if heads % kv_heads:
        raise f.fail("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    k_heads, v_heads = f.int("linear_num_key_heads"), f.int("linear_num_value_heads")
    if v_heads % k_heads:
        raise f.fail("linear_num_key_heads", f"{k_heads} does not divide linear_num_value_heads {v_heads}")
    act = f.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise f.fail("hidden_act", f"{act!r}: only silu is supported")
    if f.cfg.get("attn_output_gate") is False:
        raise f.fail("attn_output_gate", "false is not supported (Qwen full attention is always gated)")
    rotary_dim, theta = _rope(f, head_dim)
    kinds = _layer_kinds(f, n)

    num_experts = f.int("num_experts", 0, minimum=0) if variant != "dense" else 0
    if variant == "next":
        sparse_step = f.int("decoder_sparse_step", 1)
        dense_ids = f.get("mlp_only_layers", [])
        if not isinstance(dense_ids, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n
                                                  for i in dense_ids):
            raise f.fail("mlp_only_layers", f"{dense_ids!r}: expected a list of layer ids in 0..{n - 1}")
        mlp = tuple("moe" if (i not in dense_ids and num_experts > 0 and (i + 1) % sparse_step == 0) else "dense"
                    for i in range(n))
        mtp_names = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
        norm_topk = f.bool("norm_topk_prob", True)
    elif variant == "moe":
        if num_experts == 0:
            raise f.fail("num_experts", "missing or 0 in a qwen3_5_moe_text config")
        if f.cfg.get("mlp_only_layers"):
            raise f.fail("mlp_only_layers", "Qwen3.5 MoE puts experts on every layer; this must be empty")
        mlp = ("moe",) * n
        mtp_names, norm_topk = ("mtp_num_hidden_layers",), True  # transformers always renormalises here
    elif variant == "dense":
        mlp = ("dense",) * n
        mtp_names, norm_topk = ("mtp_num_hidden_layers",), False
    else:
        raise ValueError(f"unknown Qwen variant {variant!r}")
    num_mtp = _mtp_layers(f, mtp_names)
    mtp_mlp = "moe" if num_experts > 0 else "dense"  # the draft layer's MLP follows the family's

    uses_moe = "moe" in mlp or (num_mtp and mtp_mlp == "moe")
    top_k = moe_inter = shared_inter = 0
    if uses_moe:
        top_k, moe_inter = f.int("num_experts_per_tok"), f.int("moe_intermediate_size")
        shared_inter = f.int("shared_expert_intermediate_size")
        if top_k > num_experts:
            raise f.fail("num_experts_per_tok", f"{top_k} is more than num_experts {num_experts}")
    inter = f.int("intermediate_size") if ("dense" in mlp or (num_mtp and mtp_mlp == "dense")) else 0

    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    if dtype not in _DTYPES:
        raise f.fail("dtype", f"{dtype!r}: expected one of {_DTYPES}")
    return QwenDims(
        hidden=hidden, vocab=vocab, num_layers=n, layer_kinds=kinds, mlp_kinds=mlp, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=theta,
        attention_bias=f.bool("attention_bias", False), eps=f.float("rms_norm_eps", 1e-6),
        k_heads=k_heads, v_heads=v_heads, k_dim=f.int("linear_key_head_dim"), v_dim=f.int("linear_value_head_dim"),
        conv_kernel=f.int("linear_conv_kernel_dim", 4, minimum=2), num_experts=num_experts, top_k=top_k,
        moe_inter=moe_inter, shared_inter=shared_inter, inter=inter, norm_topk=norm_topk, num_mtp=num_mtp,
        mtp_mlp=mtp_mlp, dtype=dtype, tie_embeddings=f.bool("tie_word_embeddings", False), prefix=prefix,
    )


def shard_dims(d: QwenDims, tp: int) -> QwenDims:
    """The dims of one rank of `tp`: heads, linear-attention heads and MLP widths divided (KV heads
    replicated below one per rank); the error names the first layer a count does not divide in."""
    if tp == 1:
        return d

    def layer(kind=None, mlp=None) -> str:
        for i, (k, m) in enumerate(zip(d.layer_kinds, d.mlp_kinds)):
            if (kind is None or k == kind) and (mlp is None or m == mlp):
                return f"layer {i} ({k.value}{', ' + m + ' MLP' if mlp else ''})"
        return f"layer {d.num_layers} (draft)"  # only the draft layer has it

    full, gdn = layer(LayerKind.FULL_GQA), layer(LayerKind.GDN)
    return dataclasses.replace(
        d, heads=split_count(d.heads, tp, "attention heads", full),
        kv_heads=split_count(d.kv_heads, tp, "KV heads", full, replicate=True),
        k_heads=split_count(d.k_heads, tp, "linear-attention key heads", gdn),
        v_heads=split_count(d.v_heads, tp, "linear-attention value heads", gdn),
        moe_inter=split_count(d.moe_inter, tp, "expert intermediate channels", layer(mlp="moe")),
        shared_inter=split_count(d.shared_inter, tp, "shared-expert intermediate channels", layer(mlp="moe")),
        inter=split_count(d.inter, tp, "dense MLP intermediate channels", layer(mlp="dense")))


def qwen_registry(d: QwenDims, gdn_module: str) -> LayerRegistry:
    """One LayerSpec per main layer, then the draft layer(s) with ids num_layers, num_layers+1, ..."""
    kv = {"k": TensorSpec((d.kv_heads, d.head_dim), d.dtype), "v": TensorSpec((d.kv_heads, d.head_dim), d.dtype)}
    state = {"recurrent": TensorSpec((d.v_heads, d.k_dim, d.v_dim), "float32"),
             "conv": TensorSpec((d.conv_channels, d.conv_kernel - 1), d.dtype)}
    specs = []
    for i, (kind, mlp) in enumerate(zip(d.layer_kinds, d.mlp_kinds)):
        if kind == LayerKind.GDN:
            specs.append(LayerSpec(i, kind, state=dict(state), mlp=mlp, module=gdn_module))
        else:
            specs.append(LayerSpec(i, kind, kv=dict(kv), mlp=mlp, module=QwenGatedAttention.__name__))
    for j in range(d.num_mtp):
        specs.append(LayerSpec(d.num_layers + j, LayerKind.FULL_GQA, draft=True, kv=dict(kv), mlp=d.mtp_mlp,
                               module=QwenGatedAttention.__name__))
    return LayerRegistry(specs)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------

class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * silu(gate), per value head. Plain weight (init 1), not zero-centred."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNetBase(nn.Module):
    """The GDN mixer minus its input projections, which differ between Qwen3-Next and Qwen3.5.

    Subclasses implement `project(x [T,D]) -> (qkv [T,C] ordered q|k|v, z [T,Hv,Dv], b [T,Hv], a [T,Hv])`.
    """

    def __init__(self, d: QwenDims, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.k_heads, self.v_heads, self.k_dim, self.v_dim = d.k_heads, d.v_heads, d.k_dim, d.v_dim
        C, K = d.conv_channels, d.conv_kernel
        # Only the weight is used (through the short_conv op); a Conv1d names it `conv1d.weight` [C,1,K].
        self.conv1d = nn.Conv1d(C, C, K, groups=C, bias=False, padding=K - 1)
        self.A_log = nn.Parameter(torch.empty(d.v_heads))
        self.dt_bias = nn.Parameter(torch.ones(d.v_heads))
        self.norm = GatedRMSNorm(d.v_dim, d.eps)
        self.out_proj = nn.Linear(d.v_heads * d.v_dim, d.hidden, bias=False)

    def project(self, x: torch.Tensor):
        raise NotImplementedError

    def fused_segments(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """The conv runs over q | k | v channels: three segments a rank takes its heads of."""
        kd = self.k_heads * self.k_dim
        return {"conv1d.weight": (0, (kd, kd, self.v_heads * self.v_dim))}

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        qkv, z, b, a = self.project(x)  # x [T,D]
        y = gdn_mixer_region(ops, qkv, z, b, a, self.conv1d.weight, self.A_log, self.dt_bias, self.norm,
                             self.layer_id, self.k_heads, self.k_dim, self.k_dim ** -0.5)  # [T,Hv,Dv]
        return self.out_proj(y.reshape(-1, self.v_heads * self.v_dim))


def gdn_row_orders(k_heads: int, k_dim: int, v_heads: int, v_dim: int) -> dict[str, GroupedRows]:
    """How Qwen3-Next stores its GDN projections' rows, per key head h (r = v_heads / k_heads value
    heads each): in_proj_qkvz [q_h | k_h | v_h | z_h], in_proj_ba [b_h | a_h]. Held segment-major,
    they are q | k | v | z and b | a, every piece in head order."""
    r = v_heads // k_heads
    return {"in_proj_qkvz.weight": GroupedRows(k_heads, (k_dim, k_dim, r * v_dim, r * v_dim)),
            "in_proj_ba.weight": GroupedRows(k_heads, (r, r))}


class Qwen3NextGDN(GatedDeltaNetBase):
    """Qwen3-Next projections, one GEMM over rows held q | k | v | z | b | a (`gdn_row_orders`: the
    checkpoint stores them per key head), so q | k | v is the conv's input as it comes out of the
    GEMM and z, b, a are slices of it: no gather, no copy."""

    def __init__(self, d: QwenDims, layer_id: int):
        super().__init__(d, layer_id)
        self._row_orders = gdn_row_orders(d.k_heads, d.k_dim, d.v_heads, d.v_dim)
        self.in_proj = FusedLinear(d.hidden, {"in_proj_qkvz": self._row_orders["in_proj_qkvz.weight"].rows,
                                              "in_proj_ba": self._row_orders["in_proj_ba.weight"].rows})

    def row_orders(self) -> dict[str, GroupedRows]:
        return dict(self._row_orders)

    def project(self, x):
        kd, vd = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        qkv, z, b, a = self.in_proj(x, (2 * kd + vd, vd, self.v_heads, self.v_heads))
        return qkv, z.view(-1, self.v_heads, self.v_dim), b, a


class QwenGatedAttention(nn.Module):
    """GQA whose q_proj yields, per head, the query then an output gate; per-head q/k norms; partial rotary."""

    def __init__(self, d: QwenDims, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = d.heads, d.kv_heads, d.head_dim
        self.rotary_dim, self.theta = d.rotary_dim, d.rope_theta
        self.qkv_proj = FusedLinear(d.hidden, {"q_proj": d.heads * d.head_dim * 2, "k_proj": d.kv_heads * d.head_dim,
                                               "v_proj": d.kv_heads * d.head_dim}, bias=d.attention_bias)
        bias = d.attention_bias
        self.o_proj = nn.Linear(d.heads * d.head_dim, d.hidden, bias=bias)
        self.q_norm = RMSNorm(d.head_dim, d.eps, unit_offset=True)
        self.k_norm = RMSNorm(d.head_dim, d.eps, unit_offset=True)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ops) -> torch.Tensor:
        H, Hkv, hd = self.heads, self.kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x)
        q, gate = q.view(-1, H, 2 * hd).split([hd, hd], dim=-1)  # [T,H,hd] each
        q = apply_rotary(self.q_norm(q), positions, self.rotary_dim, self.theta)
        k = apply_rotary(self.k_norm(k.view(-1, Hkv, hd)), positions, self.rotary_dim, self.theta)
        v = v.view(-1, Hkv, hd)
        out = torch.empty_like(q)
        ops.gqa_attention(q, k, v, out, self.layer_id, hd ** -0.5)
        return self.o_proj((out * torch.sigmoid(gate)).reshape(-1, H * hd))


class QwenSparseMoe(MoEBlock):
    """Softmax top-k routed experts plus a shared expert scaled by sigmoid(shared_expert_gate): one `moe` op."""

    def __init__(self, d: QwenDims, layer_id: int, expert_style: str):
        super().__init__(d.hidden, d.moe_inter, d.num_experts, layer_id, top_k=d.top_k, scoring="softmax",
                         renormalize=d.norm_topk, expert_style=expert_style, shared_inter=d.shared_inter,
                         shared_name="shared_expert", shared_gate_name="shared_expert_gate.weight")


class QwenDecoderLayer(nn.Module):
    """x + mixer(norm(x)), then + mlp(norm(x)). The mixer is `linear_attn` (GDN) or `self_attn`."""

    def __init__(self, d: QwenDims, spec: LayerSpec, gdn_cls: type, expert_style: str):
        super().__init__()
        self.is_linear = spec.kind == LayerKind.GDN
        self.is_moe = spec.mlp == "moe"
        self.input_layernorm = RMSNorm(d.hidden, d.eps, unit_offset=True)
        if self.is_linear:
            self.linear_attn = gdn_cls(d, spec.layer_id)
        else:
            self.self_attn = QwenGatedAttention(d, spec.layer_id)
        self.post_attention_layernorm = RMSNorm(d.hidden, d.eps, unit_offset=True)
        self.mlp = QwenSparseMoe(d, spec.layer_id, expert_style) if self.is_moe else SwiGLU(d.hidden, d.inter)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ops) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h, ops) if self.is_linear else self.self_attn(h, positions, ops))
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, ops) if self.is_moe else self.mlp(h))


class QwenBackbone(nn.Module):
    """embed_tokens, layers, norm: what sits under the text model's tensor prefix."""

    def __init__(self, d: QwenDims, registry: LayerRegistry, gdn_cls: type, expert_style: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(d.vocab, d.hidden)
        self.layers = nn.ModuleList(QwenDecoderLayer(d, spec, gdn_cls, expert_style)
                                    for spec in sorted(registry.main_layers(), key=lambda s: s.layer_id))
        self.norm = RMSNorm(d.hidden, d.eps, unit_offset=True)


class QwenMTP(nn.Module):
    """The MTP draft (`mtp.*`): one extra gated-GQA decoder layer fed by [embedding, main hidden]."""

    def __init__(self, d: QwenDims, spec: LayerSpec, gdn_cls: type, expert_style: str, main: "QwenHybridLM"):
        super().__init__()
        self.fc = nn.Linear(2 * d.hidden, d.hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(d.hidden, d.eps, unit_offset=True)
        self.pre_fc_norm_hidden = RMSNorm(d.hidden, d.eps, unit_offset=True)
        self.layers = nn.ModuleList([QwenDecoderLayer(d, spec, gdn_cls, expert_style)])
        self.norm = RMSNorm(d.hidden, d.eps, unit_offset=True)
        # The embedding and lm_head are the main model's: keep a plain reference (not a submodule),
        # so their tensors appear once in the state dict, under their checkpoint names.
        self.__dict__["_main"] = main
        self.ops = main.ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                logits_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [R,V], the draft's normed hidden [T,D]): the draft interface of every family."""
        main = self._main
        e = self.pre_fc_norm_embedding(main.backbone.embed_tokens(input_ids))  # [T,D]
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        for layer in self.layers:
            x = layer(x, positions, self.ops)
        x = self.norm(x)
        return main.compute_logits(x, logits_index), x


class QwenHybridLM(HybridLM):
    """A Qwen hybrid causal LM; subclasses set `variant`, `gdn_cls` and the expert styles."""

    variant = "next"
    gdn_cls: type = Qwen3NextGDN
    expert_style = "gate_up_down"  # main layers
    mtp_expert_style = "gate_up_down"  # the MTP layer (per-expert tensors in every known checkpoint)

    def __init__(self, config: dict, tp: int = 1):
        super().__init__(config, tp)
        d = self.dims = shard_dims(parse_dims(config, self.variant), tp)
        self.layer_registry = qwen_registry(d, self.gdn_cls.__name__)
        backbone = QwenBackbone(d, self.layer_registry, self.gdn_cls, self.expert_style)
        if d.prefix == VL_PREFIX:  # model.language_model.*: the VL checkpoint layout
            self.model = nn.Module()
            self.model.language_model = backbone
        else:
            self.model = backbone
        self.lm_head = None if d.tie_embeddings else nn.Linear(d.hidden, lm_head_rows(d.vocab, tp), bias=False)
        if d.num_mtp:
            self.mtp = QwenMTP(d, self.layer_registry.draft_layers()[0], self.gdn_cls, self.mtp_expert_style, self)
        self.to(getattr(torch, d.dtype))

    @property
    def backbone(self) -> QwenBackbone:
        return self.model.language_model if self.dims.prefix == VL_PREFIX else self.model

    @property
    def draft(self):
        """The MTP draft module (forward(input_ids, positions, hidden, logits_index)), or None."""
        return self.mtp if self.dims.num_mtp else None

    def set_ops(self, ops) -> "QwenHybridLM":
        super().set_ops(ops)
        if self.dims.num_mtp:
            self.mtp.ops = ops
        return self

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, D] (after the final norm): what the MTP draft consumes."""
        bb = self.backbone
        x = bb.embed_tokens(input_ids)
        for layer in bb.layers:
            x = layer(x, positions, self.ops)
        return bb.norm(x)

    def compute_logits(self, hidden: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        h = hidden[logits_index]  # [R,D]
        return self.lm_head(h) if self.lm_head is not None else F.linear(h, self.backbone.embed_tokens.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(self.forward_hidden(input_ids, positions), logits_index)


class Qwen3NextForCausalLM(QwenHybridLM):
    family = "qwen3_next"


# ---------------------------------------------------------------------------------------------
# Weights and configs
# ---------------------------------------------------------------------------------------------

def init_qwen_weights(model: QwenHybridLM, seed: int) -> None:
    """N(0, 0.02) matrices, identity norms; GDN decays as transformers initialises them
    (A = U(0.01, 16), dt_bias = 1) and conv taps U(-1/sqrt(K), 1/sqrt(K)) like PyTorch's Conv1d."""
    init_weights_(model, seed, std=0.02)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GatedDeltaNetBase):
                m.A_log.copy_(torch.empty(m.v_heads).uniform_(0.01, 16, generator=g).log())
                m.dt_bias.fill_(1.0)
                bound = 1.0 / math.sqrt(m.conv1d.weight.shape[-1])
                m.conv1d.weight.copy_(torch.empty(m.conv1d.weight.shape).uniform_(-bound, bound, generator=g))


def _text_config(config: dict) -> dict:
    if config.get("model_type") != "qwen3_next":
        raise CheckpointError(f"config.json: field 'model_type': {config.get('model_type')!r} is not 'qwen3_next'")
    parse_dims(config, "next")  # validate now; registry() and build() parse again (cheap, pure)
    return dict(config)


_SIZES = {
    # tiny: 3 GDN + 1 full layer; layer 1 dense via mlp_only_layers, so both MLP paths run.
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                 intermediate_size=128, vocab_size=256, mlp_only_layers=[1], dtype="float32"),
    "small": dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                  num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                  intermediate_size=256, vocab_size=512, mlp_only_layers=[], dtype="float32"),
    # bench: the real per-layer dimensions of Qwen3-Next-80B-A3B with fewer layers and experts (~1.7B).
    "bench": dict(hidden_size=2048, num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                  linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                  linear_value_head_dim=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512, intermediate_size=5120, vocab_size=151936,
                  mlp_only_layers=[], dtype="bfloat16"),
}


def make_config(size: str) -> dict:
    """A complete Qwen3-Next config.json (transformers-loadable) with one MTP layer."""
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r} (sizes: {', '.join(_SIZES)})")
    return {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "full_attention_interval": 4, "decoder_sparse_step": 1, "norm_topk_prob": True,
        "linear_conv_kernel_dim": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000000, "partial_rotary_factor": 0.25, "max_position_embeddings": 262144,
        "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
        "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
        **_SIZES[size],
    }


def unread_tensor_prefixes(cfg: dict, registry) -> tuple[str, ...]:
    """Published checkpoints carry `mtp.*` even when config.json enables no draft, and the VL
    releases carry a vision tower: both are left unread, never an "unexpected tensor" error."""
    prefixes = () if registry(cfg).draft_layers() else ("mtp.",)
    return prefixes + (("model.visual.",) if cfg.get(TENSOR_PREFIX_KEY) == VL_PREFIX else ())


FAMILY = Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    text_config=_text_config,
    registry=lambda cfg: qwen_registry(parse_dims(cfg, "next"), Qwen3NextGDN.__name__),
    build=Qwen3NextForCausalLM,
    make_config=make_config,
    init_weights=init_qwen_weights,
    transformers_loadable=True,
    unread_tensors=lambda cfg: unread_tensor_prefixes(cfg, FAMILY.registry),
)
