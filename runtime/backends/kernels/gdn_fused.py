"""Triton kernels of hgc.gdn_fused: a whole GDN mixer between its projections.

The op (compiler/splitops/ops.py) computes, cast for cast, what a Qwen3-Next / Qwen3.5 GDN layer
computes between its projections with the unfused ops (A: the activation dtype, `out`'s):

    mixed = short_conv(qkv) with silu                           A (float32 inside the conv)
    q, k  = l2norm per key head, from mixed in float32          rounded to A
    beta  = sigmoid(b)                                          A
    g     = -exp(A_log) * softplus(a + dt_bias)                 float32
    core  = gdn_core(q, k, v, g, beta)                          A
    out   = RMSNorm(core) rounded to A, * norm_weight (rounded as torch promotes the two),
            * silu(z) in float32, rounded to A                  (models' GatedRMSNorm.forward)

Decode (one token per request) is one launch, `gdn_fused_decode`: one program per (request, key
head) runs the conv's decode step for the channels of its key head (its q and k heads, and the v
heads of the value heads that read that key head), the l2norm of q and k, then for each of those
value heads the gates, the recurrent step on the head's whole [Dk, Dv] state and the gated norm
over Dv, writing `out`. It is race-free because nothing is shared between programs: a key head's
q, k and v channels belong to it alone (value head h reads key head h // (Hv / Hk)), so each
channel's conv history and each value head's state is read and written by exactly one program,
in program order (the conv step's own barrier orders its history's loads before its stores, as
in the decode conv); every other tensor is only read, and each `out` row head written once.
Holding all of Dv makes the norm a reduction in registers. The price is parallelism: at batch 1
of Qwen3-Next's dims (Hk 16, Hv 32, Dk = Dv = 128) 16 programs, each through two 64 KiB states,
against the recurrent decode kernel's 512 narrow programs; the decode step is launch-bound
(benchmarks/kernels/gdn_fused_bench.py times both). So a step of few requests (at most
SPLIT_DECODE_MAX_ROWS) takes two launches instead: the conv step and the l2norm per (request,
q | k | v head) into a [B, C] buffer, then the gates and the recurrence per (request, value head,
value block): a head's Dv columns are independent in the delta rule, so its state splits into
blocks of columns over programs enough to fill the card (default_v_blocks). The gated norm needs
the head's whole row: each block parks its outputs in a workspace and counts itself in on a
per-(request, head) counter, and the last to arrive normalises the row (last_block_gated_norm), in
one order whatever the arrival order. The same math, more programs. The split can also run as one
launch (`merged_split`, triton_linear's split_decode option "one_launch"): `_split_one_kernel`'s
programs are the second launch's, each computing the conv and l2norm of what it reads (its v
columns, its key head's q and k) from the history it finds; a v column is one program's, which
rolls its history, and a key head's q and k channels roll once, stored by the last of the head's
programs to finish reading them (a per-(request, key head) counter, arrivals.py). A step of more requests
(more than ONE_LAUNCH_MAX_ROWS) takes the unfused kernels, four launches the caller runs: there the recurrent
decode kernel's narrow tiles fill the card and the one launch's wide programs do not. The one
launch is the op's kernel at every batch under fixed (batch-invariant) decode tiles.

Extend, mixed and target-verify steps keep the existing conv and recurrent paths (the backend
routes them as it routes short_conv and gdn_core) around two kernels of this module:
`qk_gates` (the l2norm of q and k and both gates, one launch over the step's rows) and
`gated_rmsnorm` (one launch), so such a layer is the conv, these two, and the recurrent core's
launches. Padding rows come out zero: a decode or verify row whose request sits on the padding
slot, an extend row at or past the step's real row count (read on the device).

The launchers read no device value and take grids from shapes only: every launch is capturable
(the split's value-block buffers are allocated before, by a step of the size run eagerly: split_scratch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.arrivals import arrival_counters, last_to_arrive
from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import cdiv, next_pow2
from runtime.backends.kernels.linear import (conv_rolled, conv_token, gated_norm_head, gdn_gates, history_strided,
                                            l2norm_head, rounds_weighted_norm, scalar_decay_step, store_history)
from runtime.backends.kernels.pdl import launch_args, pdl_wait
from runtime.backends.kernels.sm_count import num_sms
from runtime.cache.state_pool import PADDING_SLOT, STATE_DTYPES, STATE_TORCH_DTYPES

__all__ = ["BLOCK_ROWS", "L2NORM_EPS", "SOFTPLUS_THRESHOLD", "SPLIT_DECODE_MAX_ROWS", "ONE_LAUNCH_MAX_ROWS", "GdnDims",
           "gdn_dims",
           "decode_launches", "gdn_fused_decode", "default_v_blocks", "MIN_VALUE_BLOCK", "SplitScratch",
           "split_scratch", "qk_gates", "gated_rmsnorm",
           "decode_warps"]

# The l2norm's epsilon (inside the root), a constant of the op: the models' l2norm (FLA's and
# transformers' too); the op's `eps` argument is the gated RMSNorm's.
L2NORM_EPS = 1e-6
# torch's softplus returns x itself above this (its default threshold, beta 1)
SOFTPLUS_THRESHOLD = 20.0


# ---------------------------------------------------------------------------------------------
# the pieces of the math, each once
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _gdn_fused_decode_kernel(
    qkv_ptr, z_ptr, b_ptr, a_ptr, conv_w_ptr, A_log_ptr, dt_bias_ptr, norm_w_ptr, out_ptr,
    conv_ptr, state_ptr, slots_ptr,
    stride_x_row, stride_z_row, stride_z_head, stride_b_row, stride_b_head, stride_a_row, stride_a_head,
    stride_o_row, stride_o_head, stride_c_slot, stride_c_c, stride_c_k, stride_s_slot, stride_s_head,
    scale, eps, l2_eps,
    HK: tl.constexpr, GROUP: tl.constexpr,  # key heads; value heads per key head
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    KW: tl.constexpr, KWP: tl.constexpr,  # conv width and its next power of two
    ROUND_Y: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, PAD_SLOT: tl.constexpr, USE_GDC: tl.constexpr,
):
    pdl_wait(USE_GDC)  # launched with PDL: the slots, inputs and states are the step's (pdl.py)
    row = tl.program_id(0).to(tl.int64)  # request == row in a decode step
    kh = tl.program_id(1)  # key head: its q, k and the GROUP value heads that read it
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    m_k = offs_k < DK
    m_v = offs_v < DV
    act = out_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:
        yq, _ = conv_token(qkv_ptr, conv_w_ptr, conv_w_ptr, conv_ptr, slot, row, kh * DK + offs_k, m_k, stride_x_row,
                           stride_c_slot, stride_c_c, stride_c_k, KW=KW, KWP=KWP, HAS_BIAS=False, SILU=True)
        yk, _ = conv_token(qkv_ptr, conv_w_ptr, conv_w_ptr, conv_ptr, slot, row, (HK + kh) * DK + offs_k, m_k,
                           stride_x_row, stride_c_slot, stride_c_c, stride_c_k, KW=KW, KWP=KWP,
                           HAS_BIAS=False, SILU=True)
        # q carries the output scale, as the recurrent kernels' do
        q = l2norm_head(yq, m_k, act, l2_eps) * scale
        k = l2norm_head(yk, m_k, act, l2_eps)
        weight = tl.load(norm_w_ptr + offs_v, mask=m_v, other=0.0).to(tl.float32)
        for j in tl.static_range(GROUP):
            head = kh * GROUP + j
            # the head's state, z and gates are loaded first: in flight while its v channels convolve
            m_s = m_k[:, None] & m_v[None, :]
            s_ptrs = state_ptr + slot * stride_s_slot + head * stride_s_head + offs_k[:, None] * DV + offs_v[None, :]
            s = tl.load(s_ptrs, mask=m_s, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + row * stride_z_row + head * stride_z_head + offs_v, mask=m_v, other=0.0)
            g, beta = gdn_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, row, head, head < HK * GROUP, stride_a_row,
                                stride_a_head, stride_b_row, stride_b_head, act, SOFTPLUS_MAX)
            yv, _ = conv_token(qkv_ptr, conv_w_ptr, conv_w_ptr, conv_ptr, slot, row, 2 * HK * DK + head * DV + offs_v,
                               m_v, stride_x_row, stride_c_slot, stride_c_c, stride_c_k, KW=KW, KWP=KWP,
                               HAS_BIAS=False, SILU=True)
            v = yv.to(act).to(tl.float32)
            s, o = scalar_decay_step(s, q, k, v, tl.exp(g), beta, DELTA=True)
            # each stored element comes from the element loaded at the same address (linear.py)
            tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m_s)
            y = gated_norm_head(o.to(act).to(tl.float32), z.to(tl.float32), weight, m_v, eps, DV, act, ROUND_Y)
            tl.store(out_ptr + row * stride_o_row + head * stride_o_head + offs_v, y.to(act), mask=m_v)
    else:
        # padding row: its inputs may hold anything; it reads nothing and writes zeros.
        for j in tl.static_range(GROUP):
            tl.store(out_ptr + row * stride_o_row + (kh * GROUP + j) * stride_o_head + offs_v,
                     tl.zeros([BV], dtype=act), mask=m_v)


@triton.jit
def _split_prep_kernel(qkv_ptr, conv_w_ptr, conv_ptr, slots_ptr, mixed_ptr,
                       stride_x_row, stride_c_slot, stride_c_c, stride_c_k, stride_m_row, l2_eps,
                       HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       KW: tl.constexpr, KWP: tl.constexpr, PAD_SLOT: tl.constexpr, USE_GDC: tl.constexpr):
    """The split decode's first launch, one program per (request, head h of q | k | v): the conv step
    of the head's channels (it alone rolls their history), q and k l2-normalised, into mixed [B, C]
    in the activation dtype. A padding row's program does nothing (the second launch zeroes its out)."""
    pdl_wait(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    act = mixed_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:
        # each branch's names its own: Triton types a name assigned in both branches of an if once,
        # and a q | k head's [BK] tiles are not a v head's [BV] where Dk and Dv differ
        if h < 2 * HK:
            offs_k = h * DK + tl.arange(0, BK)
            m_k = tl.arange(0, BK) < DK
            yk = conv_token(qkv_ptr, conv_w_ptr, conv_w_ptr, conv_ptr, slot, row, offs_k, m_k, stride_x_row,
                            stride_c_slot, stride_c_c, stride_c_k, KW=KW, KWP=KWP, HAS_BIAS=False,
                            SILU=True)[0]
            tl.store(mixed_ptr + row * stride_m_row + offs_k, l2norm_head(yk, m_k, act, l2_eps).to(act), mask=m_k)
        else:
            offs_v = 2 * HK * DK + (h - 2 * HK) * DV + tl.arange(0, BV)
            m_v = tl.arange(0, BV) < DV
            yv = conv_token(qkv_ptr, conv_w_ptr, conv_w_ptr, conv_ptr, slot, row, offs_v, m_v, stride_x_row,
                            stride_c_slot, stride_c_c, stride_c_k, KW=KW, KWP=KWP, HAS_BIAS=False,
                            SILU=True)[0]
            tl.store(mixed_ptr + row * stride_m_row + offs_v, yv.to(act), mask=m_v)


@triton.jit
def last_block_gated_norm(o, cols, m_c, o_ws_ptr, arrived_ptr, z_ptr, norm_w_ptr, o_row_ptr, row, head,
                          stride_z_row, stride_z_head, eps, HV: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                          NVB: tl.constexpr, ROUND_Y: tl.constexpr, act: tl.constexpr):
    """The gated norm of a head split over NVB value blocks: each block's program parks its o
    (columns `cols`, rounded to A where the whole-head program rounds it) in the head's workspace
    row and counts itself in; the last to arrive reads the whole row back and normalises it as
    the whole-head program would (one order of sums whatever order the blocks finish in), then
    zeroes the counter for the next launch (a CUDA graph's replay starts where the last one left)."""
    at = row * HV + head
    ws = o_ws_ptr + at * DV
    tl.store(ws + cols, o.to(act).to(tl.float32), mask=m_c)
    if last_to_arrive(arrived_ptr + at, NVB):
        offs_v = tl.arange(0, BV)
        m_v = offs_v < DV
        # from L2 (.cg): arrivals.py says why
        core = tl.load(ws + offs_v, mask=m_v, other=0.0, cache_modifier=".cg")
        z = tl.load(z_ptr + row * stride_z_row + head * stride_z_head + offs_v, mask=m_v, other=0.0)
        weight = tl.load(norm_w_ptr + offs_v, mask=m_v, other=0.0).to(tl.float32)
        y = gated_norm_head(core, z.to(tl.float32), weight, m_v, eps, DV, act, ROUND_Y)
        tl.store(o_row_ptr + offs_v, y.to(act), mask=m_v)
        tl.store(arrived_ptr + at, 0)


@triton.jit
def head_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, row, head, stride_a_row, stride_a_head, stride_b_row,
               stride_b_head, HK: tl.constexpr, GROUP: tl.constexpr, SOFTPLUS_MAX: tl.constexpr,
               act: tl.constexpr):
    """A split program's (g, beta): its value head's gates at its request's row."""
    return gdn_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, row, head, head < HK * GROUP, stride_a_row,
                     stride_a_head, stride_b_row, stride_b_head, act, SOFTPLUS_MAX)


