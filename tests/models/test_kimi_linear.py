"""Kimi-Linear family: equivalence with transformers, the registry of the published 48B config, config errors.

1. A tiny float32 checkpoint is written once; our model (built from the files) and transformers'
   (`from_pretrained`, plain PyTorch fallbacks since fla-core is not installed) run a 130-token
   prefill (more than two of transformers' 64-token KDA chunks) and 16 greedy decode steps.
2. The published Kimi-Linear-48B-A3B config (embedded below, from tests/configs) gives
   the golden registry, and a meta-device build gives exactly the checkpoint's tensor names.
3. Malformed layer lists and unsupported fields fail with a CheckpointError naming the field.
"""

from __future__ import annotations

import copy

import pytest
import torch

from compiler.splitops import LayerKind, TensorSpec
from models.checkpoint import CheckpointReader, read_config, write_checkpoint
from models.common import CheckpointError
from models.families import SIZES, get_family
from models.kimi_linear import FAMILY, build, build_registry, init_weights, make_config, text_config
from testkit.helpers import EagerRunner, eager_logits, max_rel_err

PROMPT_LEN = 130
DECODE_STEPS = 16

# moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (revision e1df551a), as in
# tests/configs/kimi_linear_48b_a3b.json; auto_map left out (it names remote code).
KIMI_48B = {
    "architectures": ["KimiLinearForCausalLM"], "bos_token_id": 163584, "dtype": "bfloat16",
    "eos_token_id": 163586, "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu",
    "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216, "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32, "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear",
    "moe_intermediate_size": 1024, "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1,
    "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0, "num_shared_experts": 1, "pad_token_id": 163839, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False,
    "transformers_version": "4.57.1", "use_cache": True, "use_grouped_topk": True, "topk_group": 1,
    "v_head_dim": 128, "vocab_size": 163840,
}


# -- 1. equivalence with transformers ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    config = make_config("tiny")
    model = build(text_config(config))
    init_weights(model, seed=0)
    return write_checkpoint(tmp_path_factory.mktemp("kimi") / "tiny", config, model.checkpoint_tensors())


def _load_ours(ckpt):
    model = build(text_config(read_config(ckpt)))
    model.load_checkpoint_tensors(CheckpointReader(ckpt).get, source=str(ckpt))
    return model.eval()


