"""GraphView: what every dump format shows of one program's graph, read once from the FX graph.

It lists nodes in graph order with their type (dtype and shape, symbolic dims by name), their
arguments, the hgc facts the passes recorded, and, once the split pass has run, the pieces of
the plan that best shows the split (the first mode with eager gaps, usually extend).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.fx

from compiler.splitops import MODES, op_name_of
from compiler.splitops.artifact import SplitPlan

__all__ = ["GraphView", "value_type", "target_label"]


def value_type(val) -> tuple[Optional[torch.dtype], Optional[list]]:
    """(dtype, shape as ints / symbol names) of a node's meta value; (None, None) if not a tensor."""
    if isinstance(val, torch.Tensor):
        return val.dtype, [int(s) if isinstance(s, int) else str(s) for s in val.shape]
    if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
        return torch.int64, []
    if isinstance(val, (torch.SymFloat, float)):
        return torch.float32, []
    if isinstance(val, (torch.SymBool, bool)):
        return torch.bool, []
    return None, None


def target_label(node: torch.fx.Node) -> tuple[str, str]:
    """(domain, op type): ("hgc", "gdn_core"), ("aten", "linear.default"), ("python", "getitem")."""
    if node.op != "call_function":
        return "fx", node.op
    op = op_name_of(node.target)
    if op is not None:
        return "hgc", op
    name = getattr(node.target, "name", None)
    qualified = name() if callable(name) else None  # OpOverload: "aten::linear" + overload
    if isinstance(qualified, str) and "::" in qualified:
        ns, rest = qualified.split("::", 1)
        overload = getattr(node.target, "_overloadname", "default") or "default"
        return ns, f"{rest}.{overload}"
    return "python", getattr(node.target, "__name__", str(node.target))


@dataclasses.dataclass
class GraphView:
    title: str
    program: str
    gm: torch.fx.GraphModule
    lifted: set  # placeholder names that are parameters / buffers / constants
    plan: Optional[SplitPlan]  # the plan shown (None before the split pass)
    plans: dict  # every mode's plan for this program
    fusion: dict = dataclasses.field(default_factory=dict)  # the fusion pass's record for this program

    @classmethod
    def of(cls, gm, ctx, title: str) -> "GraphView":
        signature = ctx.signatures.get(ctx.program)
        lifted = set()
        if signature is not None:
            from torch.export.graph_signature import InputKind
            lifted = {s.arg.name for s in signature.input_specs if s.kind != InputKind.USER_INPUT}
        plans = dict(ctx.split_plans.get(ctx.program, {}))
        shown = next((plans[m] for m in MODES if m in plans and plans[m].counts()["eager"]), None)
        if shown is None and plans:
            shown = plans[next(m for m in MODES if m in plans)]
        return cls(title, ctx.program, gm, lifted, shown, plans, dict(getattr(ctx, "fusion", {}).get(ctx.program, {})))

    def nodes(self) -> list[torch.fx.Node]:
        return list(self.gm.graph.nodes)

    def piece_of(self) -> dict[str, int]:
        return self.plan.piece_of() if self.plan is not None else {}

    def facts(self, node: torch.fx.Node) -> dict:
        return {k[4:]: v for k, v in node.meta.items() if k.startswith("hgc.")}