@triton.jit
def value_block_step(s, s_ptrs, m_s, q, k, v, g, beta, z_ptr, norm_w_ptr, state_ptr, o_row_ptr, o_ws_ptr,
                     arrived_ptr, row, head, cols, m_c, stride_z_row, stride_z_head, eps, HK: tl.constexpr,
                     GROUP: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, NVB: tl.constexpr,
                     ROUND_Y: tl.constexpr, act: tl.constexpr):
    """A split program's work once it holds q, k (q with the output scale), its block's v and state
    s and its head's gates (head_gates): the recurrent step, the state stored, and the gated norm
    (the program's own where NVB is 1, else the head's last block's, last_block_gated_norm)."""
    s, o = scalar_decay_step(s, q, k, v, tl.exp(g), beta, DELTA=True)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=m_s)
    if NVB == 1:
        z = tl.load(z_ptr + row * stride_z_row + head * stride_z_head + cols, mask=m_c, other=0.0)
        weight = tl.load(norm_w_ptr + cols, mask=m_c, other=0.0).to(tl.float32)
        y = gated_norm_head(o.to(act).to(tl.float32), z.to(tl.float32), weight, m_c, eps, DV, act, ROUND_Y)
        tl.store(o_row_ptr + cols, y.to(act), mask=m_c)
    else:
        last_block_gated_norm(o, cols, m_c, o_ws_ptr, arrived_ptr, z_ptr, norm_w_ptr, o_row_ptr, row, head,
                              stride_z_row, stride_z_head, eps, HK * GROUP, DV, BV, NVB, ROUND_Y, act)


