"""Triton kernels for the linear-attention cores (GDN, KDA, Lightning) and the short conv.

What this module owns: the decode kernels and their launchers (one token per request, T == B
rows), the recurrent cores' short-extend kernel (a few tokens per request, run one after another
through the state in registers: `recurrent_extend`), and the short convolution's extend kernel
(any number of tokens per request), each reading and updating the slot-indexed state pool in
place.

1. One program per (request, value head, Dv tile). It loads the request's slot id, and for a
   real request the [Dk, BV] tile of that slot's state straight from the pool (no gather copy),
   the token's q/k/v, its gate and beta, all in float32 registers.
2. The whole update happens on that one tile in registers, then the tile is stored back to the
   same addresses and the output row written once. Rows whose slot is the padding slot load
   nothing, store no state and write zeros to `out`.
3. The launch grid comes from tensor shapes only and the launchers never read a device value,
   so a launch can be captured in a CUDA graph and replayed with new slot ids and inputs.

The update is rearranged so that both reductions over Dk read the *old* state (one pass,
independent reductions, nothing waits on a rewritten tile). With D = diag(exp(g)) acting on
the key dimension and q already scaled:

    a = (D k)^T S          predicted value of the old state under this token's decay     [BV]
    c = (D q)^T S          query read of the decayed old state                           [BV]
    u = beta (v - a)       delta-rule correction (Lightning: u = v, no beta)             [BV]
    S' = D S + k u^T       new state                                                      [BK, BV]
    o = c + (q . k) u      = q^T S', without a second reduction over the new tile         [BV]

GDN is the scalar-decay case with key head h // (Hv / Hk); KDA the per-channel decay; Lightning
a constant per-head decay without the delta rule. All three are one kernel with constexpr flags.
Every stored state element is computed from the element loaded at the same address, so the
in-place store cannot overtake a load in another thread.

The decode conv has one program per (request, channel tile): it loads the slot's last K-1
inputs, convolves them with this token's input (bias, silu), and rolls the history in place.
There a stored column comes from another column, so all loads precede one barrier and all
stores follow it.

The extend conv (`short_conv_extend`) has one program per (token block, channel tile). The
step's token blocks are a table the caller plans once per step and shares across layers: each
row names a request and a block of CONV_EXTEND_BLOCK_T of its tokens; one last pseudo-request
holds the padding rows, whose programs write zeros. A program convolves its tokens with the K-1 inputs
before them, taken from x or, for a request's first K-1 tokens, from the slot's history; the
program of a request's first block also writes the slot's new history (see _conv_new_history for
why no other program can race it). Two layouts of a program's work, chosen by ConvConfig.rows: a
[block, channels] tile, one shifted load of x per tap; or row streaming, a wider channel tile
walked one token row at a time with the K-1 earlier inputs in registers (x read once; K <= 4).

The short-extend kernel has one program per (request, value head, Dv tile): the decode kernel's
update (`_token_step`, shared) applied to the request's tokens in order, the tile loaded once and
stored once. Its time grows with the longest request, so it serves steps of short requests only;
long prefills take the chunk kernels. Given one more bound than requests, one more program row
writes zeros over the padding rows past the last request, and a request on the padding slot
touches no state: a captured bucket's launch reads its requests, bounds and slots from static
tables and is correct for any real layout the bucket replays (runtime/backends/triton_linear.py).

Not here: the recurrent cores' long extend/prefill (FLA's chunk kernels, called by the backend),
l2-normalisation of q/k and the gate activations that produce g and beta (they stay in the
graph), and which backend serves a layer.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, next_pow2
from runtime.backends.kernels.pdl import launch_args, pdl_wait
from runtime.backends.kernels.sm_count import num_sms
from runtime.cache.state_pool import PADDING_SLOT, STATE_DTYPES, STATE_TORCH_DTYPES

__all__ = [
    "GATE_PER_HEAD", "GATE_PER_CHANNEL", "GATE_CONSTANT",
    "RecurrentConfig", "ConvConfig", "recurrent_config", "conv_config", "fixed_recurrent_config", "whole_row_config",
    "gdn_decode", "kda_decode", "lightning_decode", "short_conv_decode", "recurrent_decode", "recurrent_extend",
    "recurrent_verify", "short_conv_verify", "extend_config", "walk_recurrent_config",
    "CONV_EXTEND_BLOCK_T", "conv_extend_config", "conv_extend_rows_config", "conv_extend_takes_rows",
    "short_conv_extend", "StepSnapshots", "history_strided", "ConvQk", "conv_qk_fits", "GatedNorm", "l2norm_head",
    "gdn_gates", "gated_norm_head", "rounds_weighted_norm",
]

# How the log-decay is given (a constexpr of the kernel).
GATE_PER_HEAD = 0  # GDN: g [T, H], one decay per token and value head
GATE_PER_CHANNEL = 1  # KDA: g [T, H, Dk], one decay per token, head and key channel
GATE_CONSTANT = 2  # Lightning: decay [H], the same for every token
OP_OF_GATE = {GATE_PER_HEAD: "gdn_core", GATE_PER_CHANNEL: "kda_core", GATE_CONSTANT: "lightning_core"}


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    block_v: int  # BV: Dv columns of the state one program owns (a power of two)
    num_warps: int
    # Decode only. 0: one program a (request, value head, Dv tile). n > 0: n programs an SM, each
    # walking tiles a grid's width apart in a loop that loads the next `stages` - 1 tiles' state
    # while it computes this one (`_recurrent_walk_kernel`; verify launches ignore it).
    walk: int = 0
    stages: int = 2


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    block_c: int  # channels one program owns (a power of two)
    num_warps: int
    # The extend conv's layout: False the [token block, block_c] tile, True row streaming (one
    # row of block_c channels at a time, the window in registers; K <= 4). The decode conv has one.
    rows: bool = False


def rounds_weighted_norm(norm_weight: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether torch rounds norm_weight * norm (the norm in out's dtype) to out's dtype."""
    return torch.promote_types(norm_weight.dtype, out.dtype) == out.dtype


class GatedNorm(NamedTuple):
    """The gated RMSNorm a GDN mixer applies to its core's outputs (kernels/gdn_fused.py
    `gated_rmsnorm`), for a kernel that makes them to apply as it stores them (the chunk output
    kernel, kernels/chunk.py; the decode recurrence): z [rows, Hv, Dv] (unit last stride), the
    norm's weight [Dv] and its epsilon."""

    z: torch.Tensor
    weight: torch.Tensor
    eps: float


class ConvQk(NamedTuple):
    """A fused GDN layer's q / k l2norm and gates, which the extend and decode convs may compute as
    they store their outputs (the fused op's `qk_gates`, kernels/gdn_fused.py, in the conv's launch): the conv's
    channels are q | k | v, Hk x Dk each of q and k. Written: q, k [rows, Hk, Dk] (contiguous; the
    conv's own q and k outputs are not stored), g [rows, Hv] float32 and beta [rows, Hv] (unit head
    stride). Read: b, a [rows, Hv] (any row and head strides), A_log and dt_bias [Hv]. The constants
    are the op's (gdn_fused.L2NORM_EPS, SOFTPLUS_THRESHOLD)."""

    q: torch.Tensor
    k: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    l2_eps: float
    softplus_max: float


def conv_qk_fits(config: ConvConfig, key_dim: int) -> bool:
    """Whether a conv's channel tile `config` can take `ConvQk`: whole heads of `key_dim`
    channels a program (a head's l2norm is a reduction in one program; q and k start at channels
    that are multiples of it)."""
    return config.block_c % key_dim == 0


