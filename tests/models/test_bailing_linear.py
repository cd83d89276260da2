"""Bailing linear family (Ling 2.5 / 2.6, Ring-linear): Lightning core against transformers' MiniMax
lightning attention, the per-layer decay formula pinned on published layouts, registry goldens,
checkpoint round trip, whole vs chunked vs token-by-token eager runs (MLA and GQA variants),
the MTP draft, the absorbed MLA and the router against reference-style math, and config errors.

Ground truth per part: Lightning core math = transformers 5.24 MiniMaxLightningAttention (block
algorithm for prefill, recurrence for decode); slope formula, layer layout, MLA, router, MTP =
inclusionAI's released modeling code (Ring-V2.5 models/modeling_bailing_moe_v2_5.py), rewritten here
from reading it; transformers' own bailing_hybrid is Ling 3.0 (KDA) and is not used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from compiler.splitops import LayerKind, LayerRegistry, LayerSpec, TensorSpec
from models.bailing_linear import (FAMILY, alibi_slopes, build, init_weights, lightning_log_decay, make_config,
                                   registry, text_config)
from models.checkpoint import CheckpointReader, read_config, write_checkpoint
from models.common import CheckpointError
from models.families import family_for_config, get_family
from runtime.backends.cpu_reference import CPUReferenceBackend, route_topk
from runtime.cache.batch import SeqState, build_step, commit_step
from runtime.step.bound_ops import BoundOps
from runtime.engine.generate import make_pools, run_step
from testkit.helpers import EagerRunner, eager_logits, max_rel_err

CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # copies of the published configs (SOURCES.md)
PROMPT = [(7 * i + 3) % 300 + 2 for i in range(130)]
DECODE = [11, 250, 42]


def rel_norm_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def shared_config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def tiny_model(variant: str, seed: int = 0):
    model = build(text_config(make_config("tiny", variant)))
    init_weights(model, seed)
    return model.eval()


# -- 1. the Lightning core against transformers' MiniMax lightning attention --------------------------


class _LinearCache:
    """The two methods MiniMaxLightningAttention asks of a cache."""

    def __init__(self):
        self.state = None

    def get_linear_cache(self, layer_idx):
        return self.state

    def set_linear_cache(self, layer_idx, state):
        self.state = state


class _OpenGate(nn.Module):
    """sigmoid(+inf) = 1 exactly: MiniMax's output gate becomes the identity."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x):
        return torch.full((*x.shape[:-1], self.width), float("inf"))


