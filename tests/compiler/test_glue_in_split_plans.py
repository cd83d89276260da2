"""Glue segments against the split plans: every compiled piece runs inside the piece of each mode's plan that holds it.

compiler/splitops/glue.py cuts a program at every op node; each mode's split plan (split.json)
cuts at the op nodes that mode runs eagerly, so each glue segment lies whole in one captured piece
of every plan, and runtime/artifact/compiled_glue.py installs it there. A cuda target's plans cut more than
a cpu target's (attention eager in extend, mixed and target_verify), and a bfloat16 program reads
the embedding itself as its first residual: a later piece then takes a segment's values as inputs
of the same names. The first cuda build refused its own bundle there.

Building a cuda bundle needs the GPU (tests/gpu/test_gpu_inductor.py); the mapping does not. Each
family is compiled here for `--target cuda` (bfloat16, and Kimi in float32 as the GPU test builds
it) without a bundle, and each segment's piece is its own traced glue as a GraphModule
(`segment_module`, what Inductor would compile), so installing it is the runtime's real install.
On a cpu target in bfloat16 the same install then runs: its tokens are the traced glue's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import operator

import pytest
import torch

from hgc import main as hgc
from compiler.splitops import Mode
from compiler.splitops.artifact import CAPTURED, Piece, apply_split_plan, piece_module_names
from compiler.splitops.glue import glue_segments
from runtime.artifact.docs import LoadError, read_artifact
from runtime.artifact.compiled_glue import compiled_calls
from runtime.artifact.loader import load_programs
from testkit.helpers import tiny_checkpoint
from testkit.traced_glue import traced_glue

pytestmark = pytest.mark.usefixtures("one_thread", "shared_traces", "shared_loads")

CUDA_BUILDS = [("qwen3_next", "bfloat16"), ("qwen3_5", "bfloat16"), ("kimi_linear", "bfloat16"),
               ("bailing_linear", "bfloat16"), ("kimi_linear", "float32")]


def compile_artifact(tmp_path_factory, family: str, target: str, dtype: str):
    """`hgc compile` with the default --inductor of the target: (artifact, stderr)."""
    root = tmp_path_factory.mktemp(f"glue-{family}-{target}-{dtype}")
    # head_dim 64: FlashInfer builds no head dim 32 (tiny's GQA layers have 32)
    tiny_checkpoint(family, root / "ckpt", seed=3, **({"head_dim": 64} if family in ("qwen3_next", "qwen3_5") else {}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert hgc(["compile", str(root / "ckpt"), "-o", str(root / "art"), "--target", target, "--dtype", dtype,
                    "--no-dumps", "--quiet"]) == 0, err.getvalue()[-3000:]
    return root / "art", err.getvalue()


def piece_calls(module: torch.fx.GraphModule) -> tuple[list[int], list[str]]:
    """(the segment indices of the piece calls in one piece module, in order; the names of its other
    nodes, less placeholders, output and the reads of the calls' results)."""
    calls = [n for n in module.graph.nodes if n.op == "call_function" and hasattr(n.target, "hgc_piece")]
    rest = [n.name for n in module.graph.nodes if n.op not in ("placeholder", "output") and n not in calls
            and not (n.target is operator.getitem and n.args[0] in calls)]
    return [int(n.target.hgc_piece.rsplit("_", 1)[-1]) for n in calls], rest


@pytest.fixture(scope="module", params=CUDA_BUILDS, ids=[f"{f}-{d}" for f, d in CUDA_BUILDS])
def cuda_build(request, tmp_path_factory):
    family, dtype = request.param
    art, err = compile_artifact(tmp_path_factory, family, "cuda", dtype)
    docs = read_artifact(art)
    return docs, load_programs(docs), err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine builds the bundle (tests/gpu/test_gpu_inductor.py)")
def test_a_cuda_compile_without_a_gpu_says_where_its_bundle_is_built(cuda_build, tmp_path, capsys):
    """Asking for compiled pieces of a cuda target on a machine without a GPU is a usage error naming
    the way out; the default compile builds no bundle."""
    docs, _, err = cuda_build
    assert not docs.manifest.get("targets")
    assert "no compiled pieces in this artifact: this machine has no CUDA device" in err, err
    assert hgc(["compile", "unused", "-o", str(tmp_path / "a"), "--target", "cuda", "--inductor"]) == 2
    assert "run `hgc build ARTIFACT --device cuda` on the GPU machine" in capsys.readouterr().err


def test_every_segment_installs_in_the_captured_piece_of_every_plan_that_holds_it(cuda_build):
    docs, programs, _ = cuda_build
    cut = 0
    for program, ep in programs.items():
        gm = ep.graph_module
        segments = glue_segments(gm)
        glue = traced_glue(gm, program)
        for mode, plan in docs.split_plans[program].items():
            traced = apply_split_plan(gm, plan)
            split = glue.install(traced, plan)
            piece_of = plan.piece_of()
            assert all(plan.pieces[piece_of[n]].kind == CAPTURED for s in segments for n in s.nodes)
            # each piece: a call for each segment it holds, and of its own nodes only the op
            # nodes and the segments nothing reads (checks only) left as they were
            replaced = {n for s in segments if s.outputs for n in s.nodes}
            expected = {name: ([s.index for s in segments if s.outputs and piece_of[s.nodes[0]] == p.index],
                               [n for n in p.nodes if n not in replaced])
                        for name, p in zip(piece_module_names(plan), plan.pieces)}
            assert {name: piece_calls(getattr(split, name)) for name in expected} == expected, (program, mode)
            # the traced module is left as it was (the start-up check's reference), and a piece
            # with no compiled glue is its very object in both
            assert compiled_calls(traced) == 0 and compiled_calls(split) == sum(len(c) for c, _ in expected.values())
            assert all((getattr(split, name) is getattr(traced, name)) == (not calls)
                       for name, (calls, _) in expected.items()), (program, mode)
            cut += len(plan.pieces) > 1
    assert cut, "some plan of a cuda target cuts the program into several pieces"


def test_a_plan_that_cuts_inside_a_segment_is_refused_naming_both_pieces(cuda_build):
    docs, programs, _ = cuda_build
    gm = programs["main"].graph_module
    plan = docs.split_plans["main"][Mode.DECODE]
    segment = next(s for s in glue_segments(gm) if s.outputs and len(s.nodes) > 1)
    # decode runs the whole step as one captured piece; cut it inside the segment, as a stale or
    # foreign split.json could
    (whole,) = plan.pieces
    at = whole.nodes.index(segment.nodes[1])
    cut = dataclasses.replace(plan, pieces=(Piece(0, CAPTURED, whole.nodes[:at]), Piece(1, CAPTURED, whole.nodes[at:])))
    glue = traced_glue(gm, "main")
    with pytest.raises(LoadError, match=rf"main glue segment {segment.index} \(nodes {segment.nodes[0]}\.\."
                                        rf"{segment.nodes[-1]}\) lies across pieces 0 and 1 of the decode plan"):
        glue.install(apply_split_plan(gm, cut), cut)


def test_installed_glue_gives_the_tokens_of_the_traced_glue_on_a_bfloat16_cpu_target(tmp_path_factory):
    """The runtime's install, run: a bfloat16 qwen3_next on cpu, extend cut into a piece per op core."""
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.step.bound_ops import BoundOps
    from runtime.engine.generate import greedy_generate, make_pools
    from runtime.artifact.loader import ProgramRunner, load_artifact

    path, _ = compile_artifact(tmp_path_factory, "qwen3_next", "cpu", "bfloat16")
    art = load_artifact(path)
    assert art.compiled is None, "cpu compiles build no bundle unless asked (--inductor)"
    assert len(art.split_plans["main"][Mode.EXTEND].pieces) > 1
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 10, 11]]
    outputs = []
    for installed in (False, True):
        kv, st = make_pools(art.registry, 128, 4, page_size=8)
        ops = BoundOps(CPUReferenceBackend(kv, st))
        traced = art.runner(ops)
        glue = traced_glue(traced.program.graph_module, "main") if installed else None
        run = ProgramRunner("main", traced.program, traced.plans, traced.weights, ops, art.device, art.docs,
                            outputs=traced.outputs, glue=glue)
        if installed:
            assert compiled_calls(run.module_for(Mode.EXTEND)) >= 2 and compiled_calls(run.module_for(Mode.DECODE))
        # the logits: the main program of a model with a draft returns its hidden states too
        forward = lambda *inputs, run=run, ops=ops: run.user_outputs(ops.ctx.mode, inputs)[0]  # noqa: E731
        outputs.append(greedy_generate(forward, ops, kv, st, prompts, 4))
    assert outputs[0] == outputs[1]
