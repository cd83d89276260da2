"""Qwen3.5 / Qwen3.6 (family `qwen3_5`): the Qwen3-Next architecture with flat GDN projections.

What differs from models/qwen3_next.py, which holds everything else:

1. GDN input projections are four flat matrices: `in_proj_qkv` (rows q heads | k heads | v heads,
   already the conv channel order), `in_proj_z`, `in_proj_b`, `in_proj_a`.
2. Two variants, chosen by model_type: `qwen3_5_text` is dense (SwiGLU `mlp.*` on every layer);
   `qwen3_5_moe_text` has a MoE on every layer with routed experts stored fused
   (`mlp.experts.gate_up_proj` [E,2I,D], `mlp.experts.down_proj` [E,D,I]) and top-k weights
   always renormalised. The MTP layer's experts are per-expert 2-D tensors in the real checkpoint.
3. Published checkpoints are vision-language: config.json has model_type `qwen3_5` / `qwen3_5_moe`
   and the text model in `text_config`, with tensors under `model.language_model.` (`lm_head` and
   `mtp.*` unprefixed). `text_config()` accepts those, returns the text config with the prefix
   recorded under `TENSOR_PREFIX_KEY`, and the vision tower (`model.visual.*`) is never read.
   A text-only config (`qwen3_5_text` / `qwen3_5_moe_text`) uses transformers' `model.` prefix.
4. The MTP draft is built when `mtp_num_hidden_layers` is 1 (the published configs say so).

M-RoPE (`mrope_section`) reduces to ordinary partial RoPE for text, where the temporal, height
and width positions are all the token position; hgc serves text only.
"""

from __future__ import annotations


from models.common import CheckpointError, FusedLinear
from models.families import Family
from models.qwen3_next import (TENSOR_PREFIX_KEY, VL_PREFIX, unread_tensor_prefixes, GatedDeltaNetBase, QwenDims, QwenHybridLM,
                               init_qwen_weights, parse_dims, qwen_registry)

__all__ = ["Qwen3_5GDN", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "make_config", "FAMILY"]

_TEXT_TYPES = {"qwen3_5_text": "dense", "qwen3_5_moe_text": "moe"}
_VL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


class Qwen3_5GDN(GatedDeltaNetBase):
    """Qwen3.5 GDN projections: flat in_proj_qkv / in_proj_z / in_proj_b / in_proj_a."""

    def __init__(self, d: QwenDims, layer_id: int):
        super().__init__(d, layer_id)
        self.in_proj = FusedLinear(d.hidden, {"in_proj_qkv": d.conv_channels, "in_proj_z": d.v_heads * d.v_dim,
                                              "in_proj_b": d.v_heads, "in_proj_a": d.v_heads})

    def fused_segments(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """in_proj_qkv's rows are the conv's channels, q | k | v."""
        layout = super().fused_segments()["conv1d.weight"]
        return {"conv1d.weight": layout, "in_proj_qkv.weight": layout}

    def project(self, x):
        qkv, z, b, a = self.in_proj(x)
        return qkv, z.view(-1, self.v_heads, self.v_dim), b, a


class Qwen3_5ForCausalLM(QwenHybridLM):
    family = "qwen3_5"
    variant = "dense"
    gdn_cls = Qwen3_5GDN


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    variant = "moe"
    expert_style = "fused"


def _variant(cfg: dict) -> str:
    try:
        return _TEXT_TYPES[cfg.get("model_type")]
    except KeyError:
        raise CheckpointError(f"config.json: field 'model_type': {cfg.get('model_type')!r} is not one of "
                              f"{sorted(_TEXT_TYPES) + sorted(_VL_TYPES)}") from None


def text_config(config: dict) -> dict:
    """The flat, validated text config; a VL config's `text_config` gets the `model.language_model.` prefix."""
    model_type = config.get("model_type")
    if model_type in _VL_TYPES:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"config.json: field 'text_config': a {model_type!r} config needs the text "
                                  f"model's config object here, got {type(text).__name__}")
        expected = _VL_TYPES[model_type]
        if text.get("model_type", expected) != expected:
            raise CheckpointError(f"config.json: field 'text_config.model_type': {text['model_type']!r} in a "
                                  f"{model_type!r} config; expected {expected!r}")
        flat = {**text, "model_type": expected, TENSOR_PREFIX_KEY: VL_PREFIX}
        for key in ("tie_word_embeddings", "dtype", "torch_dtype"):  # top-level values serve as defaults
            if flat.get(key) is None and config.get(key) is not None:
                flat[key] = config[key]
    else:
        flat = dict(config)
    parse_dims(flat, _variant(flat))  # validate now; registry() and build() parse again (cheap, pure)
    return flat