def test_lightning_core_matches_minimax_lightning_attention():
    from transformers.models.minimax.configuration_minimax import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    H, D, block, layers, layer = 4, 16, 16, 20, 3
    prefill, decode = 45, 6  # 45 tokens = two full blocks and a partial one
    scale = D ** -0.5
    cfg = MiniMaxConfig(hidden_size=3 * H * D, num_attention_heads=H, head_dim=D, num_hidden_layers=layers,
                        block_size=block, hidden_act="linear", layer_types=["linear_attention"] * layers)
    ref = MiniMaxLightningAttention(cfg, layer).eval()
    # Strip MiniMax's projections, norm and gate so its forward is the core alone: identity qkv
    # projection and activation, no norm, an always-open gate, identity output projection.
    with torch.no_grad():
        ref.qkv_proj.weight.copy_(torch.eye(3 * H * D))
    ref.norm, ref.output_gate, ref.out_proj = nn.Identity(), _OpenGate(H * D), nn.Identity()
    # Same decay on both sides: this layer's Bailing slopes in place of MiniMax's own variant.
    decay = lightning_log_decay(H, layer, layers)  # [H], <= 0
    q_decay, k_decay, diag_decay = ref.decay_factors((-decay).view(H, 1, 1))
    for name, value in (("slope_rate", (-decay).view(H, 1, 1)), ("query_decay", q_decay),
                        ("key_decay", k_decay), ("diagonal_decay", diag_decay)):
        getattr(ref, name).copy_(value)

    g = torch.Generator().manual_seed(0)
    L = prefill + decode
    q, k, v = (torch.randn(L, H, D, generator=g) for _ in range(3))
    k = k * 0.5

    # MiniMax: one prefill call (block algorithm), then one call per decode token (recurrence).
    # It applies no softmax-style scale, so q goes in pre-scaled.
    cache = _LinearCache()
    packed = torch.cat([q * scale, k, v], dim=-1).reshape(1, L, 3 * H * D)  # per head [q | k | v]
    with torch.no_grad():
        ref_rows = [ref(packed[:, :prefill], None, None, cache=cache)[0]]
        for t in range(prefill, L):
            ref_rows.append(ref(packed[:, t:t + 1], None, None, cache=cache)[0])
    ref_out = torch.cat(ref_rows, dim=1).view(L, H, D)

    # hgc: the lightning_core op on the CPU reference backend, same prefill / decode schedule.
    reg = LayerRegistry([LayerSpec(0, LayerKind.LIGHTNING, state={"recurrent": TensorSpec((H, D, D), "float32")})])
    kv_pool, state_pool = make_pools(reg, max_tokens=L, num_seqs=1)
    ops = BoundOps(CPUReferenceBackend(kv_pool, state_pool))
    seq = SeqState(state_pool.alloc())
    rows = []
    for start, stop in [(0, prefill)] + [(t, t + 1) for t in range(prefill, L)]:
        items = [(seq, [0] * (stop - start))]
        step = build_step(items, kv_pool)
        out = torch.empty(stop - start, H, D)
        with ops.step(step.ctx):
            ops.lightning_core(q[start:stop], k[start:stop], v[start:stop], decay, out, 0, scale)
        commit_step(items)
        rows.append(out)
    out = torch.cat(rows)

    assert rel_norm_err(out[:prefill], ref_out[:prefill]) <= 1e-5
    assert rel_norm_err(out[prefill:], ref_out[prefill:]) <= 1e-5
    assert rel_norm_err(state_pool.layer(0)["recurrent"][seq.slot], cache.state[0]) <= 1e-5


# -- 2. the per-layer decay ----------------------------------------------------------------------------

# Two published variants of the per-layer slope scale exist:
#   A: slope * (1 - (layer_idx - 1) / (num_hidden_layers - 1) + 1e-5)
#      inclusionAI's released HF modeling code: Ring-V2.5 models/modeling_bailing_moe_v2_5.py
#      (BailingMoeV2_5LinearAttention, Ling-2.5 / 2.6 / Ring-2.5) and, as quoted from the
#      Ring-mini-linear-2.0 HF repo, modeling_bailing_moe_linear_v2.py (BailingMoeV2LinearAttention).
#   B: slope * (1 - layer_idx / (num_hidden_layers - 1) + 1e-5)
#      MiniMax-Text-01, vLLM vllm/model_executor/layers/mamba/linear/bailing_linear_attn.py and SGLang
#      python/sglang/srt/layers/attention/linear/lightning_backend.py (transformers' MiniMax puts the
#      1e-5 inside the denominator instead).
# We pin A: it is the code inclusionAI published with the checkpoints, so it is the decay the weights
# were trained and evaluated with; B shifts every layer by one (layer 0 gets layer 1's decay in A),
# a bug that shipped in A but that the weights now expect. Values below are A, written out by hand
# from the formula (layer_idx 0-based over the main layers), float32 as the reference computes them.
LING_2_6_DECAY = {  # 32 layers, 32 heads: base slope 2^(-(h+1)/4); heads 0, 1, 15, 31
    0: [-0.868030488, -0.729923725, -0.064516753, -0.00403229706],
    1: [-0.840904832, -0.707113862, -0.0625006258, -0.00390628912],
    6: [-0.70527637, -0.593064368, -0.0524199791, -0.0032762487],
    30: [-0.0542597882, -0.0456268601, -0.00403288286, -0.000252055179],
}
RING_MINI_DECAY = {  # 20 layers, 16 heads: base slope 2^(-(h+1)/2); heads 0, 1, 15
    0: [-0.744330049, -0.526320815, -0.00411188137],
    1: [-0.707113862, -0.500005007, -0.00390628912],
    8: [-0.446600825, -0.315794468, -0.00246714428],
    18: [-0.0744393617, -0.0526365787, -0.000411223271],
}


