"""Qwen3.5 family (dense and MoE, text and VL layouts): transformers equivalence, MTP draft,
registry goldens for Qwen3.6-27B and Qwen3.5-35B-A3B, config errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from compiler.splitops import LayerKind, TensorSpec
from models.checkpoint import CheckpointReader
from models.common import CheckpointError
from models.families import family_for_config, get_family
from models.qwen3_5 import make_config
from testkit.helpers import eager_logits
from tests.models.test_qwen3_next import (CONFIGS, assert_no_module_built, check_draft, check_equivalence, meta_shapes,
                                   write_tiny)

transformers = pytest.importorskip("transformers")

VOCAB = make_config("tiny")["vocab_size"]


@pytest.fixture(scope="module")
def tiny_ckpts(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("qwen3_5")
    return {(variant, vl): write_tiny(root / f"{variant}{'_vl' if vl else ''}", "qwen3_5",
                                      make_config("tiny", variant, vl))
            for variant in ("dense", "moe") for vl in (False, True)}


# -- equivalence with transformers ---------------------------------------------------------------

@pytest.mark.parametrize("variant", ["dense", "moe"])
@pytest.mark.parametrize("vl", [False, True], ids=["text", "vl"])
def test_tiny_matches_transformers(tiny_ckpts, variant, vl):
    check_equivalence(tiny_ckpts[variant, vl], VOCAB)


def test_tied_embeddings_match_transformers(tmp_path):
    """tie_word_embeddings: no lm_head tensor; logits use embed_tokens (as the small Qwen3.5 models do)."""
    ckpt = write_tiny(tmp_path / "tied", "qwen3_5", {**make_config("tiny", "dense"), "tie_word_embeddings": True})
    assert "lm_head.weight" not in CheckpointReader(ckpt).names()
    check_equivalence(ckpt, VOCAB)


def test_tiny_checkpoint_layouts(tiny_ckpts):
    moe = CheckpointReader(tiny_ckpts["moe", False]).names()
    assert {"model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_z.weight",
            "model.layers.0.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.in_proj_a.weight"} <= moe
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= moe  # fused
    assert "mtp.layers.0.mlp.experts.7.gate_proj.weight" in moe  # the MTP layer's experts are per expert
    vl = CheckpointReader(tiny_ckpts["moe", True]).names()
    assert {n.replace("model.language_model.", "model.") for n in vl} == moe
    assert "lm_head.weight" in vl and "mtp.fc.weight" in vl
    dense = CheckpointReader(tiny_ckpts["dense", False]).names()
    assert "model.layers.0.mlp.down_proj.weight" in dense and "mtp.layers.0.mlp.gate_proj.weight" in dense


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_draft_matches_transformers_layer(tiny_ckpts, variant):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
    layer_cls = Qwen3_5MoeDecoderLayer if variant == "moe" else Qwen3_5DecoderLayer
    check_draft(tiny_ckpts[variant, False], layer_cls, 3, VOCAB)


def test_small_runs():
    fam = get_family("qwen3_5")
    for variant in ("dense", "moe"):
        model = fam.build(fam.text_config(make_config("small", variant)))
        fam.init_weights(model, 0)
        logits = eager_logits(model, list(range(20)), [3, 4])
        assert logits.shape == (22, 512) and torch.isfinite(logits).all()


# -- registry goldens ----------------------------------------------------------------------------

def published(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


@pytest.mark.parametrize("name, n, v_heads, conv, kv_heads, mlp", [
    ("qwen3_6_27b.json", 64, 48, 10240, 4, "dense"),
    ("qwen3_5_35b_a3b.json", 40, 32, 8192, 2, "moe"),
])
def test_registry_published(monkeypatch, name, n, v_heads, conv, kv_heads, mlp):
    config = published(name)
    fam = family_for_config(config)
    assert fam.name == "qwen3_5"
    reg = assert_no_module_built(monkeypatch, lambda: fam.registry(fam.text_config(config)))
    layer_types = config["text_config"]["layer_types"]
    assert len(layer_types) == n
    assert reg.kinds() == ["full_gqa" if t == "full_attention" else "gdn" for t in layer_types]
    assert [l.layer_id for l in reg.full_layers() if not l.draft] == list(range(3, n, 4))
    assert reg[0].state == {"recurrent": TensorSpec((v_heads, 128, 128), "float32"),
                            "conv": TensorSpec((conv, 3), "bfloat16")}
    kv = {"k": TensorSpec((kv_heads, 256), "bfloat16"), "v": TensorSpec((kv_heads, 256), "bfloat16")}
    assert reg[3].kv == kv
    (draft,) = reg.draft_layers()  # mtp_num_hidden_layers: 1
    assert (draft.layer_id, draft.kind, draft.kv, draft.mlp) == (n, LayerKind.FULL_GQA, kv, mlp)
    assert all(l.mlp == mlp for l in reg)
    assert reg[0].module == "Qwen3_5GDN"


def test_real_27b_tensor_names_and_shapes():
    shapes = meta_shapes("qwen3_5", published("qwen3_6_27b.json"))
    p = "model.language_model.layers."
    expect = {
        p + "0.linear_attn.in_proj_qkv.weight": (10240, 5120), p + "0.linear_attn.in_proj_z.weight": (6144, 5120),
        p + "0.linear_attn.in_proj_b.weight": (48, 5120), p + "0.linear_attn.in_proj_a.weight": (48, 5120),
        p + "0.linear_attn.dt_bias": (48,), p + "0.linear_attn.norm.weight": (128,),
        p + "0.linear_attn.conv1d.weight": (10240, 1, 4), p + "0.linear_attn.out_proj.weight": (5120, 6144),
        p + "63.self_attn.q_proj.weight": (12288, 5120), p + "63.self_attn.k_proj.weight": (1024, 5120),
        p + "63.self_attn.o_proj.weight": (5120, 6144), p + "63.self_attn.k_norm.weight": (256,),
        p + "1.mlp.gate_proj.weight": (17408, 5120), p + "1.mlp.down_proj.weight": (5120, 17408),
        "mtp.fc.weight": (5120, 10240), "mtp.layers.0.mlp.up_proj.weight": (17408, 5120),
        "mtp.layers.0.self_attn.q_proj.weight": (12288, 5120), "lm_head.weight": (248320, 5120),
    }
    assert {k: shapes.get(k) for k in expect} == expect
    assert not any(k.startswith(("model.visual.", "model.layers.")) for k in shapes)


def test_real_35b_tensor_names_and_shapes():
    shapes = meta_shapes("qwen3_5", published("qwen3_5_35b_a3b.json"))
    p = "model.language_model.layers."
    expect = {
        p + "0.linear_attn.in_proj_qkv.weight": (8192, 2048), p + "0.linear_attn.in_proj_z.weight": (4096, 2048),
        p + "0.linear_attn.in_proj_b.weight": (32, 2048), p + "0.linear_attn.A_log": (32,),
        p + "0.linear_attn.conv1d.weight": (8192, 1, 4), p + "0.linear_attn.out_proj.weight": (2048, 4096),
        p + "39.self_attn.q_proj.weight": (8192, 2048), p + "39.self_attn.v_proj.weight": (512, 2048),
        p + "39.self_attn.o_proj.weight": (2048, 4096),
        p + "0.mlp.experts.gate_up_proj": (256, 1024, 2048), p + "0.mlp.experts.down_proj": (256, 2048, 512),
        p + "0.mlp.gate.weight": (256, 2048), p + "0.mlp.shared_expert.gate_proj.weight": (512, 2048),
        p + "0.mlp.shared_expert_gate.weight": (1, 2048),
        "mtp.fc.weight": (2048, 4096), "mtp.layers.0.mlp.experts.255.gate_proj.weight": (512, 2048),
        "mtp.layers.0.mlp.gate.weight": (256, 2048), "lm_head.weight": (248320, 2048),
        "model.language_model.embed_tokens.weight": (248320, 2048),
    }
    assert {k: shapes.get(k) for k in expect} == expect


# -- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", ["tiny", "small", "bench"])
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_make_config_sizes(size, variant):
    fam = get_family("qwen3_5")
    config = make_config(size, variant)
    reg = fam.registry(fam.text_config(config))
    assert reg.kinds().count("full_gqa") == config["num_hidden_layers"] // 4
    assert [(l.layer_id, l.mlp) for l in reg.draft_layers()] == [(config["num_hidden_layers"], variant)]
    if size == "bench":
        params = sum(torch.Size(s).numel() for s in meta_shapes("qwen3_5", config).values())
        assert 1.0e9 <= params <= 2.2e9, params
    assert fam.make_config(size)["model_type"] == "qwen3_5_moe_text"


# -- config errors -------------------------------------------------------------------------------

def _vl(name="qwen3_5_35b_a3b.json", **text_changes) -> dict:
    config = published(name)
    return {**config, "text_config": {**config["text_config"], **text_changes}}


@pytest.mark.parametrize("config, field", [
    (_vl(layer_types=["linear_attention"] * 39), "text_config.layer_types"),
    (_vl(num_hidden_layers=44), "text_config.layer_types"),
    (_vl(full_attention_interval=2), "text_config.full_attention_interval"),
    (_vl(num_attention_heads=15), "text_config.num_key_value_heads"),
    (_vl(linear_num_value_heads=40, linear_num_key_heads=16), "text_config.linear_num_key_heads"),
    (_vl(mlp_only_layers=[0]), "text_config.mlp_only_layers"),
    (_vl(mtp_num_hidden_layers=2), "text_config.mtp_num_hidden_layers"),
    (_vl(mtp_use_dedicated_embeddings=True), "text_config.mtp_use_dedicated_embeddings"),
    (_vl(num_experts=None), "text_config.num_experts"),
    (_vl(model_type="qwen3_5_text"), "text_config.model_type"),
    (_vl("qwen3_6_27b.json", intermediate_size=None), "text_config.intermediate_size"),
    ({**published("qwen3_6_27b.json"), "text_config": None}, "text_config"),
    ({**make_config("tiny", "dense"), "layer_types": ["linear_attention"] * 5}, "layer_types"),
    ({**make_config("tiny", "dense"), "model_type": "qwen3_6_text"}, "model_type"),
])
def test_config_errors_name_the_field(config, field):
    with pytest.raises(CheckpointError) as err:
        get_family("qwen3_5").text_config(config)
    assert "config.json" in str(err.value) and repr(field) in str(err.value), str(err.value)


def test_text_config_does_not_mutate_its_input():
    config = published("qwen3_6_27b.json")
    before = json.dumps(config, sort_keys=True)
    get_family("qwen3_5").text_config(config)
    assert json.dumps(config, sort_keys=True) == before