@dataclasses.dataclass(frozen=True)
class StepSnapshots:
    """One layer entry's in-step snapshots of an extend step (the prefix cache's, docs/DESIGN.md
    "The prefix cache's snapshots"): request r's state after its first rows[r] rows of the step
    (rows[r] >= 0; -1: none) goes to pool[ids[r]]. rows, ids: int64 on the device, an entry per
    request that has rows (a captured step's last, always empty request may have none); pool: the
    snapshot pool's tensor of the layer's entry, laid out as the state pool's (same shape and strides
    past the first dimension), so the kernels address a snapshot as they address a slot."""

    rows: torch.Tensor
    ids: torch.Tensor
    pool: torch.Tensor

    @staticmethod
    def none(requests: int, state: torch.Tensor) -> "StepSnapshots":
        """No snapshots: a table of -1 (kept alive and only grown: a captured launch may hold its
        address) and the state itself as the pool, never written."""
        held = _NO_SNAPSHOT_ROWS.get(state.device)
        if held is None or held.shape[0] < requests:
            held = torch.full((max(64, next_pow2(requests)),), -1, dtype=torch.int64, device=state.device)
            _NO_SNAPSHOT_ROWS[state.device] = held
            _RETIRED.append(held)
        return StepSnapshots(held, held, state)

    def checked(self, op: str, requests: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, ids, pool) for a launch over `requests` requests of `state`, or an error naming the op."""
        rows, ids, pool = self.rows, self.ids, self.pool
        assert rows.dtype == ids.dtype == torch.int64 and rows.dim() == ids.dim() == 1, (
            f"{op}: snapshot rows and ids must be int64 vectors, got {rows.dtype} {tuple(rows.shape)}, "
            f"{ids.dtype} {tuple(ids.shape)}")
        assert min(rows.shape[0], ids.shape[0]) >= requests - 1, (
            f"{op}: snapshot tables of {rows.shape[0]} / {ids.shape[0]} entries for {requests} requests")
        assert pool.shape[1:] == state.shape[1:] and pool.stride()[1:] == state.stride()[1:] and (
            pool.dtype == state.dtype and pool.device == state.device == rows.device == ids.device), (
            f"{op}: the snapshot pool {pool.dtype} {tuple(pool.shape)} strides {pool.stride()} is not laid out as the "
            f"state {state.dtype} {tuple(state.shape)} strides {state.stride()}")
        return rows, ids, pool


_NO_SNAPSHOT_ROWS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # every -1 table ever handed out (a captured launch may hold one)


@functools.lru_cache(maxsize=None)  # a pure function of its arguments, on every launch path
def recurrent_config(batch: int, heads: int, dk: int, dv: int, device: torch.device) -> RecurrentConfig:
    """Tile choice for a decode launch of `batch` rows of `heads` value heads.

    The kernel is bound by the state bytes; what limits it at small batch is how many programs
    are in flight to keep every SM's loads outstanding. Take the widest Dv tile (fewer, larger
    programs: less per-program overhead, and q, k and the gates loaded once for more columns) that
    still gives about four programs per SM; at batch 1 with 32 heads of 128 that is BV=8 (512
    programs). About 32 state floats a thread, 64 in a tile of 64 columns (4 warps at Dk = 128).

    Why 64 columns at large batches: in the H200 tile sweep (`gpu_linear_decode_h200_2026-11-26.json`,
    benchmarks/kernels/gpu_linear_decode.py; Dk = Dv = 128) 64 columns on 4 warps took 34.9 / 64.6 /
    246.2 us for GDN at batch 32 / 64 / 256 against 37.9 / 73.1 / 288.7 for 32 columns (KDA and
    Lightning alike), and 8 warps were slower than 4 (44.2 / 80.4 / 298.1).
    """
    target = 4 * num_sms(device)
    max_bv = next_pow2(dv)
    block_v = min(8, max_bv)
    for bv in (64, 32, 16, 8):
        if bv <= max_bv and batch * heads * cdiv(dv, bv) >= target:
            block_v = bv
            break
    per_thread = 64 if block_v == 64 else 32  # state floats a thread
    num_warps = max(1, min(8, next_pow2(dk) * block_v // (32 * per_thread)))
    return RecurrentConfig(block_v, num_warps)


def whole_row_config(dk: int, dv: int) -> RecurrentConfig:
    """A decode tile of a head's whole Dv row (what `recurrent_decode`'s gated norm needs), warps as
    `recurrent_config` gives a tile of 64 columns: about 64 state floats a thread (8 warps at Dk = Dv
    = 128). Compiled for sm90 at those dims over bfloat16 states: 127 registers (126 with the norm),
    2 programs an SM, the same 64 KiB of state in flight an SM as the default tile's 4 programs of 64
    columns (docs/DESIGN.md, "Recurrent states in bfloat16")."""
    block_v = next_pow2(dv)
    return RecurrentConfig(block_v, max(1, min(8, next_pow2(dk) * block_v // (32 * 64))))


# The decode conv's tile: this many channels a program, on a warp per this many (8 channels a thread:
# a 16-byte vector of each bfloat16 history column in the state pool's [K-1, C] storage), at every
# request count. In conv_decode_probe.py on an H100 (bench qwen3_next's 8192 channels, bfloat16) the
# probe's kernel of this tile over that storage took 1.80 / 3.63 / 8.08 / 14.04 us at 1 / 32 / 128 /
# 256 requests, within 0.4 us of its best tile (512 to 2048 channels on 2 to 8 warps) at each; the
# kernel over [C, K-1] storage before 1.90 / 4.65 / 11.76 / 20.53. This kernel, before it took the
# weight's row stride as K and the probe's store order, 2.49 / 4.60 / 10.82 / 16.95; since, 1.80 /
# 3.86 / 8.11 / 13.94 beside the probe's 1.81 / 3.67 / 8.04 / 13.95 in the same run
# (conv_decode_probe_h100_2026-12-06.json, conv_decode_probe_runtime_tile_h100_2026-12-06.json,
# conv_decode_probe_final_h100_2026-12-07.json; docs/DESIGN.md "Convolution histories stored
# channels-last").
DECODE_CONV_CHANNELS = 256


def conv_config(channels: int) -> ConvConfig:
    """Channel tile of the decode and verify convs: DECODE_CONV_CHANNELS channels a program, a warp
    per DECODE_CONV_CHANNELS (fewer where the layer has fewer channels). One tile at every request
    count, so decode_tiles="fixed" (batch invariance) needs no conv tile of its own."""
    block_c = min(DECODE_CONV_CHANNELS, max(32, next_pow2(channels)))
    return ConvConfig(block_c, max(1, block_c // DECODE_CONV_CHANNELS))


# decode_tiles="walk": decode launches of many tiles walk them (RecurrentConfig.walk). Programs an
# SM and stages in flight: from its sm90 compile (kernel_resources_probe.py --decode-tiles walk;
# bfloat16 states, 64 Dv columns, 4 warps, 2 stages: 161 registers a thread, 17.6 KiB of shared
# memory, 3 programs an SM); a
# launch walks only where each program gets WALK_MIN_TILES tiles or more, since below that the
# loop's prologue is most of a program's work. Measured slower than one program a tile (an H100,
# 128 requests over bfloat16 states: 136.5 against 95.4 us; docs/DESIGN.md "Recurrent states in
# bfloat16"), so no build takes it unless asked.
WALK_PER_SM = 3
WALK_STAGES = 2
WALK_MIN_TILES = 4


@functools.lru_cache(maxsize=None)  # a pure function of its arguments, on every launch path
def walk_recurrent_config(batch: int, heads: int, dk: int, dv: int, device: torch.device) -> RecurrentConfig:
    """The decode tile of decode_tiles="walk": `recurrent_config`'s, walked where the launch has at
    least WALK_MIN_TILES tiles a program (bench qwen3_next: from 25 requests)."""
    cfg = recurrent_config(batch, heads, dk, dv, device)
    if batch * heads * cdiv(dv, cfg.block_v) < WALK_MIN_TILES * WALK_PER_SM * num_sms(device):
        return cfg
    return dataclasses.replace(cfg, walk=WALK_PER_SM, stages=WALK_STAGES)


# decode_tiles="fixed" (hgc compile --batch-invariant): one tile for every request count, since a
# different tile reduces a request's state and window in a different order. The tile chosen is the
# one that serves a full batch best, not one request's: in the tile sweep of
# benchmarks/kernels/gpu_linear_decode.py (benchmarks/history/batch_invariant.md, second run; GDN at 32
# heads of 128) one request's tiles (Dv 8, 1 warp) took 1.9x the time of these at batch 32 and 3.4x
# at batch 256, while these cost at most 0.2 us more than one request's tiles at batch 1. The
# decode conv's tile is one for every batch already (`conv_config`).


def extend_config(heads: int, dk: int, dv: int, device: torch.device) -> RecurrentConfig:
    """The short-extend kernel's tile: one request's decode tile (the most programs in flight; a
    short prompt on an idle engine is the step whose latency this kernel is for), whatever the
    step holds. One tile for every request count, since the tile sets the order a token's
    reductions run in: a captured bucket (its padding requests launched too) and the eager step of
    the same requests then compute the same bits."""
    return recurrent_config(1, heads, dk, dv, device)


@functools.lru_cache(maxsize=None)
def fixed_recurrent_config(heads: int, dk: int, dv: int, device: torch.device) -> RecurrentConfig:
    """The decode and verify tile of decode_tiles="fixed": what `recurrent_config` picks once the
    batch fills the device (Dv 64, 4 warps at Dk = Dv = 128)."""
    return recurrent_config(4 * num_sms(device), heads, dk, dv, device)


# Tokens one extend-conv program owns. The block table is planned once per step for this size,
# so it is one constant, not a per-launch choice. It must be at least K-1, so that only a
# request's first block reaches back into the slot's history (see _short_conv_extend_kernel).
CONV_EXTEND_BLOCK_T = 32


@functools.lru_cache(maxsize=None)  # a pure function of its arguments, on every launch path
def conv_extend_config(num_blocks: int, channels: int, device: torch.device) -> ConvConfig:
    """Channel tile of the extend conv: the widest up to 128 that still gives about two programs per
    SM (a long prompt: 128 channels, 4 warps; a few short requests: narrower tiles, more programs),
    with ~32 elements of the [CONV_EXTEND_BLOCK_T, block_c] tile per thread.

    128 and not 256: on the H200 at bench qwen3_next's 8192 channels, 128 channels / 4 warps took 0.117
    ms at 4096 tokens and 0.073 ms at 2048 against 0.136 and 0.083 for 256 / 8 (the best of the sweep's
    tiles, 0.115 and 0.071, within 3%; benchmarks/results/conv_extend_tiles_h200_2026-12-04.log)."""
    target = 2 * num_sms(device)
    block_c = 32
    for bc in (128, 64, 32):
        if num_blocks * cdiv(channels, bc) >= target:
            block_c = bc
            break
    block_c = min(block_c, max(32, next_pow2(channels)))
    return ConvConfig(block_c, max(1, min(8, CONV_EXTEND_BLOCK_T * block_c // 1024)))


# The row-streaming extend conv keeps at most three earlier inputs of a channel in registers.
CONV_EXTEND_ROWS_MAX_K = 4
# Steps of at least this many rows take it (and shorter ones over long tables: conv_extend_takes_rows).
# Each program walks its 32 rows in turn, four loads ahead, so a short step's few programs wait on
# memory where the tile kernel's many do not: in bench qwen3_next's one-request steps on the H200
# (8192 channels) rows took 26 us at 512 tokens against the tile's 15, and 70 against 85 at 4096
# (steps between unmeasured; the kernel alone at 2048: 53 against 73 us). The kernels alone over
# one request's table, x warm in L2, on an H100: 13.3 against 13.9 us at 512, 66.7 against 93.6 at
# 4096 (chunk_walk_one_request_two_an_sm_h100_2026-12-07.json); the whole-step figures decide.
CONV_EXTEND_ROWS_MIN_TOKENS = 2048


def conv_extend_takes_rows(rows: int, table_blocks: int, width: int) -> bool:
    """Whether an extend conv of `rows` rows (padding included) over a block table of
    `table_blocks` rows takes the row-streaming kernel (triton_linear's default): at least
    CONV_EXTEND_ROWS_MIN_TOKENS rows, or a table of more than twice the blocks those rows fill
    (one laid out for many requests, as a served artifact's buckets are: min(tokens, 256) request
    rows), for kernel widths up to CONV_EXTEND_ROWS_MAX_K.

    Every table row is a program of either kernel, empty or not, and the tile kernel has eight
    times the row kernel's programs a block row (128 channels against 1024), so a table of mostly
    empty or short blocks costs it the most. Bench qwen3_next's 8192 channels at 512 tokens:
    - over a table laid out for 256 requests (273 block rows, 16 filled), the kernels alone (x warm
      in L2): tile 38.9 us, rows 17.0 on an H200 (conv_extend_rows_lookahead_h200_2026-12-04.json),
      38.9 and 16.8 on an H100 (conv_extend_split_h100_2026-12-06.json);
    - over one request's table (18 block rows), in whole steps on an H200: tile 15 us a layer, rows
      26 (benchmarks/history/linear_extend.md, "The extend conv streamed by rows").
    Tables between those (3 to 16 block rows a filled one) are not measured: twice the filled rows
    is a line the two measured layouts fall on either side of, not a measured crossing.
    """
    filled = cdiv(rows, CONV_EXTEND_BLOCK_T)
    return width <= CONV_EXTEND_ROWS_MAX_K and (rows >= CONV_EXTEND_ROWS_MIN_TOKENS or table_blocks > 2 * filled)


@functools.lru_cache(maxsize=None)  # a pure function of its argument, on every launch path
def conv_extend_rows_config(channels: int) -> ConvConfig:
    """Channel tile of the row-streaming extend conv: 8 channels a thread (16 bytes of a bf16 row,
    one vector load), 1024 channels on 4 warps, whatever the step's length; a layer narrower than
    that a tile of its own width (next power of two, at least 32), a warp per 256 channels.

    1024 / 4 and not more programs of narrower tiles: on the H200 at bench qwen3_next's 8192
    channels it took 0.017 / 0.061 ms at 512 / 4096 tokens against 0.020 / 0.067 for 512 / 2 and
    0.025 / 0.070 for 256 / 1 (chunk_kernel_sweep.py --short; benchmarks/history/linear_extend.md)."""
    block_c = min(1024, max(32, next_pow2(channels)))
    return ConvConfig(block_c, max(1, block_c // 256), rows=True)


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


# The GDN mixer's q / k norm, gates and gated output norm, each once: the fused op's kernels
# (gdn_fused.py), the conv kernels' epilogue for a fused GDN layer (`ConvQk`) and the recurrence's and
# chunk output kernel's (`GatedNorm`) compute them with these.


@triton.jit
def l2norm_head(y, mask, act_dtype: tl.constexpr, eps):
    """A head's conv output y [BK] (float32) as q or k reach the recurrence: rounded to A (the
    conv's output), l2-normalised in float32 (eps inside the root), rounded to A, back in float32.
    y may also be [rows, BK]: each row is a head, normalised alone (the reduction is the last axis)."""
    x = tl.where(mask, y.to(act_dtype).to(tl.float32), 0.0)
    x = x * tl.math.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + eps)
    return x.to(act_dtype).to(tl.float32)


@triton.jit
def gdn_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, row, heads, mask, stride_a_row, stride_a_head,
           stride_b_row, stride_b_head, act_dtype: tl.constexpr, SOFTPLUS_MAX: tl.constexpr):
    """(g, beta) of value heads `heads` at row `row`, in float32: g = -exp(A_log) * softplus(a +
    dt_bias) computed in float32, beta = sigmoid(b) rounded to A."""
    a = tl.load(a_ptr + row * stride_a_row + heads * stride_a_head, mask=mask, other=0.0).to(tl.float32)
    x = a + tl.load(dt_bias_ptr + heads, mask=mask, other=0.0).to(tl.float32)
    softplus = tl.where(x > SOFTPLUS_MAX, x, tl.log(1.0 + tl.exp(tl.minimum(x, SOFTPLUS_MAX))))
    g = -tl.exp(tl.load(A_log_ptr + heads, mask=mask, other=0.0).to(tl.float32)) * softplus
    b = tl.load(b_ptr + row * stride_b_row + heads * stride_b_head, mask=mask, other=0.0).to(tl.float32)
    beta = tl.sigmoid(b).to(act_dtype).to(tl.float32)
    return g, beta


@triton.jit
def gated_norm_head(core, z, weight, mask, eps, DV: tl.constexpr, act_dtype: tl.constexpr, ROUND_Y: tl.constexpr):
    """GatedRMSNorm.forward of one value head: core [BV] (float32 of an A value), z and weight
    [BV] in float32 -> the output in float32 (the caller rounds it to A). ROUND_Y: weight * norm
    is rounded to A (torch's product of an A weight and the A norm); else it stays float32. core
    and z may also be [rows, BV] (weight still [BV]): each row a head, normalised alone."""
    x = tl.where(mask, core, 0.0)
    normed = (x * tl.math.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / DV + eps)).to(act_dtype).to(tl.float32)
    y = weight * normed
    if ROUND_Y:
        y = y.to(act_dtype).to(tl.float32)
    return y * (z * tl.sigmoid(z))


@triton.jit
def _token_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, head, offs_k, offs_v, m_k, m_v,
                stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
                stride_g_row, stride_g_head, stride_b_row, stride_b_head, scale,
                GROUP: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr):
    """One token of one request through one [BK, BV] state tile in registers: (new tile, output [BV]).

    Both reductions read the old tile (module docstring), so neither waits on the update. Every
    new element comes from the old element of the same position, which lets a caller store the
    tile back to the addresses it loaded it from."""
    key_head = head // GROUP
    # q carries the output scale from the start: one multiply per key channel, not per output.
    q = tl.load(q_ptr + row * stride_q_row + key_head * stride_q_head + offs_k, mask=m_k, other=0.0)
    q = q.to(tl.float32) * scale
    k = tl.load(k_ptr + row * stride_k_row + key_head * stride_k_head + offs_k, mask=m_k, other=0.0)
    k = k.to(tl.float32)
    v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + offs_v, mask=m_v, other=0.0)
    v = v.to(tl.float32)
    beta = 0.0  # Lightning: no delta rule, never read
    if DELTA:
        beta = tl.load(beta_ptr + row * stride_b_row + head * stride_b_head).to(tl.float32)
    if GATE == 1:
        decay = tl.load(g_ptr + row * stride_g_row + head * stride_g_head + offs_k, mask=m_k, other=0.0)
        decay = tl.exp(decay.to(tl.float32))  # [BK]
        c = tl.sum(s * (q * decay)[:, None], axis=0)
        s_decayed = s * decay[:, None]
        if DELTA:
            a = tl.sum(s * (k * decay)[:, None], axis=0)
            u = beta * (v - a)
        else:
            u = v
        qk = tl.sum(q * k, axis=0)
        s_new = s_decayed + k[:, None] * u[None, :]
        o = c + qk * u
    else:
        if GATE == 0:
            decay = tl.exp(tl.load(g_ptr + row * stride_g_row + head * stride_g_head).to(tl.float32))
        else:
            decay = tl.exp(tl.load(g_ptr + head * stride_g_head).to(tl.float32))  # constant per head
        s_new, o = scalar_decay_step(s, q, k, v, decay, beta, DELTA=DELTA)
    return s_new, o


@triton.jit
def scalar_decay_step(s, q, k, v, decay, beta, DELTA: tl.constexpr):
    """One token through a [BK, BV] state tile under one decay for every key channel (GDN,
    Lightning): (new tile, output [BV]). q (already times the output scale), k [BK], v [BV], decay
    (exp of the log-decay) and beta (read only with DELTA) in float32. The one statement of that
    update: the decode, extend and verify kernels reach it through _token_step, the fused GDN
    kernel (gdn_fused.py) with the q, k, v it computed itself."""
    c = tl.sum(s * q[:, None], axis=0) * decay
    s_decayed = s * decay
    if DELTA:
        a = tl.sum(s * k[:, None], axis=0) * decay
        u = beta * (v - a)
    else:
        u = v  # Lightning: no delta rule
    qk = tl.sum(q * k, axis=0)
    return s_decayed + k[:, None] * u[None, :], c + qk * u


@triton.jit
def _tile_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot, row, head, offs_k, offs_v, m_k, m_v, m_s,
               stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
               stride_g_row, stride_g_head, stride_b_row, stride_b_head, stride_s_slot, stride_s_head, scale,
               GROUP: tl.constexpr, DV: tl.constexpr, GATE: tl.constexpr, DELTA: tl.constexpr):
    """One decode token through the state tile [BK, BV] of `slot` and `head` (the pool's [Dk, Dv]
    rows contiguous), loaded and stored under m_s; returns the output [BV] in float32. The decode
    kernels' one statement of it (one tile a program, or tiles walked)."""
    s_ptrs = state_ptr + slot * stride_s_slot + head * stride_s_head + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(s_ptrs, mask=m_s, other=0.0).to(tl.float32)
    s, o = _token_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, head, offs_k, offs_v, m_k, m_v,
                       stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
                       stride_g_row, stride_g_head, stride_b_row, stride_b_head, scale,
                       GROUP=GROUP, GATE=GATE, DELTA=DELTA)
    # Each stored element is computed from the element loaded at the same address, so no thread's
    # store can overtake another thread's load of it.
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m_s)
    return o


