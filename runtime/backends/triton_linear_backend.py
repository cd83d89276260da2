"""TritonLinearBackend: the linear-attention ops of every step mode on the GPU, in place on the state pool.

It serves hgc.gdn_core, hgc.kda_core, hgc.lightning_core and hgc.short_conv in all four modes:

- DECODE (one token per request, T == B rows): our Triton decode kernels (triton_linear.py), one
  launch per op, slot ids read on the device, no gather or scatter. Capturable.
- TARGET_VERIFY (every request carries the same n tokens, rows of request b are b*n .. b*n+n-1):
  the same decode kernels launched n times, launch t on the strided rows t, n+t, 2n+t, ... of
  every tensor (the kernels take row strides), so token t sees the state token t-1 left. After
  launch t < n-1 the state of each request's slot is copied into entry t of its row of the state
  pool's intermediate states (speculative decoding keeps the state of the last accepted token:
  runtime/state_pool.py `keep_verified`). The grid, the strides and the copy come from shapes
  only and slot ids from the static buffer, so this is capturable too; it moves the state n
  times, which is cheap for n <= 8 drafts and needs no chunk bookkeeping. A step whose rows are
  not laid out that way runs the extend path below (eager only; refused inside a replayed step),
  which keeps no intermediate states: speculative decoding always verifies D + 1 tokens per
  request (runtime/speculative.py).
- EXTEND and MIXED: eager. Linear cores: the step's real requests are one varlen batch for FLA's
  chunk kernels (chunk_gated_delta_rule, chunk_kda, chunk_simple_gla with g_gamma = decay):
  initial states gathered from the pool by slot, cu_seqlens from the step, final states scattered
  back to the same slots; decode rows of a mixed step are sequences of length 1. FLA plans its
  chunks on the host from the lengths (cu_seqlens_cpu), so the call is not capturable; the
  op policy keeps extend and mixed steps eager anyway. The short conv: one vectorised torch
  computation over all requests (each request's K-1 history rows placed before its tokens).
  Padded rows of `out` are zeroed and the padding slot is neither read nor written.

FLA is imported on the first extend call. Without it an extend fails with FLANotInstalled saying
what to install; there is no fallback to the slow reference (a silent 100x slowdown is a bug
report nobody can read). The FLA entry points are looked up through `fla_ops()` so CPU tests can
stand a reference in for them and check the gather / cu_seqlens / scatter plumbing.

Lifecycle (runtime/backends/protocol.py):

1. `TritonLinearBackend(state_pool)`: kernels read and write the pool's "recurrent" and "conv"
   tensors of each layer directly, by slot id.
2. `init_capture_state(max_tokens, max_seqs)`: one static slot-id buffer [max_seqs] int64 on the
   pool's device; captured kernels read slot ids from it.
3. `init_replay_state(ctx, bucket)`: copies the step's slot ids into that buffer (before capture
   and before every replay). `init_step_metadata(ctx)`: an eager step reads `ctx.state_slots`.
   `init_chunk_metadata(ctx, chunk_size)`: plans what every layer of an extend or mixed step
   shares (real slots, cu_seqlens on host and device, the conv gather indices), once per step.
4. Each op method checks shapes on the host (never reads the device in decode / target_verify).

The kernels module (and with it triton) is imported on the first op call, never at import: the
compiler imports this module on a CPU machine to read `capability`, and the CPU tests must be
able to switch Triton to its interpreter before the kernels are defined.
"""

from __future__ import annotations

import dataclasses
import importlib
import types

import torch
import torch.nn.functional as F

from compiler.splitops import MODES, BackendCapability, LayerKind, Mode
from runtime.backends.protocol import BackendHooks, BackendSetup
from runtime.context import ExecContext
from runtime.state_pool import PADDING_SLOT, StatePool

__all__ = ["TritonLinearBackend", "WrongModeError", "FLANotInstalled", "fla_ops"]


class WrongModeError(RuntimeError):
    """A linear op reached this backend in a step it cannot run that way (for example a ragged
    target-verify step inside a replayed graph)."""


class FLANotInstalled(RuntimeError):
    """An extend or mixed step needs FLA's chunk kernels and fla-core is not importable."""


def _kernels():
    return importlib.import_module("runtime.backends.triton_linear")


