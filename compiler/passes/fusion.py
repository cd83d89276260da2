"""FusionPass: regions of op and glue nodes that one fused op computes, replaced by that op's node.

A GDN layer at decode batch 1 is a few microseconds of work spread over seven launches (the conv,
four glue kernels, the recurrence, the gated norm): the step is launch-bound. One op node for the
whole region lets a backend run it as one kernel. `PATTERNS` holds one entry per fused op:

    "gdn": short_conv .. split .. l2norm(q), l2norm(k), sigmoid(b), -exp(A_log)*softplus(a+dt_bias)
           .. gdn_core .. gated RMSNorm(core, z)   ->   out = empty_like(z); hgc.gdn_fused(..., out, ...)

Matching, per anchor op node (gdn_core), on a program whose nodes the annotate pass described:

1. the pattern's statement (compiler/splitops/gdn_mixer.py, what the model runs) is traced with
   make_fx on meta tensors of the layer's shapes: the template. Layer id, scale and eps are traced
   as marks that match any constant (the same one wherever a mark repeats);
2. the template's anchor is paired with the graph's, and every argument is paired backwards with
   the graph's argument: same target, same constants, placeholders bound to the region's inputs.
   The ops return nothing and write `out`, so the conv is found as the short_conv node that
   writes the buffer the split reads, and the gated norm forwards from the core's `out`;
3. the matched nodes must be read only inside the region (its output aside): a value the rest of
   the program reads cannot vanish into a fused op.

A region that differs in any node is left as it is. So is every region whose anchor's backend
(the one routing would choose for it on the compile's target, from the capability table) does not
declare the fused op, or declares it only where a route names it (`fused_on_route`: a backend
whose fused kernel does not win at every step yet): a plugin that runs gdn_core alone keeps its
layers too. So is a region a route keeps
unfused (`--route gdn_fused=unfused`, `--route layers=3:unfused`, a layer route to a backend without
the fused op, or a route naming one of the region's ops). Each anchor left unfused is recorded
with the reason: `ctx.fusion[program]["unfused"]`, and the pass result's `report`.

The fused node gets the annotate pass's facts (layer id, kind, module) and meta["hgc.fused"] = the
pattern's name; routing records it in routing.json, `hgc inspect` and the dumps show it. The pass
runs after the registry lints (kinds are known) and before routing (which binds the fused node).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from compiler.passes.annotate import annotate_node
from compiler.passes.base import CompilePass, PassResult, PostconditionError
from compiler.splitops import TRACED_OPS, UNFUSED, call_arguments, call_facts, op_name_of, op_nodes
from compiler.splitops.gdn_mixer import gated_rms_norm, gdn_mixer_region

__all__ = ["FusionPass", "FusionPattern", "PATTERNS"]

_ASSERT = torch.ops.aten._assert_tensor_metadata.default  # export's dtype checks: never part of a region


@dataclasses.dataclass(frozen=True)
class _Mark:
    """A constant the template leaves open: any graph constant of its type matches it."""

    name: str
    value: object  # what the template is traced with: a value no real graph holds


_MARKS = (_Mark("layer_id", -271828), _Mark("scale", 0.000271828), _Mark("eps", 0.000314159))


@dataclasses.dataclass(frozen=True)
class FusionPattern:
    """One entry of PATTERNS: the anchor op, the fused op, and how to trace and call it."""

    name: str  # meta["hgc.fused"], routing.json's "fused"
    anchor: str  # the op node matching starts from
    fused_op: str
    ops: tuple[str, ...]  # the ops of the region (a route naming one keeps the region unfused)
    inputs: tuple[str, ...]  # the template's placeholders, in order: the region's inputs
    template: Callable  # anchor node -> the traced statement of the region (fx.Graph), or why there is none
    call: Callable  # (inputs by name, marks, matched op nodes by op) -> (fused op arguments, `out` None; out's like)


# -- the GDN pattern -----------------------------------------------------------------------------

_GDN_INPUTS = ("qkv", "z", "b", "a", "conv_weight", "A_log", "dt_bias", "norm_weight")


@functools.lru_cache(maxsize=None)
def _gdn_template(channels: int, conv_shape: tuple, k_heads: int, k_dim: int, v_heads: int, v_dim: int,
                  dtype: torch.dtype) -> torch.fx.Graph:
    """gdn_mixer_region traced on meta tensors of one layer's shapes (one trace per distinct shape)."""
    marks = {m.name: m.value for m in _MARKS}

    def region(qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight):
        return gdn_mixer_region(TRACED_OPS, qkv, z, b, a, conv_weight, A_log, dt_bias,
                                lambda x, gate: gated_rms_norm(x, gate, norm_weight, marks["eps"]),
                                marks["layer_id"], k_heads, k_dim, marks["scale"])

    def meta(*shape):
        return torch.empty(shape, dtype=dtype, device="meta")

    T = 2  # the token count appears in no node (every reshape is -1 on it)
    args = (meta(T, channels), meta(T, v_heads, v_dim), meta(T, v_heads), meta(T, v_heads), meta(*conv_shape),
            meta(v_heads), meta(v_heads), meta(v_dim))
    return make_fx(region, pre_dispatch=True)(*args).graph


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _gdn_template_for(anchor: torch.fx.Node):
    """The template for a gdn_core node's layer, from the shapes of its arguments and of the conv
    that writes its inputs; a reason string when they are not those of a GDN mixer."""
    args = call_arguments(anchor)
    q, v = _val(args["q"]), _val(args["v"])
    if q is None or v is None or q.dim() != 3 or v.dim() != 3:
        return "gdn_core's q or v is not a [T, heads, dim] value"
    conv = _writer_of_split_input(args["v"])
    if conv is None:
        return "gdn_core's v is not a slice of a short_conv's output"
    weight = call_arguments(conv)["weight"]
    squeezed = isinstance(weight, torch.fx.Node) and weight.op == "call_function" and weight.args
    held = weight.args[0] if squeezed else weight  # the Conv1d's [C,1,K] the model squeezes
    x, w = _val(call_arguments(conv)["x"]), _val(held)
    if x is None or w is None:
        return "the short_conv's input or weight has no shape"
    k_heads, k_dim, v_heads, v_dim = int(q.shape[1]), int(q.shape[2]), int(v.shape[1]), int(v.shape[2])
    return _gdn_template(int(x.shape[-1]), tuple(int(s) for s in w.shape), k_heads, k_dim, v_heads, v_dim, x.dtype)


