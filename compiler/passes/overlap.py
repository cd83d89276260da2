"""OverlapPass (`--overlap`): branches of each captured piece that can run on a second CUDA stream.

A captured piece is a dataflow graph: FX's edges (a node reads another's value) plus the order
in-place writes impose (an op core writes its `out`: every later reader of it, or of a view of
it, depends on the op; an earlier reader must run before it). For each captured piece of every
mode's plan, this pass builds that graph with networkx and:

1. takes the piece's op cores as anchors, largest first by bytes moved. Op cores (the MoE block,
   attention, recurrent scans) are the kernels that at decode batch sizes launch too few
   programs to fill the GPU (one per expert, per request and head): the room a second stream can
   use. A library matmul is sized to fill the GPU by itself, so it is no anchor;
2. for each anchor, the nodes that are neither its ancestors nor its descendants can run at the
   same time as it; among them, those fit for the side stream (aten glue: no op core, nothing
   written in place, no buffer the piece writes in place) fall into weakly connected components:
   each component is a candidate branch;
3. a branch forks after the last main node it reads (the side stream waits on the main stream
   there) and joins before the first main node that reads it (the main stream waits on the side
   stream there); it is kept when the anchor lies between fork and join, when both the branch
   and the main work between fork and join move at least `min_bytes` (the size rule below), and
   when its fork-join interval overlaps no branch already kept (one side stream runs one branch
   at a time);
4. each plan's pieces are replaced by pieces carrying their branches (SideBranch, recorded in
   split.json); nodes of no branch run on the main stream.

In a MoE layer compiled with `--overlap` (compiler/passes/shared_expert.py took the shared expert
out of the moe op) the moe op is its layer's largest anchor, and the shared expert (its
gate/up and down matmuls, the activation, the gate's matmul and sigmoid) is the component
independent of it: forked after the MoE input's norm, joined before the sum of the two. The
router GEMM is inside the moe op, so the shared expert overlaps router and routed experts alike.
Whatever else is independent of an op core and large enough is found the same way: under a
lower size rule, a Lightning layer's output-gate projection beside its recurrent core, a KDA
layer's gate projections beside its short convolution (decode plans, where both share a piece).
At the default rule only the shared experts are, on every family's bench config and on the
published Qwen3-Next-80B and (dense: nothing) Qwen3.6-27B configs (tests/compiler/test_overlap.py checks
the published two).

The size rule. Each branch, and the main work it overlaps, must move at least `MIN_BRANCH_BYTES`
(bytes read plus written by its nodes, from the shapes in the node metadata, at one token: the
decode batch where weights dominate and overlap has the most to hide). Below 1 MiB a branch is a
few launches of latency-bound kernels (one launch and ramp is 2-3 us on an H200,
benchmarks/history/moe_notes.md; 1 MiB at its 4.2 TB/s copy rate is 0.25 us), and a fork and a join (two event
records, two waits; an eager step pays each as a host call) cost about what such a branch could
hide. Every real family's shared expert is far above it (Qwen3-Next: 6 MiB in bf16; Kimi-Linear
13.5 MiB), norms, rotary, gates and routers' side computations far below (KiB). An op core's
bytes are its arguments' (for the moe op: every expert, an upper bound of what a token reads).
The constant is the compile's guess until benchmarks/serving/overlap_bench.py measures it;
`--overlap-min-bytes` overrides it and is recorded in the pass fingerprint.

`ensures` checks the dependency rule on the networkx graph: no side node depends on a main node
after its fork, no main node before its join depends on a side node.

What it does not do: change the graph (the runtime moves side nodes after their fork when it
runs a piece, runtime/graphs/side_stream.py), or decide anything for eager pieces (op cores stay on the
main stream: their backends plan per step on it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator

import networkx as nx
import torch
import torch.fx

from compiler.passes.base import CompilePass, PassResult, PostconditionError, PreconditionError
from compiler.splitops import MODES, call_arguments, is_op_node
from compiler.splitops.artifact import CAPTURED, SideBranch

__all__ = ["OverlapPass", "MIN_BRANCH_BYTES", "piece_graph", "find_branches", "node_bytes", "check_branch"]

MIN_BRANCH_BYTES = 1 << 20  # the size rule of the module docstring
REFERENCE_TOKENS = 1  # the token count the size rule is evaluated at

_aten = torch.ops.aten
_ALLOCATIONS = {_aten.empty_like.default, _aten.empty.memory_format, _aten.new_empty.default,
                _aten.empty_strided.default}


# -- facts of one node -----------------------------------------------------------------------------


def _schema(node: torch.fx.Node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _is_view(node: torch.fx.Node) -> bool:
    """Whether the node's value is (or may be) a view of its first input: no data moves."""
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    schema = _schema(node)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _writes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The graph values a node writes in place (an op core's `out`; an aten `_` op's self)."""
    schema = _schema(node)
    if schema is None:
        return []
    values = call_arguments(node) if is_op_node(node) else {
        a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name)) for i, a in enumerate(schema.arguments)}
    return [values[a.name] for a in schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and isinstance(values.get(a.name), torch.fx.Node)]


def _alias_root(node: torch.fx.Node) -> torch.fx.Node:
    while _is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _size(dim, tokens: int) -> int:
    return dim if isinstance(dim, int) else _at(dim.node.expr, tokens)


@functools.lru_cache(maxsize=4096)
def _at(expr, tokens: int) -> int:
    """A symbolic size with every symbol (the token count, the logits rows) set to `tokens`."""
    return int(expr.subs({s: tokens for s in expr.free_symbols}))


def _tensor_bytes(val, tokens: int) -> int:
    if isinstance(val, torch.Tensor):
        return math.prod(_size(d, tokens) for d in val.shape) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_tensor_bytes(v, tokens) for v in val)
    return 0


def node_bytes(node: torch.fx.Node, tokens: int = REFERENCE_TOKENS) -> int:
    """Bytes a node reads and writes at `tokens` tokens: its tensor inputs and its value; 0 for views,
    allocations, checks (no value, no op core: they read metadata on the host) and anything that
    is not a call (placeholders, the output)."""
    if node.op != "call_function" or _is_view(node) or node.target in _ALLOCATIONS:
        return 0
    if node.meta.get("val") is None and not is_op_node(node):
        return 0
    read = sum(_tensor_bytes(a.meta.get("val"), tokens) for a in node.all_input_nodes)
    return read + (0 if is_op_node(node) else _tensor_bytes(node.meta.get("val"), tokens))


def _side_fit(node: torch.fx.Node, written: set) -> bool:
    """Aten glue the side stream may run: no op core, nothing written in place, nothing random,
    no value (or view of one) that a node of the piece writes in place, a tensor value (or none: a
    check). The graph's write edges would order such a reader anyway; keeping it on the main
    stream leaves no written buffer shared between streams."""
    if node.op != "call_function" or is_op_node(node) or _writes(node):
        return False
    schema = _schema(node)
    if schema is None and node.target is not operator.getitem:
        return False
    if schema is not None and torch.Tag.nondeterministic_seeded in node.target.tags:
        return False
    if _alias_root(node) in written or any(_alias_root(a) in written for a in node.all_input_nodes):
        return False
    val = node.meta.get("val")
    return val is None or isinstance(val, torch.Tensor) or (
        isinstance(val, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in val))


# -- the dataflow graph of one piece --------------------------------------------------------------


def piece_graph(nodes: list[torch.fx.Node]) -> nx.DiGraph:
    """The piece's nodes (fx.Nodes) with an edge for every value read, and for every in-place
    write: op -> each later reader of what it writes (or of a view of it), each earlier reader -> op.
    Values made outside the piece (placeholders, earlier pieces) are ready before it starts: no node."""
    inside = set(nodes)
    graph = nx.DiGraph()
    graph.add_nodes_from(nodes)
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            if a in inside:
                graph.add_edge(a, node)
            readers.setdefault(_alias_root(a), []).append(node)
    position = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        for value in _writes(node):
            for reader in readers.get(_alias_root(value), ()):
                if reader is not node:
                    graph.add_edge(*((node, reader) if position[reader] > position[node] else (reader, node)))
    return graph


# -- branches ---------------------------------------------------------------------------------------


def _interval(branch: SideBranch, position: dict[str, int], size: int) -> tuple[int, int]:
    fork = -1 if branch.fork_after is None else position[branch.fork_after]
    join = size if branch.join_before is None else position[branch.join_before]
    return fork, join


def find_branches(nodes: list[torch.fx.Node], min_bytes: int = MIN_BRANCH_BYTES) -> tuple[SideBranch, ...]:
    """Steps 1-3 of the module docstring for one captured piece (its nodes in graph order)."""
    graph = piece_graph(nodes)
    position = {n: i for i, n in enumerate(nodes)}
    cost = {n: node_bytes(n) for n in nodes}
    before = [0, *itertools.accumulate(cost[n] for n in nodes)]  # before[i]: bytes of nodes[:i]
    written = {_alias_root(v) for n in nodes for v in _writes(n)}
    fit = {n for n in nodes if _side_fit(n, written)}
    anchors = sorted((n for n in nodes if is_op_node(n) and cost[n] >= min_bytes), key=lambda n: (-cost[n], position[n]))
    taken: set[torch.fx.Node] = set()
    kept: list[tuple[int, int, SideBranch]] = []
    for anchor in anchors:
        if anchor in taken:
            continue
        related = nx.ancestors(graph, anchor) | nx.descendants(graph, anchor) | {anchor}
        free = [n for n in nodes if n in fit and n not in related and n not in taken]
        components = sorted(nx.weakly_connected_components(graph.subgraph(free)),
                            key=lambda c: min(position[n] for n in c))
        for component in components:
            outside_in = {p for n in component for p in graph.predecessors(n)} - component
            outside_out = {s for n in component for s in graph.successors(n)} - component
            if (outside_in | outside_out) & taken:
                continue  # it would read or feed another branch: one side stream, one branch at a time
            fork = max((position[p] for p in outside_in), default=-1)
            join = min((position[s] for s in outside_out), default=len(nodes))
            if not fork < position[anchor] < join:
                continue
            if any(not (j <= fork or join <= f) for f, j, _ in kept):
                continue
            side = sum(cost[n] for n in component)
            main = before[join] - before[fork + 1] - sum(cost[n] for n in component | taken
                                                         if fork < position[n] < join)
            if side < max(min_bytes, 1) or main < min_bytes:
                continue
            ordered = sorted(component, key=position.__getitem__)
            kept.append((fork, join, SideBranch(
                tuple(n.name for n in ordered), nodes[fork].name if fork >= 0 else None,
                nodes[join].name if join < len(nodes) else None, anchor.name, side, main)))
            taken |= component
    return tuple(b for _, _, b in sorted(kept, key=lambda k: k[0]))


def _reached(graph: nx.DiGraph, sources: set, step) -> dict:
    """Every node reached from `sources` along `step` (graph.successors or graph.predecessors),
    sources excluded unless reached again: {node: the source it was reached from}."""
    seen, frontier = {}, [(n, n) for n in sources]
    while frontier:
        node, source = frontier.pop()
        for nxt in step(node):
            if nxt not in seen:
                seen[nxt] = source
                frontier.append((nxt, source))
    return seen


def check_branch(nodes: list[torch.fx.Node], graph: nx.DiGraph, branch: SideBranch) -> str | None:
    """The dependency rule for one branch on the piece's dataflow graph: None, or what breaks it."""
    by_name = {n.name: n for n in nodes}
    position = {n: i for i, n in enumerate(nodes)}
    fork, join = _interval(branch, {n.name: i for i, n in enumerate(nodes)}, len(nodes))
    side = {by_name[n] for n in branch.nodes}
    for node, source in _reached(graph, side, graph.predecessors).items():
        if node not in side and position[node] > fork:
            return f"side node {source.name} depends on main node {node.name} after the fork"
    for node, source in _reached(graph, side, graph.successors).items():
        if node not in side and position[node] < join:
            return f"main node {node.name} before the join depends on side node {source.name}"
    return None