@pytest.mark.parametrize("table,heads,layers,picked", [
    (LING_2_6_DECAY, 32, 32, [0, 1, 15, 31]),
    (RING_MINI_DECAY, 16, 20, [0, 1, 15]),
])
def test_lightning_decay_golden(table, heads, layers, picked):
    for layer_idx, expected in table.items():
        got = lightning_log_decay(heads, layer_idx, layers)
        assert got.dtype == torch.float32 and got.shape == (heads,)
        assert torch.equal(got[picked], torch.tensor(expected, dtype=torch.float32)), layer_idx
    # And not variant B, which scales layer 1 by 1 - 1/(N-1) where A scales it by 1 (+1e-5).
    b_layer1 = -alibi_slopes(heads) * (1 - 1 / (layers - 1) + 1e-5)
    assert not torch.allclose(lightning_log_decay(heads, 1, layers), b_layer1)


def test_alibi_slopes_non_power_of_two():
    # 6 heads: the 4 slopes of 4 heads, then every other slope of 8 heads (ALiBi's rule).
    assert alibi_slopes(6).tolist() == [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125]
    assert torch.equal(alibi_slopes(12)[8:], torch.tensor([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]))


def test_model_layers_use_the_decay_formula():
    model = tiny_model("mla")
    captured = {}

    class Capture:
        def lightning_core(self, q, k, v, decay, out, layer_id, scale):
            captured[layer_id] = (decay.clone(), scale)
            out.zero_()

        def __getattr__(self, name):  # every other op: zero its `out` argument
            out_index = {"gqa_attention": 3, "mla_attention": 4, "moe": 8}[name]
            return lambda *args: args[out_index].zero_()

    model.set_ops(Capture())
    with torch.no_grad():
        model(torch.arange(5), torch.arange(5), torch.tensor([4]))
    assert sorted(captured) == [0, 1, 2]
    for layer_id, (decay, scale) in captured.items():
        assert torch.equal(decay, lightning_log_decay(4, layer_id, 4))
        assert scale == 16 ** -0.5


# -- 3. registry goldens -------------------------------------------------------------------------------


def test_registry_ling_2_6_flash():
    config = shared_config("ling_2_6_flash.json")
    assert family_for_config(config) is FAMILY
    reg = FAMILY.registry(FAMILY.text_config(config))
    full = {7, 15, 23, 31}
    assert reg.kinds() == ["full_mla" if i in full else "lightning" for i in range(32)]
    assert [l.layer_id for l in reg.full_layers() if not l.draft] == sorted(full)
    (draft,) = reg.draft_layers()
    assert (draft.layer_id, draft.kind, draft.draft, draft.mlp) == (32, LayerKind.FULL_MLA, True, "moe")
    assert draft.kv == {"latent": TensorSpec((512 + 64,), "float32")}  # fixture has no torch_dtype
    assert reg[7].kv == draft.kv and reg[7].module == "BailingMLA"
    assert reg[0].state == {"recurrent": TensorSpec((32, 128, 128), "float32")} and reg[0].module == "BailingLightning"
    assert [l.mlp for l in reg.main_layers()] == ["dense"] + ["moe"] * 31
    assert config["num_hidden_layers"] == 32  # the draft did not change the config


def test_registry_ring_mini_linear_2_0():
    config = shared_config("ring_mini_linear_2_0.json")
    assert family_for_config(config) is FAMILY
    reg = FAMILY.registry(FAMILY.text_config(config))
    full = {4, 9, 14, 19}
    assert reg.kinds() == ["full_gqa" if i in full else "lightning" for i in range(20)]
    assert reg.draft_layers() == []  # num_nextn_predict_layers is 0
    assert reg[4].kv == {"k": TensorSpec((4, 128), "bfloat16"), "v": TensorSpec((4, 128), "bfloat16")}
    assert reg[0].state == {"recurrent": TensorSpec((16, 128, 128), "float32")}
    assert reg[0].mlp == "dense" and reg[1].mlp == "moe"


