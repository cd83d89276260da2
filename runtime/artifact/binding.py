"""The routing table is the binding: build the backends routing.json names and bind each op node to its instance.

    backends = build_backends(art.docs, art.programs, kv_pool, state_pool)   # what routing.json names, only that
    ops = BoundOps(backends.for_program("main"))       # hooks reach every instance owning a node of the program
    gm = bind_graph(program_gm, "main", art.docs, ops, device)                # each node calls its own instance
    check_binding(gm, "main", art.docs, ops)           # start-up: every bound node against routing.json

Lifecycle:

1. `routed_calls` pairs every routing.json entry of a program with its op node in the loaded graph,
   by node name; an entry without a node, a node without an entry, or a pair whose op or layer
   differ is refused, naming the layer.
2. `build_backends` takes, for each backend instance the entries name (a backend with its kernel
   options: `RouteEntry.instance`), the class of that name from the backend registry (built-in or
   installed under the entry-point group `hgc.backends`). It refuses, naming the layer: a backend
   this runtime does not have; one whose declaration here does not serve the node (op, layer
   kind, modes, dtype, shapes: the same `capability.refusal` routing asked) or runs on another
   device than the run's; options the declaration does not offer, or a choice it scopes to other
   ops (`choice_ops`). Then each class builds its
   instance with `build(BackendSetup)`: the pools, the device, the node facts of its calls, the
   options. Nothing else is built.
3. `Backends.for_program(program)`: a BackendSet over the instances owning a node of the program,
   with, per mode, those owning a node inside a captured piece of split.json's plan (they get
   `init_replay_state`) and those owning a node in one of its eager gaps (before a piecewise step
   they alone plan eagerly).
4. `bind_graph` copies a program's graph onto the device and makes every op node call
   `ops.call_of(instance, op)` with the op's arguments in schema order.
5. `check_binding` walks the bound graph and compares each op node's instance and op with its
   entry; on any difference the runtime refuses to serve, naming the layer.

Nothing here reads a device type, a module type or an op name to decide which backend runs a node:
routing.json decided, at compile time. What it does not do: choose (routing did), run a step.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.fx

from compiler.splitops import CapabilityError, LayerKind, Mode, call_arguments, call_facts, op_name_of
from compiler.splitops.artifact import CAPTURED, RouteEntry, retarget_meta_devices
from runtime.artifact.docs import ArtifactDocs, LoadError
from runtime.backends.backend_set import BackendSet
from runtime.backends.protocol import BackendHooks, BackendSetup
from runtime.step.bound_ops import BoundOps, backend_name

__all__ = ["Backends", "build_backends", "routed_calls", "bind_graph", "check_binding", "members_of"]


def _op_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and op_name_of(n.target) is not None]


def _at(entry: RouteEntry, program: str) -> str:
    return f"layer {entry.layer_id} ({program} program, node {entry.node}, hgc.{entry.op})"


def routed_calls(docs: ArtifactDocs, program: str, gm: torch.fx.GraphModule) -> list[tuple[RouteEntry, torch.fx.Node]]:
    """(entry, node) for every op node of the program, in graph order; step 1 of the module docstring."""
    entries = {e.node: e for e in docs.routing.entries(program)}
    pairs = []
    for node in _op_nodes(gm):
        entry = entries.pop(node.name, None)
        if entry is None:
            layer = call_arguments(node).get("layer_id")
            raise LoadError(f"{docs.path}: routing.json has no entry for node {node.name} (layer {layer}, "
                            f"hgc.{op_name_of(node.target)}) of the {program} program: no backend is bound to it; "
                            f"recompile")
        op, layer_id = op_name_of(node.target), call_arguments(node).get("layer_id")
        if entry.op != op or entry.layer_id != layer_id:
            raise LoadError(f"{docs.path}: routing.json says node {node.name} is hgc.{entry.op} of layer "
                            f"{entry.layer_id}; the {program} graph has hgc.{op} of layer {layer_id}; recompile")
        pairs.append((entry, node))
    if entries:
        entry = next(iter(entries.values()))
        raise LoadError(f"{docs.path}: routing.json binds {_at(entry, program)}, a node the graph does not have: "
                        f"the document belongs to another compile; recompile")
    return pairs


@dataclasses.dataclass
class Backends:
    """The backend instances one artifact's routing.json names, by instance key, and one BackendSet per program."""

    instances: dict[str, BackendHooks]
    sets: dict[str, BackendSet]
    routes: dict[str, dict[tuple[str, int], str]]  # program -> (op, layer id) -> instance key

    def for_program(self, program: str = "main") -> BackendSet:
        try:
            return self.sets[program]
        except KeyError:
            raise LoadError(f"no {program} program was bound (programs: {sorted(self.sets)})") from None

    def op_table(self, program: str = "main") -> BoundOps:
        """An op table over the program's backend set that also serves an eager model of the same
        checkpoint: each `ops.<op>(..., layer_id, ...)` goes to the instance routing.json names for
        that layer's node (a graph bound with it calls its instances directly)."""
        backends = self.for_program(program)  # refuses a program that was not bound
        return BoundOps(backends, {k: self.instances[key] for k, key in self.routes[program].items()})


