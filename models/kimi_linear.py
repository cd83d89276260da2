"""Kimi-Linear (model_type "kimi_linear"): KDA linear layers, NoPE MLA full layers, MoE with a shared expert.

What this module owns:

1. `text_config(config)`: validates a Kimi-Linear config.json and returns a flat copy. Every error
   is a CheckpointError naming config.json and the field at fault.
2. `build_registry(cfg)`: the one place Kimi's layer layout is normalised. The checkpoint lists
   layers 1-based in `linear_attn_config.{kda_layers, full_attn_layers}`; the registry holds them
   0-based, one LayerSpec per layer. The model then reads each layer's kind from the registry,
   never from the config lists again.
3. `KimiLinearForCausalLM`: plain modules whose state-dict names are the real checkpoint names
   (`self_attn.q_conv1d.weight`, `self_attn.A_log`, `block_sparse_moe.experts.{e}.w1.weight`...),
   so a downloaded checkpoint loads as is, and what we write loads in transformers (whose
   conversion mapping renames/stacks these names on load).
4. `make_config(size)` / `init_weights(model, seed)` for synthetic checkpoints.

The math follows transformers' `models/kimi_linear` (the test oracle):

- KDA layer: q/k/v projections -> one depthwise causal conv over the 3*H*D concatenated channels
  with SiLU (`hgc.short_conv`) -> l2-normalised q, k (fp32, eps 1e-6 inside the sqrt) ->
  per-channel log-decay g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), beta = sigmoid(b_proj(x))
  -> `hgc.kda_core` -> gated RMSNorm with a *sigmoid* gate g_b(g_a(x)) -> o_proj.
- MLA layer: DeepSeek-style latent attention without positional encoding (`mla_use_nope`): the
  qk_rope_head_dim channels of q and the shared k_rope still exist and still take part in the
  scores, they are just never rotated. Run absorbed through `hgc.mla_attention`.
- MLP: dense SwiGLU for the first `first_k_dense_replace` layers, then one `hgc.moe` op:
  sigmoid-scored routed experts (selection bias `e_score_correction_bias`, renormalised, times
  routed_scaling_factor) plus the shared experts (ungated).

Tensor parallelism (`build(cfg, tp)`): `rank_config` divides the MLA and KDA heads and the MLP and
expert widths; the latent (kv_a_proj, its norm, the KV cache) stays whole on every rank, each rank
expanding it for its own heads.

What it does not do: MTP (Kimi-Linear has none; a config asking for it is refused), the rotary
MLA variant (`mla_use_nope: false`, which transformers does not implement either), caches.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, TensorSpec, split_count
from models.common import CheckpointError, FusedLinear, HybridLM, MoEBlock, SwiGLU, init_weights_, lm_head_rows
from models.families import SIZES, Family

__all__ = ["FAMILY", "KimiLinearForCausalLM", "text_config", "build_registry", "build", "make_config",
           "init_weights", "rank_config"]

_SOURCE = "config.json"

# Parameters kept in float32 whatever the model dtype: the checkpoint stores A_log and dt_bias
# in fp32, and transformers keeps the router (weight and bias) in fp32
# (`_keep_in_fp32_modules_strict`).
# (transformers itself rounds A_log to the model dtype: a bf16-only difference we accept, since
# the checkpoint, FLA and vLLM keep it fp32.)
_FP32_SUFFIXES = (".A_log", ".dt_bias", ".gate.weight", ".gate.e_score_correction_bias")


# -- config ------------------------------------------------------------------------------------


def _err(field: str, msg: str) -> CheckpointError:
    return CheckpointError(f"{_SOURCE}: {field}: {msg}")


def _int(cfg: dict, field: str, default=None, minimum: int = 1) -> int:
    value = cfg.get(field, default)
    if value is None:
        raise _err(field, "missing (required for kimi_linear)")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _err(field, f"expected an integer >= {minimum}, got {value!r}")
    return value


def _linear_attn(cfg: dict) -> dict:
    lac = cfg.get("linear_attn_config")
    if lac is None:
        return {}
    if not isinstance(lac, dict):
        raise _err("linear_attn_config", f"expected an object, got {type(lac).__name__}")
    return lac


def _layer_ids(lac: dict, name: str, num_layers: int) -> list[int]:
    """One of Kimi's 1-based layer lists, checked for type, duplicates and range; returned 0-based."""
    field = f"linear_attn_config.{name}"
    ids = lac.get(name)
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise _err(field, f"expected a list of 1-based layer ids, got {ids!r}")
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise _err(field, f"lists layer(s) {dup} more than once")
    bad = [i for i in ids if not 1 <= i <= num_layers]
    if bad:
        raise _err(field, f"layer(s) {bad} out of range: ids are 1-based, 1..{num_layers} "
                          f"(num_hidden_layers {num_layers})")
    return [i - 1 for i in ids]