def registry(cfg: dict):
    return qwen_registry(parse_dims(cfg, _variant(cfg)), Qwen3_5GDN.__name__)


def build(cfg: dict, tp: int = 1) -> QwenHybridLM:
    return (Qwen3_5MoeForCausalLM if _variant(cfg) == "moe" else Qwen3_5ForCausalLM)(cfg, tp)


_COMMON = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
_SIZES = {
    # tiny: 3 GDN + 1 full layer.
    "tiny": dict(hidden_size=64, num_hidden_layers=4, vocab_size=320, intermediate_size=128, num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                 dtype="float32", **_COMMON),
    "small": dict(hidden_size=128, num_hidden_layers=8, vocab_size=512, intermediate_size=384, num_experts=16,
                  num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                  dtype="float32", **{**_COMMON, "num_attention_heads": 8, "linear_num_key_heads": 4,
                                      "linear_num_value_heads": 8, "linear_key_head_dim": 32,
                                      "linear_value_head_dim": 32}),
    # bench: Qwen3.5-35B-A3B per-layer dimensions, 12 layers, 16 experts (MoE ~2B, dense ~1.9B).
    "bench": dict(hidden_size=2048, num_hidden_layers=12, vocab_size=248320, intermediate_size=6144,
                  num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512,
                  shared_expert_intermediate_size=512, dtype="bfloat16", num_attention_heads=16,
                  num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                  linear_key_head_dim=128, linear_value_head_dim=128),
}
_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def make_config(size: str, variant: str = "moe", vl: bool = False) -> dict:
    """A complete config.json: variant "moe" (qwen3_5_moe_text) or "dense" (qwen3_5_text), one MTP layer.

    vl=True wraps it the way the published checkpoints are laid out (model_type qwen3_5[_moe] with a
    text_config; tensors under model.language_model.); the vision tower is left out.
    """
    if size not in _SIZES:
        raise ValueError(f"unknown size {size!r} (sizes: {', '.join(_SIZES)})")
    if variant not in ("moe", "dense"):
        raise ValueError(f"unknown Qwen3.5 variant {variant!r} (expected 'moe' or 'dense')")
    dims = dict(_SIZES[size])
    if variant == "moe":
        dims.pop("intermediate_size")
    else:
        for key in _MOE_KEYS:
            dims.pop(key)
    n = dims["num_hidden_layers"]
    pairs = dims["head_dim"] // 8  # partial_rotary_factor 0.25: head_dim/4 rotary channels, head_dim/8 pairs
    base, extra = divmod(pairs, 3)  # split the pairs over t/h/w as the published [11, 11, 10] does
    model_type = "qwen3_5_moe_text" if variant == "moe" else "qwen3_5_text"
    text = {
        "model_type": model_type,
        "architectures": ["Qwen3_5MoeForCausalLM" if variant == "moe" else "Qwen3_5ForCausalLM"],
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "attention_bias": False, "attn_output_gate": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True,
                            "mrope_section": [base + (extra > 0), base + (extra > 1), base]},
        "max_position_embeddings": 262144, "tie_word_embeddings": False, "initializer_range": 0.02,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "mamba_ssm_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 1,
        **dims,
    }
    if not vl:
        return text
    vl_type = "qwen3_5_moe" if variant == "moe" else "qwen3_5"
    return {"model_type": vl_type, "architectures": ["Qwen3_5MoeForConditionalGeneration" if variant == "moe"
                                                     else "Qwen3_5ForConditionalGeneration"],
            "text_config": {k: v for k, v in text.items() if k != "architectures"},
            "tie_word_embeddings": False}


FAMILY = Family(
    name="qwen3_5",
    model_types=tuple(_TEXT_TYPES) + tuple(_VL_TYPES),
    text_config=text_config,
    registry=registry,
    build=build,
    make_config=make_config,
    init_weights=init_qwen_weights,
    transformers_loadable=True,
    unread_tensors=lambda cfg: unread_tensor_prefixes(cfg, registry),
)