def _refusal(entry: RouteEntry, facts, cls, device: torch.device) -> Optional[str]:
    """Why the class this runtime has under the entry's name cannot run its node here, or None."""
    cap = cls.capability
    if torch.device(cap.device).type != device.type:
        return f"{cap.name} runs on {cap.device}, this run is on {device}"
    kind = LayerKind(entry.kind) if entry.kind is not None else None
    why = cap.refusal(facts.op, kind, facts.dtype, facts.shapes, entry.options)
    if why is not None:
        return f"{cap.name} {why}"
    try:
        resolved = cap.resolve_options(entry.options)
    except CapabilityError as e:
        return str(e)
    if resolved != entry.options:
        return f"{cap.name} declares options {sorted(resolved)}, routing.json recorded {sorted(entry.options)}"
    why = cap.choice_refusal(facts.op, resolved)
    return f"{cap.name}'s {why}" if why is not None else None


def build_backends(docs: ArtifactDocs, programs: dict, kv_pool, state_pool, device: torch.device | str,
                   registry=None, snapshots=None) -> Backends:
    """Step 2-3 of the module docstring. `registry`: a BackendRegistry (default: runtime.backends.discover());
    `snapshots`: the prefix cache's SnapshotPool (None: caching off), for the backends that write in-step snapshots."""
    from runtime.backends import discover

    registry = registry if registry is not None else discover()
    device = torch.device(device)
    calls: dict[str, list] = {}  # instance key -> CallFacts of its nodes, every program
    first: dict[str, RouteEntry] = {}
    members: dict[str, list[str]] = {}
    captured: dict[str, dict[Mode, list[str]]] = {}
    gaps: dict[str, dict[Mode, list[str]]] = {}
    routes: dict[str, dict[tuple[str, int], str]] = {}
    for program in sorted(programs, key=lambda p: p != "main"):  # main first: its layers come first
        ep = programs[program]
        plans = docs.split_plans[program]
        in_captured = {mode: {n for p in plan.pieces if p.kind == CAPTURED for n in p.nodes}
                       for mode, plan in plans.items()}
        in_gaps = {mode: set(plan.eager_nodes()) for mode, plan in plans.items()}
        members[program], captured[program], routes[program] = [], {mode: [] for mode in Mode}, {}
        gaps[program] = {mode: [] for mode in plans}
        for entry, node in routed_calls(docs, program, ep.graph_module):
            if entry.backend not in registry:
                raise LoadError(f"{docs.path}: routing.json routes {_at(entry, program)} to backend "
                                f"{entry.backend!r}, which this runtime does not have (backends: "
                                f"{', '.join(registry.names())}); install the package that provides it "
                                f"(entry-point group hgc.backends) or recompile")
            facts = call_facts(node)
            why = _refusal(entry, facts, registry.backend_class(entry.backend), device)
            if why is not None:
                raise LoadError(f"{docs.path}: routing.json binds {_at(entry, program)} to {entry.backend}, which "
                                f"this runtime cannot bind: {why}; recompile for this runtime")
            key = entry.instance
            routes[program][(entry.op, entry.layer_id)] = key
            calls.setdefault(key, []).append(facts)
            first.setdefault(key, entry)
            if key not in members[program]:
                members[program].append(key)
            for by_mode, names_by_mode in ((captured[program], in_captured), (gaps[program], in_gaps)):
                for mode, names in names_by_mode.items():
                    if node.name in names and key not in by_mode[mode]:
                        by_mode[mode].append(key)
    instances = {}
    for key, facts in calls.items():
        entry = first[key]
        cls = registry.backend_class(entry.backend)
        setup = BackendSetup(kv_pool, state_pool, device, tuple(facts), dict(entry.options), snapshots)
        try:
            instances[key] = cls.build(setup)
        except (ValueError, TypeError, KeyError, ImportError, RuntimeError) as e:
            layers = setup.layer_ids()
            raise LoadError(f"{docs.path}: backend {key} ({registry.source(entry.backend)}) for layers {layers} "
                            f"failed to build: {type(e).__name__}: {e}") from e
    sets = {program: BackendSet({k: instances[k] for k in keys}, {m: tuple(v) for m, v in captured[program].items()},
                                {m: tuple(v) for m, v in gaps[program].items()})
            for program, keys in members.items()}
    return Backends(instances, sets, routes)


