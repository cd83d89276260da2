"""The hgc op vocabulary: one `torch.library` custom op per attention-like core, plus the MoE block.

Contract shared by every op (the "with output" style):

1. Tensors in, a preallocated `out` mutated in place, nothing returned. The layer id is an int
   argument: the runtime finds the layer's cache or state by it; the op never receives a cache.
2. Only the recurrent or attention core is inside an attention op. Projections, norms, rotary
   embeddings, gates and the l2 normalisation of q/k stay in the graph pieces around it. A fused
   op (`FUSED_OPS`) is the exception: no model calls it; the fusion pass (compiler/passes/fusion.py)
   puts it in place of the region of ops and glue it stands for.
3. Token-major, flattened layouts: T is the number of tokens in the step, across all requests.
   Which token belongs to which request, where its cache lives and what mode the step is in
   come from the runtime's per-step ExecContext, never from the op's arguments.
4. Each op declares its capture policy per mode here (`OP_SPECS`). That declaration is the only
   place it is said; the split pass, the lints and the runtime all read it.

The fake implementations do nothing: every op returns None and only mutates `out`, which
already has its shape, so torch.export sees a single in-place node per op.

The real implementations live in `runtime/backends/`. The runtime binds each op node of a graph
(or each call of an eager model, through `OpTable`) to a backend method with the same
arguments; `torch.ops.hgc.*` itself is only ever traced, never executed.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .policy import Capture, Mode
from .registry import LayerKind

__all__ = ["OpSpec", "OP_SPECS", "OPS_BY_KIND", "COLLECTIVE_OPS", "FUSED_OPS", "UNFUSED", "op_spec", "is_hgc_op", "op_name_of", "op_schemas",
           "moe_shared_width",
           "op_arguments", "call_arguments", "CallFacts", "call_facts", "is_op_node", "op_nodes"]

_LIB = torch.library.Library("hgc", "FRAGMENT")  # noqa: the namespace our ops live in

_C = Capture.CAPTURABLE


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """The declaration of one op: its name, what it mutates and its capture policy per mode."""

    name: str  # "gdn_core": the op is torch.ops.hgc.gdn_core
    kinds: frozenset[LayerKind]  # the layer kinds whose layers use this op ("mlp" ops: empty)
    stateful: bool  # reads and writes a KV cache or a state slot of its layer
    policy: dict[Mode, Capture]
    doc: str
    token_args: tuple[str, ...]  # the inputs with one row per token of the step (besides `out`)
    collective: bool = False  # talks to the other ranks of a tensor-parallel group (several per layer)

    def capture(self, mode: Mode) -> Capture:
        return self.policy[Mode(mode)]


# Stateless device work with static shapes (no host sync, no data-dependent shapes).
_ALWAYS_CAPTURABLE = {m: _C for m in Mode}
# Recurrent cores whose extend work is a fixed set of launches over a per-step table (chunks,
# cu_seqlens, slots) that can be padded to the bucket and read from static device buffers: capture
# in every mode is allowed. Whether an extend step is captured is the routed backend's word (its
# capability's `capturable` / `capture_tokens`): our chunk kernels can, FLA's (a Python entry that
# plans on the host) cannot, our short-extend kernel can in buckets of short requests (KDA's too).
_TABLE_DRIVEN_POLICY = _ALWAYS_CAPTURABLE
# GQA attention: a kernel that addresses the paged cache from the step's page table, lengths and
# query offsets (runtime/backends/kernels/gqa.py, varlen) runs an extend or mixed step as one fixed
# grid per bucket, its per-step values read from static device buffers, so capture in every mode
# is allowed and the routed backend decides: FlashInfer's prefill (planned on the host) cannot be
# captured there, the Triton kernel can (its capability's `op_capture`, extend_impl=triton), the
# CPU reference declares it eager there (the CPU plans stay as they were). MLA attention the same:
# the Triton MLA kernel reads a step's page table, lengths and query offsets too (kernels/mla.py),
# FlashInfer's MLA plans on the host.
_GQA_POLICY = _ALWAYS_CAPTURABLE
_MLA_POLICY = _ALWAYS_CAPTURABLE

OP_SPECS: dict[str, OpSpec] = {}


def _declare(name: str, schema: str, kinds: set[LayerKind], stateful: bool, policy: dict, doc: str,
             token_args: tuple[str, ...], collective: bool = False) -> None:
    assert set(policy) == set(Mode), f"{name}: a capture policy must cover every mode"
    _LIB.define(f"{name}{schema}")
    # Every op mutates `out` only and returns nothing: the fake has nothing to compute.
    _LIB._register_fake(name, lambda *args, **kwargs: None)
    OP_SPECS[name] = OpSpec(name, frozenset(kinds), stateful, dict(policy), doc, tuple(token_args), collective)


_declare(
    "gqa_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, int layer_id, float scale) -> ()",
    {LayerKind.FULL_GQA}, True, _GQA_POLICY,
    "Causal softmax attention over the layer's paged K/V. q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,Dv], "
    "out [T,Hq,Dv]. Writes this step's k/v into the cache first.",
    token_args=("q", "k", "v"),
)
_declare(
    "mla_attention",
    "(Tensor q_latent, Tensor q_rope, Tensor kv_latent, Tensor k_rope, Tensor(a!) out, int layer_id,"
    " float scale) -> ()",
    {LayerKind.FULL_MLA}, True, _MLA_POLICY,
    "Absorbed MLA: q_latent [T,H,R] (q_nope through W_UK), q_rope [T,H,P], kv_latent [T,R] (normed "
    "c_kv), k_rope [T,P]; the cache keeps [kv_latent | k_rope] per token. score = q_latent.c + "
    "q_rope.k_rope, out [T,H,R] = softmax(scale*score) @ c.",
    token_args=("q_latent", "q_rope", "kv_latent", "k_rope"),
)
_declare(
    "gdn_core",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) out, int layer_id, float scale) -> ()",
    {LayerKind.GDN}, True, _TABLE_DRIVEN_POLICY,
    "Gated delta rule. q,k [T,Hk,Dk] (already l2-normalised), v [T,Hv,Dv], g [T,Hv] log-decay, "
    "beta [T,Hv]; value head h reads key head h // (Hv/Hk). Per token: S = exp(g) S; "
    "S += k (beta (v - S^T k))^T; out = scale q^T S. State S [Hv,Dk,Dv] float32.",
    token_args=("q", "k", "v", "g", "beta"),
)
_declare(
    "kda_core",
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) out, int layer_id, float scale) -> ()",
    {LayerKind.KDA}, True, _TABLE_DRIVEN_POLICY,
    "Kimi delta attention: the gated delta rule with a per-channel decay. q,k [T,H,Dk] "
    "(already l2-normalised), v [T,H,Dv], g [T,H,Dk] log-decay, beta [T,H]. State [H,Dk,Dv] float32.",
    token_args=("q", "k", "v", "g", "beta"),
)
_declare(
    "lightning_core",
    "(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor(a!) out, int layer_id, float scale) -> ()",
    {LayerKind.LIGHTNING}, True, _TABLE_DRIVEN_POLICY,
    "Simple GLA with a constant per-head decay (lightning attention). q,k [T,H,Dk], v [T,H,Dv], "
    "decay [H] log-decay (<= 0). Per token: S = exp(decay) S + k v^T; out = scale q^T S.",
    token_args=("q", "k", "v"),
)
_declare(
    "short_conv",
    "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) out, int layer_id, bool silu) -> ()",
    {LayerKind.GDN, LayerKind.KDA}, True, _TABLE_DRIVEN_POLICY,
    "Causal depthwise convolution whose last K-1 inputs per request live in the layer's 'conv' "
    "state. x, out [T,C], weight [C,K], bias [C] or None; silu applied after when asked.",
    token_args=("x",),
)
_declare(
    "gdn_fused",
    "(Tensor qkv, Tensor z, Tensor b, Tensor a, Tensor conv_weight, Tensor A_log, Tensor dt_bias,"
    " Tensor norm_weight, Tensor(a!) out, int layer_id, int k_heads, float scale, float eps) -> ()",
    {LayerKind.GDN}, True, _TABLE_DRIVEN_POLICY,
    "A whole GDN mixer between its projections: short_conv(qkv) with silu, q|k|v split, l2norm of "
    "q and k per key head, beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), the gated "
    "delta rule (gdn_core), then the gated RMSNorm RMSNorm(core) * norm_weight * silu(z) per value "
    "head. qkv [T, 2*Hk*Dk + Hv*Dv] (q|k|v channels, the conv's input), z [T,Hv,Dv], b and a [T,Hv] "
    "(any row stride: slices of one projection), conv_weight [C,K], A_log and dt_bias [Hv], "
    "norm_weight [Dv], out [T,Hv,Dv]. Reads and writes the layer's 'conv' and 'recurrent' states.",
    token_args=("qkv", "z", "b", "a"),
)
_declare(
    "moe",
    "(Tensor x, Tensor router_weight, Tensor? router_bias, Tensor w13, Tensor w2, Tensor? shared_w13,"
    " Tensor? shared_w2, Tensor? shared_gate, Tensor(a!) out, int layer_id, int top_k, str scoring,"
    " bool renormalize, float routed_scale, int num_groups, int topk_groups) -> ()",
    set(), False, _ALWAYS_CAPTURABLE,
    "The MoE block: router top-k, routed expert SwiGLU MLPs and the shared expert. x [T,D], "
    "router_weight [E,D], router_bias [E] (added to the scores for selection only) or None, w13 "
    "[E,2I,D] (gate rows then up rows), w2 [E,D,I], out [T,D]. scoring 'softmax' or 'sigmoid'; with "
    "num_groups > 1 only the topk_groups best groups (by the sum of their two best biased scores) "
    "compete. Routed weights are the unbiased scores of the chosen experts, renormalised if asked, "
    "times routed_scale. Shared expert (every token, never routed): shared_w13 [2S,D] (gate rows then "
    "up rows) and shared_w2 [D,S], both None for a block without one; shared_gate [1,D] or None. "
    "out = routed + g * SwiGLU_shared(x) with g = sigmoid(x @ shared_gate^T), or 1 without a gate.",
    token_args=("x",),
)


# Collectives of a tensor-parallel program (compiler/passes/sharding.py places them; never a model).
# Capturable in every mode: an NCCL all-reduce of static shape records into a CUDA graph like any
# kernel (all ranks replay the same graphs in the same order); the layer id is the layer whose
# partial results they combine (the lm_head gather: the program's last layer).
_declare(
    "all_reduce",
    "(Tensor(a!) out, int layer_id) -> ()",
    set(), False, _ALWAYS_CAPTURABLE,
    "Sum over the ranks of a tensor-parallel group, in place: out [T,D] holds this rank's partial "
    "result (a row-parallel projection, a MoE block over its slice of every expert) and becomes the total.",
    token_args=(), collective=True,  # its one per-token tensor is `out`, read and written in place
)
_declare(
    "all_gather",
    "(Tensor x, Tensor(a!) out, int layer_id) -> ()",
    set(), False, _ALWAYS_CAPTURABLE,
    "Concatenate every rank's x [R,C] along the last dimension in rank order: out [R, tp*C] (the "
    "logits of a vocabulary-parallel lm_head).",
    token_args=("x",), collective=True,
)


def moe_shared_width(shared_w13, shared_w2, shared_gate, hidden: int) -> int:
    """Width S of the moe op's shared expert (0: none), after checking its three tensors agree.

    The one statement of the shared-expert shapes: backends call it before computing anything.
    """
    if shared_w13 is None or shared_w2 is None:
        given = [n for n, t in (("shared_w13", shared_w13), ("shared_w2", shared_w2), ("shared_gate", shared_gate))
                 if t is not None]
        if given:
            raise ValueError(f"moe: a shared expert needs both shared_w13 and shared_w2 (got only {given})")
        return 0
    if shared_w13.dim() != 2 or shared_w13.shape[0] % 2 or shared_w13.shape[1] != hidden:
        raise ValueError(f"moe: shared_w13 {list(shared_w13.shape)} is not [2S, D={hidden}]")
    S = shared_w13.shape[0] // 2
    if tuple(shared_w2.shape) != (hidden, S):
        raise ValueError(f"moe: shared_w2 {list(shared_w2.shape)} is not [D={hidden}, S={S}] (S from shared_w13)")
    if shared_gate is not None and tuple(shared_gate.shape) != (1, hidden):
        raise ValueError(f"moe: shared_gate {list(shared_gate.shape)} is not [1, D={hidden}]")
    return S


# Ops that stand for a region of other ops (compiler/passes/fusion.py puts them in a program): the
# ops each replaces. `UNFUSED` is the backend name a --route gives one of them to keep its region
# as it was (`--route gdn_fused=unfused`); an eager model, which always calls the region's ops,
# runs them on the backend routing bound the fused node to (runtime/step/bound_ops.py).
FUSED_OPS: dict[str, tuple[str, ...]] = {"gdn_fused": ("short_conv", "gdn_core")}
UNFUSED = "unfused"
assert set(FUSED_OPS) <= set(OP_SPECS) and all(set(ops) <= set(OP_SPECS) for ops in FUSED_OPS.values())

_ARGUMENTS: dict[str, tuple[str, ...]] = {
    name: tuple(a.name for a in getattr(torch.ops.hgc, name).default._schema.arguments) for name in OP_SPECS
}

COLLECTIVE_OPS: frozenset[str] = frozenset(name for name, spec in OP_SPECS.items() if spec.collective)

OPS_BY_KIND: dict[LayerKind, tuple[str, ...]] = {
    kind: tuple(name for name, spec in OP_SPECS.items() if kind in spec.kinds) for kind in LayerKind
}


def op_schemas() -> dict[str, str]:
    """Each hgc op's registered schema: an artifact records them, and a runtime whose ops differ
    refuses it (a .pt2 program calls its ops positionally, in the schema it was traced with)."""
    return {name: str(getattr(torch.ops.hgc, name).default._schema) for name in OP_SPECS}


def op_arguments(name: str) -> tuple[str, ...]:
    """The schema argument names of op `name`, in call order: what each positional argument is.

    The one place that reads an op's schema arguments; the annotate pass, the loader's binding,
    the runtime's per-call bookkeeping and the lints all ask here."""
    return _ARGUMENTS[name]


