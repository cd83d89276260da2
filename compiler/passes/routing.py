"""RoutingPass: bind every hgc op node to a backend, from the LayerRegistry and the capability table.

Sources of truth, and only these: the node's layer id argument, looked up in the LayerRegistry
(its kind), the op's declaration (its capture policy), and the backends' own declarations
(`runtime/backends/capability.py`). Module types are never consulted (DESIGN.md failure 1: a
linear layer wrapped in an attention module was routed as full attention by its type).

For each op node, in graph order:

1. kind = registry[layer id].kind;
2. candidates = leaf backends on the compile target that declare the op (and the kind, where
   they restrict kinds), best first (priority, then declaration order);
3. keep those that support every mode; among them prefer one that can capture every mode in
   which the op's policy allows capture;
4. record the choice in node.meta["hgc.backend"] and one entry in ctx.routing[program].

A node no backend can take is a compile error naming pass, node, layer, kind and a fix.
"""

from __future__ import annotations

from compiler.passes.annotate import op_nodes
from compiler.passes.base import CompileError, CompilePass, PassResult, PostconditionError, PreconditionError
from compiler.splitops import MODES, Capture, LayerKind, op_spec

__all__ = ["RoutingPass", "RoutingError", "choose_backend"]


class RoutingError(CompileError):
    pass


def _where(node, layer_id, kind) -> str:
    return f"routing: node {node.name} (layer {layer_id}, kind {kind})"


def choose_backend(node, ctx):
    """The capability of the backend that runs `node` on ctx.config.target; RoutingError if none can."""
    op, layer_id = node.meta["hgc.op"], node.meta["hgc.layer_id"]
    kind = LayerKind(node.meta["hgc.kind"])
    target = ctx.config.target
    table = ctx.capabilities
    candidates = table.candidates(op, kind, target)
    if not candidates:
        on_target = table.on_device(target)
        listing = "; ".join(f"{c.name} [{', '.join(sorted(c.ops))}]" for c in on_target) or "none"
        devices = ", ".join(table.devices()) or "none"
        raise RoutingError(
            f"{_where(node, layer_id, kind.value)}: no backend on device {target!r} implements hgc.{op} for "
            f"{kind.value} layers (backends on {target}: {listing}; devices with backends: {devices}); "
            f"fix: declare {op} in the capability of a {target} backend (runtime/backends/), or compile "
            f"with --target set to a device that has one")
    full = [c for c in candidates if set(MODES) <= set(c.modes_supported)]
    if not full:
        best = max(candidates, key=lambda c: len(c.modes_supported))
        lacking = [m.value for m in MODES if m not in best.modes_supported]
        raise RoutingError(
            f"{_where(node, layer_id, kind.value)}: no backend supports mode {lacking[0]} for hgc.{op} "
            f"(closest: {best.name}, which supports {[m.value for m in MODES if m in best.modes_supported]}); "
            f"fix: add mode {lacking[0]} to the capability of a {target} backend that runs {op}")
    policy = op_spec(op).policy
    wanted = {m for m in MODES if policy[m] is Capture.CAPTURABLE}

    def uncapturable(c) -> int:
        return len(wanted - set(c.modes_capturable))

    return min(full, key=lambda c: (uncapturable(c), full.index(c)))


class RoutingPass(CompilePass):
    name = "routing"
    version = 1

    def requires(self, gm, ctx) -> None:
        for node in op_nodes(gm):
            if "hgc.op" not in node.meta:
                raise PreconditionError(f"routing: node {node.name} has no op facts; the annotate pass must run first")
            if node.meta["hgc.kind"] is None:
                raise PreconditionError(
                    f"routing: node {node.name} (layer {node.meta['hgc.layer_id']}) has no registry kind; "
                    f"the registry lints must pass before routing")

    def __call__(self, gm, ctx) -> PassResult:
        entries = []
        for node in op_nodes(gm):
            cap = choose_backend(node, ctx)
            node.meta["hgc.backend"] = cap.name
            policy = op_spec(node.meta["hgc.op"]).policy
            entries.append({
                "node": node.name,
                "op": node.meta["hgc.op"],
                "layer_id": node.meta["hgc.layer_id"],
                "kind": node.meta["hgc.kind"],
                "draft": node.meta["hgc.draft"],
                "backend": cap.name,
                "policy": {m.value: policy[m].value for m in MODES},
                "backend_capturable": [m.value for m in MODES if m in cap.modes_capturable],
                "module": node.meta["hgc.module"],
            })
        ctx.routing[ctx.program] = entries
        return PassResult(gm, modified=False)

    def ensures(self, gm, ctx) -> None:
        unbound = [n.name for n in op_nodes(gm) if "hgc.backend" not in n.meta]
        if unbound:
            raise PostconditionError(f"routing: op nodes left without a backend: {unbound[:5]}")
