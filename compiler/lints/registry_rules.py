"""Rules comparing the traced graphs with the LayerRegistry (they run before routing).

Each rule guards against a failure seen in serving engines (docs/DESIGN.md):

- op-layer-id-not-constant: an op's layer id is computed at run time, so no table can route it.
- op-layer-unknown:    an op node names a layer id the registry lacks (it would find no cache).
- op-kind-mismatch:    an op node's op disagrees with its layer's registry kind (failure 1's twin:
                       a GDN core on a layer the registry calls full attention).
- duplicate-layer-id:  two op nodes of the same op claim one layer id (two layers would share a cache);
                       the collectives the sharding pass places are exempt (a layer sums two partials).
- draft-id-clash:      the draft program uses a main layer's id, or the main program a draft id
                       (failure 6: the MTP layer must have an id of its own).
- layer-without-op:    a registry layer that no program's graph uses (artifact scope).
- module-kind-mismatch (info): the module class recorded by export differs from the registry's
                       `module` (failure 1: a linear layer wrapped in an attention module). hgc
                       routes by the registry, so this is information, not an error.
"""

from __future__ import annotations

from collections import defaultdict

from compiler.lints.base import ERROR, INFO, LintRule
from compiler.splitops import OPS_BY_KIND, op_nodes, op_spec

__all__ = ["OpLayerIdNotConstant", "OpLayerUnknown", "OpKindMismatch", "DuplicateLayerId", "DraftIdClash",
           "LayerWithoutOp", "ModuleKindMismatch", "REGISTRY_RULES"]


def _module_path(node) -> str:
    stack = node.meta.get("hgc.modules") or []
    return stack[-1][0] if stack else "?"


class OpLayerIdNotConstant(LintRule):
    id = "op-layer-id-not-constant"
    severity = ERROR
    doc = "an op's layer id must be a Python int fixed at trace time"

    def check(self, gm, ctx):
        for node in op_nodes(gm):
            if node.meta.get("hgc.layer_id") is None:
                yield self.finding(
                    f"node {node.name} (hgc.{node.meta['hgc.op']}, module {_module_path(node)}) takes a layer id that "
                    f"is not a constant int, so routing cannot look it up in the registry",
                    "pass the layer's id as a Python int attribute of the module (self.layer_id), never a tensor",
                    program=ctx.program, node=node.name)


class OpLayerUnknown(LintRule):
    id = "op-layer-unknown"
    severity = ERROR
    doc = "every op node's layer id is in the registry"

    def check(self, gm, ctx):
        ids = sorted(l.layer_id for l in ctx.registry)
        for node in op_nodes(gm):
            lid = node.meta.get("hgc.layer_id")
            if lid is not None and lid not in ctx.registry:
                yield self.finding(
                    f"node {node.name} (hgc.{node.meta['hgc.op']}, module {_module_path(node)}) uses layer {lid}, "
                    f"which the registry lacks (registry ids: {ids[0]}..{ids[-1]})" if ids else
                    f"node {node.name} uses layer {lid}, and the registry is empty",
                    "build the module with the id of its LayerSpec (iterate the registry when building layers), "
                    "or add the layer to the family's registry", program=ctx.program, node=node.name, layer_id=lid)


class OpKindMismatch(LintRule):
    id = "op-kind-mismatch"
    severity = ERROR
    failure = 1
    doc = "an op node's op belongs to its layer's registry kind (moe: the layer's mlp is 'moe')"

    def check(self, gm, ctx):
        for node in op_nodes(gm):
            lid = node.meta.get("hgc.layer_id")
            if lid is None or lid not in ctx.registry:
                continue
            spec, op = ctx.registry[lid], node.meta["hgc.op"]
            kinds = op_spec(op).kinds
            if kinds and spec.kind not in kinds:
                yield self.finding(
                    f"node {node.name} is hgc.{op} (an op of {sorted(k.value for k in kinds)} layers) but the registry "
                    f"says layer {lid} is {spec.kind.value} (module {_module_path(node)})",
                    f"build layer {lid} from its registry kind ({spec.kind.value}: ops {list(OPS_BY_KIND[spec.kind])}), "
                    f"or correct the family's registry", program=ctx.program, node=node.name, layer_id=lid)
            if not kinds and op == "moe" and spec.mlp != "moe":
                yield self.finding(
                    f"node {node.name} is hgc.moe but the registry says layer {lid} has a {spec.mlp!r} MLP",
                    f"make the registry's mlp field for layer {lid} 'moe', or build a dense MLP there",
                    program=ctx.program, node=node.name, layer_id=lid)


