"""SharedExpertPass (`--overlap` only): each moe op's shared expert taken out of the op into graph glue.

The `moe` op computes router, routed experts and shared expert in one call (on CUDA the Triton
kernel runs the shared expert as extra experts of the same launches). A second stream can only
overlap what the graph shows, so with `--overlap` this pass rewrites every moe node that has a
shared expert:

1. the moe node keeps router and routed experts; its shared_w13 / shared_w2 / shared_gate become
   None (the op then writes the routed sum alone into its `out`);
2. `add_shared_expert` (compiler/splitops/shared_expert.py, the CPU reference's own math) is
   traced to aten nodes (make_fx, pre-dispatch: the IR torch.export writes) and inlined: the
   nodes that read only x and the weights go before the moe node, the sum with the op's `out`
   after it;
3. every later reader of the op's `out` reads that sum instead. Each new node gets its meta
   value from the graph's fake values (so dumps, glue segments and the artifact's program see
   shapes) and `hgc.shared_expert` = the moe node's name (for dumps and tests).

Example (Qwen3-Next, one MoE layer)::

    before:  %moe = hgc.moe(%x, %router, None, %w13, %w2, %shared_w13, %shared_w2, %shared_gate, %out, ...)
             %add = aten.add(%residual, %out)
    after:   %linear_9 = aten.linear(%x, %shared_w13) ... %mul_14 = aten.mul(%to_20, %sigmoid_3)
             %moe = hgc.moe(%x, %router, None, %w13, %w2, None, None, None, %out, ...)
             %to_22 = aten.to(%out, float32); %add_15 = aten.add(%to_22, %mul_14); %to_23 = aten.to(%add_15, ...)
             %add = aten.add(%residual, %to_23)

In float32 the program computes bit for bit what the fused op did; in bfloat16 the routed sum
is rounded once more (shared_expert.py). The overlap pass (compiler/passes/overlap.py) then
finds the shared expert independent of the moe op and may put it on the side stream.

What it does not do: decide streams (the overlap pass does), or run without `--overlap` (the
default keeps the fused op: its one launch sequence is what the overlap benchmark compares with).
"""

from __future__ import annotations

import functools

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from compiler.passes.base import CompilePass, PassResult, PostconditionError
from compiler.splitops import call_arguments, op_name_of, op_nodes
from compiler.splitops.errors import CompileError
from compiler.splitops.shared_expert import add_shared_expert

__all__ = ["SharedExpertPass", "SHARED_ARGS"]

# The moe op's shared-expert arguments, in schema order (compiler/splitops/ops.py).
SHARED_ARGS = ("shared_w13", "shared_w2", "shared_gate")
_INPUTS = ("routed", "x") + SHARED_ARGS  # add_shared_expert's parameters


def _spec(node, rows: bool = False) -> tuple | None:
    """(static shape, dtype) of a node's value; `rows`: without its first (token) dimension."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return None if val is None else (tuple(int(s) for s in val.shape[1 if rows else 0:]), val.dtype)


@functools.lru_cache(maxsize=None)
def _traced(x_spec: tuple, w13_spec: tuple, w2_spec: tuple, gate_spec: tuple | None) -> torch.fx.Graph:
    """add_shared_expert as aten nodes, traced on meta tensors of the layer's widths and dtypes.

    The token count of the trace (2) appears nowhere in the graph (shared_expert.py says why), so
    the nodes hold for the program's symbolic one; the cache makes one trace per distinct layer."""
    def tensor(spec, rows=None):
        shape, dtype = spec
        return torch.empty((rows, *shape) if rows else shape, dtype=dtype, device="meta")

    x = tensor(x_spec, 2)
    args = [torch.empty_like(x), x, tensor(w13_spec), tensor(w2_spec)]
    if gate_spec is None:
        fn = lambda routed, x, w13, w2: add_shared_expert(routed, x, w13, w2, None)  # noqa: E731
    else:
        fn = add_shared_expert
        args.append(tensor(gate_spec))
    return make_fx(fn, pre_dispatch=True)(*args).graph


def _fake_value(target, args, kwargs):
    """The meta value of a new node: its target run on the graph's fake values."""
    args, kwargs = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    mode = detect_fake_mode([v for v in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)])
    with mode:
        return target(*args, **kwargs)


def unfuse(gm: torch.fx.GraphModule, moe: torch.fx.Node) -> list[torch.fx.Node]:
    """Steps 1-3 of the module docstring for one moe node; returns the new nodes."""
    args = call_arguments(moe)
    out = args["out"]
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    early = [u.name for u in out.users if u is not moe and order[u] < order[moe]]
    if early:
        raise CompileError(f"shared_expert: moe node {moe.name} (layer {args['layer_id']}): its out {out.name} is "
                           f"read before the op by {early[:3]}; only an out the op alone writes first can be "
                           f"split into routed and shared sums")
    later = [u for u in out.users if u is not moe]
    traced = _traced(_spec(args["x"], rows=True), _spec(args["shared_w13"]), _spec(args["shared_w2"]),
                     _spec(args["shared_gate"]))
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    after_op: set[torch.fx.Node] = set()  # traced nodes that read the op's out: they go after the op
    placeholders = iter(_INPUTS)
    cursor, made = moe, []
    for t in traced.nodes:
        if t.op == "placeholder":
            name = next(placeholders)
            env[t] = out if name == "routed" else args[name]
            if name == "routed":
                after_op.add(t)
            continue
        if t.op == "output":
            result = env[t.args[0]]
            break
        node_args, node_kwargs = torch.fx.node.map_arg((t.args, t.kwargs), lambda n: env[n])
        reads_out = any(a in after_op for a in t.all_input_nodes)
        if reads_out:
            after_op.add(t)
            with graph.inserting_after(cursor):
                node = graph.call_function(t.target, node_args, node_kwargs)
            cursor = node
        else:
            with graph.inserting_before(moe):
                node = graph.call_function(t.target, node_args, node_kwargs)
        node.meta["val"] = _fake_value(t.target, node_args, node_kwargs)
        node.meta["nn_module_stack"] = dict(moe.meta.get("nn_module_stack") or {})
        node.meta["hgc.shared_expert"] = moe.name
        env[t] = node
        made.append(node)
    for user in later:
        user.replace_input_with(out, result)
    names = list(moe.target._schema.arguments)
    new_args = list(moe.args)
    for name in SHARED_ARGS:
        index = next(i for i, a in enumerate(names) if a.name == name)
        if index < len(new_args):
            new_args[index] = None
    moe.args = tuple(new_args)
    moe.kwargs = {k: (None if k in SHARED_ARGS else v) for k, v in moe.kwargs.items()}
    return made


def _fused(gm) -> list[torch.fx.Node]:
    return [n for n in op_nodes(gm) if op_name_of(n.target) == "moe" and call_arguments(n)["shared_w13"] is not None]


class SharedExpertPass(CompilePass):
    name = "shared_expert"
    version = 1

    def __call__(self, gm, ctx) -> PassResult:
        fused = _fused(gm)
        for moe in fused:
            unfuse(gm, moe)
        if fused:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified=bool(fused))

    def ensures(self, gm, ctx) -> None:
        left = [n.name for n in _fused(gm)]
        if left:
            raise PostconditionError(f"shared_expert: moe nodes {left[:3]} still compute their shared expert")
        blank = [n.name for n in gm.graph.nodes if "hgc.shared_expert" in n.meta and "val" not in n.meta]
        if blank:
            raise PostconditionError(f"shared_expert: new nodes {blank[:3]} have no meta value")