def _writer_of_split_input(v: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The short_conv node writing the buffer v was split and reshaped from (reshape(getitem(split(buf))))."""
    node = v
    for _ in range(3):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function" or not node.args:
            return None
        node = node.args[0]
    writers = [u for u in node.users if op_name_of(u.target) == "short_conv" and call_arguments(u)["out"] is node]
    return writers[0] if len(writers) == 1 else None


def _gdn_call(inputs: dict, marks: dict, matched: dict) -> tuple[tuple, torch.fx.Node]:
    """hgc.gdn_fused's arguments (the conv weight as the short_conv read it: the squeezed Conv1d
    weight), and the node `out` is made like (z: [T,Hv,Dv] in the activation dtype)."""
    conv = matched["short_conv"]
    k_heads = int(_val(call_arguments(matched["gdn_core"])["q"]).shape[1])
    args = (inputs["qkv"], inputs["z"], inputs["b"], inputs["a"], call_arguments(conv)["weight"], inputs["A_log"],
            inputs["dt_bias"], inputs["norm_weight"], None, marks["layer_id"], k_heads, marks["scale"], marks["eps"])
    return args, inputs["z"]


PATTERNS: dict[str, FusionPattern] = {
    "gdn": FusionPattern("gdn", anchor="gdn_core", fused_op="gdn_fused", ops=("short_conv", "gdn_core"),
                         inputs=_GDN_INPUTS, template=_gdn_template_for, call=_gdn_call),
}


# -- matching ------------------------------------------------------------------------------------

class _Matcher:
    """Template node -> graph node, built backwards from the anchor, then forwards to the output."""

    def __init__(self, template: torch.fx.Graph):
        self.template = template
        self.pairs: dict[torch.fx.Node, torch.fx.Node] = {}
        self.marks: dict[str, object] = {}

    def _snapshot(self):
        return dict(self.pairs), dict(self.marks)

    def _restore(self, snap) -> None:
        self.pairs, self.marks = dict(snap[0]), dict(snap[1])

    def _constant(self, t, g) -> bool:
        for mark in _MARKS:
            if type(t) is type(mark.value) and t == mark.value:
                if type(g) is not type(t) or self.marks.setdefault(mark.name, g) != g:
                    return False
                return True
        return type(t) is type(g) and t == g

    def _same(self, t, g) -> bool:
        if isinstance(t, torch.fx.Node):
            return isinstance(g, torch.fx.Node) and self.pair(t, g)
        if isinstance(t, (list, tuple)):
            return (isinstance(g, (list, tuple)) and len(t) == len(g)
                    and all(self._same(a, b) for a, b in zip(t, g)))
        if isinstance(t, dict):
            return isinstance(g, dict) and t.keys() == g.keys() and all(self._same(t[k], g[k]) for k in t)
        return self._constant(t, g)

    def pair(self, t: torch.fx.Node, g: torch.fx.Node) -> bool:
        """Pair t with g and their arguments recursively; False (and nothing paired) if they differ."""
        if t in self.pairs:
            return self.pairs[t] is g
        if t.op == "placeholder":
            self.pairs[t] = g
            return True
        if g.op != "call_function" or g.target != t.target or g in self.pairs.values():
            return False
        snap = self._snapshot()
        self.pairs[t] = g
        if self._same(t.args, g.args) and self._same(t.kwargs, g.kwargs):
            return True
        self._restore(snap)
        return False

    def forward(self, t: torch.fx.Node) -> bool:
        """Pair a template node none of whose arguments' pairs reached it: among the users of its
        paired arguments, the one node that pairs."""
        known = [a for a in t.all_input_nodes if a in self.pairs]
        candidates = [u for a in known for u in self.pairs[a].users if u.target == t.target]
        for g in dict.fromkeys(candidates):
            if self.pair(t, g):
                return True
        return False


def _op_node(graph: torch.fx.Graph, op: str) -> torch.fx.Node:
    return next(n for n in graph.nodes if n.op == "call_function" and op_name_of(n.target) == op)


def _match(pattern: FusionPattern, anchor: torch.fx.Node):
    """(matcher, graph output node) of the region around `anchor`, or a reason it is not one."""
    template = pattern.template(anchor)
    if isinstance(template, str):
        return template
    m = _Matcher(template)
    if not m.pair(_op_node(template, pattern.anchor), anchor):
        return f"the inputs of {anchor.name} are not those of the {pattern.name} region"
    for op in pattern.ops:
        t = _op_node(template, op)
        if t in m.pairs:
            continue
        out = m.pairs.get(call_arguments(t)["out"])
        writers = [u for u in (out.users if out is not None else ()) if op_name_of(u.target) == op]
        if len(writers) != 1 or not m.pair(t, writers[0]):
            return f"no single hgc.{op} node writes the buffer the {pattern.name} region reads"
    # Forwards, in template order; a node reading only inputs not yet bound (the norm's silu(z))
    # is paired backwards from the node that reads it.
    for t in template.nodes:
        if t.op == "call_function" and t not in m.pairs and any(a in m.pairs for a in t.all_input_nodes):
            if not m.forward(t):
                return (f"{anchor.name}'s region differs from the {pattern.name} pattern at {t.target} "
                        f"(template node {t.name})")
    left = [t.name for t in template.nodes if t.op == "call_function" and t not in m.pairs]
    if left:
        return f"{anchor.name}'s region lacks what the {pattern.name} pattern computes at template nodes {left[:3]}"
    output = next(n for n in template.nodes if n.op == "output")
    return m, m.pairs[output.args[0]]


def _region_check(m: _Matcher, result: torch.fx.Node, order: dict) -> Optional[str]:
    """Why the matched nodes cannot become one op node, or None."""
    inner = {g for t, g in m.pairs.items() if t.op != "placeholder"}
    for t, g in m.pairs.items():
        if t.op == "placeholder" and g in inner:
            return f"input {t.name} is computed inside the region ({g.name})"
        if t.op == "placeholder" and order[g] > order[result]:
            return f"input {g.name} comes after the region's output {result.name}"
    for g in inner - {result}:
        outside = [u.name for u in g.users if u not in inner and u.target is not _ASSERT]
        if outside:
            return f"{g.name}, inside the region, is also read by {outside[:3]}"
    return None


def _fake_value(target, args, kwargs):
    """The meta value of a new node: its target run on the graph's fake values."""
    args, kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    leaves = [v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    with detect_fake_mode(leaves):
        return target(*args, **kwargs)


def _replace(gm, ctx, pattern: FusionPattern, anchor, m: _Matcher, result, order: dict) -> torch.fx.Node:
    """The fused node before the region's output, every reader of the output reading its `out`,
    the region's nodes erased (those the fused node still reads, like the squeezed conv weight, stay)."""
    graph = gm.graph
    placeholders = [t for t in m.template.nodes if t.op == "placeholder"]
    inputs = dict(zip(pattern.inputs, (m.pairs[t] for t in placeholders)))
    matched = {op_name_of(g.target): g for g in m.pairs.values() if op_name_of(g.target) is not None}
    args, like = pattern.call(inputs, m.marks, matched)
    with graph.inserting_before(result):
        kwargs = {"pin_memory": False, "memory_format": torch.contiguous_format}
        out = graph.create_node("call_function", torch.ops.aten.empty_like.default, (like,), kwargs,
                                name=f"{pattern.fused_op}_out")
        out.meta["val"] = _fake_value(out.target, (like,), kwargs)
        fused = graph.create_node("call_function", getattr(torch.ops.hgc, pattern.fused_op).default,
                                  tuple(out if a is None else a for a in args), name=pattern.fused_op)
    for node in (out, fused):
        node.meta["nn_module_stack"] = dict(anchor.meta.get("nn_module_stack") or {})
        for key in ("stack_trace", "source_fn_stack"):
            if key in anchor.meta:
                node.meta[key] = anchor.meta[key]
    fused.meta["val"] = None
    result.replace_all_uses_with(out)
    region = sorted({g for t, g in m.pairs.items() if t.op != "placeholder"}, key=lambda n: -order[n])
    # export's dtype checks of the region's inputs, made where the region read them, go with it
    span = range(order[region[-1]], order[result])
    for node in inputs.values():
        for user in [u for u in node.users if u.target is _ASSERT and order.get(u, -1) in span]:
            graph.erase_node(user)
    for node in region:
        for user in [u for u in node.users if u.target is _ASSERT]:
            graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)
    annotate_node(fused, ctx)
    fused.meta["hgc.fused"] = pattern.name
    if "hgc.shard" in anchor.meta:  # --tp: what a rank holds of the layer (the sharding pass's note)
        fused.meta["hgc.shard"] = anchor.meta["hgc.shard"]
    return fused


