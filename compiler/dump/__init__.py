"""Dumps of a program's graph for people: readable text, ONNX (for Netron) and an SVG picture.

`write_dumps(base, gm, ctx, title)` writes base.txt, base.onnx and base.svg and returns their
paths. It reads the facts passes left in node.meta["hgc.*"] and ctx.split_plans; it changes
nothing. The DumpInstrument (compiler/passes/instruments.py) calls it before the pipeline and
after every pass.
"""

from __future__ import annotations

from pathlib import Path

from compiler.dump.graph_view import GraphView
from compiler.dump.onnx_graph import onnx_model
from compiler.dump.svg import svg_picture
from compiler.dump.text import text_dump

__all__ = ["write_dumps", "GraphView", "text_dump", "onnx_model", "svg_picture"]


def write_dumps(base: Path, gm, ctx, title: str, formats=("txt", "onnx", "svg")) -> list[Path]:
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
    if "svg" in formats:
        path = base.with_suffix(".svg")
        path.write_text(svg_picture(view))
        written.append(path)
    return written
