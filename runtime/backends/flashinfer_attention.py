"""FlashInfer full-attention backend: GQA and MLA layers over the paged KV pool, on a CUDA GPU.

What it owns: the FlashInfer wrappers (and their plans) for every full-attention layer of one
model, the step's paged metadata, the write of each step's K/V rows into the pool, and the choice
of the plan-free Triton kernels for decode and target_verify steps (`decode_impl="triton"`, and
`mla_decode_impl="triton"` for MLA layers).

Lifecycle (the hooks of runtime/backends/protocol.py):

1. `FlashInferAttentionBackend(kv_pool, q_heads, scales=...)` groups the pool's full layers by
   head configuration (GQA: query heads, kv heads, head dims, scale; MLA: heads, latent rank,
   rope dim, scale). Layers of one group share one plan per step. flashinfer is imported here;
   without it the constructor raises and says to install the gpu extra.
2. `init_step_metadata(ctx)` (eager steps) builds the paged metadata from the context once
   (`build_paged_metadata`: qo/kv indptr, kv lengths and last-page lengths on the host, page
   indices gathered on the device) and calls plan() once per group: a decode wrapper in decode
   mode, a causal paged prefill wrapper otherwise (extend, mixed, target_verify: each request's
   new rows over its whole paged cache; with `extend_impl="ragged"`, a step where every request
   starts from an empty cache uses the ragged prefill wrapper over this step's k/v instead).
   MLA groups plan `BatchMLAPagedAttentionWrapper`, or nothing extra for the Triton MLA kernel
   (`mla_impl="triton"`: the `triton_mla` backend, runtime/backends/triton_mla.py, which
   routing picks by its own declaration). `init_chunk_metadata` has nothing to add: FlashInfer's
   prefill plan covers a whole extend.
   Table steps plan nothing: a decode step, or a target_verify step whose requests all carry the
   same n rows, runs GQA groups with `decode_impl="triton"` (runtime/backends/kernels/gqa.py) and
   MLA groups with `mla_decode_impl="triton"` (both routing's defaults) or `mla_impl="triton"` (the Triton
   MLA kernel's page-table mode, runtime/backends/kernels/mla.py) straight from the step's
   `page_table` and `seq_lens`: no paged metadata is built and no wrapper is planned for them
   (paged metadata is built only when some other group of the step needs it). Extend and mixed
   steps keep FlashInfer's prefill wrappers (and the Triton MLA kernel its row arrays), except
   with `extend_impl="triton"`, or in a step of at most `whole_extend_tokens` rows (the routing
   default 512): GQA groups then run the same Triton kernel for requests of
   different lengths (`triton_gqa_attention_varlen`), from the page table, `seq_lens` and
   `query_start_loc`, so an extend or mixed step plans nothing on the host either (an eager
   target_verify step of unequal rows takes it too). MLA groups take the Triton MLA kernel's form
   for such steps (`triton_mla_attention_varlen`, from the same three) in the steps of up to
   `whole_extend_tokens` rows, whatever mla_impl says; `extend_impl="triton"` (every size) is a
   GQA-only choice: the constructor refuses it for MLA layers, whose long extends the MLA decode
   kernel would serve slowly. With decode_impl="triton" as well no GQA
   step reaches FlashInfer's kernels, so GQA layers may then be float32 (`option_dtypes`).
3. `gqa_attention(ctx, ...)` / `mla_attention(ctx, ...)` store this step's rows into the
   layer's pages (a Triton kernel that skips rows whose slot is -1, so it is safe inside a
   graph where the number of real rows changes between replays), run the planned wrapper on
   the layer's caches (or the Triton kernel of a table step) and zero the padded output rows.
   They never plan: an op whose step was not planned raises instead of running on stale metadata.
4. CUDA graphs, decode and target_verify: `init_capture_state(max_tokens, max_seqs)` allocates
   the static buffers every captured graph reads (slot ids, indptr, page indices, lengths, and
   for table steps the page table and sequence lengths), sized for the largest bucket;
   `init_replay_state(ctx, bucket)`, before the capture of a bucket and before each replay,
   copies the step's slot ids into them and plans the bucket's `use_cuda_graph` wrappers (one
   per bucket, step kind and head group, made on first use over views of those buffers): the
   decode wrapper for decode, the paged prefill wrapper (causal) for target_verify, whose
   requests all carry the same n tokens, so a bucket of B requests is always B * n query rows.
   Padding requests of a bucket own as many query rows as a real one and read that many cached
   tokens of page 0 (a finite output, zeroed after). With only table groups (`decode_impl=
   "triton"` on a GQA model) the hook plans nothing: it copies the step's page table and
   sequence lengths (already on the device: the graph runner's staging) into the static ones,
   device to device, next to the slot ids; padding requests (sequence length 0) see no key.
   Extend and mixed steps, with `extend_impl="triton"`: the bucket is the extend key's request
   rows S (its T token rows padded by the graph runner), and the hook copies the page table,
   lengths and `query_start_loc` [S+1] the same way; padded requests own no rows, the rows past
   the real ones get zeros, and the kernel's grid is the bucket's (its row blocks sized for T).
   The capability declares that capture (`op_capture`, under extend_impl=triton), so the split
   captures the op there and a whole extend step can be one graph. With another extend_impl the
   extend and mixed steps of up to `whole_extend_tokens` rows (512 by default; `varlen_extend`)
   run that kernel and are captured the same way, larger ones FlashInfer's prefill: the
   capability declares the capture bounded by the option, the split keeps the op an eager gap and
   records the bound, and the graph runner captures the buckets up to it whole (this hook then
   runs for them) and the larger ones in pieces, the op in their gap. MLA layers the same, on the
   Triton MLA kernel's varlen form up to the bound, FlashInfer's MLA (or the Triton kernel's row
   arrays, mla_impl="triton") above it.

KV layout: the pool's "k" and "v" tensors [pages, page_size, Hkv, D] are FlashInfer's NHD tuple
form as they are; the MLA "latent" entry [pages, page_size, R+P] is handed over as two strided
views [..., :R] and [..., R:] (the MLA kernels take page and token strides).

Splits of the keys (`kv_splits`, a routing option): "auto" lets the Triton kernels choose their
split count from the step's rows; "fixed" makes them split every row's keys at fixed positions
(triton_split_kv.py), so a row's output depends only on its query, its keys and its position, not
on what else shares its step. It covers the steps the Triton kernels serve: for GQA layers,
decode and target_verify steps whose requests all carry the same n rows (`decode_impl="triton"`),
and extend and mixed steps on the varlen kernel (`extend_impl="triton"`, or up to
`whole_extend_tokens` rows; there an extend row gets the bits a decode step at its position gives
it, the same tile, chunks and order: checked in Triton's interpreter, and by a gpu-marked test on
the device); for MLA layers every
step (`mla_impl="triton"`: the Triton MLA kernel serves extend and mixed steps too). Other GQA
extend and mixed steps, and target_verify steps of unequal rows, still run FlashInfer's prefill
wrappers, which choose their own splits per batch. FlashInfer's decode and
MLA kernels do the same, so "fixed" needs every GQA group on decode_impl="triton" and every MLA
group on mla_impl="triton".

It does not: choose buckets, capture or replay graphs, pad batches (the graph runner does), or
implement the linear-attention ops (routing binds those nodes to another backend; the runtime's
BackendSet forwards each step's hooks to both).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import torch

from compiler.splitops import BackendCapability, ChoiceScope, LayerKind, Mode, OpCapture, OptionDtypes, ShapeLimit
from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import next_pow2
from runtime.backends.protocol import BackendHooks, BackendSetup
from runtime.step.context import ExecContext
from runtime.step.host_copy import array_to_device
from runtime.cache.kv_pool import KVPool

try:  # Triton ships with Linux torch installs; only the GPU paths launch its kernels.
    import triton
    import triton.language as tl

    from runtime.backends.kernels.pdl import launch_args, pdl_wait
except ImportError:  # pragma: no cover - metadata building still works without it
    triton = None

__all__ = [
    "FlashInferAttentionBackend",
    "FLASHINFER_GQA_HEAD_DIMS",
    "KV_SPLITS",
    "EXTEND_IMPLS",
    "WHOLE_EXTEND_TOKENS",
    "varlen_extend",
    "MLA_EXTEND_CAPTURE",
    "full_layer_options",
    "FlashInferMissing",
    "PagedMetadata",
    "build_paged_metadata",
    "store_kv_rows",
    "import_flashinfer",
]

# Decode and target_verify kernels of GQA layers, the default first: the plan-free Triton kernel
# (triton_gqa.py) replays as fast as FlashInfer's decode and needs no host plan per step
# (benchmarks/history/compiled_pieces.md, "Plan-free decode"); FlashInfer's stays a routing choice.
DECODE_IMPLS = ("triton", "flashinfer")
# Decode and target_verify kernels of MLA layers, the default first: the Triton MLA kernel from the
# page table (kernels/mla.py's page-table mode) plans nothing on the host, so a decode graph's replay
# state is device copies recorded in it; FlashInfer's MLA decode plans BatchMLAPagedAttentionWrapper
# before every replay. On an H200 the Triton route took bench bailing_linear's batch-1 decode step
# from 1.715 to 0.904 ms and kimi_linear's from 2.312 to 1.422 (3.186 to 2.168 and 4.436 to 3.234
# at batch 128; benchmarks/history/compiled_pieces.md, "the MLA families on the Triton MLA
# decode"); on an H100 the planned decode left 0.35 ms a batch-1 step between the kernels of both
# families (benchmarks/results/step_account_mla_compiled_h100_2026-12-06.md). Extends keep what
# mla_impl says (FlashInfer's MLA prefill above whole_extend_tokens).
MLA_DECODE_IMPLS = ("triton", "flashinfer")
# How the Triton attention kernels split a row's keys, the default first: "auto" by the step's rows,
# "fixed" at fixed key positions (a row's result then independent of its step's batch).
KV_SPLITS = ("auto", "fixed")
# Extend and mixed kernels of GQA layers, the default first: FlashInfer's ragged prefill where every
# request starts from an empty cache (its paged prefill otherwise), its paged prefill always, or the
# Triton kernel from the page table (kernels/gqa.py, varlen), which plans nothing on the host and may
# be captured. The default stays FlashInfer's until a whole-step measurement says otherwise.
EXTEND_IMPLS = ("ragged", "paged", "triton")
# Extend and mixed steps of up to this many tokens run GQA groups on that Triton kernel whatever the
# extend_impl, so their buckets may be whole-step graphs; larger ones run extend_impl's kernel in the
# eager gap of pieces. The default first: on an H200 (qwen3_next, one request per step) whole-step
# graphs were faster up to about 512 tokens and slower from 1024, where FlashInfer's prefill beats
# the Triton kernel (docs/DESIGN.md, "Short extends get buckets of their own"). "0": never (pieces
# everywhere). Each must be an extend bucket of the artifact, or above them all
# (compiler/splitops/artifact.py `whole_bound_refusal`): the same steps then take the same kernel
# eagerly and replayed.
WHOLE_EXTEND_TOKENS = ("512", "0", "16", "32", "64", "128", "256", "1024", "2048", "4096")

GPU_EXTRA_HINT = "install the gpu extra: pip install -e '.[gpu]' (flashinfer-python)"


class FlashInferMissing(ImportError):
    pass


def import_flashinfer():
    """Import flashinfer or raise FlashInferMissing with the install hint."""
    try:
        import flashinfer  # noqa: F401
        import flashinfer.mla  # noqa: F401
    except ImportError as exc:
        raise FlashInferMissing(
            f"FlashInferAttentionBackend needs flashinfer, which is not importable ({exc}); "
            f"{GPU_EXTRA_HINT}") from exc
    return flashinfer


# -- paged metadata --------------------------------------------------------------------------


@dataclasses.dataclass
class PagedMetadata:
    """One step's requests in FlashInfer's paged form. Host tensors feed plan(), which reads them
    on the host anyway; the page indices are gathered on the page table's device.

    Request b's query rows are qo_indptr[b]:qo_indptr[b+1]; its kv_lens[b] cached tokens (this
    step's included) live on pages kv_indices[kv_indptr[b]:kv_indptr[b+1]], the last one holding
    kv_last_page_len[b] tokens. row_req / row_pos give each query row its request and its
    position (the number of keys it sees, minus one): the Triton MLA kernel reads those.
    """

    num_reqs: int  # requests planned (padding requests of a graph bucket included)
    num_rows: int  # query rows the kernels read: qo_indptr[-1]
    qo_indptr: torch.Tensor  # [num_reqs+1] int32, host
    kv_indptr: torch.Tensor  # [num_reqs+1] int32, host
    kv_lens: torch.Tensor  # [num_reqs] int32, host
    kv_last_page_len: torch.Tensor  # [num_reqs] int32, host
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, on ctx.page_table's device
    row_req: torch.Tensor  # [num_rows] int32, host
    row_pos: torch.Tensor  # [num_rows] int32, host
    all_fresh: bool  # every real request starts from an empty cache (ragged prefill applies)


def build_paged_metadata(ctx: ExecContext, pad_reqs_to: Optional[int] = None,
                         pad_rows_per_req: int = 1) -> PagedMetadata:
    """FlashInfer's indptr / indices / last_page_len for the real requests of `ctx`.

    pad_reqs_to (graph buckets): append padding requests up to that count, each owning
    `pad_rows_per_req` query rows (1 in decode, n in a target_verify step of n tokens per
    request) and reading as many cached tokens of page 0, so a fixed-size batch never has an
    empty request and always the same number of rows. Only host lists (`query_lens`, `cache_lens`) are read on the host; the page table
    stays on its device and is gathered there (no device-to-host synchronisation). The host
    arithmetic is numpy: torch's CPU repeat_interleave took milliseconds per call here.
    """
    ps = ctx.page_size
    q_lens = np.asarray(ctx.query_lens, dtype=np.int64)
    cache = np.asarray(ctx.cache_lens, dtype=np.int64)
    kv_lens = q_lens + cache
    num_real = q_lens.size
    n_pages = (kv_lens + ps - 1) // ps  # every real request holds at least its new token
    width = ctx.page_table.shape[1]
    if num_real and int(n_pages.max()) > width:
        raise ValueError(f"build_paged_metadata: a request needs {int(n_pages.max())} pages but the "
                         f"page table has {width} columns")
    kv_indptr = np.zeros(num_real + 1, dtype=np.int64)
    np.cumsum(n_pages, out=kv_indptr[1:])
    total = int(kv_indptr[-1])
    # Flat position of every (request, page) pair in the [B, width] page table: one gather on
    # the device instead of a host loop or a boolean mask (which would synchronise).
    flat = np.arange(total, dtype=np.int64) + np.repeat(np.arange(num_real) * width - kv_indptr[:-1], n_pages)
    flat_dev = array_to_device(flat, ctx.page_table.device)
    kv_indices = ctx.page_table.reshape(-1).index_select(0, flat_dev).to(torch.int32)  # [] indexing: ms on CPU

    qo_indptr = np.zeros(num_real + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qo_indptr[1:])
    last = kv_lens - (n_pages - 1) * ps
    rows = int(qo_indptr[-1])
    row_req = np.repeat(np.arange(num_real), q_lens)
    # Row i of request b sits at position cache_len + i: causal, it sees keys 0..that position.
    row_pos = np.arange(rows) + np.repeat(cache - qo_indptr[:-1], q_lens)
    all_fresh = not cache.any()

    if pad_reqs_to is not None and pad_reqs_to > num_real:
        n_pad, per = pad_reqs_to - num_real, pad_rows_per_req
        pad_pages = -(-per // ps)  # page 0, as often as `per` cached tokens need
        steps = np.arange(1, n_pad + 1)
        qo_indptr = np.concatenate([qo_indptr, rows + steps * per])
        kv_indptr = np.concatenate([kv_indptr, total + steps * pad_pages])
        kv_lens = np.concatenate([kv_lens, np.full(n_pad, per, np.int64)])
        last = np.concatenate([last, np.full(n_pad, per - (pad_pages - 1) * ps, np.int64)])
        kv_indices = torch.cat([kv_indices, torch.zeros(n_pad * pad_pages, dtype=torch.int32,
                                                        device=kv_indices.device)])
        row_req = np.concatenate([row_req, np.repeat(np.arange(num_real, pad_reqs_to), per)])
        row_pos = np.concatenate([row_pos, np.tile(np.arange(per), n_pad)])
        num_real, rows = pad_reqs_to, rows + n_pad * per

    # Pinned on cuda: FlashInfer's plan() copies them to the device with non_blocking=True, and a copy
    # from pageable memory waits for the stream first, which a plan made after the step's first
    # piece launched (GraphRunner._plan) would spend waiting for that piece.
    pinned = ctx.page_table.device.type == "cuda"
    i32 = lambda a: _pinned_if(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)), pinned)
    return PagedMetadata(num_reqs=num_real, num_rows=rows, qo_indptr=i32(qo_indptr), kv_indptr=i32(kv_indptr),
                         kv_lens=i32(kv_lens), kv_last_page_len=i32(last), kv_indices=kv_indices,
                         row_req=i32(row_req), row_pos=i32(row_pos), all_fresh=all_fresh)


def _pinned_if(host: torch.Tensor, pinned: bool) -> torch.Tensor:
    return host.pin_memory() if pinned else host


# -- storing this step's rows ----------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _store_rows_kernel(slot_ptr, page_size,
                           a_src, a_src_stride, a_dst, a_page_stride, a_tok_stride,
                           b_src, b_src_stride, b_dst, b_page_stride, b_tok_stride,
                           A_WIDTH: tl.constexpr, A_BLOCK: tl.constexpr,
                           B_WIDTH: tl.constexpr, B_BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
        # One program per token row; a row whose slot is negative (padding) writes nothing.
        # USE_GDC: launched with PDL (runtime/backends/kernels/pdl.py); rows and slots are the step's: it waits first.
        pdl_wait(USE_GDC)
        row = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        # A padding row gets an empty column range instead of a branch: no load, no store.
        a_limit = tl.where(slot >= 0, A_WIDTH, 0)
        b_limit = tl.where(slot >= 0, B_WIDTH, 0)
        slot = tl.maximum(slot, 0)
        page = slot // page_size
        offset = slot % page_size
        for start in tl.static_range(0, A_WIDTH, A_BLOCK):
            cols = start + tl.arange(0, A_BLOCK)
            mask = cols < a_limit
            x = tl.load(a_src + row * a_src_stride + cols, mask=mask)
            tl.store(a_dst + page * a_page_stride + offset * a_tok_stride + cols, x, mask=mask)
        for start in tl.static_range(0, B_WIDTH, B_BLOCK):
            cols = start + tl.arange(0, B_BLOCK)
            mask = cols < b_limit
            x = tl.load(b_src + row * b_src_stride + cols, mask=mask)
            tl.store(b_dst + page * b_page_stride + offset * b_tok_stride + cols, x, mask=mask)


# Launched with the same arguments step after step in eager gaps: through a Launcher (launch_cache.py).
_STORE_ROWS = Launcher(_store_rows_kernel) if triton is not None else None


def _rows_view(src: torch.Tensor) -> torch.Tensor:
    """src [T, ...] -> [T, width] with unit column stride (a view when the layout allows)."""
    flat = src.reshape(src.shape[0], -1)  # copies only when the per-row block is not one run
    return flat if flat.stride(1) == 1 else flat.contiguous()


def store_kv_rows(slot_mapping: torch.Tensor, page_size: int,
                  a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Write rows of two sources into two paged destinations in one launch.

    a, b: (src [T, ...], dst) where dst is a (view of a) pool tensor [pages, page_size, ...]
    whose per-token block is contiguous (it may start at a column offset, as the MLA latent's
    rope part does). Rows whose slot is -1 are skipped inside the kernel, so a captured graph
    stays correct whatever number of real rows a replay has.
    """
    if triton is None:  # pragma: no cover
        raise RuntimeError("store_kv_rows needs triton (it ships with torch on Linux)")
    T = slot_mapping.shape[0]
    args = []
    consts = {}
    for name, (src, dst) in (("A", a), ("B", b)):
        width = math.prod(dst.shape[2:])
        assert src.shape[0] >= T, f"store_kv_rows: {src.shape[0]} source rows for {T} slots"
        assert dst.stride(-1) == 1 and (dst.dim() == 3 or dst.stride(-2) == dst.shape[-1]), (
            "store_kv_rows: each token's block of the destination must be contiguous")
        assert src.dtype == dst.dtype, f"store_kv_rows: source {src.dtype} vs cache {dst.dtype}"
        rows = _rows_view(src)
        assert rows.shape[1] == width, f"store_kv_rows: rows of {rows.shape[1]} elements for a cache entry of {width}"
        args += [rows, rows.stride(0), dst, dst.stride(0), dst.stride(1)]
        consts[f"{name}_WIDTH"] = width
        consts[f"{name}_BLOCK"] = min(next_pow2(width), 2048)
    if T == 0:
        return
    _STORE_ROWS[(T,)](slot_mapping, page_size, *args, **consts, **launch_args(slot_mapping.device))