def members_of(backend) -> dict[str, BackendHooks]:
    """The instances an op table's backend offers, by instance key: a BackendSet's members, or one
    plain backend under its declared name (a backend of no kernel options, made by hand)."""
    if isinstance(backend, BackendSet):
        return backend.members
    return {backend_name(backend): backend}


def bind_graph(gm: torch.fx.GraphModule, program: str, docs: ArtifactDocs, ops: BoundOps,
               device: torch.device) -> torch.fx.GraphModule:
    """A copy of `gm` on `device` whose every op node calls its routed instance (step 4)."""
    graph = torch.fx.Graph()
    env: dict = {}
    graph.output(graph.graph_copy(gm.graph, env))
    retarget_meta_devices(graph, device)
    offered = members_of(ops.backend)
    calls: dict[tuple[str, str], Callable] = {}
    pairs = {node.name: entry for entry, node in routed_calls(docs, program, gm)}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        op = op_name_of(node.target)
        if op is None:
            continue
        entry = pairs[node.name]
        if entry.instance not in offered:
            raise LoadError(f"{docs.path}: routing.json binds {_at(entry, program)} to {entry.instance}, and the op "
                            f"table offers {sorted(offered)}; build the op table over the backends routing.json "
                            f"names (LoadedArtifact.backends)")
        key = (entry.instance, op)
        if key not in calls:
            calls[key] = ops.call_of(offered[entry.instance], op)
        args = tuple(call_arguments(node).values())
        node.target, node.args, node.kwargs = calls[key], args, {}
    return torch.fx.GraphModule(gm, graph)


def check_binding(bound: torch.fx.GraphModule, program: str, docs: ArtifactDocs, ops: BoundOps) -> None:
    """Step 5: every op node of the bound graph calls the instance and op its routing.json entry names."""
    offered = members_of(ops.backend)
    entries = {e.node: e for e in docs.routing.entries(program)}
    seen = set()
    for node in bound.graph.nodes:
        if node.op != "call_function" or node.name not in entries:
            continue
        entry = entries[node.name]
        seen.add(node.name)
        target_op, instance = getattr(node.target, "hgc_op", None), getattr(node.target, "hgc_backend", None)
        want = offered.get(entry.instance)
        if target_op != entry.op or want is None or instance is not want:
            got = "nothing" if instance is None else f"{backend_name(instance)}.{target_op}"
            if instance is not None and want is not None and backend_name(instance) == entry.backend:
                got += " (an instance the binding did not build)"
            raise LoadError(f"start-up: {_at(entry, program)} is bound to {got}, routing.json names "
                            f"{entry.instance}.{entry.op}; refusing to serve")
    missing = sorted(set(entries) - seen)
    if missing:
        raise LoadError(f"start-up: {_at(entries[missing[0]], program)} is in routing.json and bound to nothing; "
                        f"refusing to serve")