def test_ring_mini_shapes_match_published_tensor_widths():
    # SOURCES.md: fused QKV 6144 rows on linear layers, 3072 on the global ones; hidden 2048.
    with torch.device("meta"):
        model = build(text_config(shared_config("ring_mini_linear_2_0.json")))
    shapes = model.checkpoint_shapes()
    assert shapes["model.layers.0.attention.query_key_value.weight"][0] == (6144, 2048)
    assert shapes["model.layers.4.attention.query_key_value.weight"][0] == (3072, 2048)
    assert shapes["model.layers.0.attention.g_norm.weight"][0] == (2048,)
    assert shapes["model.layers.1.mlp.gate.expert_bias"][0] == (256,)
    assert shapes["model.layers.1.mlp.experts.255.down_proj.weight"][0] == (2048, 512)
    assert "model.layers.4.attention.g_proj.weight" not in shapes


def test_tiny_registries_and_bench_size():
    mla = registry(make_config("tiny", "mla"))
    gqa = registry(make_config("tiny", "gqa"))
    assert mla.kinds() == ["lightning"] * 3 + ["full_mla"] and [l.layer_id for l in mla.draft_layers()] == [4]
    assert gqa.kinds() == ["lightning"] * 3 + ["full_gqa"] and gqa.draft_layers()[0].kind == LayerKind.FULL_GQA
    assert registry(make_config("small")).kinds()[3] == "full_gqa"
    with torch.device("meta"):
        bench = build(text_config(make_config("bench")))
    n = sum(p.numel() for p in bench.parameters())
    assert 1e9 <= n <= 2e9, n


# -- 4. checkpoint round trip and eager runs ------------------------------------------------------------


@pytest.mark.parametrize("variant", ["mla", "gqa"])
def test_checkpoint_round_trip(tmp_path, variant):
    config = make_config("tiny", variant)
    model = tiny_model(variant, seed=1)
    ckpt = write_checkpoint(tmp_path / "ckpt", config, model.checkpoint_tensors())
    names = set(CheckpointReader(ckpt).names())
    assert "model.layers.4.eh_proj.weight" in names and "model.layers.4.mlp.experts.7.up_proj.weight" in names
    assert not any("decay" in n or "draft" in n for n in names)

    fresh = get_family("bailing_linear").build(text_config(read_config(ckpt)))
    reader = CheckpointReader(ckpt)
    fresh.load_checkpoint_tensors(reader.get)
    fresh.eval()
    prompt = PROMPT[:40]
    assert torch.equal(eager_logits(fresh, prompt, DECODE), eager_logits(model, prompt, DECODE))

    # The loader's path: built on the meta device, materialised empty, filled from the files.
    from models.loader import load_checkpoint
    _, _, loaded = load_checkpoint(ckpt)
    assert torch.equal(eager_logits(loaded, prompt, DECODE), eager_logits(model, prompt, DECODE))


def _chunked_logits(model, prompt, decode, chunks):
    runner = EagerRunner(model, max_tokens=len(prompt) + len(decode) + 1, num_seqs=1)
    seq = runner.new_seq()
    rows, start = [], 0
    for n in chunks:
        rows.append(runner.step([(seq, prompt[start:start + n])], all_logits=True))
        start += n
    assert start == len(prompt)
    for tok in decode:
        rows.append(runner.step([(seq, [tok])]))
    return torch.cat(rows)


@pytest.mark.parametrize("variant", ["mla", "gqa"])
def test_whole_chunked_and_token_by_token_agree(variant):
    model = tiny_model(variant)
    whole = eager_logits(model, PROMPT, DECODE)
    assert whole.shape == (len(PROMPT) + len(DECODE), 320) and torch.isfinite(whole).all()
    chunked = _chunked_logits(model, PROMPT, DECODE, [1, 40, 17, 1, 1, 70])
    by_token = _chunked_logits(model, PROMPT, DECODE, [1] * len(PROMPT))
    assert max_rel_err(chunked, whole) <= 1e-5
    assert max_rel_err(by_token, whole) <= 1e-5


def test_two_requests_in_one_step_match_each_alone():
    model = tiny_model("gqa")
    a, b = PROMPT[:30], PROMPT[50:75]
    runner = EagerRunner(model, max_tokens=64, num_seqs=2)
    sa, sb = runner.new_seq(), runner.new_seq()
    together = runner.step([(sa, a), (sb, b)])
    alone = torch.stack([eager_logits(model, a, [])[-1], eager_logits(model, b, [])[-1]])
    assert max_rel_err(together, alone) <= 1e-5