# -- the backend -----------------------------------------------------------------------------

# FlashInfer 0.6.0's prefill kernels static_assert a head dim of 64, 128 or 256 (seen on an H200:
# the sm90 ragged and paged prefill failed to JIT-build for head dim 32, and its fa2 tensor-core
# decode refused the same dim at run time with "Invalid configuration"). Declared as a shape limit,
# routing refuses it at compile time instead of a page of nvcc output at the first prefill.
FLASHINFER_GQA_HEAD_DIMS = (64, 128, 256)
_HEAD_DIM_WHY = "FlashInfer 0.6's prefill kernels are built for head dims 64, 128 and 256 only"
# FlashInfer's MLA (BatchMLAPagedAttentionWrapper) is used and checked here at one geometry only:
# latent rank 512 and rope width 64, DeepSeek's, which the released Kimi-Linear and Ling configs
# keep (tests/gpu/test_gpu_attention.py checks it against the reference there). A build of the tiny
# bailing_linear model (rank 32, rope 8, bf16) that routed MLA here died in its start-up with an
# illegal memory access on an H200. Other geometries route to the Triton MLA kernel.
FLASHINFER_MLA_RANK, FLASHINFER_MLA_ROPE = 512, 64
_MLA_WHY = (f"FlashInfer's MLA is checked at latent rank {FLASHINFER_MLA_RANK}, rope width {FLASHINFER_MLA_ROPE} "
            "only; other widths ran into an illegal memory access")