class DuplicateLayerId(LintRule):
    id = "duplicate-layer-id"
    severity = ERROR
    doc = "one op node per (op, layer id) in a program (collectives aside: a layer has one per partial result)"

    def check(self, gm, ctx):
        seen = defaultdict(list)
        for node in op_nodes(gm):
            lid = node.meta.get("hgc.layer_id")
            if lid is not None and not op_spec(node.meta["hgc.op"]).collective:
                seen[(node.meta["hgc.op"], lid)].append(node)
        for (op, lid), nodes in seen.items():
            if len(nodes) > 1:
                where = ", ".join(f"{n.name} in {_module_path(n)}" for n in nodes)
                yield self.finding(
                    f"layer id {lid} is used by {len(nodes)} hgc.{op} nodes ({where}): those layers would share "
                    f"one cache or state slot", "give each layer module the id of its own registry entry",
                    program=ctx.program, node=nodes[1].name, layer_id=lid)


class DraftIdClash(LintRule):
    id = "draft-id-clash"
    severity = ERROR
    failure = 6
    doc = "draft programs use draft layer ids only, the main program main ids only"

    def check(self, gm, ctx):
        draft_program = ctx.program != "main"
        for node in op_nodes(gm):
            lid = node.meta.get("hgc.layer_id")
            if lid is None or lid not in ctx.registry:
                continue
            if ctx.registry[lid].draft != draft_program:
                which = "main" if draft_program else "draft"
                yield self.finding(
                    f"the {ctx.program} program's node {node.name} (module {_module_path(node)}) uses layer {lid}, "
                    f"which the registry lists as a {which} layer: the draft would overwrite the main model's "
                    f"cache (or the reverse)",
                    "give the draft (MTP) layer its own id after the main layers (num_hidden_layers + j), marked "
                    "draft=True in the registry", program=ctx.program, node=node.name, layer_id=lid)


class LayerWithoutOp(LintRule):
    id = "layer-without-op"
    severity = ERROR
    scope = "artifact"
    doc = "every registry layer is used by an op node of its kind (and its moe op, when its MLP is 'moe')"

    def check(self, ctx):
        used = defaultdict(set)
        for gm in ctx.programs.values():
            for node in op_nodes(gm):
                if node.meta.get("hgc.layer_id") is not None:
                    used[node.meta["hgc.layer_id"]].add(node.meta["hgc.op"])
        for spec in ctx.registry:
            ops = used.get(spec.layer_id, set())
            expected = set(OPS_BY_KIND[spec.kind])
            program = "draft" if spec.draft else "main"
            if not ops & expected:
                yield self.finding(
                    f"registry layer {spec.layer_id} ({spec.kind.value}{', draft' if spec.draft else ''}) has no "
                    f"{'/'.join(sorted(expected))} node in any program: its cache would be sized but never used, "
                    f"or a module runs it under another id",
                    "check that every layer module passes its own registry id to its ops, or drop the layer from "
                    "the registry", program=program, layer_id=spec.layer_id)
            if spec.mlp == "moe" and "moe" not in ops:
                yield self.finding(
                    f"registry layer {spec.layer_id} says its MLP is 'moe' but no hgc.moe node uses that id",
                    "build the layer's MLP as a MoEBlock with the layer's id, or set mlp='dense' in the registry",
                    program=program, layer_id=spec.layer_id)


class ModuleKindMismatch(LintRule):
    id = "module-kind-mismatch"
    severity = INFO
    failure = 1
    doc = "the module class export recorded for an attention op matches the registry's module (information)"

    def check(self, gm, ctx):
        reported = set()
        for node in op_nodes(gm):
            lid = node.meta.get("hgc.layer_id")
            if lid is None or lid not in ctx.registry or lid in reported or not op_spec(node.meta["hgc.op"]).kinds:
                continue
            spec = ctx.registry[lid]
            classes = [cls.rsplit(".", 1)[-1] for _, cls in node.meta.get("hgc.modules") or []]
            if spec.module and spec.module not in classes:
                reported.add(lid)
                yield self.finding(
                    f"layer {lid} ({spec.kind.value}) runs hgc.{node.meta['hgc.op']} inside module "
                    f"{classes[-1] if classes else '?'} at {_module_path(node)}, while the registry names {spec.module}; "
                    f"hgc routes by the registry, so this only matters to code that dispatches on module types",
                    f"make the registry's module field for layer {lid} name the class that implements it",
                    program=ctx.program, node=node.name, layer_id=lid)


REGISTRY_RULES: tuple[LintRule, ...] = (
    OpLayerIdNotConstant(), OpLayerUnknown(), OpKindMismatch(), DuplicateLayerId(), DraftIdClash(),
    LayerWithoutOp(), ModuleKindMismatch(),
)
