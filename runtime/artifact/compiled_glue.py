"""Run a program's compiled glue in place of its traced glue: one call per glue run, op cores untouched.

    glue = bundle.glue("main")            # runtime/artifact/bundle.py: the pieces, loaded and checked
    glue.check(program_gm)                # the program cuts into the segments the bundle was built for
    compiled = glue.install(split_gm, plan)   # a module whose captured pieces call compiled pieces

1. `check(gm)`: `glue_segments(gm)` (compiler/splitops/glue.py, the cut the builder made) must give
   the segments bundle.json records, node for node; otherwise the bundle belongs to another graph.
   The segments are kept for step 2.
2. `install(split, plan)`: the plan says which piece runs each segment (`segment_pieces`: from
   split.json alone, refusing a plan that cuts inside a segment); in a copy of that piece's graph
   (apply_split_plan keeps node names) the segment's nodes are replaced by one call of its compiled
   piece with the segment's inputs, and its outputs are read back by position. A segment's nodes
   are found among the piece's own nodes, never its placeholders: a piece that reads a value of an
   earlier piece has a placeholder of that value's name. The op nodes between segments stay as
   they were: calls of the routed backend, mutating their `out` in place, which the next piece reads.

`split` itself is left as it was: the traced glue, the reference the start-up check compares with
(runtime/graphs/compiled_parity.py, through `ProgramRunner.module_for(mode, compiled=False)`). The module
install returns runs `split`'s own generated code over a table of submodules of its own: the new
pieces where glue was compiled, `split`'s pieces (the same objects) elsewhere. So a start-up splits
each program once per mode (splitting the 48 layers of Qwen3-Next-80B takes about a second a mode
on the CPU machine), and the graph runner, which wraps the captured pieces of the module it runs,
wraps the compiled module's, never the reference's. What it does not do: load or check bundle files
(runtime/artifact/bundle.py), or decide where pieces begin (the plan does).
"""

from __future__ import annotations

import copy
import operator
from typing import Callable

import torch
import torch.fx

from compiler.splitops.artifact import SplitPlan, piece_module_names
from compiler.splitops.glue import GlueSegment, GlueSplitError, glue_segments, segment_pieces
from runtime.artifact.docs import LoadError

__all__ = ["CompiledGlue", "compiled_calls"]


def _piece_call(piece, name: str) -> Callable:
    def call(*inputs):
        return piece(*inputs)

    call.__name__ = call.__qualname__ = name
    call.hgc_piece = name  # what `compiled_calls` counts
    return call


class CompiledGlue:
    """One program's segment records (bundle.json "programs") and the loaded pieces they name."""

    def __init__(self, program: str, records: list[dict], pieces: dict, bundle: str):
        self.program, self.records, self.bundle = program, records, bundle
        self._segments: list[GlueSegment] | None = None  # check(gm) sets them
        self._calls = {name: _piece_call(piece, f"hgc_piece_{name.rsplit('/', 1)[-1].split('.')[0]}")
                       for name, piece in pieces.items()}

    def check(self, gm: torch.fx.GraphModule) -> None:
        """Step 1: refuse a bundle cut from another graph."""
        segments = glue_segments(gm)
        if len(segments) != len(self.records):
            raise LoadError(f"bundle {self.bundle}: the {self.program} program cuts into {len(segments)} glue "
                            f"segments, the bundle was built for {len(self.records)}: rebuild it")
        for segment, record in zip(segments, self.records):
            if not segment.matches(record):
                raise LoadError(f"bundle {self.bundle}: {self.program} glue segment {segment.index} (from node "
                                f"{segment.nodes[0]}) is not the one the bundle was built for (from "
                                f"{record.get('first')}): rebuild it")
        self._segments = segments

    def install(self, split: torch.fx.GraphModule, plan: SplitPlan) -> torch.fx.GraphModule:
        """Step 2 for `split` (apply_split_plan(gm, plan) of the checked graph, left unchanged): the
        module that runs the compiled pieces."""
        if self._segments is None:
            raise RuntimeError(f"{self.program}: check(gm) the program before installing its compiled glue")
        try:
            held = segment_pieces(self._segments, plan, self.program)
        except GlueSplitError as e:
            raise LoadError(f"bundle {self.bundle}: {e}") from None
        names = piece_module_names(plan)
        by_piece: dict[int, list[GlueSegment]] = {}
        for segment, record in zip(self._segments, self.records):
            if record["piece"] is not None:
                by_piece.setdefault(held[segment.index], []).append(segment)
        replaced = {}
        for index, segments in by_piece.items():
            traced = getattr(split, names[index])
            graph = copy.deepcopy(traced.graph)
            self._install_segments(graph, names[index], segments)
            replaced[names[index]] = torch.fx.GraphModule(traced, graph)
        return _with_submodules(split, replaced)

    def _install_segments(self, graph: torch.fx.Graph, piece_name: str, segments: list[GlueSegment]) -> None:
        """In `graph` (a copy of piece `piece_name`'s): each segment's nodes become one call of its piece."""
        values = {n.name: n for n in graph.nodes}  # what a segment may read: placeholders included
        computed = {n.name: n for n in graph.nodes if n.op != "placeholder"}
        for segment in segments:
            where = f"bundle {self.bundle}: {self.program} glue segment {segment.index} in {piece_name}"
            try:
                nodes = [computed[n] for n in segment.nodes]
                inputs = tuple(values[n] for n in segment.inputs)
            except KeyError as e:
                raise LoadError(f"{where}: node {e} is not there; the split module is not of the checked "
                                f"graph") from None
            if any(a.next is not b for a, b in zip(nodes, nodes[1:])):
                raise LoadError(f"{where}: its nodes are not one run there; the split module is not of the "
                                f"checked graph")
            inside = set(nodes)
            with graph.inserting_before(nodes[0]):
                call = graph.call_function(self._calls[self.records[segment.index]["piece"]], inputs)
                outputs = [graph.call_function(operator.getitem, (call, i)) for i in range(len(segment.outputs))]
            for name, out in zip(segment.outputs, outputs):
                values[name].replace_all_uses_with(out, delete_user_cb=lambda user: user not in inside)
                values[name] = out  # a later segment of this piece reads it from here
            for n in reversed(nodes):
                graph.erase_node(n)


def _with_submodules(split: torch.fx.GraphModule, replaced: dict[str, torch.nn.Module]) -> torch.fx.GraphModule:
    """`split`'s generated forward over its own table of submodules, `replaced` swapped in.

    Not GraphModule(split, split.graph) nor copy.copy(split): both generate and compile the top
    module's code again, a third of a second for a 48-layer program's extend plan on the CPU
    machine, for code that calls its pieces by attribute name and so runs unchanged over another
    table. The top graph is shared and never rewritten (install rewrites copies of piece graphs).
    object.__new__: GraphModule.__new__ would make a class of its own, without split's forward."""
    top = object.__new__(type(split))
    top.__dict__.update(split.__dict__)
    top._modules = {**split._modules, **replaced}
    return top


def compiled_calls(module: torch.nn.Module) -> int:
    """How many compiled-piece calls a (split) module makes: 0 for traced glue."""
    return sum(1 for m in module.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function" and hasattr(n.target, "hgc_piece"))