# -- the pass ------------------------------------------------------------------------------------

def _kept_by_route(pattern: FusionPattern, layer_id, ctx) -> Optional[str]:
    """The route that keeps this layer's region unfused, or None."""
    table = ctx.capabilities
    for route in ctx.config.routes:
        if route.layers is not None and layer_id in route.layers:
            if route.backend == UNFUSED:
                return f"--route {route}"
            if route.backend in table and pattern.fused_op not in table[route.backend].ops:
                return f"--route {route} names {route.backend}, which does not implement hgc.{pattern.fused_op}"
        if route.op == pattern.fused_op and route.backend == UNFUSED:
            return f"--route {route}"
        if route.op in pattern.ops:
            return f"--route {route} binds the region's hgc.{route.op}"
    return None


def _served(pattern: FusionPattern, anchor, ctx) -> Optional[str]:
    """None when the fused op would run where the anchor would: a route names a backend for it,
    or the backend routing would choose for the anchor (by priority, among those that serve its
    node) declares the fused op too. A backend that runs the region's op and not the fused one
    keeps its layers (fusing would take them from it)."""
    table, target, layer_id = ctx.capabilities, ctx.config.target, anchor.meta.get("hgc.layer_id")
    named = [r.backend for r in ctx.config.routes if r.backend in table
             and (r.op == pattern.fused_op or (r.layers is not None and layer_id in r.layers))]
    if named:
        return None
    kind = ctx.registry[layer_id].kind
    facts = call_facts(anchor)
    serving = [c for c in table.candidates(pattern.anchor, kind, target)
               if c.refusal(pattern.anchor, kind, facts.dtype, facts.shapes) is None]
    if not serving:
        return f"no backend on {target!r} serves {anchor.name} (routing will say why)"
    if not serving[0].serves(pattern.fused_op, kind):
        return (f"{serving[0].name}, the backend of {anchor.name} on {target!r}, does not declare "
                f"hgc.{pattern.fused_op}")
    if pattern.fused_op in serving[0].fused_on_route:
        return (f"{serving[0].name} runs hgc.{pattern.fused_op} only where a route names it "
                f"(--route {pattern.fused_op}={serving[0].name})")
    return None