# FlashInfer's kernels are instantiated for 16-bit activations: its JIT dtype table has no float32
# (a float32 MLA plan died with a KeyError inside FlashInfer), so float32 routes elsewhere, or, for
# GQA layers, here with every step on the Triton kernels (decode_impl and extend_impl "triton").
_FLASHINFER_DTYPES = frozenset({"bfloat16", "float16"})


def full_layer_options(setup: BackendSetup) -> dict:
    """Constructor arguments of a full-attention backend for the layers routed to it: per layer
    query heads and softmax scale, the MLA rope width and the query dtype, read off the calls.

    FlashInfer fixes each layer's scale and head count at plan time, before any op runs; the
    facts sit in the compiled graph (each node's `scale` argument and its query's shape and
    dtype), which keeps one source of truth and the runtime free of models/. A layer met twice
    (two programs, two calls) must agree with itself.
    """
    query = {"gqa_attention": "q", "mla_attention": "q_latent"}
    heads, scales, ropes, dtypes = {}, {}, set(), set()
    for call in setup.calls:
        if call.op not in query:
            continue
        shape = call.shapes.get(query[call.op])
        if shape is None or len(shape) != 3 or shape[1] is None:
            raise ValueError(f"layer {call.layer_id} ({call.op}): its query carries no [rows, heads, dim] shape "
                             f"in the graph; recompile the artifact")
        fact = (shape[1], float(call.scalars["scale"]))
        if heads.setdefault(call.layer_id, fact[0]) != fact[0] or scales.setdefault(call.layer_id, fact[1]) != fact[1]:
            raise ValueError(f"layer {call.layer_id}: the graphs disagree about its query heads or scale")
        if call.op == "mla_attention":
            ropes.add(call.shapes["k_rope"][-1])
        dtypes.add(call.dtype)
    if len(ropes) > 1:
        raise ValueError(f"MLA layers with different rope widths {sorted(ropes)}: one backend instance plans one width")
    if len(dtypes) > 1:
        raise ValueError(f"full layers with different dtypes {sorted(dtypes)}: one backend instance plans one")
    options = {"q_heads": heads, "scales": scales, "layers": sorted(heads)}
    if ropes:
        options["mla_rope_dim"] = ropes.pop()
    if dtypes:
        options["q_dtype"] = getattr(torch, dtypes.pop())
    return options