@triton.jit
def _recurrent_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slots_ptr,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_g_row, stride_g_head, stride_b_row, stride_b_head, stride_o_row, stride_o_head,
    stride_s_slot, stride_s_head,
    scale,
    z_ptr, norm_w_ptr, stride_z_row, stride_z_head, eps,  # GatedNorm's
    GROUP: tl.constexpr,  # value heads per key head (Hv // Hk)
    DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr,  # next power of two >= DK: the whole key dimension sits in one program
    BV: tl.constexpr,
    GATE: tl.constexpr,  # GATE_PER_HEAD / GATE_PER_CHANNEL / GATE_CONSTANT
    DELTA: tl.constexpr,  # delta rule with beta (GDN, KDA) or plain outer product (Lightning)
    PAD_SLOT: tl.constexpr,
    NORM: tl.constexpr, ROUND_Y: tl.constexpr,  # GatedNorm: the head's output normalised (BV >= DV)
    USE_GDC: tl.constexpr,  # launched with PDL (pdl.py): everything it reads is the step's, so it waits first
):
    pdl_wait(USE_GDC)
    row = tl.program_id(0).to(tl.int64)  # request == row in a decode step
    head = tl.program_id(1)  # value head
    v_tile = tl.program_id(2)

    offs_k = tl.arange(0, BK)
    offs_v = v_tile * BV + tl.arange(0, BV)
    m_k = offs_k < DK
    m_v = offs_v < DV
    o_ptrs = out_ptr + row * stride_o_row + head * stride_o_head + offs_v

    # slot ids are int64 and the pool can exceed 2**31 elements: keep offsets in int64.
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:
        o = _tile_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot, row, head, offs_k, offs_v, m_k, m_v,
                       m_k[:, None] & m_v[None, :], stride_q_row, stride_q_head, stride_k_row, stride_k_head,
                       stride_v_row, stride_v_head, stride_g_row, stride_g_head, stride_b_row, stride_b_head,
                       stride_s_slot, stride_s_head, scale, GROUP=GROUP, DV=DV, GATE=GATE, DELTA=DELTA)
        act = out_ptr.dtype.element_ty
        if NORM:  # the core as the unfused op stores it, then its gated norm (the program holds the whole row)
            z = tl.load(z_ptr + row * stride_z_row + head * stride_z_head + offs_v, mask=m_v, other=0.0)
            weight = tl.load(norm_w_ptr + offs_v, mask=m_v, other=0.0).to(tl.float32)
            o = gated_norm_head(o.to(act).to(tl.float32), z.to(tl.float32), weight, m_v, eps, DV, act, ROUND_Y)
        tl.store(o_ptrs, o.to(act), mask=m_v)
    else:
        # padding row: its inputs may hold anything; it reads nothing and writes zeros.
        tl.store(o_ptrs, tl.zeros([BV], dtype=out_ptr.dtype.element_ty), mask=m_v)


@triton.jit(do_not_specialize=["n_tiles"])
def _recurrent_walk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slots_ptr,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_g_row, stride_g_head, stride_b_row, stride_b_head, stride_o_row, stride_o_head,
    stride_s_slot, stride_s_head,
    scale, n_tiles,
    HV: tl.constexpr,  # value heads
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, PAD_SLOT: tl.constexpr,
    STAGES: tl.constexpr,  # tiles whose state is in flight at once (a pipelined loop: cp.async from 2)
    USE_GDC: tl.constexpr,
):
    """`_recurrent_decode_kernel`'s step over tiles t = (request, value head, Dv tile), request-major,
    walked by each program from its id a grid's width apart. One tile a program leaves nothing in
    flight while the program computes; here the loop's pipelining loads the next tiles' states
    while this one's step runs. A padding row is masks, not a branch (a branch would break the
    pipeline): its state is neither loaded nor stored, and its output is zeros."""
    pdl_wait(USE_GDC)
    TILES_V: tl.constexpr = (DV + BV - 1) // BV
    offs_k = tl.arange(0, BK)
    m_k = offs_k < DK
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        row = tl.cast(t // (HV * TILES_V), tl.int64)  # the interpreter's loop index is a Python int
        head = t // TILES_V % HV
        offs_v = t % TILES_V * BV + tl.arange(0, BV)
        m_v = offs_v < DV
        slot = tl.load(slots_ptr + row).to(tl.int64)
        live = slot + offs_v * 0 != PAD_SLOT  # [BV]: the interpreter masks by no scalar and tensor of bools
        o = _tile_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slot, row, head, offs_k, offs_v, m_k, m_v,
                       m_k[:, None] & (m_v & live)[None, :], stride_q_row, stride_q_head, stride_k_row,
                       stride_k_head, stride_v_row, stride_v_head, stride_g_row, stride_g_head, stride_b_row,
                       stride_b_head, stride_s_slot, stride_s_head, scale, GROUP=GROUP, DV=DV, GATE=GATE, DELTA=DELTA)
        o = tl.where(live, o, 0.0)  # a padding row's inputs may hold anything, NaN included
        tl.store(out_ptr + row * stride_o_row + head * stride_o_head + offs_v, o.to(out_ptr.dtype.element_ty),
                 mask=m_v)


