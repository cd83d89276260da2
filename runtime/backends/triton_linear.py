"""TritonLinearBackend: the linear-attention ops of every step mode on the GPU, in place on the state pool.

It serves hgc.gdn_core, hgc.kda_core, hgc.lightning_core, hgc.short_conv and hgc.gdn_fused (a
whole GDN mixer: one launch a decode step, runtime/backends/kernels/gdn_fused.py; in the other
modes the conv and gdn_core paths below around its l2norm-and-gates and gated-norm kernels) in all
four modes:

- DECODE (one token per request, T == B rows): our Triton decode kernels (triton_linear.py), one
  launch per op, slot ids read on the device, no gather or scatter. Capturable.
- TARGET_VERIFY (every request carries the same n tokens, rows of request b are b*n .. b*n+n-1):
  one launch per op (triton_linear.recurrent_verify / short_conv_verify): a program loads its
  tile of the request's state once, runs the n tokens through it in order, each as the decode
  kernel runs it, writes the state after token t < n-1 straight into entry t of the request's row
  of the state pool's intermediate states (speculative decoding keeps the state of the last
  accepted token: runtime/cache/state_pool.py `keep_verified`) and the state after the last token into
  the slot. The grid comes from shapes only and slot ids from the static buffer, so this is
  capturable too. (Run as n decode launches with a gather and a copy of the state after each, a
  bench qwen3_next verify step at batch 1 took 380 kernels against decode's 222: BENCHMARKS.md,
  "Sixth run".) A step whose rows are
  not laid out that way runs the extend path below (eager only; refused inside a replayed step),
  which keeps no intermediate states: speculative decoding always verifies D + 1 tokens per
  request (runtime/engine/speculative.py).
- EXTEND and MIXED: linear cores of GDN and Lightning layers: our chunk kernels
  (triton_chunk.chunk_extend, `chunk_impl="triton"`, the routing default: three launches a layer,
  two for Lightning, over the step's real requests as one varlen batch, states read from and
  written to their slots in place, no gather or scatter; decode rows of a mixed step are requests
  of length 1). KDA's, and every layer's with `chunk_impl="fla"`: FLA's chunk kernels
  (chunk_gated_delta_rule, chunk_kda, chunk_simple_gla with g_gamma = decay), initial states
  gathered from the pool by slot, final states scattered back to the same slots. Both take the
  chunk table the step's plan made on the host. Ours and the extend conv are capturable (the
  capability's `op_capture`): a replayed step reads the tables from the static extend plan
  init_replay_state fills, padded to the bucket (_StaticExtendPlan); FLA's are not (its Python
  plans on the host), so KDA and `chunk_impl=fla` stay eager gaps of the larger steps (KDA's are
  captured at every size under `kda_graph=on`, FLA 0.6's graph form of chunk_kda). GDN's with
  `chunk_impl="flashinfer"`: FlashInfer's SM90 prefill kernel (kernels/flashinfer_gdn.py, one
  launch over the step's requests, their states gathered by slot into its layout and put back) in
  steps of more than `flashinfer_past` tokens, eagerly: a bucket holds empty request rows, which
  FlashInfer's kernel is not written for and whose states the route would gather too, so a captured
  bucket (of at most flashinfer_past tokens) runs our chunk kernels, as an eager step of as many
  tokens does. With
  `short_extend_tokens` set, a step of such an op whose requests each bring at most that many
  tokens (a prefix-cache hit's tail, a short prompt) runs the recurrent cores through our
  short-extend kernel instead (triton_linear.recurrent_extend: one launch a layer, each request's
  tokens in order, the padding rows zeroed by the same launch). That kernel reads the static
  plan's tables too, so a bucket of at most short_extend_tokens rows, which holds no longer
  request, may capture it: the capability declares that capture bounded by the option, the split
  keeps the op a gap and records the bound, and the extend buckets up to it are whole-step
  graphs (Kimi's KDA beside MLA's bounded capture). The short conv: our Triton
  extend kernel (triton_linear.short_conv_extend), one launch over every request's tokens, reading
  each request's history from its slot and writing the new one back. Padded rows of `out` are zeroed
  and the padding slot is neither read nor written.

In-step snapshots (the prefix cache's, docs/DESIGN.md "The prefix cache's snapshots"): built
with the cache's SnapshotPool, the chunk kernels and the extend conv also write a request's state
after its snapshot row of the step into the pool, reading the step's snapshot tables from the
plan (the staged ones in a replayed step). `writes_step_snapshots` says yes only where no extend
step of this instance's ops reaches FLA's kernels, which cannot.

Plan once per step, launch lean. Everything these paths derive from the step alone is made by
the step's hooks and shared by every layer: slot ids on the device and the target-verify row
layout (init_step_metadata / init_replay_state), and for a step on the extend path the kept
requests, their slots, cu_seqlens on host and device, the chunk indices (FLA's and our chunk
kernels' one table) and the conv kernel's token-block table
(init_chunk_metadata, host tables built with numpy and copied in one transfer). An op call then
does constant host work: shape checks and its launches, no loop over requests, no host-to-device
copy, no device read. FLA is handed the plan's chunk indices where
its entry point takes them; elsewhere it derives them from cu_seqlens_cpu once per step, through
its cache keyed by tensor identity, which every layer's call hits after the first.

FLA is imported on the first extend call. Without it an extend fails with FLANotInstalled saying
what to install; there is no fallback to the slow reference (a silent 100x slowdown is a bug
report nobody can read). The FLA entry points are looked up through `fla_ops()` so CPU tests can
stand a reference in for them and check the gather / cu_seqlens / scatter plumbing.

Lifecycle (runtime/backends/protocol.py):

1. `TritonLinearBackend(state_pool)`: kernels read and write the pool's "recurrent" and "conv"
   tensors of each layer directly, by slot id.
2. `init_capture_state(max_tokens, max_seqs)`: one static slot-id buffer [max_seqs] int64 on the
   pool's device; captured kernels read slot ids from it. Where extend steps are captured, the
   static extend plan too (its tables for the largest bucket).
3. `init_replay_state(ctx, bucket)`: copies the step's slot ids into that buffer (before capture
   and before every replay), and for an extend or mixed step its padded tables into the static
   extend plan. `init_step_metadata(ctx)`: an eager step's plan (slot ids on the
   device, the verify layout). `init_chunk_metadata(ctx, chunk_size)`: the extend plan above,
   once per step, when the step takes the extend path.
4. Each op method checks shapes on the host (never reads the device in decode / target_verify).

The kernels module (and with it triton) is imported on first use (a step's plan or an op call),
never at import: the compiler imports this module on a CPU machine to read `capability`, and the
CPU tests must be able to switch Triton to its interpreter before the kernels are defined.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import math
import types

import numpy as np
import torch

from compiler.splitops import MODES, BackendCapability, ChoiceScope, LayerKind, Mode, OpCapture
from runtime.backends.kernels.launch_math import cdiv, token_blocks
from runtime.backends.protocol import BackendHooks, BackendSetup
from runtime.step.context import ExecContext
from runtime.step.host_copy import tensor_to_device
from runtime.cache.state_pool import PADDING_SLOT, StatePool

__all__ = ["TritonLinearBackend", "WrongModeError", "FLANotInstalled", "fla_ops"]


class WrongModeError(RuntimeError):
    """A linear op reached this backend in a step it cannot run that way (for example a ragged
    target-verify step inside a replayed graph)."""


class FLANotInstalled(RuntimeError):
    """An extend or mixed step needs FLA's chunk kernels and fla-core is not importable."""


# The kernel modules, imported on first use (they import triton, which the CPU tests' conftest
# must configure first) and kept: import_module on every op call was about 3 us each, four to six
# a fused GDN layer's eager extend.
@functools.cache
def _kernels():
    return importlib.import_module("runtime.backends.kernels.linear")


@functools.cache
def _chunk_kernels():
    return importlib.import_module("runtime.backends.kernels.chunk")


@functools.cache
def _fused_kernels():
    return importlib.import_module("runtime.backends.kernels.gdn_fused")


@functools.cache
def _flashinfer_kernels():
    return importlib.import_module("runtime.backends.kernels.flashinfer_gdn")


def _gdn_heads(call) -> tuple[int, int, int, int]:
    """(key heads, value heads, Dk, Dv) of a gdn_core or gdn_fused node's CallFacts."""
    if call.op == "gdn_core":
        _, hk, dk = call.shapes["q"]
        _, hv, dv = call.shapes["v"]
        return hk, hv, dk, dv
    _, hv, dv = call.shapes["out"]
    hk = int(call.scalars["k_heads"])
    return hk, hv, (call.shapes["qkv"][1] - hv * dv) // (2 * hk), dv


def _extend_tables():
    return importlib.import_module("runtime.backends.kernels.extend_tables")


def fla_ops(gdn_entry: str = "forward") -> types.SimpleNamespace:
    """FLA's three chunk entry points (keyword calls only: positional orders differ between them).

    gdn_entry: "forward" (FLA's gated-delta-rule forward below its public entry, where this FLA has
    one: `_gdn_forward`) or "public" (its public entry; benchmarks/kernels/gpu_linear_extend.py times both)."""
    if gdn_entry not in ("forward", "public"):
        raise ValueError(f"fla_ops: gdn_entry must be 'forward' or 'public', not {gdn_entry!r}")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        missing = getattr(e, "name", None) or str(e)
        hint = ("fla-core imports einops; install it (pip install einops)" if missing == "einops" else
                "install the gpu extra (pip install 'hgc[gpu]', which brings fla-core 0.6)")
        raise FLANotInstalled(
            f"triton_linear: extend, mixed and ragged target-verify steps of linear layers run FLA's chunk "
            f"kernels, and importing them failed ({type(e).__name__}: {e}); {hint}. There is no fallback to "
            f"the CPU reference on purpose.") from e
    gdn = (_gdn_forward() if gdn_entry == "forward" else None) or chunk_gated_delta_rule
    return types.SimpleNamespace(gdn=gdn, kda=chunk_kda,
                                 simple_gla=_simple_gla_taking_chunk_indices() or chunk_simple_gla)


