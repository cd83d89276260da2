"""FusedLinear: sibling projections of one input as one GEMM, each part still read and written under
its release checkpoint name, in every family that stacks them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.common import FusedLinear, HybridLM
from testkit.engine_toy import available_families, build_model

FAMILIES = [f for f in available_families() if f != "toy"]


class _Parent(HybridLM):
    """A one-module model: the stack lives at `attn.in_proj`, its parts are `attn.<part>`."""

    def __init__(self, parts, bias):
        super().__init__({})
        self.attn = torch.nn.Module()
        self.attn.in_proj = FusedLinear(6, parts, bias=bias)


@pytest.mark.parametrize("bias", [False, True, ("k_proj",)], ids=["none", "all", "some"])
def test_parts_keep_their_names_and_give_their_own_projections(bias):
    parts = {"q_proj": 4, "k_proj": 3, "v_proj": 2}
    model = _Parent(parts, bias)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    tensors = model.checkpoint_tensors()
    biased = set(parts) if bias is True else set(bias or ())
    assert set(tensors) == ({f"attn.{p}.weight" for p in parts} | {f"attn.{p}.bias" for p in biased})
    x = torch.randn(5, 6, generator=g)
    outs = model.attn.in_proj(x)
    for part, out in zip(parts, outs):
        ref = F.linear(x, tensors[f"attn.{part}.weight"], tensors.get(f"attn.{part}.bias"))
        torch.testing.assert_close(out, ref)
    # The checkpoint names are views of the stack (no copies), so a checkpoint written from them and
    # read back fills the same bytes.
    fresh = _Parent(parts, bias)
    fresh.load_checkpoint_tensors({k: v.clone() for k, v in tensors.items()}.__getitem__)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_pieces_may_span_adjacent_parts():
    model = _Parent({"q_proj": 4, "k_proj": 3, "g_proj": 2}, False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the stack is allocated, not initialised: what it held could be NaN
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 6, generator=g)
    qk, gate = model.attn.in_proj(x, (7, 2))
    q, k, g = model.attn.in_proj(x)
    assert torch.equal(qk, torch.cat([q, k], dim=-1)) and torch.equal(gate, g)


def test_a_missing_part_is_named_on_load():
    from models.common import CheckpointError

    model = _Parent({"q_proj": 4, "k_proj": 3}, False)
    tensors = dict(model.checkpoint_tensors())
    del tensors["attn.k_proj.weight"]
    with pytest.raises(CheckpointError, match="attn.k_proj.weight"):
        model.load_checkpoint_tensors(tensors.__getitem__)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_stacks_its_sibling_projections_without_renaming_them(family):
    """Each family has stacked projections, and no checkpoint name carries the stack's own name."""
    model = build_model(family)
    stacks = [m for m in model.modules() if isinstance(m, FusedLinear)]
    assert stacks, f"{family}: no stacked projections"
    assert all(len(m.parts) >= 2 for m in stacks), f"{family}: a stack of one projection saves no launch"
    names = model.checkpoint_tensors()
    assert not [n for n in names if ".in_proj.weight" in n or ".qkv_proj." in n], sorted(names)[:5]
    for m in stacks:
        assert sum(m.parts.values()) == m.weight.shape[0]