@triton.jit(do_not_specialize=["num_seqs"])
def _recurrent_extend_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slots_ptr, bounds_ptr,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_g_row, stride_g_head, stride_b_row, stride_b_head, stride_o_row, stride_o_head,
    stride_s_slot, stride_s_head,
    scale, num_seqs,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, PAD_SLOT: tl.constexpr,
):
    """A few tokens per request: one program per (request, value head, Dv tile) loads the slot's
    tile once, runs the request's tokens bounds[r] .. bounds[r+1]-1 through it in order, writing
    each token's output, and stores the tile once at the end. Request num_seqs (launched where
    the bounds carry one more entry) is the padding rows, and a request on the padding slot (a
    captured bucket's padding requests, a capture's placeholders) reads no state: both write zeros."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    v_tile = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = v_tile * BV + tl.arange(0, BV)
    m_k = offs_k < DK
    m_v = offs_v < DV
    m_s = m_k[:, None] & m_v[None, :]
    bos = tl.load(bounds_ptr + seq).to(tl.int64)
    eos = tl.load(bounds_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq, mask=seq < num_seqs, other=PAD_SLOT).to(tl.int64)
    if slot != PAD_SLOT:
        s_ptrs = state_ptr + slot * stride_s_slot + head * stride_s_head + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.load(s_ptrs, mask=m_s, other=0.0).to(tl.float32)
        for row in range(bos, eos):
            s, o = _token_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, head, offs_k, offs_v, m_k, m_v,
                               stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row,
                               stride_v_head, stride_g_row, stride_g_head, stride_b_row, stride_b_head, scale,
                               GROUP=GROUP, GATE=GATE, DELTA=DELTA)
            tl.store(out_ptr + row * stride_o_row + head * stride_o_head + offs_v,
                     o.to(out_ptr.dtype.element_ty), mask=m_v)
        # Only this program touches this tile of this slot: the store after the loop races nothing.
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m_s)
    else:
        # the padding rows (or a padding request's): their inputs may hold anything; zeros out
        for row in range(bos, eos):
            tl.store(out_ptr + row * stride_o_row + head * stride_o_head + offs_v,
                     tl.zeros([BV], dtype=out_ptr.dtype.element_ty), mask=m_v)


@triton.jit
def _recurrent_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slots_ptr, inter_ptr,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_g_row, stride_g_head, stride_b_row, stride_b_head, stride_o_row, stride_o_head,
    stride_s_slot, stride_s_head, stride_i_row, stride_i_tok, stride_i_head,
    scale,
    N: tl.constexpr,  # tokens per request: request r owns rows r*N .. r*N+N-1
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE: tl.constexpr, DELTA: tl.constexpr, PAD_SLOT: tl.constexpr,
):
    """A target-verify step: one program per (request, value head, Dv tile) loads the slot's tile
    once, runs the request's N tokens through it in order (each token exactly as the decode kernel
    runs it), writes the tile after token t < N-1 into the request's intermediate entry t, and
    stores the tile after the last token back into the slot. A request on the padding slot reads
    and keeps nothing and writes zero outputs."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    v_tile = tl.program_id(2)
    offs_k = tl.arange(0, BK)
    offs_v = v_tile * BV + tl.arange(0, BV)
    m_k = offs_k < DK
    m_v = offs_v < DV
    first = seq * N
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if slot != PAD_SLOT:
        m_s = m_k[:, None] & m_v[None, :]
        tile = offs_k[:, None] * DV + offs_v[None, :]
        s_ptrs = state_ptr + slot * stride_s_slot + head * stride_s_head + tile
        i_ptrs = inter_ptr + seq * stride_i_row + head * stride_i_head + tile
        s = tl.load(s_ptrs, mask=m_s, other=0.0).to(tl.float32)
        for t in tl.static_range(N):
            s, o = _token_step(s, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, first + t, head, offs_k, offs_v, m_k, m_v,
                               stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row,
                               stride_v_head, stride_g_row, stride_g_head, stride_b_row, stride_b_head, scale,
                               GROUP=GROUP, GATE=GATE, DELTA=DELTA)
            tl.store(out_ptr + (first + t) * stride_o_row + head * stride_o_head + offs_v,
                     o.to(out_ptr.dtype.element_ty), mask=m_v)
            if t < N - 1:
                tl.store(i_ptrs + t * stride_i_tok, s.to(inter_ptr.dtype.element_ty), mask=m_s)
        # Only this program touches this tile of this slot: the store after the loop races nothing.
        tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m_s)
    else:
        for t in tl.static_range(N):
            tl.store(out_ptr + (first + t) * stride_o_row + head * stride_o_head + offs_v,
                     tl.zeros([BV], dtype=out_ptr.dtype.element_ty), mask=m_v)


@triton.jit
def _short_conv_decode_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, slots_ptr,
    stride_x_row, stride_o_row, stride_s_slot, stride_s_c, stride_s_k,
    C,
    q_ptr, k_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, stride_qk_row, stride_g_row,
    stride_beta_row, stride_a_row, stride_a_head, stride_b_row, stride_b_head, HKDK, l2_eps,  # ConvQk's
    KW: tl.constexpr,  # kernel width K (the weight's row stride); the state holds the last K-1 inputs, oldest first
    KWP: tl.constexpr,  # next power of two >= KW: the window's columns in registers
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    QK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, BG: tl.constexpr, SOFTPLUS_MAX: tl.constexpr,  # ConvQk's
    USE_GDC: tl.constexpr,  # launched with PDL (pdl.py): it waits first
):
    pdl_wait(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    c_tile = tl.program_id(1)
    offs_c = c_tile * BC + tl.arange(0, BC)
    m_c = offs_c < C
    if QK:
        if c_tile == 0:  # the row's gates (a padding row's too, as qk_gates gives them)
            rows = tl.zeros([1], dtype=tl.int64) + row
            _conv_rows_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, rows, rows >= 0, stride_a_row,
                             stride_a_head, stride_b_row, stride_b_head, stride_g_row, stride_beta_row, HV=HV, BG=BG,
                             SOFTPLUS_MAX=SOFTPLUS_MAX)

    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:
        # conv_token's step with the output stored before the history, the order of the probe kernel
        # measured for this tile (benchmarks/probes/conv_decode_probe.py `_channels_last_kernel`)
        y, new_hist = conv_rolled(x_ptr, w_ptr, bias_ptr, state_ptr, slot, row, offs_c, m_c, stride_x_row,
                                  stride_s_slot, stride_s_c, stride_s_k, KW, KWP, HAS_BIAS, SILU)
        _store_conv_row(y, m_c, row, offs_c, c_tile * BC, out_ptr, stride_o_row, q_ptr, k_ptr, stride_qk_row, HKDK,
                        l2_eps, QK=QK, DK=DK, BC=BC)
        tl.debug_barrier()  # every load of the history before any store of it (conv_token says why)
        store_history(state_ptr, slot, offs_c, m_c, new_hist, stride_s_slot, stride_s_c, stride_s_k, KW, KWP)
    else:
        _store_conv_row(tl.zeros([BC], dtype=tl.float32), m_c, row, offs_c, c_tile * BC, out_ptr, stride_o_row, q_ptr,
                        k_ptr, stride_qk_row, HKDK, l2_eps, QK=QK, DK=DK, BC=BC)


@triton.jit
def conv_token(x_ptr, w_ptr, bias_ptr, state_ptr, slot, row, offs_c, m_c, stride_x_row,
                stride_s_slot, stride_s_c, stride_s_k, KW: tl.constexpr, KWP: tl.constexpr, HAS_BIAS: tl.constexpr,
                SILU: tl.constexpr):
    """One token (row `row` of x) through the conv of one slot's channels offs_c: (output [BC] in
    float32, the rolled history [KWP, BC] in float32), the history stored back into the slot."""
    y, new_hist = conv_rolled(x_ptr, w_ptr, bias_ptr, state_ptr, slot, row, offs_c, m_c, stride_x_row,
                              stride_s_slot, stride_s_c, stride_s_k, KW, KWP, HAS_BIAS, SILU)
    # No thread may overwrite a column another thread has yet to read (the compiler may give loads
    # and stores different thread layouts).
    tl.debug_barrier()
    store_history(state_ptr, slot, offs_c, m_c, new_hist, stride_s_slot, stride_s_c, stride_s_k, KW, KWP)
    return y, new_hist


@triton.jit
def store_history(state_ptr, slot, offs_c, m_c, new_hist, stride_s_slot, stride_s_c, stride_s_k, KW: tl.constexpr,
                  KWP: tl.constexpr):
    """A rolled history [KWP, BC] (`conv_rolled`'s) stored into the slot's channels offs_c."""
    cols = tl.arange(0, KWP)
    s_ptrs = state_ptr + slot * stride_s_slot + cols[:, None] * stride_s_k + offs_c[None, :] * stride_s_c
    tl.store(s_ptrs, new_hist.to(state_ptr.dtype.element_ty), mask=(cols[:, None] < KW - 1) & m_c[None, :])


@triton.jit
def conv_rolled(x_ptr, w_ptr, bias_ptr, state_ptr, slot, row, offs_c, m_c, stride_x_row,
                stride_s_slot, stride_s_c, stride_s_k, KW: tl.constexpr, KWP: tl.constexpr, HAS_BIAS: tl.constexpr,
                SILU: tl.constexpr):
    """`conv_token` without the store: (output [BC] in float32, the rolled history [KWP, BC] in
    float32), the slot's history only read (the caller stores it, or has another program do so).

    The tile is history columns by channels, [KWP, BC]: over the state pool's [K-1, C] storage
    (CONV_HISTORY_CHANNELS_LAST) a column of the tile is BC contiguous values, which the compiler
    lays out along the threads in 16-byte vectors. A probe kernel of this tile took 8.0 us at 128
    requests of bench qwen3_next's 8192 channels on an H100, where a [BC, KWP] tile over the same
    storage took 9.8 and the [C, K-1] storage before 11.8 (DECODE_CONV_CHANNELS)."""
    cols = tl.arange(0, KWP)
    # [KWP, BC] pointers to the slot's history; columns 0..K-2 exist
    s_ptrs = state_ptr + slot * stride_s_slot + cols[:, None] * stride_s_k + offs_c[None, :] * stride_s_c
    m_hist = (cols[:, None] < KW - 1) & m_c[None, :]
    hist = tl.load(s_ptrs, mask=m_hist, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x_row + offs_c, mask=m_c, other=0.0).to(tl.float32)  # [BC]
    # the weight [C, K] contiguous (the launchers make it so): a row stride the compiler knows, so
    # a channel's K taps load as one vector
    w = tl.load(w_ptr + offs_c[None, :] * KW + cols[:, None],
                mask=(cols[:, None] < KW) & m_c[None, :], other=0.0).to(tl.float32)  # [KWP, BC]
    window = tl.where(cols[:, None] == KW - 1, x[None, :], hist)  # inputs t-K+1 .. t
    y = tl.sum(window * w, axis=0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_c, mask=m_c, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    # The rolled history: column j takes column j+1, the last one the new input.
    shifted = tl.load(s_ptrs + stride_s_k, mask=(cols[:, None] < KW - 2) & m_c[None, :], other=0.0).to(tl.float32)
    new_hist = tl.where(cols[:, None] == KW - 2, x[None, :], shifted)
    return y, new_hist


@triton.jit
def _short_conv_verify_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, slots_ptr, inter_ptr,
    stride_x_row, stride_o_row, stride_s_slot, stride_s_c, stride_s_k, stride_i_row, stride_i_tok,
    stride_i_c, stride_i_k, C,
    N: tl.constexpr,  # tokens per request: request r owns rows r*N .. r*N+N-1
    KW: tl.constexpr, KWP: tl.constexpr, BC: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, PAD_SLOT: tl.constexpr,
):
    """A target-verify step of the decode conv: the request's N tokens in order, each through the
    decode kernel's own step (conv_token, which rolls the slot's history), and the history after
    token t < N-1 also into the request's intermediate entry t. A request on the padding slot
    reads and keeps nothing and writes zero outputs."""
    seq = tl.program_id(0).to(tl.int64)
    c_tile = tl.program_id(1)
    offs_c = c_tile * BC + tl.arange(0, BC)
    m_c = offs_c < C
    first = seq * N
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    if slot != PAD_SLOT:
        cols = tl.arange(0, KWP)
        i_ptrs = inter_ptr + seq * stride_i_row + cols[:, None] * stride_i_k + offs_c[None, :] * stride_i_c
        for t in tl.static_range(N):
            y, kept = conv_token(x_ptr, w_ptr, bias_ptr, state_ptr, slot, first + t, offs_c, m_c, stride_x_row,
                                  stride_s_slot, stride_s_c, stride_s_k, KW=KW, KWP=KWP, HAS_BIAS=HAS_BIAS, SILU=SILU)
            tl.store(out_ptr + (first + t) * stride_o_row + offs_c, y.to(out_ptr.dtype.element_ty), mask=m_c)
            if t < N - 1:
                tl.store(i_ptrs + t * stride_i_tok, kept.to(inter_ptr.dtype.element_ty),
                         mask=(cols[:, None] < KW - 1) & m_c[None, :])
            # the next token reads the history this one stored, maybe from another thread
            tl.debug_barrier()
    else:
        for t in tl.static_range(N):
            tl.store(out_ptr + (first + t) * stride_o_row + offs_c, tl.zeros([BC], dtype=out_ptr.dtype.element_ty),
                     mask=m_c)


