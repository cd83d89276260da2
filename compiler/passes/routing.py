"""RoutingPass: bind every hgc op node to a backend, from the LayerRegistry, the capability table and the routes.

Sources of truth, and only these: the node's layer id argument, looked up in the LayerRegistry
(its kind), the node's own facts (the dtype of its `out`, its arguments' shapes), the op's
declaration (its capture policy), the backends' own declarations (compiler/splitops/capability.py:
device, ops, kinds, modes, dtypes, shape limits, kernel options) and the routes the user gave
(`hgc compile --route`). Module types are never consulted (docs/DESIGN.md failure 1: a linear layer
wrapped in an attention module was routed as full attention by its type).

For each op node, in graph order:

1. kind = registry[layer id].kind;
2. a route that applies binds it: `layers=3,7:BACKEND` (a listed layer, an op the backend
   implements) before `OP=BACKEND`; the backend must run on the target and serve the node
   (`capability.refusal`: op, kind, every mode, dtype under the route's kernel options, shapes),
   or the compile fails naming the
   layer, the backend and what it lacks;
3. otherwise the candidates are the backends of the target that declare the op (and the kind,
   where they restrict kinds), minus those that only a route may bind (`explicit_only`); those
   that refuse the node drop out, and the error, if none is left, names each with its reason
   (docs/DESIGN.md failure 9: a backend chosen without regard to dtype or shape limits);
4. among those left, the highest priority wins; among equals, one that can capture every mode in
   which the op's policy allows capture, then declaration order;
5. record the choice in node.meta["hgc.backend"] and one entry in ctx.routing[program]: backend,
   kernel options (each declared option resolved, a route's choice or the default), and what chose it;
   a route's choice the backend scopes to other ops (`choice_ops`: FlashInfer's extend_impl=triton
   on an MLA layer) fails the compile naming the layer and the choice.

With --batch-invariant (CompileConfig.batch_invariant), step 3 keeps only backends that declare
batch-invariant kernels (`BackendCapability.batch_invariant`), and step 5 sets the options that
declaration names; a route to a backend without one, or one that sets such an option otherwise,
is an error.

Route syntax (`parse_route`): `gdn_core=cpu_reference`, `layers=3,7:torch_reference`,
`gqa_attention=flashinfer[extend_impl=paged]`. A route that matches no node, names an unknown
backend or option, or whose backend implements none of a listed layer's ops is an error too.
The backend name `unfused` (ops.UNFUSED) is no backend: `gdn_fused=unfused` or `layers=3:unfused`
keeps a fused op's region as the model wrote it (the fusion pass reads it; routing skips it), and
is refused for an op that stands for no region (`moe=unfused`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from compiler.passes.base import CompilePass, PassResult, PostconditionError, PreconditionError
from compiler.splitops import (FUSED_OPS, MODES, OP_SPECS, UNFUSED, Capture, CapabilityError, CompileError, LayerKind,
                              call_facts, op_nodes, op_spec)

__all__ = ["RoutingPass", "RoutingError", "Route", "parse_route", "choose_backend"]


class RoutingError(CompileError):
    pass


@dataclasses.dataclass(frozen=True)
class Route:
    """One `--route`: bind the nodes of `op`, or of `layers`, to `backend` (with kernel `options`)."""

    backend: str
    op: Optional[str] = None
    layers: Optional[tuple[int, ...]] = None
    options: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        target = f"{self.op}=" if self.op else f"layers={','.join(map(str, self.layers))}:"
        opts = f"[{','.join(f'{k}={v}' for k, v in self.options)}]" if self.options else ""
        return f"{target}{self.backend}{opts}"


_ROUTE = re.compile(r"^(?:(?P<op>[a-z_]+)=|layers=(?P<layers>[0-9][0-9, ]*):)(?P<backend>[A-Za-z0-9_.\-]+)"
                    r"(?:\[(?P<options>[^\]]*)\])?$")


def parse_route(text: str) -> Route:
    """"gdn_core=cpu_reference" / "layers=3,7:fast_gdn" / "gqa_attention=flashinfer[extend_impl=paged]"."""
    match = _ROUTE.match(text.strip())
    if match is None:
        raise RoutingError(f"--route {text!r}: expected OP=BACKEND or layers=3,7:BACKEND, optionally followed by "
                           f"[option=choice,...] (ops: {', '.join(OP_SPECS)})")
    op = match["op"]
    if op is not None and op not in OP_SPECS:
        raise RoutingError(f"--route {text!r}: hgc has no op {op!r} (ops: {', '.join(OP_SPECS)})")
    if match["backend"] == UNFUSED and op is not None and op not in FUSED_OPS:
        raise RoutingError(f"--route {text!r}: {UNFUSED!r} keeps a fused op's region unfused, and hgc.{op} is no fused "
                           f"op (fused ops: {', '.join(FUSED_OPS)})")
    if match["backend"] == UNFUSED and match["options"]:
        raise RoutingError(f"--route {text!r}: {UNFUSED!r} is no backend and takes no kernel options")
    layers = None
    if match["layers"] is not None:
        layers = tuple(sorted({int(x) for x in match["layers"].replace(" ", "").split(",") if x}))
    options = []
    for part in (match["options"] or "").split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise RoutingError(f"--route {text!r}: kernel option {part!r} is not option=choice")
        options.append((key.strip(), value.strip()))
    return Route(match["backend"], op, layers, tuple(options))


def _where(node, layer_id, kind) -> str:
    return f"routing: node {node.name} (layer {layer_id}, kind {kind})"


def _route_for(node, routes: tuple[Route, ...], table) -> Optional[Route]:
    """The route that binds this node: a layer route whose backend implements the op, else an op route."""
    op, layer_id = node.meta["hgc.op"], node.meta["hgc.layer_id"]
    routes = tuple(r for r in routes if r.backend != UNFUSED)  # the fusion pass's word, not a binding
    by_layer = [r for r in routes if r.layers is not None and layer_id in r.layers and op in table[r.backend].ops]
    if len({r.backend for r in by_layer}) > 1:
        raise RoutingError(f"{_where(node, layer_id, node.meta['hgc.kind'])}: routes {', '.join(map(str, by_layer))} "
                           f"each claim it; give each layer one backend per op")
    if by_layer:
        return by_layer[-1]
    by_op = [r for r in routes if r.op == op]
    return by_op[-1] if by_op else None


def _routed(node, route: Route, ctx, facts):
    """The capability `route` binds `node` to, after checking the backend can serve it there."""
    layer_id, kind = node.meta["hgc.layer_id"], LayerKind(node.meta["hgc.kind"])
    cap = ctx.capabilities[route.backend]
    target = ctx.config.target
    if cap.device != target:
        raise RoutingError(f"{_where(node, layer_id, kind.value)}: route {route} names {cap.name}, which runs on "
                           f"{cap.device!r}, and the compile target is {target!r}; fix: route to a {target} backend "
                           f"or compile with --target {cap.device}")
    why = cap.refusal(facts.op, kind, facts.dtype, facts.shapes, dict(route.options))
    if why is not None:
        raise RoutingError(f"{_where(node, layer_id, kind.value)}: route {route} sends hgc.{facts.op} ({facts.dtype}) "
                           f"to {cap.name}, which {why}; fix: route this layer to a backend that serves it "
                           f"(hgc backends lists them)")
    return cap


def _automatic(node, ctx, facts):
    """The best backend of the target for `node` by declaration: step 3-4 of the module docstring."""
    op, layer_id = facts.op, node.meta["hgc.layer_id"]
    kind = LayerKind(node.meta["hgc.kind"])
    target = ctx.config.target
    table = ctx.capabilities
    candidates = table.candidates(op, kind, target)
    if not candidates:
        on_target = table.on_device(target)
        listing = "; ".join(f"{c.name} [{', '.join(sorted(c.ops))}]" + (" (only by --route)" if c.explicit_only else "")
                            for c in on_target) or "none"
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
    refusals = {c.name: c.refusal(op, kind, facts.dtype, facts.shapes) for c in full}
    fits = [c for c in full if refusals[c.name] is None]
    if not fits:
        considered = "; ".join(f"{name} {why}" for name, why in refusals.items())
        explicit = [c.name for c in table.on_device(target) if c.explicit_only and c.serves(op, kind)]
        also = f", or --route {op}={explicit[0]} (eager, slow)" if explicit else ""
        raise RoutingError(
            f"{_where(node, layer_id, kind.value)}: no backend on {target} runs hgc.{op} in {facts.dtype} with "
            f"shapes {dict(facts.shapes)} (considered: {considered}); fix: compile with another --dtype, or use a "
            f"checkpoint whose shapes a backend serves{also}")
    if ctx.config.batch_invariant:
        invariant = [c for c in fits if c.batch_invariant_for(op) is not None]
        if not invariant:
            raise RoutingError(
                f"{_where(node, layer_id, kind.value)}: --batch-invariant, and no backend that runs hgc.{op} here "
                f"declares batch-invariant kernels (considered: {', '.join(c.name for c in fits)}); fix: compile "
                f"without --batch-invariant, or give one of them a `batch_invariant` declaration")
        fits = invariant
    policy = op_spec(op).policy
    wanted = {m for m in MODES if policy[m] is Capture.CAPTURABLE}

    def uncapturable(c) -> int:  # under its default kernel options (a route picks others)
        return sum(not c.capturable(op, m) for m in wanted)

    return min(fits, key=lambda c: (-c.priority, uncapturable(c), fits.index(c)))


def choose_backend(node, ctx) -> tuple[object, dict, str]:
    """(capability, resolved kernel options, what chose it) for `node` on ctx.config.target."""
    facts = call_facts(node)
    route = _route_for(node, ctx.config.routes, ctx.capabilities)
    cap = _routed(node, route, ctx, facts) if route is not None else _automatic(node, ctx, facts)
    given = dict(route.options) if route is not None else {}
    if ctx.config.batch_invariant:
        given = _batch_invariant_options(node, cap, given, route)
    try:
        options = cap.resolve_options(given)
    except CapabilityError as e:
        raise RoutingError(f"routing: route {route}: {e}") from None
    why = cap.choice_refusal(facts.op, options)  # a default serves every op: only a route's choice is refused
    if why is not None:
        layer_id, kind = node.meta["hgc.layer_id"], node.meta["hgc.kind"]
        raise RoutingError(f"{_where(node, layer_id, kind)}: route {route} sends hgc.{facts.op} to {cap.name}, whose "
                           f"{why}; fix: route this layer without that choice")
    return cap, options, f"route {route}" if route is not None else "priority"


def _batch_invariant_options(node, cap, given: dict, route: Optional[Route]) -> dict:
    """`given` with the backend's batch-invariant choices set (--batch-invariant); a route that chose
    otherwise, or a backend with no such choices, is refused."""
    where = _where(node, node.meta["hgc.layer_id"], node.meta["hgc.kind"])
    declared = cap.batch_invariant_for(node.meta["hgc.op"])
    if declared is None:
        raise RoutingError(f"{where}: --batch-invariant, and route {route} names {cap.name}, which declares no "
                           f"batch-invariant kernels for hgc.{node.meta['hgc.op']}; fix: route it to a backend that "
                           f"does (hgc backends lists them) or compile without --batch-invariant")
    for option, choice in declared.items():
        if given.get(option, choice) != choice:
            raise RoutingError(f"{where}: --batch-invariant needs {cap.name}[{option}={choice}], and route {route} "
                               f"sets {option}={given[option]}; fix: drop that option from the route")
        given[option] = choice
    return given


def _check_routes(ctx) -> None:
    """Routes naming unknown backends, or layers the registry lacks: refused before any node."""
    for route in ctx.config.routes:
        if route.backend == UNFUSED:
            continue
        if route.backend not in ctx.capabilities:
            raise RoutingError(f"routing: route {route} names backend {route.backend!r}, which this installation does "
                               f"not have (backends: {', '.join(ctx.capabilities.names())}); fix: install the package "
                               f"that provides it (entry-point group hgc.backends) or name another")
        cap = ctx.capabilities[route.backend]
        if route.op is not None and route.op not in cap.ops:
            raise RoutingError(f"routing: route {route}: {cap.name} does not implement hgc.{route.op} (it declares "
                               f"{sorted(cap.ops)})")
        for layer_id in route.layers or ():
            if layer_id not in ctx.registry:
                raise RoutingError(f"routing: route {route}: the registry has no layer {layer_id} (layers: "
                                   f"{[spec.layer_id for spec in ctx.registry]})")


def _check_routes_used(ctx) -> None:
    """After every program is routed: each route bound at least one node, each listed layer a node."""
    bound = [e for entries in ctx.routing.values() for e in entries]
    for route in (r for r in ctx.config.routes if r.backend != UNFUSED):
        mine = [e for e in bound if e["chosen_by"] == f"route {route}"]
        if route.op is not None and not mine:
            raise RoutingError(f"routing: route {route} matches no node (no program calls hgc.{route.op}, or a layer "
                               f"route claims every one)")
        for layer_id in route.layers or ():
            if not any(e["layer_id"] == layer_id for e in mine):
                ops = sorted({e["op"] for e in bound if e["layer_id"] == layer_id})
                raise RoutingError(f"routing: route {route}: {route.backend} implements none of layer {layer_id}'s "
                                   f"ops {ops} (it declares {sorted(ctx.capabilities[route.backend].ops)})")


class RoutingPass(CompilePass):
    name = "routing"
    version = 2

    def requires(self, gm, ctx) -> None:
        for node in op_nodes(gm):
            if "hgc.op" not in node.meta:
                raise PreconditionError(f"routing: node {node.name} has no op facts; the annotate pass must run first")
            if node.meta["hgc.kind"] is None:
                raise PreconditionError(
                    f"routing: node {node.name} (layer {node.meta['hgc.layer_id']}) has no registry kind; "
                    f"the registry lints must pass before routing")

    def __call__(self, gm, ctx) -> PassResult:
        if ctx.program == ctx.program_names[0]:
            _check_routes(ctx)
        entries = []
        for node in op_nodes(gm):
            cap, options, chosen_by = choose_backend(node, ctx)
            node.meta["hgc.backend"] = cap.name
            node.meta["hgc.backend_options"] = options  # the split pass reads them (OpCapture)
            policy = op_spec(node.meta["hgc.op"]).policy
            entries.append({
                "node": node.name,
                "op": node.meta["hgc.op"],
                "layer_id": node.meta["hgc.layer_id"],
                "kind": node.meta["hgc.kind"],
                "draft": node.meta["hgc.draft"],
                "dtype": call_facts(node).dtype,
                "backend": cap.name,
                "options": options,
                "chosen_by": chosen_by,
                "policy": {m.value: policy[m].value for m in MODES},
                "backend_capturable": cap.capturable_modes(node.meta["hgc.op"], options),
                # modes captured only in steps of up to some tokens (whole-step graphs; a gap above)
                "backend_capture_bounds": cap.capture_bounds(node.meta["hgc.op"], options),
                "module": node.meta["hgc.module"],
                # the fusion pattern whose region this node stands for (compiler/passes/fusion.py)
                **({"fused": node.meta["hgc.fused"]} if node.meta.get("hgc.fused") else {}),
            })
        ctx.routing[ctx.program] = entries
        if ctx.program == ctx.program_names[-1]:
            _check_routes_used(ctx)
        return PassResult(gm, modified=False)

    def ensures(self, gm, ctx) -> None:
        unbound = [n.name for n in op_nodes(gm) if "hgc.backend" not in n.meta]
        if unbound:
            raise PostconditionError(f"routing: op nodes left without a backend: {unbound[:5]}")
