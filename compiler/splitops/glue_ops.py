"""Ops of the compiled glue: custom ops that Inductor keeps as calls inside a piece (namespace `hgc_glue`).

They are not op cores. An op core (compiler/splitops/ops.py, namespace `hgc`) is bound by routing,
cut out of the glue and called by the runtime between pieces; a glue op is plain glue, compiled into
a piece like any aten op, except that Inductor cannot see through it: the op has no decomposition,
so the piece's code calls it by name and the process's kernel for it runs. `is_op_node` and the
glue cut (compiler/splitops/glue.py) look at the `hgc` namespace only, so a glue op never cuts.

`small_m_linear(x, weight)`: x [M, K] @ weight [N, K]^T -> [M, N], a bias-free projection.
1. Defined here, when this module is imported: its CompositeExplicitAutograd kernel is `F.linear`
   (every device, the CPU's reference), its fake kernel an empty [M, N]. Whatever loads a piece
   that calls it imports this module first (runtime/artifact/bundle.py).
2. `use_small_m_linear(gm)`: the rewrite compiler/inductor_pieces.py runs on a glue segment before
   its structure key is taken and it compiles, where hgc/build_command.py asks for it (cuda
   bundles of artifacts that are not batch-invariant: docs/DESIGN.md, "Decode's projections as one
   GEMV launch").
3. The runtime registers the op's CUDA kernel (runtime/backends/glue_kernels.py): the one-launch
   GEMV (runtime/backends/kernels/gemv.py) for the few-row shapes where it was measured faster
   than cuBLAS, `F.linear` for everything else. Chosen per call, from the call's shapes: one
   compiled piece serves every bucket.

`add_rms_norm_linear(a, b, norm_weight, weight, eps, unit_offset) -> (out, summed)` and
`rms_norm_linear(x, norm_weight, weight, eps, unit_offset) -> out`: a layer's input RMSNorm
(models/common.py `RMSNorm`), with the residual add before it in the first, and the projection that
reads the normed row, as one op. summed = a + b in the activation dtype (the residual stream the
glue carries on); out = linear(RMSNorm(summed or x), weight), the normed row rounded to the
activation dtype before the product, as the glue rounds it.
1. Defined here, as small_m_linear is: their CompositeExplicitAutograd kernels are the traced
   glue's own ops (`rms_norm_rows`, then F.linear), so on the CPU a rewritten segment gives the
   bits it gave before; fake kernels give the shapes.
2. `use_norm_linear(gm)`: the rewrite compile_glue runs after `use_small_m_linear` where
   hgc/build_command.py asks for it (`hgc build --norm-linear`; docs/DESIGN.md, "Norms folded into
   the GEMVs (`--norm-linear`)").
3. The runtime registers their CUDA kernels beside small_m_linear's (runtime/backends/glue_kernels.py):
   a GEMV with the norm in its prologue where small_m_linear would take the GEMV, else one row
   kernel for the add and the norm, then F.linear.

`linear_add_rms_norm(x, weight, residual, norm_weight, eps, unit_offset) -> (normed, summed)`: a
layer's output projection, the residual add after it and the RMSNorm of the sum (the norm that
feeds the MoE op) as one op: summed = residual + linear(x, weight) in the activation dtype, normed =
RMSNorm(summed). Defined as the two above are; `use_norm_linear` folds them too (its step 2), and
the runtime runs the GEMV with the add and the norm in its epilogue where small_m_linear would take
the GEMV (the last of its programs to finish normalises the row), else F.linear and the row kernel.

`qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, unit_offset) -> (q_out, k_out)`: a
layer's per-head RMSNorms of q [T, Hq, D] and k [T, Hk, D] and `apply_rotary`'s GPT-NeoX rotation of
their first 2 * len(inv_freq) channels (`norm_rope_rows`, the traced glue's ops, is its CPU kernel).
`use_norm_rope(gm)` (`hgc build --norm-rope`) folds each pair it finds, q's then k's, into one call,
with the rotation's inv_freq as the glue computed it; the runtime's CUDA kernel
(runtime/backends/kernels/norm_rope.py) reads each row once where Inductor's code passed over q twice.

`sigmoid_gate(x, gate) -> out`: an attention output's gate, out = x * sigmoid(gate) rounded as the
traced glue rounds it (the sigmoid to the activation dtype, then the product), x and gate [T, H, D]
(or [T, D]) with a contiguous last dimension (gate a view of the projection's output, beside q),
out contiguous. `use_sigmoid_gate(gm)` (`hgc build --sigmoid-gate`) takes each `mul(x,
sigmoid(gate))` whose sigmoid nothing else reads; the runtime's CUDA kernel
(runtime/backends/kernels/sigmoid_gate.py) reads each row once in a fixed tile, where Inductor's
fused kernel chose its tile by timing candidates at the build and took one of two, about twice
apart at 4096 tokens, build by build (docs/DESIGN.md, "An attention output's gate as one kernel").

What it does not do: decide which device runs the GEMV (the kernel registration does), or touch an
op core's arguments.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["NAMESPACE", "SMALL_M_LINEAR", "ADD_RMS_NORM_LINEAR", "RMS_NORM_LINEAR", "LINEAR_ADD_RMS_NORM",
           "QK_NORM_ROPE", "SIGMOID_GATE", "rms_norm_rows", "norm_rope_rows",
           "use_small_m_linear", "use_norm_linear", "use_norm_rope", "use_sigmoid_gate"]

NAMESPACE = "hgc_glue"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # noqa: kept for the process: dropping it undefines the op
_LIB.define("small_m_linear(Tensor x, Tensor weight) -> Tensor")


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty([*x.shape[:-1], weight.shape[0]])


_LIB.impl("small_m_linear", _reference, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::small_m_linear", _fake, lib=_LIB)

SMALL_M_LINEAR = torch.ops.hgc_glue.small_m_linear.default

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # the GEMV's dtypes (gemv.py)


def _plain_projection(node: torch.fx.Node) -> bool:
    """aten.linear(x [M, K], weight [N, K]) without a bias, weight a placeholder of the graph (in a
    glue segment: a value from outside it, the model's parameter), both of one float dtype."""
    if node.op != "call_function" or node.target is not torch.ops.aten.linear.default:
        return False
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    x, weight = node.args[0], node.args[1]
    if bias is not None or not isinstance(weight, torch.fx.Node) or weight.op != "placeholder":
        return False
    xv, wv = x.meta.get("val"), weight.meta.get("val")
    return (isinstance(xv, torch.Tensor) and isinstance(wv, torch.Tensor) and xv.dim() == 2 and wv.dim() == 2
            and xv.dtype == wv.dtype and xv.dtype in _FLOATS)


def use_small_m_linear(gm: torch.fx.GraphModule) -> int:
    """Step 2: each plain projection of `gm` (`_plain_projection`) becomes a call of small_m_linear
    in place, with the projection's traced value; how many. A projection with a bias, a
    3-D input, a weight computed in the graph or a non-float dtype stays as it was.

    Traced glue holds projections as aten.linear (export keeps the composite op), never as a
    transposed mm, so that is what it matches: a qwen3_next attention output projection is
    `linear(reshape(mul(in_1, sigmoid(in_0)), [-1, K]), in_2)`, in_2 its weight, and every linear of
    the tiny qwen3_next programs is a plain one (tests/compiler/test_glue_ops.py)."""
    count = 0
    for node in list(gm.graph.nodes):
        if not _plain_projection(node):
            continue
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(SMALL_M_LINEAR, (node.args[0], node.args[1]))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count


# -- a layer's input norm folded into the projection that reads it ----------------------------------

_LIB.define("add_rms_norm_linear(Tensor a, Tensor b, Tensor norm_weight, Tensor weight, float eps, bool unit_offset)"
            " -> (Tensor, Tensor)")
_LIB.define("rms_norm_linear(Tensor x, Tensor norm_weight, Tensor weight, float eps, bool unit_offset) -> Tensor")


def rms_norm_rows(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """models/common.py RMSNorm.forward, op for op as the glue traces it: x's rows normalised in
    float32, scaled by (w + 1) or w in float32, rounded to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight.float()
    return (xf * (w + 1.0) if unit_offset else xf * w).to(x.dtype)


def _add_norm_reference(a, b, norm_weight, weight, eps: float, unit_offset: bool):
    summed = a + b
    return F.linear(rms_norm_rows(summed, norm_weight, eps, unit_offset), weight), summed


def _norm_reference(x, norm_weight, weight, eps: float, unit_offset: bool):
    return F.linear(rms_norm_rows(x, norm_weight, eps, unit_offset), weight)


def _add_norm_fake(a, b, norm_weight, weight, eps: float, unit_offset: bool):
    return a.new_empty([*a.shape[:-1], weight.shape[0]]), torch.empty_like(a, memory_format=torch.contiguous_format)


def _norm_fake(x, norm_weight, weight, eps: float, unit_offset: bool):
    return x.new_empty([*x.shape[:-1], weight.shape[0]])


_LIB.impl("add_rms_norm_linear", _add_norm_reference, "CompositeExplicitAutograd")
_LIB.impl("rms_norm_linear", _norm_reference, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::add_rms_norm_linear", _add_norm_fake, lib=_LIB)
torch.library.register_fake(f"{NAMESPACE}::rms_norm_linear", _norm_fake, lib=_LIB)

ADD_RMS_NORM_LINEAR = torch.ops.hgc_glue.add_rms_norm_linear.default
RMS_NORM_LINEAR = torch.ops.hgc_glue.rms_norm_linear.default

# -- a post-attention norm folded into the output projection before it --------------------------------

_LIB.define("linear_add_rms_norm(Tensor x, Tensor weight, Tensor residual, Tensor norm_weight, float eps, "
            "bool unit_offset) -> (Tensor, Tensor)")


def _linear_norm_reference(x, weight, residual, norm_weight, eps: float, unit_offset: bool):
    summed = residual + F.linear(x, weight)
    return rms_norm_rows(summed, norm_weight, eps, unit_offset), summed


def _linear_norm_fake(x, weight, residual, norm_weight, eps: float, unit_offset: bool):
    like = torch.empty_like(residual, memory_format=torch.contiguous_format)
    return like, torch.empty_like(like)


_LIB.impl("linear_add_rms_norm", _linear_norm_reference, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::linear_add_rms_norm", _linear_norm_fake, lib=_LIB)

LINEAR_ADD_RMS_NORM = torch.ops.hgc_glue.linear_add_rms_norm.default

# -- a GQA layer's q / k norms and their rotary --------------------------------------------------------

_LIB.define("qk_norm_rope(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor positions, Tensor inv_freq, "
            "float eps, bool unit_offset) -> (Tensor, Tensor)")


def norm_rope_rows(x: torch.Tensor, norm_weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   eps: float, unit_offset: bool) -> torch.Tensor:
    """models/common.py's RMSNorm of each head's row of x [T, H, D], then `apply_rotary`'s GPT-NeoX
    rotation of its first 2 * len(inv_freq) channels, op for op as the glue traces them."""
    normed = rms_norm_rows(x, norm_weight, eps, unit_offset)
    rotary = 2 * inv_freq.shape[0]
    freqs = positions.float().unsqueeze(-1) * inv_freq
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    rot, rest = normed[..., :rotary].float(), normed[..., rotary:]
    x1, x2 = rot[..., : rotary // 2], rot[..., rotary // 2:]
    return torch.cat(((x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), rest), dim=-1)


def _qk_norm_rope_reference(q, k, q_weight, k_weight, positions, inv_freq, eps: float, unit_offset: bool):
    return (norm_rope_rows(q, q_weight, positions, inv_freq, eps, unit_offset),
            norm_rope_rows(k, k_weight, positions, inv_freq, eps, unit_offset))


def _qk_norm_rope_fake(q, k, q_weight, k_weight, positions, inv_freq, eps: float, unit_offset: bool):
    return q.new_empty(q.shape), k.new_empty(k.shape)


_LIB.impl("qk_norm_rope", _qk_norm_rope_reference, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::qk_norm_rope", _qk_norm_rope_fake, lib=_LIB)

QK_NORM_ROPE = torch.ops.hgc_glue.qk_norm_rope.default

# -- an attention output's sigmoid gate ----------------------------------------------------------------

_LIB.define("sigmoid_gate(Tensor x, Tensor gate) -> Tensor")


def _sigmoid_gate_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The traced glue's two ops (sigmoid in the activation dtype, then the product), contiguous."""
    return (x * torch.sigmoid(gate)).contiguous()


def _sigmoid_gate_fake(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_LIB.impl("sigmoid_gate", _sigmoid_gate_reference, "CompositeExplicitAutograd")
torch.library.register_fake(f"{NAMESPACE}::sigmoid_gate", _sigmoid_gate_fake, lib=_LIB)

SIGMOID_GATE = torch.ops.hgc_glue.sigmoid_gate.default

_aten = torch.ops.aten
_ASSERT = _aten._assert_tensor_metadata.default  # export's dtype checks: readers that compute nothing


@dataclasses.dataclass
class _Norm:
    """An RMSNorm as the rewrite found it: `out` its normed row (the cast back to the activation
    dtype), `row` its input, `to_float` the input's cast to float32, `nodes` its own nodes (`out`
    first, to_float last: readers before what they read, the order they are erased in)."""

    out: torch.fx.Node
    row: torch.fx.Node
    to_float: torch.fx.Node
    nodes: list[torch.fx.Node]
    norm_weight: torch.fx.Node
    eps: float
    unit_offset: bool


@dataclasses.dataclass
class _InputNorm:
    """An RMSNorm whose normed row only a projection reads (`weight` its weight)."""

    projection: torch.fx.Node
    norm: _Norm
    weight: torch.fx.Node


def _call(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _val(node) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _readers(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [u for u in node.users if u.target is not _ASSERT]


def _read_only_by(node, reader: torch.fx.Node) -> bool:
    return _readers(node) == [reader]


def _same_sizes(x, y) -> bool:
    """Whether two shapes are equal as traced, symbolic sizes included, without adding a guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(x) == len(y) and all(statically_known_true(p == q) for p, q in zip(x, y))


def _cast_to(node) -> Optional[torch.dtype]:
    """The dtype a plain cast converts to (`aten.to.dtype`, or `_to_copy` with a dtype only), else None."""
    if _call(node, _aten.to.dtype):
        plain = len(node.args) == 2 and not any(node.kwargs.values())  # no copy, non_blocking or memory format
        return node.args[1] if plain else None
    if _call(node, _aten._to_copy.default) and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def _projection_of(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """(input row, weight) of a plain projection (`_plain_projection`) or a call of small_m_linear
    (which use_small_m_linear made of one), else None."""
    if _plain_projection(node):
        return node.args[0], node.args[1]
    if _call(node, SMALL_M_LINEAR) and node.args[1].op == "placeholder":
        return node.args[0], node.args[1]
    return None


def _scale_of(node) -> Optional[tuple[torch.fx.Node, bool, list[torch.fx.Node]]]:
    """(norm weight, unit_offset, its nodes) where node is the norm's float32 scale: `to(w, float32)`
    or `add(to(w, float32), 1.0)` of a placeholder w; else None."""
    unit_offset = _call(node, _aten.add.Tensor) and len(node.args) == 2 and not node.kwargs and node.args[1] == 1.0
    cast = node.args[0] if unit_offset else node
    if _cast_to(cast) != torch.float32 or not isinstance(cast.args[0], torch.fx.Node) or \
            cast.args[0].op != "placeholder":
        return None
    if unit_offset and not _read_only_by(cast, node):
        return None
    return cast.args[0], unit_offset, [node, cast] if unit_offset else [cast]


def _normalized_of(node) -> Optional[tuple[torch.fx.Node, float, list[torch.fx.Node]]]:
    """(the float32 row x, eps, the nodes) where node is `mul(x, rsqrt(add(mean(pow(x, 2), [-1],
    True), eps)))`, its factors in either order; else None."""
    if not _call(node, _aten.mul.Tensor) or len(node.args) != 2:
        return None
    for x, rsqrt in (node.args, node.args[::-1]):
        if not _call(rsqrt, _aten.rsqrt.default) or not _read_only_by(rsqrt, node):
            continue
        plus = rsqrt.args[0]
        if not _call(plus, _aten.add.Tensor) or plus.kwargs or not isinstance(plus.args[1], (int, float)):
            continue
        mean = plus.args[0]
        if not _call(mean, _aten.mean.dim) or mean.kwargs or list(mean.args[1:]) not in ([[-1], True], [[1], True]):
            continue
        square = mean.args[0]
        if not _call(square, _aten.pow.Tensor_Scalar) or square.args[1] != 2 or square.args[0] is not x:
            continue
        if not (_read_only_by(plus, rsqrt) and _read_only_by(mean, plus) and _read_only_by(square, mean)):
            continue
        return x, float(plus.args[1]), [node, rsqrt, plus, mean, square]
    return None


def _rms_norm_of(y, rank: int = 2) -> Optional[_Norm]:
    """The RMSNorm (models/common.py) whose normed row y is, else None: `y = to(mul(normalized,
    scale), A)` with A the row's dtype, normalized and scale as `_normalized_of` and `_scale_of` say,
    the float32 row `to(row, float32)` of a row of A of `rank` dimensions (3: a head's rows [T, H, D])."""
    row_value = _val(y)
    if row_value is None or _cast_to(y) != row_value.dtype:
        return None
    product = y.args[0]
    if not _call(product, _aten.mul.Tensor) or len(product.args) != 2 or not _read_only_by(product, y):
        return None
    for normalized, scale in (product.args, product.args[::-1]):
        norm, scaled = _normalized_of(normalized), _scale_of(scale)
        if norm is None or scaled is None or not _read_only_by(normalized, product) or \
                not _read_only_by(scale, product):
            continue
        to_float, eps, norm_nodes = norm
        norm_weight, unit_offset, scale_nodes = scaled
        row = to_float.args[0] if _cast_to(to_float) == torch.float32 else None
        value, w = _val(row), _val(norm_weight)
        if value is None or w is None or value.dtype != row_value.dtype or value.dim() != rank or \
                not _same_sizes(w.shape, value.shape[-1:]):
            continue
        # the float32 row has readers of its own only where the cast is no cast (a float32 row): the
        # residual stream, read as the row itself
        if value.dtype != torch.float32 and set(_readers(to_float)) != {norm_nodes[0], norm_nodes[-1]}:
            continue
        return _Norm(y, row, to_float, [y, product, *scale_nodes, *norm_nodes, to_float], norm_weight, eps,
                     unit_offset)
    return None


def _input_norm(projection: torch.fx.Node) -> Optional[_InputNorm]:
    """The RMSNorm whose normed row only this projection reads, else None."""
    found = _projection_of(projection)
    if found is None:
        return None
    y, weight = found
    if not _read_only_by(y, projection):
        return None
    norm = _rms_norm_of(y)
    return None if norm is None else _InputNorm(projection, norm, weight)


def _residual_sum(row: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """(a, b) where row is `add(a, b)` of two tensors of its own shape and dtype, else None."""
    if not _call(row, _aten.add.Tensor) or len(row.args) != 2 or row.kwargs:
        return None
    a, b = row.args
    value, va, vb = _val(row), _val(a), _val(b)
    same = all(v is not None and v.dtype == value.dtype and _same_sizes(v.shape, value.shape) for v in (va, vb))
    return (a, b) if same else None


def _erase(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Erase `nodes`, readers first, each with export's dtype checks of it."""
    for node in nodes:
        for check in [u for u in node.users if u.target is _ASSERT]:
            graph.erase_node(check)
        graph.erase_node(node)


def _reroute_float_readers(norm: _Norm, row: torch.fx.Node) -> None:
    """A float32 row's own readers (`_rms_norm_of`) read `row` instead of the norm's cast."""
    for reader in _readers(norm.to_float):
        if reader not in norm.nodes:
            reader.replace_input_with(norm.to_float, row)


def _results(graph: torch.fx.Graph, call: torch.fx.Node, first: torch.fx.Node,
             second: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """getitem nodes of a two-result call, right after it, each with the meta of the node whose place
    it takes (`first`, `second`); the call's value is the pair."""
    with graph.inserting_after(call):
        two = graph.call_function(operator.getitem, (call, 1))
    with graph.inserting_after(call):
        one = graph.call_function(operator.getitem, (call, 0))
    call.meta = {**first.meta, "val": (_val(first), _val(second))}
    one.meta, two.meta = dict(first.meta), dict(second.meta)
    return one, two


def _fold(graph: torch.fx.Graph, found: _InputNorm) -> None:
    """Replace the norm and its projection with one op call: add_rms_norm_linear where the row is a
    residual sum (the op's summed takes the sum's place for its other readers), else rms_norm_linear."""
    norm = found.norm
    args = (norm.norm_weight, found.weight, norm.eps, norm.unit_offset)
    summands = _residual_sum(norm.row)
    if summands is not None:
        with graph.inserting_after(norm.row):  # before any other reader of the sum
            call = graph.call_function(ADD_RMS_NORM_LINEAR, (*summands, *args))
        out, summed = _results(graph, call, found.projection, norm.row)
        row = summed
    else:
        with graph.inserting_before(found.projection):
            out = call = graph.call_function(RMS_NORM_LINEAR, (norm.row, *args))
        call.meta = dict(found.projection.meta)
        row = norm.row
    found.projection.replace_all_uses_with(out)
    _reroute_float_readers(norm, row)
    _erase(graph, [found.projection, *norm.nodes])
    if summands is not None:
        norm.row.replace_all_uses_with(summed)
        _erase(graph, [norm.row])


def _output_norm(y: torch.fx.Node) -> Optional[tuple[_Norm, torch.fx.Node, torch.fx.Node, torch.fx.Node]]:
    """(the norm, the projection, the residual, (x, w)) where y is an RMSNorm's normed row whose input
    is a residual sum with a projection that only the sum reads: `add(residual, linear(x, w))` in
    either order (the projection as `_projection_of` takes it); else None."""
    norm = _rms_norm_of(y)
    if norm is None:
        return None
    summands = _residual_sum(norm.row)
    if summands is None:
        return None
    for projection, residual in (summands, summands[::-1]):
        found = _projection_of(projection) if isinstance(projection, torch.fx.Node) else None
        if found is not None and _read_only_by(projection, norm.row) and projection is not residual:
            return norm, projection, residual, found
    return None


def _fold_output(graph: torch.fx.Graph, norm: _Norm, projection: torch.fx.Node, residual: torch.fx.Node,
                 found: tuple[torch.fx.Node, torch.fx.Node]) -> None:
    """Replace the projection, the residual add and the norm with one call of linear_add_rms_norm:
    its normed row takes the norm's place, its summed the sum's."""
    x, weight = found
    with graph.inserting_before(norm.row):  # the projection's operands and the residual are defined by then
        call = graph.call_function(LINEAR_ADD_RMS_NORM, (x, weight, residual, norm.norm_weight, norm.eps,
                                                         norm.unit_offset))
    out, summed = _results(graph, call, norm.out, norm.row)
    norm.out.replace_all_uses_with(out)
    _reroute_float_readers(norm, summed)
    _erase(graph, norm.nodes)
    norm.row.replace_all_uses_with(summed)
    _erase(graph, [norm.row, projection])


def use_norm_linear(gm: torch.fx.GraphModule) -> int:
    """Step 2: RMSNorms (models/common.py) folded into the GEMVs beside them; how many, of both kinds.

    1. Input norms: each norm whose normed row only a projection reads, and the residual add before
       it, becomes one call of add_rms_norm_linear (rms_norm_linear where the norm's input is not
       such a sum: the embedding's output).
    2. Output norms, among the norms left: each norm whose input is a residual sum with a
       projection that only the sum reads (a layer's output projection, then the post-attention
       norm that feeds the MoE op), with the projection and the add, becomes one call of
       linear_add_rms_norm.

    A projection is a plain one (`_plain_projection`) or a call of small_m_linear (the rewrite runs
    after use_small_m_linear), the norm's weight a graph input. Anything else stays as it was: a
    norm between two other ops (the final norm: the logits' rows are indexed first, and its input
    is the MoE op's output), a projection another node reads too, a norm of another form (Kimi's
    KimiRMSNorm scales after rounding).

    The traced form, node by node: `h = add(a, b)`, `x = to(h, float32)`, `mul(x, rsqrt(add(mean(
    pow(x, 2), [-1], True), eps)))` times `to(w, float32)` (or `add(to(w, float32), 1.0)` with a unit
    offset), `to(.., A)` with A h's dtype, then the projection. In a float32 program `x` is h itself
    (the cast is none), and the residual stream is read from it. Export's dtype checks
    (`_assert_tensor_metadata`) of the norm's nodes are erased with them."""
    count = 0
    for node in list(gm.graph.nodes):
        if node._erased:  # a node of a norm folded before
            continue
        found = _input_norm(node)
        if found is None:
            continue
        _fold(gm.graph, found)
        count += 1
    for node in list(gm.graph.nodes):
        if node._erased:
            continue
        output = _output_norm(node)
        if output is None:
            continue
        _fold_output(gm.graph, *output)
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


# -- a GQA layer's q / k norms with their rotary, as one call -----------------------------------------

_LAST = (-1, 2)  # the channel dimension of a [T, H, D] value, as a slice or cat names it


@dataclasses.dataclass
class _Rotary:
    """A head norm and the NeoX rotation of its rows as the rewrite found them: `out` the rotated
    rows (a cat), `nodes` the rotation's own nodes (`out` first: readers before what they read)."""

    out: torch.fx.Node
    norm: _Norm
    positions: torch.fx.Node
    inv_freq: torch.fx.Node
    rotary_dim: int
    nodes: list[torch.fx.Node]


def _readers_are(node, readers) -> bool:
    return isinstance(node, torch.fx.Node) and set(_readers(node)) == set(readers) and \
        len(_readers(node)) == len(set(readers))


def _channel_slice(node) -> Optional[tuple[torch.fx.Node, int, int]]:
    """(source, start, end) of `slice(source, last dim, start, end)` with a unit step, else None."""
    if not _call(node, _aten.slice.Tensor) or node.kwargs or not 4 <= len(node.args) <= 5 or \
            node.args[1] not in _LAST or (len(node.args) == 5 and node.args[4] != 1):
        return None
    return node.args[0], node.args[2], node.args[3]


def _product(node, a, b) -> bool:
    """Whether node is `mul(a, b)`, read by one node."""
    return _call(node, _aten.mul.Tensor) and list(node.args) == [a, b] and not node.kwargs and \
        len(_readers(node)) == 1


def _angles(c, s) -> Optional[tuple[torch.fx.Node, torch.fx.Node, list[torch.fx.Node]]]:
    """(positions, inv_freq, nodes) where c, s are `unsqueeze(cos(f), 1)`, `unsqueeze(sin(f), 1)` of
    f = `mul(unsqueeze(to(positions, float32), -1), inv_freq)`, read by nothing else; else None."""
    if not (_call(c, _aten.unsqueeze.default) and _call(s, _aten.unsqueeze.default) and c.args[1:] == (1,)
            and s.args[1:] == (1,)):
        return None
    cos, sin = c.args[0], s.args[0]
    if not (_call(cos, _aten.cos.default) and _call(sin, _aten.sin.default) and cos.args[0] is sin.args[0]):
        return None
    f = cos.args[0]
    if not (_call(f, _aten.mul.Tensor) and len(f.args) == 2 and _readers_are(f, [cos, sin])
            and _read_only_by(cos, c) and _read_only_by(sin, s)):
        return None
    column, inv_freq = f.args
    if not (_call(column, _aten.unsqueeze.default) and column.args[1:] == (-1,) and _read_only_by(column, f)):
        return None
    as_float = column.args[0]
    if _cast_to(as_float) != torch.float32 or not _read_only_by(as_float, column):
        return None
    inv = _val(inv_freq)
    if inv is None or inv.dim() != 1 or inv.dtype != torch.float32:
        return None
    return as_float.args[0], inv_freq, [c, s, cos, sin, f, column, as_float]


def _neox_rotary_of(cat: torch.fx.Node) -> Optional[_Rotary]:
    """The rotation `apply_rotary` (models/common.py, interleaved=False) writes as cat is, of a head
    norm's rows, else None:

        rot = to(slice(n, -1, 0, R), float32); x1, x2 = slice(rot, -1, 0, R/2), slice(rot, -1, R/2, end)
        cat([to(sub(mul(x1, c), mul(x2, s)), A), to(add(mul(x2, c), mul(x1, s)), A), slice(n, -1, R, end)], -1)

    with c, s as `_angles` says and n a head norm's normed rows [T, H, D] (`_rms_norm_of`, rank 3),
    every node read only inside it."""
    if not _call(cat, _aten.cat.default) or len(cat.args) != 2 or cat.args[1] not in _LAST or cat.kwargs:
        return None
    parts = cat.args[0]
    value = _val(cat)
    if not isinstance(parts, (list, tuple)) or len(parts) != 3 or value is None or value.dim() != 3:
        return None
    first, second, rest = parts
    dtype = value.dtype
    if _cast_to(first) != dtype or _cast_to(second) != dtype or not (_read_only_by(first, cat)
                                                                      and _read_only_by(second, cat)):
        return None
    minus, plus = first.args[0], second.args[0]
    if not (_call(minus, _aten.sub.Tensor) and _call(plus, _aten.add.Tensor) and len(minus.args) == 2
            and len(plus.args) == 2 and not minus.kwargs and not plus.kwargs
            and _read_only_by(minus, first) and _read_only_by(plus, second)):
        return None
    (m1, m2), (m3, m4) = minus.args, plus.args
    if not all(_call(m, _aten.mul.Tensor) for m in (m1, m2, m3, m4)):
        return None
    x1, c = m1.args
    x2, s = m2.args
    if not (_product(m1, x1, c) and _product(m2, x2, s) and _product(m3, x2, c) and _product(m4, x1, s)):
        return None
    low, high = _channel_slice(x1), _channel_slice(x2)
    if low is None or high is None or low[0] is not high[0]:
        return None
    rot, half = low[0], low[2]
    if low[1] != 0 or high[1] != half or not (_readers_are(x1, [m1, m4]) and _readers_are(x2, [m2, m3])
                                              and _readers_are(rot, [x1, x2])):
        return None
    if _cast_to(rot) != torch.float32:
        return None
    head = _channel_slice(rot.args[0])
    tail = _channel_slice(rest)
    if head is None or tail is None or head[0] is not tail[0] or head[1] != 0 or head[2] != 2 * half or \
            tail[1] != 2 * half or not _read_only_by(rot.args[0], rot) or not _read_only_by(rest, cat):
        return None
    normed = head[0]
    if not _readers_are(normed, [rot.args[0], rest]):
        return None
    angles = _angles(c, s)
    norm = _rms_norm_of(normed, rank=3)
    if angles is None or norm is None or _val(angles[1]).shape[0] != half:
        return None
    if not (_readers_are(c, [m1, m3]) and _readers_are(s, [m2, m4])):
        return None
    positions, inv_freq, angle_nodes = angles
    nodes = [cat, first, second, minus, plus, m1, m2, m3, m4, x1, x2, rot, rot.args[0], rest, *angle_nodes]
    return _Rotary(cat, norm, positions, inv_freq, 2 * half, nodes)


def _same_computation(a, b) -> bool:
    """Whether two nodes compute the same value from the same inputs: the same op on the same
    constants and the same (or equally computed) nodes, as two calls of rope_inv_freq do."""
    if a is b:
        return True
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or a.op != "call_function" or \
            b.op != "call_function" or a.target is not b.target or len(a.args) != len(b.args) or a.kwargs != b.kwargs:
        return False
    return all(_same_computation(x, y) if isinstance(x, torch.fx.Node) else x == y for x, y in zip(a.args, b.args))


def _pairs_with(q: _Rotary, k: _Rotary, order: dict) -> bool:
    """Whether q's and k's rotaries fold into one call: the same positions, rotation and norm form,
    rows of one head size and dtype, and every reader of q's rows after k's (the call takes k's place)."""
    qv, kv = _val(q.norm.row), _val(k.norm.row)
    return (q.positions is k.positions and q.rotary_dim == k.rotary_dim and q.norm.eps == k.norm.eps
            and q.norm.unit_offset == k.norm.unit_offset and qv.dtype == kv.dtype
            and _same_sizes(qv.shape[2:], kv.shape[2:]) and _same_computation(q.inv_freq, k.inv_freq)
            and all(order[r] > order[k.out] for r in q.out.users))


def _erase_unread(graph: torch.fx.Graph, node) -> None:
    """Erase node (and, in turn, what it read) where nothing but export's dtype checks reads it."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or _readers(node):
        return
    inputs = list(node.all_input_nodes)
    _erase(graph, [node])
    for a in inputs:
        _erase_unread(graph, a)


def _fold_norm_rope(graph: torch.fx.Graph, q: _Rotary, k: _Rotary) -> None:
    """Replace both rotaries and their norms with one call of qk_norm_rope, placed where k's
    rotated rows were made; k's inv_freq, no longer read, goes with them."""
    with graph.inserting_before(k.out):
        call = graph.call_function(QK_NORM_ROPE, (q.norm.row, k.norm.row, q.norm.norm_weight, k.norm.norm_weight,
                                                  q.positions, q.inv_freq, q.norm.eps, q.norm.unit_offset))
    q_out, k_out = _results(graph, call, q.out, k.out)
    q.out.replace_all_uses_with(q_out)
    k.out.replace_all_uses_with(k_out)
    spare = k.inv_freq
    for found in (q, k):
        _reroute_float_readers(found.norm, found.norm.row)
        _erase(graph, [*found.nodes, *found.norm.nodes])
    _erase_unread(graph, spare)


def use_norm_rope(gm: torch.fx.GraphModule) -> int:
    """A GQA layer's q and k head norms with their rotary become one call of qk_norm_rope; how many
    calls (`hgc build --norm-rope`).

    It finds each NeoX rotation of a head norm's rows (`_neox_rotary_of`: RMSNorm with its weight a
    graph input, then `apply_rotary(..., interleaved=False)`, every node read only inside it) and
    folds each one with the next one found (`_pairs_with`: the layer's q, then its k). Anything else
    stays as it was: a lone norm and rotary, the GPT-J rotation, a rotation of rows no norm made, a
    norm's rows that something else reads too. Export's dtype checks of the folded nodes go with
    them."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    found = [r for r in (_neox_rotary_of(n) for n in gm.graph.nodes) if r is not None]
    count, i = 0, 0
    while i + 1 < len(found):
        if _pairs_with(found[i], found[i + 1], order):
            _fold_norm_rope(gm.graph, found[i], found[i + 1])
            count, i = count + 1, i + 2
        else:
            i += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count


# -- the sigmoid gate rewrite ---------------------------------------------------------------------------


# Ops that only reshape what they read: a gated output seen through them is still the segment's input.
_RESHAPES = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.unflatten.int,
             _aten.flatten.using_ints)


def _segment_input(x: torch.fx.Node) -> bool:
    """Whether x is an input of the segment (an op core's output), seen through reshapes only.

    Not where the segment computes x itself: Kimi's KDA and Ling's Lightning layers gate the output
    of their own norm, and Inductor fuses that norm, the sigmoid and the product into one kernel,
    which a call of the op would split in two. In bailing_linear's step accounts on an H100
    (step_account_mla_triton_decode_h100_2026-12-06.md) the split cost 9.8 us of a batch-1 step and
    14.6 at 128 requests, and at 4096 tokens took 232.7 us where the fused kernels took 226.7; in
    kimi_linear's the glue took 18 us more of a batch-1 step and 282 more of a 4096-token one."""
    while x.op == "call_function" and x.target in _RESHAPES:
        x = x.args[0]
    return x.op == "placeholder"


def _sigmoid_gate_of(mul: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]:
    """(x, gate, the sigmoid node) of `mul(x, sigmoid(gate))` (either order), else None: the sigmoid
    read by the product alone, x an input of the segment (`_segment_input`), x and gate of one float
    dtype and one shape (no broadcast), 2-D or 3-D, each with a contiguous last dimension (what the
    kernel reads)."""
    if not _call(mul, _aten.mul.Tensor) or len(mul.args) != 2 or mul.kwargs:
        return None
    out = _val(mul)
    for x, sig in (mul.args, reversed(mul.args)):
        if not (_call(sig, _aten.sigmoid.default) and _read_only_by(sig, mul) and isinstance(x, torch.fx.Node)
                and _segment_input(x)):
            continue
        gate = sig.args[0]
        xv, gv = _val(x), _val(gate)
        if xv is None or gv is None or out is None:
            continue
        if (xv.dim() in (2, 3) and xv.dtype == gv.dtype == out.dtype and xv.dtype in _FLOATS
                and _same_sizes(xv.shape, gv.shape) and _same_sizes(out.shape, xv.shape)
                and xv.stride(-1) == 1 and gv.stride(-1) == 1):
            return x, gate, sig
    return None


def use_sigmoid_gate(gm: torch.fx.GraphModule) -> int:
    """Each `mul(x, sigmoid(gate))` of `gm` (`_sigmoid_gate_of`) becomes one call of sigmoid_gate in
    the product's place; how many (`hgc build --sigmoid-gate`). A sigmoid something else reads, a
    gate of rows the segment computes, a broadcast product, mixed dtypes or a strided last dimension
    stay as they were."""
    count = 0
    for node in list(gm.graph.nodes):
        found = _sigmoid_gate_of(node)
        if found is None:
            continue
        x, gate, sig = found
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(SIGMOID_GATE, (x, gate))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        _erase(gm.graph, [node, sig])
        count += 1
    if count:
        gm.graph.lint()
        gm.recompile()
    return count