@triton.jit
def _conv_window(x_rows, hist_ptrs, w_ptr, offs_t, offs_c, m_out, m_c, stride_x_row, stride_w_c, stride_s_k,
                 KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HISTORY: tl.constexpr):
    """sum_k w[c, k] * input[i - (K-1) + k, c] over a [BT, BC] tile of tokens i, in float32, the taps
    added in the reference's order. Input p >= 0 of the request is row p of x_rows; p < 0 is history
    column K-1+p, read only with HISTORY (else those taps are zero: a block that never reaches back)."""
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for k in tl.static_range(KW):
        p = offs_t + (k - (KW - 1))
        v = tl.load(x_rows + p[:, None] * stride_x_row + offs_c[None, :], mask=m_out & (p >= 0)[:, None], other=0.0)
        v = v.to(tl.float32)
        if HISTORY:  # exactly one of the two masked loads is live per element
            h = tl.load(hist_ptrs[None, :] + (KW - 1 + p)[:, None] * stride_s_k, mask=m_out & (p < 0)[:, None],
                        other=0.0)
            v += h.to(tl.float32)
        wk = tl.load(w_ptr + offs_c * stride_w_c + k, mask=m_c, other=0.0).to(tl.float32)
        acc += v * wk[None, :]
    return acc


@triton.jit
def _store_conv_rows(y, m, rows, offs_c, c0, out_ptr, stride_o_row, q_ptr, k_ptr, stride_qk_row, HKDK, l2_eps,
                     QK: tl.constexpr, DK: tl.constexpr, R: tl.constexpr, BC: tl.constexpr):
    """Store a [R, BC] tile of conv outputs y (float32) of rows `rows` and channels `offs_c` from c0:
    into out, or with QK (a fused GDN layer's conv, `ConvQk`: channels q | k | v, the tile whole
    heads of DK) each q and k head l2-normalised as the recurrence takes it (l2norm_head) into q or
    k [rows, HKDK], the v channels into out."""
    act = out_ptr.dtype.element_ty
    dst = out_ptr + rows[:, None] * stride_o_row + offs_c[None, :]
    if QK:
        if c0 < 2 * HKDK:  # some of the tile's heads are q's or k's
            normed = tl.reshape(l2norm_head(tl.reshape(y, (R, BC // DK, DK)), tl.reshape(m, (R, BC // DK, DK)), act,
                                            l2_eps), (R, BC))
            c = offs_c[None, :]
            y = tl.where(c < 2 * HKDK, normed, y)
            dst = tl.where(c < HKDK, q_ptr + rows[:, None] * stride_qk_row + c,
                           tl.where(c < 2 * HKDK, k_ptr + rows[:, None] * stride_qk_row + (c - HKDK), dst))
    tl.store(dst, y.to(act), mask=m)


@triton.jit
def _store_conv_row(y, m, row, offs_c, c0, out_ptr, stride_o_row, q_ptr, k_ptr, stride_qk_row, HKDK, l2_eps,
                    QK: tl.constexpr, DK: tl.constexpr, BC: tl.constexpr):
    """One row's [BC] conv outputs y (float32) of row `row`: into out as a plain [BC] store (the
    row-streaming and decode kernels' layout), or with QK through `_store_conv_rows` as a [1, BC] tile."""
    if QK:
        _store_conv_rows(y[None, :], m[None, :], tl.zeros([1], dtype=tl.int64) + row, offs_c, c0, out_ptr,
                         stride_o_row, q_ptr, k_ptr, stride_qk_row, HKDK, l2_eps, QK=QK, DK=DK, R=1, BC=BC)
    else:
        tl.store(out_ptr + row * stride_o_row + offs_c, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_rows_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, rows, m_rows, stride_a_row, stride_a_head,
                     stride_b_row, stride_b_head, stride_g_row, stride_beta_row, HV: tl.constexpr, BG: tl.constexpr,
                     SOFTPLUS_MAX: tl.constexpr):
    """A fused GDN layer's gates of every value head at rows `rows` (gdn_gates), stored: what the
    extend conv's first channel tile adds for `ConvQk`."""
    heads = tl.arange(0, BG)
    m = m_rows[:, None] & (heads < HV)[None, :]
    act = beta_ptr.dtype.element_ty
    g, beta = gdn_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, rows[:, None], heads[None, :], m, stride_a_row,
                        stride_a_head, stride_b_row, stride_b_head, act, SOFTPLUS_MAX)
    tl.store(g_ptr + rows[:, None] * stride_g_row + heads[None, :], g, mask=m)
    tl.store(beta_ptr + rows[:, None] * stride_beta_row + heads[None, :], beta.to(act), mask=m)


@triton.jit
def _conv_history(x_rows, hist_ptrs, n, cols, offs_c, m_col, stride_x_row, stride_s_k, KW: tl.constexpr):
    """[BC, HP] float32: the last K-1 inputs after the request's first n tokens, column q being input
    p = n - (K-1) + q: a token of x, or (fewer than K-1 tokens) old history column n + q."""
    p = n - (KW - 1) + cols
    new_x = tl.load(x_rows + p[None, :] * stride_x_row + offs_c[:, None], mask=m_col & (p >= 0)[None, :], other=0.0)
    new_h = tl.load(hist_ptrs[:, None] + (KW - 1 + p)[None, :] * stride_s_k, mask=m_col & (p < 0)[None, :], other=0.0)
    return new_x.to(tl.float32) + new_h.to(tl.float32)


@triton.jit
def _conv_new_history(x_rows, hist_ptrs, snap_rows_ptr, snap_ids_ptr, snap_ptr, seq, n, offs_c, m_c, stride_x_row,
                      stride_s_c, stride_s_k, stride_snap_slot, KW: tl.constexpr, HP: tl.constexpr):
    """The slot's new history, written by the program of a request's first token block, and the
    request's in-step snapshot if it has one.

    The new history is the last K-1 inputs of the window [old history | the request's tokens],
    column q being input p = n - (K-1) + q: a token of x, or (fewer than K-1 new tokens) old
    history column n + q. The race: the slot's history is read by the taps of the request's
    outputs and rewritten here. Only this request's first block reads it (a block j > 0 starts at
    token j*BT >= K-1, all of whose taps are in x), and that block's program is the one that
    writes it, for its own channels only; requests have distinct slots. Within the program every
    load of the history precedes one barrier and every store follows it, as in the decode conv."""
    cols = tl.arange(0, HP)
    m_col = m_c[:, None] & (cols < KW - 1)[None, :]
    new_hist = _conv_history(x_rows, hist_ptrs, n, cols, offs_c, m_col, stride_x_row, stride_s_k, KW=KW)
    # An in-step snapshot (the prefix cache's): the history after the request's first r tokens,
    # read, like the new one, before the barrier.
    snap_row = tl.load(snap_rows_ptr + seq).to(tl.int64)
    if snap_row >= 0:
        snap = _conv_history(x_rows, hist_ptrs, snap_row, cols, offs_c, m_col, stride_x_row, stride_s_k, KW=KW)
        snap_id = tl.load(snap_ids_ptr + seq).to(tl.int64)
        tl.store(snap_ptr + snap_id * stride_snap_slot + offs_c[:, None] * stride_s_c + cols[None, :] * stride_s_k,
                 snap.to(snap_ptr.dtype.element_ty), mask=m_col)
    tl.debug_barrier()
    tl.store(hist_ptrs[:, None] + cols[None, :] * stride_s_k, new_hist.to(hist_ptrs.dtype.element_ty), mask=m_col)


# num_seqs changes every step: not specialized, so one build serves every batch (the bundle holds it)
@triton.jit(do_not_specialize=["num_seqs"])
def _short_conv_extend_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, slots_ptr, bounds_ptr, blocks_ptr, snap_rows_ptr, snap_ids_ptr,
    snap_ptr, stride_x_row, stride_o_row, stride_w_c, stride_s_slot, stride_s_c, stride_s_k, stride_snap_slot,
    C, num_seqs,
    q_ptr, k_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, stride_qk_row, stride_g_row,
    stride_beta_row, stride_a_row, stride_a_head, stride_b_row, stride_b_head, HKDK, l2_eps,  # ConvQk's
    KW: tl.constexpr,  # kernel width K; the state holds the last K-1 inputs, oldest first
    HP: tl.constexpr,  # next power of two >= K-1: the history's columns in registers
    BT: tl.constexpr,  # tokens of a block (CONV_EXTEND_BLOCK_T), at least K-1
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    QK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, BG: tl.constexpr, SOFTPLUS_MAX: tl.constexpr,  # ConvQk's
):
    # blocks [NB, 2]: (request r, block j) covers tokens j*BT .. j*BT+BT-1 of request r, which are
    # rows bounds[r] + those of x and out; bounds [R+2] is cu_seqlens then the step's row count,
    # so r == num_seqs is the padding rows.
    blk = tl.program_id(0)
    c_tile = tl.program_id(1)
    seq = tl.load(blocks_ptr + 2 * blk)
    j = tl.load(blocks_ptr + 2 * blk + 1)
    bos = tl.load(bounds_ptr + seq).to(tl.int64)
    n = tl.load(bounds_ptr + seq + 1).to(tl.int64) - bos  # tokens of the request (padding: rows)
    if j * BT >= n:  # a row of a captured step's table past the step's blocks (an empty request's)
        return
    offs_t = j * BT + tl.arange(0, BT)  # token index within the request
    offs_c = c_tile * BC + tl.arange(0, BC)
    m_t = offs_t < n
    m_c = offs_c < C
    m_out = m_t[:, None] & m_c[None, :]
    if QK:
        if c_tile == 0:  # the gates of the block's rows, once (a padding row's too, as qk_gates gives them)
            _conv_rows_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, bos + offs_t, m_t, stride_a_row,
                             stride_a_head, stride_b_row, stride_b_head, stride_g_row, stride_beta_row, HV=HV, BG=BG,
                             SOFTPLUS_MAX=SOFTPLUS_MAX)

    if seq == num_seqs:
        # padding rows: their inputs may hold anything; they read nothing and come out zero.
        _store_conv_rows(tl.zeros([BT, BC], dtype=tl.float32), m_out, bos + offs_t, offs_c, c_tile * BC, out_ptr,
                         stride_o_row, q_ptr, k_ptr, stride_qk_row, HKDK, l2_eps, QK=QK, DK=DK, R=BT, BC=BC)
    else:
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        hist_ptrs = state_ptr + slot * stride_s_slot + offs_c * stride_s_c  # [BC]: column 0 of the history
        x_rows = x_ptr + bos * stride_x_row
        # Only a request's first block reaches back into the history (BT >= K-1): the others skip
        # its loads altogether.
        if j == 0:
            acc = _conv_window(x_rows, hist_ptrs, w_ptr, offs_t, offs_c, m_out, m_c, stride_x_row, stride_w_c,
                               stride_s_k, KW=KW, BT=BT, BC=BC, HISTORY=True)
        else:
            acc = _conv_window(x_rows, hist_ptrs, w_ptr, offs_t, offs_c, m_out, m_c, stride_x_row, stride_w_c,
                               stride_s_k, KW=KW, BT=BT, BC=BC, HISTORY=False)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        _store_conv_rows(acc, m_out, bos + offs_t, offs_c, c_tile * BC, out_ptr, stride_o_row, q_ptr, k_ptr,
                         stride_qk_row, HKDK, l2_eps, QK=QK, DK=DK, R=BT, BC=BC)
        # The race on the slot's history: see _conv_new_history.
        if (j == 0) & (slot != PAD_SLOT):
            _conv_new_history(x_rows, hist_ptrs, snap_rows_ptr, snap_ids_ptr, snap_ptr, seq, n, offs_c, m_c,
                              stride_x_row, stride_s_c, stride_s_k, stride_snap_slot, KW=KW, HP=HP)


