"""A GQA layer's q / k norms and rotary as one call of hgc_glue::qk_norm_rope (`hgc build --norm-rope`), on the CPU.

1. The rewrite (compiler/splitops/glue_ops.py `use_norm_rope`) on real traced glue: the tiny
   families compiled for the CPU (bfloat16, and qwen3_next in float32) fold each layer whose q and k
   heads are normed and rotated into one call, main and draft program alike: qwen3_next's and
   qwen3_5's GQA layers (unit-offset norms), bailing_linear's Lightning layers (plain norms);
   kimi_linear (MLA, and KDA without a rotary) has none to fold. Every rewritten segment gives the
   bits it gave on random inputs: the op's CPU kernel is the traced glue's own ops.
2. What it leaves as it was: a lone norm and rotary, GPT-J's rotation, a rotation of rows no norm
   made, normed rows something else reads too.
3. The op's CPU kernel is models/common.py's RMSNorm and apply_rotary, bit for bit; registering
   the CUDA kernels installs the op's.
4. A CPU Inductor piece holding the op gives the uncompiled piece's values.
5. compile_glue's counts (the flag's refusals, bundle.json's field and `hgc inspect`'s column:
   tests/hgc/test_bundle_choices.py).

The kernel itself: tests/runtime/backends/test_norm_rope.py (interpreter, and on a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

from compiler.splitops import op_name_of, op_nodes
from compiler.splitops.glue import glue_segments, segment_module
from compiler.splitops.glue_ops import QK_NORM_ROPE, norm_rope_rows, use_norm_rope
from models.common import RMSNorm, apply_rotary, rope_inv_freq
from testkit.helpers import shared_artifact
from testkit.traced_glue import REWRITE_BUILDS, assert_same_bits, gqa_calls_per_forward, segment_modules



# -- 1. the rewrite on traced glue ----------------------------------------------------------------------


def calls(module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in module.graph.nodes if n.target is QK_NORM_ROPE]


@pytest.mark.parametrize("family,dtype", REWRITE_BUILDS)
def test_each_layer_folds_once_and_every_rewritten_segment_gives_the_bits_it_gave(programs, family, dtype):
    """Per program, one call per layer whose attention op reads normed, rotated q and k heads
    (gqa_attention, lightning_core; the call's first two arguments q's and k's views of the
    projection), and every rewritten segment against itself unrewritten on the same random inputs at
    a token count it was not traced with: every output the same bits."""
    for program, gm in programs(family, dtype).items():
        folded = 0
        for segment, reference in segment_modules(gm):
            module = copy.deepcopy(reference)
            count = use_norm_rope(module)
            assert count == len(calls(module)) <= 1, f"{family} {program} segment {segment.index}"
            if not count:
                continue
            folded += 1
            (call,) = calls(module)
            q, k = (a.meta["val"] for a in call.args[:2])
            assert q.dim() == k.dim() == 3 and q.shape[1] >= k.shape[1] and q.shape[2] == k.shape[2], (q.shape, k.shape)
            assert_same_bits(reference, module, segment.index, f"{family} {program} segment {segment.index}")
        readers = 0 if family == "kimi_linear" else sum(op_name_of(n.target) in ("gqa_attention", "lightning_core")
                                                         for n in op_nodes(gm))
        assert folded == readers, (family, program, folded, readers)
        assert folded or family == "kimi_linear" or program != "main"


# -- 2. what it leaves ----------------------------------------------------------------------------------


class Heads(torch.nn.Module):
    """A GQA layer's glue from its projection's output to q and k, in the forms the rewrite must tell
    apart: `kind` "gqa" (q and k normed and rotated, the layer's form), "lone" (q only), "gptj" (the
    interleaved rotation), "no norm" (k rotated as it comes), "read twice" (q's normed rows returned too)."""

    def __init__(self, kind: str, H=2, Hk=1, D=32, R=8):
        super().__init__()
        self.kind, self.H, self.Hk, self.D, self.R = kind, H, Hk, D, R
        self.q_norm = RMSNorm(D, 1e-6, unit_offset=True)
        self.k_norm = RMSNorm(D, 1e-6, unit_offset=True)
        with torch.no_grad():
            self.q_norm.weight.normal_(0, 0.3)
            self.k_norm.weight.normal_(0, 0.3)

    def forward(self, qkv, positions):
        H, Hk, D, R = self.H, self.Hk, self.D, self.R
        q, k, _ = qkv.split([H * 2 * D, Hk * D, Hk * D], dim=-1)
        q, gate = q.view(-1, H, 2 * D).split([D, D], dim=-1)
        k = k.view(-1, Hk, D)
        gptj = self.kind == "gptj"
        qn = self.q_norm(q)
        q = apply_rotary(qn, positions, R, 1e7, interleaved=gptj)
        if self.kind == "lone":
            return q, gate
        k = apply_rotary(k if self.kind == "no norm" else self.k_norm(k), positions, R, 1e7, interleaved=gptj)
        return (q, k, gate, qn) if self.kind == "read twice" else (q, k, gate)


def exported(kind: str, dtype=torch.bfloat16) -> tuple[torch.fx.GraphModule, Heads]:
    model = Heads(kind)
    T = Dim("T", min=1, max=64)
    example = (torch.randn(5, 2 * 2 * 32 + 2 * 32).to(dtype), torch.arange(5))
    return torch.export.export(model.to(dtype), example, dynamic_shapes=({0: T}, {0: T})).graph_module, model


@pytest.mark.parametrize("kind,folds", [("gqa", 1), ("lone", 0), ("gptj", 0), ("no norm", 0), ("read twice", 0)])
def test_the_rewrite_takes_the_layers_form_and_leaves_the_others(kind, folds):
    gm, model = exported(kind)
    rewritten = copy.deepcopy(gm)
    assert use_norm_rope(rewritten) == folds
    if folds:  # what the rotation read is gone: no cos, sin or norm left for Inductor
        left = {n.target for n in rewritten.graph.nodes}
        assert not left & {torch.ops.aten.cos.default, torch.ops.aten.sin.default, torch.ops.aten.rsqrt.default}
    params = [p.detach() for p in (model.q_norm.weight, model.k_norm.weight)]
    for rows in (1, 7):
        given = (*params, torch.randn(rows, 192).to(torch.bfloat16), torch.randint(0, 9000, (rows,)))
        for got, want in zip(rewritten(*given), gm(*given)):
            assert torch.equal(got, want)


# -- 3. the op's kernels --------------------------------------------------------------------------------


def test_the_reference_is_the_models_norm_and_rotary():
    """norm_rope_rows (the op's CPU kernel) and models/common.py's RMSNorm then apply_rotary: the same bits."""
    for unit_offset, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        norm = RMSNorm(64, eps=1e-6, unit_offset=unit_offset).to(dtype)
        with torch.no_grad():
            norm.weight.normal_(0, 0.3)
        x, positions = torch.randn(5, 3, 64).to(dtype), torch.randint(0, 50000, (5,))
        inv = rope_inv_freq(16, 1e7)
        want = apply_rotary(norm(x), positions, 16, 1e7)
        assert torch.equal(norm_rope_rows(x, norm.weight, positions, inv, 1e-6, unit_offset), want)
        q, k = QK_NORM_ROPE(x, x[:, :1], norm.weight, norm.weight, positions, inv, 1e-6, unit_offset)
        assert torch.equal(q, want) and torch.equal(k, want[:, :1])


def test_register_installs_the_ops_cuda_kernel():
    from runtime.backends import glue_kernels

    glue_kernels.register()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hgc_glue::qk_norm_rope", "CUDA")


# -- 4. a CPU Inductor piece holding the op -------------------------------------------------------------


@pytest.mark.slow  # one Inductor C++ compile: about 10 s on 2 cores
def test_a_piece_with_the_op_compiles_with_inductor_and_gives_the_uncompiled_values(tmp_path, one_thread):
    from compiler.inductor_pieces import compile_piece
    from compiler.splitops.bundle import cache_env

    gm, model = exported("gqa")
    (segment,) = glue_segments(gm)
    reference_module, module = segment_module(gm, segment), segment_module(gm, segment)
    assert use_norm_rope(module) == 1
    with cache_env({"inductor": tmp_path / "inductor"}):
        piece = compile_piece(module, torch.device("cpu"))
    params = {"p_q_norm_weight": model.q_norm.weight.detach(), "p_k_norm_weight": model.k_norm.weight.detach()}
    for rows in (1, 7):  # neither is the traced count (5)
        given = {**params, "qkv": torch.randn(rows, 192).to(torch.bfloat16),
                 "positions": torch.randint(0, 9000, (rows,))}
        inputs = [given[name] for name in segment.inputs]
        got, want = piece(*inputs), reference_module(*inputs)
        assert len(got) == len(want) == 3
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=0, atol=0)


# -- 5. the build decision ------------------------------------------------------------------------------


def test_compile_glue_counts_the_calls_per_piece(tmp_path_factory, tmp_path, monkeypatch):
    """compile_glue(norm_rope=True) folds before the key is taken and it compiles (Inductor stood in
    for): per forward, one call for each GQA layer of each program (its gqa_attention ops)."""
    per_forward, gqa = gqa_calls_per_forward(shared_artifact(tmp_path_factory, "qwen3_next")[1], monkeypatch,
                                             tmp_path, calls, norm_rope=True)
    assert per_forward == gqa and gqa["main"] > 0