def fla_ops() -> types.SimpleNamespace:
    """FLA's three chunk entry points (keyword calls only: positional orders differ between them)."""
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
    return types.SimpleNamespace(gdn=chunk_gated_delta_rule, kda=chunk_kda, simple_gla=chunk_simple_gla)


@dataclasses.dataclass
class _ExtendPlan:
    """What every layer of one eager extend / mixed step shares, computed once per step."""

    ctx: ExecContext
    num_tokens: int  # real rows (the first rows of the step)
    lens: list[int]  # tokens of each request kept (requests with no token this step are skipped)
    slots: torch.Tensor  # [R] int64 on the pool's device: the kept requests' slots
    cu_seqlens: torch.Tensor  # [R+1] int64 on the device
    cu_seqlens_cpu: torch.Tensor  # [R+1] int64 on the host (FLA plans its chunks from it, no sync)
    conv: dict  # kernel width K -> (window starts [T], history rows [R*(K-1)], token rows [T], tail rows)


def _in_dtype_of(v: torch.Tensor, *tensors: torch.Tensor) -> tuple:
    """q and k in v's dtype for FLA's chunk kernels, which tl.dot them with v-sized tiles and refuse
    a mix. Kimi keeps q, k in float32 after its l2norm (as transformers does); FLA's own in-kernel
    l2norm would hand them on in the input dtype, which is what they get here."""
    return tuple(t.to(v.dtype) for t in tensors)