def _layer_kinds(cfg: dict) -> list[LayerKind]:
    """The kind of each main layer, 0-based. The only place Kimi's layer lists are interpreted.

    Kimi's checkpoints number layers from 1 in `linear_attn_config.kda_layers` and
    `full_attn_layers` (transformers subtracts 1 too). A config re-saved by transformers also has
    `layer_types` (0-based, transformers gives it precedence): it must agree with the lists.
    """
    n = _int(cfg, "num_hidden_layers")
    lac = _linear_attn(cfg)
    layer_types = cfg.get("layer_types")
    if "kda_layers" in lac or "full_attn_layers" in lac:
        kda = _layer_ids(lac, "kda_layers", n)
        full = _layer_ids(lac, "full_attn_layers", n)
        both = sorted(set(kda) & set(full))
        if both:
            raise _err("linear_attn_config.full_attn_layers",
                       f"overlaps linear_attn_config.kda_layers at layer(s) {[i + 1 for i in both]} (1-based)")
        missing = sorted(set(range(n)) - set(kda) - set(full))
        if missing:
            raise _err("linear_attn_config.kda_layers",
                       f"layer(s) {[i + 1 for i in missing]} (1-based) are in neither "
                       f"linear_attn_config.kda_layers nor linear_attn_config.full_attn_layers")
        full_set = set(full)
        kinds = [LayerKind.FULL_MLA if i in full_set else LayerKind.KDA for i in range(n)]
        if layer_types is not None and _kinds_from_types(layer_types, n) != kinds:
            raise _err("layer_types", "disagrees with linear_attn_config.kda_layers / full_attn_layers")
        return kinds
    if layer_types is not None:
        return _kinds_from_types(layer_types, n)
    # transformers would fall back to an invented "every 4th layer" layout here; a real
    # checkpoint always lists its layers, so a config without them is refused.
    raise _err("linear_attn_config.kda_layers", "missing: list the KDA and full-attention layers "
                                                "(linear_attn_config.kda_layers and full_attn_layers, 1-based)")


def _kinds_from_types(layer_types, n: int) -> list[LayerKind]:
    names = {"full_attention": LayerKind.FULL_MLA, "linear_attention": LayerKind.KDA}
    if not isinstance(layer_types, list) or len(layer_types) != n or any(t not in names for t in layer_types):
        raise _err("layer_types", f"expected {n} entries of 'full_attention' / 'linear_attention', got {layer_types!r}")
    return [names[t] for t in layer_types]


def _dense_layers(cfg: dict) -> list[bool]:
    """Whether each layer has a dense MLP (else MoE): the first `first_k_dense_replace` layers."""
    n = cfg["num_hidden_layers"]
    k = _int(cfg, "first_k_dense_replace", 1, minimum=0)  # transformers' default is 1
    dense = [i < k for i in range(n)]
    mlp_types = cfg.get("mlp_layer_types")
    if mlp_types is not None and mlp_types != ["dense" if d else "sparse" for d in dense]:
        raise _err("mlp_layer_types", f"disagrees with first_k_dense_replace {k}")
    return dense


def _dtype_name(cfg: dict) -> str:
    name = cfg.get("dtype", cfg.get("torch_dtype", "bfloat16"))
    field = "dtype" if "dtype" in cfg else "torch_dtype"
    if not isinstance(name, str) or not isinstance(getattr(torch, name, None), torch.dtype):
        raise _err(field, f"not a torch dtype name: {name!r}")
    return name