@pytest.fixture(scope="module")
def reference_run(tiny_ckpt):
    """transformers: prefill, then greedy decode one token at a time through its cache."""
    transformers = pytest.importorskip("transformers")
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    ref.eval()
    prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1234))
    rows, tokens = [], []
    with torch.no_grad():
        out = ref(input_ids=prompt[None], use_cache=True)
        rows.append(out.logits[0])
        tokens.append(int(out.logits[0, -1].argmax()))
        cache = out.cache  # transformers 5 renamed past_key_values to cache
        for _ in range(DECODE_STEPS):
            out = ref(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
            cache = out.cache
            rows.append(out.logits[0])
            tokens.append(int(out.logits[0, -1].argmax()))
    return info, prompt.tolist(), torch.cat(rows), tokens


def test_checkpoint_loads_in_transformers_without_key_mismatch(reference_run):
    info = reference_run[0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_prefill_and_decode_match_transformers(tiny_ckpt, reference_run):
    _, prompt, ref_logits, ref_tokens = reference_run
    ours = eager_logits(_load_ours(tiny_ckpt), prompt, ref_tokens[:DECODE_STEPS])
    assert ours.shape == ref_logits.shape == (PROMPT_LEN + DECODE_STEPS, 256)
    err_prefill = max_rel_err(ours[:PROMPT_LEN], ref_logits[:PROMPT_LEN])
    err_decode = max_rel_err(ours[PROMPT_LEN:], ref_logits[PROMPT_LEN:])
    print(f"kimi_linear tiny fp32: max_rel_err prefill {err_prefill:.2e}, decode {err_decode:.2e}")
    assert err_prefill <= 1e-4 and err_decode <= 1e-4
    # Greedy: the last prompt row and every decode row pick transformers' next token.
    assert ours[PROMPT_LEN - 1:].argmax(-1).tolist() == ref_tokens


def test_chunked_prefill_matches_transformers(tiny_ckpt, reference_run):
    """Prefill in two uneven chunks: conv state, KDA state and MLA cache carry across steps."""
    _, prompt, ref_logits, _ = reference_run
    runner = EagerRunner(_load_ours(tiny_ckpt), max_tokens=PROMPT_LEN + 1, num_seqs=1)
    seq = runner.new_seq()
    first = runner.step([(seq, prompt[:67])], all_logits=True)
    second = runner.step([(seq, prompt[67:])], all_logits=True)
    assert max_rel_err(torch.cat([first, second]), ref_logits[:PROMPT_LEN]) <= 1e-4


def test_variant_config_matches_transformers(tmp_path):
    """The optional paths the published model does not use: a q LoRA (q_a/q_b + q_a_layernorm),
    attention biases, two shared experts, no top-k renormalisation. Prefill only."""
    transformers = pytest.importorskip("transformers")
    config = dict(make_config("tiny"), q_lora_rank=24, attention_bias=True, num_shared_experts=2,
                  moe_renormalize=False)
    model = build(text_config(config))
    init_weights(model, seed=3)
    ckpt = write_checkpoint(tmp_path / "variant", config, model.checkpoint_tensors())
    ref, info = transformers.AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ref.eval()(input_ids=prompt[None]).logits[0]
    assert max_rel_err(eager_logits(_load_ours(ckpt), prompt.tolist(), []), expected) <= 1e-4


# -- 2. the published 48B config ---------------------------------------------------------------


def test_registry_golden_kimi_linear_48b():
    reg = build_registry(text_config(copy.deepcopy(KIMI_48B)))
    mla = [3, 7, 11, 15, 19, 23, 26]  # the config's 1-based 4, 8, ..., 24, 27
    assert len(reg) == 27 and [l.layer_id for l in reg] == list(range(27))
    assert reg.kinds() == ["full_mla" if i in mla else "kda" for i in range(27)]
    assert [l.layer_id for l in reg.full_layers()] == mla
    assert not reg.draft_layers()
    for layer in reg:
        assert layer.mlp == ("dense" if layer.layer_id == 0 else "moe")
        if layer.kind is LayerKind.KDA:
            assert layer.module == "KimiDeltaAttention"
            assert layer.state == {"recurrent": TensorSpec((32, 128, 128), "float32"),
                                   "conv": TensorSpec((3 * 32 * 128, 3), "bfloat16")}
            assert not layer.kv
        else:
            assert layer.module == "KimiMLAttention"
            assert layer.kv == {"latent": TensorSpec((512 + 64,), "bfloat16")}
            assert not layer.state
    assert FAMILY.registry(FAMILY.text_config(copy.deepcopy(KIMI_48B))) == reg


def test_kimi_linear_48b_tensor_names_on_meta():
    """No weights: a meta-device build lists exactly the published checkpoint's tensors."""
    with torch.device("meta"):
        model = build(text_config(copy.deepcopy(KIMI_48B)))
    shapes = model.checkpoint_shapes()
    # The model-information report of the real checkpoint: 20,493 tensors, 49,122,681,728 parameters.
    assert len(shapes) == 20493
    assert sum(torch.Size(s).numel() for s, _ in shapes.values()) == 49_122_681_728
    expect = {
        "model.layers.0.self_attn.q_conv1d.weight": (4096, 1, 4),
        "model.layers.0.self_attn.f_b_proj.weight": (4096, 128),
        "model.layers.0.self_attn.A_log": (1, 1, 32, 1),
        "model.layers.0.self_attn.dt_bias": (4096,),
        "model.layers.0.self_attn.b_proj.weight": (32, 2304),
        "model.layers.0.self_attn.o_norm.weight": (128,),
        "model.layers.0.mlp.gate_proj.weight": (9216, 2304),
        "model.layers.3.self_attn.q_proj.weight": (6144, 2304),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (576, 2304),
        "model.layers.3.self_attn.kv_a_layernorm.weight": (512,),
        "model.layers.3.self_attn.kv_b_proj.weight": (8192, 512),
        "model.layers.26.block_sparse_moe.gate.e_score_correction_bias": (256,),
        "model.layers.26.block_sparse_moe.experts.255.w3.weight": (1024, 2304),
        "model.layers.26.block_sparse_moe.shared_experts.down_proj.weight": (2304, 1024),
        "lm_head.weight": (163840, 2304),
    }
    assert {k: shapes[k][0] for k in expect} == expect
    assert shapes["model.layers.0.self_attn.A_log"][1] == torch.float32


def test_make_config_sizes():
    assert get_family("kimi_linear") is FAMILY and FAMILY.transformers_loadable
    for size in SIZES:
        reg = FAMILY.registry(FAMILY.text_config(make_config(size)))  # config and registry only
        assert reg.full_layers() and reg.linear_layers()
    bench = text_config(make_config("bench"))
    assert (bench["hidden_size"], bench["linear_head_dim"], bench["kv_lora_rank"]) == (2304, 128, 512)


# -- 3. config errors --------------------------------------------------------------------------


def _with(**changes):
    cfg = copy.deepcopy(KIMI_48B)
    for key, value in changes.items():
        if key in ("kda_layers", "full_attn_layers"):
            cfg["linear_attn_config"][key] = value
        else:
            cfg[key] = value
    return cfg


KDA = KIMI_48B["linear_attn_config"]["kda_layers"]
FULL = KIMI_48B["linear_attn_config"]["full_attn_layers"]


@pytest.mark.parametrize("cfg, field", [
    (_with(full_attn_layers=FULL + [5]), "full_attn_layers"),  # 5 is also a KDA layer
    (_with(kda_layers=KDA[1:]), "kda_layers"),  # layer 1 in neither list
    (_with(full_attn_layers=FULL[:-1] + [28]), "full_attn_layers"),  # 27 layers, 1-based
    (_with(kda_layers=[0] + KDA), "kda_layers"),  # 0 is out of range: the ids are 1-based
    (_with(kda_layers=KDA + [2]), "kda_layers"),  # listed twice
    (_with(layer_types=["linear_attention"] * 27), "layer_types"),  # disagrees with the lists
    (_with(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
    (_with(mla_use_nope=False), "mla_use_nope"),
    (_with(moe_router_activation_func="softmax"), "moe_router_activation_func"),
    (_with(model_type="deepseek_v3"), "model_type"),
], ids=["overlap", "missing", "out-of-range", "zero-based", "duplicate", "layer-types", "mtp", "rope-mla",
        "softmax-router", "model-type"])
def test_config_errors_name_the_field(cfg, field):
    with pytest.raises(CheckpointError, match=f"config.json: .*{field}"):
        build_registry(text_config(cfg))


def test_missing_layer_lists():
    cfg = copy.deepcopy(KIMI_48B)
    del cfg["linear_attn_config"]["kda_layers"], cfg["linear_attn_config"]["full_attn_layers"]
    with pytest.raises(CheckpointError, match="config.json: linear_attn_config.kda_layers"):
        text_config(cfg)


@pytest.mark.filterwarnings("ignore:`rope_scaling` is deprecated:FutureWarning")  # the published null
def test_config_resaved_by_transformers_gives_the_same_registry():
    """transformers re-saves the layout twice (layer_types, mlp_layer_types): both must agree."""
    transformers = pytest.importorskip("transformers")
    resaved = transformers.KimiLinearConfig(**copy.deepcopy(KIMI_48B)).to_dict()
    assert "layer_types" in resaved and "linear_head_dim" in resaved
    assert build_registry(text_config(resaved)) == build_registry(text_config(copy.deepcopy(KIMI_48B)))
