"""The ONNX dump: the FX graph as an ONNX model built with onnx.helper, for Netron.

1. Graph inputs are the placeholders (weights and user inputs), typed from their meta values.
2. Each call_function node becomes one NodeProto in the domain of its op ("aten", "hgc",
   "python" for getitem and symbolic arithmetic). Tensor arguments are inputs; constants are
   attributes (arg0, arg1, ...). hgc op nodes carry `layer_id`, `op`, `kind`, `backend` and
   `stateful` attributes, and their node name is "L<layer>/<op>/<fx name>".
3. An hgc op writes its `out` argument in place; ONNX values are single-assignment, so the op gets
   an output "<fx name>.out" and later readers of `out` read that value: Netron then draws the
   data flowing through the op.
4. After the split pass, each piece of the shown plan is an ONNX function (domain "hgc.pieces",
   named "piece_<i>_<kind>") and the graph is the sequence of calls to them.

The result passes onnx.checker.check_model; it is a picture of the program, not something to run.
"""

from __future__ import annotations

import torch
import torch.fx
import onnx
from onnx import TensorProto, helper

from compiler.dump.graph_view import GraphView, target_label, value_type
from compiler.splitops import op_name_of

__all__ = ["onnx_model", "PIECES_DOMAIN"]

PIECES_DOMAIN = "hgc.pieces"

_DTYPES = {
    torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
    torch.float64: TensorProto.DOUBLE, torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}


def _value_info(name: str, node: torch.fx.Node | None):
    dtype, shape = value_type(node.meta.get("val")) if node is not None else (None, None)
    if dtype is None:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
    return helper.make_tensor_value_info(name, _DTYPES.get(dtype, TensorProto.FLOAT), shape)


def _attribute_value(value):
    """A constant argument as an ONNX attribute value (ints, floats, strings, or their lists)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, float) for v in value):
        return list(value)
    return repr(value)


class _Builder:
    def __init__(self, view: GraphView):
        self.view = view
        self.current: dict[str, str] = {}  # fx node name -> the ONNX value holding it now
        self.domains: set[str] = set()

    def value(self, node: torch.fx.Node) -> str:
        return self.current.get(node.name, node.name)

    def node_proto(self, node: torch.fx.Node):
        domain, op_type = target_label(node)
        self.domains.add(domain)
        inputs, attrs = [], {}

        def collect(prefix: str, a):
            if isinstance(a, torch.fx.Node):
                inputs.append(self.value(a))
            elif isinstance(a, (list, tuple)) and any(isinstance(x, torch.fx.Node) for x in a):
                for j, x in enumerate(a):
                    collect(f"{prefix}_{j}", x)
            elif a is not None:
                attrs[prefix] = _attribute_value(a)

        for i, a in enumerate(node.args):
            collect(f"arg{i}", a)
        for k, a in node.kwargs.items():
            collect(k, a)
        outputs = [node.name]
        name = node.name
        op = op_name_of(node.target) if node.op == "call_function" else None
        if op is not None:
            facts = self.view.facts(node)
            layer = facts.get("layer_id")
            attrs.update({"op": op, "layer_id": -1 if layer is None else int(layer)})
            for key in ("kind", "backend", "module"):
                if facts.get(key) is not None:
                    attrs[key] = str(facts[key])
            if "stateful" in facts:
                attrs["stateful"] = int(bool(facts["stateful"]))
            for mode, index in sorted((facts.get("piece") or {}).items()):
                attrs[f"piece_{mode}"] = int(index)
            name = f"L{layer}/{op}/{node.name}"
            # The op mutates its Tensor(a!) arguments: later readers see the op's output instead.
            written = [i for i, arg in enumerate(node.target._schema.arguments)
                       if arg.alias_info is not None and arg.alias_info.is_write]
            for i in written:
                if i < len(node.args) and isinstance(node.args[i], torch.fx.Node):
                    out_name = f"{node.name}.out"
                    outputs = [out_name]
                    self.current[node.args[i].name] = out_name
        return helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs), outputs


def onnx_model(view: GraphView) -> onnx.ModelProto:
    b = _Builder(view)
    nodes = view.nodes()
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output_node = next(n for n in nodes if n.op == "output")
    inputs = [_value_info(n.name, n) for n in placeholders]
    protos = []  # (fx node, NodeProto, outputs)
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        proto, outs = b.node_proto(node)
        protos.append((node, proto, outs))
    results = [a for a in torch.fx.graph.map_arg(output_node.args[0], lambda n: n) if isinstance(a, torch.fx.Node)] \
        if isinstance(output_node.args[0], (list, tuple)) else [output_node.args[0]]
    outputs = [_value_info(b.value(n), n) for n in results]
    opsets = [helper.make_opsetid("", 21)]
    functions = []
    if view.plan is None:
        graph_nodes = [p for _, p, _ in protos]
    else:
        graph_nodes, functions = _pieces(view, protos, b, {i.name for i in inputs}, {o.name for o in outputs})
        opsets.append(helper.make_opsetid(PIECES_DOMAIN, 1))
    opsets += [helper.make_opsetid(d, 1) for d in sorted(b.domains)]
    graph = helper.make_graph(graph_nodes, f"{view.program}:{view.title}", inputs, outputs)
    model = helper.make_model(graph, opset_imports=opsets, functions=functions, producer_name="hgc",
                              doc_string=f"hgc {view.program} program after {view.title}")
    return model


def _pieces(view: GraphView, protos, b: _Builder, graph_inputs: set[str], graph_outputs: set[str]):
    """One FunctionProto per piece of the shown plan, and the graph of calls to them."""
    piece_of = view.piece_of()
    by_piece: dict[int, list] = {}
    for node, proto, outs in protos:
        by_piece.setdefault(piece_of[node.name], []).append((proto, outs))
    defined_in: dict[str, int] = {}
    for index, items in by_piece.items():
        for _, outs in items:
            for o in outs:
                defined_in[o] = index
    used_after: dict[int, set[str]] = {i: set() for i in by_piece}
    for index, items in by_piece.items():
        for proto, _ in items:
            for name in proto.input:
                where = defined_in.get(name)
                if where is not None and where != index:
                    used_after[where].add(name)
    for name in graph_outputs:
        if name in defined_in:
            used_after[defined_in[name]].add(name)
    calls, functions = [], []
    for index in sorted(by_piece):
        items = by_piece[index]
        local = {o for _, outs in items for o in outs}
        needed = []
        for proto, _ in items:
            for name in proto.input:
                if name not in local and name not in needed:
                    needed.append(name)
        produced = [o for _, outs in items for o in outs if o in used_after[index]]
        kind = view.plan.pieces[index].kind
        fname = f"piece_{index}_{kind}"
        domains = sorted({p.domain for p, _ in items})
        functions.append(helper.make_function(
            PIECES_DOMAIN, fname, needed, produced, [p for p, _ in items],
            opset_imports=[helper.make_opsetid(d, 1) for d in domains] + [helper.make_opsetid("", 21)],
            doc_string=f"{kind} piece {index} of the {view.plan.mode.value} plan ({len(items)} nodes)"))
        calls.append(helper.make_node(fname, needed, produced, name=f"{kind} piece {index}", domain=PIECES_DOMAIN))
    return calls, functions