@dataclasses.dataclass(frozen=True)
class _Group:
    """Layers that share one plan: same kind, heads, head dims, scale and dtypes."""

    kind: str  # "gqa" or "mla"
    num_q_heads: int
    num_kv_heads: int  # MLA: 1 (the latent is shared by every head)
    head_dim: int  # GQA: D of q/k; MLA: latent rank R
    head_dim_v: int  # GQA: Dv; MLA: R
    rope_dim: int  # MLA: P; GQA: 0
    scale: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


@dataclasses.dataclass
class _Planned:
    """A wrapper plus the event that says its last plan's host-to-device copy has finished.

    plan() fills a pinned host buffer and copies it asynchronously; planning the same wrapper
    again before that copy ran would overwrite the source, so the next plan waits on the event.
    """

    wrapper: Any
    on_cuda: bool = True
    event: Optional[torch.cuda.Event] = None

    def plan(self, *args, **kwargs) -> None:
        if self.event is not None:
            self.event.synchronize()
        self.wrapper.plan(*args, **kwargs)
        if self.on_cuda:
            self.event = torch.cuda.Event()
            self.event.record()


@dataclasses.dataclass
class _StepTable:
    """A table step's addressing, as the Triton kernels read it: B requests of n rows each, or
    (extend_impl="triton", extend and mixed steps) of the rows query_start_loc gives each."""

    page_table: torch.Tensor  # [B, width] int32 on the device (graph steps: the static copy)
    seq_lens: torch.Tensor  # [B] int32 on the device: cached + new tokens (padding requests: 0)
    rows_per_req: int  # n; 0: requests of different lengths (query_start_loc)
    groups: frozenset  # the _Groups that run a Triton kernel from it
    query_start_loc: Optional[torch.Tensor] = None  # [B+1] int32 on the device, when rows_per_req is 0
    max_rows: int = 0  # when rows_per_req is 0: the most rows a request (or the padding) owns


@dataclasses.dataclass
class _StepPlan:
    ctx: ExecContext
    meta: Optional[PagedMetadata]  # None when no group of the step needs paged metadata
    kind: str  # "decode", "prefill" or "ragged"
    bucket: Optional[int]  # the captured bucket this plan serves; None: an eager step
    num_rows: int  # query rows the kernels read (a graph step's padding requests included)
    slots: torch.Tensor  # [rows] slot ids the store kernel reads: ctx.slot_mapping, or the static copy
    # graph steps with padding rows and a group off the table kernels: [rows, 1, 1] bool, True on those (static)
    pad_rows: Optional[torch.Tensor]
    wrappers: dict  # _Group -> flashinfer wrapper (groups on a Triton kernel: absent)
    triton_meta: Optional[tuple] = None  # (kv_indptr, kv_indices, row_req, row_pos) on the device
    table: Optional[_StepTable] = None  # decode / uniform target_verify steps with Triton groups




def varlen_extend(mode, tokens: int, extend_impl: str, whole_extend_tokens: int) -> bool:
    """Whether a step whose requests carry different rows runs the Triton kernels' varlen forms
    (GQA's, and MLA's: MLA layers never take extend_impl="triton"): every such step with
    extend_impl="triton" (an eager target_verify step of unequal rows too); otherwise an extend or
    mixed step of at most whole_extend_tokens `tokens`. `tokens` is the
    step's rows (ExecContext.num_tokens): a graph step's are its bucket's, an eager step's its own,
    and with the bound an extend bucket, a step goes to a bucket on the bound's side it lies on, so
    an eager step and the graph its bucket replays run the same kernel."""
    if extend_impl == "triton":
        return True
    return Mode(mode) in (Mode.EXTEND, Mode.MIXED) and tokens <= whole_extend_tokens


# MLA extend and mixed steps of up to whole_extend_tokens tokens on the Triton MLA kernel's varlen
# form (kernels/mla.py: page table, lengths, query offsets; nothing planned on the host), declared
# by every backend that runs MLA layers on that kernel (this one and triton_mla).
MLA_EXTEND_CAPTURE = OpCapture("mla_attention", frozenset({Mode.EXTEND, Mode.MIXED}), up_to="whole_extend_tokens",
                               why="steps of up to whole_extend_tokens tokens on the Triton MLA kernel from the "
                                   "page table, seq_lens and query_start_loc")


def _graph_mode(mode) -> Mode:
    """The mode whose graphs a step of `mode` replays: a mixed step replays the extend keys'."""
    return Mode.EXTEND if Mode(mode) == Mode.MIXED else Mode(mode)


