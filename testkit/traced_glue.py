"""A program's glue with each segment's own traced glue as its piece (`traced_glue`): what
runtime/artifact/compiled_glue.py installs when a piece is the segment itself rather than an
Inductor build, so tests/compiler/test_glue_in_split_plans.py and benchmarks/host/split_modules_bench.py
run the runtime's real install without compiling a bundle. And what the tests of the glue rewrites
(compiler/splitops/glue_ops.py) share: the tiny families' programs compiled for the CPU in a dtype
(`program_factory`), the builds they rewrite (`REWRITE_BUILDS`), their segments as modules
(`segment_modules`), random inputs for them (`random_inputs`), the check that a rewritten
segment gives the bits it gave (`assert_same_bits`) and a build's counts of a rewrite's calls
(`gqa_calls_per_forward`)."""

from __future__ import annotations

import contextlib
import io

import torch

from compiler.splitops.artifact import retarget_meta_devices
from compiler.splitops.glue import glue_segments, segment_module
from runtime.artifact.compiled_glue import CompiledGlue


# (family, dtype) builds a glue rewrite's tests take: every family in bfloat16, a cuda bundle's
# dtype, and qwen3_next in float32 too
REWRITE_BUILDS = [("qwen3_next", "bfloat16"), ("qwen3_next", "float32"), ("qwen3_5", "bfloat16"),
                  ("kimi_linear", "bfloat16"), ("bailing_linear", "bfloat16")]


def traced_piece(gm: torch.fx.GraphModule, segment, device: torch.device) -> torch.fx.GraphModule:
    module = segment_module(gm, segment)
    retarget_meta_devices(module.graph, device)
    module.recompile()
    return module


def traced_glue(gm: torch.fx.GraphModule, program: str, device: str = "cpu") -> CompiledGlue:
    """The program's glue with each segment's own traced glue as its piece."""
    segments = glue_segments(gm)
    records = [{**s.to_json(), "piece": f"pieces/{s.index}.bin" if s.outputs else None} for s in segments]
    pieces = {f"pieces/{s.index}.bin": traced_piece(gm, s, torch.device(device)) for s in segments if s.outputs}
    glue = CompiledGlue(program, records, pieces, "traced")
    glue.check(gm)
    return glue


def stand_in_inductor(monkeypatch, count) -> list:
    """compiler/inductor_pieces.compile_piece stood in for (a test of what compile_glue hands Inductor,
    without its C++ or Triton builds): each piece is saved as an empty file, and `count(module)` of
    every segment module it was handed goes into the list returned, in compile order."""
    import compiler.inductor_pieces as inductor_pieces

    compiled: list = []

    class Saved:
        def save(self, path, format):
            open(path, "wb").close()

    def compile_piece(module, device, config_patches=None):
        compiled.append(count(module))
        return Saved()

    monkeypatch.setattr(inductor_pieces, "compile_piece", compile_piece)
    return compiled


def program_factory(tmp_path_factory):
    """get(family, dtype) -> {program: GraphModule} of the tiny checkpoint compiled for the CPU in
    that dtype (float32: the suite's shared artifact), each compiled once per factory."""
    from hgc import main
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.loader import load_programs
    from testkit.helpers import shared_artifact, tiny_checkpoint
    from testkit.traces import shared_traces

    made: dict = {}

    def get(family: str, dtype: str = "bfloat16") -> dict[str, torch.fx.GraphModule]:
        if (family, dtype) not in made:
            if dtype == "float32":
                art = shared_artifact(tmp_path_factory, family)[1]
            else:
                root = tmp_path_factory.mktemp(f"glue-{family}-{dtype}")
                tiny_checkpoint(family, root / "ckpt", seed=3)
                err = io.StringIO()
                with shared_traces(), contextlib.redirect_stderr(err):
                    assert main(["compile", str(root / "ckpt"), "-o", str(root / "art"), "--target", "cpu",
                                 "--dtype", dtype, "--no-dumps", "--quiet"]) == 0, err.getvalue()[-3000:]
                art = root / "art"
            made[family, dtype] = {p: ep.graph_module for p, ep in load_programs(read_artifact(art)).items()}
        return made[family, dtype]

    return get


def segment_modules(gm: torch.fx.GraphModule):
    """(segment, its module) for every glue segment with outputs, retargeted to the CPU."""
    for segment in glue_segments(gm):
        if segment.outputs:
            yield segment, traced_piece(gm, segment, torch.device("cpu"))


def random_inputs(module: torch.fx.GraphModule, rows: int, seed: int) -> list[torch.Tensor]:
    """Every placeholder's value with each symbolic size `rows`: floats normal, integers (ids,
    positions, row indices) below `rows`."""
    g = torch.Generator().manual_seed(seed)

    def size(s):
        return s if isinstance(s, int) else int(s.node.expr.xreplace({x: rows for x in s.node.expr.free_symbols}))

    values = []
    for node in module.graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            shape = [size(s) for s in val.shape]
            if val.dtype.is_floating_point:
                values.append(torch.randn(shape, generator=g).to(val.dtype))
            else:
                values.append(torch.randint(0, rows, shape, generator=g).to(val.dtype))
    return values


# Outputs that are memory a segment allocates for a later op to fill: their bits are whatever the
# allocator handed out, so a rewritten segment and its reference need not agree on them.
_ALLOCATIONS = (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format,
                torch.ops.aten.new_empty.default)


def assert_same_bits(reference: torch.fx.GraphModule, rewritten: torch.fx.GraphModule, seed: int, where: str) -> None:
    """The rewritten segment against its unrewritten reference on the same random inputs, at a
    token count neither was traced with (3 rows): every output the same bits."""
    given = random_inputs(reference, rows=3, seed=seed)
    outputs = reference.graph.output_node().args[0]
    for node, got, want in zip(outputs, rewritten(*given), reference(*given)):
        if isinstance(want, torch.Tensor) and node.target not in _ALLOCATIONS:
            assert torch.equal(got, want), f"{where}: {node.name}"


def gqa_calls_per_forward(shared_art, monkeypatch, out, calls, **choice) -> tuple[dict, dict]:
    """compile_glue over a shared qwen3_next artifact (`shared_art`: its folder) with one rewrite's
    `choice` (e.g. sigmoid_gate=True), Inductor stood in for: ({program: the calls bundle records say
    a forward makes}, {program: its gqa_attention ops}). Each piece's recorded count is checked
    against `calls(module)` of the module it compiled; the keyword names the pieces' field."""
    import compiler.inductor_pieces as inductor_pieces
    from compiler.splitops import op_name_of, op_nodes
    from runtime.artifact.docs import read_artifact
    from runtime.artifact.loader import load_programs

    (field,) = choice
    docs = read_artifact(shared_art)
    gms = {p: ep.graph_module for p, ep in load_programs(docs).items()}
    compiled = stand_in_inductor(monkeypatch, lambda module: len(calls(module)))
    records, pieces = inductor_pieces.compile_glue(gms, docs.split_plans, "cpu", out, out / "cache", **choice)
    assert sorted(p[field] for p in pieces.values()) == sorted(compiled)
    per_forward = {p: sum(pieces[r["piece"]][field] for r in records[p] if r["piece"]) for p in gms}
    gqa = {p: sum(op_name_of(n.target) == "gqa_attention" for n in op_nodes(gm)) for p, gm in gms.items()}
    return per_forward, gqa
