"""The readable text dump: one line per node, hgc facts beside op nodes, pieces marked after the split.

Example (Qwen3-Next tiny, after the split; extend plan)::

    # hgc dump: split   program: main   nodes: 585   hgc ops: 10
    # plans: decode 1 piece(s) (0 eager) | extend 21 piece(s) (10 eager) | ...
    # ---- piece 0: captured (extend) ----
    %embedding: float32[s0, 64] = aten.embedding.default(%p_model_embed_tokens_weight, %input_ids)
    ...
    # ---- piece 1: eager (extend) ----
    %short_conv: = hgc.short_conv(%cat, %squeeze, None, %empty_like, 0, True)   # layer 0 gdn -> cpu_reference

With `--overlap`, the side-stream branches of the shown plan (compiler/passes/overlap.py): where
each forks and joins, and its nodes::

    %to_15: float32[s72, 64] = aten.to.dtype.dtype(%mul_11, torch.float32)
    # fork 0: the side stream waits on the main stream here; 12 node(s) on it beside %moe (side 27152 B, main 199168 B at one token)
    %linear_default: float32[s72, 64] = aten.linear.default(%to_15, %p_model_layers_0_mlp_shared_w13)   # stream 1 (branch 0)
    ...
    # join 0: the main stream waits on the side stream here
    %add_tensor: float32[s72, 64] = aten.add.Tensor.Tensor(%to_18, %mul_tensor)

After the fusion pass, the regions it fused (and those it left, with the reason) head the dump,
and a fused node says which pattern it stands for::

    # fused: gdn at layers 0, 1, 2
    %gdn_fused: = hgc.gdn_fused(%getitem, %view, ..., %gdn_fused_out, 0, 2, 0.25, 1e-06)   # layer 0 gdn (fused gdn) -> cpu_reference

A tensor-parallel program (`--tp N`) also shows what one rank holds (the sharding pass's notes)::

    %p_model_layers_0_mlp_w13: float32[8, 32, 64] = weight   # shard: dim 1 / 2 in 2 segments
    %all_reduce_default: = hgc.all_reduce(%linear_2, 0)   # layer 0 gdn -> gloo (shard: collective after linear_2)
"""

from __future__ import annotations

import torch.fx

from compiler.dump.graph_view import GraphView, target_label, value_type
from compiler.splitops import MODES

__all__ = ["text_dump"]


def _arg(a) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v)}" for k, v in a.items()) + "}"
    return repr(a)


def _type(node) -> str:
    dtype, shape = value_type(node.meta.get("val"))
    if dtype is None:
        return ""
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(str(s) for s in shape)}]"


def _shard(node) -> str:
    """What one rank of a tensor-parallel program holds (the sharding pass's note), if anything."""
    return f"shard: {node.meta['hgc.shard']}" if node.meta.get("hgc.shard") else ""


def _facts(node, branch=None) -> str:
    if branch is not None:
        return f"   # stream 1 (branch {branch})"
    if "hgc.op" not in node.meta:
        shard = _shard(node)
        return f"   # {shard}" if shard else ""
    parts = [f"layer {node.meta.get('hgc.layer_id')}", str(node.meta.get("hgc.kind"))]
    if node.meta.get("hgc.fused"):
        parts.append(f"(fused {node.meta['hgc.fused']})")
    if "hgc.backend" in node.meta:
        parts.append(f"-> {node.meta['hgc.backend']}")
    if _shard(node):
        parts.append(f"({_shard(node)})")
    return "   # " + " ".join(parts)


def _fusion_lines(record: dict) -> list[str]:
    """What the fusion pass fused in this program, and each region it left, with the reason."""
    lines = []
    by_pattern: dict[str, list] = {}
    for e in record.get("fused", []):
        by_pattern.setdefault(e["pattern"], []).append(str(e["layer_id"]))
    if by_pattern:
        lines.append("# fused: " + " | ".join(f"{p} at layers {', '.join(ids)}" for p, ids in by_pattern.items()))
    lines += [f"# left unfused: {e['pattern']} at {e['node']} (layer {e['layer_id']}): {e['reason']}"
              for e in record.get("unfused", [])]
    return lines


def text_dump(view: GraphView) -> str:
    nodes = view.nodes()
    ops = [n for n in nodes if "hgc.op" in n.meta or target_label(n)[0] == "hgc"]
    lines = [f"# hgc dump: {view.title}   program: {view.program}   nodes: {len(nodes)}   hgc ops: {len(ops)}"]
    if view.plans:
        summary = " | ".join(f"{m.value} {len(view.plans[m].pieces)} piece(s) ({view.plans[m].counts()['eager']} eager"
                             + (f", {len(view.plans[m].side_branches())} side branches" if view.plans[m].side_branches()
                                else "") + ")" for m in MODES if m in view.plans)
        lines.append(f"# plans: {summary}")
    lines += _fusion_lines(view.fusion)
    piece_of = view.piece_of()
    forks, joins, side = _stream_marks(view)
    current = None
    for node in nodes:
        if node.op == "placeholder":
            kind = "weight" if node.name in view.lifted else "input"
            lines.append(f"%{node.name}: {_type(node)} = {kind}{_facts(node)}")
            continue
        if node.op == "output":
            lines += joins.get((current, None), []) if current is not None else []
            lines.append(f"return {_arg(node.args[0])}")
            continue
        piece = piece_of.get(node.name)
        if piece is not None and piece != current:
            if current is not None:
                lines += joins.get((current, None), [])
            current = piece
            lines.append(f"# ---- piece {piece}: {view.plan.pieces[piece].kind} ({view.plan.mode.value}) ----")
            lines += forks.get((piece, None), [])
        lines += joins.get((piece, node.name), [])
        domain, op = target_label(node)
        args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
        lines.append(f"%{node.name}: {_type(node)} = {domain}.{op}({args}){_facts(node, side.get(node.name))}")
        lines += forks.get((piece, node.name), [])
    return "\n".join(lines) + "\n"


def _stream_marks(view: GraphView) -> tuple[dict, dict, dict]:
    """The shown plan's side branches as dump lines: (piece, node after which it forks) -> lines,
    (piece, node before which it joins) -> lines (None: the piece's start / end), side node -> branch."""
    forks, joins, side = {}, {}, {}
    for number, (piece, branch) in enumerate(view.plan.side_branches() if view.plan is not None else []):
        forks.setdefault((piece, branch.fork_after), []).append(
            f"# fork {number}: the side stream waits on the main stream here; {len(branch.nodes)} node(s) on it "
            f"beside %{branch.anchor} (side {branch.side_bytes} B, main {branch.main_bytes} B at one token)")
        joins.setdefault((piece, branch.join_before), []).append(
            f"# join {number}: the main stream waits on the side stream here")
        side.update(dict.fromkeys(branch.nodes, number))
    return forks, joins, side