@triton.jit
def _split_core_kernel(mixed_ptr, z_ptr, b_ptr, a_ptr, A_log_ptr, dt_bias_ptr, norm_w_ptr, out_ptr, state_ptr,
                       slots_ptr, o_ws_ptr, arrived_ptr, stride_m_row, stride_z_row, stride_z_head, stride_b_row,
                       stride_b_head, stride_a_row, stride_a_head, stride_o_row, stride_o_head, stride_s_slot,
                       stride_s_head, scale, eps, HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       NVB: tl.constexpr,  # value blocks a head's state is split into (1: the whole head)
                       BVB: tl.constexpr, BVP: tl.constexpr,  # a block's columns (DV / NVB), their next power of two
                       ROUND_Y: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, PAD_SLOT: tl.constexpr,
                       USE_GDC: tl.constexpr):
    """The split decode's second launch, one program per (request, value head, value block): the
    gates, the recurrent step on the block's BVB columns of the head's state and the gated norm,
    from the first launch's q, k, v (rounded to A there as the one-launch kernel rounds them in
    registers: the same values). The delta rule's columns are independent (scalar_decay_step
    reduces over the key channels only), so a block computes its columns' state and output
    exactly as the whole head would. With NVB 1 the program holds all of Dv and normalises in
    registers; else the last of the head's blocks to finish does (last_block_gated_norm). With PDL
    the wait comes first: the counters and workspace are shared with the previous layer's launch."""
    pdl_wait(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BVB + tl.arange(0, BVP)  # the grid has no third axis when NVB is 1: block 0
    offs_k = tl.arange(0, BK)
    m_k = offs_k < DK
    m_c = tl.arange(0, BVP) < BVB
    act = out_ptr.dtype.element_ty
    o_row_ptr = out_ptr + row * stride_o_row + head * stride_o_head
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:
        m_s = m_k[:, None] & m_c[None, :]
        s_ptrs = state_ptr + slot * stride_s_slot + head * stride_s_head + offs_k[:, None] * DV + cols[None, :]
        s = tl.load(s_ptrs, mask=m_s, other=0.0).to(tl.float32)
        src = mixed_ptr + row * stride_m_row
        kh = head // GROUP
        q = tl.load(src + kh * DK + offs_k, mask=m_k, other=0.0).to(tl.float32) * scale
        k = tl.load(src + (HK + kh) * DK + offs_k, mask=m_k, other=0.0).to(tl.float32)
        v = tl.load(src + 2 * HK * DK + head * DV + cols, mask=m_c, other=0.0).to(tl.float32)
        g, beta = head_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, row, head, stride_a_row, stride_a_head,
                             stride_b_row, stride_b_head, HK, GROUP, SOFTPLUS_MAX, act)
        value_block_step(s, s_ptrs, m_s, q, k, v, g, beta, z_ptr, norm_w_ptr, state_ptr, o_row_ptr, o_ws_ptr,
                         arrived_ptr, row, head, cols, m_c, stride_z_row, stride_z_head, eps, HK, GROUP, DV, BV,
                         NVB, ROUND_Y, act)
    else:
        # padding row: every block zeroes its columns and none counts in, so its counter stays zero
        tl.store(o_row_ptr + cols, tl.zeros([BVP], dtype=act), mask=m_c)


