"""The layer picture: one row per layer, every program side by side, what runs where in each mode.

    dumps/NN_<pass>.svg        main program on the left, the draft (MTP) program beside it

A node-level picture of even a tiny model is thousands of boxes (6016 x 10440 pixels for two
layers); Netron on the ONNX dump is the tool for nodes. This picture answers the questions a
reader of a dump has, for a 48-layer model on one screen:

- per layer: its id and kind (from the LayerRegistry), the op nodes it holds (hgc.op), the
  backend routing bound each to (hgc.backend);
- per mode: each op node captured (green) or an eager gap (red), as the split plans say, and a
  bracket beside the column for each captured piece, spanning the layers whose nodes it holds
  (so a piecewise plan shows where each CUDA graph starts and ends).

1. `layer_rows(gm, ctx, program)` assigns every node of the program to a row: a layer (from the
   op nodes' hgc.layer_id, and for other nodes the `layers.N` of their nn_module_stack), or the
   rows "in" (before the first layer: embedding) and "out" (after the last: norm, logits).
2. `layer_picture(tables, title)` draws the tables of every program side by side as SVG.

Before routing or split the columns stay empty (no backend, no plan yet). It changes nothing in
the graph.
"""

from __future__ import annotations

import dataclasses
import re
from xml.sax.saxutils import escape

import torch.fx

from compiler.splitops import MODES
from compiler.splitops.artifact import CAPTURED, EAGER, plan_node_names

__all__ = ["LayerRow", "LayerTable", "layer_rows", "layer_picture"]

KIND_COLOURS = {"full_gqa": "#f4a261", "full_mla": "#e9c46a", "gdn": "#2a9d8f", "kda": "#57cc99",
                "lightning": "#90be6d"}
STATE_COLOURS = {CAPTURED: "#52b788", EAGER: "#e63946"}
ROW_H, FONT, MARGIN, HEADER = 17, 11, 16, 64
# column widths in pixels: layer id, kind, ops, backends, then one per mode
COLUMNS = (("layer", 44), ("kind", 74), ("ops", 150), ("backend", 150))
MODE_W = 96
_LAYER_PATH = re.compile(r"(^|\.)layers\.(\d+)(\.|$)")


@dataclasses.dataclass
class LayerRow:
    label: str  # the layer id, or "in" / "out"
    kind: str = ""
    ops: list[str] = dataclasses.field(default_factory=list)  # op name per op node, in graph order
    backends: list[str] = dataclasses.field(default_factory=list)
    states: dict[str, list[str]] = dataclasses.field(default_factory=dict)  # mode -> captured/eager per op node


@dataclasses.dataclass
class LayerTable:
    program: str
    rows: list[LayerRow]
    pieces: dict[str, list[tuple[int, int, int]]]  # mode -> (piece index, first row, last row) of captured pieces
    modes: list[str]