class FlashInferAttentionBackend(BackendHooks):
    """GQA and MLA full attention through FlashInfer's paged kernels (see the module docstring)."""

    name = "flashinfer"
    capability = BackendCapability(
        name="flashinfer", device="cuda", ops=frozenset({"gqa_attention", "mla_attention"}),
        modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}), kinds=frozenset({LayerKind.FULL_GQA, LayerKind.FULL_MLA}),
        # GQA extend and mixed steps on the Triton kernel read the step's page table, lengths and
        # query offsets from the bucket's static buffers: nothing planned on the host, one grid per bucket.
        # Under whole_extend_tokens, only steps of up to that many tokens run that kernel: the split
        # keeps the op a gap (larger steps run extend_impl's there) and whole-step graphs of the
        # buckets up to it hold it.
        op_capture=(OpCapture("gqa_attention", frozenset({Mode.EXTEND, Mode.MIXED}), when=(("extend_impl", "triton"),),
                              why="the Triton GQA kernel from the page table, seq_lens and query_start_loc"),
                    OpCapture("gqa_attention", frozenset({Mode.EXTEND, Mode.MIXED}), up_to="whole_extend_tokens",
                              why="steps of up to whole_extend_tokens tokens on the Triton GQA kernel"),
                    MLA_EXTEND_CAPTURE),
        dtypes=_FLASHINFER_DTYPES,
        # GQA layers whose every step runs a Triton kernel never reach FlashInfer's JIT: float32 too.
        option_dtypes=(OptionDtypes("gqa_attention", frozenset({"float32"}),
                                    when=(("decode_impl", "triton"), ("extend_impl", "triton")),
                                    why="every GQA step on the Triton kernels, none on FlashInfer's"),),
        limits=(ShapeLimit("gqa_attention", "q", -1, frozenset(FLASHINFER_GQA_HEAD_DIMS), why=_HEAD_DIM_WHY),
                ShapeLimit("gqa_attention", "v", -1, frozenset(FLASHINFER_GQA_HEAD_DIMS), why=_HEAD_DIM_WHY),
                ShapeLimit("mla_attention", "q_latent", -1, frozenset({FLASHINFER_MLA_RANK}), why=_MLA_WHY),
                ShapeLimit("mla_attention", "q_rope", -1, frozenset({FLASHINFER_MLA_ROPE}), why=_MLA_WHY)),
        # Kernel alternatives routing records (the first choice is the default; see __init__).
        # decode_impl: the default is the first choice; "triton" plans nothing on the host for
        # decode and target_verify steps (runtime/backends/kernels/gqa.py). mla_decode_impl: the
        # same for MLA layers (runtime/backends/kernels/mla.py's page-table mode; MLA_DECODE_IMPLS).
        # kv_splits: "fixed" makes the Triton kernels' results independent of the step's batch
        # (module docstring, "Splits of the keys"). extend_impl: "triton" runs GQA extend and mixed
        # steps on the Triton kernel (EXTEND_IMPLS); MLA layers refuse it (choice_ops).
        # whole_extend_tokens: GQA extend and mixed steps of up to that many tokens on it whatever
        # extend_impl says (WHOLE_EXTEND_TOKENS).
        options=(("extend_impl", EXTEND_IMPLS),
                 ("decode_impl", DECODE_IMPLS),
                 ("mla_decode_impl", MLA_DECODE_IMPLS),
                 ("decode_backend", ("fa2", "auto", "fa3")),
                 ("decode_tensor_cores", ("auto", "on", "off")),
                 ("prefill_backend", ("auto", "fa2", "fa3")),
                 ("mla_backend", ("auto", "fa2", "fa3")),
                 ("kv_splits", KV_SPLITS),
                 ("whole_extend_tokens", WHOLE_EXTEND_TOKENS)),
        # --batch-invariant: GQA on the Triton table kernel with fixed splits. MLA layers here run
        # FlashInfer's MLA kernel, which splits by the batch: routing sends them to triton_mla.
        batch_invariant=(("decode_impl", "triton"), ("kv_splits", "fixed")),
        batch_invariant_ops=frozenset({"gqa_attention"}),
        priority=1,
        choice_ops=(ChoiceScope("extend_impl", "triton", frozenset({"gqa_attention"}),
                                why="the Triton kernel serves GQA layers; MLA extends are not served by it"),),
        doc="paged GQA / MLA attention through FlashInfer; decode and target_verify captured (the Triton "
            "kernel from the page table, or use_cuda_graph wrappers); GQA extend and mixed steps of up to "
            "whole_extend_tokens tokens captured on the Triton kernel, larger ones eager (every size captured "
            "with extend_impl=triton); MLA extend and mixed steps of up to whole_extend_tokens tokens captured "
            "on the Triton MLA kernel, larger ones eager")

    @classmethod
    def build(cls, setup: BackendSetup) -> "FlashInferAttentionBackend":
        """For the full layers routed here, with their heads, scales and dtypes read off the graph."""
        return cls(setup.kv_pool, **full_layer_options(setup), **cls._kernel_options(setup.options))

    @staticmethod
    def _kernel_options(options: Mapping[str, str]) -> dict:
        """Routing's recorded choices (capability.options) as constructor arguments."""
        kwargs = {k: options[k] for k in ("extend_impl", "decode_impl", "mla_decode_impl", "decode_backend",
                                          "prefill_backend", "mla_backend", "kv_splits") if k in options}
        if "whole_extend_tokens" in options:
            kwargs["whole_extend_tokens"] = int(options["whole_extend_tokens"])
        if "decode_tensor_cores" in options:
            kwargs["decode_tensor_cores"] = {"auto": None, "on": True, "off": False}[options["decode_tensor_cores"]]
        return kwargs

    def __init__(self, kv_pool: KVPool, q_heads: int | Mapping[int, int],
                 scales: float | Mapping[int, float] | None = None, *, layers: Optional[Iterable[int]] = None,
                 mla_rope_dim: int = 64, q_dtype: Optional[torch.dtype] = None,
                 workspace_bytes: int = 256 * 1024 * 1024, decode_tensor_cores: Optional[bool] = None,
                 decode_backend: str = "fa2", prefill_backend: str = "auto", mla_backend: str = "auto",
                 mla_impl: str = "flashinfer", extend_impl: str = "ragged", decode_impl: str = DECODE_IMPLS[0],
                 mla_decode_impl: str = "flashinfer", kv_splits: str = KV_SPLITS[0],
                 whole_extend_tokens: int = 0):
        """q_heads: query heads of every full layer (one int, or per layer id). layers: the full
        layers this instance serves (default: every full layer of the pool). scales: softmax
        scale per layer (GQA default head_dim**-0.5; MLA layers need one: the scale depends on
        the un-absorbed head dims). The op's own `scale` argument must agree with it: FlashInfer
        fixes the scale at plan time, before the op is called.
        decode_tensor_cores: None = FlashInfer's tensor-core decode when a kv head serves 4 or
        more query heads. decode_backend: the prefill kernel family the tensor-core decode runs
        ("fa2" by default: on an H200 the "auto" choice, fa3, was 2-10x slower for one query
        row, since it does not pack a kv head's query heads into one tile;
        benchmarks/history/attention_notes.md). prefill_backend: FlashInfer's backend ("auto", "fa2", "fa3") of
        the prefill kernels. mla_backend: the same for BatchMLAPagedAttentionWrapper.
        mla_impl: "flashinfer" or "triton" (triton_mla.py; as a routing choice it is the
        `triton_mla` backend, which fixes it). extend_impl: "ragged" (a step where
        every request starts from an empty cache attends over this step's k/v, 1.5x faster at
        2048 tokens), "paged" (always the paged prefill) or "triton" (GQA extend and mixed steps
        through triton_gqa_attention_varlen from the page table: no host plan, capturable; GQA
        layers only). decode_impl: "flashinfer" or "triton"
        (GQA layers of decode and uniform target_verify steps through triton_gqa.py, straight from
        the page table: nothing planned on the host). mla_decode_impl: "triton" or "flashinfer", the
        same for MLA layers (the Triton MLA kernel's page-table mode; mla_impl="triton" runs it
        whatever this says). Routing records MLA_DECODE_IMPLS[0] for an artifact; an instance built by
        hand keeps FlashInfer's MLA decode unless told, so a kernel test or benchmark naming
        mla_impl="flashinfer" measures FlashInfer's kernel. kv_splits: "auto" or "fixed", how the Triton
        kernels split a row's keys (module docstring, "Splits of the keys"); "fixed" needs
        decode_impl="triton" for GQA layers and mla_impl="triton" for MLA layers.
        whole_extend_tokens: extend and mixed steps of up to that many tokens run the Triton
        kernels' varlen forms (GQA whatever extend_impl says, MLA whatever mla_impl says;
        `varlen_extend`), and may be captured; 0: none.
        Routing gives an artifact's instances the capability's default (WHOLE_EXTEND_TOKENS[0]);
        an instance built by hand (kernel benchmarks, tests) runs extend_impl's kernel on every
        extend unless told, so what it measures is the kernel it names.
        """
        self.flashinfer = self._kernel_library()
        if mla_impl not in ("flashinfer", "triton"):
            raise ValueError(f"mla_impl must be 'flashinfer' or 'triton', not {mla_impl!r}")
        if extend_impl not in EXTEND_IMPLS:
            raise ValueError(f"extend_impl must be one of {', '.join(map(repr, EXTEND_IMPLS))}, not {extend_impl!r}")
        if decode_impl not in DECODE_IMPLS:
            raise ValueError(f"decode_impl must be one of {', '.join(map(repr, DECODE_IMPLS))}, not {decode_impl!r}")
        if mla_decode_impl not in MLA_DECODE_IMPLS:
            raise ValueError(f"mla_decode_impl must be one of {', '.join(map(repr, MLA_DECODE_IMPLS))}, "
                             f"not {mla_decode_impl!r}")
        if kv_splits not in KV_SPLITS:
            raise ValueError(f"kv_splits must be one of {', '.join(map(repr, KV_SPLITS))}, not {kv_splits!r}")
        self.kv_pool = kv_pool
        self.device = kv_pool.device
        self._check_device()
        self.decode_tensor_cores = decode_tensor_cores
        self.decode_backend = decode_backend
        self.prefill_backend = prefill_backend
        self.mla_backend = mla_backend
        self.mla_impl = mla_impl
        self.extend_impl = extend_impl
        self.decode_impl = decode_impl
        self.mla_decode_impl = mla_decode_impl
        self.fixed_splits = kv_splits == "fixed"  # passed to every Triton attention kernel
        if whole_extend_tokens < 0:
            raise ValueError(f"whole_extend_tokens must be a token count, not {whole_extend_tokens!r}")
        self.whole_extend_tokens = whole_extend_tokens
        # One float workspace for every wrapper: their runs follow one another on one stream.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.layers: dict[int, _Group] = {}
        served = sorted(kv_pool.buffers) if layers is None else sorted(layers)
        unpooled = [i for i in served if i not in kv_pool.buffers]
        if unpooled:
            raise ValueError(f"{self.name}: layers {unpooled} hold no KV pages in the pool (full layers: "
                             f"{sorted(kv_pool.buffers)})")
        for layer_id in served:
            entries = kv_pool.buffers[layer_id]
            self.layers[layer_id] = self._group_of(layer_id, entries, q_heads, scales, mla_rope_dim, q_dtype)
        self.groups: tuple[_Group, ...] = tuple(dict.fromkeys(self.layers.values()))
        for option, value in (("decode_impl", decode_impl), ("extend_impl", extend_impl)):
            if value != "triton":
                continue
            from runtime.backends.kernels.gqa import gqa_head_dim_refusal
            for layer_id, g in self.layers.items():
                if g.kind == "mla" and option == "extend_impl":
                    raise ValueError(f"layer {layer_id} ({option}='triton'): MLA extends are not served by the Triton "
                                     f"GQA kernel; route MLA layers with extend_impl ragged or paged")
                why = g.kind == "gqa" and (gqa_head_dim_refusal(g.head_dim) or gqa_head_dim_refusal(g.head_dim_v))
                if why:
                    raise ValueError(f"layer {layer_id} ({option}='triton'): {why}")
        if self.fixed_splits:
            self._check_fixed_splits()
        self._eager: dict[tuple[_Group, str], _Planned] = {}  # (group, kind) -> eager wrapper
        self._static: Optional[dict[str, torch.Tensor]] = None  # init_capture_state's buffers
        self._graph: dict[tuple[_Group, int, str], _Planned] = {}  # (group, bucket, kind) -> use_cuda_graph wrapper
        self._step: Optional[_StepPlan] = None

    # -- configuration ---------------------------------------------------------------------

    def _kernel_library(self):
        """The flashinfer module (FlashInferMissing with the install hint when it is absent)."""
        return import_flashinfer()

    def _check_fixed_splits(self) -> None:
        """kv_splits="fixed": every group on a Triton kernel, which takes fixed splits; FlashInfer's
        decode and MLA kernels choose their own splits per batch."""
        for layer_id, g in self.layers.items():
            if g.kind == "gqa" and self.decode_impl != "triton":
                raise ValueError(f"layer {layer_id} (kv_splits='fixed'): FlashInfer's decode kernel splits a row's "
                                 f"keys by the batch; set decode_impl='triton' (decode_impl is {self.decode_impl!r})")
            if g.kind == "mla" and self.mla_impl != "triton":
                raise ValueError(f"layer {layer_id} (kv_splits='fixed'): FlashInfer's MLA kernel splits a row's "
                                 f"keys by the batch; set mla_impl='triton' (route mla_attention to the triton_mla "
                                 f"backend)")

    def _check_device(self) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"FlashInferAttentionBackend needs a KV pool on a CUDA device, not {self.device}")

    @staticmethod
    def _group_of(layer_id, entries, q_heads, scales, rope_dim, q_dtype) -> _Group:
        def per_layer(value, what):
            if isinstance(value, Mapping):
                if layer_id not in value:
                    raise KeyError(f"FlashInferAttentionBackend: no {what} given for full layer {layer_id}")
                return value[layer_id]
            return value

        heads = int(per_layer(q_heads, "query head count"))
        scale = per_layer(scales, "softmax scale") if scales is not None else None
        if "k" in entries and "v" in entries:
            k, v = entries["k"], entries["v"]
            hkv, d, dv = k.shape[2], k.shape[3], v.shape[3]
            if heads % hkv:
                raise ValueError(f"layer {layer_id}: {heads} query heads are not a multiple of {hkv} kv heads")
            return _Group("gqa", heads, hkv, d, dv, 0, float(scale if scale is not None else d ** -0.5),
                          q_dtype or k.dtype, k.dtype)
        if "latent" in entries:
            lat = entries["latent"]
            rank = lat.shape[-1] - rope_dim
            if scale is None:
                raise ValueError(f"layer {layer_id} (MLA): pass its softmax scale in `scales` "
                                 "(it depends on the un-absorbed qk head dims, which the pool does not know)")
            return _Group("mla", heads, 1, rank, rank, rope_dim, float(scale), q_dtype or lat.dtype, lat.dtype)
        raise ValueError(f"layer {layer_id}: KV entries {sorted(entries)} are neither GQA (k, v) nor MLA (latent)")

    def _use_tensor_cores(self, g: _Group) -> bool:
        if self.decode_tensor_cores is not None:
            return self.decode_tensor_cores
        return g.num_q_heads // g.num_kv_heads >= 4

    # -- wrappers --------------------------------------------------------------------------

    def _eager_wrapper(self, g: _Group, kind: str) -> _Planned:
        key = (g, kind)
        if key not in self._eager:
            fi = self.flashinfer
            if g.kind == "mla":
                w = fi.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=self.mla_backend)
            elif kind == "decode":
                w = fi.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self.decode_backend,
                                                          use_tensor_cores=self._use_tensor_cores(g))
            elif kind == "prefill":
                w = fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend=self.prefill_backend)
            else:
                w = fi.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend=self.prefill_backend)
            self._eager[key] = _Planned(w, self.device.type == "cuda")
        return self._eager[key]

    def _graph_wrapper(self, g: _Group, bucket: int, kind: str) -> _Planned:
        """The bucket's use_cuda_graph wrapper for a step kind ("decode", or "prefill" for
        target_verify), over views of the static buffers (fixed addresses).

        Every bucket, kind and group shares the buffers: they hold the same step's metadata, and
        only one graph replays at a time, right after init_replay_state refilled them (plan()
        copies each step's indptr, indices and lengths into them).
        """
        key = (g, bucket, kind)
        if key not in self._graph:
            fi, st = self.flashinfer, self._static
            if g.kind == "mla":
                w = fi.mla.BatchMLAPagedAttentionWrapper(
                    self.workspace, use_cuda_graph=True, qo_indptr=st["qo_indptr"][: bucket + 1],
                    kv_indptr=st["kv_indptr"][: bucket + 1], kv_indices=st["kv_indices"],
                    kv_len_arr=st["kv_lens"][:bucket], backend=self.mla_backend)
            elif kind == "decode":
                w = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self._use_tensor_cores(g),
                    paged_kv_indptr_buffer=st["kv_indptr"][: bucket + 1], paged_kv_indices_buffer=st["kv_indices"],
                    paged_kv_last_page_len_buffer=st["kv_last_page_len"][:bucket], backend=self.decode_backend)
            else:
                w = fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=st["qo_indptr"][: bucket + 1],
                    paged_kv_indptr_buf=st["kv_indptr"][: bucket + 1], paged_kv_indices_buf=st["kv_indices"],
                    paged_kv_last_page_len_buf=st["kv_last_page_len"][:bucket], backend=self.prefill_backend)
            self._graph[key] = _Planned(w, self.device.type == "cuda")
        return self._graph[key]

    # -- planning (never inside a captured region) -----------------------------------------

    def _plan(self, ctx: ExecContext, bucket: Optional[int]) -> _StepPlan:
        mode = Mode(ctx.mode)
        per = self._rows_per_request(ctx)
        # requests of different rows on the varlen kernels: every such step with extend_impl="triton"
        # (GQA groups alone: MLA layers refuse it), else extend and mixed steps of up to
        # whole_extend_tokens rows (varlen_extend), GQA and MLA groups alike
        varlen = not per and self._varlen(mode, ctx.num_tokens)
        on_table = frozenset(g for g in self.groups if (per and self._table_kernel(g)) or varlen)
        if mode == Mode.DECODE:
            kind = "decode"
        elif self.extend_impl == "ragged" and mode == Mode.EXTEND and not any(ctx.cache_lens):
            kind = "ragged"  # every request starts from an empty cache
        else:
            kind = "prefill"
        wrapped = [g for g in self.groups if g not in on_table and not (g.kind == "mla" and self.mla_impl == "triton")]
        row_mla = any(g.kind == "mla" and self.mla_impl == "triton" and g not in on_table for g in self.groups)
        meta = None
        if wrapped or row_mla:  # table groups alone need no paged metadata: nothing built on the host
            pad_per = ctx.num_tokens // ctx.num_seqs if bucket is not None else 1  # a bucket's rows per request
            meta = build_paged_metadata(ctx, pad_reqs_to=bucket, pad_rows_per_req=pad_per)
        wrappers = {}
        for g in wrapped:
            planned = self._graph_wrapper(g, bucket, kind) if bucket is not None else (
                self._eager_wrapper(g, "mla" if g.kind == "mla" else kind))
            self._plan_group(planned, g, kind, meta)
            wrappers[g] = planned.wrapper
        triton_meta = self._triton_meta(meta, bucket) if row_mla else None
        if bucket is None:
            slots, pad_rows, num_rows = ctx.slot_mapping, None, ctx.num_real_tokens
        else:
            num_rows = ctx.num_tokens  # init_replay_state checked: bucket * n
            slots = self._static["slots"][:ctx.num_tokens]
            slots.copy_(ctx.slot_mapping, non_blocking=True)
            pad_rows = None
            # Only a group off the table kernels masks its padding rows: those kernels write zeros
            # there themselves (a padding request sees no key: kernels/gqa.py, kernels/mla.py), and
            # a one-request table step has none. So a step whose groups are all on the table
            # launches neither the mask's compare nor a masked_fill per attention layer.
            if (wrapped or row_mla) and not (per and bucket == 1):
                pad_rows = self._static["pad_rows"][:ctx.num_tokens]
                torch.lt(slots.view(-1, 1, 1), 0, out=pad_rows)  # once per step, not once per layer
        table = self._table(ctx, bucket, per, on_table) if on_table else None
        return _StepPlan(ctx, meta, kind, bucket, num_rows, slots, pad_rows, wrappers, triton_meta, table)

    def _table_kernel(self, g: _Group) -> bool:
        """Whether the group runs a Triton kernel from the page table in a table step."""
        if g.kind == "gqa":
            return self.decode_impl == "triton"
        return self.mla_impl == "triton" or self.mla_decode_impl == "triton"

    def _varlen(self, mode: Mode, tokens: int) -> bool:
        """Whether a step of `mode` and `tokens` rows whose requests carry different rows runs the GQA
        groups on the Triton kernel for requests of different lengths (`varlen_extend`)."""
        return varlen_extend(mode, tokens, self.extend_impl, self.whole_extend_tokens)

    def _captured(self, mode: Mode, tokens: Optional[int] = None) -> bool:
        """Whether this instance's steps of `mode` (of `tokens` rows, where given) may be replayed
        from graphs: what its capability declares (modes_capturable, or an op capture under its
        extend_impl, or up to its whole_extend_tokens)."""
        options = {"extend_impl": self.extend_impl, "whole_extend_tokens": str(self.whole_extend_tokens)}
        bounds = [self.capability.capture_tokens(op, Mode(mode), options) for op in sorted(self.capability.ops)]
        return any(b is None or (b > 0 and (tokens is None or tokens <= b)) for b in bounds)

    @staticmethod
    def _rows_per_request(ctx: ExecContext) -> int:
        """n for a table step (decode: 1; target_verify where every request has n rows), else 0."""
        mode = Mode(ctx.mode)
        if mode == Mode.DECODE:
            return 1
        if mode == Mode.TARGET_VERIFY and ctx.query_lens and len(set(ctx.query_lens)) == 1:
            return ctx.query_lens[0]
        return 0  # requests of different lengths: a prefill plan serves them

    def _table(self, ctx: ExecContext, bucket: Optional[int], per: int, groups: frozenset) -> _StepTable:
        """The page table and sequence lengths (and, for requests of different lengths, the query
        offsets) the Triton kernels read: the step's own in an eager step (its real requests),
        copies into static buffers (device to device) in a graph step."""
        if bucket is None:
            reqs = ctx.num_real_seqs
            if per:
                return _StepTable(ctx.page_table[:reqs], ctx.seq_lens[:reqs], per, groups)
            return _StepTable(ctx.page_table[:reqs], ctx.seq_lens[:reqs], 0, groups,
                              ctx.query_start_loc[: reqs + 1], max(ctx.query_lens))
        st, width = self._static, ctx.page_table.shape[1]
        if st["page_table"] is None:  # sized by the first graph step: the graph runner's are all max_pages wide
            st["page_table"] = torch.zeros(st["seq_lens"].shape[0], width, dtype=torch.int32, device=self.device)
        table = st["page_table"]
        if width > table.shape[1]:
            raise ValueError(f"{self.name}: a graph step's page table has {width} columns, the static one "
                             f"{table.shape[1]} (captured graphs read its address): keep max_pages fixed")
        table[:bucket, :width].copy_(ctx.page_table, non_blocking=True)
        st["seq_lens"][:bucket].copy_(ctx.seq_lens, non_blocking=True)
        if per:
            return _StepTable(table[:bucket], st["seq_lens"][:bucket], per, groups)
        # Requests of different lengths: the bucket's T rows are the most any request (or the
        # padding) can own, so the kernel's grid is the bucket's whatever the step's lengths.
        starts = st["query_start_loc"][: bucket + 1]
        starts.copy_(ctx.query_start_loc, non_blocking=True)
        return _StepTable(table[:bucket], st["seq_lens"][:bucket], 0, groups, starts, ctx.num_tokens)

    def _plan_group(self, planned: _Planned, g: _Group, kind: str, meta: PagedMetadata) -> None:
        ps = self.kv_pool.page_size
        if g.kind == "mla":
            # Decode rows see their whole cache: the plain (non-causal) schedule is the same thing.
            planned.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_lens, g.num_q_heads,
                         g.head_dim, g.rope_dim, ps, kind != "decode", g.scale, g.q_dtype, g.kv_dtype)
        elif kind == "decode":
            if g.head_dim != g.head_dim_v:
                raise ValueError(f"FlashInfer decode needs equal q/k and v head dims (got {g.head_dim}, {g.head_dim_v})")
            planned.plan(meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, g.num_q_heads, g.num_kv_heads,
                         g.head_dim, ps, q_data_type=g.q_dtype, kv_data_type=g.kv_dtype, sm_scale=g.scale)
        elif kind == "prefill":
            # seq_lens: the cached + new tokens it would otherwise derive from the indptr into a
            # pageable tensor and copy from there (a copy that waits for the stream first); the same
            # values, from the pinned metadata (its other readers are FlashInfer's cuDNN backend alone).
            planned.plan(meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, g.num_q_heads,
                         g.num_kv_heads, g.head_dim, ps, head_dim_vo=g.head_dim_v, causal=True, sm_scale=g.scale,
                         q_data_type=g.q_dtype, kv_data_type=g.kv_dtype, seq_lens=meta.kv_lens)
        else:  # ragged: this step's k/v are the whole cache of every request
            planned.plan(meta.qo_indptr, meta.qo_indptr, g.num_q_heads, g.num_kv_heads, g.head_dim,
                         head_dim_vo=g.head_dim_v, causal=True, sm_scale=g.scale, q_data_type=g.q_dtype,
                         kv_data_type=g.kv_dtype)

    def _triton_meta(self, meta: PagedMetadata, bucket: Optional[int]) -> tuple:
        host = (meta.kv_indptr, meta.row_req, meta.row_pos)
        if bucket is None:
            indptr, row_req, row_pos = (t.to(self.device, non_blocking=True) for t in host)
            return indptr, meta.kv_indices, row_req, row_pos
        st = self._static
        rows = meta.num_rows
        views = (st["kv_indptr"][: bucket + 1], st["kv_indices"], st["row_req"][:rows], st["row_pos"][:rows])
        for view, value in zip(views, (meta.kv_indptr, meta.kv_indices, meta.row_req, meta.row_pos)):
            view[: value.numel()].copy_(value)
        return views

    # -- hooks -------------------------------------------------------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Allocate the buffers every captured graph reads (decode and target_verify; extend and
        mixed with extend_impl="triton"), sized for the largest bucket: n = max(max_seqs,
        max_tokens) rows (a verify bucket has several rows per request). Real requests own
        distinct pages and the padding requests read page 0 for at most n rows, so num_pages + n
        page indices always fit.
        """
        i32 = dict(dtype=torch.int32, device=self.device)
        n = max(max_seqs, max_tokens)
        self._static = {
            "slots": torch.full((n,), -1, dtype=torch.int64, device=self.device),
            "pad_rows": torch.ones((n, 1, 1), dtype=torch.bool, device=self.device),
            "qo_indptr": torch.arange(n + 1, **i32),  # refilled by each plan (decode: one row per request)
            "kv_indptr": torch.zeros(n + 1, **i32),
            "kv_indices": torch.zeros(self.kv_pool.num_pages + n, **i32),
            "kv_lens": torch.zeros(n, **i32),
            "kv_last_page_len": torch.zeros(n, **i32),
            "row_req": torch.zeros(n, **i32),
            "row_pos": torch.zeros(n, **i32),
            "seq_lens": torch.zeros(n, **i32),  # table steps (decode_impl / mla_decode_impl "triton")
            "query_start_loc": torch.zeros(n + 1, **i32),  # extend and mixed steps (extend_impl "triton")
            "page_table": None,  # [n, width]: allocated by the first table step (its width)
        }
        self._graph.clear()  # wrappers made over older buffers would read stale addresses

    def init_replay_state(self, ctx: ExecContext, bucket: int) -> None:
        """Plan the bucket's fixed-buffer wrappers for this step, before its capture or replay."""
        if self._static is None:
            raise RuntimeError(f"{self.name}: init_replay_state before init_capture_state")
        mode = Mode(ctx.mode)
        if not self._captured(mode, ctx.num_tokens):
            raise ValueError(f"{self.name}: only decode and target_verify steps are captured (capability "
                             f"modes_capturable; extend and mixed with extend_impl='triton', this instance's is "
                             f"{self.extend_impl!r}, or of up to whole_extend_tokens={self.whole_extend_tokens} "
                             f"tokens), not a {mode.value!r} step of {ctx.num_tokens} rows; routing must keep it "
                             f"eager")
        if self._varlen(mode, ctx.num_tokens) and mode in (Mode.EXTEND, Mode.MIXED):
            if ctx.num_seqs != bucket or ctx.num_tokens > self._static["slots"].shape[0]:
                raise ValueError(f"{self.name}: {mode.value} step of {ctx.num_seqs} requests and {ctx.num_tokens} "
                                 f"rows replayed in bucket {bucket} (static buffers hold "
                                 f"{self._static['slots'].shape[0]} rows); the graph runner pads an extend step to "
                                 "its key's requests and rows")
            self._step = self._plan(ctx, bucket)
            return
        per = ctx.num_tokens // bucket if bucket else 0
        uniform = mode == Mode.DECODE and per == 1 or mode == Mode.TARGET_VERIFY and per >= 1 and all(
            n == per for n in ctx.query_lens)
        if (ctx.num_seqs != bucket or not uniform or ctx.num_tokens != bucket * per
                or ctx.num_tokens > self._static["slots"].shape[0]):
            raise ValueError(f"{self.name}: a {mode.value} step of {ctx.num_seqs} requests and {ctx.num_tokens} rows "
                             f"replayed in bucket {bucket} (static buffers hold {self._static['slots'].shape[0]} rows); "
                             "the graph runner pads a decode step to one row per request of its bucket, a target_verify "
                             "step to the same n rows for every request")
        self._step = self._plan(ctx, bucket)

    def replay_state_in_graph(self, mode: Mode) -> bool:
        """A whole-step graph records this backend's replay state where every group runs a Triton
        kernel from the page table (decode_impl / mla_decode_impl "triton"; in extend and mixed steps,
        extend_impl "triton"): _plan then only copies the step's slots, page table and lengths (and
        query offsets) into the static buffers on the device, and the rows per request, or the
        most rows a request can own, are fixed by the bucket. FlashInfer's own plan() works on the
        host: it stays before every replay."""
        mode = Mode(mode)
        if not self._captured(mode):
            return False
        if mode in (Mode.EXTEND, Mode.MIXED):  # a whole-step extend graph: of a size on the varlen kernels
            return True
        return all(self._table_kernel(g) for g in self.groups)

    def init_step_metadata(self, ctx: ExecContext) -> None:
        """Plan every head group for an eager step, once, before the step's first op."""
        self._step = self._plan(ctx, bucket=None)

    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Nothing to add: init_step_metadata planned the whole extend (FlashInfer's prefill plan
        splits long requests into work tiles itself), and the ops must not plan."""
        if self._step is None or self._step.ctx is not ctx:
            raise RuntimeError(f"{self.name}: init_chunk_metadata for a step that init_step_metadata did not plan")

    # -- ops -------------------------------------------------------------------------------

    def _step_for(self, ctx: ExecContext, layer_id: int, kind: str, scale: float) -> tuple[_Group, _StepPlan]:
        step = self._step
        planned_for_ctx = step is not None and (step.ctx is ctx or (
            # A graph runner may capture with its own context object over the same step (and a
            # mixed step replays an extend key's graph).
            step.bucket is not None and ctx.num_seqs == step.bucket
            and _graph_mode(ctx.mode) == _graph_mode(step.ctx.mode)))
        if not planned_for_ctx:
            raise RuntimeError(f"{self.name}: layer {layer_id} ran in a step that was not planned; call "
                               "init_step_metadata(ctx) (or init_replay_state(ctx, bucket) for a graph) first")
        try:
            g = self.layers[layer_id]
        except KeyError:
            raise KeyError(f"{self.name} has no full layer {layer_id} (layers: {sorted(self.layers)})") from None
        if g.kind != kind:
            raise ValueError(f"layer {layer_id} is a {g.kind} layer, called through {kind}_attention")
        if not math.isclose(scale, g.scale, rel_tol=1e-6):
            raise ValueError(f"layer {layer_id}: the op's scale {scale} differs from the planned {g.scale}; "
                             "pass it in FlashInferAttentionBackend(scales=...)")
        return g, step

    @staticmethod
    def _zero_padding(step: _StepPlan, out: torch.Tensor, g: _Group) -> None:
        if step.bucket is not None:
            # The real row count changes between replays: mask on the device (rows with slot -1).
            # A table kernel ran over every row of the bucket and wrote zeros on its padding
            # rows, and a graph whose rows are all one request's (pad_rows None) has none: either
            # way no mask is recorded, one kernel fewer per attention layer.
            if step.pad_rows is not None and not (step.table is not None and g in step.table.groups):
                out.masked_fill_(step.pad_rows, 0)
        elif step.num_rows < out.shape[0]:
            out[step.num_rows:].zero_()

    def gqa_attention(self, ctx, q, k, v, out, layer_id, scale):
        g, step = self._step_for(ctx, layer_id, "gqa", scale)
        assert q.shape[1] == g.num_q_heads and k.shape[1] == g.num_kv_heads, (
            f"layer {layer_id}: q/k heads {q.shape[1]}/{k.shape[1]}, planned {g.num_q_heads}/{g.num_kv_heads}")
        cache = self.kv_pool.layer(layer_id)
        kc, vc = cache["k"], cache["v"]
        store_kv_rows(step.slots, ctx.page_size, (k, kc), (v, vc))
        n = step.num_rows
        target = out[:n] if out.is_contiguous() else torch.empty_like(out[:n])
        if step.table is not None and g in step.table.groups and not step.table.rows_per_req:
            from runtime.backends.kernels.gqa import triton_gqa_attention_varlen
            t = step.table
            triton_gqa_attention_varlen(q[:n], kc, vc, t.page_table, t.seq_lens, t.query_start_loc, target, g.scale,
                                        max_rows=t.max_rows, fixed_splits=self.fixed_splits)
        elif step.table is not None and g in step.table.groups:
            from runtime.backends.kernels.gqa import triton_gqa_attention
            t = step.table
            triton_gqa_attention(q[:n], kc, vc, t.page_table, t.seq_lens, t.rows_per_req, target, g.scale,
                                 fixed_splits=self.fixed_splits)
        elif step.kind == "ragged":
            step.wrappers[g].run(q[:n], k[:n], v[:n], out=target)
        else:
            step.wrappers[g].run(q[:n], (kc, vc), out=target)
        if target.data_ptr() != out.data_ptr():
            out[:n].copy_(target)
        self._zero_padding(step, out, g)

    def mla_attention(self, ctx, q_latent, q_rope, kv_latent, k_rope, out, layer_id, scale):
        g, step = self._step_for(ctx, layer_id, "mla", scale)
        R = g.head_dim
        assert kv_latent.shape[-1] == R and k_rope.shape[-1] == g.rope_dim, (
            f"layer {layer_id}: latent/rope dims {kv_latent.shape[-1]}/{k_rope.shape[-1]}, planned {R}/{g.rope_dim}")
        latent = self.kv_pool.layer(layer_id)["latent"]
        ckv, kpe = latent[..., :R], latent[..., R:]  # strided views into [pages, page_size, R+P]
        store_kv_rows(step.slots, ctx.page_size, (kv_latent, ckv), (k_rope, kpe))
        n = step.num_rows
        target = out[:n] if out.is_contiguous() else torch.empty_like(out[:n])
        if step.table is not None and g in step.table.groups and not step.table.rows_per_req:
            from runtime.backends.kernels.mla import triton_mla_attention_varlen
            t = step.table
            triton_mla_attention_varlen(q_latent[:n], q_rope[:n], ckv, kpe, t.page_table, t.seq_lens,
                                        t.query_start_loc, target, g.scale, fixed_splits=self.fixed_splits)
        elif step.table is not None and g in step.table.groups:
            from runtime.backends.kernels.mla import triton_mla_attention_paged
            t = step.table
            triton_mla_attention_paged(q_latent[:n], q_rope[:n], ckv, kpe, t.page_table, t.seq_lens, t.rows_per_req,
                                       target, g.scale, fixed_splits=self.fixed_splits)
        elif self.mla_impl == "triton":
            from runtime.backends.kernels.mla import triton_mla_attention
            kv_indptr, kv_indices, row_req, row_pos = step.triton_meta
            triton_mla_attention(q_latent[:n], q_rope[:n], ckv, kpe, kv_indptr, kv_indices, row_req[:n],
                                 row_pos[:n], target, g.scale, fixed_splits=self.fixed_splits)
        else:
            step.wrappers[g].run(q_latent[:n], q_rope[:n], ckv, kpe, out=target)
        if target.data_ptr() != out.data_ptr():
            out[:n].copy_(target)
        self._zero_padding(step, out, g)