class TritonLinearBackend(BackendHooks):
    name = "triton_linear"
    supported_ops = frozenset({"gdn_core", "kda_core", "lightning_core", "short_conv"})
    # Every mode, so routing can bind these ops here on "cuda". Captured: decode (one decode-kernel
    # launch per op) and target_verify (n strided decode-kernel launches, shapes fixed per bucket).
    # Extend and mixed run FLA's chunk kernels, whose chunk plan is made on the host: eager.
    capability = BackendCapability(
        name="triton_linear", device="cuda", ops=supported_ops,
        modes_supported=frozenset(MODES), modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}),
        kinds=frozenset({LayerKind.GDN, LayerKind.KDA, LayerKind.LIGHTNING}),
        doc="Triton decode kernels (decode; target_verify as n strided decode launches), FLA chunk kernels "
            "for extend/mixed, torch for the extend conv; in place on the slot-indexed state pool (padding "
            "slot skipped); capturable in decode and target_verify")

    def __init__(self, state_pool: StatePool, recurrent_config=None, conv_config=None, fla=None):
        """`recurrent_config` / `conv_config` (triton_linear.RecurrentConfig / ConvConfig) pin a tile
        choice, for benchmarks; None picks one per launch from the shapes. `fla`: a namespace with
        gdn / kda / simple_gla standing in for FLA's chunk functions (tests); None imports FLA lazily."""
        self.state_pool = state_pool
        self.device = state_pool.device
        self.recurrent_config = recurrent_config
        self.conv_config = conv_config
        self._fla = fla
        self._static_slots: torch.Tensor | None = None  # [max_seqs] int64: what captured kernels read
        self._planned: tuple[ExecContext, torch.Tensor] | None = None  # (ctx, its slot ids [B])
        self._extend_plan: _ExtendPlan | None = None

    @classmethod
    def build(cls, setup: BackendSetup) -> "TritonLinearBackend":
        """Over the state pool: every kernel finds its layer's state by layer id and slot."""
        return cls(setup.state_pool)

    # -- hooks --------------------------------------------------------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Allocate the static slot-id buffer that every captured decode / target-verify graph reads."""
        self._static_slots = torch.full((max_seqs,), PADDING_SLOT, dtype=torch.int64, device=self.device)

    def init_replay_state(self, ctx: ExecContext, bucket: int) -> None:
        """Copy this step's slot ids into the static buffer read by the graph of `bucket`."""
        if self._static_slots is None:
            raise RuntimeError(f"{self.name}: init_replay_state before init_capture_state")
        if ctx.num_seqs != bucket or bucket > self._static_slots.shape[0]:
            raise RuntimeError(f"{self.name}: step of {ctx.num_seqs} requests replayed in bucket {bucket} "
                               f"(static buffers hold {self._static_slots.shape[0]}); the graph runner pads "
                               f"steps to their bucket before replay")
        slots = self._static_slots[:bucket]
        slots.copy_(ctx.state_slots, non_blocking=True)
        self._planned = (ctx, slots)
        self._extend_plan = None

    def init_step_metadata(self, ctx: ExecContext) -> None:
        """An eager step: decode kernels read ctx.state_slots where it lies; forget the last plans."""
        self._planned = None
        self._extend_plan = None

    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Plan the extend path once for all layers: real slots, cu_seqlens (host and device).

        FLA chooses its own chunk length (64), so `chunk_size` (the engine's token budget) sizes
        nothing here."""
        self._extend_plan = self._make_plan(ctx)

    # -- helpers --------------------------------------------------------------------------------

    def _step_slots(self, ctx: ExecContext) -> torch.Tensor:
        """Slot ids [B] for this step on the pool's device: the static buffer in a replayed step."""
        if self._planned is not None and self._planned[0] is ctx:
            return self._planned[1]
        slots = ctx.state_slots
        if slots.device != self.device:
            slots = slots.to(self.device, non_blocking=True)
        return slots

    def _verify_width(self, ctx: ExecContext, rows: int) -> int | None:
        """Tokens per request n if this target-verify step has rows b*n .. b*n+n-1 for request b."""
        B = ctx.num_seqs
        if B == 0 or rows % B:
            return None
        n = rows // B
        return n if all(q == n for q in ctx.query_lens) else None

    def _route(self, ctx: ExecContext, op: str, layer_id: int, rows: int) -> tuple[str, int]:
        """('decode', 1), ('verify', n) or ('extend', 0): which path this op call takes."""
        mode = Mode(ctx.mode)
        replayed = self._planned is not None and self._planned[0] is ctx
        if mode == Mode.DECODE:
            if rows != ctx.num_seqs:
                raise ValueError(f"{self.name}: hgc.{op} (layer {layer_id}) got {rows} rows for {ctx.num_seqs} "
                                 f"requests; a decode step has exactly one row per request, padding included")
            return "decode", 1
        if mode == Mode.TARGET_VERIFY:
            n = self._verify_width(ctx, rows)
            if n is not None:
                return "verify", n
            if replayed:
                raise WrongModeError(
                    f"{self.name}: hgc.{op} (layer {layer_id}): a replayed target_verify step must give every "
                    f"request the same number of rows (rows {rows}, requests {ctx.num_seqs}, lengths "
                    f"{ctx.query_lens}); ragged verify steps only run eagerly")
            return "extend", 0
        if replayed:
            raise WrongModeError(f"{self.name}: hgc.{op} (layer {layer_id}) in a replayed {mode.value!r} step; "
                                 f"extend and mixed steps of linear layers run eagerly (FLA chunk kernels)")
        return "extend", 0

    def _layer_state(self, layer_id: int, entry: str) -> torch.Tensor:
        return self.state_pool.layer(layer_id)[entry]

    def _fla_ops(self) -> types.SimpleNamespace:
        if self._fla is None:
            self._fla = fla_ops()
        return self._fla

    def _make_plan(self, ctx: ExecContext) -> _ExtendPlan:
        keep = [b for b, n in enumerate(ctx.query_lens) if n > 0]
        lens = [ctx.query_lens[b] for b in keep]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        cu_cpu = torch.tensor(cu, dtype=torch.int64)
        slots = self._step_slots(ctx)[:ctx.num_real_seqs]
        if len(keep) != ctx.num_real_seqs:
            slots = slots[torch.tensor(keep, dtype=torch.int64, device=slots.device)]
        if len(keep) == ctx.num_real_seqs and ctx.query_start_loc.device == self.device:
            cu_dev = ctx.query_start_loc[:len(keep) + 1].to(torch.int64)  # already on the device: no copy
        else:
            cu_dev = cu_cpu.to(self.device, non_blocking=True)
        return _ExtendPlan(ctx, ctx.num_real_tokens, lens, slots.to(torch.int64), cu_dev, cu_cpu, {})

    def _plan(self, ctx: ExecContext) -> _ExtendPlan:
        if self._extend_plan is None or self._extend_plan.ctx is not ctx:
            self._extend_plan = self._make_plan(ctx)  # a caller that skipped init_chunk_metadata (tests)
        return self._extend_plan

    @staticmethod
    def _rows(t: torch.Tensor, t0: int, n: int) -> torch.Tensor:
        """Rows t0, t0+n, t0+2n, ... of t: token t0 of every request in a target-verify step."""
        return t[t0::n]

    # -- the extend path (eager) ---------------------------------------------------------------

    def _chunk(self, ctx, op, layer_id, out, call) -> None:
        """Run one FLA chunk call over the step's real requests, states gathered and scattered by slot."""
        plan = self._plan(ctx)
        T = plan.num_tokens
        if T > 0 and plan.lens:
            states = self._layer_state(layer_id, "recurrent")
            h0 = states.index_select(0, plan.slots)  # [R, H, Dk, Dv] float32, a copy FLA may overwrite
            o, ht = call(self._fla_ops(), T, h0, plan)
            if ht is None or tuple(ht.shape) != tuple(h0.shape):
                raise RuntimeError(f"{self.name}: hgc.{op} (layer {layer_id}): FLA returned a final state of shape "
                                   f"{None if ht is None else tuple(ht.shape)}, expected {tuple(h0.shape)}")
            out[:T].copy_(o.reshape(out[:T].shape))
            states.index_copy_(0, plan.slots, ht.to(states.dtype))
        if out.shape[0] > T:
            out[T:].zero_()

    def _gdn_extend(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        q, k = _in_dtype_of(v, q, k)
        def call(fla, T, h0, plan):
            return fla.gdn(q=q[None, :T], k=k[None, :T], v=v[None, :T], g=g[None, :T], beta=beta[None, :T],
                           scale=scale, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=plan.cu_seqlens, cu_seqlens_cpu=plan.cu_seqlens_cpu)
        self._chunk(ctx, "gdn_core", layer_id, out, call)

    def _kda_extend(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        q, k = _in_dtype_of(v, q, k)
        def call(fla, T, h0, plan):
            return fla.kda(q=q[None, :T], k=k[None, :T], v=v[None, :T], g=g[None, :T], beta=beta[None, :T],
                           scale=scale, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=plan.cu_seqlens, cu_seqlens_cpu=plan.cu_seqlens_cpu)
        self._chunk(ctx, "kda_core", layer_id, out, call)

    def _lightning_extend(self, ctx, q, k, v, decay, out, layer_id, scale):
        q, k = _in_dtype_of(v, q, k)
        def call(fla, T, h0, plan):
            # g_gamma: FLA's constant per-head log-decay, exactly Lightning's; no [T, H] gate tensor.
            return fla.simple_gla(q=q[None, :T], k=k[None, :T], v=v[None, :T], g_gamma=decay.float(), scale=scale,
                                  initial_state=h0, output_final_state=True, cu_seqlens=plan.cu_seqlens,
                                  cu_seqlens_cpu=plan.cu_seqlens_cpu)
        self._chunk(ctx, "lightning_core", layer_id, out, call)

    def _conv_indices(self, plan: _ExtendPlan, K: int):
        """Gather indices of the extend conv for kernel width K, made once per step (host lists, one copy).

        Request r's block in the scratch E [T + R*(K-1), C] is its K-1 history rows then its tokens,
        at offset cu[r] + r*(K-1). Token i of request r reads E[cu[r] + r*(K-1) + i + j], j < K; the
        new history is the block's last K-1 rows."""
        if K not in plan.conv:
            P = K - 1
            win, hist, tok, tail = [], [], [], []
            for r, n in enumerate(plan.lens):
                off = int(plan.cu_seqlens_cpu[r]) + r * P
                hist.extend(range(off, off + P))
                tok.extend(range(off + P, off + P + n))
                win.extend(range(off, off + n))
                tail.extend(range(off + n, off + n + P))
            idx = torch.tensor([win, tok], dtype=torch.int64).to(self.device, non_blocking=True)
            side = torch.tensor([hist, tail], dtype=torch.int64).to(self.device, non_blocking=True)
            plan.conv[K] = (idx[0], side[0], idx[1], side[1])
        return plan.conv[K]

    def _conv_extend(self, ctx, x, weight, bias, out, layer_id, silu):
        plan = self._plan(ctx)
        T = plan.num_tokens
        if T > 0 and plan.lens:
            states = self._layer_state(layer_id, "conv")  # [slots+1, C, K-1]
            C, K = weight.shape
            R, P = len(plan.lens), K - 1
            win, hist, tok, tail = self._conv_indices(plan, K)
            E = torch.empty(T + R * P, C, dtype=torch.float32, device=x.device)
            E[hist] = states.index_select(0, plan.slots).float().transpose(1, 2).reshape(R * P, C)
            E[tok] = x[:T].float()
            w = weight.float()
            y = E[win] * w[:, 0]
            for j in range(1, K):  # same order of additions as the reference's sum over the window
                y = y + E[win + j] * w[:, j]
            if bias is not None:
                y = y + bias.float()
            out[:T].copy_(F.silu(y) if silu else y)
            states.index_copy_(0, plan.slots, E[tail].reshape(R, P, C).transpose(1, 2).to(states.dtype))
        if out.shape[0] > T:
            out[T:].zero_()

    def _keep_intermediate(self, ctx: ExecContext, layer_id: int, entry: str, state: torch.Tensor,
                           slots: torch.Tensor, t: int, n: int) -> None:
        """After token t of a target-verify step (t < n-1): each row's slot state into its entry t.
        Padded rows copy the padding slot into rows no real request reads this step."""
        if t < n - 1:
            rows = slots.shape[0]
            verify = self.state_pool.verify_layer(layer_id, n, rows)[entry]
            verify[:rows, t].copy_(state.index_select(0, slots))

    # -- ops ------------------------------------------------------------------------------------

    def gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        path, n = self._route(ctx, "gdn_core", layer_id, q.shape[0])
        if path == "extend":
            return self._gdn_extend(ctx, q, k, v, g, beta, out, layer_id, scale)
        slots, state, r = self._step_slots(ctx), self._layer_state(layer_id, "recurrent"), self._rows
        for t in range(n):  # decode: n == 1, the whole tensors
            _kernels().gdn_decode(r(q, t, n), r(k, t, n), r(v, t, n), r(g, t, n), r(beta, t, n), r(out, t, n),
                                  state, slots, scale, self.recurrent_config)
            self._keep_intermediate(ctx, layer_id, "recurrent", state, slots, t, n)

    def kda_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        path, n = self._route(ctx, "kda_core", layer_id, q.shape[0])
        if path == "extend":
            return self._kda_extend(ctx, q, k, v, g, beta, out, layer_id, scale)
        slots, state, r = self._step_slots(ctx), self._layer_state(layer_id, "recurrent"), self._rows
        for t in range(n):
            _kernels().kda_decode(r(q, t, n), r(k, t, n), r(v, t, n), r(g, t, n), r(beta, t, n), r(out, t, n),
                                  state, slots, scale, self.recurrent_config)
            self._keep_intermediate(ctx, layer_id, "recurrent", state, slots, t, n)

    def lightning_core(self, ctx, q, k, v, decay, out, layer_id, scale):
        path, n = self._route(ctx, "lightning_core", layer_id, q.shape[0])
        if path == "extend":
            return self._lightning_extend(ctx, q, k, v, decay, out, layer_id, scale)
        slots, state, r = self._step_slots(ctx), self._layer_state(layer_id, "recurrent"), self._rows
        for t in range(n):
            _kernels().lightning_decode(r(q, t, n), r(k, t, n), r(v, t, n), decay, r(out, t, n), state, slots, scale,
                                        self.recurrent_config)
            self._keep_intermediate(ctx, layer_id, "recurrent", state, slots, t, n)

    def short_conv(self, ctx, x, weight, bias, out, layer_id, silu):
        path, n = self._route(ctx, "short_conv", layer_id, x.shape[0])
        if path == "extend":
            return self._conv_extend(ctx, x, weight, bias, out, layer_id, silu)
        slots, state, r = self._step_slots(ctx), self._layer_state(layer_id, "conv"), self._rows
        for t in range(n):
            _kernels().short_conv_decode(r(x, t, n), weight, bias, r(out, t, n), state, slots, silu, self.conv_config)
            self._keep_intermediate(ctx, layer_id, "conv", state, slots, t, n)
