"""build_gpu_backend: the CUDA backend of a loaded artifact, with every per-layer fact read from the artifact.

    art = load_artifact(path, "cuda")
    kv_pool, state_pool = make_pools(art.registry, 512, 32, device="cuda", kv_dtype=torch.bfloat16)
    backend = build_gpu_backend(art, kv_pool, state_pool)      # HybridBackend(full, linear, moe)
    ops = BoundOps(backend)

FlashInfer fixes each layer's softmax scale and query head count at plan time, before any op
runs, so the full-attention child must be told them up front. Those facts already sit in the
compiled graph: every `hgc.gqa_attention` / `hgc.mla_attention` node carries its layer id and
its `scale` as constant arguments, and its query input's shape (rows, heads, dim) and dtype in
`node.meta["val"]`. Reading them from there, rather than from the model config, keeps one source
of truth (the graph the runtime will execute) and keeps the runtime free of models/ and of the
compiler's passes. Every program of the artifact (main and, when present, the draft layer) is
read, since the KV pool holds the draft's full layer too.

The result is always `HybridBackend(FlashInferAttentionBackend, TritonLinearBackend,
TritonMoEBackend)`: together they declare every hgc op exactly once, which HybridBackend checks.

It does not size pools (runtime/generate.py, the memory planner) or capture graphs itself (GraphRunner).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from compiler.splitops import op_name_of
from runtime.backends.hybrid import HybridBackend

__all__ = ["FullLayerFacts", "full_layer_facts", "build_gpu_backend"]

# The argument of each full-attention op that holds its queries: its shape gives the head count.
_QUERY_ARG = {"gqa_attention": "q", "mla_attention": "q_latent"}


@dataclasses.dataclass(frozen=True)
class FullLayerFacts:
    layer_id: int
    op: str  # "gqa_attention" or "mla_attention"
    q_heads: int
    scale: float
    q_dtype: torch.dtype
    rope_dim: Optional[int]  # MLA only: the k_rope width


def _schema_args(op: str) -> list[str]:
    return [a.name for a in getattr(torch.ops.hgc, op).default._schema.arguments]


def _arg(node, names: list[str], name: str) -> Any:
    i = names.index(name)
    return node.args[i] if i < len(node.args) else node.kwargs[name]


def full_layer_facts(artifact) -> dict[int, FullLayerFacts]:
    """Per full layer id: query heads, softmax scale, query dtype (and MLA rope width), from the graphs.

    A layer met twice (two programs, or two calls) must agree with itself; anything else is an
    artifact this runtime cannot plan for, and the error names the layer.
    """
    facts: dict[int, FullLayerFacts] = {}
    for program_name, ep in artifact.programs.items():
        for node in ep.graph.nodes:
            if node.op != "call_function":
                continue
            op = op_name_of(node.target)
            if op not in _QUERY_ARG:
                continue
            names = _schema_args(op)
            layer_id, scale = int(_arg(node, names, "layer_id")), float(_arg(node, names, "scale"))
            q = _arg(node, names, _QUERY_ARG[op])
            val = getattr(q, "meta", {}).get("val")
            if val is None or val.dim() != 3:
                raise ValueError(f"{program_name} program, layer {layer_id} ({op}): its query input carries no "
                                 f"[rows, heads, dim] shape in meta['val']; recompile the artifact")
            rope = None
            if op == "mla_attention":
                k_rope = _arg(node, names, "k_rope").meta["val"]
                rope = int(k_rope.shape[-1])
            fact = FullLayerFacts(layer_id, op, int(val.shape[1]), scale, val.dtype, rope)
            seen = facts.setdefault(layer_id, fact)
            if seen != fact:
                raise ValueError(f"layer {layer_id}: the graphs disagree about it ({seen} vs {fact})")
    return facts


# FlashInfer 0.6.0's prefill kernels static_assert a head dim of 64, 128 or 256 (seen on an H200:
# the sm90 ragged and paged prefill failed to JIT-build for head dim 32, and its fa2 tensor-core
# decode refused the same dim at run time with "Invalid configuration"). Refusing here turns a page
# of nvcc output at the first prefill into one line at start-up.
FLASHINFER_GQA_HEAD_DIMS = (64, 128, 256)


def _check_head_dims(kv_pool) -> None:
    bad = {i: (e["k"].shape[-1], e["v"].shape[-1]) for i, e in kv_pool.buffers.items()
           if "k" in e and not {e["k"].shape[-1], e["v"].shape[-1]} <= set(FLASHINFER_GQA_HEAD_DIMS)}
    if bad:
        raise ValueError(f"full layers {sorted(bad)} have (k, v) head dims {sorted(set(bad.values()))}; FlashInfer's "
                         f"prefill kernels take {FLASHINFER_GQA_HEAD_DIMS} only: serve this checkpoint on the CPU "
                         f"backend, or use a checkpoint whose head_dim FlashInfer supports")


def build_gpu_backend(artifact, kv_pool, state_pool, *, moe_config_dir=None, **flashinfer_options) -> HybridBackend:
    """HybridBackend(FlashInfer full attention, Triton linear attention, Triton MoE) for this artifact.

    q heads, scales and the query dtype of every full layer come from the artifact's graphs
    (`full_layer_facts`); `flashinfer_options` go to FlashInferAttentionBackend unchanged
    (decode_backend, extend_impl, ...). Each full layer of the KV pool must appear in a graph, and
    GQA head dims must be ones FlashInfer builds (FLASHINFER_GQA_HEAD_DIMS).
    """
    # Imported here: flashinfer and triton are GPU-machine dependencies, and importing this
    # module (for its docstring, or on a CPU machine) must not need them.
    from runtime.backends.flashinfer_attention import FlashInferAttentionBackend
    from runtime.backends.triton_linear_backend import TritonLinearBackend
    from runtime.backends.triton_moe import TritonMoEBackend

    facts = full_layer_facts(artifact)
    missing = sorted(set(kv_pool.buffers) - set(facts))
    if missing:
        raise ValueError(f"full layers {missing} hold KV pages but no graph of the artifact calls attention on them")
    pooled = {i: f for i, f in facts.items() if i in kv_pool.buffers}
    rope_dims = {f.rope_dim for f in pooled.values() if f.rope_dim is not None}
    if len(rope_dims) > 1:
        raise ValueError(f"MLA layers with different rope widths {sorted(rope_dims)}: one FlashInfer backend "
                         f"plans one width")
    q_dtypes = {f.q_dtype for f in pooled.values()}
    if len(q_dtypes) > 1:
        raise ValueError(f"full layers with different query dtypes {sorted(map(str, q_dtypes))}")
    options = dict(flashinfer_options)
    if rope_dims:
        options.setdefault("mla_rope_dim", rope_dims.pop())
    if q_dtypes:
        options.setdefault("q_dtype", q_dtypes.pop())
    _check_head_dims(kv_pool)
    full = FlashInferAttentionBackend(kv_pool, {i: f.q_heads for i, f in pooled.items()},
                                      {i: f.scale for i, f in pooled.items()}, **options)
    linear = TritonLinearBackend(state_pool)
    moe = TritonMoEBackend(moe_config_dir, device=state_pool.device)
    return HybridBackend(full, linear, moe)
