"""Bailing linear family: inclusionAI Ling 2.5 / 2.6 and Ring-linear (Lightning + MLA or GQA, MoE, MTP).

What it owns:

- `text_config(config)`: validates a `config.json` of `model_type` "bailing_moe_linear"
  (Ring-mini / Ring-flash-linear-2.0: GQA full layers) or "bailing_hybrid" (Ling-2.5 / 2.6 and
  Ring-2.5 as published by inclusionAI: MLA full layers), fills the defaults of inclusionAI's
  `BailingMoeV2_5Config`, and raises `CheckpointError` naming config.json and the field.
- `registry(cfg)`: the LayerRegistry. Main layer i is full attention where
  (i + 1) % layer_group_size == 0, Lightning elsewhere; the NextN / MTP layers follow with ids
  N, N+1, ... (draft=True, always full attention of the family's kind). The config is never
  changed to describe them.
- `build(cfg)`: `BailingLinearForCausalLM`, whose state-dict names are the checkpoint's
  (`model.word_embeddings`, `model.layers.{i}.attention.*`, `model.layers.{i}.mlp.*`,
  `model.layers.{N}.{enorm,hnorm,eh_proj,final_layernorm,...}`, `model.norm`, `lm_head`).
- `make_config(size)`, `init_weights(model, seed)` and the `FAMILY` record.

A step through one layer (flattened tokens, x [T, D]):

1. Lightning layer: fused `query_key_value` -> q, k, v [T, H, Dh] (silu first if `linear_silu`),
   qk RMSNorm, NeoX rotary on the first head_dim * partial_rotary_factor channels of q and k,
   then the `lightning_core` op (S = exp(decay) S + k v^T, out = Dh^-0.5 q^T S), then the group
   RMSNorm `g_norm`, the sigmoid gate `g_proj` and `dense`. The per-head log-decay is not in the
   checkpoint: it is computed in the graph from the head count and the layer index (see
   `lightning_log_decay`).
2. MLA layer (bailing_hybrid): q through q_a_proj / q_a_layernorm / q_b_proj, c_kv and k_rope
   through kv_a_proj_with_mqa; the `mla_attention` op runs absorbed (q_nope times kv_b_proj's
   W_UK gives q_latent, the op's latent output times W_UV gives v), then `dense`.
3. GQA layer (bailing_moe_linear): fused `query_key_value` (H + 2 Hkv heads), qk RMSNorm,
   partial NeoX rotary, the `gqa_attention` op, `dense`.
4. MLP: a SwiGLU on the first `first_k_dense_replace` layers; elsewhere one `moe` op: sigmoid
   router with `expert_bias` for selection, group-limited top-k, weights renormalised and scaled
   by routed_scaling_factor, plus the shared experts (ungated) inside the same op.
5. Draft (`BailingLinearForCausalLM.draft`, MTP layer N): enorm(embed(next ids)) and
   hnorm(main hidden) are joined by eh_proj, run through one full-attention decoder layer and
   final_layernorm; the main model's lm_head gives its logits. The main hidden it takes is
   `forward_hidden(input_ids, positions)` (after the final norm, as in the reference's training
   path); `forward` is `compute_logits(forward_hidden(...), logits_index)`.

Tensor parallelism (`build(cfg, tp)`): `rank_config` divides the heads (GQA's KV heads replicated
below one per rank), g_norm's groups and the MLP / expert widths. The Lightning decay of a head
depends on its index among all heads, so a rank model cannot compute its heads' decays from its
own shapes: it holds them as a buffer (`log_decay`, a slice of `computed_tensors()`, which the
artifact stores), where the whole model computes them in the graph.

What it does not do: hold any cache or state (the runtime does, by layer id), serve
rope_scaling (YaRN) or tied embeddings (refused at config time), or load transformers' own
`bailing_hybrid` (Ling 3.0, KDA + MLA), which is a different architecture under the same
model_type and is refused.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, TensorSpec, split_count
from models.common import (CheckpointError, FusedLinear, HybridLM, MoEBlock, RMSNorm, SwiGLU, apply_rotary,
                           init_weights_, lm_head_rows)
from models.families import Family

__all__ = [
    "FAMILY", "MODEL_TYPES", "BailingLinearForCausalLM", "BailingMTPDraft", "text_config", "registry",
    "build", "make_config", "init_weights", "lightning_log_decay", "alibi_slopes", "main_layer_kinds",
    "rank_config",
]

MODEL_TYPES = ("bailing_moe_linear", "bailing_hybrid")
_SOURCE = "config.json"

# Defaults of inclusionAI's BailingMoeV2_5Config (Ring-V2.5 models/configuration_bailing_moe_v2_5.py),
# used where a config.json omits a field: real configs are written by that class, so an absent
# field means its default. Structural fields (sizes, counts) are required instead (_REQUIRED).
_DEFAULTS = {
    "hidden_act": "silu",
    "use_qkv_bias": False,
    "use_bias": False,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 600000.0,
    "rope_scaling": None,
    "partial_rotary_factor": 0.5,
    "rope_interleave": True,
    "num_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "moe_intermediate_size": 512,
    "first_k_dense_replace": 1,
    "use_qk_norm": True,
    "num_nextn_predict_layers": 0,
    "moe_router_enable_expert_bias": True,
    "routed_scaling_factor": 1.0,
    "group_norm_size": 4,
    "linear_silu": False,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "score_function": "sigmoid",
}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "layer_group_size", "num_experts", "num_experts_per_tok")
# Fields only Ling 3.0's KDA + MLA model (transformers' `bailing_hybrid`) writes.
_KDA_MARKERS = ("short_conv_kernel_size", "kda_safe_gate", "kda_lower_bound", "linear_attn_config")


# -- config ----------------------------------------------------------------------------------------


def _err(field: str, msg: str) -> CheckpointError:
    return CheckpointError(f"{_SOURCE}: field {field!r} {msg}")


def _int(cfg: dict, field: str, lo: int) -> int:
    value = cfg.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _err(field, f"must be an integer >= {lo} (got {value!r})")
    return value


def attention_kind(cfg: dict) -> LayerKind:
    """The full-attention kind of a Bailing config: MLA for Ling 2.5 / 2.6, GQA for Ring-linear 2.0."""
    return LayerKind.FULL_MLA if cfg["model_type"] == "bailing_hybrid" else LayerKind.FULL_GQA


def _dtype_name(cfg: dict) -> str:
    # Same rule as models/loader.config_dtype, so KV entries match the model's own dtype.
    name = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise _err("torch_dtype", f"names no torch dtype ({name!r})")
    return name


def text_config(config: dict) -> dict:
    """config.json -> a validated copy with every field the family reads filled in."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{_SOURCE}: expected a JSON object")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise _err("model_type", f"is {model_type!r}; the bailing_linear family serves {', '.join(MODEL_TYPES)}")
    markers = [k for k in _KDA_MARKERS if k in config]
    if markers:
        raise _err(markers[0], "belongs to Ling 3.0 (KDA + MLA, transformers' bailing_hybrid), which is not the "
                   "Lightning-based bailing_linear family; no hgc family serves it yet")
    cfg = dict(config)
    for key, value in _DEFAULTS.items():
        cfg.setdefault(key, value)
    # transformers 5 style: rope settings may live in rope_parameters.
    rope_params = cfg.get("rope_parameters") or {}
    if isinstance(rope_params, dict):
        if "rope_theta" in rope_params and "rope_theta" not in config:
            cfg["rope_theta"] = rope_params["rope_theta"]
        if "partial_rotary_factor" in rope_params and "partial_rotary_factor" not in config:
            cfg["partial_rotary_factor"] = rope_params["partial_rotary_factor"]
        if rope_params.get("rope_type", "default") != "default":
            raise _err("rope_parameters", f"has rope_type {rope_params.get('rope_type')!r}; only plain RoPE is served")
    for field in _REQUIRED:
        if field not in config:
            raise CheckpointError(f"{_SOURCE}: missing field {field!r}")
    if cfg.get("head_dim") is None:
        cfg["head_dim"] = cfg["hidden_size"] // max(int(cfg["num_attention_heads"]), 1)
    _validate(cfg)
    return cfg


