"""TritonLinearBackend: the linear-attention ops of decode steps on Triton kernels, in place on the state pool.

It serves hgc.gdn_core, hgc.kda_core, hgc.lightning_core and hgc.short_conv for DECODE steps only
(one token per request, T == B rows); any other mode is refused with an error naming it, because
routing must send extend, mixed and target-verify steps to a backend that declares them.

Lifecycle (runtime/backends/protocol.py):

1. `TritonLinearBackend(state_pool)`: kernels read and write the pool's "recurrent" and "conv"
   tensors of each layer directly, by slot id; nothing is copied.
2. `init_capture_state(max_tokens, max_seqs)`: allocates one static slot-id buffer [max_seqs]
   int64 on the pool's device. Captured kernels read slot ids from it.
3. `init_replay_state(ctx, bucket)`: copies the step's slot ids into that buffer (before capture
   and before every replay), so a replayed graph updates this step's slots.
   `init_step_metadata(ctx)`: an eager step reads `ctx.state_slots` itself.
4. Each op method checks shapes on the host (never reads the device), then launches one kernel
   whose grid comes from the shapes: safe inside a CUDA graph.

Padding requests point at the reserved slot (runtime.state_pool.PADDING_SLOT): the kernels skip
their state and write zeros to their output rows, whatever their inputs hold.

The kernels module (and with it triton) is imported on the first op call, never at import: the
compiler imports this module on a CPU machine to read `capability`, and the CPU tests must be
able to switch Triton to its interpreter before the kernels are defined.
"""

from __future__ import annotations

import importlib

import torch

from compiler.splitops import LayerKind, Mode
from runtime.backends.capability import BackendCapability
from runtime.backends.protocol import BackendHooks
from runtime.context import ExecContext
from runtime.state_pool import PADDING_SLOT, StatePool

__all__ = ["TritonLinearBackend", "WrongModeError"]


class WrongModeError(RuntimeError):
    """A linear op reached this decode-only backend in a step of another mode (a routing bug)."""


def _kernels():
    return importlib.import_module("runtime.backends.triton_linear")


class TritonLinearBackend(BackendHooks):
    name = "triton_linear"
    supported_ops = frozenset({"gdn_core", "kda_core", "lightning_core", "short_conv"})
    # The kernels implement one token per request, so decode is all this backend supports (and
    # it may be captured there). Routing sends the other modes of these ops to another backend;
    # the op methods refuse them loudly.
    capability = BackendCapability(
        name="triton_linear", device="cuda", ops=supported_ops,
        modes_supported=frozenset({Mode.DECODE}), modes_capturable=frozenset({Mode.DECODE}),
        kinds=frozenset({LayerKind.GDN, LayerKind.KDA, LayerKind.LIGHTNING}),
        doc="Triton decode kernels for GDN, KDA, Lightning and the short conv, in place on the slot-indexed "
            "state pool (padding slot skipped); decode only, capturable")

    def __init__(self, state_pool: StatePool, recurrent_config=None, conv_config=None):
        """`recurrent_config` / `conv_config` (triton_linear.RecurrentConfig / ConvConfig) pin a tile
        choice, for benchmarks; None picks one per launch from the shapes."""
        self.state_pool = state_pool
        self.device = state_pool.device
        self.recurrent_config = recurrent_config
        self.conv_config = conv_config
        self._static_slots: torch.Tensor | None = None  # [max_seqs] int64: what captured kernels read
        self._planned: tuple[ExecContext, torch.Tensor] | None = None  # (ctx, its slot ids [B])

    # -- hooks --------------------------------------------------------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Allocate the static slot-id buffer that every captured decode graph reads."""
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

    def init_step_metadata(self, ctx: ExecContext) -> None:
        """Nothing to plan for an eager step: the kernels read ctx.state_slots where it lies."""
        self._planned = None

    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Nothing to plan: this backend never runs extend or mixed steps (routing sends them elsewhere)."""

    # -- helpers --------------------------------------------------------------------------------

    def _slots(self, ctx: ExecContext, op: str, layer_id: int, rows: int) -> torch.Tensor:
        """Slot ids [B] for this step on the pool's device: the static buffer in a captured step."""
        if ctx.mode != Mode.DECODE:
            raise WrongModeError(
                f"{self.name}: hgc.{op} (layer {layer_id}) was called in a {Mode(ctx.mode).value!r} step; "
                f"this backend implements decode only (one token per request). Routing must send "
                f"{Mode(ctx.mode).value} steps of linear layers to a backend that declares that mode.")
        if rows != ctx.num_seqs:
            raise ValueError(f"{self.name}: hgc.{op} (layer {layer_id}) got {rows} rows for {ctx.num_seqs} "
                             f"requests; a decode step has exactly one row per request, padding included")
        if self._planned is not None and self._planned[0] is ctx:
            return self._planned[1]
        slots = ctx.state_slots
        if slots.device != self.device:
            slots = slots.to(self.device, non_blocking=True)
        return slots

    def _layer_state(self, layer_id: int, entry: str) -> torch.Tensor:
        return self.state_pool.layer(layer_id)[entry]

    # -- ops ------------------------------------------------------------------------------------

    def gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        slots = self._slots(ctx, "gdn_core", layer_id, q.shape[0])
        _kernels().gdn_decode(q, k, v, g, beta, out, self._layer_state(layer_id, "recurrent"), slots, scale,
                     self.recurrent_config)

    def kda_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        slots = self._slots(ctx, "kda_core", layer_id, q.shape[0])
        _kernels().kda_decode(q, k, v, g, beta, out, self._layer_state(layer_id, "recurrent"), slots, scale,
                     self.recurrent_config)

    def lightning_core(self, ctx, q, k, v, decay, out, layer_id, scale):
        slots = self._slots(ctx, "lightning_core", layer_id, q.shape[0])
        _kernels().lightning_decode(q, k, v, decay, out, self._layer_state(layer_id, "recurrent"), slots, scale,
                           self.recurrent_config)

    def short_conv(self, ctx, x, weight, bias, out, layer_id, silu):
        slots = self._slots(ctx, "short_conv", layer_id, x.shape[0])
        _kernels().short_conv_decode(x, weight, bias, out, self._layer_state(layer_id, "conv"), slots, silu,
                            self.conv_config)