def _module_layer(node: torch.fx.Node) -> int | None:
    """N of the innermost `...layers.N` module the node was traced in (None: outside every layer)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        match = _LAYER_PATH.search(str(path))
        if match:
            return int(match.group(2))
    return None


def layer_rows(gm: torch.fx.GraphModule, ctx, program: str) -> LayerTable:
    planned = set(plan_node_names(gm))
    nodes = [n for n in gm.graph.nodes if n.name in planned]
    ops = [n for n in nodes if n.meta.get("hgc.op")]
    # module index -> layer id, read off the op nodes (a config may number its layers from 1)
    index_to_id = {_module_layer(n): n.meta["hgc.layer_id"] for n in ops if _module_layer(n) is not None}
    order = list(dict.fromkeys(n.meta["hgc.layer_id"] for n in ops))
    rows = {"in": LayerRow("in"), **{lid: LayerRow(str(lid)) for lid in order}, "out": LayerRow("out")}
    row_of: dict[str, object] = {}
    current = "in"  # a node outside every layer module takes the row of the last op node before it
    for n in nodes:
        if n.meta.get("hgc.op"):
            current = n.meta["hgc.layer_id"]
        index = _module_layer(n)
        layer = index_to_id.get(index, index)
        row_of[n.name] = layer if layer in rows else current
    for n in reversed(nodes):  # after the last layer: the final norm and the logits
        if n.meta.get("hgc.op") or _module_layer(n) is not None:
            break
        row_of[n.name] = "out"
    for lid in order:
        if lid in ctx.registry:
            rows[lid].kind = ctx.registry[lid].kind.value
    for n in ops:
        row = rows[n.meta["hgc.layer_id"]]
        row.ops.append(n.meta["hgc.op"])
        row.backends.append(str(n.meta.get("hgc.backend") or ""))
    plans = ctx.split_plans.get(program, {})
    modes = [m.value for m in MODES if m in plans]
    keys = list(rows)
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for mode in MODES:
        if mode not in plans:
            continue
        kind_of = {name: p.kind for p in plans[mode].pieces for name in p.nodes}
        for n in ops:
            rows[n.meta["hgc.layer_id"]].states.setdefault(mode.value, []).append(kind_of.get(n.name, ""))
        spans = []
        for p in plans[mode].pieces:
            at = [keys.index(row_of[name]) for name in p.nodes if row_of.get(name) in rows]
            if p.kind == CAPTURED and at:
                spans.append((p.index, min(at), max(at)))
        pieces[mode.value] = spans
    return LayerTable(program, list(rows.values()), pieces, modes)


def _table_width(table: LayerTable) -> int:
    return sum(w for _, w in COLUMNS) + MODE_W * max(len(table.modes), 1)


def _cell(x: int, y: int, text: str, colour: str | None = None, bold: bool = False) -> str:
    fill = f' fill="{colour}"' if colour else ""
    weight = ' font-weight="bold"' if bold else ""
    return f'<text x="{x}" y="{y}"{fill}{weight}>{escape(text)}</text>'


def _draw(table: LayerTable, x0: int, y0: int) -> list[str]:
    out = [_cell(x0, y0 - 26, f"{table.program} program", bold=True)]
    x = x0
    for name, width in COLUMNS:
        out.append(_cell(x, y0 - 6, name, bold=True))
        x += width
    mode_x = x
    for i, mode in enumerate(table.modes):
        out.append(_cell(mode_x + i * MODE_W + 12, y0 - 6, mode, bold=True))
    for r, row in enumerate(table.rows):
        y = y0 + r * ROW_H
        if r % 2:
            out.append(f'<rect x="{x0 - 4}" y="{y}" width="{_table_width(table) + 4}" height="{ROW_H}" '
                       f'fill="#f5f5f5"/>')
        base = y + ROW_H - 5
        colour = KIND_COLOURS.get(row.kind)
        if colour:
            out.append(f'<rect x="{x0 + COLUMNS[0][1]}" y="{y + 2}" width="{COLUMNS[1][1] - 6}" height="{ROW_H - 4}" '
                       f'rx="3" fill="{colour}"/>')
        cells = (row.label, row.kind, " + ".join(row.ops), " + ".join(sorted(set(row.backends), key=row.backends.index)))
        x = x0
        for (name, width), text in zip(COLUMNS, cells):
            out.append(_cell(x + 2, base, text[: width // 6]))
            x += width
        for i, mode in enumerate(table.modes):
            cx = mode_x + i * MODE_W + 12
            for j, state in enumerate(row.states.get(mode, [])):
                fill = STATE_COLOURS.get(state, "#cccccc")
                out.append(f'<rect x="{cx + j * 38}" y="{y + 3}" width="34" height="{ROW_H - 6}" rx="2" fill="{fill}">'
                           f'<title>{escape(f"layer {row.label} {row.ops[j]}: {state} in {mode}")}</title></rect>')
                out.append(f'<text x="{cx + j * 38 + 3}" y="{base - 1}" font-size="9" fill="white">'
                           f'{"graph" if state == CAPTURED else state}</text>')
    # brackets: one per captured piece, left of its mode column, alternating two offsets so that
    # adjacent pieces that share a row stay apart
    for i, mode in enumerate(table.modes):
        bx = mode_x + i * MODE_W + 2
        for k, (index, first, last) in enumerate(table.pieces.get(mode, [])):
            left = bx + (k % 2) * 4
            top, bottom = y0 + first * ROW_H + 2, y0 + (last + 1) * ROW_H - 2
            out.append(f'<path d="M{left + 4},{top} H{left} V{bottom} H{left + 4}" fill="none" stroke="#1d3557" '
                       f'stroke-width="1.3"><title>{escape(f"{mode}: captured piece {index}")}</title></path>')
    return out


def layer_picture(tables: list[LayerTable], title: str) -> str:
    """SVG of every program's layer table, side by side, under one title and legend."""
    gap = 40
    width = MARGIN * 2 + sum(_table_width(t) for t in tables) + gap * (len(tables) - 1)
    height = MARGIN * 2 + HEADER + 20 + max((len(t.rows) for t in tables), default=1) * ROW_H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
           f'font-size="{FONT}">', f'<rect width="{width}" height="{height}" fill="white"/>',
           _cell(MARGIN, MARGIN + 4, f"after {title}: one row per layer; per mode, each op node captured (graph) "
                                      f"or an eager gap; a bracket spans each captured piece", bold=True)]
    lx = MARGIN
    for name, colour in [*KIND_COLOURS.items(), ("graph", STATE_COLOURS[CAPTURED]), ("eager", STATE_COLOURS[EAGER])]:
        out.append(f'<rect x="{lx}" y="{MARGIN + 12}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{lx + 16}" y="{MARGIN + 22}">{escape(name)}</text>')
        lx += 96
    x = MARGIN
    for table in tables:
        out += _draw(table, x, MARGIN + HEADER + 20)
        x += _table_width(table) + gap
    out.append("</svg>")
    return "\n".join(out) + "\n"