def _gdn_forward():
    """FLA's gated-delta-rule forward, called below its public entry, or None where FLA has none.

    Per layer of an extend step, FLA 0.6's public `chunk_gated_delta_rule` runs a dynamo-disable
    wrapper, its backend dispatch, argument checks, an autograd Function with its input guard
    (contiguous copies, a device context) and autocast wrapper, around `chunk_gated_delta_rule_fwd`:
    host time of a layer whose kernels take a tenth of it (BENCHMARKS.md, the linear extend
    section). For what this backend asks (no in-kernel l2norm, beta sigmoid or gate, chunks of 64,
    the state laid out [K, V]) the forward computes the same result; the inputs are made contiguous
    here as the guard did, and the output cast to q's dtype as the Function did."""
    try:
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    except ImportError:
        return None
    wanted = {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
              "chunk_indices", "state_v_first", "chunk_size"}
    if not wanted <= set(inspect.signature(chunk_gated_delta_rule_fwd).parameters):
        return None

    def gdn(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, chunk_indices,
            use_qk_l2norm_in_kernel=False):
        del cu_seqlens_cpu  # the chunk indices are what FLA would have built from it
        if use_qk_l2norm_in_kernel:
            raise ValueError("triton_linear: the GDN forward is called without FLA's in-kernel l2norm")
        # FLA 0.6 returns (g cumsum, o, A, final state, initial state, gate input)
        _, o, _, final_state, _, _ = chunk_gated_delta_rule_fwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
            scale=scale, initial_state=initial_state.contiguous(), output_final_state=output_final_state,
            state_v_first=False, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, chunk_size=FLA_CHUNK)
        return o.to(q.dtype), final_state
    return gdn


@functools.lru_cache(maxsize=8)
def _takes_graph_form(kda) -> bool:
    """Whether FLA's chunk_kda (or a stand-in) names `use_graph`: FLA 0.6's form for graph capture."""
    return "use_graph" in inspect.signature(kda).parameters


def _simple_gla_taking_chunk_indices():
    """FLA's simple-GLA forward that takes the plan's chunk indices, or None where FLA has none.

    FLA 0.6's public `chunk_simple_gla` takes no `chunk_indices` and builds them on every call
    from cu_seqlens_cpu with torch's CPU repeat_interleave, which cost 0.04 to 15 ms a call on
    the GPU machine (BENCHMARKS.md, extend host cost). Its forward, `chunk_simple_gla_fwd`, takes
    them; the public entry's only other work for a constant decay is the base-2 rescale of
    g_gamma and making the inputs contiguous, done here the same way. Without that forward (a
    future FLA), the public entry computes the same result, slower."""
    try:
        from fla.ops.simple_gla.chunk import chunk_simple_gla_fwd
        from fla.ops.utils.constant import RCP_LN2
    except ImportError:
        return None
    if "chunk_indices" not in inspect.signature(chunk_simple_gla_fwd).parameters:
        return None

    def simple_gla(q, k, v, g_gamma, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                   chunk_indices):
        del cu_seqlens_cpu  # the chunk indices are what FLA would have built from it
        return chunk_simple_gla_fwd(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=None,
                                    g_gamma=g_gamma * RCP_LN2, scale=scale, initial_state=initial_state.contiguous(),
                                    output_final_state=output_final_state, state_v_first=False,
                                    cu_seqlens=cu_seqlens, chunk_size=FLA_CHUNK, chunk_indices=chunk_indices)
    return simple_gla


FLA_CHUNK = 64  # FLA's chunk length: its entry points' default, which this backend never overrides


@dataclasses.dataclass
class _ExtendPlan:
    """What every layer of one eager extend / mixed / ragged verify step shares, made once per step
    from the step's host lengths and copied to the device in one transfer."""

    num_tokens: int | None  # real rows (the first rows of the step); None in a captured step's static plan
    slots: torch.Tensor  # [R] int64 on the pool's device: the R requests with tokens this step
    cu_seqlens: torch.Tensor  # [R+1] int64 on the device
    cu_seqlens_cpu: torch.Tensor  # [R+1] int64 on the host (FLA plans its chunks from it, no sync)
    # [chunks, 2] int64 on the device: (request, chunk) in FLA's layout; a captured step's lists the
    # padding rows' chunks too, as request R (its bounds are padded_bounds)
    chunk_indices: torch.Tensor
    padded_bounds: torch.Tensor  # [R+2] int64 on the device: cu_seqlens, then num_rows (request R: the padding rows)
    conv_blocks: torch.Tensor  # [NB, 2] int64 on the device: (request, token block) of the extend conv
    longest: int  # the most tokens one request brings this step (which recurrent path it takes)
    # In-step snapshots (ExecContext.snapshot_rows / snapshot_ids) of the plan's requests, on the
    # device; None: the step has none to write (kernels.linear.StepSnapshots says how they are read)
    snap_rows: torch.Tensor | None = None
    snap_ids: torch.Tensor | None = None
    # The static plan of a captured step (_StaticExtendPlan): tables padded to the bucket at fixed
    # addresses, every launch's grid fixed by the bucket; num_tokens, cu_seqlens_cpu and longest
    # are then not the launches' to read.
    captured: bool = False


@dataclasses.dataclass
class _StepPlan:
    """What every layer of one step shares: made by the step's hooks, read by every op call."""

    ctx: ExecContext
    slots: torch.Tensor  # [B] int64 on the pool's device (in a replayed step: the static buffer)
    replayed: bool  # init_replay_state made it: ops run inside a captured graph
    verify_width: int | None  # target_verify with request b on rows b*n .. b*n+n-1: that n
    extend: _ExtendPlan | None = None  # made for steps that take the extend path
    # A piecewise step whose eager gaps hold some of this instance's ops (KDA beside a captured
    # conv): the eager plan made before init_replay_state, which those ops keep reading.
    eager_extend: _ExtendPlan | None = None