@triton.jit
def _split_one_kernel(qkv_ptr, z_ptr, b_ptr, a_ptr, conv_w_ptr, A_log_ptr, dt_bias_ptr, norm_w_ptr, out_ptr, conv_ptr,
                      state_ptr, slots_ptr, o_ws_ptr, arrived_ptr, conv_arrived_ptr,
                      stride_x_row, stride_z_row, stride_z_head, stride_b_row, stride_b_head, stride_a_row,
                      stride_a_head, stride_o_row, stride_o_head, stride_c_slot, stride_c_c, stride_c_k,
                      stride_s_slot, stride_s_head, scale, eps, l2_eps,
                      HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, KW: tl.constexpr, KWP: tl.constexpr, NVB: tl.constexpr, BVB: tl.constexpr,
                      BVP: tl.constexpr, ROUND_Y: tl.constexpr, SOFTPLUS_MAX: tl.constexpr,
                      PAD_SLOT: tl.constexpr, EARLY_GATES: tl.constexpr, USE_GDC: tl.constexpr):
    """The split in one launch, one program per (request, value head, value block), the second
    launch's programs doing the first's work for what they read: the conv step of their v columns
    and of their key head's q and k channels, the l2norm of q and k (each program of a key head
    computes the same values from the same history), then the gates, the recurrence and the gated
    norm as `_split_core_kernel` does. Each v column belongs to one program, which rolls its history
    itself; a key head's q and k channels are read by its GROUP * NVB programs, so the last of them
    to finish reading counts in last (a per-(request, key head) counter, arrivals.py) and stores
    their rolled history, which it holds like every other. The values are the split's, the same
    rounding at the same places.

    EARLY_GATES (gdn_fused_decode's early_gates; off unless asked): the gates' loads issued with
    the slot's, before the branch on it, where they otherwise wait behind the conv counter's
    atomic (its acquire orders every later load after it): one dependent round trip fewer a
    program, the same values (a padding row's gates are computed and not used)."""
    pdl_wait(USE_GDC)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BVB + tl.arange(0, BVP)
    offs_k = tl.arange(0, BK)
    m_k = offs_k < DK
    m_c = tl.arange(0, BVP) < BVB
    act = out_ptr.dtype.element_ty
    o_row_ptr = out_ptr + row * stride_o_row + head * stride_o_head
    if EARLY_GATES:
        g, beta = head_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, row, head, stride_a_row, stride_a_head,
                             stride_b_row, stride_b_head, HK, GROUP, SOFTPLUS_MAX, act)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot != PAD_SLOT:
        kh = head // GROUP
        m_s = m_k[:, None] & m_c[None, :]
        s_ptrs = state_ptr + slot * stride_s_slot + head * stride_s_head + offs_k[:, None] * DV + cols[None, :]
        s = tl.load(s_ptrs, mask=m_s, other=0.0).to(tl.float32)
        yq, hq = conv_rolled(qkv_ptr, conv_w_ptr, conv_w_ptr, conv_ptr, slot, row, kh * DK + offs_k, m_k,
                             stride_x_row, stride_c_slot, stride_c_c, stride_c_k, KW, KWP, False, True)
        yk, hk = conv_rolled(qkv_ptr, conv_w_ptr, conv_w_ptr, conv_ptr, slot, row, (HK + kh) * DK + offs_k, m_k,
                             stride_x_row, stride_c_slot, stride_c_c, stride_c_k, KW, KWP, False, True)
        v_ch = 2 * HK * DK + head * DV + cols
        yv = conv_token(qkv_ptr, conv_w_ptr, conv_w_ptr, conv_ptr, slot, row, v_ch, m_c, stride_x_row,
                        stride_c_slot, stride_c_c, stride_c_k, KW=KW, KWP=KWP, HAS_BIAS=False, SILU=True)[0]
        # q and k as the first launch stores them (rounded to A), q with the output scale
        q = l2norm_head(yq, m_k, act, l2_eps) * scale
        k = l2norm_head(yk, m_k, act, l2_eps)
        v = yv.to(act).to(tl.float32)
        if last_to_arrive(conv_arrived_ptr + row * HK + kh, GROUP * NVB):
            store_history(conv_ptr, slot, kh * DK + offs_k, m_k, hq, stride_c_slot, stride_c_c, stride_c_k, KW, KWP)
            store_history(conv_ptr, slot, (HK + kh) * DK + offs_k, m_k, hk, stride_c_slot, stride_c_c, stride_c_k,
                          KW, KWP)
            tl.store(conv_arrived_ptr + row * HK + kh, 0)
        if not EARLY_GATES:
            g, beta = head_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, row, head, stride_a_row, stride_a_head,
                                 stride_b_row, stride_b_head, HK, GROUP, SOFTPLUS_MAX, act)
        value_block_step(s, s_ptrs, m_s, q, k, v, g, beta, z_ptr, norm_w_ptr, state_ptr, o_row_ptr, o_ws_ptr,
                         arrived_ptr, row, head, cols, m_c, stride_z_row, stride_z_head, eps, HK, GROUP, DV, BV,
                         NVB, ROUND_Y, act)
    else:
        # padding row: every program zeroes its columns and none counts in, so its counters stay zero
        tl.store(o_row_ptr + cols, tl.zeros([BVP], dtype=act), mask=m_c)


# T changes with the step: not specialized (a count of 1 would be), so one build serves every step
@triton.jit(do_not_specialize=["T"])
def _qk_gates_kernel(
    mixed_ptr, b_ptr, a_ptr, A_log_ptr, dt_bias_ptr, q_ptr, k_ptr, g_ptr, beta_ptr, T,
    stride_m_row, stride_b_row, stride_b_head, stride_a_row, stride_a_head,
    stride_q_row, stride_k_row, stride_g_row, stride_beta_row, l2_eps,
    HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BG: tl.constexpr,
    BR: tl.constexpr, SOFTPLUS_MAX: tl.constexpr, USE_GDC: tl.constexpr,
):
    """One program per (BR rows, key head): those rows' q and k heads l2-normalised, and the gates
    of the GROUP value heads that read the key head. mixed [T, C] is the conv's output (q | k | v
    channels). A block of rows, not one: a program of one 128-wide head is too little work to
    hide its own start (a 4096-row step is 65,536 such programs)."""
    pdl_wait(USE_GDC)
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    kh = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    m_r = rows < T
    m = m_r[:, None] & (offs_k < DK)[None, :]
    act = q_ptr.dtype.element_ty
    src = mixed_ptr + rows[:, None] * stride_m_row + kh * DK + offs_k[None, :]
    q = l2norm_head(tl.load(src, mask=m, other=0.0).to(tl.float32), m, act, l2_eps)
    k = l2norm_head(tl.load(src + HK * DK, mask=m, other=0.0).to(tl.float32), m, act, l2_eps)
    tl.store(q_ptr + rows[:, None] * stride_q_row + kh * DK + offs_k[None, :], q.to(act), mask=m)
    tl.store(k_ptr + rows[:, None] * stride_k_row + kh * DK + offs_k[None, :], k.to(act), mask=m)
    heads = tl.zeros([BR, BG], dtype=tl.int32) + (kh * GROUP + tl.arange(0, BG))[None, :]
    m_h = m_r[:, None] & (tl.arange(0, BG) < GROUP)[None, :]
    g, beta = gdn_gates(a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, rows[:, None], heads, m_h, stride_a_row,
                        stride_a_head, stride_b_row, stride_b_head, act, SOFTPLUS_MAX)
    tl.store(g_ptr + rows[:, None] * stride_g_row + heads, g, mask=m_h)
    tl.store(beta_ptr + rows[:, None] * stride_beta_row + heads, beta.to(act), mask=m_h)


