"""The SVG picture: nodes as boxes on layers (longest path from the inputs), edges as lines.

Weights (lifted placeholders) are left out: they would add hundreds of boxes and no information.
hgc op nodes are coloured by layer kind, eager op cores (of the plan the view shows) get a thick
red outline, and a legend sits at the top. Layout is computed here (no graphviz binary):

1. depth(node) = 1 + max depth of its inputs (inputs at depth 0);
2. nodes of one depth sit on one row, left to right in graph order;
3. each edge is a straight line from the bottom of its source to the top of its target.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

import torch.fx

from compiler.dump.graph_view import GraphView, target_label

__all__ = ["svg_picture"]

BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 150, 30, 16, 26, 20
KIND_COLOURS = {"full_gqa": "#f4a261", "full_mla": "#e9c46a", "gdn": "#2a9d8f", "kda": "#57cc99",
                "lightning": "#90be6d", None: "#bdb2ff"}
MOE_COLOUR = "#8ecae6"
PLAIN_COLOUR = "#eeeeee"
INPUT_COLOUR = "#ffffff"


def _label(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return node.name
    if node.op == "output":
        return "output"
    domain, op = target_label(node)
    if domain == "hgc":
        return f"{op} L{node.meta.get('hgc.layer_id')}"
    return op.split(".")[0]


def svg_picture(view: GraphView) -> str:
    nodes = [n for n in view.nodes() if not (n.op == "placeholder" and n.name in view.lifted)]
    shown = {n.name for n in nodes}
    depth: dict[str, int] = {}
    for n in nodes:
        ins = [a.name for a in n.all_input_nodes if a.name in shown]
        depth[n.name] = 1 + max((depth[a] for a in ins), default=-1)
    rows: dict[int, list[torch.fx.Node]] = {}
    for n in nodes:
        rows.setdefault(depth[n.name], []).append(n)
    pos = {}
    for d, row in rows.items():
        for i, n in enumerate(row):
            pos[n.name] = (MARGIN + i * (BOX_W + GAP_X), MARGIN + 40 + d * (BOX_H + GAP_Y))
    width = MARGIN * 2 + max(len(r) for r in rows.values()) * (BOX_W + GAP_X) if rows else 200
    height = MARGIN * 2 + 40 + (max(rows) + 1 if rows else 1) * (BOX_H + GAP_Y)
    eager = set(view.plan.eager_nodes()) if view.plan is not None else set()
    plan_note = f" (outlined: eager in {view.plan.mode.value})" if view.plan is not None else ""
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
           f'font-size="10">',
           f'<text x="{MARGIN}" y="{MARGIN + 4}" font-size="13">{escape(view.program)}: after {escape(view.title)}'
           f'{escape(plan_note)}</text>']
    lx = MARGIN
    for kind, colour in list(KIND_COLOURS.items())[:-1] + [("moe", MOE_COLOUR)]:
        out.append(f'<rect x="{lx}" y="{MARGIN + 12}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{lx + 16}" y="{MARGIN + 22}">{kind}</text>')
        lx += 90
    for n in nodes:
        x2, y2 = pos[n.name]
        for a in n.all_input_nodes:
            if a.name in pos:
                x1, y1 = pos[a.name]
                out.append(f'<line x1="{x1 + BOX_W // 2}" y1="{y1 + BOX_H}" x2="{x2 + BOX_W // 2}" y2="{y2}" '
                           f'stroke="#999" stroke-width="0.8"/>')
    for n in nodes:
        x, y = pos[n.name]
        op = n.meta.get("hgc.op") or (target_label(n)[1] if target_label(n)[0] == "hgc" else None)
        if op == "moe":
            fill = MOE_COLOUR
        elif op is not None:
            fill = KIND_COLOURS.get(n.meta.get("hgc.kind"), KIND_COLOURS[None])
        else:
            fill = INPUT_COLOUR if n.op in ("placeholder", "output") else PLAIN_COLOUR
        stroke, sw = ("#d62828", 3) if n.name in eager else ("#555", 1)
        title = escape(f"{n.name}: {n.format_node() or ''}")
        out.append(f'<g><title>{title}</title><rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="4" '
                   f'fill="{fill}" stroke="{stroke}" stroke-width="{sw}"/>'
                   f'<text x="{x + 5}" y="{y + 19}">{escape(_label(n)[:22])}</text></g>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
