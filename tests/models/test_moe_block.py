"""MoEBlock in every family: the whole block, shared expert included, is one `moe` op, and its
op-layout weights keep the release checkpoint names."""

from __future__ import annotations

import pytest
import torch

from models.common import MoEBlock
from models.families import get_family
from runtime.backends.protocol import protocol_args
from testkit.engine_toy import available_families, build_model

FAMILIES = [f for f in available_families() if f != "toy"]
MARK = 0.25  # what the recording op writes into `out`

# The shared expert's checkpoint names per family (the release names), relative to the block.
SHARED_NAMES = {
    "qwen3_next": ("shared_expert.{}_proj.weight", "shared_expert_gate.weight"),
    "qwen3_5": ("shared_expert.{}_proj.weight", "shared_expert_gate.weight"),
    "kimi_linear": ("shared_experts.{}_proj.weight", None),
    "bailing_linear": ("shared_experts.{}_proj.weight", None),
}


class RecordingMoE:
    """An op table with only `moe`: records its arguments (schema order) and writes MARK into `out`."""

    def __init__(self):
        self.calls: list[dict] = []

    def moe(self, *args):
        named = dict(zip(protocol_args("moe")[1:], args))  # protocol arguments after ctx
        self.calls.append(named)
        named["out"].fill_(MARK)


def _blocks(model) -> dict[str, MoEBlock]:
    return {name + ".": m for name, m in model.named_modules() if isinstance(m, MoEBlock)}


def test_every_family_is_checked():
    assert set(FAMILIES) == set(SHARED_NAMES)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_block_is_one_moe_op_that_gets_the_shared_expert(family):
    model = build_model(family)
    blocks = _blocks(model)
    assert blocks
    for name, block in blocks.items():
        ops = RecordingMoE()
        x = torch.randn(3, block.w13.shape[-1])
        with torch.no_grad():
            out = block(x, ops)
        assert len(ops.calls) == 1, f"{name}: one moe op per block"
        call = ops.calls[0]
        assert call["shared_w13"] is block.shared_w13 and call["shared_w2"] is block.shared_w2, name
        assert call["shared_gate"] is block.shared_gate, name
        # Nothing is added around the op: the block's output is the op's `out`.
        assert torch.equal(out, torch.full_like(out, MARK)), f"{name}: graph math after the moe op"


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_expert_weights_keep_the_release_checkpoint_names(family):
    model = build_model(family)
    tensors = model.checkpoint_tensors()
    mlp_name, gate_name = SHARED_NAMES[family]
    assert not [n for n in tensors if any(p in n.rsplit(".", 1)[-1] for p in MoEBlock.OP_LAYOUT_PARAMS)]
    for prefix, block in _blocks(model).items():
        S = block.shared_inter
        assert S > 0, f"{prefix}: the tiny {family} has a shared expert"
        gate, up, down = (tensors[prefix + mlp_name.format(p)] for p in ("gate", "up", "down"))
        assert torch.equal(gate, block.shared_w13[:S]) and torch.equal(up, block.shared_w13[S:])
        assert torch.equal(down, block.shared_w2)
        if gate_name is None:
            assert block.shared_gate is None
        else:
            assert torch.equal(tensors[prefix + gate_name], block.shared_gate)


def test_a_block_without_shared_experts_passes_none():
    family = get_family("bailing_linear")
    model = family.build(family.text_config(dict(family.make_config("tiny"), num_shared_experts=0)))
    block = next(iter(_blocks(model).values()))
    ops = RecordingMoE()
    block(torch.randn(2, block.w13.shape[-1]), ops)
    assert [ops.calls[0][k] for k in ("shared_w13", "shared_w2", "shared_gate")] == [None, None, None]
    assert not [n for n in model.checkpoint_tensors() if "shared" in n]
