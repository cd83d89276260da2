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

What it does not do: decide which device runs the GEMV (the kernel registration does), or touch an
op core's arguments.
"""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["NAMESPACE", "SMALL_M_LINEAR", "use_small_m_linear"]

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