def text_config(config: dict) -> dict:
    """Validate a Kimi-Linear config.json; return a flat copy with the KDA dims also under their flat
    names (linear_num_heads, linear_head_dim, linear_conv_kernel_dim). The layer layout is checked
    here and normalised in the registry; optional fields keep transformers' defaults where read."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{_SOURCE}: expected a JSON object")
    if config.get("model_type") != "kimi_linear":
        raise _err("model_type", f"expected 'kimi_linear', got {config.get('model_type')!r}")
    cfg = dict(config)
    if _int(cfg, "num_nextn_predict_layers", 0, minimum=0) > 0:
        raise _err("num_nextn_predict_layers", f"{cfg['num_nextn_predict_layers']}: MTP / NextN draft layers are "
                                               "not supported for kimi_linear (Kimi-Linear has none)")
    for field in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                  "kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size", "num_experts",
                  "num_experts_per_token"):
        _int(cfg, field)
    _int(cfg, "qk_rope_head_dim", minimum=0)
    lac = _linear_attn(cfg)
    # The checkpoint keeps the KDA dims in linear_attn_config; transformers re-saves them flat.
    for sub, flat, minimum in (("num_heads", "linear_num_heads", 1), ("head_dim", "linear_head_dim", 1),
                               ("short_conv_kernel_size", "linear_conv_kernel_dim", 2)):
        if sub in lac:
            field = f"linear_attn_config.{sub}"
            cfg[flat] = _int({field: lac[sub]}, field, minimum=minimum)
            if flat in config and config[flat] != cfg[flat]:
                raise _err(flat, f"{config[flat]!r} disagrees with {field} ({lac[sub]!r})")
        else:
            _int(cfg, flat, minimum=minimum)
    _layer_kinds(cfg)
    _dense_layers(cfg)
    _dtype_name(cfg)

    if cfg.get("mla_use_nope", True) is not True:
        # transformers' KimiLinearAttention never rotates (it has no rotary path at all), so the
        # rotary variant has no oracle here; refuse it rather than guess.
        raise _err("mla_use_nope", f"{cfg['mla_use_nope']!r}: only NoPE MLA (true) is supported")
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if kv_heads != cfg["num_attention_heads"]:
        raise _err("num_key_value_heads", f"{kv_heads}: MLA expands the latent to every head; "
                                          f"expected num_attention_heads ({cfg['num_attention_heads']})")
    if cfg.get("q_lora_rank") is not None:
        _int(cfg, "q_lora_rank")
    if cfg.get("tie_word_embeddings", False):
        raise _err("tie_word_embeddings", "true is not supported (Kimi-Linear has a separate lm_head)")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise _err("hidden_act", f"{act!r}: the KDA conv and the MLPs are SiLU / SwiGLU; expected 'silu'")

    # MoE router. transformers hard-codes sigmoid scoring and always runs the grouped top-k
    # (ignoring moe_router_activation_func, use_grouped_topk and moe_layer_freq), so the values
    # where its behaviour would differ from the field's meaning are refused.
    scoring = cfg.get("moe_router_activation_func", "sigmoid")
    if scoring != "sigmoid":
        raise _err("moe_router_activation_func", f"{scoring!r}: only 'sigmoid' is supported")
    if _int(cfg, "moe_layer_freq", 1) != 1:
        raise _err("moe_layer_freq", f"{cfg['moe_layer_freq']}: only 1 (every layer after the dense ones) is supported")
    E, k = cfg["num_experts"], cfg["num_experts_per_token"]
    groups = _int(cfg, "num_expert_group", 1)
    topk_groups = _int(cfg, "topk_group", 1)
    if groups > 1 and cfg.get("use_grouped_topk", True) is False:
        raise _err("use_grouped_topk", "false with num_expert_group > 1 is not supported "
                                       "(transformers always groups)")
    if E % groups or (groups > 1 and E // groups < 2):
        raise _err("num_expert_group", f"{groups} must divide num_experts ({E}) into groups of at least 2")
    if topk_groups > groups:
        raise _err("topk_group", f"{topk_groups} exceeds num_expert_group ({groups})")
    if k > E or k > topk_groups * (E // groups):
        raise _err("num_experts_per_token", f"{k} exceeds the experts of the {topk_groups} kept group(s)")
    _int(cfg, "num_shared_experts", 1)
    for field, default in (("rms_norm_eps", 1e-5), ("routed_scaling_factor", 2.446)):
        value = cfg.get(field, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise _err(field, f"expected a positive number, got {value!r}")
    return cfg


# -- registry ----------------------------------------------------------------------------------


def build_registry(cfg: dict) -> LayerRegistry:
    """One LayerSpec per main layer (0-based; Kimi's 1-based lists are converted in `_layer_kinds`)."""
    kinds = _layer_kinds(cfg)
    dense = _dense_layers(cfg)
    dtype = _dtype_name(cfg)
    H, D, K = cfg["linear_num_heads"], cfg["linear_head_dim"], cfg["linear_conv_kernel_dim"]
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    layers = []
    for i, kind in enumerate(kinds):
        mlp = "dense" if dense[i] else "moe"
        if kind is LayerKind.KDA:
            layers.append(LayerSpec(i, kind, mlp=mlp, module=KimiDeltaAttention.__name__, state={
                "recurrent": TensorSpec((H, D, D), "float32"),
                # q, k and v convs as one depthwise conv: channels q | k | v, last K-1 inputs.
                "conv": TensorSpec((3 * H * D, K - 1), dtype),
            }))
        else:
            layers.append(LayerSpec(i, kind, mlp=mlp, module=KimiMLAttention.__name__,
                                    kv={"latent": TensorSpec((latent,), dtype)}))
    return LayerRegistry(layers)


def rank_config(cfg: dict, tp: int) -> dict:
    """The flat config of one rank of `tp`: heads and MLP / expert widths divided (the error names
    the first layer a count does not divide in); everything else as it is."""
    if tp == 1:
        return cfg
    kinds, dense = _layer_kinds(cfg), _dense_layers(cfg)

    def first(pred, what) -> str:
        i = next((i for i in range(len(kinds)) if pred(i)), None)
        return f"layer {i} ({what})" if i is not None else "no layer"

    mla = first(lambda i: kinds[i] is LayerKind.FULL_MLA, "full_mla")
    kda = first(lambda i: kinds[i] is LayerKind.KDA, "kda")
    heads = split_count(cfg["num_attention_heads"], tp, "attention heads", mla)
    linear_heads = split_count(cfg["linear_num_heads"], tp, "KDA heads", kda)
    out = dict(cfg, num_attention_heads=heads, num_key_value_heads=heads, linear_num_heads=linear_heads,
               moe_intermediate_size=split_count(cfg["moe_intermediate_size"], tp, "expert intermediate channels",
                                                 first(lambda i: not dense[i], "moe MLP")),
               intermediate_size=split_count(cfg["intermediate_size"], tp, "dense MLP intermediate channels",
                                             first(lambda i: dense[i], "dense MLP")))
    out["linear_attn_config"] = dict(_linear_attn(cfg), num_heads=linear_heads)
    return out


# -- modules -----------------------------------------------------------------------------------


class KimiRMSNorm(nn.Module):
    """RMSNorm as transformers' KimiLinearRMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class KimiGatedRMSNorm(nn.Module):
    """o_norm: RMSNorm over each head's channels times sigmoid(gate), all in fp32 (the activation
    is sigmoid, not SiLU: transformers' KimiLinearRMSNormGated and FLA's FusedRMSNormGated agree)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (xf * torch.sigmoid(gate.float())).to(x.dtype)