@pytest.mark.parametrize("variant", ["mla", "gqa"])
def test_mtp_draft_runs(variant):
    model = tiny_model(variant)
    assert model.draft is not None and "draft" not in dict(model.named_children())
    runner = EagerRunner(model, max_tokens=80, num_seqs=3)
    prompt = PROMPT[:48]
    main_seq, draft_seq = runner.new_seq(), runner.new_seq()
    captured = {}

    def main_forward(ids, pos, idx):
        captured["hidden"] = model.forward_hidden(ids, pos)
        return model.compute_logits(captured["hidden"], idx)

    main_logits = run_step(main_forward, runner.ops, [(main_seq, prompt)], runner.kv_pool)
    hidden = captured["hidden"]
    assert hidden.shape == (48, 64)
    # Draft inputs: token t+1 with the main hidden state of position t.
    next_ids = prompt[1:] + [int(main_logits[-1].argmax())]

    def draft_forward(lo, hi):
        def fwd(ids, pos, idx):
            logits, h = model.draft(ids, pos, hidden[lo:hi], torch.arange(ids.shape[0]))
            captured["draft_hidden"] = h
            return logits
        return fwd

    whole = run_step(draft_forward(0, 48), runner.ops, [(draft_seq, next_ids)], runner.kv_pool)
    assert whole.shape == (48, 320) and torch.isfinite(whole).all()
    assert captured["draft_hidden"].shape == (48, 64)
    # Its own layer id (4) keeps its own KV: the draft run in two chunks gives the same logits.
    seq2 = runner.new_seq()
    parts = [run_step(draft_forward(lo, hi), runner.ops, [(seq2, next_ids[lo:hi])], runner.kv_pool)
             for lo, hi in ((0, 20), (20, 48))]
    assert max_rel_err(torch.cat(parts), whole) <= 1e-5


# -- absorbed MLA and router against the reference modeling code's math --------------------------------


