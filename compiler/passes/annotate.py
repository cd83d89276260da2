"""AnnotateOpsPass: record, on every hgc op node, what it is and where it came from.

For each `torch.ops.hgc.<op>` node of the program, in node.meta:

    hgc.op        "gdn_core"                      the op name
    hgc.layer_id  3                               its layer id argument (None if not a constant int)
    hgc.kind      "gdn"                           the registry's kind for that layer (None: unknown id)
    hgc.draft     False                           whether the registry marks that layer as a draft layer
    hgc.stateful  True                            from the op declaration
    hgc.modules   [["model.layers.3", "pkg.Cls"]] the nn.Module stack, outermost first (informational)
    hgc.module    "pkg.Cls"                       the innermost module class (informational)

Module types are recorded for the lints' information only; nothing routes by them.

Example: the node `gdn_core` of a Qwen3-Next layer 0 gets
`{"hgc.op": "gdn_core", "hgc.layer_id": 0, "hgc.kind": "gdn", ...}`.
"""

from __future__ import annotations

import torch.fx

from compiler.passes.base import CompilePass, PassResult
from compiler.splitops import call_arguments, op_name_of, op_nodes, op_spec

__all__ = ["AnnotateOpsPass", "annotate_node", "module_stack"]


def module_stack(node: torch.fx.Node) -> list[list[str]]:
    """[[module path, class qualified name], ...] outermost first, from export's nn_module_stack."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for path, cls in stack.values():
        name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        out.append([str(path), name])
    return out


def annotate_node(node: torch.fx.Node, ctx) -> None:
    """The facts above on one op node (the fusion pass calls it for the nodes it makes)."""
    op = op_name_of(node.target)
    layer_id = call_arguments(node).get("layer_id")
    layer_id = layer_id if isinstance(layer_id, int) and not isinstance(layer_id, bool) else None
    spec = ctx.registry[layer_id] if layer_id is not None and layer_id in ctx.registry else None
    stack = module_stack(node)
    node.meta["hgc.op"] = op
    node.meta["hgc.layer_id"] = layer_id
    node.meta["hgc.kind"] = spec.kind.value if spec is not None else None
    node.meta["hgc.draft"] = spec.draft if spec is not None else None
    node.meta["hgc.stateful"] = op_spec(op).stateful
    node.meta["hgc.modules"] = stack
    node.meta["hgc.module"] = stack[-1][1] if stack else ""


class AnnotateOpsPass(CompilePass):
    name = "annotate"
    version = 1

    def __call__(self, gm, ctx) -> PassResult:
        for node in op_nodes(gm):
            annotate_node(node, ctx)
        return PassResult(gm, modified=False)

    def ensures(self, gm, ctx) -> None:
        assert all("hgc.op" in n.meta for n in op_nodes(gm)), "annotate: an op node was left without facts"
