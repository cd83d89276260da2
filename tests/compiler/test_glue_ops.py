"""The glue op hgc_glue::small_m_linear and its rewrite (compiler/splitops/glue_ops.py), on the CPU.

The rewrite takes bias-free 2-D float projections whose weight is a graph input and leaves every
other linear; the op computes F.linear on the CPU; a glue segment holding it compiles with Inductor
(the C++ wrapper, as cpu bundles build) and gives the uncompiled segment's values at token counts
it was not traced with; and the op is glue, not an op core: the cut between glue and op cores does
not stop at it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from compiler.splitops import is_hgc_op, is_op_node, op_nodes
from compiler.splitops.glue import glue_segments, segment_module
from compiler.splitops.glue_ops import SMALL_M_LINEAR, use_small_m_linear
from testkit.helpers import shared_artifact


class Glue(torch.nn.Module):
    """Two plain projections (one reading the other) and four linears the rewrite must leave."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 12, bias=False)
        self.down = torch.nn.Linear(12, 8, bias=False)
        self.biased = torch.nn.Linear(8, 4)
        self.register_buffer("int_weight", torch.ones(3, 8, dtype=torch.int64))

    def forward(self, x, seq, ids):  # x [T, 8], seq [2, T, 8], ids [T, 8] int64
        plain = self.down(torch.relu(self.up(x)))  # 2 plain projections
        biased = self.biased(x)  # a bias
        three_d = F.linear(seq, self.up.weight)  # a 3-D input
        computed = F.linear(x, self.up.weight * 2.0)  # a weight computed in the graph
        integer = F.linear(ids, self.int_weight)  # not a float
        return plain, biased, three_d, computed, integer


def exported() -> torch.fx.GraphModule:
    """The module exported with a dynamic token count: parameters lifted to placeholders, as in a program."""
    T = Dim("T", min=1, max=64)
    args = (torch.randn(5, 8), torch.randn(2, 5, 8), torch.ones(5, 8, dtype=torch.int64))
    return torch.export.export(Glue(), args, dynamic_shapes=({0: T}, {1: T}, {0: T})).graph_module


def values(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """Every placeholder's value by name: parameters, then inputs of `rows` tokens."""
    torch.manual_seed(seed)
    model = Glue()
    return {"p_up_weight": model.up.weight.detach(), "p_down_weight": model.down.weight.detach(),
            "p_biased_weight": model.biased.weight.detach(), "p_biased_bias": model.biased.bias.detach(),
            "b_int_weight": model.int_weight, "x": torch.randn(rows, 8), "seq": torch.randn(2, rows, 8),
            "ids": torch.randint(0, 4, (rows, 8))}


def call(gm: torch.fx.GraphModule, given: dict) -> tuple:
    return gm(*[given[n.name] for n in gm.graph.nodes if n.op == "placeholder"])


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (torch.ops.aten.linear.default, SMALL_M_LINEAR)]


def test_the_rewrite_takes_plain_projections_and_leaves_the_others():
    gm = exported()
    linear = torch.ops.aten.linear.default
    assert targets(gm).count(linear) == 6, gm.code
    assert use_small_m_linear(gm) == 2
    ops = [n for n in gm.graph.nodes if n.target is SMALL_M_LINEAR]
    assert [n.args[1].target for n in ops] == ["p_up_weight", "p_down_weight"]  # both weights: placeholders
    assert ops[1].args[0].args[0] is ops[0], "the second reads the first through the relu"
    left = [n for n in gm.graph.nodes if n.target is linear]
    assert len(left) == 4
    assert any(len(n.args) > 2 and n.args[2] is not None for n in left), "the biased one stays"
    assert any(n.args[0].meta["val"].dim() == 3 for n in left), "the 3-D one stays"
    assert any(n.args[1].op != "placeholder" for n in left), "the computed weight stays"
    assert any(n.args[0].meta["val"].dtype == torch.int64 for n in left), "the integer one stays"
    assert all(tuple(n.meta["val"].shape)[1:] == (12,) or tuple(n.meta["val"].shape)[1:] == (8,) for n in ops)
    assert use_small_m_linear(gm) == 0, "a second run finds nothing more"


def test_the_rewritten_graph_computes_what_it_did():
    gm = exported()
    given = values(3, seed=1)
    expected = call(gm, given)
    assert use_small_m_linear(gm) == 2
    for got, want in zip(call(gm, given), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_op_on_the_cpu_is_f_linear(dtype):
    x, w = torch.randn(3, 16).to(dtype), torch.randn(24, 16).to(dtype)
    got = SMALL_M_LINEAR(x, w)
    assert got.shape == (3, 24) and got.dtype == dtype
    torch.testing.assert_close(got, F.linear(x, w), rtol=0, atol=0)


def test_the_op_is_glue_not_an_op_core(tmp_path_factory):
    """A tiny qwen3_next program with every projection made the op cuts into the same glue runs, at
    the same op cores: glue.py cuts at `hgc` ops only. Every projection of its glue is a plain one."""
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.loader import load_programs

    gm = load_programs(read_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1]))["main"].graph_module
    before = [len(s.nodes) for s in glue_segments(gm)]
    cores = [n.name for n in op_nodes(gm)]
    linears = targets(gm).count(torch.ops.aten.linear.default)
    assert not is_hgc_op(SMALL_M_LINEAR)
    assert use_small_m_linear(gm) == linears > 0
    assert targets(gm) == [SMALL_M_LINEAR] * linears
    assert [n.name for n in op_nodes(gm)] == cores and not any(is_op_node(n) for n in gm.graph.nodes
                                                               if n.target is SMALL_M_LINEAR)
    assert [len(s.nodes) for s in glue_segments(gm)] == before


@pytest.mark.slow  # one Inductor C++ compile: about 15 s on 2 cores
def test_a_segment_with_the_op_compiles_with_inductor_and_gives_the_uncompiled_values(tmp_path, one_thread):
    from compiler.inductor_pieces import compile_piece
    from compiler.splitops.bundle import cache_env

    gm = exported()
    (segment,) = glue_segments(gm)
    reference, module = segment_module(gm, segment), segment_module(gm, segment)
    assert use_small_m_linear(module) == 2
    with cache_env({"inductor": tmp_path / "inductor"}):
        piece = compile_piece(module, torch.device("cpu"))
    for rows in (1, 7):  # neither is the traced count (5): one compile serves every token count
        given = values(rows, seed=rows)
        inputs = [given[name] for name in segment.inputs]
        got, want = piece(*inputs), reference(*inputs)
        assert len(got) == len(want) == len(segment.outputs)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