class FusionPass(CompilePass):
    name = "fusion"
    version = 1

    def __call__(self, gm, ctx) -> PassResult:
        fused, unfused = [], []
        graph = gm.graph
        for pattern in PATTERNS.values():
            for anchor in [n for n in op_nodes(gm) if op_name_of(n.target) == pattern.anchor]:
                layer_id = anchor.meta.get("hgc.layer_id")
                reason = _kept_by_route(pattern, layer_id, ctx) or _served(pattern, anchor, ctx)
                found = None
                if reason is None:
                    found = _match(pattern, anchor)
                    reason = found if isinstance(found, str) else None
                order = {n: i for i, n in enumerate(graph.nodes)}
                if reason is None:
                    reason = _region_check(*found, order)
                if reason is not None:
                    unfused.append({"pattern": pattern.name, "node": anchor.name, "layer_id": layer_id,
                                    "reason": reason})
                    continue
                node = _replace(gm, ctx, pattern, anchor, *found, order)
                fused.append({"pattern": pattern.name, "node": node.name, "layer_id": layer_id})
        if fused:
            graph.lint()
            gm.recompile()
        report = {"fused": fused, "unfused": unfused}
        ctx.fusion[ctx.program] = report
        return PassResult(gm, modified=bool(fused), report=report)

    def ensures(self, gm, ctx) -> None:
        named = {e["node"] for e in ctx.fusion.get(ctx.program, {}).get("unfused", [])}
        for pattern in PATTERNS.values():
            left = [n.name for n in op_nodes(gm) if op_name_of(n.target) == pattern.anchor and n.name not in named]
            if left:
                raise PostconditionError(f"fusion: {left[:3]} left unfused without a reason")
        blank = [n.name for n in op_nodes(gm) if n.meta.get("hgc.fused") and "hgc.op" not in n.meta]
        if blank:
            raise PostconditionError(f"fusion: fused nodes {blank[:3]} lack the annotate pass's facts")
