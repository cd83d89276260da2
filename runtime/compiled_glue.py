"""Run a program's compiled glue in place of its traced glue: one call per glue run, op cores untouched.

    glue = bundle.glue("main")            # runtime/bundle.py: the pieces, loaded and checked
    glue.check(program_gm)                # the program cuts into the segments the bundle was built for
    glue.install(split_gm)                # each captured piece's glue runs become calls of compiled pieces

1. `check(gm)`: `glue_segments(gm)` (compiler/splitops/glue.py, the cut the builder made) must give
   the segments bundle.json records, node for node; otherwise the bundle belongs to another graph.
2. `install(split)`: in every piece of a split program (apply_split_plan keeps node names), the
   nodes of each segment with a compiled piece are replaced by one call of that piece with the
   segment's inputs, and its outputs are read back by position. The op nodes between segments
   stay as they were: calls of the routed backend, mutating their `out` in place, which the next
   piece reads. A split plan cuts only at op nodes, so a segment never straddles two pieces.

The split module is otherwise unchanged, so the graph runner captures and replays it like the
traced one, and `ProgramRunner.module_for(mode, compiled=False)` still gives the traced glue:
the reference the start-up check compares with (runtime/compiled_parity.py). What it does not
do: load or check bundle files (runtime/bundle.py).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.fx

from compiler.splitops.glue import glue_segments
from runtime.artifact_docs import LoadError

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

    def install(self, split: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """Step 2, in place on `split`'s piece modules; returns `split`. Every segment with a
        compiled piece must have been found in exactly one piece."""
        installed: list[int] = []
        for name, piece in split.named_children():
            if isinstance(piece, torch.fx.GraphModule):
                installed += self._install_piece(piece, name)
        expected = [r["index"] for r in self.records if r["piece"] is not None]
        if sorted(installed) != expected:
            missing = sorted(set(expected) - set(installed))
            raise LoadError(f"bundle {self.bundle}: {self.program} glue segment(s) {missing[:3] or installed[:3]} "
                            f"found in no piece, or in two, of the split program: rebuild it")
        return split

    def _install_piece(self, piece: torch.fx.GraphModule, piece_name: str) -> list[int]:
        by_name = {n.name: n for n in piece.graph.nodes}
        changed: list[int] = []
        for record in self.records:
            if record["piece"] is None or record["first"] not in by_name:
                continue
            nodes = []
            node = by_name[record["first"]]
            while len(nodes) < record["size"]:
                if node.op in ("output", "placeholder", "root"):
                    raise LoadError(f"bundle {self.bundle}: {self.program} glue segment {record['index']} does not "
                                    f"lie whole in {piece_name}")
                nodes.append(node)
                node = node.next
            if nodes[-1].name != record["last"]:
                raise LoadError(f"bundle {self.bundle}: {self.program} glue segment {record['index']} ends at "
                                f"{nodes[-1].name} in {piece_name}, recorded {record['last']}: rebuild it")
            inside = set(nodes)
            try:
                inputs = tuple(by_name[n] for n in record["inputs"])
            except KeyError as e:
                raise LoadError(f"bundle {self.bundle}: {self.program} glue segment {record['index']} reads {e}, "
                                f"which {piece_name} does not have") from None
            with piece.graph.inserting_before(nodes[0]):
                call = piece.graph.call_function(self._calls[record["piece"]], inputs)
                outputs = [piece.graph.call_function(operator.getitem, (call, i))
                           for i in range(len(record["outputs"]))]
            for name, out in zip(record["outputs"], outputs):
                by_name[name].replace_all_uses_with(out, delete_user_cb=lambda user: user not in inside)
                by_name[name] = out  # a later segment of this piece reads it from here
            for n in reversed(nodes):
                piece.graph.erase_node(n)
            changed.append(record["index"])
        if changed:
            piece.recompile()
        return changed


def compiled_calls(module: torch.nn.Module) -> int:
    """How many compiled-piece calls a (split) module makes: 0 for traced glue."""
    return sum(1 for m in module.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function" and hasattr(n.target, "hgc_piece"))
