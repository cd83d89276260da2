"""Qwen3-Next's GDN projections held flat (q | k | v | z | b | a) while the checkpoint stores them
per key head: the row order and its inverse, the projection against the per-head computation the
checkpoint's layout implies, and a traced GDN layer with no gather or copy before its conv."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from compiler.frontend import build_model, example_sizes, export_programs
from compiler.splitops import GroupedRows, op_name_of
from models.families import get_family
from models.qwen3_next import Qwen3NextGDN, gdn_row_orders, make_config


@pytest.mark.parametrize("groups, segments", [(1, (3,)), (2, (2, 1)), (3, (4, 4, 2, 2)), (16, (128, 128, 256, 256))])
def test_row_order_and_its_inverse_round_trip_exactly(groups, segments):
    rows = GroupedRows(groups, segments)
    order = rows.order()
    assert sorted(order.tolist()) == list(range(rows.rows))  # a permutation
    stored = torch.randn(rows.rows, 5, generator=torch.Generator().manual_seed(groups))
    held = rows.to_held(stored)
    assert torch.equal(rows.to_stored(held), stored)
    assert torch.equal(rows.to_held(rows.to_stored(stored)), stored)
    # held is segment-major: segment s of every group, in group order, before segment s + 1
    width, starts = sum(segments), [sum(segments[:s]) for s in range(len(segments))]
    expected = torch.cat([stored.view(groups, width, 5)[:, a:a + n].reshape(-1, 5) for a, n in zip(starts, segments)])
    assert torch.equal(held, expected)
    assert GroupedRows.from_json(rows.to_json()) == rows


def test_row_order_refuses_a_tensor_of_other_rows():
    with pytest.raises(ValueError, match="expected 6 rows"):
        GroupedRows(2, (2, 1)).to_held(torch.zeros(5, 2))


def _tiny_model():
    fam = get_family("qwen3_next")
    model = fam.build(fam.text_config(make_config("tiny")))
    fam.init_weights(model, 0)
    return model


def _interleaved_project(x, qkvz_w, ba_w, Hk, Dk, Hv, Dv):
    """The projection as the checkpoint lays it out: one GEMM over the stored rows, then each key
    head's q, k, v, z and b, a picked out of its group and gathered into q | k | v."""
    r = Hv // Hk
    qkvz, ba = F.linear(x, torch.cat([qkvz_w, ba_w])).split([qkvz_w.shape[0], ba_w.shape[0]], dim=-1)
    q, k, v, z = qkvz.view(-1, Hk, 2 * Dk + 2 * r * Dv).split([Dk, Dk, r * Dv, r * Dv], dim=-1)
    b, a = ba.view(-1, Hk, 2 * r).split([r, r], dim=-1)
    qkv = torch.cat([q.reshape(-1, Hk * Dk), k.reshape(-1, Hk * Dk), v.reshape(-1, Hk * r * Dv)], dim=-1)
    return qkv, z.reshape(-1, Hv, Dv), b.reshape(-1, Hv), a.reshape(-1, Hv)


def test_project_on_held_rows_equals_the_per_head_computation_exactly():
    model = _tiny_model()
    prefix, gdn = next((n, m) for n, m in model.named_modules() if isinstance(m, Qwen3NextGDN))
    stored = model.checkpoint_tensors()
    qkvz_w, ba_w = stored[f"{prefix}.in_proj_qkvz.weight"], stored[f"{prefix}.in_proj_ba.weight"]
    assert gdn.k_heads < gdn.v_heads  # r > 1: value heads are grouped under key heads
    x = torch.randn(7, qkvz_w.shape[1], generator=torch.Generator().manual_seed(3))
    got = gdn.project(x)
    ref = _interleaved_project(x, qkvz_w, ba_w, gdn.k_heads, gdn.k_dim, gdn.v_heads, gdn.v_dim)
    for name, g, r in zip(("qkv", "z", "b", "a"), got, ref):
        assert g.dtype == torch.float32 and g.shape == r.shape, name
        assert torch.equal(g, r), f"{name}: max abs diff {(g - r).abs().max()}"
    # every piece is a view of the one GEMM output: nothing gathered, nothing copied
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1


def test_checkpoint_holds_the_release_layout_and_reads_back_exactly():
    model = _tiny_model()
    prefix, gdn = next((n, m) for n, m in model.named_modules() if isinstance(m, Qwen3NextGDN))
    stored, held = model.checkpoint_tensors(), model.checkpoint_tensors(held=True)
    orders = gdn_row_orders(gdn.k_heads, gdn.k_dim, gdn.v_heads, gdn.v_dim)
    assert set(model.row_orders()) >= {f"{prefix}.{name}" for name in orders}
    for name, rows in orders.items():
        key = f"{prefix}.{name}"
        assert held[key].untyped_storage().data_ptr() == gdn.in_proj.weight.untyped_storage().data_ptr()
        assert torch.equal(stored[key], rows.to_stored(held[key]))
    fresh = _tiny_model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_checkpoint_tensors({k: v.clone() for k, v in stored.items()}.__getitem__)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_traced_gdn_layer_hands_its_conv_a_slice_of_the_projection():
    """In the program the compiler exports, a GDN layer's projection reaches the conv and the
    gated norm through splits and views only: no cat (the gather of q | k | v) and no copy of z."""
    fam = get_family("qwen3_next")
    text = fam.text_config(make_config("tiny"))
    model = build_model(fam, text, "float32")
    ep = export_programs(model, example_sizes(model, text), int(text["hidden_size"]), fam.name)["main"]
    in_gdn = [n for n in ep.graph.nodes if n.op == "call_function"
              and any("linear_attn" in path for path, _ in (n.meta.get("nn_module_stack") or {}).values())]
    assert in_gdn
    copies = {"cat", "clone", "contiguous", "_unsafe_view", "copy", "_to_copy"}
    found = [n.name for n in in_gdn if getattr(n.target, "__name__", "").split(".")[0] in copies]
    assert not found, found
    # a reshape that cannot view its input copies it (Inductor: a clone kernel); here every one views
    reshapes = [n for n in in_gdn if getattr(n.target, "__name__", "").split(".")[0] in ("reshape", "view")]
    copied = [n.name for n in reshapes
              if n.meta["val"].untyped_storage() is not n.args[0].meta["val"].untyped_storage()]
    assert reshapes and not copied, copied
    convs = [n for n in in_gdn if op_name_of(n.target) == "short_conv"]
    assert convs
    for conv in convs:
        x = conv.args[0]  # getitem of the projection's split: a row-strided view of the GEMM output
        assert x.meta["val"].stride()[1] == 1 and x.meta["val"].stride()[0] > x.meta["val"].shape[1]