def call_arguments(node) -> dict[str, object]:
    """Every schema argument of an hgc op node (an fx.Node), by name: positional, keyword or the default.

    Values are what the graph holds: fx.Nodes for tensors, constants for the rest. A missing
    argument without a default is a KeyError naming it."""
    name = op_name_of(node.target)
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            raise KeyError(f"graph node {node.name}: hgc.{name} lacks argument {arg.name!r}")
    return out


@dataclasses.dataclass(frozen=True)
class CallFacts:
    """What routing and binding read off one op node: its layer id, dtype and argument shapes."""

    op: str
    layer_id: object  # an int when the node's layer_id is a constant (lints refuse anything else)
    dtype: Optional[str]  # the dtype of `out`: the activation dtype the op computes in
    shapes: dict[str, tuple]  # tensor argument -> sizes (None for a dynamic size, e.g. the token count)
    scalars: dict[str, object]  # every non-tensor argument (layer_id, scale, top_k, ...)


def _meta_val(value):
    meta = getattr(value, "meta", None)
    return meta.get("val") if isinstance(meta, dict) else None


def call_facts(node) -> CallFacts:
    """The CallFacts of an hgc op node, from its arguments' `meta["val"]` (export records them, and
    torch.export.load restores them: the compiler and the runtime read the same facts)."""
    args = call_arguments(node)
    shapes, scalars = {}, {}
    for name, value in args.items():
        val = _meta_val(value)
        if isinstance(val, torch.Tensor):
            shapes[name] = tuple(s if isinstance(s, int) else None for s in val.shape)
        elif not hasattr(value, "meta"):
            scalars[name] = value
    out = _meta_val(args.get("out"))
    dtype = str(out.dtype).removeprefix("torch.") if isinstance(out, torch.Tensor) else None
    return CallFacts(op_name_of(node.target), args.get("layer_id"), dtype, shapes, scalars)


def op_spec(name: str) -> OpSpec:
    try:
        return OP_SPECS[name]
    except KeyError:
        raise KeyError(f"hgc has no op {name!r} (ops: {sorted(OP_SPECS)})") from None


def op_name_of(target) -> Optional[str]:
    """`torch.ops.hgc.gdn_core.default` (or the packet) -> "gdn_core"; anything else -> None."""
    name = getattr(target, "name", None)
    qualified = name() if callable(name) else None  # OpOverload.name() -> "hgc::gdn_core"
    if qualified is None:
        qualified = getattr(target, "_qualified_op_name", None)  # OpOverloadPacket
    if isinstance(qualified, str) and qualified.startswith("hgc::"):
        return qualified.split("::", 1)[1].split(".", 1)[0]
    return None


def is_hgc_op(target) -> bool:
    return op_name_of(target) is not None


def is_op_node(node) -> bool:
    """An fx node calling an hgc op."""
    return node.op == "call_function" and op_name_of(node.target) is not None


def op_nodes(gm) -> list:
    """The hgc op nodes of a graph module, in graph order."""
    return [n for n in gm.graph.nodes if is_op_node(n)]