class _ConvWeight(nn.Module):
    """Holds one short conv's depthwise weight [C, 1, K] under the checkpoint's `<name>.weight`."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) in fp32: FLA's in-kernel l2norm (eps inside the sqrt, unlike F.normalize)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


class KimiDeltaAttention(nn.Module):
    """A KDA layer: everything but the conv and the recurrence runs here; those two are hgc ops."""

    def __init__(self, cfg: dict, layer_id: int):
        super().__init__()
        hidden = cfg["hidden_size"]
        H, D, K = cfg["linear_num_heads"], cfg["linear_head_dim"], cfg["linear_conv_kernel_dim"]
        self.layer_id, self.num_heads, self.head_dim = layer_id, H, D
        C = H * D
        # Every projection of x in one GEMM: q | k | v (adjacent, so the conv reads them as one
        # [T, 3C] input without a concatenation), the forget gate's and output gate's low-rank (D)
        # down projections, and beta's (one per head).
        self.in_proj = FusedLinear(hidden, {"q_proj": C, "k_proj": C, "v_proj": C, "f_a_proj": D, "b_proj": H,
                                            "g_a_proj": D})
        self.q_conv1d = _ConvWeight(C, K)
        self.k_conv1d = _ConvWeight(C, K)
        self.v_conv1d = _ConvWeight(C, K)
        self.f_b_proj = nn.Linear(D, C, bias=False)
        self.A_log = nn.Parameter(torch.empty(1, 1, H, 1))  # checkpoint shape; per-head decay rate
        self.dt_bias = nn.Parameter(torch.empty(C))
        self.g_b_proj = nn.Linear(D, C, bias=False)
        self.o_norm = KimiGatedRMSNorm(D, cfg.get("rms_norm_eps", 1e-5))
        self.o_proj = nn.Linear(C, hidden, bias=False)

    def forget_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g [T,H,D] fp32: -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), from f_a(x)."""
        T = f_a.shape[0]
        g = (self.f_b_proj(f_a).float() + self.dt_bias.float()).view(T, self.num_heads, self.head_dim)
        # transformers' softplus: log(1 + exp(g)) below 20 (not log1p), identity above.
        g = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return -torch.exp(self.A_log.float().view(self.num_heads, 1)) * g

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        T, H, D = x.shape[0], self.num_heads, self.head_dim
        # One depthwise conv over q|k|v channels is exactly three separate ones (no channel mixing);
        # the three are adjacent parts of the projection, read by the conv as one [T, 3C] piece.
        mixed, f_a, b, g_a = self.in_proj(x, (3 * H * D, D, H, D))
        conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight],
                                dim=0).squeeze(1)  # [3C, K]
        conv_out = torch.empty_like(mixed)
        ops.short_conv(mixed, conv_weight, None, conv_out, self.layer_id, True)
        q, k, v = conv_out.view(T, 3, H, D).unbind(1)  # each [T, H, D]
        # q, k stay fp32 after the norm, as in transformers / FLA where the l2norm runs in fp32
        # inside the kernel.
        q, k = _l2norm(q), _l2norm(k)
        g = self.forget_gate(f_a)  # [T, H, D] fp32
        beta = torch.sigmoid(b)  # [T, H]
        core = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
        ops.kda_core(q, k, v.contiguous(), g, beta, core, self.layer_id, D ** -0.5)
        gate = self.g_b_proj(g_a).view(T, H, D)
        return self.o_proj(self.o_norm(core, gate).reshape(T, H * D))


