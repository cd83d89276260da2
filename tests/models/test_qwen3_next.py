"""Qwen3-Next family: equivalence with transformers, the MTP draft, registry goldens, config errors.

The helpers at the top (`write_tiny`, `load_both`, `hf_greedy_logits`, `hf_mtp_logits`,
`run_draft`) are shared with tests/models/test_qwen3_5.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from compiler.splitops import LayerKind, TensorSpec
from models.checkpoint import CheckpointReader, read_config, write_checkpoint
from models.common import CheckpointError
from models.families import family_for_config, get_family
from models.qwen3_next import make_config
from runtime.engine.generate import run_step
from testkit.helpers import EagerRunner, eager_logits, max_rel_err

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # copies of the published configs (SOURCES.md)
PROMPT_LEN, DECODE_STEPS, TOL = 130, 16, 1e-4


# -- shared helpers ------------------------------------------------------------------------------

def write_tiny(path: Path, family: str, config: dict, seed: int = 0) -> Path:
    fam = get_family(family)
    model = fam.build(fam.text_config(config))
    fam.init_weights(model, seed)
    return write_checkpoint(path, config, model.checkpoint_tensors())


def load_both(ckpt: Path):
    """(ours, theirs, reader): ours through the family table, theirs through from_pretrained."""
    config = read_config(ckpt)
    fam = family_for_config(config)
    ours = fam.build(fam.text_config(config))
    reader = CheckpointReader(ckpt)
    ours.load_checkpoint_tensors(reader.get, source=str(ckpt))
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info
    # Our checkpoint holds exactly our tensors: nothing the model would silently skip.
    assert reader.names() == set(ours.checkpoint_tensors())
    return ours, theirs.eval(), reader


@torch.no_grad()
def hf_greedy_logits(hf, prompt: list[int], steps: int):
    """transformers with its cache: prefill, then `steps` greedy tokens one at a time."""
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
    rows, cache, tokens = [out.logits[0]], out.cache, []
    for _ in range(steps):
        tokens.append(int(rows[-1][-1].argmax()))
        out = hf(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        rows.append(out.logits[0])
        cache = out.cache
    return torch.cat(rows), tokens


def check_equivalence(ckpt: Path, vocab: int) -> tuple[float, float]:
    ours, theirs, _ = load_both(ckpt)
    prompt = torch.randint(0, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ref, tokens = hf_greedy_logits(theirs, prompt, DECODE_STEPS)
    got = eager_logits(ours, prompt, tokens)
    assert got.shape == ref.shape == (PROMPT_LEN + DECODE_STEPS, vocab)
    prefill_err = max_rel_err(got[:PROMPT_LEN], ref[:PROMPT_LEN])
    decode_err = max_rel_err(got[PROMPT_LEN:], ref[PROMPT_LEN:])
    print(f"{ckpt.name}: max rel err prefill {prefill_err:.2e}, decode {decode_err:.2e}")
    assert prefill_err <= TOL and decode_err <= TOL
    # greedy tokens: ours pick what transformers picked at every decode step
    assert got[PROMPT_LEN - 1:-1].argmax(-1).tolist() == tokens
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    return prefill_err, decode_err


def run_draft(model, runner: EagerRunner, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """Draft logits of every row, as one step of a fresh sequence."""
    seq = runner.new_seq()
    return run_step(lambda i, p, _: model.draft(i, p, hidden, torch.arange(i.shape[0]))[0], runner.ops,
                    [(seq, ids)], runner.kv_pool)


def main_hidden(model, runner: EagerRunner, prompt: list[int]) -> torch.Tensor:
    seq = runner.new_seq()
    return run_step(lambda i, p, _: model.forward_hidden(i, p), runner.ops, [(seq, prompt)], runner.kv_pool)


@torch.no_grad()
def hf_mtp_logits(hf, layer_cls, full_layer_idx: int, reader: CheckpointReader, ids, hidden) -> torch.Tensor:
    """The MTP draft rebuilt from transformers' own decoder layer and norms (transformers has no MTP).

    `full_layer_idx` is any main layer that is full attention with the MTP's MLP kind, so
    transformers builds the right module for it; the `mtp.*` weights are then loaded into it.
    """
    cfg = hf.config
    norm_cls = type(hf.model.norm)
    layer = layer_cls(cfg, full_layer_idx)
    weights = {k[len("mtp.layers.0."):]: reader.get(k) for k in reader.names() if k.startswith("mtp.layers.0.")}
    E = getattr(cfg, "num_experts", 0)
    if "mlp.experts.0.gate_proj.weight" in weights:  # transformers holds experts fused: build its tensors
        gate_up = [torch.cat([weights.pop(f"mlp.experts.{e}.gate_proj.weight"),
                              weights.pop(f"mlp.experts.{e}.up_proj.weight")]) for e in range(E)]
        weights["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        weights["mlp.experts.down_proj"] = torch.stack([weights.pop(f"mlp.experts.{e}.down_proj.weight")
                                                        for e in range(E)])
    layer.load_state_dict(weights, strict=True)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = norm_cls(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].weight.copy_(reader.get(f"mtp.{name}.weight"))
    fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
    fc.weight.copy_(reader.get("mtp.fc.weight"))

    T = len(ids)
    e = norms["pre_fc_norm_embedding"](hf.get_input_embeddings()(torch.tensor([ids])))
    x = fc(torch.cat([e, norms["pre_fc_norm_hidden"](hidden[None])], dim=-1))
    positions = torch.arange(T)[None]
    rope = hf.model.rotary_emb(x, positions)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    x = layer(x, position_embeddings=rope, attention_mask=mask, position_ids=positions)
    return hf.lm_head(norms["norm"](x))[0]


def check_draft(ckpt: Path, layer_cls, full_layer_idx: int, vocab: int) -> float:
    """Our draft (through the runtime) == transformers-built reference; prefill == prefill + decode."""
    ours, theirs, reader = load_both(ckpt)
    spec = ours.layer_registry.draft_layers()
    assert [s.layer_id for s in spec] == [ours.dims.num_layers] and spec[0].kind == LayerKind.FULL_GQA
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, vocab, (40,), generator=g).tolist()
    draft_ids = torch.randint(0, vocab, (40,), generator=g).tolist()
    runner = EagerRunner(ours, max_tokens=64, num_seqs=4)
    hidden = main_hidden(ours, runner, prompt)
    got = run_draft(ours, runner, draft_ids, hidden)
    ref = hf_mtp_logits(theirs, layer_cls, full_layer_idx, reader, draft_ids, hidden)
    err = max_rel_err(got, ref)
    print(f"{ckpt.name}: draft max rel err {err:.2e}")
    assert err <= TOL

    # The draft layer's KV cache: a 30-token prefill then 10 single-token steps == one prefill.
    seq = runner.new_seq()
    rows = [run_step(lambda i, p, _: ours.draft(i, p, hidden[:30], torch.arange(30))[0], runner.ops,
                     [(seq, draft_ids[:30])], runner.kv_pool)]
    for t in range(30, 40):
        rows.append(run_step(lambda i, p, li: ours.draft(i, p, hidden[t:t + 1], li)[0], runner.ops,
                             [(seq, [draft_ids[t]])], runner.kv_pool))
    assert max_rel_err(torch.cat(rows), got) <= TOL
    return err


def assert_no_module_built(monkeypatch, fn):
    """Run fn with nn.Module construction forbidden: registries come from config.json alone."""
    def refuse(self, *a, **k):
        raise AssertionError(f"building the registry constructed a module ({type(self).__name__})")
    monkeypatch.setattr(nn.Module, "__init__", refuse)
    try:
        return fn()
    finally:
        monkeypatch.undo()


def meta_shapes(family: str, config: dict) -> dict[str, tuple[int, ...]]:
    fam = get_family(family)
    with torch.device("meta"):
        model = fam.build(fam.text_config(config))
    return {k: tuple(s) for k, (s, _) in model.checkpoint_shapes().items()}


# -- equivalence with transformers ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("qwen3_next") / "tiny", "qwen3_next", make_config("tiny"))


def test_tiny_matches_transformers(tiny_ckpt):
    check_equivalence(tiny_ckpt, make_config("tiny")["vocab_size"])


def test_tiny_checkpoint_layout(tiny_ckpt):
    names = CheckpointReader(tiny_ckpt).names()
    # real Qwen3-Next names: fused qkvz / ba projections, per-expert tensors, unprefixed mtp.*
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert "model.layers.0.linear_attn.in_proj_ba.weight" in names
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.1.mlp.gate_proj.weight" in names  # mlp_only_layers [1]: dense
    assert "model.layers.3.self_attn.q_norm.weight" in names
    assert {"mtp.fc.weight", "mtp.layers.0.mlp.shared_expert_gate.weight"} <= names
    assert not any(n.endswith(("w13", "w2")) for n in names)


def test_draft_matches_transformers_layer(tiny_ckpt):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer
    check_draft(tiny_ckpt, Qwen3NextDecoderLayer, 3, make_config("tiny")["vocab_size"])


def test_missing_mtp_tensor_is_named(tiny_ckpt):
    config = read_config(tiny_ckpt)
    fam = get_family("qwen3_next")
    model = fam.build(fam.text_config(config))
    reader = CheckpointReader(tiny_ckpt)

    def get(name):
        if name == "mtp.fc.weight":
            raise KeyError(name)
        return reader.get(name)
    with pytest.raises(CheckpointError, match="mtp.fc.weight"):
        model.load_checkpoint_tensors(get)
    # Without an MTP field the draft is not built and the mtp.* tensors are simply not read.
    plain = fam.build(fam.text_config({k: v for k, v in config.items() if k != "num_nextn_predict_layers"}))
    assert plain.draft is None and not plain.layer_registry.draft_layers()
    plain.load_checkpoint_tensors(reader.get)


# -- registry goldens ----------------------------------------------------------------------------

def published_next() -> dict:
    return json.loads((CONFIGS / "qwen3_next_80b_a3b.json").read_text())


def test_registry_qwen3_next_80b(monkeypatch):
    config = published_next()
    fam = family_for_config(config)
    assert fam.name == "qwen3_next"
    reg = assert_no_module_built(monkeypatch, lambda: fam.registry(fam.text_config(config)))
    full = [i for i in range(48) if (i + 1) % 4 == 0]
    assert full == list(range(3, 48, 4))
    assert reg.kinds() == ["full_gqa" if i in full else "gdn" for i in range(48)]
    assert len(reg) == 48 and not reg.draft_layers()  # the published config has no MTP field
    gdn, attn = reg[0], reg[3]
    assert gdn.state == {"recurrent": TensorSpec((32, 128, 128), "float32"), "conv": TensorSpec((8192, 3), "bfloat16")}
    assert attn.kv == {"k": TensorSpec((2, 256), "bfloat16"), "v": TensorSpec((2, 256), "bfloat16")}
    assert all(l.mlp == "moe" for l in reg)
    assert gdn.module == "Qwen3NextGDN" and attn.module == "QwenGatedAttention"


def test_registry_mtp_rule():
    fam = get_family("qwen3_next")
    reg = fam.registry(fam.text_config({**published_next(), "num_nextn_predict_layers": 1}))
    (draft,) = reg.draft_layers()
    assert draft.layer_id == 48 and draft.kind == LayerKind.FULL_GQA and draft.mlp == "moe"
    assert draft.kv == reg[47].kv
    same = fam.registry(fam.text_config({**published_next(), "mtp_num_hidden_layers": 1}))
    assert same == reg
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers"):
        fam.text_config({**published_next(), "num_nextn_predict_layers": 1, "mtp_num_hidden_layers": 0})
    with pytest.raises(CheckpointError, match="0 or 1"):
        fam.text_config({**published_next(), "num_nextn_predict_layers": 2})


def test_real_80b_tensor_names_and_shapes():
    """Built on the meta device: every tensor of the published checkpoint, by name and shape (SOURCES.md)."""
    shapes = meta_shapes("qwen3_next", {**published_next(), "num_nextn_predict_layers": 1})
    assert len(shapes) == 75944  # the report's tensor count, MTP included
    expect = {
        "model.layers.0.linear_attn.in_proj_qkvz.weight": (12288, 2048),
        "model.layers.0.linear_attn.in_proj_ba.weight": (64, 2048),
        "model.layers.0.linear_attn.conv1d.weight": (8192, 1, 4),
        "model.layers.0.linear_attn.A_log": (32,), "model.layers.0.linear_attn.dt_bias": (32,),
        "model.layers.0.linear_attn.norm.weight": (128,),
        "model.layers.0.linear_attn.out_proj.weight": (2048, 4096),
        "model.layers.47.self_attn.q_proj.weight": (8192, 2048),
        "model.layers.47.self_attn.k_proj.weight": (512, 2048),
        "model.layers.47.self_attn.o_proj.weight": (2048, 4096),
        "model.layers.47.self_attn.q_norm.weight": (256,),
        "model.layers.5.mlp.gate.weight": (512, 2048),
        "model.layers.5.mlp.experts.511.gate_proj.weight": (512, 2048),
        "model.layers.5.mlp.experts.0.down_proj.weight": (2048, 512),
        "model.layers.5.mlp.shared_expert.up_proj.weight": (512, 2048),
        "model.layers.5.mlp.shared_expert_gate.weight": (1, 2048),
        "mtp.fc.weight": (2048, 4096), "mtp.pre_fc_norm_embedding.weight": (2048,),
        "mtp.layers.0.self_attn.q_proj.weight": (8192, 2048),
        "mtp.layers.0.mlp.experts.511.down_proj.weight": (2048, 512),
        "model.embed_tokens.weight": (151936, 2048), "lm_head.weight": (151936, 2048),
    }
    assert {k: shapes.get(k) for k in expect} == expect


# -- sizes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", ["tiny", "small", "bench"])
def test_make_config_sizes(size):
    fam = get_family("qwen3_next")
    config = fam.make_config(size)
    reg = fam.registry(fam.text_config(config))
    assert reg.kinds().count("full_gqa") == config["num_hidden_layers"] // 4
    assert [l.layer_id for l in reg.draft_layers()] == [config["num_hidden_layers"]]
    if size == "bench":  # parameters counted on the meta device: no weights are built
        params = sum(torch.Size(s).numel() for s in meta_shapes("qwen3_next", config).values())
        assert 1.0e9 <= params <= 2.0e9, params


def test_small_runs():
    fam = get_family("qwen3_next")
    model = fam.build(fam.text_config(fam.make_config("small")))
    fam.init_weights(model, 0)
    logits = eager_logits(model, list(range(20)), [3, 4])
    assert logits.shape == (22, 512) and torch.isfinite(logits).all()


def test_init_weights_realistic_decays():
    fam = get_family("qwen3_next")
    a = fam.build(fam.text_config(make_config("tiny")))
    b = fam.build(fam.text_config(make_config("tiny")))
    fam.init_weights(a, 7)
    fam.init_weights(b, 7)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    gdn = a.model.layers[0].linear_attn
    A = gdn.A_log.exp()
    assert ((A >= 0.01) & (A <= 16)).all() and torch.equal(gdn.dt_bias, torch.ones_like(gdn.dt_bias))


# -- config errors -------------------------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    ({"layer_types": ["linear_attention"] * 47}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 47 + ["sliding_attention"]}, "layer_types[47]"),
    ({"layer_types": ["full_attention"] * 48}, "full_attention_interval"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"linear_num_key_heads": 12}, "linear_num_key_heads"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers"),
    ({"num_experts_per_tok": 600}, "num_experts_per_tok"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"hidden_size": None}, "hidden_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"partial_rotary_factor": 0.003}, "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"model_type": "qwen3_moe"}, "model_type"),
])
def test_config_errors_name_the_field(change, field):
    config = {**published_next(), **change}
    with pytest.raises(CheckpointError) as err:
        get_family("qwen3_next").text_config(config)
    assert "config.json" in str(err.value) and repr(field) in str(err.value), str(err.value)


def test_moe_placement_sparse_step_and_mlp_only_layers():
    fam = get_family("qwen3_next")
    reg = fam.registry(fam.text_config({**published_next(), "decoder_sparse_step": 2, "mlp_only_layers": [5]}))
    moe = [l.layer_id for l in reg if l.mlp == "moe"]
    assert moe == [i for i in range(48) if (i + 1) % 2 == 0 and i != 5]
    dense = fam.registry(fam.text_config({**published_next(), "num_experts": 0}))
    assert all(l.mlp == "dense" for l in dense)


def test_layer_types_list_is_honoured():
    types = ["linear_attention", "full_attention"] * 24
    fam = get_family("qwen3_next")
    config = {k: v for k, v in published_next().items() if k != "full_attention_interval"}
    reg = fam.registry(fam.text_config({**config, "layer_types": types}))
    assert reg.kinds() == ["gdn", "full_gqa"] * 24