@triton.jit
def _rows_input(x_rows, hist_ptrs, p, offs_c, m_c, stride_x_row, stride_s_k, KW: tl.constexpr, BC: tl.constexpr,
                LIVE: tl.constexpr):
    """[BC] float32: input p ([BC], one value) of the request (row p of x_rows, or p < 0 history
    column K-1+p), as _conv_window reads it; zeros where not LIVE (a register K never uses)."""
    v = tl.zeros([BC], dtype=tl.float32)
    if LIVE:  # exactly one of the two masked loads is live
        v = tl.load(x_rows + p * stride_x_row + offs_c, mask=m_c & (p >= 0), other=0.0).to(tl.float32)
        v += tl.load(hist_ptrs + (KW - 1 + p) * stride_s_k, mask=m_c & (p < 0), other=0.0).to(tl.float32)
    return v


@triton.jit
def _rows_weight(w_ptr, offs_c, m_c, stride_w_c, k: tl.constexpr, BC: tl.constexpr, LIVE: tl.constexpr):
    """[BC] float32: tap k of the channels' weights; zeros where not LIVE."""
    w = tl.zeros([BC], dtype=tl.float32)
    if LIVE:
        w = tl.load(w_ptr + offs_c * stride_w_c + k, mask=m_c, other=0.0).to(tl.float32)
    return w


@triton.jit(do_not_specialize=["num_seqs"])
def _short_conv_extend_rows_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, slots_ptr, bounds_ptr, blocks_ptr, snap_rows_ptr, snap_ids_ptr,
    snap_ptr, stride_x_row, stride_o_row, stride_w_c, stride_s_slot, stride_s_c, stride_s_k, stride_snap_slot,
    C, num_seqs,
    q_ptr, k_ptr, g_ptr, beta_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, stride_qk_row, stride_g_row,
    stride_beta_row, stride_a_row, stride_a_head, stride_b_row, stride_b_head, HKDK, l2_eps,  # ConvQk's
    KW: tl.constexpr,  # kernel width K, 2 to 4: the K-1 earlier inputs live in p1, p2, p3
    HP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,  # channels of the program: 8 a thread, one 16-byte load of a bf16 row
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PAD_SLOT: tl.constexpr,
    QK: tl.constexpr, DK: tl.constexpr, HV: tl.constexpr, BG: tl.constexpr, SOFTPLUS_MAX: tl.constexpr,  # ConvQk's
):
    """The extend conv streamed by rows: the tile kernel's table, grid and results, but a program
    walks its block's BT tokens one row of BC channels at a time, each row of x loaded once (the
    tile kernel loads each K times, once per shifted tap) and the window's K-1 earlier inputs
    carried in registers from row to row. The loop is unrolled, and each row is loaded four rows
    ahead of its use (q0..q3, BT >= 4). Taps are added oldest first in float32, as in
    _conv_window: the same bits."""
    blk = tl.program_id(0)
    c_tile = tl.program_id(1)
    seq = tl.load(blocks_ptr + 2 * blk)
    j = tl.load(blocks_ptr + 2 * blk + 1)
    bos = tl.load(bounds_ptr + seq).to(tl.int64)
    n = tl.load(bounds_ptr + seq + 1).to(tl.int64) - bos
    if j * BT >= n:  # a row of a captured step's table past the step's blocks
        return
    t0 = j * BT  # the block's first token within the request
    offs_c = c_tile * BC + tl.arange(0, BC)
    m_c = offs_c < C
    # t0 as a [BC] vector: the interpreter takes no scalar in a mask, and a splat keeps the row
    # masks constant across a thread's channels (16-byte loads)
    t_c = tl.zeros([BC], dtype=tl.int64) + t0
    if QK:
        if c_tile == 0:  # the gates of the block's rows, once (a padding row's too, as qk_gates gives them)
            offs_t = t0 + tl.arange(0, BT)
            _conv_rows_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, bos + offs_t, offs_t < n,
                             stride_a_row, stride_a_head, stride_b_row, stride_b_head, stride_g_row, stride_beta_row,
                             HV=HV, BG=BG, SOFTPLUS_MAX=SOFTPLUS_MAX)

    if seq == num_seqs:  # padding rows: read nothing, come out zero
        for t in tl.static_range(BT):
            _store_conv_row(tl.zeros([BC], dtype=tl.float32), m_c & (t_c + t < n), bos + t0 + t, offs_c, c_tile * BC,
                            out_ptr, stride_o_row, q_ptr, k_ptr, stride_qk_row, HKDK, l2_eps, QK=QK, DK=DK, BC=BC)
    else:
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        hist_ptrs = state_ptr + slot * stride_s_slot + offs_c * stride_s_c
        x_rows = x_ptr + bos * stride_x_row
        # p_a: input t - a of the row t about to be computed, u_a its tap (K-1-a); u0 the row's own.
        # Before the block: from x, or for the first block (BT >= K-1) all from the history.
        p1 = _rows_input(x_rows, hist_ptrs, t_c - 1, offs_c, m_c, stride_x_row, stride_s_k, KW=KW, BC=BC, LIVE=True)
        p2 = _rows_input(x_rows, hist_ptrs, t_c - 2, offs_c, m_c, stride_x_row, stride_s_k, KW=KW, BC=BC, LIVE=KW >= 3)
        p3 = _rows_input(x_rows, hist_ptrs, t_c - 3, offs_c, m_c, stride_x_row, stride_s_k, KW=KW, BC=BC, LIVE=KW >= 4)
        u0 = _rows_weight(w_ptr, offs_c, m_c, stride_w_c, KW - 1, BC=BC, LIVE=True)
        u1 = _rows_weight(w_ptr, offs_c, m_c, stride_w_c, KW - 2, BC=BC, LIVE=True)
        u2 = _rows_weight(w_ptr, offs_c, m_c, stride_w_c, KW - 3, BC=BC, LIVE=KW >= 3)
        u3 = _rows_weight(w_ptr, offs_c, m_c, stride_w_c, KW - 4, BC=BC, LIVE=KW >= 4)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_c, mask=m_c, other=0.0).to(tl.float32)
        # Rows are loaded four ahead of their use (q0 the row about to be computed): the
        # compiler cannot move a load of x above the store of an earlier output row (out may alias
        # x for all it knows), so a load issued just before its use would wait a whole memory
        # latency per row. Rows past the request's tokens: not read, not stored.
        q0 = tl.load(x_rows + t0 * stride_x_row + offs_c, mask=m_c & (t_c < n), other=0.0)
        q1 = tl.load(x_rows + (t0 + 1) * stride_x_row + offs_c, mask=m_c & (t_c + 1 < n), other=0.0)
        q2 = tl.load(x_rows + (t0 + 2) * stride_x_row + offs_c, mask=m_c & (t_c + 2 < n), other=0.0)
        q3 = tl.load(x_rows + (t0 + 3) * stride_x_row + offs_c, mask=m_c & (t_c + 3 < n), other=0.0)
        for t in tl.static_range(BT):
            m_row = m_c & (t_c + t < n)
            x = q0.to(tl.float32)
            q0 = q1
            q1 = q2
            q2 = q3
            if t + 4 < BT:
                q3 = tl.load(x_rows + (t0 + t + 4) * stride_x_row + offs_c, mask=m_c & (t_c + (t + 4) < n),
                             other=0.0)
            acc = tl.zeros([BC], dtype=tl.float32)
            if KW >= 4:
                acc += p3 * u3
            if KW >= 3:
                acc += p2 * u2
            acc += p1 * u1
            acc += x * u0
            if HAS_BIAS:
                acc += bias
            if SILU:
                acc = acc * tl.sigmoid(acc)
            _store_conv_row(acc, m_row, bos + t0 + t, offs_c, c_tile * BC, out_ptr, stride_o_row, q_ptr, k_ptr,
                            stride_qk_row, HKDK, l2_eps, QK=QK, DK=DK, BC=BC)
            p3 = p2
            p2 = p1
            p1 = x
        if (j == 0) & (slot != PAD_SLOT):
            _conv_new_history(x_rows, hist_ptrs, snap_rows_ptr, snap_ids_ptr, snap_ptr, seq, n, offs_c, m_c,
                              stride_x_row, stride_s_c, stride_s_k, stride_snap_slot, KW=KW, HP=HP)


# ---------------------------------------------------------------------------------------------
# launchers (host side: shape checks only, never a device read)
# ---------------------------------------------------------------------------------------------


# The decode kernels launch in the eager gaps of piecewise steps with the same arguments step
# after step: launched through a Launcher, they skip Triton's per-launch binding (launch_cache.py).
_RECURRENT_DECODE = Launcher(_recurrent_decode_kernel)
_RECURRENT_WALK = Launcher(_recurrent_walk_kernel)
_SHORT_CONV_DECODE = Launcher(_short_conv_decode_kernel)
_RECURRENT_VERIFY = Launcher(_recurrent_verify_kernel)
_RECURRENT_EXTEND = Launcher(_recurrent_extend_kernel)  # a replayed step's eager gap repeats its arguments
_SHORT_CONV_VERIFY = Launcher(_short_conv_verify_kernel)
# the extend conv in a piecewise step's gap on the static tables (triton_linear plan_gap_step)
_SHORT_CONV_EXTEND = Launcher(_short_conv_extend_kernel)
_SHORT_CONV_EXTEND_ROWS = Launcher(_short_conv_extend_rows_kernel)