class KimiMLAttention(nn.Module):
    """NoPE MLA, absorbed: scores against the normalised latent c (kv_a_layernorm output).

    q = [q_nope | q_pe] per head, key = [W_UK c | k_pe] (k_pe shared by all heads), value = W_UV c,
    scale (nope + rope)^-0.5. q_nope . (W_UK c) = (W_UK^T q_nope) . c, so the op gets q_latent and
    returns softmax @ c, which W_UV turns into the value. Nothing is rotated (`mla_use_nope`).
    """

    def __init__(self, cfg: dict, layer_id: int):
        super().__init__()
        hidden, H = cfg["hidden_size"], cfg["num_attention_heads"]
        self.layer_id, self.num_heads = layer_id, H
        self.nope, self.rope, self.v_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        self.rank = cfg["kv_lora_rank"]
        bias = bool(cfg.get("attention_bias", False))
        self.q_lora_rank = cfg.get("q_lora_rank")
        qk = self.nope + self.rope
        # The query's projection of x (whole, or its low-rank down projection) and the latent's, as one GEMM.
        q_part = {"q_proj": H * qk} if self.q_lora_rank is None else {"q_a_proj": self.q_lora_rank}
        parts = {**q_part, "kv_a_proj_with_mqa": self.rank + self.rope}
        self.in_proj = FusedLinear(hidden, parts, bias=tuple(p for p in parts if p != "q_proj") if bias else False)
        if self.q_lora_rank is not None:
            self.q_a_layernorm = KimiRMSNorm(self.q_lora_rank, 1e-6)  # transformers: class default eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, H * qk, bias=False)
        # eps 1e-6, not rms_norm_eps: transformers (and Kimi's release) build it without an eps.
        self.kv_a_layernorm = KimiRMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, hidden, bias=bias)
        self.scale = qk ** -0.5

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q, kv_a = self.in_proj(x)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(T, H, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_pe = kv_a.split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c)  # [T, R]
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]  # [H, nope, R], [H, v, R]
        q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)  # [T, H, R]
        out = torch.empty(T, H, self.rank, dtype=x.dtype, device=x.device)
        ops.mla_attention(q_latent, q_pe.contiguous(), c.contiguous(), k_pe.contiguous(), out,
                          self.layer_id, self.scale)
        o = torch.einsum("thr,hvr->thv", out, w_uv).reshape(T, H * self.v_dim)
        return self.o_proj(o)