def _hf_rotate_interleaved(x, positions, theta):
    """The reference's rope_interleave path: de-interleave, then rotate_half with cat(freqs, freqs)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = positions.float()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]  # [T, 1, d]
    x = x.view(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(x.shape)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def test_absorbed_mla_matches_reference_attention():
    model = tiny_model("mla", seed=3)
    mla = model.model.layers[3].attention
    T = 21
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(T)

    # Reference (non-absorbed): q and k = [nope | rope], v from kv_b_proj, causal softmax.
    H, Dn, P, Dv, R = 4, 16, 8, 16, 32
    with torch.no_grad():
        weights = model.checkpoint_tensors()
        proj = lambda name: x @ weights[f"model.layers.3.attention.{name}.weight"].T
        q = mla.q_b_proj(mla.q_a_layernorm(proj("q_a_proj"))).view(T, H, Dn + P)
        q_pass, q_rot = q.split([Dn, P], dim=-1)
        k_pass, k_rot = proj("kv_a_proj_with_mqa").split([R, P], dim=-1)
        kv = mla.kv_b_proj(mla.kv_a_layernorm(k_pass)).view(T, H, Dn + Dv)
        k_nope, v = kv.split([Dn, Dv], dim=-1)
        q_rot = _hf_rotate_interleaved(q_rot, positions, 10000.0)
        k_rot = _hf_rotate_interleaved(k_rot[:, None, :], positions, 10000.0).expand(T, H, P)
        qs, ks = torch.cat([q_pass, q_rot], -1), torch.cat([k_nope, k_rot], -1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * (Dn + P) ** -0.5
        scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        ref = mla.dense(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, H * Dv))

    runner = EagerRunner(model, max_tokens=32, num_seqs=1)
    items = [(runner.new_seq(), [0] * T)]
    step = build_step(items, runner.kv_pool)
    with runner.ops.step(step.ctx), torch.no_grad():
        got = mla(x, positions, runner.ops)
    assert max_rel_err(got, ref) <= 1e-5


def _reference_gate(x, weight, expert_bias, top_k, n_group, topk_group, routed_scale):
    """BailingMoeV2_5Gate.forward as read: sigmoid scores, bias for selection, group-limited top-k."""
    scores = torch.sigmoid(x.float() @ weight.float().t())
    biased = scores + expert_bias
    T, E = biased.shape
    group_scores = biased.view(T, n_group, -1).topk(2, dim=-1)[0].sum(-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1)
    mask = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    ids = biased.masked_fill(~mask.bool(), float("-inf")).topk(top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) if top_k > 1 else w
    return ids, w * routed_scale


def test_router_matches_reference_gate():
    g = torch.Generator().manual_seed(9)
    x, weight = torch.randn(64, 32, generator=g), torch.randn(16, 32, generator=g)
    bias = torch.randn(16, generator=g) * 0.3
    for top_k, n_group, topk_group in ((4, 4, 2), (2, 8, 3), (1, 4, 2)):
        ids, w = route_topk(x, weight, bias, top_k, "sigmoid", top_k > 1, 2.5, n_group, topk_group)
        ref_ids, ref_w = _reference_gate(x, weight, bias, top_k, n_group, topk_group, 2.5)
        dense = torch.zeros(64, 16).scatter_(1, ids, w)
        ref_dense = torch.zeros(64, 16).scatter_(1, ref_ids, ref_w)
        assert torch.allclose(dense, ref_dense, rtol=1e-6, atol=1e-7), (top_k, n_group, topk_group)


def test_moe_block_router_settings():
    model = tiny_model("mla")
    moe = model.model.layers[1].mlp
    assert (moe.scoring, moe.top_k, moe.num_groups, moe.topk_groups, moe.routed_scale) == ("sigmoid", 2, 4, 2, 2.5)
    assert moe.renormalize and moe.gate.selection_bias is moe.gate.expert_bias
    assert model.model.layers[0].mlp.__class__.__name__ == "SwiGLU"


# -- 5. config errors ------------------------------------------------------------------------------------


def _with(variant: str, **changes):
    config = make_config("tiny", variant)
    for key, value in changes.items():
        if value is ...:
            config.pop(key)
        else:
            config[key] = value
    return config


@pytest.mark.parametrize("variant,changes,field", [
    ("mla", {"layer_group_size": 0}, "layer_group_size"),
    ("mla", {"layer_group_size": 3}, "layer_group_size"),
    ("gqa", {"layer_group_size": "4"}, "layer_group_size"),
    ("gqa", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("mla", {"num_attention_heads": 0}, "num_attention_heads"),
    ("mla", {"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    ("gqa", {"group_norm_size": 3}, "group_norm_size"),
    ("mla", {"n_group": 3}, "n_group"),
    ("mla", {"topk_group": 5}, "topk_group"),
    ("mla", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("mla", {"first_k_dense_replace": 5}, "first_k_dense_replace"),
    ("mla", {"qk_rope_head_dim": 4}, "qk_rope_head_dim"),
    ("mla", {"rope_interleave": False}, "rope_interleave"),
    ("gqa", {"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
    ("gqa", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ("gqa", {"tie_word_embeddings": True}, "tie_word_embeddings"),
    ("gqa", {"torch_dtype": "float99"}, "torch_dtype"),
    ("gqa", {"model_type": "minimax"}, "model_type"),
    ("mla", {"hidden_size": ...}, "hidden_size"),
    ("mla", {"short_conv_kernel_size": 4}, "short_conv_kernel_size"),
    ("mla", {"layer_types": ["linear_attention"] * 4}, "layer_types"),
])
def test_config_errors_name_the_field(variant, changes, field):
    config = _with(variant, **changes)
    with pytest.raises(CheckpointError) as info:
        FAMILY.text_config(config)
    message = str(info.value)
    assert message.startswith("config.json") and repr(field) in message, message
    with pytest.raises(CheckpointError):
        FAMILY.registry(config)


def test_family_record():
    assert get_family("bailing_linear") is FAMILY
    assert FAMILY.model_types == ("bailing_moe_linear", "bailing_hybrid") and not FAMILY.transformers_loadable
    for variant in ("mla", "gqa"):
        assert family_for_config(make_config("tiny", variant)) is FAMILY
    assert math.isclose(text_config(make_config("tiny"))["rope_theta"], 10000.0)