def _unit_last(name: str, t: torch.Tensor) -> torch.Tensor:
    """Inputs need a unit-stride last dimension (16-byte loads); copy the rare one that has not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def history_strided(conv_state: torch.Tensor) -> bool:
    """Whether a conv history [..., C, K-1] is laid out as the kernels address it: with a unit stride
    on its channels (the state pool's, `CONV_HISTORY_CHANNELS_LAST`) or on its K-1 columns, the
    other stride any. The kernels take both strides."""
    return 1 in conv_state.stride()[-2:]


def _check_rows(op: str, rows: int, slots: torch.Tensor, *tensors: torch.Tensor) -> None:
    assert slots.dim() == 1 and slots.shape[0] == rows, (
        f"{op}: one state slot per request; got {rows} requests and state_slots of shape {tuple(slots.shape)}")
    assert slots.dtype in (torch.int64, torch.int32), f"{op}: state_slots must be int32/int64, got {slots.dtype}"
    for t in tensors:
        assert t.device == slots.device, f"{op}: all tensors must be on {slots.device}, got one on {t.device}"


def _recurrent_args(op: str, q, k, v, gate, beta, out, state, gate_kind: int, rows: int) -> tuple:
    """Shape checks shared by the decode and extend launchers; (q, k, v, gate, the stride arguments
    after the pointers, the kernel's constexprs) with unit-stride last dimensions."""
    Hk, Dk = q.shape[1], q.shape[2]
    Hv, Dv = v.shape[1], v.shape[2]
    assert q.shape[0] == rows and k.shape == q.shape and v.shape[0] == rows and out.shape == v.shape, (
        f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)} disagree")
    assert Hv % Hk == 0, f"{op}: {Hv} value heads cannot share {Hk} key heads evenly"
    assert state.dtype in STATE_TORCH_DTYPES and state.shape[1:] == (Hv, Dk, Dv), (
        f"{op}: state pool layer must be [slots+1, {Hv}, {Dk}, {Dv}] in one of {STATE_DTYPES}, got {state.dtype} "
        f"{tuple(state.shape)}")
    assert state.stride(3) == 1 and state.stride(2) == Dv, f"{op}: each state [Dk, Dv] must be contiguous"
    assert out.stride(-1) == 1, f"{op}: out must have a unit-stride last dimension (it is written in place)"
    expected_gate = {GATE_PER_HEAD: (rows, Hv), GATE_PER_CHANNEL: (rows, Hv, Dk), GATE_CONSTANT: (Hv,)}[gate_kind]
    assert tuple(gate.shape) == expected_gate, f"{op}: gate shape {tuple(gate.shape)}, expected {expected_gate}"
    q, k, v = _unit_last("q", q), _unit_last("k", k), _unit_last("v", v)
    if gate_kind == GATE_PER_CHANNEL:
        gate = _unit_last("g", gate)
    if beta is not None:
        assert tuple(beta.shape) == (rows, Hv), f"{op}: beta shape {tuple(beta.shape)}, expected {(rows, Hv)}"
    g_row, g_head = (0, gate.stride(0)) if gate_kind == GATE_CONSTANT else (gate.stride(0), gate.stride(1))
    b_row, b_head = (beta.stride(0), beta.stride(1)) if beta is not None else (0, 0)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               g_row, g_head, b_row, b_head, out.stride(0), out.stride(1), state.stride(0), state.stride(1))
    consts = dict(GROUP=Hv // Hk, DK=Dk, DV=Dv, BK=next_pow2(Dk), GATE=gate_kind,
                  DELTA=beta is not None)
    return q, k, v, gate, strides, consts


def recurrent_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
                     beta: torch.Tensor | None, out: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     scale: float, gate_kind: int, config: RecurrentConfig | None = None,
                     gated_norm: GatedNorm | None = None) -> None:
    """One decode step of the gated (delta-rule) recurrence over the slot-indexed pool, in place.

    q, k [B, Hk, Dk]; v, out [B, Hv, Dv]; gate [B, Hv] / [B, Hv, Dk] / [Hv] by gate_kind; beta [B, Hv]
    or None (no delta rule); state [num_slots+1, Hv, Dk, Dv] float32 or bfloat16 (STATE_DTYPES: read
    into float32, the new state rounded to it); slots [B] int64.

    `gated_norm` (GatedNorm; one program a tile that holds the whole Dv row, not walked): `out`
    receives GatedRMSNorm(core, z) instead of the core (a fused GDN layer's norm in the recurrence's
    launch: the values of gdn_fused's `gated_rmsnorm` over the core rounded to out's dtype).
    """
    op = OP_OF_GATE[gate_kind]
    B = q.shape[0]
    _check_rows(op, B, slots, q, k, v, gate, out, state)
    q, k, v, gate, strides, consts = _recurrent_args(op, q, k, v, gate, beta, out, state, gate_kind, B)
    if B == 0:
        return
    Hv, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
    cfg = config or recurrent_config(B, Hv, Dk, Dv, q.device)
    # A tile smaller than the program's threads would only replicate elements across them.
    assert next_pow2(Dk) * cfg.block_v >= 32 * cfg.num_warps, f"{op}: {cfg} leaves threads idle"
    b_t = beta if beta is not None else gate  # never read without DELTA; any valid pointer will do
    z, norm_w, eps, round_y = out, out, 0.0, False
    if gated_norm is not None:
        z, norm_w, eps = gated_norm
        if cfg.walk or cfg.block_v < Dv or z.shape != out.shape or z.stride(-1) != 1 or norm_w.shape != (Dv,):
            raise ValueError(f"{op}: the gated norm takes one program a whole Dv row ({Dv} columns, not walked; "
                             f"{cfg}) and z {tuple(out.shape)} with a unit last stride, weight [{Dv}]; got z "
                             f"{tuple(z.shape)}, weight {tuple(norm_w.shape)}")
        round_y = rounds_weighted_norm(norm_w, out)
    if cfg.walk:
        n_tiles = B * Hv * cdiv(Dv, cfg.block_v)
        grid = (min(n_tiles, cfg.walk * num_sms(q.device)),)
        _RECURRENT_WALK[grid](q, k, v, gate, b_t, out, state, slots, *strides, float(scale), n_tiles, HV=Hv,
                              **consts, BV=cfg.block_v, PAD_SLOT=PADDING_SLOT, STAGES=cfg.stages,
                              num_warps=cfg.num_warps, **launch_args(q.device))
        return
    grid = (B, Hv, cdiv(Dv, cfg.block_v))
    _RECURRENT_DECODE[grid](q, k, v, gate, b_t, out, state, slots, *strides, float(scale), z, norm_w, z.stride(0),
                            z.stride(1), float(eps), **consts, BV=cfg.block_v, PAD_SLOT=PADDING_SLOT,
                            NORM=gated_norm is not None, ROUND_Y=round_y, num_warps=cfg.num_warps,
                            **launch_args(q.device))


def recurrent_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
                     beta: torch.Tensor | None, out: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     bounds: torch.Tensor, scale: float, gate_kind: int, config: RecurrentConfig | None = None) -> None:
    """A few tokens of each of R requests through the recurrence, over the slot-indexed pool, in place.

    The rows of q, k, v, gate, beta and out are the step's tokens (as recurrent_decode's, with T
    rows); request r owns rows bounds[r] .. bounds[r+1]-1 (a request may own none) and the state
    in slot slots[r] (slots [R] int64; a request on the padding slot reads and writes no state and
    gets zero outputs). bounds [R+1] int64 on the device: rows from bounds[R] on are not touched;
    bounds [R+2]: rows bounds[R] .. bounds[R+1]-1 are padding and get zeros (a captured bucket's
    padding rows, whose count only the device knows). Its cost grows with the longest request's
    tokens, one after another: for short requests (a prefix cache hit's tail, a short prompt), where
    a chunked kernel's launches cost more than its work. config: default `extend_config`."""
    op = OP_OF_GATE[gate_kind]
    R = slots.shape[0]
    _check_rows(op, R, slots, q, k, v, gate, out, state, bounds)
    assert bounds.dim() == 1 and bounds.shape[0] in (R + 1, R + 2), (
        f"{op}: bounds must be [{R + 1}] or, with the padding rows, [{R + 2}] for {R} requests, got {tuple(bounds.shape)}")
    q, k, v, gate, strides, consts = _recurrent_args(op, q, k, v, gate, beta, out, state, gate_kind, q.shape[0])
    launched = bounds.shape[0] - 1  # the requests, and the padding rows as one more
    if launched == 0:
        return
    Hv, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
    cfg = config or extend_config(Hv, Dk, Dv, q.device)
    assert next_pow2(Dk) * cfg.block_v >= 32 * cfg.num_warps, f"{op}: {cfg} leaves threads idle"
    b_t = beta if beta is not None else gate
    grid = (launched, Hv, cdiv(Dv, cfg.block_v))
    _RECURRENT_EXTEND[grid](q, k, v, gate, b_t, out, state, slots, bounds, *strides, float(scale), R,
                            **consts, BV=cfg.block_v, PAD_SLOT=PADDING_SLOT, num_warps=cfg.num_warps)


def recurrent_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor,
                     beta: torch.Tensor | None, out: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                     inter: torch.Tensor, n: int, scale: float, gate_kind: int,
                     config: RecurrentConfig | None = None) -> None:
    """A target-verify step of B requests of n tokens each, in one launch: request b owns rows
    b*n .. b*n+n-1 of q, k, v, gate, beta and out (as recurrent_decode's, with B*n rows) and the
    state in slot slots[b] (the padding slot: zero outputs, nothing read or kept). The state after
    token t < n-1 goes to inter[b, t] (inter [rows >= B, n-1 or more, Hv, Dk, Dv] float32, the
    state pool's intermediate states), the state after the last token into the slot. Each token is
    computed as recurrent_decode computes it with the same config, so the outputs and states are
    those of n decode launches, one token of every request each."""
    op = OP_OF_GATE[gate_kind]
    B = slots.shape[0]
    rows = B * n
    _check_rows(op, B, slots, q, k, v, gate, out, state, inter)
    q, k, v, gate, strides, consts = _recurrent_args(op, q, k, v, gate, beta, out, state, gate_kind, rows)
    Hv, Dk, Dv = v.shape[1], q.shape[2], v.shape[2]
    assert inter.dtype == state.dtype and inter.shape[0] >= B and inter.shape[1] >= n - 1 and \
        inter.shape[2:] == state.shape[1:] and inter.stride(4) == 1 and inter.stride(3) == Dv, (
            f"{op}: intermediate states must be [>= {B}, >= {n - 1}, {Hv}, {Dk}, {Dv}] {state.dtype} with "
            f"contiguous [Dk, Dv] states, got {inter.dtype} {tuple(inter.shape)}")
    if B == 0:
        return
    cfg = config or recurrent_config(B, Hv, Dk, Dv, q.device)
    assert next_pow2(Dk) * cfg.block_v >= 32 * cfg.num_warps, f"{op}: {cfg} leaves threads idle"
    b_t = beta if beta is not None else gate
    grid = (B, Hv, cdiv(Dv, cfg.block_v))
    _RECURRENT_VERIFY[grid](q, k, v, gate, b_t, out, state, slots, inter, *strides,
                            inter.stride(0), inter.stride(1), inter.stride(2), float(scale), N=n, **consts,
                            BV=cfg.block_v, PAD_SLOT=PADDING_SLOT, num_warps=cfg.num_warps)


def gdn_decode(q, k, v, g, beta, out, state, slots, scale, config=None) -> None:
    """GDN: q, k [B,Hk,Dk]; v, out [B,Hv,Dv]; g, beta [B,Hv]; state [slots+1,Hv,Dk,Dv] f32; slots [B]."""
    recurrent_decode(q, k, v, g, beta, out, state, slots, scale, GATE_PER_HEAD, config)


def kda_decode(q, k, v, g, beta, out, state, slots, scale, config=None) -> None:
    """KDA: q, k, v, out [B,H,D]; g [B,H,Dk] per-channel log-decay; beta [B,H]; state [slots+1,H,Dk,Dv]."""
    assert q.shape[1] == v.shape[1], f"kda_core: key heads {q.shape[1]} != value heads {v.shape[1]}"
    recurrent_decode(q, k, v, g, beta, out, state, slots, scale, GATE_PER_CHANNEL, config)