class KimiSparseMoE(MoEBlock):
    """`block_sparse_moe`: routed experts plus the shared experts (as one ungated MLP): one hgc.moe op."""

    def __init__(self, cfg: dict, layer_id: int):
        super().__init__(
            cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], layer_id,
            top_k=cfg["num_experts_per_token"], scoring="sigmoid",
            renormalize=bool(cfg.get("moe_renormalize", True)),
            routed_scale=float(cfg.get("routed_scaling_factor", 2.446)),
            num_groups=cfg.get("num_expert_group", 1), topk_groups=cfg.get("topk_group", 1),
            router_bias="e_score_correction_bias", expert_style="w1_w3_w2",
            shared_inter=cfg["moe_intermediate_size"] * cfg.get("num_shared_experts", 1), shared_name="shared_experts")


class KimiDecoderLayer(nn.Module):
    def __init__(self, cfg: dict, spec: LayerSpec):
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-5)
        self.input_layernorm = KimiRMSNorm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = KimiRMSNorm(cfg["hidden_size"], eps)
        attn_cls = KimiDeltaAttention if spec.kind is LayerKind.KDA else KimiMLAttention
        self.self_attn = attn_cls(cfg, spec.layer_id)
        self.dense = spec.mlp == "dense"  # checkpoint names differ: `mlp.*` vs `block_sparse_moe.*`
        if self.dense:
            self.mlp = SwiGLU(cfg["hidden_size"], cfg["intermediate_size"])
        else:
            self.block_sparse_moe = KimiSparseMoE(cfg, spec.layer_id)

    def forward(self, h: torch.Tensor, ops) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ops)
        x = self.post_attention_layernorm(h)
        return h + (self.mlp(x) if self.dense else self.block_sparse_moe(x, ops))


