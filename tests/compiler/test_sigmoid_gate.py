"""An attention output's sigmoid gate as one call of hgc_glue::sigmoid_gate (`hgc build --sigmoid-gate`), on the CPU.

1. The rewrite (compiler/splitops/glue_ops.py `use_sigmoid_gate`) on real traced glue: the tiny
   families compiled for the CPU (bfloat16, and qwen3_next in float32) take each GQA layer's gated
   output and leave the KDA and Lightning layers' (the gate of their own norm, which Inductor fuses);
   every rewritten segment gives the bits it gave on random inputs, since the op's CPU kernel is the
   traced glue's own two ops.
2. What it leaves as it was: a sigmoid something else reads, a gate of rows the segment normed, a
   broadcast product, mixed dtypes.
3. The op's CPU kernel against the two ops; registering the CUDA kernels installs the op's; a CPU
   Inductor piece holding the op gives the uncompiled piece's values.
4. compile_glue's counts per piece (the flag's refusals, bundle.json's field and `hgc inspect`'s
   column: tests/hgc/test_bundle_choices.py).

The kernel itself: tests/runtime/backends/test_sigmoid_gate.py (interpreter), tests/gpu/ (a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

from compiler.splitops import op_name_of, op_nodes
from compiler.splitops.glue_ops import SIGMOID_GATE, use_sigmoid_gate
from testkit.helpers import shared_artifact
from testkit.traced_glue import REWRITE_BUILDS, assert_same_bits, gqa_calls_per_forward, segment_modules

# ops whose output the layer gates with a sigmoid of a projection, by family: Qwen3-Next's and
# Qwen3.5's GQA layers (the gate beside q). Kimi's KDA and Ling's Lightning layers gate their own
# norm of the op's output, which the rewrite leaves to Inductor (`_segment_input`).
GATED = {"qwen3_next": ("gqa_attention",), "qwen3_5": ("gqa_attention",), "kimi_linear": (),
         "bailing_linear": ()}


def calls(module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in module.graph.nodes if n.target is SIGMOID_GATE]


@pytest.mark.parametrize("family,dtype", REWRITE_BUILDS)
def test_each_gated_layer_takes_one_call_and_every_rewritten_segment_gives_the_bits_it_gave(programs, family,
                                                                                          dtype):
    """Per program, the calls number the gated ops of GATED; every rewritten segment against
    itself unrewritten on the same random inputs at a token count it was not traced with: every
    output the same bits."""
    for program, gm in programs(family, dtype).items():
        taken = 0
        for segment, reference in segment_modules(gm):
            module = copy.deepcopy(reference)
            count = use_sigmoid_gate(module)
            assert count == len(calls(module)), f"{family} {program} segment {segment.index}"
            if not count:
                continue
            taken += count
            for call in calls(module):
                x, gate = (a.meta["val"] for a in call.args)
                assert x.shape == gate.shape and x.stride(-1) == gate.stride(-1) == 1
            assert_same_bits(reference, module, segment.index, f"{family} {program} segment {segment.index}")
        gated = sum(op_name_of(n.target) in GATED[family] for n in op_nodes(gm))
        assert taken == gated, (family, program, taken, gated)
        assert taken or program != "main" or not GATED[family]


# -- 2. what it leaves ----------------------------------------------------------------------------------


class Gate(torch.nn.Module):
    """An attention output gated by a sigmoid of the projection beside q, in the forms the rewrite
    must tell apart: "gate" (the layer's form), "read twice" (the sigmoid returned too), "normed"
    (the gate of the output's RMS norm, as KDA and Lightning layers gate theirs), "broadcast" (a gate
    of one channel a head), "mixed" (a float32 gate on bf16 rows)."""

    def __init__(self, kind: str, H=2, D=32):
        super().__init__()
        self.kind, self.H, self.D = kind, H, D

    def forward(self, attn, qg):
        H, D = self.H, self.D
        gate = qg.view(-1, H, 2 * D)[..., D:]
        if self.kind == "broadcast":
            gate = gate[..., :1]
        if self.kind == "mixed":
            gate = gate.float()
        s = torch.sigmoid(gate)
        rows = attn.view(-1, H, D)
        if self.kind == "normed":
            rows = (rows.float() * torch.rsqrt(rows.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(rows.dtype)
        out = rows * s
        return (out, s) if self.kind == "read twice" else (out,)


def exported(kind: str):
    model = Gate(kind)
    T = Dim("T", min=1, max=64)
    example = (torch.randn(5, 64).to(torch.bfloat16), torch.randn(5, 128).to(torch.bfloat16))
    return torch.export.export(model, example, dynamic_shapes=({0: T}, {0: T})).graph_module


@pytest.mark.parametrize("kind,takes", [("gate", 1), ("read twice", 0), ("normed", 0), ("broadcast", 0),
                                        ("mixed", 0)])
def test_the_rewrite_takes_the_layers_form_and_leaves_the_others(kind, takes):
    gm = exported(kind)
    rewritten = copy.deepcopy(gm)
    assert use_sigmoid_gate(rewritten) == takes
    left = {n.target for n in rewritten.graph.nodes}
    assert (torch.ops.aten.sigmoid.default in left) == (not takes)
    for rows in (1, 7):
        given = (torch.randn(rows, 64).to(torch.bfloat16), torch.randn(rows, 128).to(torch.bfloat16))
        for got, want in zip(rewritten(*given), gm(*given)):
            assert torch.equal(got, want)
            assert got.is_contiguous()


# -- 3. the op's kernels --------------------------------------------------------------------------------


def test_the_reference_is_the_two_ops_and_its_output_is_contiguous():
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(5, 3, 64).to(dtype)
        gate = torch.randn(5, 3, 128).to(dtype)[..., 64:]  # a strided view, as q's neighbour is
        got = SIGMOID_GATE(x, gate)
        assert torch.equal(got, x * torch.sigmoid(gate)) and got.is_contiguous()


def test_register_installs_the_ops_cuda_kernel():
    from runtime.backends import glue_kernels

    glue_kernels.register()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hgc_glue::sigmoid_gate", "CUDA")


@pytest.mark.slow  # one Inductor C++ compile: about 10 s on 2 cores
def test_a_piece_with_the_op_compiles_with_inductor_and_gives_the_uncompiled_values(tmp_path, one_thread):
    from compiler.inductor_pieces import compile_piece
    from compiler.splitops.bundle import cache_env
    from compiler.splitops.glue import glue_segments, segment_module

    gm = exported("gate")
    (segment,) = glue_segments(gm)
    reference_module, module = segment_module(gm, segment), segment_module(gm, segment)
    assert use_sigmoid_gate(module) == 1
    with cache_env({"inductor": tmp_path / "inductor"}):
        piece = compile_piece(module, torch.device("cpu"))
    for rows in (1, 7):  # neither is the traced count (5)
        given = {"attn": torch.randn(rows, 64).to(torch.bfloat16), "qg": torch.randn(rows, 128).to(torch.bfloat16)}
        inputs = [given[name] for name in segment.inputs]
        (got,), (want,) = piece(*inputs), reference_module(*inputs)
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)


# -- 4. the build decision ------------------------------------------------------------------------------


def test_compile_glue_counts_the_calls_per_piece(tmp_path_factory, tmp_path, monkeypatch):
    """compile_glue(sigmoid_gate=True) rewrites before the key is taken and it compiles (Inductor
    stood in for): per forward, one call for each GQA layer of each program."""
    per_forward, gqa = gqa_calls_per_forward(shared_artifact(tmp_path_factory, "qwen3_next")[1], monkeypatch,
                                             tmp_path, calls, sigmoid_gate=True)
    assert per_forward == gqa and gqa["main"] > 0