class OverlapPass(CompilePass):
    name = "overlap"
    version = 1

    def __init__(self, min_bytes: int | None = None):
        self.min_bytes = MIN_BRANCH_BYTES if min_bytes is None else int(min_bytes)

    def config(self) -> dict:
        return {"min_bytes": self.min_bytes, "reference_tokens": REFERENCE_TOKENS}

    def requires(self, gm, ctx) -> None:
        if ctx.program not in ctx.split_plans:
            raise PreconditionError("overlap: no split plans for this program; the split pass must run first")

    def __call__(self, gm, ctx) -> PassResult:
        by_name = {n.name: n for n in gm.graph.nodes}
        found: dict[tuple[str, ...], tuple[SideBranch, ...]] = {}  # plans of several modes share pieces
        plans = ctx.split_plans[ctx.program]
        for mode, plan in plans.items():
            pieces = []
            for piece in plan.pieces:
                if piece.kind == CAPTURED and piece.nodes not in found:
                    found[piece.nodes] = find_branches([by_name[n] for n in piece.nodes], self.min_bytes)
                branches = found.get(piece.nodes, ()) if piece.kind == CAPTURED else ()
                pieces.append(dataclasses.replace(piece, branches=branches))
            plans[mode] = dataclasses.replace(plan, pieces=tuple(pieces))
        return PassResult(gm, modified=False)

    def ensures(self, gm, ctx) -> None:
        by_name = {n.name: n for n in gm.graph.nodes}
        checked: set[tuple[str, ...]] = set()
        for mode in MODES:
            for piece in ctx.split_plans[ctx.program][mode].pieces:
                if not piece.branches or piece.nodes in checked:
                    continue
                checked.add(piece.nodes)
                nodes = [by_name[n] for n in piece.nodes]
                graph = piece_graph(nodes)
                for i, branch in enumerate(piece.branches):
                    broken = check_branch(nodes, graph, branch)
                    if broken:
                        raise PostconditionError(f"overlap: {mode.value} piece {piece.index} side branch {i}: {broken}")