class KimiLinearForCausalLM(HybridLM):
    """`forward(input_ids [T], positions [T], logits_index [R]) -> logits [R, V]`.

    `positions` is unused: MLA is NoPE and KDA needs no position; kept for the shared calling convention.
    """

    family = "kimi_linear"

    def __init__(self, cfg: dict, tp: int = 1):
        super().__init__(cfg, tp)
        cfg = rank_config(cfg, tp)
        self.layer_registry = build_registry(cfg)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.model.layers = nn.ModuleList(KimiDecoderLayer(cfg, spec) for spec in self.layer_registry.main_layers())
        self.model.norm = KimiRMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5))
        self.lm_head = nn.Linear(cfg["hidden_size"], lm_head_rows(cfg["vocab_size"], tp), bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [T, D]
        for layer in self.model.layers:
            h = layer(h, self.ops)
        return self.lm_head(self.model.norm(h[logits_index]))  # the norm is per row: only rows we need


# -- family entry points -----------------------------------------------------------------------


def build(cfg: dict, tp: int = 1) -> KimiLinearForCausalLM:
    """The model (one rank of `tp`) in the config's dtype, router / A_log / dt_bias kept fp32; weights
    uninitialised."""
    model = KimiLinearForCausalLM(cfg, tp)
    dtype = getattr(torch, _dtype_name(cfg))
    for name, p in model.named_parameters():
        if not name.endswith(_FP32_SUFFIXES):
            p.data = p.data.to(dtype)
    return model


def init_weights(model: KimiLinearForCausalLM, seed: int) -> None:
    """N(0, initializer_range) matrices, unit norms; A_log and dt_bias as FLA / transformers init them."""
    init_weights_(model, seed, std=float(model.config.get("initializer_range", 0.02)))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, KimiDeltaAttention):
                # A = exp(A_log) uniform in [1, 16]; softplus(dt_bias) log-uniform in [1e-3, 1e-1].
                a = torch.empty(module.A_log.shape).uniform_(1.0, 16.0, generator=g)
                module.A_log.copy_(a.log())
                dt = torch.empty(module.dt_bias.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g)
                dt = dt.exp().clamp_min(1e-4)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def _base_config() -> dict:
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "mla_use_nope": True,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": 1,
        "q_lora_rank": None,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_grouped_topk": True,
        "first_k_dense_replace": 1,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def _with_layout(cfg: dict, full_1based: list[int], heads: int, head_dim: int, kernel: int) -> dict:
    n = cfg["num_hidden_layers"]
    cfg["linear_attn_config"] = {
        "full_attn_layers": full_1based,
        "kda_layers": [i for i in range(1, n + 1) if i not in full_1based],
        "num_heads": heads, "head_dim": head_dim, "short_conv_kernel_size": kernel,
    }
    cfg["pad_token_id"] = cfg["vocab_size"] - 1
    return cfg


def make_config(size: str) -> dict:
    """A complete config.json. tiny: CPU tests; small: a few times bigger; bench: real per-layer
    dims (hidden 2304, KDA 32x128, MLA 32 heads 128+64 / 128, kv rank 512, experts 1024 wide) with
    8 layers (MLA at 0-based 3, 7) and 16 experts instead of 27 and 256: about 1.96B parameters."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (sizes: {', '.join(SIZES)})")
    cfg = _base_config()
    if size == "tiny":
        # MLA in the middle (0-based 2) so KDA layers read its output; two expert groups so the
        # grouped top-k path is exercised too. initializer_range ~ 1/sqrt(hidden): with 0.02 the
        # MLA scores of a 64-wide model are nearly uniform and a wrong scale hides under 1e-4.
        cfg.update(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   initializer_range=0.1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_experts=8, num_experts_per_token=2,
                   moe_intermediate_size=32, num_expert_group=2, topk_group=1, model_max_length=4096,
                   dtype="float32")
        return _with_layout(cfg, [3], heads=2, head_dim=16, kernel=4)
    if size == "small":
        cfg.update(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                   initializer_range=0.06, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=16, num_experts_per_token=4,
                   moe_intermediate_size=64, num_expert_group=1, topk_group=1, model_max_length=8192,
                   dtype="float32")
        return _with_layout(cfg, [4, 8], heads=4, head_dim=32, kernel=4)
    cfg.update(vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=8,
               num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, num_experts=16, num_experts_per_token=8,
               moe_intermediate_size=1024, num_expert_group=1, topk_group=1, model_max_length=1048576,
               dtype="bfloat16", bos_token_id=163584, eos_token_id=163586)
    cfg = _with_layout(cfg, [4, 8], heads=32, head_dim=128, kernel=4)
    cfg["pad_token_id"] = 163839
    return cfg


FAMILY = Family(
    name="kimi_linear",
    model_types=("kimi_linear",),
    text_config=text_config,
    registry=build_registry,
    build=build,
    make_config=make_config,
    init_weights=init_weights,
    transformers_loadable=True,
)
