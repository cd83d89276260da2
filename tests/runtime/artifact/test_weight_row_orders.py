"""Weights whose rows a program holds in another order than the checkpoint's (compiler/splitops/rows.py):
weights.json records the order with the view, and a rank that reads its rows of Qwen3-Next's GDN
projections holds its key heads' q and k and its value heads' v, z, b and a, in held order."""

from __future__ import annotations

import pytest
import torch

from compiler.frontend import build_model, trace_model
from compiler.passes.sharding import derive_spec
from compiler.splitops import GroupedRows
from compiler.splitops.artifact import ArtifactFormatError, ParamSource, TensorView, parse_weights_doc, weights_doc
from models.families import get_family
from models.qwen3_next import make_config
from runtime.artifact.weights import assemble

TP = 2


def test_a_view_keeps_its_row_order_through_weights_json():
    rows = GroupedRows(2, (3, 1))
    source = ParamSource((10, 4), "float32", (TensorView("a.weight", 0, (8, 4), (4, 1), rows),
                                              TensorView("b.weight", 32, (2, 4), (4, 1))))
    parsed, _ = parse_weights_doc(weights_doc({"w": source}, {"main": {"w": "w"}}))
    assert parsed["w"] == source and not source.is_whole()
    bad = weights_doc({"w": source}, {"main": {"w": "w"}})
    bad["tensors"]["w"]["views"][0][4] = {"groups": 0, "segments": [3, 1]}
    with pytest.raises(ArtifactFormatError, match="groups and segments must be positive"):
        parse_weights_doc(bad)


def _rank_rows(Hk: int, Dk: int, Hv: int, Dv: int, rank: int) -> list[int]:
    """Rows of the whole held stack q | k | v | z | b | a that rank `rank` holds, in its order."""
    keys, values = range(rank * Hk // TP, (rank + 1) * Hk // TP), range(rank * Hv // TP, (rank + 1) * Hv // TP)
    blocks = [(0, Dk, keys), (Hk * Dk, Dk, keys), (2 * Hk * Dk, Dv, values), (2 * Hk * Dk + Hv * Dv, Dv, values),
              (2 * Hk * Dk + 2 * Hv * Dv, 1, values), (2 * Hk * Dk + 2 * Hv * Dv + Hv, 1, values)]
    return [base + h * width + i for base, width, heads in blocks for h in heads for i in range(width)]


class _RankFiles:
    """What runtime/artifact/weights.WeightFiles.get gives rank `rank`: its slices of the checkpoint tensor."""

    def __init__(self, stored, specs, rank):
        self.stored, self.specs, self.rank = stored, specs, rank

    def get(self, name):
        spec, t = self.specs[name], self.stored[name]
        if spec.replicated:
            return t
        return torch.cat([t.narrow(spec.dim, a, b - a) for a, b in spec.rank_slices(self.rank, TP)], spec.dim)


def test_a_rank_holds_its_heads_rows_of_the_gdn_projections_in_held_order():
    fam = get_family("qwen3_next")
    config = {**make_config("tiny"), "linear_num_key_heads": 4, "linear_num_value_heads": 8}  # 2 key heads a rank
    text = fam.text_config(config)
    whole = fam.build(text)
    fam.init_weights(whole, 0)
    stored = whole.checkpoint_tensors()  # the release's layout, as a checkpoint holds it
    traced = trace_model(build_model(fam, text, "float32", TP), fam, config, text, "float32",
                         build_model(fam, text, "float32"))
    specs = {name: derive_spec(name, f.whole, f.rank, TP, f.whole_segments, f.rank_segments)
             for name, f in traced.shard_facts.items()}
    layers = [fqn for fqn in traced.tensors if fqn.endswith("linear_attn.in_proj.weight")]
    assert layers
    for fqn in layers:
        source = traced.tensors[fqn]
        assert [v.rows is not None for v in source.views] == [True, True], source
        gdn = whole.get_submodule(fqn.removesuffix(".in_proj.weight"))
        assert [v.rows.groups for v in source.views] == [gdn.k_heads // TP] * 2 and gdn.k_heads // TP > 1
        held = gdn.in_proj.weight.detach()
        for rank in range(TP):
            got = assemble(fqn, source, _RankFiles(stored, specs, rank), "cpu")
            rows = _rank_rows(gdn.k_heads, gdn.k_dim, gdn.v_heads, gdn.v_dim, rank)
            assert torch.equal(got, held[rows]), (fqn, rank)


def test_sharding_refuses_a_row_ordered_tensor_cut_in_segments():
    from compiler.passes.sharding import _check_row_order
    from compiler.splitops import ShardingError, ShardSpec

    view = TensorView("model.layers.0.linear_attn.in_proj_qkvz.weight", 0, (8, 4), (4, 1), GroupedRows(2, (3, 1)))
    _check_row_order(view, ShardSpec(0, ((16, TP),)), TP)  # whole groups, one block per rank
    _check_row_order(view, ShardSpec(1, ((8, TP),)), TP)  # columns cut: rows untouched
    with pytest.raises(ShardingError, match="one block of whole groups"):
        _check_row_order(view, ShardSpec(0, ((8, TP), (8, TP))), TP)
