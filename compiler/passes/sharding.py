"""ShardingPass: give every weight and op node of a tensor-parallel program its sharding, and put
the collectives into the graph as op nodes.

The program is one rank's (compiler/frontend.py traces the model built for one rank of `--tp N`:
heads and widths already divided, a count that does not divide already refused there, naming the
layer). What this pass decides, from the frontend's `ShardFact`s (each checkpoint tensor's whole
and rank shapes, and the fused layouts the model declares) and the graph:

1. How each rank reads each checkpoint tensor (`ShardSpec`, ctx.shard_specs): the one dimension
   where whole and rank shapes differ is cut; a declared fused tensor (q | k | v rows, gate | up)
   is cut segment by segment; a dimension cut into fewer parts than ranks is held by tp / parts
   ranks each (KV heads when there are fewer than ranks: Qwen3-Next's 2 KV heads at --tp 4 give
   each head to 2 ranks, never a late failure); equal shapes are replicated. In a linear layer's
   [out, in] weight a cut of dim 0 is column-parallel (the output is this rank's heads or
   channels, kept local), a cut of dim 1 row-parallel (the output is a partial sum). A tensor
   whose rows the model holds in an order of its own (splitops/rows.py) must be cut into whole
   groups, one block per rank, since each rank rearranges the rows it read.
2. `hgc.all_reduce` after every partial sum: each `aten.linear` whose weight is row-parallel (a
   bias, if it has one, moves after the sum, added once), and each `hgc.moe` whose experts are
   cut. `hgc.all_gather` after a column-parallel linear whose output is a program output: the
   vocabulary-parallel lm_head, whose logits every rank then holds whole. A collective carries
   the layer id of the op node before it (the layer whose result it completes; lm_head's gather:
   the last layer). Nothing else crosses ranks: embeddings, norms, routers and MLA latents are
   replicated, attention and linear-attention heads (with their KV and state pools) and short
   convolution channels stay on their rank.
3. Facts for people: node.meta["hgc.shard"] on every weight placeholder (its spec, described)
   and every op node (its layer's heads / state / KV per rank against the whole model's), and
   ctx.sharding (sharding.json: the specs, the layers, each collective with why it is there).

MoE: tensor-parallel experts, not expert-parallel. Each rank holds every expert with 1/tp of its
intermediate width (Qwen3-Next-80B: 512 experts of 512 channels, 128 per rank at --tp 4; Kimi-
Linear-48B: 256 experts of 1024), so the `moe` op and every backend of it (the CPU reference, the
fused Triton MoE) run unchanged on a rank's slice, and the block ends in the same one all-reduce
a dense MLP needs. At decode batch sizes (1 to 128 tokens, top-10 of 512 experts) every rank then
reads the same bytes per step however routing skews, where expert-parallel puts a hot expert's
whole weight on one rank (the step waits for the busiest), needs a dispatch all-to-all or a
masked all-reduce, and an expert offset in the op. Expert-parallel pays when a slice gets too
thin for the GEMM tiles (512 channels over 8 ranks: 64) or for large prefill batches; neither is
where these releases are served at 2 to 4 GPUs.

It runs first in the pipeline (compiler/pipeline.py, only for --tp > 1), so the annotate pass
gives the collectives their facts and routing binds them like any op (runtime/backends/
collectives.py: gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.fx
from torch._guards import detect_fake_mode

from compiler.passes.base import CompilePass, PassResult, PostconditionError, PreconditionError
from compiler.splitops import (COLLECTIVE_OPS, REPLICATED, LayerRegistry, ShardingError, ShardSpec, call_arguments,
                               op_name_of, op_nodes)

__all__ = ["ShardingPass", "derive_spec", "sharding_summary"]

_LINEAR = torch.ops.aten.linear.default
_HGC = torch.ops.hgc
# Nodes that pass a tensor through unchanged in layout, between lm_head's linear and the output.
_PASS_THROUGH = {"to", "_to_copy", "clone", "contiguous", "_assert_tensor_metadata"}


def _layer_of(name: str) -> str:
    found = re.search(r"layers\.(\d+)\.", name)
    return f"layer {found.group(1)}, " if found else ""


def derive_spec(name: str, whole: tuple, rank: tuple, tp: int, whole_segments=None, rank_segments=None) -> ShardSpec:
    """How each rank reads tensor `name` of shape `whole` when a rank holds `rank` (step 1 of the
    module docstring); `*_segments`: (dim, lengths) of a fused layout the model declares."""
    whole, rank = tuple(whole), tuple(rank)
    where = f"sharding: tensor {name!r} ({_layer_of(name)}whole {list(whole)}, rank {list(rank)})"
    if whole == rank:
        return REPLICATED
    dims = [d for d, (w, r) in enumerate(zip(whole, rank)) if w != r] if len(whole) == len(rank) else []
    if len(dims) != 1:
        raise ShardingError(f"{where}: a rank's tensor must differ from the whole in one dimension; fix the family's "
                            f"rank build (models/)")
    dim = dims[0]
    if whole_segments is not None:
        (wdim, wseg), (rdim, rseg) = whole_segments, rank_segments or (None, ())
        if wdim != dim or rdim != dim or len(wseg) != len(rseg) or sum(wseg) != whole[dim] or sum(rseg) != rank[dim]:
            raise ShardingError(f"{where}: the fused layout declared whole {whole_segments} and on a rank "
                                f"{rank_segments} does not match the shapes")
        pairs = tuple(zip(wseg, rseg))
    else:
        pairs = ((whole[dim], rank[dim]),)
    segments = []
    for w, r in pairs:
        if r == 0 or w % r or tp % (w // r):
            raise ShardingError(f"{where}: {w} rows over {tp} ranks as {r} per rank is no even cut (or replication) "
                                f"of dim {dim}")
        segments.append((w, w // r))
    return ShardSpec(dim, tuple(segments))


def _check_row_order(view, spec: ShardSpec, tp: int) -> None:
    """A view whose rows the program holds in its own order (splitops/rows.py) is rearranged after a
    rank reads its rows, with the rank's groups: that holds only when the rank's rows are one block
    of whole groups (Qwen3-Next: its key heads, each with its q, k, v, z rows)."""
    if view.rows is None or spec.dim != 0:
        return
    (length, parts), *more = spec.segments
    if more or length // parts != view.rows.rows:
        raise ShardingError(f"sharding: tensor {view.name!r} ({_layer_of(view.name)}rows held in the order "
                            f"{view.rows}) is cut as {spec.describe(tp)}; a rank must read one block of whole "
                            f"groups; fix the family's row_orders or fused_segments (models/)")


def _fake(fn, *values):
    """Run `fn` on fake values (the graph's meta["val"]s) to get the meta value of a new node."""
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    with mode:
        return fn(*values)


def _insert_after(graph: torch.fx.Graph, anchor: torch.fx.Node, target, args: tuple, meta_from: torch.fx.Node,
                  val=None) -> torch.fx.Node:
    with graph.inserting_after(anchor):
        node = graph.call_function(target, args)
    node.meta["nn_module_stack"] = dict(meta_from.meta.get("nn_module_stack") or {})
    node.meta["val"] = val
    if op_name_of(target) in COLLECTIVE_OPS:
        node.meta["hgc.shard"] = f"collective after {meta_from.name}"
    return node


def _redirect(old: torch.fx.Node, new: torch.fx.Node, keep: set) -> None:
    """Users of `old` read `new` instead, except the nodes in `keep` (those that make `new`)."""
    for user in list(old.users):
        if user not in keep:
            user.replace_input_with(old, new)


def _passes_on(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether `user` passes `node`'s value on unchanged in layout (a dtype cast, a copy)."""
    return (user.op == "call_function" and getattr(user.target, "__name__", "").split(".")[0] in _PASS_THROUGH
            and bool(user.args) and user.args[0] is node)


def _reaches_output(node: torch.fx.Node) -> bool:
    """Whether `node`'s value is a program output, directly or through dtype casts and copies."""
    return any(user.op == "output" or (_passes_on(user, node) and _reaches_output(user)) for user in node.users)


def _refresh_passed_on(node: torch.fx.Node) -> None:
    """The casts and copies after `node` get meta values of its (new) shape: they were traced on the
    rank's lm_head output, before the gather widened it, and the loader reads the logits' width there."""
    for user in list(node.users):
        if _passes_on(user, node) and isinstance(user.meta.get("val"), torch.Tensor):
            args, kwargs = torch.fx.node.map_arg((user.args, user.kwargs), lambda n: n.meta["val"])
            user.meta["val"] = _fake(lambda *a: user.target(*a, **kwargs), *args)
            _refresh_passed_on(user)


class ShardingPass(CompilePass):
    name = "sharding"
    version = 1

    def __init__(self, tp: int):
        self.tp = tp

    def config(self) -> dict:
        return {"tp": self.tp}

    def requires(self, gm, ctx) -> None:
        if ctx.tp != self.tp or not ctx.shard_facts:
            raise PreconditionError(f"sharding: --tp {self.tp} needs programs traced for one rank of {self.tp} "
                                    f"(the frontend's trace_checkpoint(..., tp={self.tp})); got tp {ctx.tp}")
        if any(op_name_of(n.target) in COLLECTIVE_OPS for n in op_nodes(gm)):
            raise PreconditionError("sharding: the program already has collectives; a model never calls them")

    def __call__(self, gm, ctx) -> PassResult:
        if not ctx.shard_specs:
            ctx.shard_specs = {name: derive_spec(name, f.whole, f.rank, self.tp, f.whole_segments, f.rank_segments)
                               for name, f in ctx.shard_facts.items()}
        sources = ctx.weight_sources.get(ctx.program, {})
        for source in sources.values():
            for view in source.views:
                _check_row_order(view, ctx.shard_specs[view.name], self.tp)
        specs_of = {node.name: [ctx.shard_specs[v.name] for v in sources[node.name].views]
                    for node in gm.graph.nodes if node.op == "placeholder" and node.name in sources}
        for node in gm.graph.nodes:
            if node.name in specs_of:
                node.meta["hgc.shard"] = "; ".join(dict.fromkeys(s.describe(self.tp) for s in specs_of[node.name]))
        collectives = self._place_collectives(gm, specs_of, ctx.signatures.get(ctx.program))
        for node in op_nodes(gm):
            if op_name_of(node.target) not in COLLECTIVE_OPS:
                node.meta["hgc.shard"] = _op_shard(node, ctx.registry, ctx.whole_registry, self.tp)
        ctx.sharding[ctx.program] = collectives
        gm.graph.lint()
        gm.recompile()
        return PassResult(gm, modified=True)

    def _place_collectives(self, gm, specs_of: dict[str, list[ShardSpec]], signature) -> list[dict]:
        graph, placed = gm.graph, []
        last_layer: Optional[int] = None

        def spec(node) -> Optional[ShardSpec]:
            specs = specs_of.get(getattr(node, "name", None))
            return specs[0] if specs and len(specs) == 1 else None

        for node in list(graph.nodes):
            op = op_name_of(node.target) if node.op == "call_function" else None
            if op is not None:
                args = call_arguments(node)
                last_layer = args["layer_id"]
                if op == "moe":
                    placed += self._after_moe(graph, node, args, specs_of)
                continue
            if node.op != "call_function" or node.target is not _LINEAR:
                continue
            weight = spec(node.args[1])
            if weight is None or weight.dim is None:
                continue
            if weight.dim == 1:
                placed.append(self._reduce_linear(graph, node, last_layer))
            elif weight.dim == 0 and _reaches_output(node):
                placed.append(self._gather_output(graph, node, last_layer, signature))
        return placed

    def _reduce_linear(self, graph, node, layer_id) -> dict:
        if layer_id is None:
            raise ShardingError(f"sharding: node {node.name} (a row-parallel linear) comes before any layer's op node; "
                                f"nothing names the layer its all-reduce belongs to")
        bias = node.args[2] if len(node.args) > 2 else None
        if bias is not None:  # summed over ranks the bias would count tp times: add it once, after the sum
            node.args = node.args[:2]
        reduce = _insert_after(graph, node, _HGC.all_reduce.default, (node, layer_id), node)
        why = f"row-parallel {node.args[1].name}: sums each rank's partial projection"
        if bias is not None:
            add = _insert_after(graph, reduce, torch.ops.aten.add.Tensor, (node, bias), node,
                                _fake(torch.add, node.meta["val"], bias.meta["val"]))
            _redirect(node, add, {reduce, add})
            why += f" (bias {bias.name} added once, after it)"
        return {"node": reduce.name, "op": "all_reduce", "layer_id": layer_id, "after": node.name, "why": why}

    def _after_moe(self, graph, node, args, specs_of) -> list[dict]:
        names = ("w13", "w2", "shared_w13", "shared_w2")
        cut = {n: any(not s.replicated for s in specs_of.get(args[n].name, ())) for n in names if args[n] is not None}
        if len(set(cut.values())) > 1:
            raise ShardingError(f"sharding: layer {args['layer_id']}'s moe block has its {sorted(k for k, v in cut.items() if v)} "
                                f"cut and {sorted(k for k, v in cut.items() if not v)} whole: its output would be part "
                                f"partial sum, part total")
        if not any(cut.values()):
            return []
        out = args["out"]
        reduce = _insert_after(graph, node, _HGC.all_reduce.default, (out, args["layer_id"]), node)
        return [{"node": reduce.name, "op": "all_reduce", "layer_id": args["layer_id"], "after": node.name,
                 "why": "tensor-parallel experts: sums each rank's slice of every expert (and of the shared expert)"}]

    def _gather_output(self, graph, node, layer_id, signature) -> dict:
        val = node.meta["val"]
        rows = _insert_after(graph, node, torch.ops.aten.sym_size.int, (node, 0), node, val.shape[0])
        width = val.shape[-1] * self.tp
        out = _insert_after(graph, rows, torch.ops.aten.new_empty.default, (node, [rows, width]), node,
                            _fake(lambda v: v.new_empty((v.shape[0], width)), val))
        gather = _insert_after(graph, out, _HGC.all_gather.default, (node, out, layer_id), node)
        _redirect(node, out, {rows, out, gather})
        _refresh_passed_on(out)
        for spec in getattr(signature, "output_specs", ()):  # the exported program names its outputs by node
            if getattr(spec.arg, "name", None) == node.name:
                spec.arg = type(spec.arg)(name=out.name)
        return {"node": gather.name, "op": "all_gather", "layer_id": layer_id, "after": node.name,
                "why": f"vocabulary-parallel {node.args[1].name}: each rank's {val.shape[-1]} logits, gathered to {width}"}

    def ensures(self, gm, ctx) -> None:
        order = list(gm.graph.nodes)
        for i, node in enumerate(order):
            if node.op == "call_function" and node.target is _LINEAR:
                specs = ctx.weight_sources.get(ctx.program, {}).get(getattr(node.args[1], "name", None))
                row = specs is not None and any(ctx.shard_specs[v.name].dim == 1 for v in specs.views)
                if row and op_name_of(order[i + 1].target) != "all_reduce":
                    raise PostconditionError(f"sharding: row-parallel node {node.name} is not followed by its all-reduce")


# The argument whose dim 1 (or, for short_conv, last dim) counts a rank's heads (channels).
_HEADS = {"gqa_attention": ("q", 1, "heads"), "mla_attention": ("q_latent", 1, "heads"), "gdn_core": ("v", 1, "heads"),
          "kda_core": ("q", 1, "heads"), "lightning_core": ("q", 1, "heads"), "short_conv": ("x", -1, "channels")}


def _op_shard(node, registry: LayerRegistry, whole: LayerRegistry, tp: int) -> str:
    """What a rank holds of the op node's layer: its heads, and each state / KV entry's rank shape
    against the whole model's (a pool is allocated per rank, never loaded, so no cut is described)."""
    op = op_name_of(node.target)
    if op == "moe":
        return "tensor-parallel experts: every expert, 1/%d of its intermediate channels" % tp
    parts = []
    if op in _HEADS:
        arg, dim, what = _HEADS[op]
        count = call_arguments(node)[arg].meta["val"].shape[dim]
        parts.append(f"{what} {count} of {count * tp}")
    layer_id = call_arguments(node)["layer_id"]
    for group in ("kv", "state") if layer_id in registry else ():
        for entry, rank in getattr(registry[layer_id], group).items():
            parts.append(f"{group}.{entry} {list(rank.shape)} of {list(getattr(whole[layer_id], group)[entry].shape)}")
    return "; ".join(parts)


def sharding_summary(ctx) -> dict:
    """sharding.json's content: the rank count, every tensor's spec, each layer's rank shapes, the collectives."""
    layers = []
    for spec in ctx.registry:
        whole = ctx.whole_registry[spec.layer_id]
        entries = {**{f"kv.{k}": (whole.kv[k], v) for k, v in spec.kv.items()},
                   **{f"state.{k}": (whole.state[k], v) for k, v in spec.state.items()}}
        layers.append({"layer_id": spec.layer_id, "kind": spec.kind.value, "draft": spec.draft,
                       "entries": {k: {"whole": list(w.shape), "rank": list(r.shape)} for k, (w, r) in entries.items()}})
    return {"tp": ctx.tp, "moe": "tensor-parallel experts",
            "tensors": {name: spec.to_json() for name, spec in sorted(ctx.shard_specs.items())},
            "layers": layers, "collectives": {p: ctx.sharding.get(p, []) for p in ctx.program_names}}