def _to_device_at_once(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """int64 host tensors -> views of one device buffer, made by one copy. Each part starts 16 bytes
    aligned and the first at the buffer's start, so a kernel taking one of them (ours, FLA's) sees
    the same pointer alignment every step and Triton never specializes it anew mid-serving."""
    flat, spans, at = [], [], 0
    for t in parts:
        flat.append(t.flatten())
        spans.append((at, t.shape))
        at += t.numel()
        if at % 2:
            flat.append(torch.zeros(1, dtype=torch.int64))
            at += 1
    buf = tensor_to_device(torch.cat(flat), device)  # from pinned memory: a pageable copy waits for the stream
    return [buf[a:a + math.prod(shape)].view(shape) for a, shape in spans]


class _StaticExtendPlan:
    """The extend path's tables for captured extend and mixed steps, in one static device buffer.

    A captured graph keeps its launches' grids and pointers, so a step of bucket (T rows, B
    requests) gets tables of fixed shapes at fixed addresses, refilled before each replay (one copy):

    - slots [B+1]: the backend's static slot ids (the step's, padding requests on the padding
      slot), then one more request that is always empty, on the padding slot;
    - bounds [B+3]: cu_seqlens of the B+1 requests (padding requests and the extra one empty:
      their programs do nothing), then T: request B+1 is the padding rows, which the chunk
      kernels' output kernel and the conv kernel write as zeros (so no launch fills `out`);
    - chunks [T/64 + B, 2]: every request's (request, chunk) rows and the padding rows', then rows
      naming the empty request (their programs store nothing); T/64 + B is the most a step of the
      bucket can have: B + 1 requests with rows, each a partial chunk at most beyond T/64 whole ones;
    - conv blocks [T/32 + B + 1, 2]: the same in the conv's blocks of 32 rows.

    The short-extend kernel reads the slots and bounds alone: B + 1 requests and the padding rows
    as one more, which it writes as zeros.

    An eager step's chunk table is FLA's too, which knows no padding request: its padding rows
    are zeroed after the chunk kernels."""

    def __init__(self, max_tokens: int, max_seqs: int, device: torch.device):
        self.max_tokens, self.max_seqs = max_tokens, max_seqs
        self.buf = torch.zeros(self._size(max_tokens, max_seqs), dtype=torch.int64, device=torch.device(device))

    @staticmethod
    def _rows(tokens: int, seqs: int) -> tuple[int, int]:
        """(chunk rows, conv block rows) of a bucket's tables."""
        return cdiv(tokens, FLA_CHUNK) + seqs, cdiv(tokens, _kernels().CONV_EXTEND_BLOCK_T) + seqs + 1

    @classmethod
    @functools.lru_cache(maxsize=None)
    def _layout(cls, tokens: int, seqs: int) -> list[tuple[int, tuple[int, ...]]]:
        """(offset, shape) of bounds, chunks and conv blocks; 16-byte aligned."""
        chunks, blocks = cls._rows(tokens, seqs)
        spans, at = [], 0
        for shape in ((seqs + 3,), (chunks, 2), (blocks, 2)):
            spans.append((at, shape))
            at += math.prod(shape) + math.prod(shape) % 2
        return spans

    @classmethod
    def _size(cls, tokens: int, seqs: int) -> int:
        at, shape = cls._layout(tokens, seqs)[-1]
        return at + math.prod(shape)

    def fill(self, ctx: ExecContext, slots: torch.Tensor) -> _ExtendPlan:
        """This step's tables (one launch on the device from the step's staged query offsets:
        kernels/extend_tables.py, which says why) and the plan of views the ops launch over.
        slots: the backend's static slot ids, the step's already copied into the first B. Reads
        nothing on the host but the bucket's shape, so a whole-step graph records it."""
        T, B = ctx.num_tokens, ctx.num_seqs
        if T > self.max_tokens or B > self.max_seqs:
            raise RuntimeError(f"triton_linear: a captured extend step of {T} rows and {B} requests; the static "
                               f"plan holds {self.max_tokens} and {self.max_seqs}")
        layout = self._layout(T, B)
        # also the padding slot as request B's (a larger bucket's step may have left a slot id there)
        _extend_tables().fill_extend_tables(ctx.query_start_loc, self.buf, slots, T, B, layout, FLA_CHUNK,
                                            _kernels().CONV_EXTEND_BLOCK_T)
        bounds, chunks, blocks = [self.buf[at:at + math.prod(shape)].view(shape) for at, shape in layout]
        # the snapshot tables are the staged step's own (static per key); the extra request B has no rows
        return _ExtendPlan(None, slots[:B + 1], bounds[:B + 2], None, chunks, bounds, blocks, 0,
                           ctx.snapshot_rows, ctx.snapshot_ids, captured=True)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream (never on the CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _in_dtype_of(v: torch.Tensor, *tensors: torch.Tensor) -> tuple:
    """q and k in v's dtype for FLA's chunk kernels, which tl.dot them with v-sized tiles and refuse
    a mix. Kimi keeps q, k in float32 after its l2norm (as transformers does); FLA's own in-kernel
    l2norm would hand them on in the input dtype, which is what they get here."""
    return tuple(t.to(v.dtype) for t in tensors)


# The short-extend limits routing offers, the first the default. 64: on an H200 the recurrent
# kernel's step beat FLA's chunk path 3.3x to 12.9x at every measured short step (8 to 64 tokens a
# request, 1 to 16 requests; benchmarks/kernels/gpu_linear_extend.py, BENCHMARKS.md), FLA's Python entry
# costing about 1 ms a layer against some 0.1 ms of kernels. Longer requests were not timed there,
# and the recurrent kernel's time grows with a request's tokens one after another, so they keep
# FLA's chunk kernels. "0": FLA always. It applies to the ops whose extend steps are not captured at
# every size (KDA, and GDN or Lightning with chunk_impl=fla), and bounds their capture: a bucket of
# at most that many tokens runs the kernel in its graph as its eager step does, larger ones hold the
# op in an eager gap. An op captured in extend at every size runs the chunk kernels
# eagerly too, so an eager step computes what the replayed graph of the same step does (a recurrent
# and a chunked kernel round differently, and a random-weight bench model carried that to 27% of its
# logits, benchmarks/serving/gpu_e2e.py's graph-against-eager tokens: BENCHMARKS.md).
SHORT_EXTEND_CHOICES = ("64", "0", "16", "32", "128")

# Which chunk kernels run the extend steps of GDN and Lightning layers (past the short-extend
# limit), the first the default: "triton", ours (runtime/backends/kernels/chunk.py: three launches a
# layer through the Launcher, no gather or scatter); "fla", FLA's (whose Python launch path costs
# about half a millisecond of host time a layer; its kernels alone were faster for one long request,
# 0.17 against 0.29 ms a layer at 2048 tokens, until ours stored their intermediates in 16 bits:
# 0.155 against 0.174 since, chunk.py's docstring). Ours is the default: whole extend steps of bench qwen3_next
# (9 GDN layers) were 1.07x to 2.61x faster with them than with FLA's at 512 and 2048 tokens over
# 1, 4 and 16 requests, and of bench bailing_linear (6 Lightning layers) 1.0x to 1.83x (BENCHMARKS.md,
# "GDN extend steps on our chunk kernels"). KDA's per-channel gates run FLA's whatever the choice,
# and the short convolution has no chunk kernels: they take the default with GDN, so the ops of one
# layer resolve alike and share one backend instance.
# "flashinfer": GDN layers' steps of more than flashinfer_past tokens on FlashInfer's SM90 prefill
# kernel (kernels/flashinfer_gdn.py), shorter ones on ours; GDN only (the kernel is the delta rule's),
# bf16, head dim 128, more value heads than key heads. Not the default: its kernel beat our three
# (1770 against 2829 us of a 4096-token step of bench qwen3_next, 9 layers, H100), but its steps are
# piecewise, and the card sat idle while the host ran the gap-only backends' plans right after a
# short first piece: whole steps 6.246 / 8.821 / 15.675 ms against 4.427 / 7.640 / 14.491 at 1024 /
# 2048 / 4096 tokens (benchmarks/results/step_account_flashinfer_ab_h100_2026-12-06.md; the unfused
# route on the core alone, step_account_flashinfer_core_ab_h100_2026-12-06.md, traced it). With those
# plans at their backend's first op and the gaps on the static tables (plan_gap_step), one warm H100:
# 6.103 / 7.970 / 13.986 ms against 4.385 / 7.574 / 14.737, under the default at 4096 tokens only; up
# to 2048 the card waits on the gaps' host, about 0.55 ms a layer
# (step_account_flashinfer_gap_tables_ab_h100_2026-12-06.md).
CHUNK_IMPL_CHOICES = ("triton", "fla", "flashinfer")
# flashinfer_past: the most tokens of a step that chunk_impl="flashinfer" leaves to our chunk kernels,
# and so the largest extend bucket that captures the GDN ops (the route runs in eager gaps). 512, the
# default: FlashInfer's kernel and its copies against ours on an H100 at bench qwen3_next's dims
# (benchmarks/probes/gdn_prefill_probe.py, one call): 59.0 against 52.1 us at one request of 512
# tokens, 128.9 against 170.0 at 2048, 219.2 against 315.6 at 4096, 120.4 against 292.8 at 4 x 1024
# (its time is about 35 + 0.046 us a token for one request, ours 8 + 0.075: even near 930 tokens).
FLASHINFER_PAST = ("512", "256", "1024", "2048")
# kda_graph: whether KDA's extend steps past the short-extend limit call FLA's chunk_kda in its form
# for graph capture ("on": `use_graph=True`, the chunk table built on the device at a fixed size from
# cu_seqlens padded with empty requests), so a bucket captures KDA at every size as it captures our
# chunk kernels, or in its plain form in the eager gaps ("off", the default). Kimi's prompt steps past
# 64 tokens spend most of their time on the host in those gaps; the graph form costs a state gather
# and write-back for every request row of the bucket, padding ones too (docs/DESIGN.md, "Past 64
# tokens a KDA layer is an eager gap"). Steps of at most short_extend_tokens rows (a bucket's, or an
# eager step's real rows) keep the short-extend kernel under "on" as under "off". Measured on an
# H100 (bench kimi_linear, one call each), "on" against "off", in one-request buckets: 4.387 against
# 7.478 ms at 512 tokens, 22.643 against 23.892 at 4096 (step_account_kda_graph_ab_h100_2026-12-06.md,
# before the rule); in a served artifact's buckets (256 request rows past 128 tokens), with the
# rule: 2.067 against 2.055 ms at 64 tokens, 2.861 against 7.143 at 128 (a one-request key), but
# 14.099 against 7.620 at 512 and 32.104 against 23.544 at 4096, every request row's state gathered,
# handed through FLA and written back (step_account_kda_graph_served_ab_h100_2026-12-06.md). Off: a
# served artifact's long prompts would pay that.
KDA_GRAPH = ("off", "on")
# decode_tiles: the decode and verify kernels' tiles "by_batch" (the default), "fixed" or "walk" (the
# capability's comment).
DECODE_TILES = ("by_batch", "fixed", "walk")
# split_decode: the fused GDN mixer's split decode (one request) in "one_launch" (the default;
# kernels/gdn_fused.py `_split_one_kernel`: the second launch's programs do the first's conv and
# l2norm for what they read) or "two_launches". Why one launch: on an H100, in one call, the nine
# layers' split took 68.8 us of a batch-1 step against 65.3 in two launches, and the step's time
# outside its kernels about 1 us a launch (9 fewer;
# benchmarks/results/step_account_in_experts_folds_ab_h100_2026-12-07.md). "one_launch_early": the
# one launch with its value head's gates loaded before the key head's conv counter
# (gdn_fused_decode's early_gates), the same values; not the default until it times faster.
SPLIT_DECODE = ("one_launch", "two_launches", "one_launch_early")
# extend_norm: where a fused GDN mixer's extend step applies its gated RMSNorm on our chunk kernels,
# "apart" (the default: kernels/gdn_fused.py `gated_rmsnorm`, one launch after the core) or
# "in_output" (the chunk output kernel normalises each row's head as it stores it: kernels/chunk.py
# `chunk_extend`, kernels/linear.py `GatedNorm`; one launch a layer fewer, and the core's write and
# read gone: at bench qwen3_next's 4096 tokens about 67 MB a layer). Its programs then take a head's whole Dv row,
# where the default tile takes half of bench's 128 columns. Not the default until a whole step
# times it faster. Steps on FLA's or FlashInfer's kernels, or on the short-extend kernel, keep the
# norm apart whatever this says.
EXTEND_NORM = ("apart", "in_output")
# qk_gates: where a fused GDN mixer's steps on its unfused kernels (extend and mixed steps, and
# decode steps of more than kernels/gdn_fused.py ONE_LAUNCH_MAX_ROWS requests) compute its q / k
# l2norm and gates: "apart" (the default: gdn_fused.py `qk_gates`, one launch after the conv) or
# "in_conv" (the conv normalises each q and k head and its first channel tile computes the gates as
# it stores its rows: kernels/linear.py `ConvQk`; one launch a layer fewer, and q and k's write and
# read as the conv's outputs gone: at bench qwen3_next's 4096 tokens about 67 MB a layer, where
# qk_gates took 19.4 us a layer on an H200, and 2.3 us a layer at a decode of 128 requests; the
# account of 89a83fb's bfloat16 states, benchmarks/results/step_account_state_dtype_h200_2026-12-06.md
# and its raw JSON). Where
# the conv's channel tile would split a key head (a short extend's narrow tiles: conv_qk_fits) and
# in verify steps they stay apart. Not the default until a whole step times it faster.
QK_GATES = ("apart", "in_conv")
# decode_norm: where a fused GDN mixer's decode steps on its unfused kernels (more than
# kernels/gdn_fused.py ONE_LAUNCH_MAX_ROWS requests) apply its gated RMSNorm: "apart" (the default:
# gdn_fused.py `gated_rmsnorm`, one launch after the recurrence) or "in_recurrence" (the decode
# recurrence normalises each head's row as it stores it, its programs a head's whole Dv row on
# kernels/linear.py `whole_row_config`'s tile in place of `recurrent_config`'s: one launch a layer
# fewer: the norm's kernel took 3.7 us a layer at a decode of 128 requests on an H200, the same
# account). Decode tiles pinned, fixed or
# walked keep the norm apart. Not the default until a whole step times it faster.
DECODE_NORM = ("apart", "in_recurrence")


class TritonLinearBackend(BackendHooks):
    name = "triton_linear"
    supported_ops = frozenset({"gdn_core", "kda_core", "lightning_core", "short_conv", "gdn_fused"})
    # Every mode, so routing can bind these ops here on "cuda". Captured: decode (one decode-kernel
    # launch per op) and target_verify (one verify-kernel launch per op, shapes fixed per bucket);
    # extend and mixed steps of the ops our own kernels run (GDN and Lightning on our chunk
    # kernels, the short conv), whose tables a captured step reads from static buffers padded to
    # the bucket (_StaticExtendPlan). KDA, and chunk_impl=fla, call FLA's Python entry, which plans
    # on the host: eager, except in steps of up to short_extend_tokens tokens (our recurrent kernel).
    capability = BackendCapability(
        name="triton_linear", device="cuda", ops=supported_ops,
        modes_supported=frozenset(MODES), modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}),
        op_capture=(
            OpCapture("gdn_core", frozenset({Mode.EXTEND, Mode.MIXED}), when=(("chunk_impl", "triton"),),
                      why="our chunk kernels over the bucket's static tables"),
            OpCapture("gdn_fused", frozenset({Mode.EXTEND, Mode.MIXED}), when=(("chunk_impl", "triton"),),
                      why="the extend conv and our chunk kernels over the bucket's static tables"),
            OpCapture("lightning_core", frozenset({Mode.EXTEND, Mode.MIXED}), when=(("chunk_impl", "triton"),),
                      why="our chunk kernels over the bucket's static tables"),
            OpCapture("short_conv", frozenset({Mode.EXTEND, Mode.MIXED}),
                      why="our extend conv over the bucket's static tables"),
            OpCapture("kda_core", frozenset({Mode.EXTEND, Mode.MIXED}), when=(("kda_graph", "on"),),
                      why="FLA's chunk_kda in its graph form over the bucket's static tables"),
            # chunk_impl=flashinfer: buckets of up to flashinfer_past tokens on our chunk kernels (and
            # the extend conv); larger steps hold the op in an eager gap, on FlashInfer's kernel.
            *(OpCapture(op, frozenset({Mode.EXTEND, Mode.MIXED}), when=(("chunk_impl", "flashinfer"),),
                        up_to="flashinfer_past",
                        why="steps of up to flashinfer_past tokens on our chunk kernels over the bucket's "
                            "static tables (FlashInfer's kernel past them, in eager gaps)")
              for op in ("gdn_core", "gdn_fused")),
            # The recurrent cores that no entry above captures (KDA, or chunk_impl=fla): a bucket of
            # at most short_extend_tokens rows holds no longer request, so its steps, eager or
            # replayed, run the short-extend kernel, which reads its requests, bounds and slots from
            # the bucket's static tables; larger steps stay in the eager gap (FLA's chunk kernels).
            *(OpCapture(op, frozenset({Mode.EXTEND, Mode.MIXED}), up_to="short_extend_tokens",
                        why="steps of up to short_extend_tokens tokens on the recurrent extend kernel over the "
                            "bucket's static tables")
              for op in ("gdn_core", "kda_core", "lightning_core")),
        ),
        kinds=frozenset({LayerKind.GDN, LayerKind.KDA, LayerKind.LIGHTNING}),
        # short_extend_tokens, chunk_impl: the constructor's arguments of the same names, chosen at
        # compile time (`--route gdn_core=triton_linear[short_extend_tokens=64]`) and recorded in
        # routing.json.
        # decode_tiles: "by_batch" picks the decode and verify kernels' tiles from the step's request
        # count (more, narrower programs for few requests); "fixed" takes one tile for every count
        # (triton_linear.fixed_recurrent_config), so a request's state and output reduce in one order
        # whatever shares its step.
        # "walk" takes by_batch's tiles, and a decode launch of many tiles runs them on a few programs an
        # SM that load the next tile's state while they compute one (kernels/linear.py
        # walk_recurrent_config; measured slower than by_batch on an H100, so off unless asked).
        # split_decode: the fused mixer's one-request decode in two launches or one (SPLIT_DECODE).
        # kda_graph: KDA's long extends on FLA's graph form, captured at every size (KDA_GRAPH).
        # flashinfer_past: the step size past which chunk_impl=flashinfer takes FlashInfer's kernel.
        # extend_norm: the fused GDN mixer's gated norm in its own launch or in the chunk output
        # kernel (EXTEND_NORM); qk_gates: its q / k norm and gates in their own launch or in the
        # conv's (QK_GATES); decode_norm: its gated norm at decode in its own launch or in the
        # recurrence's (DECODE_NORM).
        options=(("short_extend_tokens", SHORT_EXTEND_CHOICES), ("chunk_impl", CHUNK_IMPL_CHOICES),
                 ("decode_tiles", DECODE_TILES), ("split_decode", SPLIT_DECODE), ("kda_graph", KDA_GRAPH),
                 ("flashinfer_past", FLASHINFER_PAST), ("extend_norm", EXTEND_NORM), ("qk_gates", QK_GATES),
                 ("decode_norm", DECODE_NORM)),
        # (short_conv too: a GDN layer's conv shares its core's instance, and the choice leaves it as it is)
        choice_ops=(ChoiceScope("chunk_impl", "flashinfer", frozenset({"gdn_core", "gdn_fused", "short_conv"}),
                                why="FlashInfer's prefill kernel is the gated delta rule's (GDN layers)"),),
        batch_invariant=(("decode_tiles", "fixed"),),
        # The fused GDN mixer is this backend's by default (no fused_on_route): with its decode on the
        # split at one request and the unfused kernels past it (kernels/gdn_fused.py decode_launches),
        # bench qwen3_next's whole steps on an H200, fused against unfused in one call: decode B=1
        # 0.829 / 0.863 ms (145 / 181 kernels), B=128 3.103 / 3.127 ms, extend 512 3.052 / 3.119 ms,
        # 4096 14.63 / 15.15 ms (benchmarks/history/linear_decode.md, "The fused GDN mixer in whole steps").
        doc="Triton decode kernels (decode; target_verify: every request's tokens in one launch; the fused GDN "
            "mixer two or four launches a decode step, one under fixed tiles), Triton chunk kernels "
            "for GDN and Lightning extend/mixed (a Triton recurrent kernel where every request is short; FLA's "
            "chunk kernels for KDA, or with chunk_impl=fla), a Triton extend conv; "
            "in place on the slot-indexed state pool (padding slot skipped); capturable in decode and target_verify, "
            "and in extend and mixed where our own kernels run (KDA, and chunk_impl=fla, in steps of up to "
            "short_extend_tokens tokens; KDA at every size on FLA's graph form with kda_graph=on)")

    # The extend conv's layout: None row streaming (conv_extend_rows_config) where
    # conv_extend_takes_rows says (long steps, or tables laid out for many requests; kernel widths up
    # to CONV_EXTEND_ROWS_MAX_K, every released model's 4), else the tile kernel (conv_extend_config);
    # True / False one layout at every step (tests and benchmarks; True still leaves wider kernels to
    # the tile). kernels/linear.py says why.
    conv_extend_rows: bool | None = None

    def __init__(self, state_pool: StatePool, recurrent_config=None, conv_config=None, fla=None,
                 short_extend_tokens: int = 0, chunk_impl: str = "fla", decode_tiles: str = DECODE_TILES[0],
                 snapshots=None, routed_ops: frozenset[str] | None = None, split_decode: str = SPLIT_DECODE[0],
                 kda_graph: str = KDA_GRAPH[0], flashinfer_past: int = int(FLASHINFER_PAST[0]), flashinfer=None,
                 extend_norm: str = EXTEND_NORM[0], qk_gates: str = QK_GATES[0],
                 decode_norm: str = DECODE_NORM[0]):
        """`recurrent_config` / `conv_config` (triton_linear.RecurrentConfig / ConvConfig) pin a tile
        choice of the decode kernels, for benchmarks; None picks one per launch from the shapes.
        `fla`: a namespace with gdn / kda / simple_gla standing in for FLA's chunk functions (tests);
        None imports FLA lazily. `short_extend_tokens`: a step whose requests each bring at most
        this many tokens runs the recurrent cores through `triton_linear.recurrent_extend` (one
        launch a layer, tokens in order) instead of FLA's chunk kernels (several launches and their
        Python a layer), and extend buckets of up to this many tokens may hold them; 0: never. An
        artifact sets it through the routing option of the same name (SHORT_EXTEND_CHOICES). `chunk_impl`: whose chunk kernels run the other extend steps of GDN
        and Lightning layers, "fla" or "triton" (triton_chunk.chunk_extend); the routing option of the same name (CHUNK_IMPL_CHOICES), whose recorded choice
        build() passes. Built directly (tests, benchmarks), FLA's unless asked. `decode_tiles`: the
        routing option of the same name; "fixed" launches decode and verify steps with one tile at
        every request count (triton_linear.fixed_recurrent_config; the conv's tile is one already; unless a
        config is pinned); "walk" launches decode steps of many requests on programs walking the
        tiles (walk_recurrent_config). `snapshots`: the prefix cache's SnapshotPool, which the chunk
        kernels and the extend conv write in-step snapshots into (None: caching off); `routed_ops`: the ops
        routing binds to this instance (None: any it supports), which say whether it may write them
        (`writes_step_snapshots`). `split_decode`, `kda_graph`, `flashinfer_past`, `extend_norm`,
        `qk_gates`, `decode_norm`: the routing options of the same names. `flashinfer`: a callable standing in for
        FlashInfer's kernel launch (kernels/flashinfer_gdn.GdnPrefill.launch; tests); None loads the
        library on first use."""
        def choice(option: str, value: str, choices: tuple) -> str:
            if value not in choices:
                raise ValueError(f"{self.name}: {option} must be one of {choices}, not {value!r}")
            return value

        split_decode = choice("split_decode", split_decode, SPLIT_DECODE)
        self.merged_split = split_decode in ("one_launch", "one_launch_early")
        self.early_gates = split_decode == "one_launch_early"
        decode_tiles = choice("decode_tiles", decode_tiles, DECODE_TILES)
        self.fixed_tiles = decode_tiles == "fixed"
        self.walk_tiles = decode_tiles == "walk"
        choice("chunk_impl", chunk_impl, CHUNK_IMPL_CHOICES)
        self.kda_graph = choice("kda_graph", kda_graph, KDA_GRAPH) == "on"
        self.norm_in_output = choice("extend_norm", extend_norm, EXTEND_NORM) == "in_output"
        self.qk_in_conv = choice("qk_gates", qk_gates, QK_GATES) == "in_conv"
        self.norm_in_recurrence = choice("decode_norm", decode_norm, DECODE_NORM) == "in_recurrence"
        self.state_pool = state_pool
        self.device = state_pool.device
        self.recurrent_config = recurrent_config
        self.conv_config = conv_config
        self.short_extend_tokens = short_extend_tokens
        self.chunk_impl = chunk_impl
        self.flashinfer_past = flashinfer_past
        self._flashinfer = flashinfer
        self.snapshots = snapshots
        self.routed_ops = self.supported_ops if routed_ops is None else frozenset(routed_ops)
        self._fla = fla
        self._fla_chunk_indices: frozenset[str] | None = None  # FLA entry points that take chunk_indices
        # [max_seqs + 1] int64: what captured kernels read (a captured extend step's B + 1 requests)
        self._static_slots: torch.Tensor | None = None
        self._static_extend: _StaticExtendPlan | None = None  # captured extend and mixed steps' tables
        self._graph_workspaces: dict[tuple, object] = {}  # the chunk kernels' in captured steps (never regrown)
        self._step: _StepPlan | None = None
        options = {"short_extend_tokens": str(short_extend_tokens), "chunk_impl": chunk_impl, "kda_graph": kda_graph,
                   "flashinfer_past": str(flashinfer_past)}
        # Ops whose extend and mixed steps this instance may run inside a captured graph, at any
        # size, and those it may run there in steps of up to some tokens (the short-extend kernel).
        self._captured_extend = frozenset(op for op in self.supported_ops
                                          if self.capability.capturable(op, Mode.EXTEND, options))
        self._bounded_extend = {op: n for op in sorted(self.supported_ops - self._captured_extend)
                                if (n := self.capability.capture_tokens(op, Mode.EXTEND, options))}

    @classmethod
    def build(cls, setup: BackendSetup) -> "TritonLinearBackend":
        """Over the state pool: every kernel finds its layer's state by layer id and slot."""
        options = cls.routed_options(setup.options)
        if options["chunk_impl"] == "flashinfer":  # at build, naming the layer: not at its first long step
            fi = _flashinfer_kernels()
            if setup.device.type == "cuda":
                fi.check_device(setup.device)
            for call in setup.calls:
                if call.op in ("gdn_core", "gdn_fused"):
                    fi.check_layer(call.dtype, *_gdn_heads(call),
                                   f"triton_linear: hgc.{call.op} (layer {call.layer_id})")
        return cls(setup.state_pool, snapshots=setup.snapshots, routed_ops=frozenset(c.op for c in setup.calls),
                   **options)

    def writes_step_snapshots(self, snapshots) -> bool:
        """Into the pool it was built with, where every extend step of its ops runs our kernels: the
        chunk kernels (chunk_impl "triton") and the extend conv write the state after a request's
        snapshot row on the way. FLA's chunk kernels return the state after a request's last token
        alone, so with KDA routed here (FLA past the short-extend limit) or chunk_impl "fla" the
        prefix cache ends a chunk at each snapshot point instead."""
        return (snapshots is not None and snapshots is self.snapshots and self.chunk_impl == "triton"
                and "kda_core" not in self.routed_ops)

    @staticmethod
    def routed_options(options: dict) -> dict:
        """The constructor's keyword arguments from routing's recorded kernel options (the split
        captured the ops these make capturable); an entry routed before an option existed has
        none: the declared default."""
        return {"short_extend_tokens": int(options.get("short_extend_tokens", SHORT_EXTEND_CHOICES[0])),
                "chunk_impl": options.get("chunk_impl", CHUNK_IMPL_CHOICES[0]),
                "decode_tiles": options.get("decode_tiles", DECODE_TILES[0]),
                "split_decode": options.get("split_decode", SPLIT_DECODE[0]),
                "kda_graph": options.get("kda_graph", KDA_GRAPH[0]),
                "flashinfer_past": int(options.get("flashinfer_past", FLASHINFER_PAST[0])),
                "extend_norm": options.get("extend_norm", EXTEND_NORM[0]),
                "qk_gates": options.get("qk_gates", QK_GATES[0]),
                "decode_norm": options.get("decode_norm", DECODE_NORM[0])}

    # -- hooks --------------------------------------------------------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Allocate the static slot-id buffer that every captured decode / target-verify graph reads,
        and the static extend tables where extend steps are captured."""
        self._static_slots = torch.full((max_seqs + 1,), PADDING_SLOT, dtype=torch.int64, device=self.device)
        if self._captured_extend or self._bounded_extend:
            self._static_extend = _StaticExtendPlan(max_tokens, max_seqs, self.device)

    def init_replay_state(self, ctx: ExecContext, bucket: int) -> None:
        """Copy this step's slot ids into the static buffer read by the graph of `bucket` (and, for
        an extend or mixed step, its padded tables into the static extend plan)."""
        if self._static_slots is None:
            raise RuntimeError(f"{self.name}: init_replay_state before init_capture_state")
        if ctx.num_seqs != bucket or bucket >= self._static_slots.shape[0]:
            raise RuntimeError(f"{self.name}: step of {ctx.num_seqs} requests replayed in bucket {bucket} "
                               f"(static buffers hold {self._static_slots.shape[0] - 1}); the graph runner pads "
                               f"steps to their bucket before replay")
        slots = self._static_slots[:bucket]
        slots.copy_(ctx.state_slots, non_blocking=True)
        eager = self._step if self._step is not None and self._step.ctx is ctx and not self._step.replayed else None
        self._step = self._make_step_plan(ctx, slots, replayed=True)
        if eager is not None:  # plan_piecewise_step planned the gaps first: their ops keep that plan
            self._step.eager_extend = eager.extend
        if Mode(ctx.mode) in (Mode.EXTEND, Mode.MIXED) and self._static_extend is not None:
            self._step.extend = self._static_extend.fill(ctx, self._static_slots)

    def replay_state_in_graph(self, mode: Mode) -> bool:
        """Its replay state is one device copy of the step's slot ids (and, in target_verify, a row
        layout the bucket fixes; in extend and mixed, where ops of this instance are captured there,
        one launch that makes the static tables from the staged query offsets): a whole-step graph,
        or the first captured piece of a piecewise step, records it."""
        mode = Mode(mode)
        if mode in (Mode.EXTEND, Mode.MIXED):
            return bool(self._captured_extend or self._bounded_extend)
        return mode in self.capability.modes_capturable

    def plan_gap_step(self, ctx: ExecContext, bucket: int, chunk_size: int) -> None:
        """A piecewise step whose eager gaps hold every node of this instance (FlashInfer's GDN
        extends past `flashinfer_past`: the whole fused mixer a gap): where the step fits the static
        tables, its gap ops run on them, as the captured steps' ops do (init_replay_state: the step's
        slot ids and one launch of tables from the staged query offsets), not on tables built on
        the host. The host then builds and copies nothing for the step, and the gap's launches see
        the bucket's grids and the static tables' addresses every step of the bucket (the
        Launcher's hits). FlashInfer's kernel takes the real requests, which lead the tables
        (_flashinfer_chunk). Otherwise (another chunk_impl, a step past the tables or of at most
        `flashinfer_past` real rows, a request without rows, which FlashInfer's kernel is not
        written for, or a snapshot pool without the step's snapshot tables) an eager step's plan."""
        if (self.chunk_impl == "flashinfer" and self._static_extend is not None
                and Mode(ctx.mode) in (Mode.EXTEND, Mode.MIXED)
                and ctx.num_tokens <= self._static_extend.max_tokens and ctx.num_seqs <= self._static_extend.max_seqs
                and ctx.num_real_tokens > self.flashinfer_past and min(ctx.query_lens) > 0
                and (self.snapshots is None or ctx.snapshot_rows is not None)):
            self.init_replay_state(ctx, bucket)
            self._step.eager_extend = self._step.extend  # the gaps' plan: the static tables
            return
        super().plan_gap_step(ctx, bucket, chunk_size)

    def init_step_metadata(self, ctx: ExecContext) -> None:
        """An eager step: plan what every op call of the step reads (slot ids on the device, the
        target-verify row layout), forgetting the last step's plan."""
        self._step = self._make_step_plan(ctx, self._device_slots(ctx), replayed=False)

    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Plan the extend path once for all layers (when the step takes it): kept requests, their
        slots, cu_seqlens on host and device, FLA's chunk indices, the extend conv's token blocks.
        (A replayed step then gets the static plan from init_replay_state, which replaces it.)

        FLA chooses its own chunk length (FLA_CHUNK), so `chunk_size` (the engine's token budget)
        sizes nothing here."""
        step = self._step_plan(ctx)
        if self._takes_extend_path(step):
            step.extend = self._make_extend_plan(step)

    # -- the step plan ------------------------------------------------------------------------------

    def _device_slots(self, ctx: ExecContext) -> torch.Tensor:
        slots = ctx.state_slots
        return slots if slots.device == self.device else slots.to(self.device, non_blocking=True)

    @staticmethod
    def _make_step_plan(ctx: ExecContext, slots: torch.Tensor, replayed: bool) -> _StepPlan:
        width = None
        if Mode(ctx.mode) == Mode.TARGET_VERIFY and ctx.num_seqs and ctx.num_tokens % ctx.num_seqs == 0:
            n = ctx.num_tokens // ctx.num_seqs
            width = n if all(q == n for q in ctx.query_lens) else None
        return _StepPlan(ctx, slots, replayed, width)

    def _step_plan(self, ctx: ExecContext) -> _StepPlan:
        """This step's plan; made here only for a caller that skipped init_step_metadata (tests)."""
        if self._step is None or self._step.ctx is not ctx:
            self._step = self._make_step_plan(ctx, self._device_slots(ctx), replayed=False)
        return self._step

    @staticmethod
    def _takes_extend_path(step: _StepPlan) -> bool:
        mode = Mode(step.ctx.mode)
        return mode in (Mode.EXTEND, Mode.MIXED) or (mode == Mode.TARGET_VERIFY and step.verify_width is None)

    def _make_extend_plan(self, step: _StepPlan) -> _ExtendPlan:
        """Host tables from the step's lengths (numpy, no loop over requests), one copy."""
        ctx = step.ctx
        lens = np.asarray(ctx.query_lens, dtype=np.int64)
        keep = np.flatnonzero(lens).astype(np.int64)
        lens = lens[keep]
        R, T = lens.size, int(lens.sum())
        cu = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        bounds = np.append(cu, np.int64(ctx.num_tokens))
        chunks = token_blocks(lens, FLA_CHUNK)
        # The padding rows are request R of the conv's table: their programs write zeros.
        blocks = token_blocks(np.append(lens, np.int64(ctx.num_tokens - T)), _kernels().CONV_EXTEND_BLOCK_T)
        bounds, keep, chunks, blocks, cu = (torch.from_numpy(a) for a in (bounds, keep, chunks, blocks, cu))
        bounds_dev, keep_dev, chunks_dev, blocks_dev = _to_device_at_once(
            [bounds, keep, chunks, blocks], self.device)
        slots = step.slots[:ctx.num_real_seqs]
        slots = slots if R == ctx.num_real_seqs else slots.index_select(0, keep_dev)
        snap_rows = snap_ids = None
        if self.snapshots is not None and ctx.snapshot_rows is not None:
            snap_rows, snap_ids = (t[:ctx.num_real_seqs].to(self.device, non_blocking=True)
                                   for t in (ctx.snapshot_rows, ctx.snapshot_ids))
            if R != ctx.num_real_seqs:
                snap_rows, snap_ids = snap_rows.index_select(0, keep_dev), snap_ids.index_select(0, keep_dev)
        return _ExtendPlan(T, slots, bounds_dev[:R + 1], cu, chunks_dev, bounds_dev, blocks_dev,
                           int(lens.max()) if R else 0, snap_rows, snap_ids)

    def _in_graph(self, step: _StepPlan, op: str) -> bool:
        """Whether `op` runs on the static extend plan in this replayed step: an op captured in
        extend at any size, or one captured up to a bound in a step (its bucket) of at most that
        many tokens; else it runs in an eager gap."""
        return (step.extend is not None and step.extend.captured
                and (op in self._captured_extend or step.ctx.num_tokens <= self._bounded_extend.get(op, 0)))

    def _extend_plan(self, step: _StepPlan, op: str) -> _ExtendPlan:
        """The plan `op` reads: in a replayed step, an op the step's graph does not hold runs in an
        eager gap, on the eager plan (_route refused the step if there was none)."""
        if step.replayed and not self._in_graph(step, op):
            return step.eager_extend
        if step.extend is None:
            step.extend = self._make_extend_plan(step)  # a caller that skipped init_chunk_metadata (tests)
        return step.extend

    # -- helpers: constant host work per op call ----------------------------------------------------

    def _step_slots(self, ctx: ExecContext) -> torch.Tensor:
        """Slot ids [B] for this step on the pool's device: the static buffer in a replayed step."""
        return self._step_plan(ctx).slots

    def _route(self, ctx: ExecContext, op: str, layer_id: int, rows: int) -> tuple[str, int]:
        """('decode', 1), ('verify', n) or ('extend', 0): which path this op call takes."""
        step = self._step_plan(ctx)
        mode = Mode(ctx.mode)
        if mode == Mode.DECODE:
            if rows != ctx.num_seqs:
                raise ValueError(f"{self.name}: hgc.{op} (layer {layer_id}) got {rows} rows for {ctx.num_seqs} "
                                 f"requests; a decode step has exactly one row per request, padding included")
            return "decode", 1
        if rows != ctx.num_tokens:
            raise ValueError(f"{self.name}: hgc.{op} (layer {layer_id}) got {rows} rows for a step of "
                             f"{ctx.num_tokens}; ops see every row of the step, padding included")
        if mode == Mode.TARGET_VERIFY:
            if step.verify_width is not None:
                return "verify", step.verify_width
            if step.replayed:
                raise WrongModeError(
                    f"{self.name}: hgc.{op} (layer {layer_id}): a replayed target_verify step must give every "
                    f"request the same number of rows (rows {rows}, requests {ctx.num_seqs}, lengths "
                    f"{ctx.query_lens}); ragged verify steps only run eagerly")
            return "extend", 0
        if step.replayed:
            captured = self._in_graph(step, op)
            # an op the graphs cannot hold runs in an eager gap of a piecewise step, on the eager plan
            # made before the replay state; never inside a capture, and never without that plan
            in_gap = not captured and step.eager_extend is not None and not _capturing(self.device)
            if not captured and not in_gap:
                raise WrongModeError(f"{self.name}: hgc.{op} (layer {layer_id}) in a replayed {mode.value!r} step; "
                                     f"its extend and mixed steps run eagerly here (FLA's chunk kernels plan on the "
                                     f"host), or init_replay_state made no static plan")
        return "extend", 0

    def _layer_state(self, layer_id: int, entry: str) -> torch.Tensor:
        return self.state_pool.layer(layer_id)[entry]

    def _fla_ops(self) -> types.SimpleNamespace:
        if self._fla is None:
            self._fla = fla_ops()
        if self._fla_chunk_indices is None:
            # FLA versions differ in which entry points take precomputed chunk indices; where one
            # does not, it derives them from cu_seqlens_cpu through FLA's cache keyed by tensor
            # identity, which the plan's shared tensors hit on every layer after the first.
            self._fla_chunk_indices = frozenset(
                name for name in ("gdn", "kda", "simple_gla")
                if "chunk_indices" in inspect.signature(getattr(self._fla, name)).parameters)
        return self._fla

    # -- the extend path (eager) ---------------------------------------------------------------

    def _chunk(self, ctx, op, layer_id, out, fla_name: str, tokens: dict, graph_form: bool = False,
               zero_padding: bool = True, **options) -> None:
        """One FLA chunk call, states gathered and scattered by slot.

        `tokens`: the call's per-token inputs over the step's rows; `options`: its other keyword
        arguments. Everything derived from the step comes from the plan. The plain form runs over the
        step's real requests and rows. `graph_form` (kda_graph "on"): chunk_kda's form for graph
        capture, in eager and captured steps alike, so an eager step computes what the replayed graph
        of the same step does; captured, over the static plan, the bucket's rows and its B + 1
        requests (padding requests and the always-empty one on the padding slot, empty at the tail of
        cu_seqlens, as the form requires). FLA leaves the padding rows undefined, so they are written
        as zeros here, and the padding requests' final states (they sit on the padding slot) are
        replaced by the slot's own contents before the write-back: the padding slot keeps what it held.
        `zero_padding` False: an eager step leaves the padding rows of `out` as they are, for a
        caller that never reads them (gdn_fused's core, whose gated norm writes its own zeros)."""
        plan = self._extend_plan(self._step_plan(ctx), op)
        if plan.captured:
            assert graph_form, f"{self.name}: hgc.{op} captured in extend takes FLA's graph form only"
            bounds, slots, rows = plan.padded_bounds, plan.slots, out.shape[0]
            cu = bounds[:-1]  # the B + 1 requests; the last entry, the bucket's rows, is the padding rows'
        else:
            cu, slots, rows = plan.cu_seqlens, plan.slots, plan.num_tokens
        if rows > 0:
            states = self._layer_state(layer_id, "recurrent")
            fn = getattr(self._fla_ops(), fla_name)
            if graph_form:
                if not _takes_graph_form(fn):  # before FLA 0.6, its **kwargs would swallow use_graph
                    raise RuntimeError(f"{self.name}: kda_graph=on takes FLA's chunk_kda in its graph form "
                                       f"(use_graph, FLA 0.6 and later); this FLA's chunk_kda has none")
                options.update(use_graph=True, max_num_seqs=slots.shape[0])
            else:
                options["cu_seqlens_cpu"] = plan.cu_seqlens_cpu
                if fla_name in self._fla_chunk_indices:
                    options["chunk_indices"] = plan.chunk_indices
            # [R, H, Dk, Dv], a copy FLA may overwrite, in float32 whatever the pool keeps (--state-dtype):
            # the initial state FLA's chunk kernels are written for
            h0 = states.index_select(0, slots).float()
            o, ht = fn(**{name: t[None, :rows] for name, t in tokens.items()}, **options, initial_state=h0,
                       output_final_state=True, cu_seqlens=cu)
            if ht is None or tuple(ht.shape) != tuple(h0.shape):
                raise RuntimeError(f"{self.name}: hgc.{op} (layer {layer_id}): FLA returned a final state of shape "
                                   f"{None if ht is None else tuple(ht.shape)}, expected {tuple(h0.shape)}")
            o = o.reshape(out[:rows].shape)
            if plan.captured:
                real = torch.arange(rows, device=out.device) < bounds[-2]
                o = torch.where(real.view(-1, *([1] * (o.dim() - 1))), o, 0)
                held = states[PADDING_SLOT].float().expand_as(ht)
                ht = torch.where((slots == PADDING_SLOT).view(-1, 1, 1, 1), held, ht)
            out[:rows].copy_(o)
            states.index_copy_(0, slots, ht.to(states.dtype))
        if zero_padding and out.shape[0] > rows:
            out[rows:].zero_()

    def _short_extend(self, ctx, layer_id, q, k, v, gate, beta, out, scale, gate_kind) -> bool:
        """The recurrent extend kernel over the step's requests, where each brings at most
        `short_extend_tokens` tokens; False where the step is longer. One launch either way: the
        padding rows are the plan's last request, written as zeros by the kernel (in a captured
        bucket the host does not know the real count), and a captured bucket's padding requests sit
        on the padding slot. A captured bucket is at most short_extend_tokens rows (the capture's
        bound), so it holds no longer request: the graph and the eager step of the same requests
        run this kernel alike. KDA under kda_graph=on is captured at every size: there the step's
        rows decide (a bucket's, or an eager step's real rows), the longer ones going to the graph
        form."""
        op = _kernels().OP_OF_GATE[gate_kind]
        graph_form = op == "kda_core" and self.kda_graph
        if not self.short_extend_tokens or (op in self._captured_extend and not graph_form):
            return False  # an op captured in extend takes its graph's kernels eagerly too (SHORT_EXTEND_CHOICES)
        plan = self._extend_plan(self._step_plan(ctx), op)
        if graph_form:
            # kda_graph=on: a step of at most short_extend_tokens rows (a bucket's, or an eager step's
            # real rows, which a bucket of as many rows replays) on this kernel, larger ones on the
            # graph form: the kernel each size was measured faster on (KDA_GRAPH)
            if (ctx.num_tokens if plan.captured else plan.num_tokens) > self.short_extend_tokens:
                return False
        elif not plan.captured and not 0 < plan.longest <= self.short_extend_tokens:
            return False
        _kernels().recurrent_extend(q, k, v, gate, beta, out, self._layer_state(layer_id, "recurrent"), plan.slots,
                                    plan.padded_bounds, scale, gate_kind, self.recurrent_config)
        return True

    def _triton_chunk(self, ctx, layer_id, q, k, v, gate, beta, out, scale, gate_kind, zero_padding=True,
                      norm=None) -> bool:
        """Our chunk kernels over the step's real requests, states read from and written to their
        slots in place (padding rows zeroed as _chunk does, or left where `zero_padding` is False);
        False where chunk_impl is "fla". `norm`: (GatedNorm, the mixer's output): the output kernel
        writes the normalised rows there instead of the core into `out`, padding rows zero."""
        if self.chunk_impl == "fla":
            return False
        gated = None
        if norm is not None:
            gated, out = norm
            zero_padding = True  # as the norm's own kernel leaves the output's padding rows
        plan = self._extend_plan(self._step_plan(ctx), _kernels().OP_OF_GATE[gate_kind])
        if plan.captured:
            # the padding rows are the table's last request, written as zeros by the output kernel:
            # the graph does not know the real row count, and zeroing all of `out` first cost a launch
            state = self._layer_state(layer_id, "recurrent")
            _chunk_kernels().chunk_extend(q, k, v, gate, beta, out, state, plan.slots, plan.padded_bounds,
                                          plan.chunk_indices, scale, gate_kind,
                                          config=self._graph_chunk_config(v, q.shape[0]),
                                          workspaces=self._workspaces(q, v, beta, plan.chunk_indices.shape[0]),
                                          snapshots=self._step_snapshots(plan, layer_id, "recurrent"),
                                          gated_norm=gated)
            return True
        T = plan.num_tokens
        if T > 0:
            _chunk_kernels().chunk_extend(q, k, v, gate, beta, out, self._layer_state(layer_id, "recurrent"),
                                          plan.slots, plan.cu_seqlens, plan.chunk_indices, scale, gate_kind,
                                          snapshots=self._step_snapshots(plan, layer_id, "recurrent"),
                                          gated_norm=gated)
        if zero_padding and out.shape[0] > T:
            out[T:].zero_()
        return True

    def _flashinfer_chunk(self, ctx, layer_id, q, k, v, g, beta, out, scale, zero_padding=True) -> bool:
        """FlashInfer's kernel over an eager step of more than flashinfer_past rows, or over a
        piecewise step's gap on the static tables (plan_gap_step); False for a captured step (its
        bucket is at most that many rows) or a shorter one."""
        step = self._step_plan(ctx)
        plan = self._extend_plan(step, "gdn_core")
        if plan.captured:
            if step.eager_extend is not plan or _capturing(self.device):
                return False
            # plan_gap_step's static tables: the real requests lead them (the bucket's padding
            # requests, empty, after), so FlashInfer gets the first R, none of them empty
            R = ctx.num_real_seqs
            slots, cu, rows = plan.slots[:R], plan.padded_bounds[:R + 1], ctx.num_real_tokens
        elif plan.num_tokens <= self.flashinfer_past:
            return False
        else:
            slots, cu, rows = plan.slots, plan.cu_seqlens, plan.num_tokens
        launch = self._flashinfer or _flashinfer_kernels().prefill(v.device).launch
        _flashinfer_kernels().chunk_into_pool(launch, q, k, v, g, beta, out, self._layer_state(layer_id, "recurrent"),
                                              slots, cu, rows, scale, zero_padding)
        return True

    def _graph_chunk_config(self, v: torch.Tensor, rows: int):
        """Tiles of a captured step's chunk kernels: chosen for one request (the fewest programs in
        flight), since the graph keeps them whatever the step's requests, and for the bucket's rows
        (a bucket of at most a chunk's rows has one chunk a request: chunk_config's short tiles)."""
        chunks = _chunk_kernels()
        return chunks.chunk_config(1, v.shape[1], v.shape[2], v.device, chunks.takes_short_tiles(rows))

    def _workspaces(self, q: torch.Tensor, v: torch.Tensor, beta, chunks: int) -> object:
        """This instance's chunk workspaces for captured steps, made once for the first captured
        extend step's rows and chunk-table rows: the largest extend bucket's warm-up, outside any
        graph (capture goes largest first). A later captured step never needs more; if one did,
        chunk_extend would refuse it rather than regrow memory a graph holds."""
        Hv, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
        key = (Hv, Dk, Dv, v.dtype, beta is not None)
        held = self._graph_workspaces.get(key)
        if held is None:
            held = _chunk_kernels().ChunkWorkspaces.allocate(q.shape[0], chunks, Hv, Dk, Dv, v.dtype,
                                                            beta is not None, v.device)
            self._graph_workspaces[key] = held
        return held

    def _gdn_extend(self, ctx, q, k, v, g, beta, out, layer_id, scale, zero_padding=True, norm=None) -> bool:
        """Whether `norm` (`_triton_chunk`'s) was applied: only our chunk kernels fold it."""
        if self.chunk_impl == "flashinfer":  # past flashinfer_past FlashInfer's, else ours as "triton" runs them
            if self._flashinfer_chunk(ctx, layer_id, q, k, v, g, beta, out, scale, zero_padding):
                return False
        elif self._short_extend(ctx, layer_id, q, k, v, g, beta, out, scale, _kernels().GATE_PER_HEAD):
            return False
        if self._triton_chunk(ctx, layer_id, q, k, v, g, beta, out, scale, _kernels().GATE_PER_HEAD, zero_padding,
                              norm):
            return norm is not None
        q, k = _in_dtype_of(v, q, k)
        self._chunk(ctx, "gdn_core", layer_id, out, "gdn", dict(q=q, k=k, v=v, g=g, beta=beta),
                    zero_padding=zero_padding, scale=scale, use_qk_l2norm_in_kernel=False)
        return False

    def _kda_extend(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        if self._short_extend(ctx, layer_id, q, k, v, g, beta, out, scale, _kernels().GATE_PER_CHANNEL):
            return
        q, k = _in_dtype_of(v, q, k)
        self._chunk(ctx, "kda_core", layer_id, out, "kda", dict(q=q, k=k, v=v, g=g, beta=beta),
                    graph_form=self.kda_graph, scale=scale, use_qk_l2norm_in_kernel=False)

    def _lightning_extend(self, ctx, q, k, v, decay, out, layer_id, scale):
        if self._short_extend(ctx, layer_id, q, k, v, decay, None, out, scale, _kernels().GATE_CONSTANT):
            return
        if self._triton_chunk(ctx, layer_id, q, k, v, decay, None, out, scale, _kernels().GATE_CONSTANT):
            return
        q, k = _in_dtype_of(v, q, k)
        # g_gamma: FLA's constant per-head log-decay, exactly Lightning's; no [T, H] gate tensor.
        self._chunk(ctx, "lightning_core", layer_id, out, "simple_gla", dict(q=q, k=k, v=v), scale=scale,
                    g_gamma=decay.float())

    def _conv_extend(self, ctx, x, weight, bias, out, layer_id, silu, qk=None) -> bool:
        """The Triton extend conv, one launch: every request's tokens, its new history, zero padding
        rows. `qk` (kernels/linear.py ConvQk): a fused GDN layer's q / k norm and gates in the same
        launch where the step's channel tile holds whole key heads; whether it took them."""
        plan = self._extend_plan(self._step_plan(ctx), "short_conv")
        kernels = _kernels()
        width = weight.shape[-1]
        if self.conv_extend_rows is None:  # by the padded rows and the table's length: one choice per bucket
            rows = kernels.conv_extend_takes_rows(x.shape[0], plan.conv_blocks.shape[0], width)
        else:
            rows = self.conv_extend_rows and width <= kernels.CONV_EXTEND_ROWS_MAX_K
        config = kernels.conv_extend_rows_config(x.shape[1]) if rows else None
        if qk is not None:
            tile = config or kernels.conv_extend_config(plan.conv_blocks.shape[0], x.shape[1], x.device)
            qk = qk if kernels.conv_qk_fits(tile, qk.q.shape[2]) else None
        kernels.short_conv_extend(x, weight, bias, out, self._layer_state(layer_id, "conv"), plan.slots,
                                  plan.padded_bounds, plan.conv_blocks, silu,
                                  what=f"{self.name}: hgc.short_conv (layer {layer_id})", config=config,
                                  snapshots=self._step_snapshots(plan, layer_id, "conv"), qk=qk)
        return qk is not None

    def _step_snapshots(self, plan: _ExtendPlan, layer_id: int, entry: str):
        """The plan's in-step snapshots of this layer's `entry` into the pool, or None (none to write)."""
        if self.snapshots is None:
            return None
        if plan.snap_rows is None:
            if plan.captured:  # the graph would keep the empty table and never write the snapshots asked later
                raise RuntimeError(f"{self.name}: a captured extend step without snapshot tables, built with a "
                                   f"snapshot pool (layer {layer_id}); the step's context must carry snapshot_rows")
            return None
        return _kernels().StepSnapshots(plan.snap_rows, plan.snap_ids, self.snapshots.buffers[layer_id][entry])

    def _recurrent(self, ctx, op: str, layer_id: int, q, k, v, gate, beta, out, scale, gate_kind: int) -> bool:
        """A decode step (n == 1) or a target-verify step of n tokens per request, one launch either way
        (False: the step takes the extend path). A verify step keeps the state after each token but
        the last in the state pool's intermediate states (entry t of the request's row), the last
        one in its slot."""
        path, n = self._route(ctx, op, layer_id, q.shape[0])
        if path == "extend":
            return False
        kernels = _kernels()
        if gate_kind != kernels.GATE_PER_HEAD:
            assert q.shape[1] == v.shape[1], f"{op}: key heads {q.shape[1]} != value heads {v.shape[1]}"
        slots, state = self._step_slots(ctx), self._layer_state(layer_id, "recurrent")
        config = self.recurrent_config
        if config is None and self.fixed_tiles:  # one tile, whatever the step holds
            config = kernels.fixed_recurrent_config(v.shape[1], q.shape[2], v.shape[2], v.device)
        elif config is None and self.walk_tiles and n == 1:
            config = kernels.walk_recurrent_config(q.shape[0], v.shape[1], q.shape[2], v.shape[2], v.device)
        if n == 1:
            kernels.recurrent_decode(q, k, v, gate, beta, out, state, slots, scale, gate_kind, config)
        else:
            inter = self.state_pool.verify_layer(layer_id, n, slots.shape[0])["recurrent"]
            kernels.recurrent_verify(q, k, v, gate, beta, out, state, slots, inter, n, scale, gate_kind, config)
        return True

    # -- ops ------------------------------------------------------------------------------------

    def gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        self._gdn_core(ctx, q, k, v, g, beta, out, layer_id, scale)

    def _gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale, zero_padding=True, norm=None) -> bool:
        """`zero_padding` False (gdn_fused's core, whose gated norm reads no padding row and writes
        its zeros): an eager extend leaves the padding rows of `out` unwritten, one launch fewer.
        Whether `norm` was applied (`_gdn_extend`)."""
        if self._recurrent(ctx, "gdn_core", layer_id, q, k, v, g, beta, out, scale, _kernels().GATE_PER_HEAD):
            return False
        return self._gdn_extend(ctx, q, k, v, g, beta, out, layer_id, scale, zero_padding, norm)

    def kda_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        if not self._recurrent(ctx, "kda_core", layer_id, q, k, v, g, beta, out, scale, _kernels().GATE_PER_CHANNEL):
            self._kda_extend(ctx, q, k, v, g, beta, out, layer_id, scale)

    def lightning_core(self, ctx, q, k, v, decay, out, layer_id, scale):
        if not self._recurrent(ctx, "lightning_core", layer_id, q, k, v, decay, None, out, scale,
                               _kernels().GATE_CONSTANT):
            self._lightning_extend(ctx, q, k, v, decay, out, layer_id, scale)

    def gdn_fused(self, ctx, qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, layer_id, k_heads, scale,
                  eps):
        """A whole GDN mixer (kernels/gdn_fused.py). Decode: two launches for one request, the
        unfused kernels' four for more (kernels/gdn_fused.py decode_launches), one launch under
        fixed decode tiles. Decode steps of many requests, target-verify and extend
        steps: the conv and the recurrent core as short_conv and gdn_core run them in this step
        (verify kernels, extend conv, chunk kernels, FLA), with one launch for the l2norm and the
        gates between them and one for the gated norm after."""
        fused = _fused_kernels()
        what = f"{self.name}: hgc.gdn_fused (layer {layer_id})"
        path, n = self._route(ctx, "gdn_fused", layer_id, qkv.shape[0])
        # fixed tiles (batch-invariant): one kernel at every batch, as for the other decode kernels;
        # else a decode of many requests takes the unfused kernels below, as a verify step does
        launches = 1 if self.fixed_tiles else fused.decode_launches(qkv.shape[0])
        if path == "decode" and launches != 4:
            fused.gdn_fused_decode(qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out,
                                   self._layer_state(layer_id, "conv"), self._layer_state(layer_id, "recurrent"),
                                   self._step_slots(ctx), k_heads, scale, eps, what, launches=launches,
                                   merged_split=self.merged_split and launches == 2,
                                   early_gates=self.early_gates and launches == 2)
            return
        dims = fused.gdn_dims(qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, k_heads, what)
        mixed = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        # (a verify step's conv never takes them: no buffers made for it)
        qk = self._conv_qk(qkv, b, a, A_log, dt_bias, dims) if self.qk_in_conv and path != "verify" else None
        if self._short_conv(ctx, qkv, conv_weight, None, mixed, layer_id, True, qk):
            q, k, g, beta = qk.q, qk.k, qk.g, qk.beta  # qk_gates=in_conv: the conv's launch made them
            v = mixed[:, 2 * dims.hk * dims.dk:].view(qkv.shape[0], dims.hv, dims.dv)
        else:
            q, k, v, g, beta = fused.qk_gates(mixed, b, a, A_log, dt_bias, dims)
        if path == "decode" and self._decode_with_norm(ctx, q, k, v, g, beta, z, norm_weight, out, layer_id, scale,
                                                       eps):
            return
        core = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        # extend_norm=in_output: our chunk kernels write the normalised rows into `out` themselves
        norm = ((_kernels().GatedNorm(z, norm_weight, eps), out)
                if self.norm_in_output and path == "extend" else None)
        if self._gdn_core(ctx, q, k, v, g, beta, core, layer_id, scale, zero_padding=False, norm=norm):
            return
        if path != "extend":  # decode (n 1) or verify
            fused.gated_rmsnorm(core, z, norm_weight, out, eps, slots=self._step_slots(ctx), rows_per_slot=n)
        else:  # padding rows: from the bounds of the plan gdn_core ran on
            plan = self._extend_plan(self._step_plan(ctx), "gdn_core")
            fused.gated_rmsnorm(core, z, norm_weight, out, eps, bounds=plan.padded_bounds)

    def _decode_with_norm(self, ctx, q, k, v, g, beta, z, norm_weight, out, layer_id, scale, eps) -> bool:
        """decode_norm=in_recurrence: a fused GDN layer's decode recurrence and gated norm in one
        launch on whole-row tiles (kernels/linear.py recurrent_decode's gated_norm); False (nothing
        run) without the option or where the decode tiles are pinned, fixed or walked."""
        if not self.norm_in_recurrence or self.recurrent_config is not None or self.fixed_tiles or self.walk_tiles:
            return False
        kernels = _kernels()
        kernels.recurrent_decode(q, k, v, g, beta, out, self._layer_state(layer_id, "recurrent"), self._step_slots(ctx),
                                 scale, kernels.GATE_PER_HEAD, kernels.whole_row_config(q.shape[2], v.shape[2]),
                                 gated_norm=kernels.GatedNorm(z, norm_weight, eps))
        return True

    @staticmethod
    def _conv_qk(qkv, b, a, A_log, dt_bias, dims):
        """The ConvQk of a fused GDN layer's extend step: its q, k, g and beta as qk_gates makes them."""
        T = qkv.shape[0]
        fused = _fused_kernels()
        q = torch.empty(T, dims.hk, dims.dk, dtype=qkv.dtype, device=qkv.device)
        g = torch.empty(T, dims.hv, dtype=torch.float32, device=qkv.device)
        beta = torch.empty(T, dims.hv, dtype=qkv.dtype, device=qkv.device)
        return _kernels().ConvQk(q, torch.empty_like(q), g, beta, b, a, A_log, dt_bias, fused.L2NORM_EPS,
                                 fused.SOFTPLUS_THRESHOLD)

    def short_conv(self, ctx, x, weight, bias, out, layer_id, silu):
        """The decode conv, or over a target-verify step its histories kept as the recurrent cores keep states."""
        self._short_conv(ctx, x, weight, bias, out, layer_id, silu)

    def _short_conv(self, ctx, x, weight, bias, out, layer_id, silu, qk=None) -> bool:
        """short_conv; `qk` (kernels/linear.py ConvQk): a fused GDN layer's q / k norm and gates in the
        conv's launch, which an extend or decode step takes where its channel tile holds whole key
        heads (a verify step never). Whether it took them."""
        path, n = self._route(ctx, "short_conv", layer_id, x.shape[0])
        if path == "extend":
            return self._conv_extend(ctx, x, weight, bias, out, layer_id, silu, qk)
        slots, state = self._step_slots(ctx), self._layer_state(layer_id, "conv")
        config = self.conv_config  # None: the launch's tile, one at every batch (fixed tiles need none of their own)
        if n == 1:
            kernels = _kernels()
            if qk is not None and not kernels.conv_qk_fits(config or kernels.conv_config(x.shape[1]), qk.q.shape[2]):
                qk = None
            kernels.short_conv_decode(x, weight, bias, out, state, slots, silu, config, qk=qk)
            return qk is not None
        inter = self.state_pool.verify_layer(layer_id, n, slots.shape[0])["conv"]
        _kernels().short_conv_verify(x, weight, bias, out, state, slots, inter, n, silu, config)
        return False