def lightning_decode(q, k, v, decay, out, state, slots, scale, config=None) -> None:
    """Lightning: q, k, v, out [B,H,D]; decay [H] log-decay; state [slots+1,H,Dk,Dv]; no delta rule."""
    assert q.shape[1] == v.shape[1], f"lightning_core: key heads {q.shape[1]} != value heads {v.shape[1]}"
    recurrent_decode(q, k, v, decay, None, out, state, slots, scale, GATE_CONSTANT, config)


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                      conv_state: torch.Tensor, slots: torch.Tensor, silu: bool,
                      config: ConvConfig | None = None, qk: ConvQk | None = None) -> None:
    """Causal depthwise conv, one token per request: x, out [B,C]; weight [C,K]; bias [C] or None;
    conv_state [slots+1, C, K-1] (last K-1 inputs, oldest first), rolled in place; slots [B].
    `qk`: a fused GDN layer's q / k norm and gates in the same launch, as short_conv_extend takes it."""
    _short_conv_tokens(x, weight, bias, out, conv_state, slots, silu, config, 1, None, qk)


def short_conv_verify(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                      conv_state: torch.Tensor, slots: torch.Tensor, inter: torch.Tensor, n: int, silu: bool,
                      config: ConvConfig | None = None) -> None:
    """The decode conv over a target-verify step of B requests of n tokens each, in one launch:
    x, out [B*n, C], request b's rows b*n .. b*n+n-1; conv_state [slots+1, C, K-1]; slots [B] (the
    padding slot: zero outputs, nothing read or kept); the history after token t < n-1 into
    inter[b, t] (inter [>= B, >= n-1, C, K-1]), after the last one into the slot. Outputs and
    histories are those of n short_conv_decode launches with the same config."""
    _short_conv_tokens(x, weight, bias, out, conv_state, slots, silu, config, n, inter)


def _short_conv_tokens(x, weight, bias, out, conv_state, slots, silu: bool, config: ConvConfig | None, n: int,
                       inter: torch.Tensor | None, qk: ConvQk | None = None) -> None:
    """short_conv_decode (n == 1, no intermediate histories; ConvQk may come) or short_conv_verify:
    checks, then one launch."""
    B, (rows, C), K = slots.shape[0], x.shape, weight.shape[1]
    _check_rows("short_conv", B, slots, x, weight, out, conv_state, *(() if inter is None else (inter,)))
    assert K >= 2, "short_conv: a kernel of width 1 keeps no state; it is not a decode conv"
    assert rows == B * n and weight.shape == (C, K) and out.shape == x.shape, (
        f"short_conv: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)} for {B} requests "
        f"of {n} token(s) disagree")
    assert conv_state.shape[1:] == (C, K - 1) and history_strided(conv_state), (
        f"short_conv: conv state must be [slots+1, {C}, {K - 1}] with a unit stride on its channels or its history, "
        f"got {tuple(conv_state.shape)} strides {conv_state.stride()}")
    if inter is not None:
        assert inter.dtype == conv_state.dtype and inter.shape[0] >= B and inter.shape[1] >= n - 1 and \
            inter.shape[2:] == (C, K - 1) and history_strided(inter), (
                f"short_conv: intermediate histories must be [>= {B}, >= {n - 1}, {C}, {K - 1}], got "
                f"{tuple(inter.shape)}")
    assert out.stride(-1) == 1, "short_conv: out must have a unit-stride last dimension"
    x, weight = _unit_last("x", x), weight.contiguous()  # conv_rolled takes K as its row stride
    if bias is not None:
        assert bias.shape == (C,), f"short_conv: bias shape {tuple(bias.shape)}, expected {(C,)}"
        bias = bias.contiguous()
    if B == 0:
        return
    cfg = config or conv_config(C)
    assert cfg.block_c >= 32 * cfg.num_warps, f"short_conv: {cfg} leaves threads idle"
    assert not cfg.rows, f"short_conv: {cfg} is a row-streaming tile, a layout of the extend conv only"
    grid = (B, cdiv(C, cfg.block_c))
    common = (x.stride(0), out.stride(0), *conv_state.stride())
    consts = dict(KW=K, KWP=next_pow2(K), BC=cfg.block_c, HAS_BIAS=bias is not None, SILU=bool(silu),
                  PAD_SLOT=PADDING_SLOT, num_warps=cfg.num_warps)
    b_t = bias if bias is not None else weight  # never read without HAS_BIAS
    if inter is None:
        _SHORT_CONV_DECODE[grid](x, weight, b_t, out, conv_state, slots, *common, C,
                                 *_conv_qk_args(qk, out, cfg, rows, C, "short_conv"), **consts, **_conv_qk_consts(qk),
                                 **launch_args(x.device))
    else:
        _SHORT_CONV_VERIFY[grid](x, weight, b_t, out, conv_state, slots, inter, *common,
                                 *inter.stride(), C, N=n, **consts)


def short_conv_extend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                      conv_state: torch.Tensor, slots: torch.Tensor, bounds: torch.Tensor, blocks: torch.Tensor,
                      silu: bool, what: str = "short_conv", config: ConvConfig | None = None,
                      snapshots: StepSnapshots | None = None, qk: ConvQk | None = None) -> None:
    """Causal depthwise conv over ragged requests, one launch: x, out [rows, C]; weight [C, K];
    bias [C] or None; conv_state [slots+1, C, K-1] (last K-1 inputs, oldest first), rewritten in
    place for every request; slots [R] the requests' slots; bounds [R+2] int64 (cu_seqlens of the
    R requests, then `rows`: the rows past cu_seqlens[R] are padding and come out zero); blocks
    [NB, 2] int64, (request, block of CONV_EXTEND_BLOCK_T tokens) covering every request's tokens
    and, as request R, the padding rows. `what` names the caller (its layer) in errors.

    The host reads no device value: the table is planned once per step by the caller, and NB is
    its length. `snapshots`: the step's in-step snapshots of the history (StepSnapshots; None: none).
    `config`: the channel tile and layout (None: conv_extend_config's tile); a row-streaming one
    (ConvConfig.rows, conv_extend_rows_config) takes kernel widths up to CONV_EXTEND_ROWS_MAX_K.
    `qk`: a fused GDN layer's q / k norm and gates in the same launch (ConvQk; its tile must fit:
    conv_qk_fits), `out` then holding the v channels alone."""
    rows, C = x.shape
    K = weight.shape[1] if weight.dim() == 2 else 0
    R = slots.shape[0]
    if weight.shape != (C, K) or out.shape != x.shape:
        raise ValueError(f"{what}: x {tuple(x.shape)}, weight {tuple(weight.shape)} (expected [{C}, K]) and out "
                         f"{tuple(out.shape)} disagree")
    if not 2 <= K <= CONV_EXTEND_BLOCK_T + 1:
        raise ValueError(f"{what}: kernel width {K} is not supported by the extend conv (2 to "
                         f"{CONV_EXTEND_BLOCK_T + 1}: the first token block must hold the K-1 inputs of the history)")
    if config is not None and config.rows and K > CONV_EXTEND_ROWS_MAX_K:
        raise ValueError(f"{what}: kernel width {K} is not supported by the row-streaming extend conv (at most "
                         f"{CONV_EXTEND_ROWS_MAX_K}); the tile layout (ConvConfig.rows False) takes it")
    if conv_state.shape[1:] != (C, K - 1) or not history_strided(conv_state):
        raise ValueError(f"{what}: conv state must be [slots+1, {C}, {K - 1}] with a unit stride on its channels or "
                         f"its history, got {tuple(conv_state.shape)} strides {conv_state.stride()}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"{what}: bias shape {tuple(bias.shape)}, expected {(C,)}")
    if bounds.shape != (R + 2,) or blocks.dim() != 2 or blocks.shape[1] != 2:
        raise ValueError(f"{what}: the step plan has bounds {tuple(bounds.shape)} and blocks {tuple(blocks.shape)} "
                         f"for {R} requests; expected [{R + 2}] and [NB, 2]")
    for t in (weight, out, conv_state, bounds, blocks) + (() if bias is None else (bias,)):
        if t.device != x.device:
            raise ValueError(f"{what}: all tensors must be on {x.device}, got one on {t.device}")
    if out.stride(-1) != 1:
        raise ValueError(f"{what}: out must have a unit-stride last dimension (it is written in place)")
    x, weight = _unit_last("x", x), _unit_last("weight", weight)
    bias = bias.contiguous() if bias is not None else None
    num_blocks = blocks.shape[0]
    if num_blocks == 0 or C == 0:
        return
    cfg = config or conv_extend_config(num_blocks, C, x.device)
    grid = (num_blocks, cdiv(C, cfg.block_c))
    snap_rows, snap_ids, snap = (snapshots or StepSnapshots.none(R, conv_state)).checked(what, R, conv_state)
    kernel = _SHORT_CONV_EXTEND_ROWS if cfg.rows else _SHORT_CONV_EXTEND
    kernel[grid](
        x, weight, bias if bias is not None else weight, out, conv_state, slots, bounds, blocks, snap_rows, snap_ids,
        snap, x.stride(0), out.stride(0), weight.stride(0), *conv_state.stride(), snap.stride(0),
        C, R, *_conv_qk_args(qk, out, cfg, rows, C, what),
        KW=K, HP=max(2, next_pow2(K - 1)), BT=CONV_EXTEND_BLOCK_T, BC=cfg.block_c,
        HAS_BIAS=bias is not None, SILU=bool(silu), PAD_SLOT=PADDING_SLOT,
        **_conv_qk_consts(qk), num_warps=cfg.num_warps,
    )


def _conv_qk_consts(qk: ConvQk | None) -> dict:
    """The conv kernels' ConvQk constexprs (placeholders without it)."""
    if qk is None:
        return dict(QK=False, DK=1, HV=1, BG=1, SOFTPLUS_MAX=0.0)
    return dict(QK=True, DK=qk.q.shape[2], HV=qk.g.shape[1], BG=next_pow2(qk.g.shape[1]),
                SOFTPLUS_MAX=qk.softplus_max)


def _conv_qk_args(qk: ConvQk | None, out: torch.Tensor, cfg: ConvConfig, rows: int, C: int, what: str) -> tuple:
    """The extend conv kernels' ConvQk arguments, checked (placeholders without it: never read)."""
    if qk is None:
        return (out,) * 8 + (0,) * 7 + (0, 0.0)
    T, hk, dk = qk.q.shape
    hv = qk.g.shape[1]
    ok = (qk.q.is_contiguous() and qk.k.shape == qk.q.shape and qk.k.is_contiguous() and T == rows
          and qk.q.dtype == qk.k.dtype == out.dtype
          and qk.g.shape == (rows, hv) and qk.g.dtype == torch.float32 and qk.beta.shape == (rows, hv)
          and qk.g.stride(1) == 1 and qk.beta.stride(1) == 1 and qk.b.shape == (rows, hv) and qk.a.shape == (rows, hv)
          and qk.A_log.shape == (hv,) and qk.dt_bias.shape == (hv,) and C > 2 * hk * dk)
    if not ok:
        raise ValueError(f"{what}: the conv's q / k norm and gates take q, k [{rows}, Hk, Dk] contiguous and g, beta, "
                         f"b, a [{rows}, Hv] within {C} channels; got q {tuple(qk.q.shape)}, g {tuple(qk.g.shape)}")
    if not conv_qk_fits(cfg, dk):
        raise ValueError(f"{what}: a channel tile of {cfg.block_c} does not hold whole key heads of {dk}: conv_qk_fits")
    return (qk.q, qk.k, qk.g, qk.beta, qk.a, qk.b, qk.A_log, qk.dt_bias, hk * dk, qk.g.stride(0), qk.beta.stride(0),
            qk.a.stride(0), qk.a.stride(1), qk.b.stride(0), qk.b.stride(1), hk * dk, float(qk.l2_eps))
