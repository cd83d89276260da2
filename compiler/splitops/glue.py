"""The glue of a program: the runs of graph nodes between op cores, cut the same way by the builder and the runtime.

A program alternates glue (projections, norms, rotary, gates, residual adds, the `out`
allocations) and op cores (`torch.ops.hgc.*`, which the runtime binds to backends). Inductor
compiles the glue; the op cores stay opaque calls made in place by the runtime. Every split plan
cuts only at op cores, so each glue run sits whole inside one captured piece of every mode's
plan: compiling the runs once serves every mode and every bucket. Which piece that is, is read
from the plan (split.json) alone, by `segment_pieces`.

1. `glue_segments(gm)`: the maximal runs of non-op nodes in graph order, each with the values it
   reads from outside (`inputs`, first use first) and the values read after it (`outputs`,
   graph order). A symbolic size read from outside (the token count, taken once by an earlier
   segment) is not an input when a tensor input has it as a dimension: the segment takes it from
   that tensor itself (`_border_reads`), so only tensors cross the glue's borders. The bundle
   builder (compiler/inductor_pieces.py) and the runtime (runtime/artifact/compiled_glue.py) both call it
   on the same graph, and the runtime refuses a bundle whose recorded segments differ from its own.
2. `segment_module(gm, segment)`: the run as a GraphModule of its own, placeholders `in_0..` in
   `inputs` order, then the sizes it takes from them (`size_0..`), and a tuple of `outputs`;
   nodes renamed `v0..` so that layers of one structure give the same code.
3. `structure_key(module)`: the SHA-256 of that code and of each input's dtype, sizes and strides
   (symbolic sizes named by first appearance): equal keys, one compile.
4. `segment_pieces(segments, plan)`: the captured piece of a split plan that runs each segment;
   a plan that cuts inside a segment, or leaves glue in an eager piece, raises GlueSplitError. The
   split pass checks it for every plan it makes, the builder before compiling anything, and the
   runtime installs each segment into the piece it names.

What it does not do: compile (compiler/inductor_pieces.py), or run anything (runtime/artifact/compiled_glue.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch
import torch.fx

from .artifact import CAPTURED, SplitPlan
from .ops import is_op_node

__all__ = ["GlueSegment", "GlueSplitError", "glue_segments", "segment_module", "structure_key", "input_specs",
           "segment_pieces"]


class GlueSplitError(ValueError):
    """A split plan that does not hold some glue segment whole in one captured piece."""


@dataclasses.dataclass(frozen=True)
class GlueSegment:
    """One run of glue: its node names in graph order, the outside values it reads, the values read after it."""

    index: int
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def to_json(self) -> dict:
        return {"index": self.index, "first": self.nodes[0], "last": self.nodes[-1], "size": len(self.nodes),
                "inputs": list(self.inputs), "outputs": list(self.outputs)}

    def matches(self, recorded: dict) -> bool:
        return self.to_json() == {k: recorded.get(k) for k in ("index", "first", "last", "size", "inputs", "outputs")}


def _border_reads(run: list[torch.fx.Node]) -> tuple[list[torch.fx.Node], dict]:
    """The values a run reads from outside, first use first, as (inputs, sizes): sizes maps each
    symbolic size among them that a tensor input has as a dimension to the first such (tensor,
    dim); inputs are the rest (a size no tensor input has stays one, and `input_specs` refuses it).

    Why: a model may take the token count once (`sym_size.int(input_ids, 0)`, MLA families) and
    view every later layer's attention output with it. Passed across a border it would be a SymInt
    input, which the cpu pieces cannot take: with Inductor's C++ wrapper, compile_fx replaces every
    non-tensor placeholder by None (`_extract_inputs_from_exported_gm`, torch 2.13), and the view
    fails on `[None, 64]`. The segment reads a tensor with that row count anyway (the op's `out` it
    views), so it takes the size from that tensor; the runtime then passes tensors only."""
    inside = set(run)
    reads = list(dict.fromkeys(a for n in run for a in n.all_input_nodes if a not in inside))
    dims = {}  # dimension expression -> (first tensor input with it, its index there)
    for node in reads:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt):
                    dims.setdefault(s.node.expr, (node, d))
    sizes = {n: dims[n.meta["val"].node.expr] for n in reads
             if isinstance(n.meta.get("val"), torch.SymInt) and n.meta["val"].node.expr in dims}
    return [n for n in reads if n not in sizes], sizes


def glue_segments(gm: torch.fx.GraphModule) -> list[GlueSegment]:
    """Step 1 of the module docstring. A run whose values nobody reads later (only checks) is kept:
    it has no outputs, and nothing is compiled for it."""
    runs: list[list[torch.fx.Node]] = [[]]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_op_node(node):
            runs.append([])
        else:
            runs[-1].append(node)
    segments = []
    for run in (r for r in runs if r):
        inside = set(run)
        inputs, _ = _border_reads(run)
        outputs = [n for n in run if any(u not in inside for u in n.users)]
        segments.append(GlueSegment(len(segments), tuple(n.name for n in run), tuple(n.name for n in inputs),
                                    tuple(n.name for n in outputs)))
    return segments


def segment_module(gm: torch.fx.GraphModule, segment: GlueSegment) -> torch.fx.GraphModule:
    """Step 2: the segment alone, with the source nodes' meta (their traced values) copied."""
    by_name = {n.name: n for n in gm.graph.nodes}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs, sizes = _border_reads([by_name[name] for name in segment.nodes])
    assert [n.name for n in inputs] == list(segment.inputs), f"segment {segment.index} is not of this graph"
    for i, node in enumerate(inputs):
        placeholder = graph.placeholder(f"in_{i}")
        placeholder.meta = dict(node.meta)
        env[node] = placeholder
    for i, (size, (tensor, dim)) in enumerate(sizes.items()):
        taken = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], dim))
        taken.meta = dict(size.meta)
        taken._rename(f"size_{i}")
        env[size] = taken
    for i, name in enumerate(segment.nodes):
        copied = graph.node_copy(by_name[name], lambda n: env[n])
        copied.meta = dict(by_name[name].meta)
        copied._rename(f"v{i}")
        env[by_name[name]] = copied
    graph.output(tuple(env[by_name[name]] for name in segment.outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def input_specs(module: torch.fx.GraphModule) -> list[dict]:
    """dtype, sizes and strides of each placeholder's traced value; a symbolic size is named by the
    order its symbol first appears (`T0`, `T1`), so graphs traced apart compare equal."""
    names: dict[str, str] = {}

    def dim(value) -> object:
        if isinstance(value, int):
            return value
        text = str(value)
        for symbol in sorted(value.node.expr.free_symbols, key=lambda s: text.find(str(s))):
            names.setdefault(str(symbol), f"T{len(names)}")
        expr = value.node.expr.xreplace({s: type(s)(names[str(s)]) for s in value.node.expr.free_symbols})
        return str(expr)

    specs = []
    for node in module.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"glue input {node.name} is not a tensor ({type(val).__name__}); only tensors cross "
                             f"the glue's borders")
        specs.append({"dtype": str(val.dtype), "sizes": [dim(s) for s in val.shape],
                      "strides": [dim(s) for s in val.stride()]})
    return specs


def structure_key(module: torch.fx.GraphModule) -> str:
    """Step 3: equal for two segments that compile to the same code."""
    text = json.dumps({"code": module.code, "inputs": input_specs(module)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def segment_pieces(segments: list[GlueSegment], plan: SplitPlan, program: str = "main") -> dict[int, int]:
    """Step 4: {segment index: index of the plan's piece that holds all its nodes}, for every segment."""
    piece_of = plan.piece_of()
    held: dict[int, int] = {}
    for segment in segments:
        pieces = sorted({piece_of[n] for n in segment.nodes})
        where = f"{program} glue segment {segment.index} (nodes {segment.nodes[0]}..{segment.nodes[-1]})"
        if len(pieces) > 1:
            raise GlueSplitError(f"{where} lies across pieces {', '.join(map(str, pieces[:-1]))} and {pieces[-1]} of "
                                 f"the {plan.mode.value} plan: a split plan may cut only at op nodes")
        if plan.pieces[pieces[0]].kind != CAPTURED:
            raise GlueSplitError(f"{where} lies in eager piece {pieces[0]} of the {plan.mode.value} plan: eager "
                                 f"pieces hold op cores only")
        held[segment.index] = pieces[0]
    return held