# T and real_at change with the step: not specialized (a value of 1 would be), so one build serves
# every step
@triton.jit(do_not_specialize=["T", "real_at"])
def _gated_rmsnorm_kernel(
    core_ptr, z_ptr, norm_w_ptr, out_ptr, slots_ptr, bounds_ptr, real_at, T,
    stride_c_row, stride_c_head, stride_z_row, stride_z_head, stride_o_row, stride_o_head, eps,
    DV: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, ROUND_Y: tl.constexpr,
    ROWS_PER_SLOT: tl.constexpr,  # > 0: row r is padding where slots[r // ROWS_PER_SLOT] is the padding slot
    PAD_SLOT: tl.constexpr, USE_GDC: tl.constexpr,
):
    """One program per (BR rows, value head): out = GatedRMSNorm(core, z), each row's head
    normalised alone. Padding rows (by slot, or at or past bounds[real_at] when ROWS_PER_SLOT is
    0) read nothing and write zeros. Rows in blocks for the reason `_qk_gates_kernel` gives."""
    pdl_wait(USE_GDC)
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    head = tl.program_id(1)
    offs_v = tl.arange(0, BV)
    m_r = rows < T
    act = out_ptr.dtype.element_ty
    if ROWS_PER_SLOT > 0:
        slot = tl.load(slots_ptr + rows // ROWS_PER_SLOT, mask=m_r, other=PAD_SLOT).to(tl.int64)
        real = m_r & (slot != PAD_SLOT)
    else:
        real = m_r & (rows < tl.load(bounds_ptr + real_at).to(tl.int64))
    m = real[:, None] & (offs_v < DV)[None, :]
    core = tl.load(core_ptr + rows[:, None] * stride_c_row + head * stride_c_head + offs_v[None, :], mask=m,
                   other=0.0)
    z = tl.load(z_ptr + rows[:, None] * stride_z_row + head * stride_z_head + offs_v[None, :], mask=m, other=0.0)
    weight = tl.load(norm_w_ptr + offs_v, mask=offs_v < DV, other=0.0).to(tl.float32)
    y = gated_norm_head(core.to(tl.float32), z.to(tl.float32), weight[None, :], m, eps, DV, act, ROUND_Y)
    tl.store(out_ptr + rows[:, None] * stride_o_row + head * stride_o_head + offs_v[None, :],
             tl.where(m, y, 0.0).to(act), mask=m_r[:, None] & (offs_v < DV)[None, :])


# ---------------------------------------------------------------------------------------------
# launchers (host side: shape checks only, never a device read)
# ---------------------------------------------------------------------------------------------

# launched in the eager gaps of piecewise steps with the same arguments step after step (linear.py)
_GDN_FUSED_DECODE = Launcher(_gdn_fused_decode_kernel)
_SPLIT_PREP = Launcher(_split_prep_kernel)
_SPLIT_CORE = Launcher(_split_core_kernel)
_SPLIT_ONE = Launcher(_split_one_kernel)
_QK_GATES = Launcher(_qk_gates_kernel)
_GATED_RMSNORM = Launcher(_gated_rmsnorm_kernel)


class GdnDims(NamedTuple):
    """The dims of one gdn_fused call."""

    hk: int  # key heads
    hv: int  # value heads (a multiple of hk)
    dk: int
    dv: int
    channels: int  # the conv's: 2 * hk * dk + hv * dv
    kernel_width: int  # the conv's K


def gdn_dims(qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, k_heads: int, what: str) -> GdnDims:
    """The call's dims from its shapes, every argument checked against them (`what` names the call)."""
    rows, C = qkv.shape
    Hv, Dv = out.shape[1], out.shape[2]
    Hk = int(k_heads)
    Dk = (C - Hv * Dv) // (2 * Hk) if Hk > 0 else 0
    K = conv_weight.shape[1] if conv_weight.dim() == 2 else 0
    problems = []
    if Hk <= 0 or Dk <= 0 or 2 * Hk * Dk + Hv * Dv != C or Hv % Hk:
        problems.append(f"qkv width {C} is not 2 * {Hk} key heads * Dk + {Hv} * {Dv} with {Hv} value heads "
                        f"a multiple of {Hk}")
    expected = {"z": (z, (rows, Hv, Dv)), "b": (b, (rows, Hv)), "a": (a, (rows, Hv)),
                "conv_weight": (conv_weight, (C, K)),
                "A_log": (A_log, (Hv,)), "dt_bias": (dt_bias, (Hv,)), "norm_weight": (norm_weight, (Dv,)),
                "out": (out, (rows, Hv, Dv))}
    problems += [f"{name} {tuple(t.shape)}, expected {shape}" for name, (t, shape) in expected.items()
                 if tuple(t.shape) != shape]
    if K < 2:
        problems.append(f"conv width {K}: a width-1 conv keeps no state")
    if qkv.dtype != out.dtype:
        problems.append(f"qkv is {qkv.dtype} and out {out.dtype}: the op computes in one activation dtype")
    for name, t in (("qkv", qkv), ("z", z), ("out", out)):
        if t.stride(-1) != 1:
            problems.append(f"{name} needs a unit-stride last dimension (strides {t.stride()})")
    # conv_weight: the kernels take its width as its row stride (linear.py conv_rolled)
    for name, t in (("conv_weight", conv_weight), ("A_log", A_log), ("dt_bias", dt_bias), ("norm_weight", norm_weight)):
        if not t.is_contiguous():
            problems.append(f"{name} must be contiguous")
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
    return GdnDims(Hk, Hv, Dk, Dv, C, K)


def decode_warps(dk: int, dv: int) -> int:
    """Warps of a fused decode program: ~64 state floats a thread (8 warps at Dk = Dv = 128). Built
    for sm_90 at those dims (Triton 3.9, bf16 and float32), 8 warps take 254 registers a thread
    and spill nothing, 16 take 128 and spill a few bytes, 4 spill some 3.7 KB a thread."""
    return max(1, min(8, next_pow2(dk) * next_pow2(dv) // 2048))


# Decode steps of at most this many requests take the two-launch split (`gdn_fused_decode`), those
# up to ONE_LAUNCH_MAX_ROWS the one launch, larger ones the four launches of the unfused kernels. On
# the H200 at bench qwen3_next's dims, us a layer (benchmarks/kernels/gdn_fused_bench.py,
# benchmarks/history/linear_decode.md "The fused GDN mixer", 2026-12-04), split / one launch / four
# launches / the unfused region (its glue compiled): batch 1, 8.17 / 12.05 / 8.59 / 11.27; batch 8,
# 15.94 / 14.35 / 14.04 / 15.79; batch 16, 27.97 / 27.81 / 21.02 / 21.60; batch 128, 212.4 / 286.4 /
# 182.9 / 185.6. Past one request the one launch never won: its program per (request, key head)
# walks two 64 KiB states where the recurrent decode kernel's narrow tiles spread them over the card.
# It stays the op's kernel under fixed decode tiles (batch-invariant: one kernel at every batch).
# Those split numbers are of whole-head programs (v_blocks 1): at batch 1 the second launch's 32
# programs each stream a head's 64 KiB state in and out at what one SM can pull (6.5 us of the
# layer, where the state's bytes at the card's copy rate take about 1 us) on a card of 132 SMs. So
# the split now also divides each head's value columns over value blocks (default_v_blocks: 4 of
# 32 columns at batch 1 of those dims, 128 programs), the last block of a head normalising it.
SPLIT_DECODE_MAX_ROWS = 1
ONE_LAUNCH_MAX_ROWS = 1
# The narrowest value block the default takes: 32 float32 columns, a key channel's 128-byte line
MIN_VALUE_BLOCK = 32


def default_v_blocks(rows: int, hv: int, dv: int, sms: int) -> int:
    """The split's value blocks for a step of `rows` requests: the fewest (a power of two dividing
    Dv, blocks of at least MIN_VALUE_BLOCK columns) that give each of `sms` SMs a program, else
    the most such (at most `rows` * `hv` * blocks programs can run)."""
    n = 1
    while rows * hv * n < sms and dv % (2 * n) == 0 and dv // (2 * n) >= MIN_VALUE_BLOCK:
        n *= 2
    return n


class SplitScratch(NamedTuple):
    """Where a split launch's value blocks meet (last_block_gated_norm), per (request, value head)."""

    arrived: torch.Tensor  # int32 [pairs]: blocks of the pair done in the running launch (0 between launches)
    o_ws: torch.Tensor  # float32 [pairs * Dv]: the pair's core output, block by block


# Per device, one SplitScratch shared by every split launch of every layer, allocated zeroed once
# and grown outside any CUDA graph capture. Sharing is safe: launches on one stream run in order,
# and each launch leaves every counter it touched at zero (a head's last block resets it; a padding
# row's blocks never count in), so the next launch or a graph's replay starts from zeros; the
# workspace is written before it is read within a launch. Launches on two streams at once would
# race on it: the runtime runs its steps on one. A grown-out SplitScratch stays referenced here:
# a graph captured over it replays into memory nothing else was handed.
_SPLIT_SCRATCH: dict[torch.device, SplitScratch] = {}
_RETIRED_SCRATCH: list[SplitScratch] = []


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def split_scratch(device, pairs: int, dv: int, what: str = "gdn_fused") -> SplitScratch:
    """The device's SplitScratch, with room for `pairs` (request, value head) pairs of Dv columns."""
    device = torch.device(device)
    have = _SPLIT_SCRATCH.get(device)
    if have is not None and have.arrived.numel() >= pairs and have.o_ws.numel() >= pairs * dv:
        return have
    if _capturing(device):
        # an allocation here would be the graph's, and its zeroing a node replayed over live counters
        held = "none" if have is None else f"{have.arrived.numel()} pairs, {have.o_ws.numel()} workspace floats"
        raise RuntimeError(f"{what}: the split decode's value-block buffers on {device} hold {held}; this step "
                           f"needs {pairs} (request, value head) pairs of {dv} columns ({pairs * dv} floats). "
                           f"They grow only outside a CUDA graph capture: run a step of this size before capturing")
    if have is not None:
        _RETIRED_SCRATCH.append(have)
        pairs, floats = max(pairs, have.arrived.numel()), max(pairs * dv, have.o_ws.numel())
    else:
        floats = pairs * dv
    fresh = SplitScratch(torch.zeros(pairs, dtype=torch.int32, device=device),
                         torch.zeros(floats, dtype=torch.float32, device=device))
    _SPLIT_SCRATCH[device] = fresh
    return fresh


def decode_launches(rows: int) -> int:
    """Launches of a decode step of `rows` requests (SPLIT_DECODE_MAX_ROWS, ONE_LAUNCH_MAX_ROWS): 2
    and 1 are `gdn_fused_decode`'s, 4 the unfused kernels the caller runs (triton_linear runs them
    as it runs a verify step's: its short_conv and gdn_core, `qk_gates`, `gated_rmsnorm`)."""
    if rows <= SPLIT_DECODE_MAX_ROWS:
        return 2
    return 1 if rows <= ONE_LAUNCH_MAX_ROWS else 4


def gdn_fused_decode(qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, conv_state, state, slots,
                     k_heads: int, scale: float, eps: float, what: str = "gdn_fused",
                     num_warps: int | None = None, launches: int | None = None,
                     v_blocks: int | None = None, merged_split: bool = False, early_gates: bool = False) -> None:
    """One decode step of a GDN mixer: row r is request r, on slot slots[r] (the padding slot: a zero
    row, nothing read or kept). conv_state [slots+1, C, K-1] and state [slots+1, Hv, Dk, Dv] (float32
    or bfloat16, read into float32) are the layer's, updated in place.

    launches: 1, one program per (request, key head) through everything; 2, the split: the conv and
    the l2norm per (request, q | k | v head) into a [B, C] buffer, then the gates, recurrence and
    gated norm per (request, value head, value block), more programs where requests are few. None:
    `decode_launches`, which is neither for many requests: the caller runs the unfused kernels
    there. Both (the split with v_blocks 1) compute the same values in the same order, so a
    request's output does not depend on which one ran. `num_warps` pins the recurrence's warps
    (benchmarks); None: decode_warps of a program's columns, for the one launch the same at every
    batch, so under fixed tiles a request's reductions never depend on what shares its step.

    v_blocks (the split only): value blocks of Dv / v_blocks columns each head's state is split
    into, one program each; the last of a head's blocks to finish computes its gated norm over the
    whole row, in one order whatever order they finish in. 1: one program holds the whole head and
    normalises it itself (no counter), the one launch's tiles and so its order of sums. None:
    default_v_blocks for the device's SMs. Narrower blocks compute each column as the whole head
    does, their key sums maybe in another order (another tile's layout): float32 noise.

    merged_split (the split only): its two launches as one (`_split_one_kernel`: each program of the
    second does the first's conv and l2norm for what it reads), the same values. early_gates (with
    merged_split; triton_linear's split_decode "one_launch_early"): its gates loaded before its slot is known (`_split_one_kernel`'s
    EARLY_GATES), the same values."""
    d = gdn_dims(qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, k_heads, what)
    B = qkv.shape[0]
    if slots.shape != (B,):
        raise ValueError(f"{what}: {B} decode rows and state slots of shape {tuple(slots.shape)}")
    if conv_state.shape[1:] != (d.channels, d.kernel_width - 1) or not history_strided(conv_state):
        raise ValueError(f"{what}: conv state {tuple(conv_state.shape)} strides {conv_state.stride()}, expected "
                         f"[slots+1, {d.channels}, {d.kernel_width - 1}] with a unit stride on its channels or its "
                         f"history")
    if state.dtype not in STATE_TORCH_DTYPES or state.shape[1:] != (d.hv, d.dk, d.dv) or state.stride(3) != 1 \
            or state.stride(2) != d.dv:
        raise ValueError(f"{what}: state {state.dtype} {tuple(state.shape)}, expected [slots+1, {d.hv}, {d.dk}, "
                         f"{d.dv}] in one of {STATE_DTYPES} with contiguous [Dk, Dv] states")
    launches = decode_launches(B) if launches is None else launches
    if launches not in (1, 2):
        raise ValueError(f"{what}: launches {launches}: 1 or 2 (a step of {B} requests takes the unfused "
                         f"kernels, which the caller runs)")
    if merged_split and launches != 2:
        raise ValueError(f"{what}: merged_split merges the split's two launches; this call takes {launches}")
    if early_gates and not merged_split:
        raise ValueError(f"{what}: early_gates is the merged split's (merged_split); this call does not merge")
    if v_blocks is not None and (launches != 2 or v_blocks < 1 or d.dv % v_blocks):
        raise ValueError(f"{what}: v_blocks {v_blocks}: the two-launch split's value blocks, a count that "
                         f"divides Dv {d.dv} (this call takes {launches} launch(es))")
    if B == 0:
        return
    BK, BV, KWP = next_pow2(d.dk), next_pow2(d.dv), next_pow2(d.kernel_width)
    round_y = rounds_weighted_norm(norm_weight, out)
    warps = num_warps or decode_warps(d.dk, d.dv)
    if launches == 2 and merged_split:
        _split_one(qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, conv_state, state, slots, d, scale,
                   eps, round_y, num_warps, v_blocks, what, early_gates)
        return
    if launches == 2:
        mixed = torch.empty((B, d.channels), dtype=qkv.dtype, device=qkv.device)
        _SPLIT_PREP[(B, 2 * d.hk + d.hv)](
            qkv, conv_weight, conv_state, slots, mixed, qkv.stride(0), *conv_state.stride(),
            mixed.stride(0), L2NORM_EPS, HK=d.hk, DK=d.dk, DV=d.dv, BK=BK, BV=BV,
            KW=d.kernel_width, KWP=KWP, PAD_SLOT=PADDING_SLOT, num_warps=1, **launch_args(qkv.device))
        _split_core(mixed, z, b, a, A_log, dt_bias, norm_weight, out, state, slots, d, scale, eps, round_y,
                    num_warps, v_blocks, what)
        return
    _GDN_FUSED_DECODE[(B, d.hk)](
        qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, conv_state, state, slots,
        qkv.stride(0), z.stride(0), z.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
        out.stride(0), out.stride(1), *conv_state.stride(),
        state.stride(0), state.stride(1), float(scale), float(eps), L2NORM_EPS,
        HK=d.hk, GROUP=d.hv // d.hk, DK=d.dk, DV=d.dv, BK=BK, BV=BV, KW=d.kernel_width, KWP=KWP, ROUND_Y=round_y,
        SOFTPLUS_MAX=SOFTPLUS_THRESHOLD, PAD_SLOT=PADDING_SLOT, num_warps=warps, **launch_args(qkv.device))


def _value_blocks(B: int, d: GdnDims, slots, out, v_blocks: int | None, what: str) -> tuple:
    """(value blocks, grid, SplitScratch) of a split's second launch (or its merged launch):
    (request, value head) programs, or (request, value head, value block) ones meeting in the
    device's SplitScratch."""
    nvb = default_v_blocks(B, d.hv, d.dv, num_sms(out.device)) if v_blocks is None else v_blocks
    if nvb == 1:
        return nvb, (B, d.hv), SplitScratch(slots, out)  # not read: the program normalises its own head
    return nvb, (B, d.hv, nvb), split_scratch(out.device, B * d.hv, d.dv, what)


def _split_one(qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, conv_state, state, slots, d: GdnDims,
               scale, eps, round_y: bool, num_warps: int | None, v_blocks: int | None, what: str,
               early_gates: bool = False) -> None:
    """The split as one launch (`_split_one_kernel`), its key heads' conv counters on the device's
    shared arrival counters (arrivals.py)."""
    B = qkv.shape[0]
    nvb, grid, scratch = _value_blocks(B, d, slots, out, v_blocks, what)
    block = d.dv // nvb
    conv_arrived = arrival_counters(qkv.device, B * d.hk, "gdn_fused split")
    _SPLIT_ONE[grid](
        qkv, z, b, a, conv_weight, A_log, dt_bias, norm_weight, out, conv_state, state, slots, scratch.o_ws,
        scratch.arrived, conv_arrived, qkv.stride(0), z.stride(0), z.stride(1), b.stride(0), b.stride(1),
        a.stride(0), a.stride(1), out.stride(0), out.stride(1), *conv_state.stride(),
        state.stride(0), state.stride(1), float(scale), float(eps), L2NORM_EPS,
        HK=d.hk, GROUP=d.hv // d.hk, DK=d.dk, DV=d.dv, BK=next_pow2(d.dk), BV=next_pow2(d.dv), KW=d.kernel_width,
        KWP=next_pow2(d.kernel_width), NVB=nvb, BVB=block, BVP=next_pow2(block), ROUND_Y=round_y,
        SOFTPLUS_MAX=SOFTPLUS_THRESHOLD, PAD_SLOT=PADDING_SLOT, EARLY_GATES=early_gates,
        num_warps=num_warps or decode_warps(d.dk, block), **launch_args(qkv.device))


def _split_core(mixed, z, b, a, A_log, dt_bias, norm_weight, out, state, slots, d: GdnDims, scale, eps,
                round_y: bool, num_warps: int | None, v_blocks: int | None, what: str) -> None:
    """The split's second launch over the first's q, k, v in `mixed` (`_value_blocks`' programs)."""
    B = mixed.shape[0]
    nvb, grid, scratch = _value_blocks(B, d, slots, out, v_blocks, what)
    block = d.dv // nvb
    _SPLIT_CORE[grid](
        mixed, z, b, a, A_log, dt_bias, norm_weight, out, state, slots, scratch.o_ws, scratch.arrived,
        mixed.stride(0), z.stride(0), z.stride(1), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), float(scale), float(eps),
        HK=d.hk, GROUP=d.hv // d.hk, DK=d.dk, DV=d.dv, BK=next_pow2(d.dk), BV=next_pow2(d.dv), NVB=nvb,
        BVB=block, BVP=next_pow2(block), ROUND_Y=round_y, SOFTPLUS_MAX=SOFTPLUS_THRESHOLD, PAD_SLOT=PADDING_SLOT,
        num_warps=num_warps or decode_warps(d.dk, block), **launch_args(mixed.device))


# Rows a program of `qk_gates` and `gated_rmsnorm` takes: a [16, 128] tile over 4 warps keeps 16
# values a thread in flight where one row's 128 gave a one-warp program 4 (the row kernels took
# 80 and 42 us a layer at 4096 tokens on an H200, 3.5x and 2.6x their bytes at the copy rate).
# One value for every step, so each kernel is one build.
BLOCK_ROWS = 16


def _row_warps(block_rows: int, width: int) -> int:
    """Warps for a [block_rows, width] tile: 16 values a thread, 1 to 8 warps (one row of 128: the
    one warp the row kernels had)."""
    return max(1, min(8, block_rows * next_pow2(width) // 512))


def qk_gates(mixed, b, a, A_log, dt_bias, d: GdnDims, block_rows: int = BLOCK_ROWS) -> tuple:
    """(q, k [T, Hk, Dk] l2-normalised, v [T, Hv, Dv] a view of mixed, g [T, Hv] float32, beta
    [T, Hv]) from the conv's output mixed [T, C] (contiguous), in one launch over every row.
    block_rows: rows a program takes (a power of two; benchmarks compare 1 with BLOCK_ROWS)."""
    T = mixed.shape[0]
    assert mixed.shape == (T, d.channels) and mixed.is_contiguous(), (
        f"gdn_fused: the conv's output must be a contiguous [T, {d.channels}], got {tuple(mixed.shape)}")
    q = torch.empty(T, d.hk, d.dk, dtype=mixed.dtype, device=mixed.device)
    k = torch.empty_like(q)
    g = torch.empty(T, d.hv, dtype=torch.float32, device=mixed.device)
    beta = torch.empty(T, d.hv, dtype=mixed.dtype, device=mixed.device)
    v = mixed[:, 2 * d.hk * d.dk:].view(T, d.hv, d.dv)
    if T:
        group = d.hv // d.hk
        _QK_GATES[(cdiv(T, block_rows), d.hk)](
            mixed, b, a, A_log, dt_bias, q, k, g, beta, T,
            mixed.stride(0), b.stride(0), b.stride(1), a.stride(0), a.stride(1),
            q.stride(0), k.stride(0), g.stride(0), beta.stride(0), L2NORM_EPS,
            HK=d.hk, GROUP=group, DK=d.dk, BK=next_pow2(d.dk), BG=next_pow2(group), BR=block_rows,
            SOFTPLUS_MAX=SOFTPLUS_THRESHOLD, num_warps=_row_warps(block_rows, d.dk), **launch_args(mixed.device))
    return q, k, v, g, beta


def gated_rmsnorm(core, z, norm_weight, out, eps: float, *, slots=None, rows_per_slot: int = 0,
                  bounds=None, block_rows: int = BLOCK_ROWS) -> None:
    """out = GatedRMSNorm(core, z) over every row, in one launch; padding rows zero. Either
    `slots` [B] with `rows_per_slot` n (row r belongs to request r // n), or `bounds`, an extend
    plan's padded bounds on the device (cu_seqlens, then the step's rows: the real rows end at its
    second-to-last entry). The whole tensor is passed, not a view of that entry, so the pointer
    keeps the plan's alignment whatever the request count (a new alignment is a new Triton build).
    block_rows: rows a program takes, as in `qk_gates`."""
    T, Hv, Dv = out.shape
    assert core.shape == out.shape and core.stride(-1) == 1, f"gdn_fused: core {tuple(core.shape)}"
    assert (slots is not None and rows_per_slot > 0) != (bounds is not None), (
        "gated_rmsnorm: padding rows come from slots (with rows_per_slot) or from bounds, one of the two")
    if T == 0:
        return
    marker = slots if slots is not None else bounds
    real_at = 0 if bounds is None else bounds.shape[0] - 2
    _GATED_RMSNORM[(cdiv(T, block_rows), Hv)](
        core, z, norm_weight, out, marker, marker, real_at, T,
        core.stride(0), core.stride(1), z.stride(0), z.stride(1), out.stride(0), out.stride(1),
        float(eps), DV=Dv, BV=next_pow2(Dv), BR=block_rows, ROUND_Y=rounds_weighted_norm(norm_weight, out),
        ROWS_PER_SLOT=rows_per_slot, PAD_SLOT=PADDING_SLOT, num_warps=_row_warps(block_rows, Dv),
        **launch_args(out.device))
