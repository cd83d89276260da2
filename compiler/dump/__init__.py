"""Dumps of a compile for people: per program readable text and ONNX (for Netron), and one
picture of every program's layers (compiler/dump/layers.py).

`write_dumps(base, gm, ctx, title)` writes base.txt and base.onnx of one program and returns their
paths; `write_layer_picture(path, ctx, title)` writes the SVG of every program side by side. Both
read the facts passes left in node.meta["hgc.*"] and ctx.split_plans; they change nothing. The
DumpInstrument (compiler/passes/instruments.py) calls them before the pipeline and after every pass.
"""

from __future__ import annotations

from pathlib import Path

from compiler.dump.graph_view import GraphView
from compiler.dump.onnx_graph import onnx_model
from compiler.dump.layers import layer_picture, layer_rows
from compiler.dump.text import text_dump

__all__ = ["write_dumps", "write_layer_picture", "GraphView", "text_dump", "onnx_model", "layer_picture"]


def write_dumps(base: Path, gm, ctx, title: str, formats=("txt", "onnx")) -> list[Path]:
    view = GraphView.of(gm, ctx, title)
    written = []
    if "txt" in formats:
        path = base.with_suffix(".txt")
        path.write_text(text_dump(view))
        written.append(path)
    if "onnx" in formats:
        path = base.with_suffix(".onnx")
        path.write_bytes(onnx_model(view).SerializeToString(deterministic=True))
        written.append(path)
    return written


def write_layer_picture(path: Path, ctx, title: str) -> Path:
    """The layer picture of every program of `ctx` (main, then the draft beside it)."""
    tables = [layer_rows(ctx.programs[program], ctx, program) for program in ctx.program_names]
    path.write_text(layer_picture(tables, title))
    return path