def _validate(cfg: dict) -> None:
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        _int(cfg, field, 1)
    N, H, Dh = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"]

    G = cfg.get("layer_group_size")
    if isinstance(G, bool) or not isinstance(G, int) or G < 1:
        raise _err("layer_group_size", f"must be an integer >= 1 (got {G!r})")
    if N % G:
        # inclusionAI's modeling code makes the trailing N % G layers full attention, vLLM makes them
        # linear: no published model has such a tail, and we refuse to guess which one trained it.
        raise _err("layer_group_size", f"({G}) must divide num_hidden_layers ({N}): every group of "
                   f"layer_group_size layers ends with its full-attention layer")
    _int(cfg, "num_nextn_predict_layers", 0)
    k_dense = _int(cfg, "first_k_dense_replace", 0)
    if k_dense > N:
        raise _err("first_k_dense_replace", f"({k_dense}) exceeds num_hidden_layers ({N})")
    if "layer_types" in cfg and cfg["layer_types"] is not None:
        derived = ["full_attention" if k != "linear" else "linear_attention" for k in main_layer_kinds(cfg)]
        if list(cfg["layer_types"]) != derived:
            raise _err("layer_types", "disagrees with layer_group_size (full attention where (i+1) % "
                       f"layer_group_size == 0): expected {derived}")

    if cfg["hidden_act"] != "silu":
        raise _err("hidden_act", f"is {cfg['hidden_act']!r}; Bailing MLPs are SwiGLU ('silu')")
    if cfg["rope_scaling"] is not None:
        raise _err("rope_scaling", "is set; only plain RoPE is served (rope_scaling must be null)")
    if cfg["tie_word_embeddings"]:
        raise _err("tie_word_embeddings", "is true; Bailing checkpoints store lm_head separately")
    prf = cfg["partial_rotary_factor"]
    rot = int(Dh * prf) if isinstance(prf, (int, float)) and not isinstance(prf, bool) else -1
    if not 0 < rot <= Dh or rot % 2:
        raise _err("partial_rotary_factor", f"({prf!r}) with head_dim {Dh} must give an even rotary dimension in "
                   f"(0, head_dim]")
    gn = _int(cfg, "group_norm_size", 1)
    if (H * Dh) % gn:
        raise _err("group_norm_size", f"({gn}) must divide num_attention_heads * head_dim ({H * Dh})")
    if not isinstance(cfg["rms_norm_eps"], (int, float)) or cfg["rms_norm_eps"] <= 0:
        raise _err("rms_norm_eps", f"must be a positive number (got {cfg['rms_norm_eps']!r})")

    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    if k > E:
        raise _err("num_experts_per_tok", f"({k}) exceeds num_experts ({E})")
    groups = cfg.get("n_group") or 1
    topk_groups = cfg.get("topk_group") or 1
    for field, value in (("n_group", groups), ("topk_group", topk_groups)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _err(field, f"must be an integer >= 1 or null (got {value!r})")
    if E % groups:
        raise _err("n_group", f"({groups}) must divide num_experts ({E})")
    if groups > 1 and E // groups < 2:
        raise _err("n_group", f"({groups}) leaves fewer than 2 experts per group; a group is scored by its two best")
    if topk_groups > groups:
        raise _err("topk_group", f"({topk_groups}) exceeds n_group ({groups})")
    if groups > 1 and k > topk_groups * (E // groups):
        raise _err("num_experts_per_tok", f"({k}) exceeds the experts of the {topk_groups} groups kept")
    if cfg["score_function"] not in ("sigmoid", "softmax"):
        raise _err("score_function", f"is {cfg['score_function']!r}; expected 'sigmoid' or 'softmax'")
    if cfg["num_shared_experts"] is not None:
        _int(cfg, "num_shared_experts", 0)
    if cfg.get("moe_shared_expert_intermediate_size") is not None:
        _int(cfg, "moe_shared_expert_intermediate_size", 1)

    if attention_kind(cfg) == LayerKind.FULL_MLA:
        for field in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            _int(cfg, field, 1)
        if cfg["q_lora_rank"] is not None:
            _int(cfg, "q_lora_rank", 1)
        if not cfg["rope_interleave"]:
            raise _err("rope_interleave", "is false; Bailing MLA layers rotate interleaved pairs (the reference "
                       "modeling code has no other path)")
        if cfg["qk_rope_head_dim"] != rot:
            # The reference code builds the MLA rotary table from head_dim * partial_rotary_factor, so the two
            # must agree for its weights to mean what they say.
            raise _err("qk_rope_head_dim", f"({cfg['qk_rope_head_dim']}) must equal head_dim * "
                       f"partial_rotary_factor ({rot}), the rotary width the MLA layers are built with")
    else:
        Hkv = _int(cfg, "num_key_value_heads", 1)
        if H % Hkv:
            raise _err("num_key_value_heads", f"({Hkv}) must divide num_attention_heads ({H})")
    _dtype_name(cfg)


def main_layer_kinds(cfg: dict) -> list[str]:
    """'linear' or 'full' for each main layer: full attention closes every group of layer_group_size."""
    G = cfg["layer_group_size"]
    return ["full" if (i + 1) % G == 0 else "linear" for i in range(cfg["num_hidden_layers"])]


def _shared_inter(cfg: dict) -> int:
    """Width of the shared-expert MLP (0: none). Ring-2.0 configs name it, Ling-2.5 configs do not."""
    n = cfg["num_shared_experts"] or 0
    return n * (cfg.get("moe_shared_expert_intermediate_size") or cfg["moe_intermediate_size"])


# -- the decay -------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int, device=None) -> torch.Tensor:
    """The positive ALiBi slopes of Lightning Attention, [H] float32, built with tensor ops.

    For H a power of two, head h has slope 2^(-8 (h+1) / H). Otherwise the first c = 2^floor(log2 H)
    heads take the slopes of c heads and the rest take every other slope of 2c heads, which is
    2^(-8 (j + 1/2) / c) for j = h - c. Computed in float64 and rounded once, it equals the
    reference's Python-float list turned into a float32 tensor bit for bit (checked for H <= 256).
    Tensor ops (not a stored tensor) so the graph carries it: nothing to load, nothing to cast.
    """
    c = 2 ** int(math.floor(math.log2(num_heads)))
    h = torch.arange(num_heads, dtype=torch.float64, device=device)
    exponent = torch.where(h < c, (h + 1) * (8.0 / c), (h - c + 0.5) * (8.0 / c))
    return torch.exp2(-exponent).to(torch.float32)


def lightning_log_decay(num_heads: int, layer_idx: int, num_layers: int, device=None) -> torch.Tensor:
    """Per-head log-decay [H] (<= 0) of Lightning layer `layer_idx` (0-based, main-layer numbering).

    decay = -slopes * (1 - (layer_idx - 1) / (num_layers - 1) + 1e-5): the variant of inclusionAI's
    released modeling code (BailingMoeV2_5LinearAttention and BailingMoeV2LinearAttention), which
    the checkpoints were published with. Its `layer_idx - 1` makes layer 0 decay slightly faster
    than layer 1; MiniMax, vLLM and SGLang use `layer_idx` instead. See tests/models/test_bailing_linear.py.
    """
    if num_layers < 2:
        # Unreachable from a valid config: with one layer, that layer closes its group and is full.
        raise ValueError("a Lightning layer needs num_hidden_layers >= 2")
    factor = 1 - (layer_idx - 1) / (num_layers - 1) + 1e-5
    # float32 slopes times a Python float, negated: the reference's own arithmetic, so equal bits.
    return -alibi_slopes(num_heads, device) * factor


def rank_config(cfg: dict, tp: int) -> dict:
    """The config of one rank of `tp`: heads, g_norm groups and MLP / expert widths divided (the
    error names the first layer a count does not divide in); everything else as it is."""
    if tp == 1:
        return cfg
    kinds = main_layer_kinds(cfg)
    full_kind = attention_kind(cfg).value
    linear = f"layer {kinds.index('linear')} (lightning)" if "linear" in kinds else "no layer"
    full = f"layer {kinds.index('full')} ({full_kind})" if "full" in kinds else f"layer {len(kinds)} (draft)"
    k_dense = cfg["first_k_dense_replace"]
    moe = f"layer {k_dense} (moe MLP)"
    heads = split_count(cfg["num_attention_heads"], tp, "attention heads", linear if "linear" in kinds else full)
    out = dict(cfg, num_attention_heads=heads,
               group_norm_size=split_count(cfg["group_norm_size"], tp, "g_norm groups", linear),
               moe_intermediate_size=split_count(cfg["moe_intermediate_size"], tp, "expert intermediate channels", moe),
               intermediate_size=split_count(cfg["intermediate_size"], tp, "dense MLP intermediate channels",
                                             "layer 0 (dense MLP)" if k_dense else "no layer"))
    if attention_kind(cfg) == LayerKind.FULL_GQA:
        out["num_key_value_heads"] = split_count(cfg["num_key_value_heads"], tp, "KV heads", full, replicate=True)
    else:
        out["num_key_value_heads"] = heads  # MLA: one latent expanded to every head, kept equal as configs write it
    if cfg.get("moe_shared_expert_intermediate_size") is not None:
        out["moe_shared_expert_intermediate_size"] = split_count(
            cfg["moe_shared_expert_intermediate_size"], tp, "shared-expert intermediate channels", moe)
    return out


# -- registry --------------------------------------------------------------------------------------


def registry(cfg: dict) -> LayerRegistry:
    cfg = text_config(cfg)
    N, H, Dh = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["head_dim"]
    dtype = _dtype_name(cfg)
    full = attention_kind(cfg)
    if full == LayerKind.FULL_MLA:
        full_kv = {"latent": TensorSpec((cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],), dtype)}
        full_module = BailingMLA.__name__
    else:
        Hkv = cfg["num_key_value_heads"]
        full_kv = {"k": TensorSpec((Hkv, Dh), dtype), "v": TensorSpec((Hkv, Dh), dtype)}
        full_module = BailingGQA.__name__
    layers = []
    for i, kind in enumerate(main_layer_kinds(cfg)):
        mlp = "dense" if i < cfg["first_k_dense_replace"] else "moe"
        if kind == "full":
            layers.append(LayerSpec(i, full, kv=dict(full_kv), mlp=mlp, module=full_module))
        else:
            layers.append(LayerSpec(i, LayerKind.LIGHTNING, state={"recurrent": TensorSpec((H, Dh, Dh), "float32")},
                                    mlp=mlp, module=BailingLightning.__name__))
    for j in range(cfg["num_nextn_predict_layers"]):
        layers.append(LayerSpec(N + j, full, draft=True, kv=dict(full_kv), mlp="moe", module=BailingMTPLayer.__name__))
    return LayerRegistry(layers)


# -- modules ---------------------------------------------------------------------------------------


class GroupRMSNorm(nn.Module):
    """RMSNorm over `groups` equal slices of the last dimension, one weight per channel (`g_norm`)."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, shape = x.dtype, x.shape
        x = x.float().unflatten(-1, (self.groups, shape[-1] // self.groups))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.flatten(-2) * self.weight.float()).to(dtype)


class BailingLightning(nn.Module):
    """Lightning (simple GLA) attention of a linear layer; names under `attention.` in the checkpoint."""

    def __init__(self, cfg: dict, layer_id: int, tp: int = 1):
        super().__init__()
        self.layer_id = layer_id
        self.num_layers = cfg["num_hidden_layers"]
        self.H, self.Dh = cfg["num_attention_heads"], cfg["head_dim"]
        self.tp = tp
        if tp > 1:  # this rank's heads' decays: a slice of `whole_log_decay()` (see the module docstring)
            self.register_buffer("log_decay", torch.empty(self.H, dtype=torch.float32))
        self.rotary_dim = int(self.Dh * cfg["partial_rotary_factor"])
        self.theta = float(cfg["rope_theta"])
        self.silu = bool(cfg["linear_silu"])
        hidden, inner, eps = cfg["hidden_size"], self.H * self.Dh, cfg["rms_norm_eps"]
        # Linear layers are multi-head: k and v have as many heads as q (3 H Dh rows); the output
        # gate's projection of x runs in the same GEMM.
        self.in_proj = FusedLinear(hidden, {"query_key_value": 3 * inner, "g_proj": inner},
                                   bias=("query_key_value",) if cfg["use_qkv_bias"] else False)
        if cfg["use_qk_norm"]:
            self.query_layernorm = RMSNorm(self.Dh, eps)
            self.key_layernorm = RMSNorm(self.Dh, eps)
        else:
            self.query_layernorm = self.key_layernorm = None
        self.g_norm = GroupRMSNorm(inner, cfg["group_norm_size"], eps)
        self.dense = nn.Linear(inner, hidden, bias=cfg["use_bias"])

    def forward(self, x, positions, ops):
        T = x.shape[0]
        qkv, g = self.in_proj(x)
        if self.silu:
            qkv = F.silu(qkv)
        q, k, v = qkv.view(T, 3 * self.H, self.Dh).split(self.H, dim=1)  # [T, H, Dh] each
        if self.query_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q = apply_rotary(q, positions, self.rotary_dim, self.theta)
        k = apply_rotary(k, positions, self.rotary_dim, self.theta)
        if self.tp > 1:
            decay = self.log_decay.float()  # [H] of this rank's heads
        else:
            decay = lightning_log_decay(self.H, self.layer_id, self.num_layers, device=x.device)  # [H]
        out = v.new_empty(T, self.H, self.Dh)
        ops.lightning_core(q, k, v.contiguous(), decay, out, self.layer_id, self.Dh ** -0.5)
        o = self.g_norm(out.view(T, self.H * self.Dh))
        return self.dense(o * torch.sigmoid(g))

    def whole_log_decay(self) -> torch.Tensor:
        """The decays of all heads of the layer (every rank's), float32 on the CPU."""
        return lightning_log_decay(self.H * self.tp, self.layer_id, self.num_layers)

    def fused_segments(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """query_key_value's rows are q | k | v, H heads each."""
        inner = self.H * self.Dh
        layout = (0, (inner, inner, inner))
        return {"query_key_value.weight": layout,
                **({"query_key_value.bias": layout} if self.in_proj.biased else {})}


class BailingMLA(nn.Module):
    """Multi-head latent attention (Ling 2.5 / 2.6 full layers), run absorbed through `mla_attention`."""

    def __init__(self, cfg: dict, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        hidden, bias = cfg["hidden_size"], cfg["use_qkv_bias"]
        self.H = cfg["num_attention_heads"]
        self.R, self.P = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        self.Dn, self.Dv = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        self.theta = float(cfg["rope_theta"])
        self.scale = (self.Dn + self.P) ** -0.5
        self.q_lora = cfg["q_lora_rank"] is not None
        # The query's projection of x (whole, or its low-rank down projection) and the latent's, as one GEMM.
        q_part = {"q_a_proj": cfg["q_lora_rank"]} if self.q_lora else {"q_proj": self.H * (self.Dn + self.P)}
        parts = {**q_part, "kv_a_proj_with_mqa": self.R + self.P}
        self.in_proj = FusedLinear(hidden, parts, bias=tuple(p for p in parts if p != "q_proj") if bias else False)
        if self.q_lora:
            # The reference builds q_a_layernorm / kv_a_layernorm without passing rms_norm_eps: 1e-6.
            self.q_a_layernorm = RMSNorm(cfg["q_lora_rank"], 1e-6)
            self.q_b_proj = nn.Linear(cfg["q_lora_rank"], self.H * (self.Dn + self.P), bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, 1e-6)
        self.kv_b_proj = nn.Linear(self.R, self.H * (self.Dn + self.Dv), bias=False)
        self.dense = nn.Linear(self.H * self.Dv, hidden, bias=bias)

    def forward(self, x, positions, ops):
        T = x.shape[0]
        q, kv_a = self.in_proj(x)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_rope = q.view(T, self.H, self.Dn + self.P).split([self.Dn, self.P], dim=-1)
        c_kv, k_rope = kv_a.split([self.R, self.P], dim=-1)
        latent = self.kv_a_layernorm(c_kv)  # [T, R]
        # Interleaved pairs (2i, 2i+1). The reference de-interleaves first, which only permutes the
        # rotated channels of q and k alike: every q_rope . k_rope is the same.
        q_rope = apply_rotary(q_rope, positions, self.P, self.theta, interleaved=True)
        k_rope = apply_rotary(k_rope.unsqueeze(1), positions, self.P, self.theta, interleaved=True).squeeze(1)
        w = self.kv_b_proj.weight.view(self.H, self.Dn + self.Dv, self.R)
        w_uk, w_uv = w[:, : self.Dn], w[:, self.Dn:]  # [H, Dn, R], [H, Dv, R]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        out = q_latent.new_empty(T, self.H, self.R)
        ops.mla_attention(q_latent, q_rope.contiguous(), latent, k_rope.contiguous(), out, self.layer_id, self.scale)
        o = torch.einsum("thr,hvr->thv", out, w_uv).reshape(T, self.H * self.Dv)
        return self.dense(o)


class BailingGQA(nn.Module):
    """Grouped-query softmax attention (Ring-linear 2.0 full layers): fused qkv, qk-norm, partial rotary."""

    def __init__(self, cfg: dict, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.H, self.Hkv, self.Dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.rotary_dim = int(self.Dh * cfg["partial_rotary_factor"])
        self.theta = float(cfg["rope_theta"])
        hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.query_key_value = nn.Linear(hidden, (self.H + 2 * self.Hkv) * self.Dh, bias=cfg["use_qkv_bias"])
        if cfg["use_qk_norm"]:
            self.query_layernorm = RMSNorm(self.Dh, eps)
            self.key_layernorm = RMSNorm(self.Dh, eps)
        else:
            self.query_layernorm = self.key_layernorm = None
        self.dense = nn.Linear(self.H * self.Dh, hidden, bias=cfg["use_bias"])

    def fused_segments(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """query_key_value's rows are H query heads | Hkv key heads | Hkv value heads."""
        layout = (0, (self.H * self.Dh, self.Hkv * self.Dh, self.Hkv * self.Dh))
        return {"query_key_value.weight": layout,
                **({"query_key_value.bias": layout} if self.query_key_value.bias is not None else {})}

    def forward(self, x, positions, ops):
        T = x.shape[0]
        qkv = self.query_key_value(x).view(T, self.H + 2 * self.Hkv, self.Dh)
        q, k, v = qkv.split([self.H, self.Hkv, self.Hkv], dim=1)
        if self.query_layernorm is not None:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q = apply_rotary(q, positions, self.rotary_dim, self.theta)
        k = apply_rotary(k, positions, self.rotary_dim, self.theta)
        out = q.new_empty(T, self.H, self.Dh)
        ops.gqa_attention(q.contiguous(), k.contiguous(), v.contiguous(), out, self.layer_id, self.Dh ** -0.5)
        return self.dense(out.view(T, self.H * self.Dh))


class BailingMoE(MoEBlock):
    """Routed experts plus the shared experts (as one ungated MLP, if any): one `moe` op, `mlp.` in the checkpoint."""

    def __init__(self, cfg: dict, layer_id: int):
        top_k = cfg["num_experts_per_tok"]
        super().__init__(
            cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], layer_id, top_k=top_k,
            scoring=cfg["score_function"],
            # The reference renormalises whenever top_k > 1 (and never for top_k == 1, where the weight
            # is the raw score); norm_topk_prob, where a config has it, is true for every release.
            renormalize=top_k > 1 and bool(cfg.get("norm_topk_prob", True)),
            routed_scale=cfg["routed_scaling_factor"], num_groups=cfg.get("n_group") or 1,
            topk_groups=cfg.get("topk_group") or 1,
            router_bias="expert_bias" if cfg["moe_router_enable_expert_bias"] else None,
            expert_style="gate_up_down", shared_inter=_shared_inter(cfg), shared_name="shared_experts")


def _attention(cfg: dict, layer_id: int, kind: str, tp: int) -> nn.Module:
    if kind == "linear":
        return BailingLightning(cfg, layer_id, tp)
    return BailingMLA(cfg, layer_id) if attention_kind(cfg) == LayerKind.FULL_MLA else BailingGQA(cfg, layer_id)


class BailingDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, layer_id: int, kind: str, tp: int = 1):
        super().__init__()
        D, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.input_layernorm = RMSNorm(D, eps)
        self.attention = _attention(cfg, layer_id, kind, tp)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.mlp = SwiGLU(D, cfg["intermediate_size"]) if layer_id < cfg["first_k_dense_replace"] \
            else BailingMoE(cfg, layer_id)

    def forward(self, x, positions, ops):
        x = x + self.attention(self.input_layernorm(x), positions, ops)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, ops) if isinstance(self.mlp, MoEBlock) else self.mlp(h))


class BailingMTPLayer(BailingDecoderLayer):
    """NextN / MTP layer `model.layers.{N+j}`: a full-attention MoE decoder layer behind eh_proj."""

    def __init__(self, cfg: dict, layer_id: int):
        # layer_id >= num_hidden_layers >= first_k_dense_replace: the MLP is the MoE block, as in the reference.
        super().__init__(cfg, layer_id, "full")
        D, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
        self.enorm = RMSNorm(D, eps)
        self.hnorm = RMSNorm(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.final_layernorm = RMSNorm(D, eps)

    def forward(self, embeds, hidden, positions, ops):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.final_layernorm(super().forward(x, positions, ops))


class BailingBackbone(nn.Module):
    """`model.*`: embeddings, main layers then the MTP layers (same ModuleList, as stored), final norm."""

    def __init__(self, cfg: dict, tp: int = 1):
        super().__init__()
        N = cfg["num_hidden_layers"]
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        layers = [BailingDecoderLayer(cfg, i, kind, tp) for i, kind in enumerate(main_layer_kinds(cfg))]
        layers += [BailingMTPLayer(cfg, N + j) for j in range(cfg["num_nextn_predict_layers"])]
        self.layers = nn.ModuleList(layers)
        self.num_main = N
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class BailingMTPDraft(nn.Module):
    """The draft model: MTP layer(s) sharing the main model's embedding and lm_head.

    It holds the same module objects as the main model (no copies), so one checkpoint load fills
    both; the main model keeps it as a plain attribute, so its state dict names each tensor once.
    forward(input_ids [T], positions [T], hidden [T, D], logits_index [R]) -> (logits [R, V], hidden [T, D]):
    `input_ids` are the tokens one ahead of the positions whose main-model `hidden` is given.
    `depth` picks layer N + depth when a config has more than one MTP layer.
    """

    def __init__(self, layers: list[BailingMTPLayer], word_embeddings: nn.Embedding, lm_head: nn.Linear, ops):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.word_embeddings = word_embeddings
        self.lm_head = lm_head
        self.ops = ops

    def forward(self, input_ids, positions, hidden, logits_index, depth: int = 0):
        h = self.layers[depth](self.word_embeddings(input_ids), hidden, positions, self.ops)
        return self.lm_head(h[logits_index]).float(), h


class BailingLinearForCausalLM(HybridLM):
    family = "bailing_linear"

    def __init__(self, config: dict, tp: int = 1):
        cfg = text_config(config)
        super().__init__(cfg, tp)
        cfg = text_config(rank_config(cfg, tp))
        self.model = BailingBackbone(cfg, tp)
        self.lm_head = nn.Linear(cfg["hidden_size"], lm_head_rows(cfg["vocab_size"], tp), bias=False)
        self.layer_registry = registry(cfg)
        mtp = list(self.model.layers[self.model.num_main:])
        draft = BailingMTPDraft(mtp, self.model.word_embeddings, self.lm_head, self.ops) if mtp else None
        # A plain attribute, not a submodule: its tensors are already named under model.layers.{N}.
        object.__setattr__(self, "draft", draft)

    def set_ops(self, ops) -> "BailingLinearForCausalLM":
        super().set_ops(ops)
        if self.draft is not None:
            self.draft.ops = ops
        return self

    def computed_tensors(self) -> dict[str, torch.Tensor]:
        """A rank model's Lightning decays, whole: each rank's `log_decay` buffer is its heads' slice."""
        return {f"{name}.log_decay": m.whole_log_decay() for name, m in self.named_modules()
                if isinstance(m, BailingLightning) and m.tp > 1}

    def forward_hidden(self, input_ids, positions):
        """Main-model hidden states after the final norm [T, D]: what the MTP draft consumes."""
        x = self.model.word_embeddings(input_ids)
        for layer in self.model.layers[: self.model.num_main]:
            x = layer(x, positions, self.ops)
        return self.model.norm(x)

    def compute_logits(self, hidden, logits_index):
        return self.lm_head(hidden[logits_index]).float()  # [R, V]

    def forward(self, input_ids, positions, logits_index):
        return self.compute_logits(self.forward_hidden(input_ids, positions), logits_index)


def build(cfg: dict, tp: int = 1) -> BailingLinearForCausalLM:
    return BailingLinearForCausalLM(cfg, tp)


def init_weights(model: HybridLM, seed: int) -> None:
    # Matrices N(0, 0.02), norms at one, expert_bias and any linear bias small random: the router's
    # selection bias then matters, as it does in a trained model.
    init_weights_(model, seed)


# -- sizes -----------------------------------------------------------------------------------------


def make_config(size: str, variant: str | None = None) -> dict:
    """A complete config.json. variant "mla" (Ling 2.5 / 2.6 layout) or "gqa" (Ring-linear 2.0 layout);
    by default tiny and bench are MLA, small is GQA, so every size family-wide covers both."""
    if size not in ("tiny", "small", "bench"):
        raise ValueError(f"unknown size {size!r} (sizes: tiny, small, bench)")
    variant = variant or {"tiny": "mla", "small": "gqa", "bench": "mla"}[size]
    if variant not in ("mla", "gqa"):
        raise ValueError(f"unknown variant {variant!r} (variants: mla, gqa)")
    common = {
        "hidden_act": "silu", "use_qkv_bias": False, "use_bias": False, "use_qk_norm": True,
        "tie_word_embeddings": False, "rope_scaling": None, "partial_rotary_factor": 0.5,
        "score_function": "sigmoid", "moe_router_enable_expert_bias": True, "norm_topk_prob": True,
        "first_k_dense_replace": 1, "num_shared_experts": 1, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "pad_token_id": 0, "eos_token_id": 1,
    }
    if size == "tiny":  # ~130 tokens well under a second on a CPU
        dims = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                "layer_group_size": 4, "num_attention_heads": 4, "head_dim": 16, "group_norm_size": 2,
                "num_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
                "moe_intermediate_size": 32, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
                "rope_theta": 10000.0, "torch_dtype": "float32"}
        mla = {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
               "v_head_dim": 16}
        gqa = {"num_key_value_heads": 2, "linear_silu": True}
    elif size == "small":
        dims = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8,
                "layer_group_size": 4, "num_attention_heads": 8, "head_dim": 32, "group_norm_size": 4,
                "num_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                "moe_intermediate_size": 64, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
                "rope_theta": 600000.0, "torch_dtype": "float32"}
        mla = {"q_lora_rank": 64, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
               "v_head_dim": 32}
        gqa = {"num_key_value_heads": 2, "linear_silu": False}
    else:  # bench: Ring-mini / Ling-2.6 per-layer dims (hidden 2048, 16 x 128 heads, MLA 1536/512/64),
        # fewer layers and experts: about 1.7B parameters.
        dims = {"vocab_size": 157184, "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 8,
                "layer_group_size": 4, "num_attention_heads": 16, "head_dim": 128, "group_norm_size": 4,
                "num_experts": 32, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                "moe_intermediate_size": 512, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
                "rope_theta": 6000000.0, "torch_dtype": "bfloat16"}
        mla = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128}
        gqa = {"num_key_value_heads": 4, "linear_silu": False}
    if variant == "mla":
        return {"architectures": ["BailingMoeV2_5ForCausalLM"], "model_type": "bailing_hybrid",
                "rope_interleave": True, "num_key_value_heads": dims["num_attention_heads"],
                **common, **dims, **mla}
    return {"architectures": ["BailingMoeLinearV2ForCausalLM"], "model_type": "bailing_moe_linear",
            "moe_shared_expert_intermediate_size": dims["moe_intermediate_size"], **common, **dims, **gqa}


FAMILY = Family(
    name="bailing_linear",
    model_types=MODEL_TYPES,
    text_config=text_config,
    registry=registry,
    build=build,
    make_config=make_config,
    init_weights=init_weights,
    transformers_loadable=False,
)
