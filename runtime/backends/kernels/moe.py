"""Fused Triton MoE: the `moe` op with device-side routing, static-shape token sorting and grouped GEMMs.

Implements `hgc.moe` (compiler/splitops/ops.py) with the exact semantics of
`runtime.backends.cpu_reference.route_topk` / `moe_reference`, capturable in a CUDA graph: no host
synchronisation, no data-dependent shapes, every launch grid a function of (T, E, top_k, I, S, D)
and the chosen config only. Counts that change from step to step (T, P, n_real, num_pid_m, the
sentinel) are `do_not_specialize`: Triton would otherwise build a kernel again for each class of
their values (divisible by 16, equal to 1), so a length that `hgc build` never ran would build a
kernel at serving time, outside the artifact's bundle.

The shared expert rides in the same launches. SwiGLU is separable over intermediate channels, so a
shared expert of width S is the sum of n_shared = ceil(S/I) experts of the routed width I (the last
one masked past S): chunk c is expert id E + c, and every real token selects all of them with the
weight g = sigmoid(x . shared_gate) (1 without a gate). The GEMM kernels read the weights of an id
>= E from the shared tensors (a branch per program on its expert id), so the expert weights are
never concatenated or copied, and a model without a shared expert compiles that branch out.

One call, in order (T tokens, E routed experts, k = top_k, slots = k + n_shared per token, P =
T*slots (token, slot) pairs, ids E + n_shared the padding sentinel):

1. Router logits [T,E] float32: for T <= 128 `_logits_gemv_kernel` spreads the router over many
   programs, and with a gated shared expert one more program puts the gate's logit x . g in
   column E (`logits_kernel_for` says why); otherwise `_logits_kernel` (bf16 operands, float32
   accumulation), or, asked for ("split", the backend's router option "split"; under 64 experts),
   `_split_router_kernel`: the GEMM in slices of D, and the last slice of each row block to finish
   sums them and routes its rows, steps 1 and 2 in one launch; asked for ("fused"), step 2
   computes them itself. Products of bf16 numbers are exact in
   float32, so each is the reference's `x.float() @ W.float().T` up to summation order.
2. `_route_kernel`, one program per token: softmax or sigmoid scores, + bias for selection only,
   grouped selection (groups ranked by the sum of their two best biased scores), top-k, weights
   renormalised and scaled; then the shared chunks' ids and the gate g in the slots after the
   top-k. Rows at or past the real token count get the sentinel in every slot and weight 0, so
   padding costs no expert work.
3. Sorted path (`BLOCK_M >= 16`): `_align_kernel` lays the pairs out expert by expert (the shared
   chunks after the routed experts), each expert's in pair order (stable, so the result is
   deterministic), in segments padded to BLOCK_M with the sentinel pair id P, and writes the
   expert of each block. Its programs each place one block of pairs: a pair's row is its
   expert's segment start + the expert's pairs in earlier blocks + its rank in its own block (a
   sort of the block's expert-major keys, or with count_ranks a running count down a one-hot of
   the block's experts); further programs pad the segments. Up to
   256 pairs one block holds them all and the kernel counts them itself; up to SCAN_MAX_PAIRS
   blocks of SCAN_BLOCK_P whose programs each count every pair (one launch for a decode or short
   extend step either way, `sort_blocks`); past that, in blocks of COUNTED_BLOCK_P,
   `_align_count_kernel` first counts each block's pairs per expert, so no program scans more
   than its own block. Nothing is zeroed
   before, and no atomics. Buffers have the static bound
   `P + min(E + n_shared, P) * (BLOCK_M - 1)` rows; blocks past the used total exit at once, and
   an expert with no pairs owns no block, so its weights are never read.
   Steps 2 and 3 in one launch for a small step (`route_sort_folds`: up to 64 tokens, fewer past 64
   experts, after the GEMV): `_route_sort_kernel`, one program, routes every token at
   once (`_route_rows` over a [tokens, experts] tile, as `_route_kernel` runs it over one token)
   and then lays out the pairs as `_align_kernel`'s one-block case does.
   The router in one launch where asked (`one_launch_router`, the backend's router option) and the
   step folds (`router_folds`): after the GEMV (tokens that fit one routing tile), `_router_kernel`
   runs step 1's GEMV programs, and the last of them to finish (runtime/backends/kernels/arrivals.py)
   routes every token, and sorts where `route_sort_folds` allows, then zeroes its counter; after the
   GEMM (up to 64 experts: one tile holds a token's row), `_logits_route_kernel`'s programs each
   route their own rows. A layer's router is then one launch where it was two.
4. `_gate_up_sorted_kernel`: grouped GEMM x[tokens] @ w13[e]^T (for a shared chunk, its rows of
   shared_w13), gate and up tiles side by side, SiLU(gate) * up fused, h [rows, I] stored in
   sorted row order.
5. `_down_sorted_kernel`: h @ w2[e]^T (for a shared chunk, its columns of shared_w2) times the
   pair's weight, stored per pair: y [P, D].
6. `_combine_kernel`: out[t] = sum_j y[t*slots + j] in float32, in slot order (deterministic, no
   atomics), one program per token and 2048 columns; rows of padding tokens come out zero.
   Steps 5 and 6 as the split down where asked (`split_down`, the backend's down option, from
   SPLIT_DOWN_MIN_TOKENS tokens): step 4 writes the shared chunks' rows by token into h_shared
   [T, S] instead; `down_split` runs torch's grouped GEMM over the routed experts' segments
   (w2 seen as [E, I, D], no copy) and one dense GEMM of h_shared with shared_w2;
   `_split_maps_kernel` makes the GEMM's offsets and the sort's inverse map from the sort in one
   launch; `_combine_split_kernel` sums each token's routed rows through that map times their
   weights, then its shared row times the gate.

Token path (`BLOCK_M == 1`, chosen for tiny T such as batch-1 decode): no sorting. One GEMV program
per (pair, column tile) computes h, then one program per (token, column tile) runs the down
projection of its k experts and n_shared shared chunks and combines them in slot order. Each active
expert's weights are read once per token, which at T=1 is exactly the active experts' bytes. Asked
for (the backend's experts option "one_launch", with the routing in the gate-up kernel),
`_experts_token_kernel` runs both as one launch, its down programs waiting for their token's
gate-up programs (measured slower on an H100: docs/DESIGN.md).

Kernel configs: runtime/backends/kernels/moe_config.py. Shapes never depend on data, so the same launches
replay from a CUDA graph; the backend (runtime/backends/triton_moe.py) adds the runtime protocol
(capability, capture hooks, padding count) and imports this module on its first call, as the
Triton linear backend imports its kernels: importing the backend needs no triton, and
TRITON_INTERPRET is read when the kernels are first needed.

Not done here: expert parallelism, quantised weights. Inputs must be contiguous in their last
dimension (asserted, never copied: a copy of the expert weights per call would cost more than the op).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from compiler.splitops import moe_shared_width
from runtime.backends.kernels.arrivals import arrival_counters, last_to_arrive
from runtime.backends.kernels.launch_math import cdiv, next_pow2, triton_interpreted
from runtime.backends.kernels.moe_config import GemmConfig, MoEConfig, check_count_ranks
from runtime.backends.kernels.pdl import launch_args, pdl_wait

__all__ = ["combine", "down_sorted", "down_token", "fused_moe", "gate_up_sorted", "gate_up_token", "max_sorted_rows",
           "route", "route_sort", "route_sort_folds", "router_folds", "shared_chunks", "sort_tokens"]

GEMV_LOGITS_MAX_TOKENS = 128  # logits_kernel_for says why
# The router GEMM's tile past it, (BLOCK_M, BLOCK_K, num_warps, num_stages): with 16 to 64 experts the
# grid is T / BLOCK_M programs, each walking D in BLOCK_K steps. Bench qwen3_next's router on an H200
# (benchmarks/probes/router_logits_probe.py, the GEMM and the routing kernel, us): at 512 tokens
# 11.1 here against 9.8 for the best of five other tiles (16, 256, 4, 3); at 4096 this tile was the
# best (15.0 against 15.1-16.2). One tile for every count: a second would save ~1 us a layer at 512.
LOGITS_DOT_TILE = (64, 64, 4, 4)
# The split router's tile and its slices of D ("split" logits, `_split_router_kernel`): D = 2048 in 8
# slices of 256 columns, 4 steps of 64 each, 8 programs a 64-token row block.
LOGITS_SPLIT_TILE = (64, 64, 4, 3)
LOGITS_SPLIT = 8
LOGITS_KERNELS = ("fused", "gemv", "dot", "split")  # `route`'s logits_kernel choices


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _logits_kernel(x_ptr, w_ptr, out_ptr, T, E, D, stride_xt, stride_we,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_FP32: tl.constexpr, USE_GDC: tl.constexpr):
    """logits [T,E] float32 = x [T,D] @ w [E,D]^T."""
    pdl_wait(USE_GDC)
    _logits_tile(x_ptr, w_ptr, out_ptr, tl.program_id(0), tl.program_id(1), T, E, D, stride_xt, stride_we, BLOCK_M,
                 BLOCK_N, BLOCK_K, DOT_FP32)


@triton.jit
def _logits_tile(x_ptr, w_ptr, out_ptr, pid_m, pid_n, T, E, D, stride_xt, stride_we, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Rows pid_m*BLOCK_M.. and experts pid_n*BLOCK_N.. of the router's logits, stored in out [T, E]."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < T
    n_mask = offs_n < E
    a_ptrs = x_ptr + offs_m[:, None] * stride_xt + offs_k[None, :]  # [BM,BK]
    b_ptrs = w_ptr + offs_n[None, :] * stride_we + offs_k[:, None]  # [BK,BN]
    # DOT_FP32 (mixed or float32 operands): exact float32 products, as the reference computes them.
    acc = _dot_block(a_ptrs, b_ptrs, m_mask, n_mask, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, False, False)
    tl.store(out_ptr + offs_m[:, None] * E + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["T", "n_real"])
def _logits_route_kernel(x_ptr, w_ptr, sgate_ptr, logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, T, n_real,
                         routed_scale, D, stride_xt, stride_we,
                         E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                         NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                         G_PAD: tl.constexpr, S_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr,
                         RENORM: tl.constexpr, NREAL_FROM_PTR: tl.constexpr, N_SHARED: tl.constexpr,
                         NS_PAD: tl.constexpr, SHARED_GATE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                         USE_GDC: tl.constexpr):
    """The router GEMM with the routing in its epilogue (`router_folds`, the "dot" logits): one
    program holds BLOCK_M tokens' whole rows of logits (every expert in one BLOCK_N tile), so it
    routes them itself (`_route_rows` over its rows), the shared gate's logit x . gate summed here
    BLOCK_K columns at a time. Nothing is shared between programs."""
    pdl_wait(USE_GDC)
    pid_m = tl.program_id(0)
    _logits_tile(x_ptr, w_ptr, logits_ptr, pid_m, 0, T, E, D, stride_xt, stride_we, BLOCK_M, BLOCK_N, BLOCK_K,
                 DOT_FP32)
    gate_logit = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if N_SHARED > 0 and SHARED_GATE:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + offs_k
            xv = tl.load(x_ptr + offs_m[:, None] * stride_xt + k[None, :],
                         mask=(offs_m[:, None] < T) & (k[None, :] < D), other=0.0).to(tl.float32)
            acc_g += xv * tl.load(sgate_ptr + k, mask=k < D, other=0.0).to(tl.float32)[None, :]
        gate_logit += tl.sum(acc_g, axis=1)
    # the rows are read back by other threads of this program: a CTA barrier orders the stores first
    tl.debug_barrier()
    _route_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, pid_m * BLOCK_M, T, n_real, routed_scale, E,
                gate_logit, E, TOP_K, K_PAD, NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS, G_PAD, S_PAD, BLOCK_M, HAS_BIAS,
                SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD, SHARED_GATE, False, False)


@triton.jit(do_not_specialize=["T", "n_real"])
def _split_router_kernel(x_ptr, w_ptr, sgate_ptr, part_ptr, logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr,
                         arrived_ptr, T, n_real, routed_scale, D, stride_xt, stride_we, stride_lt,
                         E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                         NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                         G_PAD: tl.constexpr, S_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr,
                         RENORM: tl.constexpr, NREAL_FROM_PTR: tl.constexpr, N_SHARED: tl.constexpr,
                         NS_PAD: tl.constexpr, SHARED_GATE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, K_SLICE: tl.constexpr,
                         DOT_FP32: tl.constexpr, USE_GDC: tl.constexpr):
    """The router of a long step in one launch ("split" logits): program (m, s) multiplies BLOCK_M
    tokens by slice s of D (K_SLICE columns, the shared gate's row as column E of the tile) and
    stores that partial [BLOCK_M, BLOCK_N] tile; the last of row block m's SPLIT programs to
    finish (arrivals.py) sums the partials in slice order, stores the logits (the gate's in
    column E) and routes the rows (`_route_rows`), then zeroes its counter.

    Why: one program walking D = 2048 in 32 dependent steps took ~8.5 us at any token count (bench
    qwen3_next on an H200), and the routing kernel ~5 more; slices put SPLIT times the programs in
    flight, each a few steps long. The sum runs in slice order whichever program finishes last,
    and SPLIT and the tile depend on D only, so a token's logits have the same bits at every step
    size this kernel serves."""
    pdl_wait(USE_GDC)
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_SLICE, BLOCK_K):
        k = s * K_SLICE + k0 + offs_k
        k_mask = k < D
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xt + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptr + offs_n[None, :] * stride_we + k[:, None], mask=(offs_n < E)[None, :] & k_mask[:, None],
                    other=0.0)
        if N_SHARED > 0 and SHARED_GATE:  # the gate's row in column E (the loads above hold 0 there)
            b += tl.load(sgate_ptr + k[:, None] + offs_n[None, :] * 0, mask=(offs_n == E)[None, :] & k_mask[:, None],
                         other=0.0)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tile = (offs_m[:, None] + s * T).to(tl.int64) * BLOCK_N + offs_n[None, :]
    tl.store(part_ptr + tile, acc, mask=m_mask[:, None])
    if last_to_arrive(arrived_ptr + pid_m, SPLIT):
        logits = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(SPLIT):
            tile = (offs_m[:, None] + j * T).to(tl.int64) * BLOCK_N + offs_n[None, :]
            logits += tl.load(part_ptr + tile, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
        COLS: tl.constexpr = E + (1 if N_SHARED > 0 and SHARED_GATE else 0)
        tl.store(logits_ptr + offs_m[:, None].to(tl.int64) * stride_lt + offs_n[None, :], logits,
                 mask=m_mask[:, None] & (offs_n < COLS)[None, :])
        # the rows are read back by other threads of this program: a CTA barrier orders the stores first
        tl.debug_barrier()
        _route_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, pid_m * BLOCK_M, T, n_real, routed_scale,
                    stride_lt, tl.zeros((BLOCK_M,), dtype=tl.float32), E, TOP_K, K_PAD, NUM_GROUPS, GROUP_SIZE,
                    TOPK_GROUPS, G_PAD, S_PAD, BLOCK_M, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD,
                    SHARED_GATE, True, False)
        tl.store(arrived_ptr + pid_m, 0)


@triton.jit
def _logits_program(x_ptr, w_ptr, gate_ptr, out_ptr, t, blk, gate_blk, E, D, stride_xt, stride_we, stride_ot,
                    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr, ONE_STEP: tl.constexpr,
                    USE_GDC: tl.constexpr):
    """Program (t, blk) of the router's GEMV: token t's logits of experts blk*BLOCK_E.., or, where
    HAS_GATE and blk == gate_blk, the shared expert's gate logit x . gate into column E (so the
    routing reads it from L2 instead of waiting on its own D-long dot from DRAM). ONE_STEP: D <=
    BLOCK_D. USE_GDC: launched with PDL (pdl.py); where D fits one step, the program's router rows
    are read before the wait, while the previous kernel drains."""
    offs_d = tl.arange(0, BLOCK_D)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    if HAS_GATE and blk == gate_blk:
        pdl_wait(USE_GDC)
        acc_g = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs_d
            xv = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
            acc_g += xv * tl.load(gate_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(out_row + E, tl.sum(acc_g, axis=0))
    else:
        offs_e = blk * BLOCK_E + tl.arange(0, BLOCK_E)
        e_mask = offs_e < E
        acc = tl.zeros((BLOCK_E,), dtype=tl.float32)
        if USE_GDC and ONE_STEP:  # the loop below with its one step, the weight load ahead of the wait
            wv = tl.load(w_ptr + offs_e[:, None] * stride_we + offs_d[None, :],
                         mask=e_mask[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
            pdl_wait(USE_GDC)
            xv = tl.load(x_row + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
            acc += tl.sum(wv * xv[None, :], axis=1)
        else:
            pdl_wait(USE_GDC)
            for d0 in range(0, D, BLOCK_D):
                d = d0 + offs_d
                xv = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
                wv = tl.load(w_ptr + offs_e[:, None] * stride_we + d[None, :],
                             mask=e_mask[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
                acc += tl.sum(wv * xv[None, :], axis=1)
        tl.store(out_row + offs_e, acc, mask=e_mask)


@triton.jit
def _logits_gemv_kernel(x_ptr, w_ptr, gate_ptr, out_ptr, E, D, stride_xt, stride_we, stride_ot,
                        BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, HAS_GATE: tl.constexpr,
                        ONE_STEP: tl.constexpr, USE_GDC: tl.constexpr):
    """logits [T,E] float32 for few tokens: one program per (token, BLOCK_E experts), many in flight;
    with HAS_GATE the last program of each token computes the shared gate's logit (`_logits_program`)."""
    _logits_program(x_ptr, w_ptr, gate_ptr, out_ptr, tl.program_id(0), tl.program_id(1), tl.num_programs(1) - 1,
                    E, D, stride_xt, stride_we, stride_ot, BLOCK_E, BLOCK_D, HAS_GATE, ONE_STEP, USE_GDC)


@triton.jit(do_not_specialize=["T", "n_real"])
def _route_kernel(x_ptr, w_ptr, logits_ptr, bias_ptr, sgate_ptr, ids_ptr, weights_ptr, nreal_ptr,
                  T, n_real, routed_scale, D, stride_xt, stride_we, stride_lt,
                  E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  G_PAD: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                  FUSED_LOGITS: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr,
                  RENORM: tl.constexpr, NREAL_FROM_PTR: tl.constexpr,
                  N_SHARED: tl.constexpr, NS_PAD: tl.constexpr, SHARED_GATE: tl.constexpr,
                  GATE_IN_LOGITS: tl.constexpr, GATE_BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr):
    """One token: ids [k + n_shared] int32 and weights float32 (`_route_rows` says what they hold).

    Without GATE_IN_LOGITS the token's shared-gate logit x . shared_gate is computed here, and with
    FUSED_LOGITS its router logits too (written to its logits row, then routed from there).
    """
    pdl_wait(USE_GDC)
    t = tl.program_id(0)
    row = logits_ptr + t.to(tl.int64) * stride_lt
    # The gate's logit first, so that its loads can overlap the selection below instead of following it.
    gate_logit = tl.zeros((1,), dtype=tl.float32)
    if N_SHARED > 0 and SHARED_GATE and not GATE_IN_LOGITS:
        acc_g = tl.zeros((GATE_BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, GATE_BLOCK_D):
            d = d0 + tl.arange(0, GATE_BLOCK_D)
            xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + d, mask=d < D, other=0.0).to(tl.float32)
            acc_g += xv * tl.load(sgate_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        gate_logit += tl.sum(acc_g, axis=0)
    if FUSED_LOGITS:
        e1 = tl.arange(0, E_PAD)
        acc = tl.zeros((E_PAD,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + d, mask=d < D, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + e1[:, None] * stride_we + d[None, :],
                         mask=(e1[:, None] < E) & (d[None, :] < D), other=0.0).to(tl.float32)
            acc += tl.sum(wv * xv[None, :], axis=1)
        tl.store(row + e1, acc, mask=e1 < E)
        # The row is re-read below in the grouped [G,S] layout by other threads of this program.
        tl.debug_barrier()
    _route_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, t, T, n_real, routed_scale, stride_lt,
                gate_logit, E, TOP_K, K_PAD, NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS, G_PAD, S_PAD, 1, HAS_BIAS,
                SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD, SHARED_GATE, GATE_IN_LOGITS, False)


@triton.jit
def _load_logits(ptrs, mask, CG: tl.constexpr):
    """Logits (0 where masked); CG: from L2, as a last-to-arrive program reads them (arrivals.py)."""
    if CG:
        v = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        v = tl.load(ptrs, mask=mask, other=0.0)
    return v


@triton.jit
def _route_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, t0, T, n_real, routed_scale, stride_lt,
                gate_logit, E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                G_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr, NREAL_FROM_PTR: tl.constexpr,
                N_SHARED: tl.constexpr, NS_PAD: tl.constexpr, SHARED_GATE: tl.constexpr,
                GATE_IN_LOGITS: tl.constexpr, CG: tl.constexpr):
    """Route tokens t0 .. t0 + BLOCK_T - 1 (those below T) from their logits rows, all at once:
    `_route_select`'s slots stored into ids and weights [T, k + n_shared]."""
    SLOTS: tl.constexpr = TOP_K + N_SHARED
    t = t0 + tl.arange(0, BLOCK_T)  # [BT]
    in_step = t < T
    sel_ids, sel_w, shared_ids, shared_w = _route_select(
        logits_ptr, bias_ptr, nreal_ptr, t, in_step, n_real, routed_scale, stride_lt, gate_logit, E, TOP_K, K_PAD,
        NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS, G_PAD, S_PAD, BLOCK_T, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR,
        N_SHARED, NS_PAD, SHARED_GATE, GATE_IN_LOGITS, CG)
    kk = tl.arange(0, K_PAD)[None, :]
    pair = t[:, None] * SLOTS
    k_mask = (kk < TOP_K) & in_step[:, None]
    tl.store(ids_ptr + pair + kk, sel_ids, mask=k_mask)
    tl.store(weights_ptr + pair + kk, sel_w, mask=k_mask)
    if N_SHARED > 0:
        c = tl.arange(0, NS_PAD)[None, :]
        c_mask = (c < N_SHARED) & in_step[:, None]
        tl.store(ids_ptr + pair + TOP_K + c, shared_ids, mask=c_mask)
        tl.store(weights_ptr + pair + TOP_K + c, shared_w, mask=c_mask)


@triton.jit
def _route_select(logits_ptr, bias_ptr, nreal_ptr, t, in_step, n_real, routed_scale, stride_lt, gate_logit,
                  E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  G_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr, NREAL_FROM_PTR: tl.constexpr,
                  N_SHARED: tl.constexpr, NS_PAD: tl.constexpr, SHARED_GATE: tl.constexpr,
                  GATE_IN_LOGITS: tl.constexpr, CG: tl.constexpr):
    """The slots of tokens t [BLOCK_T] (rows of the step where in_step) from their logits rows:
    (routed ids [BT, K_PAD] int32, their weights float32, the shared chunks' ids [BT, NS_PAD], their
    weights). Slots 0..k-1 are the routed top-k; slots k.. are the shared expert's chunks
    E..E+n_shared-1, weighted by sigmoid(x . shared_gate) (1 without a gate). Padding rows (at or
    past n_real) get the sentinel E + n_shared and weight 0 in every slot. The gate's logit: column
    E of the logits row with GATE_IN_LOGITS, else `gate_logit` [BLOCK_T]. CG: the logits are other
    programs' stores of this launch, read from L2 (arrivals.py). Columns past k (K_PAD) and past
    n_shared (NS_PAD) hold the sentinel and weight 0, and are not slots.
    """
    SENTINEL: tl.constexpr = E + N_SHARED
    rows = logits_ptr + t.to(tl.int64) * stride_lt
    if N_SHARED > 0 and SHARED_GATE and GATE_IN_LOGITS:
        gate_logit = _load_logits(rows + E, in_step, CG)

    # Experts in a [token, group, member] layout; with one group it is [BT, 1, E].
    g = tl.arange(0, G_PAD)[None, :, None]
    s = tl.arange(0, S_PAD)[None, None, :]
    valid = (g < NUM_GROUPS) & (s < GROUP_SIZE)  # [1, G, S]
    e3 = g * GROUP_SIZE + s  # expert id where valid
    logit = _load_logits(rows[:, None, None] + e3, valid & in_step[:, None, None], CG)
    if SOFTMAX:
        top = tl.max(tl.max(tl.where(valid, logit, float("-inf")), axis=2), axis=1)
        p = tl.where(valid, tl.exp(logit - top[:, None, None]), 0.0)
        scores = p / tl.sum(tl.sum(p, axis=2), axis=1)[:, None, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-logit))
    choice = scores
    if HAS_BIAS:
        # The bias steers selection only; weights below use the unbiased scores.
        choice = choice + tl.load(bias_ptr + e3, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    if NUM_GROUPS > 1:
        # Group score: the sum of the group's two best biased scores (one if groups have one member).
        best1 = tl.max(choice, axis=2)  # [BT, G]
        arg1 = tl.min(tl.where(choice == best1[:, :, None], s, S_PAD), axis=2)
        if GROUP_SIZE > 1:
            best2 = tl.max(tl.where(s == arg1[:, :, None], float("-inf"), choice), axis=2)
            gscore = best1 + best2
        else:
            gscore = best1
        gidx = tl.arange(0, G_PAD)[None, :]
        gscore = tl.where(gidx < NUM_GROUPS, gscore, float("-inf"))
        keep = tl.zeros((BLOCK_T, G_PAD), dtype=tl.int32) != 0
        for _ in tl.static_range(TOPK_GROUPS):
            gbest = tl.max(gscore, axis=1)
            gi = tl.min(tl.where(gscore == gbest[:, None], gidx, G_PAD), axis=1)
            keep = keep | (gidx == gi[:, None])
            gscore = tl.where(gidx == gi[:, None], float("-inf"), gscore)
        choice = tl.where(keep[:, :, None], choice, float("-inf"))

    kk = tl.arange(0, K_PAD)[None, :]
    sel_ids = tl.full((BLOCK_T, K_PAD), SENTINEL, dtype=tl.int32)
    sel_w = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, axis=2), axis=1)
        # Lowest expert id among ties; clamp to the sentinel if nothing selectable is left.
        idx = tl.min(tl.min(tl.where(valid & (choice == best[:, None, None]), e3, SENTINEL), axis=2), axis=1)
        hit = valid & (e3 == idx[:, None, None])
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), axis=2), axis=1)
        sel_ids = tl.where(kk == j, idx[:, None], sel_ids)
        sel_w = tl.where(kk == j, w[:, None], sel_w)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        if SOFTMAX:
            sel_w = sel_w / tl.sum(sel_w, axis=1)[:, None]
        else:
            sel_w = sel_w / (tl.sum(sel_w, axis=1)[:, None] + 1e-20)
    sel_w = sel_w * routed_scale

    if NREAL_FROM_PTR:
        n_real = tl.load(nreal_ptr)
    real = (t < n_real)[:, None]
    sel_ids = tl.where(real, sel_ids, SENTINEL)
    sel_w = tl.where(real, sel_w, 0.0)

    c = tl.arange(0, NS_PAD)[None, :]
    gate = tl.full((BLOCK_T, NS_PAD), 1.0, dtype=tl.float32)
    if N_SHARED > 0 and SHARED_GATE:
        gate = gate / (1.0 + tl.exp(-gate_logit[:, None]))
    live = real & (c < N_SHARED)
    return sel_ids, sel_w, tl.where(live, E + c, SENTINEL), tl.where(live, gate, 0.0)


@triton.jit(do_not_specialize=["P"])
def _align_count_kernel(ids_ptr, block_counts_ptr, P, E: tl.constexpr, E_BINS: tl.constexpr,
                        BLOCK_P: tl.constexpr, USE_GDC: tl.constexpr):
    """Pairs per expert in each block of BLOCK_P pairs: block_counts[b, e] (bins past E hold 0)."""
    pdl_wait(USE_GDC)
    b = tl.program_id(0)
    p = b * BLOCK_P + tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + p, mask=p < P, other=E)
    tl.store(block_counts_ptr + b * E_BINS + tl.arange(0, E_BINS), tl.histogram(ids, E_BINS, mask=ids < E))


@triton.jit
def _align_counts(ids_ptr, block_counts_ptr, b, num_blocks, P, E: tl.constexpr, E_BINS: tl.constexpr,
                  BLOCK_P: tl.constexpr, COUNTED: tl.constexpr, NB_STEP: tl.constexpr, SCANNED: tl.constexpr):
    """(pairs of each expert, of each expert in the blocks before block b, of each expert in block b), [E_BINS].

    COUNTED: summed from _align_count_kernel's rows; SCANNED: counted here from every pair's id,
    SCAN_CHUNK at a time (each program reads the step's ids, a few KiB from L2, where the count
    kernel would cost a launch); otherwise one block holds every pair and is counted here."""
    if SCANNED:
        counts = tl.zeros((E_BINS,), dtype=tl.int32)
        before = tl.zeros((E_BINS,), dtype=tl.int32)
        first = b * BLOCK_P
        for c0 in range(0, P, SCAN_CHUNK):
            p = c0 + tl.arange(0, SCAN_CHUNK)
            ids = tl.load(ids_ptr + p, mask=p < P, other=E)
            counts += tl.histogram(ids, E_BINS, mask=ids < E)
            before += tl.histogram(ids, E_BINS, mask=(ids < E) & (p < first))
        p = first + tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < P, other=E)
        mine = tl.histogram(ids, E_BINS, mask=ids < E)
    elif COUNTED:
        bins = tl.arange(0, E_BINS)
        counts = tl.zeros((E_BINS,), dtype=tl.int32)
        before = tl.zeros((E_BINS,), dtype=tl.int32)
        mine = tl.zeros((E_BINS,), dtype=tl.int32)
        for r0 in range(0, num_blocks, NB_STEP):
            r = r0 + tl.arange(0, NB_STEP)[:, None]
            rows = tl.load(block_counts_ptr + r * E_BINS + bins[None, :], mask=r < num_blocks, other=0)
            counts += tl.sum(rows, axis=0)
            before += tl.sum(tl.where(r < b, rows, 0), axis=0)
            mine += tl.sum(tl.where(r == b, rows, 0), axis=0)
    else:
        p = tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < P, other=E)
        counts = tl.histogram(ids, E_BINS, mask=ids < E)
        before = counts * 0
        mine = counts
    return counts, before, mine


@triton.jit(do_not_specialize=["P", "num_blocks"])
def _align_kernel(ids_ptr, block_counts_ptr, sorted_ptr, block_expert_ptr, total_ptr, P, num_blocks,
                  E: tl.constexpr, E_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                  COUNTED: tl.constexpr, NB_STEP: tl.constexpr, E_CHUNK: tl.constexpr, COUNT_RANKS: tl.constexpr,
                  SCANNED: tl.constexpr, USE_GDC: tl.constexpr):
    """The sorted layout (sort_tokens' contract). Programs below num_blocks place the pairs of one
    block of BLOCK_P (`_place_pairs`, ranks counted with COUNT_RANKS, else sorted); each program
    past them pads the segments of E_CHUNK experts and names their blocks' expert (`_pad_segments`)."""
    pdl_wait(USE_GDC)
    pid = tl.program_id(0)
    b = tl.minimum(pid, num_blocks - 1)  # an expert program's counts need no block of its own
    counts, before, mine = _align_counts(ids_ptr, block_counts_ptr, b, num_blocks, P, E, E_BINS, BLOCK_P,
                                         COUNTED, NB_STEP, SCANNED)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded  # exclusive prefix: segment start of each expert
    if pid < num_blocks:
        _place_pairs(ids_ptr, sorted_ptr, pid, P, starts, before, mine, E, E_BINS, BLOCK_P, COUNT_RANKS)
    else:
        chunk = pid - num_blocks
        if chunk == 0:
            tl.store(total_ptr, tl.sum(padded, axis=0))
        _pad_segments(sorted_ptr, block_expert_ptr, chunk, P, starts, counts, padded, E, E_BINS, BLOCK_M, E_CHUNK)


RANK_CHUNK_CELLS = tl.constexpr(8192)  # pairs x bins that one counting step holds ([chunk, E_BINS] int32)


@triton.jit
def _place_pairs(ids_ptr, sorted_ptr, b, P, starts, before, mine, E: tl.constexpr, E_BINS: tl.constexpr,
                 BLOCK_P: tl.constexpr, COUNT: tl.constexpr):
    """Write the pair ids of block b (pairs b*BLOCK_P ..) at their sorted rows.

    A pair's row is its expert's segment start + the expert's pairs in earlier blocks + its rank
    among the expert's pairs of its own block, so within an expert the pairs keep pair order.
    COUNT (moe_config.COUNT_RANKS_MAX_EXPERTS bins at most): the rank is counted, a running
    sum down a [pairs, bins] one-hot, a chunk of pairs at a time; else the block's keys
    expert * BLOCK_P + position are sorted (a one-hot that wide would not fit). The sort's ~55
    exchange stages over 1024 keys are a chain of shared-memory round trips whatever the expert count.
    """
    if COUNT:
        CHUNK: tl.constexpr = BLOCK_P if BLOCK_P * E_BINS <= RANK_CHUNK_CELLS else RANK_CHUNK_CELLS // E_BINS
        bins = tl.arange(0, E_BINS)
        seen = starts + before  # [E_BINS]: the row of each expert's next pair
        for c0 in tl.static_range(0, BLOCK_P, CHUNK):
            p = b * BLOCK_P + c0 + tl.arange(0, CHUNK)
            ids = tl.load(ids_ptr + p, mask=p < P, other=E)  # beyond P: the sentinel, placed nowhere
            hot = (ids[:, None] == bins[None, :]).to(tl.int32)  # [CHUNK, E_BINS]
            upto = tl.cumsum(hot, axis=0)  # pairs of each expert in this chunk up to and including each pair
            row = tl.sum(hot * (seen[None, :] + upto - 1), axis=1)
            tl.store(sorted_ptr + row, p, mask=ids < E)
            seen += tl.sum(hot, axis=0)
    else:
        # Sorted position i of this block holds the pair of expert e at row base[e] + i.
        base = starts + before - (tl.cumsum(mine, axis=0) - mine)
        i = tl.arange(0, BLOCK_P)
        p = b * BLOCK_P + i
        ids = tl.load(ids_ptr + p, mask=p < P, other=E)  # beyond P: the sentinel, sorted last
        key = tl.sort(ids * BLOCK_P + i)
        e = key // BLOCK_P
        row = tl.gather(base, tl.minimum(e, E_BINS - 1), 0) + i
        tl.store(sorted_ptr + row, b * BLOCK_P + key % BLOCK_P, mask=e < E)


@triton.jit
def _pad_segments(sorted_ptr, block_expert_ptr, chunk, P, starts, counts, padded, E: tl.constexpr,
                  E_BINS: tl.constexpr, BLOCK_M: tl.constexpr, E_CHUNK: tl.constexpr):
    """For experts chunk*E_CHUNK ..: the sentinel pair id P in the rows after each segment's pairs,
    and the expert of each of its blocks."""
    ec = chunk * E_CHUNK + tl.arange(0, E_CHUNK)
    live = ec < E
    at = tl.minimum(ec, E_BINS - 1)
    start = tl.gather(starts, at, 0)
    count = tl.gather(counts, at, 0)
    size = tl.where(live, tl.gather(padded, at, 0), 0)
    q = tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + start[:, None] + count[:, None] + q, tl.full((E_CHUNK, BLOCK_M), P, dtype=tl.int32),
             mask=q < (size - count)[:, None])
    blocks = size // BLOCK_M
    first = start // BLOCK_M
    for j in range(0, tl.max(blocks, axis=0)):
        tl.store(block_expert_ptr + first + j, ec, mask=j < blocks)


@triton.jit
def _route_sort_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                     T, n_real, P, routed_scale, stride_lt,
                     E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                     NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                     G_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                     HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
                     NREAL_FROM_PTR: tl.constexpr, N_SHARED: tl.constexpr, NS_PAD: tl.constexpr,
                     SHARED_GATE: tl.constexpr, E_BINS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_P: tl.constexpr, E_CHUNK: tl.constexpr, COUNT_RANKS: tl.constexpr, CG: tl.constexpr):
    """A small step's routing and sort in one program: `_route_rows` over all T tokens, then
    `_align_kernel`'s layout of one block holding every pair (COUNT_RANKS as it takes it). The
    shared gate's logit comes in column E of the logits (the GEMV's). CG as `_route_rows` takes it."""
    _route_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, 0, T, n_real, routed_scale, stride_lt,
                tl.zeros((BLOCK_T,), dtype=tl.float32), E, TOP_K, K_PAD, NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS,
                G_PAD, S_PAD, BLOCK_T, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD, SHARED_GATE,
                True, CG)
    # The ids are read back in pair order by other threads of this program: a CTA barrier orders
    # this program's global stores before those loads.
    tl.debug_barrier()
    EXPERTS: tl.constexpr = E + N_SHARED  # the shared chunks sort as experts; ids past them are padding
    counts, before, mine = _align_counts(ids_ptr, ids_ptr, 0, 1, P, EXPERTS, E_BINS, BLOCK_P, False, 1, False)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    starts = tl.cumsum(padded, axis=0) - padded
    _place_pairs(ids_ptr, sorted_ptr, 0, P, starts, before, mine, EXPERTS, E_BINS, BLOCK_P, COUNT_RANKS)
    tl.store(total_ptr, tl.sum(padded, axis=0))
    for chunk in tl.static_range((EXPERTS + E_CHUNK - 1) // E_CHUNK):
        _pad_segments(sorted_ptr, block_expert_ptr, chunk, P, starts, counts, padded, EXPERTS, E_BINS, BLOCK_M,
                      E_CHUNK)


@triton.jit(do_not_specialize=["T", "n_real", "P"])
def _route_sort_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                       T, n_real, P, routed_scale, stride_lt,
                       E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                       NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                       G_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
                       NREAL_FROM_PTR: tl.constexpr, N_SHARED: tl.constexpr, NS_PAD: tl.constexpr,
                       SHARED_GATE: tl.constexpr, E_BINS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_P: tl.constexpr, E_CHUNK: tl.constexpr, COUNT_RANKS: tl.constexpr,
                       USE_GDC: tl.constexpr):
    """A small step's routing and sort in one launch (`route_sort_folds`), after the GEMV: `_route_sort_rows`."""
    pdl_wait(USE_GDC)
    _route_sort_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                     T, n_real, P, routed_scale, stride_lt, E, TOP_K, K_PAD, NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS,
                     G_PAD, S_PAD, BLOCK_T, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD,
                     SHARED_GATE, E_BINS, BLOCK_M, BLOCK_P, E_CHUNK, COUNT_RANKS, False)


@triton.jit(do_not_specialize=["T", "n_real", "P"])
def _router_kernel(x_ptr, w_ptr, gate_ptr, logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, sorted_ptr,
                   block_expert_ptr, total_ptr, arrived_ptr, T, n_real, P, routed_scale, D,
                   stride_xt, stride_we, stride_lt,
                   E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                   NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                   G_PAD: tl.constexpr, S_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
                   NREAL_FROM_PTR: tl.constexpr, N_SHARED: tl.constexpr, NS_PAD: tl.constexpr,
                   SHARED_GATE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, ONE_STEP: tl.constexpr,
                   SORT: tl.constexpr, E_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                   E_CHUNK: tl.constexpr, COUNT_RANKS: tl.constexpr, USE_GDC: tl.constexpr):
    """The router in one launch (`router_folds`): `_logits_gemv_kernel`'s programs, and the last of
    them to finish (arrivals.py) routes every token, then zeroes the counter: with SORT all at once
    and lays out the sorted pairs (`_route_sort_rows`, BLOCK_T rows), else BLOCK_T tokens at a time
    (`_route_rows`; 1: the routing kernel's tile, its bits). The shared gate's logit goes in column
    E (SHARED_GATE: the last program of each token)."""
    _logits_program(x_ptr, w_ptr, gate_ptr, logits_ptr, tl.program_id(0), tl.program_id(1), tl.num_programs(1) - 1,
                    E, D, stride_xt, stride_we, stride_lt, BLOCK_E, BLOCK_D, SHARED_GATE, ONE_STEP, USE_GDC)
    if last_to_arrive(arrived_ptr, T * tl.num_programs(1)):
        if SORT:
            _route_sort_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, sorted_ptr, block_expert_ptr,
                             total_ptr, T, n_real, P, routed_scale, stride_lt, E, TOP_K, K_PAD, NUM_GROUPS,
                             GROUP_SIZE, TOPK_GROUPS, G_PAD, S_PAD, BLOCK_T, HAS_BIAS, SOFTMAX, RENORM,
                             NREAL_FROM_PTR, N_SHARED, NS_PAD, SHARED_GATE, E_BINS, BLOCK_M, BLOCK_P, E_CHUNK,
                             COUNT_RANKS, True)
        else:
            for t0 in range(0, T, BLOCK_T):
                _route_rows(logits_ptr, bias_ptr, ids_ptr, weights_ptr, nreal_ptr, t0, T, n_real, routed_scale,
                            stride_lt, tl.zeros((BLOCK_T,), dtype=tl.float32), E, TOP_K, K_PAD, NUM_GROUPS,
                            GROUP_SIZE, TOPK_GROUPS, G_PAD, S_PAD, BLOCK_T, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR,
                            N_SHARED, NS_PAD, SHARED_GATE, True, True)
        tl.store(arrived_ptr, 0)


@triton.jit
def _grouped_pid(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Walk GROUP_M row blocks down a column before moving right: neighbouring programs share tiles."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _gate_up_block(a_ptrs, g_ptrs, up, valid, n_mask, D,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                   EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """silu(a @ gate) * (a @ up) [BM,BN] float32: a the gathered token rows, gate/up rows `up` apart."""
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            if EVEN_N:
                bg = tl.load(g_ptrs)
                bu = tl.load(g_ptrs + up)
            else:
                bg = tl.load(g_ptrs, mask=n_mask[None, :], other=0.0)
                bu = tl.load(g_ptrs + up, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < D - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            bu = tl.load(g_ptrs + up, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            a32 = a.to(tl.float32)
            acc_g = tl.dot(a32, bg.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(a32, bu.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit(do_not_specialize=["num_pid_m", "P"])
def _gate_up_sorted_kernel(x_ptr, w13_ptr, sw13_ptr, h_ptr, hs_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                           num_pid_m, P, SLOTS, E, I, S, D, stride_xt, stride_we, stride_wn, stride_swn, stride_hm,
                           stride_hs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr,
                           EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_SHARED: tl.constexpr,
                           SHARED_TOKENS: tl.constexpr, USE_GDC: tl.constexpr):
    """h[rows, cols] = silu(x[tok] @ w13[e, cols]^T) * (x[tok] @ w13[e, I + cols]^T) for one row block.

    A block of expert e >= E is chunk c = e - E of the shared expert: its columns c*I + cols of
    sw13's gate rows (and S rows below, its up rows); columns past S are masked, so they hold 0.
    SHARED_TOKENS (the split down, `down_split`): a shared block's rows go to hs[tok, c*I + cols]
    instead, token by token (its real pairs only, columns below S), and its rows of h are not written.
    """
    pdl_wait(USE_GDC)  # before the early return: every program waits
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped_pid(pid, num_pid_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # past the used blocks: no weight is read
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    tok = pair // SLOTS
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    # Tensor offsets stay int32 (the host checks the sizes); only the expert's base is 64-bit.
    # Full 64-bit pointer tensors cost two registers per element and spilled at 64x64 tiles.
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [BM,BK] gathered token rows
    # One GEMM loop for routed and shared blocks: the branch only picks the weight rows. Two
    # inlined loops would each get pipeline buffers in shared memory (twice the tile, over the
    # 227 KiB of an H100/H200 at the tuned 128x128 tiles).
    w_base = w13_ptr + e * stride_we
    stride_n = stride_wn
    up = I * stride_wn  # the up rows sit I rows below the gate rows
    w_mask = n_mask
    if HAS_SHARED:
        if e >= E:
            c = (e - E).to(tl.int32)
            w_base = sw13_ptr + (c * I) * stride_swn
            stride_n = stride_swn
            up = S * stride_swn
            w_mask = offs_n < S - c * I
    g_ptrs = w_base + offs_n[None, :] * stride_n + offs_k[:, None]  # [BK,BN] gate rows
    h = _gate_up_block(a_ptrs, g_ptrs, up, valid, w_mask, D, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, EVEN_K, EVEN_N)
    if SHARED_TOKENS:
        if e >= E:
            c = (e - E).to(tl.int32)
            tl.store(hs_ptr + tok[:, None] * stride_hs + c * I + offs_n[None, :], h.to(hs_ptr.dtype.element_ty),
                     mask=valid[:, None] & w_mask[None, :])
        else:
            _store_h(h_ptr, h, rows, offs_n, n_mask, stride_hm)
    else:
        _store_h(h_ptr, h, rows, offs_n, n_mask, stride_hm)


@triton.jit
def _store_h(h_ptr, h, rows, offs_n, n_mask, stride_hm):
    """h rows of one block in sorted row order, in h's dtype (every row: padding rows hold zeros)."""
    tl.store(h_ptr + rows[:, None] * stride_hm + offs_n[None, :], h.to(h_ptr.dtype.element_ty), mask=n_mask[None, :])


@triton.jit
def _dot_block(a_ptrs, b_ptrs, valid, n_mask, K,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
               EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """a [BM, K] @ b [K, BN] in float32, K walked in BLOCK_K steps (the pointers advance along K by 1):
    router logits, and h rows times one expert's down-projection columns."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            if EVEN_N:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["num_pid_m", "P"])
def _down_sorted_kernel(h_ptr, w2_ptr, sw2_ptr, y_ptr, weights_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                        num_pid_m, P, E, D, I, S, stride_hm, stride_we, stride_wn, stride_swn, stride_yp,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_SHARED: tl.constexpr,
                        USE_GDC: tl.constexpr):
    """y[pair, cols] = weight[pair] * (h[row] @ w2[e, cols]^T) for one row block.

    A block of expert e >= E is chunk c = e - E of the shared expert: sw2's columns c*I.. (at
    most S - c*I of them) against the chunk's h columns.
    """
    pdl_wait(USE_GDC)  # before the early return: every program waits
    pid = tl.program_id(0)
    pid_m, pid_n = _grouped_pid(pid, num_pid_m, tl.cdiv(D, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < P
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :]  # [BM,BK]
    # One GEMM loop for routed and shared blocks, as in _gate_up_sorted_kernel.
    w_base = w2_ptr + e * stride_we
    stride_n = stride_wn
    K = I
    if HAS_SHARED:
        if e >= E:
            c = (e - E).to(tl.int32)
            w_base = sw2_ptr + c * I
            stride_n = stride_swn
            K = tl.minimum(S - c * I, I)
    b_ptrs = w_base + offs_n[None, :] * stride_n + offs_k[:, None]  # [BK,BN]
    acc = _dot_block(a_ptrs, b_ptrs, valid, n_mask, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32, EVEN_K, EVEN_N)
    _store_weighted_y(y_ptr, acc, weights_ptr, pair, valid, offs_n, n_mask, stride_yp)


@triton.jit
def _store_weighted_y(y_ptr, acc, weights_ptr, pair, valid, offs_n, n_mask, stride_yp):
    """y[pair] = routing weight * acc for the block's real pairs (padding rows own no y row)."""
    w = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    tl.store(y_ptr + pair[:, None] * stride_yp + offs_n[None, :], (acc * w[:, None]).to(y_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _store_out_row(out_ptr, t, stride_ot, offs, acc, d_mask, EVEN_D: tl.constexpr):
    """A combine's float32 sums for token t's columns offs, rounded to out's dtype (masked only where
    D does not fill the tile)."""
    if EVEN_D:
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["SENTINEL"])
def _combine_kernel(y_ptr, ids_ptr, out_ptr, SENTINEL, D, stride_yp, stride_ot, SLOTS: tl.constexpr,
                    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, USE_GDC: tl.constexpr):
    """out[t] = sum over slots j (in order) of y[t*slots + j]; padding tokens (all slots SENTINEL) give 0.

    The slot loop is unrolled and a padding slot's row is masked, not branched around, so every
    slot's loads are in flight at once; adding its 0 leaves the float32 sum's bits as they are.
    """
    pdl_wait(USE_GDC)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(SLOTS):
        pair = t * SLOTS + j
        live = (offs * 0 + tl.load(ids_ptr + pair)) < SENTINEL  # padding slots own no y row (never written)
        row = y_ptr + pair.to(tl.int64) * stride_yp + offs
        if EVEN_D:
            acc += tl.load(row, mask=live, other=0.0).to(tl.float32)
        else:
            acc += tl.load(row, mask=live & d_mask, other=0.0).to(tl.float32)
    _store_out_row(out_ptr, t, stride_ot, offs, acc, d_mask, EVEN_D)


MAPS_BLOCK = 1024  # sorted rows (or blocks) `_split_maps_kernel` takes at a time


@triton.jit(do_not_specialize=["R", "num_blocks", "P"])
def _split_maps_kernel(sorted_ptr, block_expert_ptr, total_ptr, ends_ptr, inv_ptr, R, num_blocks, P,
                       E: tl.constexpr, E_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                       USE_GDC: tl.constexpr):
    """The split down's maps of the sorted layout (`split_maps`), made from the sort on the device.
    Each program but the last writes inv[pair] = row for BLOCK sorted rows (rows below total holding
    a pair below P: padding rows write nothing); the last one counts the blocks below total of each
    of the E experts and writes each segment's end row (an expert without rows ends where the one
    before does): the grouped GEMM's offsets. One launch where torch's ops took about fourteen."""
    pdl_wait(USE_GDC)
    pid = tl.program_id(0)
    total = tl.load(total_ptr)
    if pid < tl.num_programs(0) - 1:
        rows = pid * BLOCK + tl.arange(0, BLOCK)
        pairs = tl.load(sorted_ptr + rows, mask=rows < R, other=P)
        tl.store(inv_ptr + pairs, rows, mask=(rows < total) & (pairs >= 0) & (pairs < P))
    else:
        counts = tl.zeros((E_BINS,), dtype=tl.int32)
        for b0 in range(0, num_blocks, BLOCK):
            b = b0 + tl.arange(0, BLOCK)
            ids = tl.load(block_expert_ptr + b, mask=b < num_blocks, other=E)
            live = (b < total // BLOCK_M) & (ids >= 0) & (ids < E)
            counts += tl.histogram(tl.where(live, ids, 0), E_BINS, mask=live)
        e = tl.arange(0, E_BINS)
        tl.store(ends_ptr + e, tl.cumsum(counts, axis=0) * BLOCK_M, mask=e < E)


@triton.jit(do_not_specialize=["SENTINEL"])
def _combine_split_kernel(yr_ptr, inv_ptr, ys_ptr, ids_ptr, weights_ptr, out_ptr, SENTINEL, E, D, stride_yr, stride_ys,
                          stride_ot, SLOTS: tl.constexpr, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                          BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, USE_GDC: tl.constexpr):
    """The split down's combine (`down_split`): out[t] = sum over routed slots j (in order) of
    weight[pair] * yr[inv[pair]] (the grouped GEMM's row of the pair, in sorted order), then
    weight of the first shared slot * ys[t] (the shared expert's dense GEMM, token order), in
    float32. A slot routed to no expert (padding) reads nothing, as in `_combine_kernel`."""
    pdl_wait(USE_GDC)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * SLOTS + j
        live = (offs * 0 + tl.load(ids_ptr + pair)) < E
        if not EVEN_D:
            live = live & d_mask
        row = tl.load(inv_ptr + pair).to(tl.int64)
        w = tl.load(weights_ptr + pair).to(tl.float32)
        acc += tl.load(yr_ptr + row * stride_yr + offs, mask=live, other=0.0).to(tl.float32) * w
    if HAS_SHARED:
        pair = t * SLOTS + TOP_K
        live = (offs * 0 + tl.load(ids_ptr + pair)) < SENTINEL
        if not EVEN_D:
            live = live & d_mask
        w = tl.load(weights_ptr + pair).to(tl.float32)
        acc += tl.load(ys_ptr + t.to(tl.int64) * stride_ys + offs, mask=live, other=0.0).to(tl.float32) * w
    _store_out_row(out_ptr, t, stride_ot, offs, acc, d_mask, EVEN_D)


@triton.jit
def _gate_up_row(x_ptrs, g_ptrs, up, n_mask, D, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """silu(x . gate rows) * (x . up rows) [BN] float32 for one token; up rows `up` past the gate rows."""
    acc_g = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N,), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_K:
            xv = tl.load(x_ptrs).to(tl.float32)
            wg = tl.load(g_ptrs, mask=n_mask[:, None], other=0.0).to(tl.float32)
            wu = tl.load(g_ptrs + up, mask=n_mask[:, None], other=0.0).to(tl.float32)
        else:
            k_mask = offs_k < D - k0
            xv = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            wg = tl.load(g_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            wu = tl.load(g_ptrs + up, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit(do_not_specialize=["n_real"])
def _gate_up_token_kernel(x_ptr, w13_ptr, sw13_ptr, h_ptr, ids_ptr, logits_ptr, bias_ptr, nreal_ptr, weights_ptr,
                          SLOTS, D, I, S, n_real, routed_scale, stride_xt, stride_we, stride_wn, stride_swn, stride_lt,
                          E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          N_SHARED: tl.constexpr, ROUTE: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                          NUM_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                          G_PAD: tl.constexpr, S_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr,
                          RENORM: tl.constexpr, NREAL_FROM_PTR: tl.constexpr, NS_PAD: tl.constexpr,
                          SHARED_GATE: tl.constexpr, USE_GDC: tl.constexpr):
    """GEMV for one pair: h[pair, cols] float32. Padding pairs (the sentinel E + n_shared) write zeros
    and read no weight; a pair of expert e >= E is chunk e - E of the shared expert.

    Loads that feed no dot are not software-pipelined, so a program should finish in one or two
    steps: the token configs use narrow column tiles (2-8) and BLOCK_K up to D, many programs.
    Which weights a pair reads comes from the routing kernel's ids: with PDL it reads none before the wait.

    ROUTE (the router option "in_experts"): no routing kernel ran; each program picks its token's
    slots from the logits row the GEMV wrote (`_route_select`: the routing kernel's code and tile,
    the shared gate's logit in column E, the arguments after ids_ptr) and takes its own slot's
    expert, and the programs of a pair's first column tile store its id and weight for the down
    projection. Every program of a token repeats the token's few reductions over E in registers,
    where the routing kernel's launch and its gap in the step would come first. Without ROUTE
    those arguments are not read.
    """
    pdl_wait(USE_GDC)
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    tok = pair // SLOTS
    if ROUTE:
        sel_ids, sel_w, shared_ids, shared_w = _token_route(
            logits_ptr, bias_ptr, nreal_ptr, tok, n_real, routed_scale, stride_lt, E, TOP_K, K_PAD, NUM_GROUPS,
            GROUP_SIZE, TOPK_GROUPS, G_PAD, S_PAD, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD,
            SHARED_GATE)
        e, w = _slot_of(sel_ids, sel_w, shared_ids, shared_w, pair - tok * SLOTS, TOP_K, K_PAD, NS_PAD)
        if tl.program_id(1) == 0:
            tl.store(ids_ptr + pair, e)
            tl.store(weights_ptr + pair, w)
    else:
        e = tl.load(ids_ptr + pair)
    h = _pair_h(x_ptr, w13_ptr, sw13_ptr, e, tok, offs_n, n_mask, D, I, S, stride_xt, stride_we, stride_wn,
                stride_swn, E, N_SHARED, BLOCK_N, BLOCK_K, EVEN_K)
    tl.store(h_ptr + pair.to(tl.int64) * I + offs_n, h, mask=n_mask)


@triton.jit
def _token_route(logits_ptr, bias_ptr, nreal_ptr, tok, n_real, routed_scale, stride_lt,
                 E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, NUM_GROUPS: tl.constexpr,
                 GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr, G_PAD: tl.constexpr, S_PAD: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr, NREAL_FROM_PTR: tl.constexpr,
                 N_SHARED: tl.constexpr, NS_PAD: tl.constexpr, SHARED_GATE: tl.constexpr):
    """Token `tok`'s `_route_select` row (BLOCK_T 1) from the GEMV's logits row (the shared gate's
    logit in column E), as an expert kernel that routes its own pairs reads it."""
    t = tok + tl.arange(0, 1)
    return _route_select(logits_ptr, bias_ptr, nreal_ptr, t, t >= 0, n_real, routed_scale, stride_lt,
                         tl.zeros((1,), dtype=tl.float32), E, TOP_K, K_PAD, NUM_GROUPS, GROUP_SIZE, TOPK_GROUPS,
                         G_PAD, S_PAD, 1, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD, SHARED_GATE,
                         True, False)


@triton.jit
def _slot_of(sel_ids, sel_w, shared_ids, shared_w, j, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
             NS_PAD: tl.constexpr):
    """Slot j's (expert id, weight) in one token's `_route_select` row (BLOCK_T 1): a column of the
    routed slots or of the shared ones (the others add zeros: exact)."""
    kk = tl.arange(0, K_PAD)[None, :]
    routed = (kk == j) & (kk < TOP_K)  # K_PAD's columns past k are not slots
    shared = TOP_K + tl.arange(0, NS_PAD)[None, :] == j
    e = tl.sum(tl.sum(tl.where(routed, sel_ids, 0), axis=1), axis=0) + tl.sum(
        tl.sum(tl.where(shared, shared_ids, 0), axis=1), axis=0)
    w = tl.sum(tl.sum(tl.where(routed, sel_w, 0.0), axis=1), axis=0) + tl.sum(
        tl.sum(tl.where(shared, shared_w, 0.0), axis=1), axis=0)
    return e, w


@triton.jit
def _pair_h(x_ptr, w13_ptr, sw13_ptr, e, tok, offs_n, n_mask, D, I, S, stride_xt, stride_we, stride_wn, stride_swn,
            E: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            EVEN_K: tl.constexpr):
    """h [BN] float32 of one pair of token `tok` at columns offs_n: silu(x . gate rows) * (x . up
    rows) of expert e (for e >= E, shared chunk e - E's rows of sw13); zeros for the padding
    sentinel, which reads no weight."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok.to(tl.int64) * stride_xt + offs_k  # [BK]
    h = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if e < E:
        g_ptrs = w13_ptr + e.to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BN,BK]
        # The up rows sit I rows below the gate rows.
        h = _gate_up_row(x_ptrs, g_ptrs, I * stride_wn, n_mask, D, BLOCK_N, BLOCK_K, EVEN_K)
    else:
        if N_SHARED > 0:
            if e < E + N_SHARED:
                c = e - E
                g_ptrs = (sw13_ptr + (c * I).to(tl.int64) * stride_swn + offs_n[:, None] * stride_swn
                          + offs_k[None, :])
                h = _gate_up_row(x_ptrs, g_ptrs, S * stride_swn, offs_n < S - c * I, D, BLOCK_N, BLOCK_K, EVEN_K)
    return h


@triton.jit
def _down_row(h_ptrs, w_ptrs, live, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              ONE_STEP: tl.constexpr):
    """h row [K] . w rows [BN, K] in float32; rows not `live` load nothing and give 0.

    ONE_STEP (K <= BLOCK_K): straight-line code, no loop. The caller unrolls its slots, and only
    without a loop around each slot's loads (even a loop of one trip) can the compiler issue every
    slot's loads before the first is used; with loops the slots were one DRAM round trip apart.
    """
    offs_k = tl.arange(0, BLOCK_K)
    if ONE_STEP:
        if EVEN_K:
            hv = tl.load(h_ptrs)
            wt = tl.load(w_ptrs, mask=live[:, None], other=0.0).to(tl.float32)
        else:
            k_mask = offs_k < K
            hv = tl.load(h_ptrs, mask=k_mask, other=0.0)
            wt = tl.load(w_ptrs, mask=live[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        return tl.sum(wt * hv[None, :], axis=1)
    part = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            hv = tl.load(h_ptrs)
            wt = tl.load(w_ptrs, mask=live[:, None], other=0.0).to(tl.float32)
        else:
            k_mask = offs_k < K - k0
            hv = tl.load(h_ptrs, mask=k_mask, other=0.0)
            wt = tl.load(w_ptrs, mask=live[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        part += tl.sum(wt * hv[None, :], axis=1)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return part


@triton.jit
def _down_token_kernel(h_ptr, w2_ptr, sw2_ptr, ids_ptr, weights_ptr, out_ptr, E, D, I, S,
                       stride_we, stride_wn, stride_swn, stride_ot,
                       TOP_K: tl.constexpr, N_SHARED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, EVEN_K_SHARED: tl.constexpr, ONE_STEP: tl.constexpr,
                       USE_GDC: tl.constexpr):
    """out[t, cols] = sum over slots j (in order) of weight_j * (h[t*slots+j] @ w2[e_j, cols]^T).

    Slots 0..k-1 are routed experts, slots k + c the shared expert's chunk c (columns c*I.. of
    sw2). The slot loops are unrolled and padding slots are masked, not branched around, so the
    tiles of all slots can be in flight at once (a branch per slot serialised them: k DRAM round trips).
    """
    pdl_wait(USE_GDC)
    t = tl.program_id(0)
    SLOTS: tl.constexpr = TOP_K + N_SHARED
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * SLOTS + j
        e = tl.load(ids_ptr + pair)
        live = n_mask & ((offs_n * 0 + e) < E)  # [BN]: a padding slot (the sentinel) loads nothing
        w_ptrs = w2_ptr + tl.minimum(e, E - 1).to(tl.int64) * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]
        h_ptrs = h_ptr + pair.to(tl.int64) * I + offs_k  # padding rows of h hold zeros
        part = _down_row(h_ptrs, w_ptrs, live, I, BLOCK_N, BLOCK_K, EVEN_K, ONE_STEP)
        acc += tl.load(weights_ptr + pair) * part
    for c in tl.static_range(N_SHARED):
        pair = t * SLOTS + TOP_K + c
        e = tl.load(ids_ptr + pair)
        live = n_mask & ((offs_n * 0 + e) < E + N_SHARED)  # a padding token's chunk loads nothing
        w_ptrs = sw2_ptr + c * I + offs_n[:, None] * stride_swn + offs_k[None, :]
        h_ptrs = h_ptr + pair.to(tl.int64) * I + offs_k
        part = _down_row(h_ptrs, w_ptrs, live, tl.minimum(S - c * I, I), BLOCK_N, BLOCK_K, EVEN_K_SHARED, ONE_STEP)
        acc += tl.load(weights_ptr + pair) * part
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit(do_not_specialize=["T", "n_real"])
def _experts_token_kernel(x_ptr, w13_ptr, sw13_ptr, w2_ptr, sw2_ptr, h_ptr, ids_ptr, weights_ptr, out_ptr,
                          logits_ptr, bias_ptr, nreal_ptr, ready_ptr, T, D, I, S, n_real, routed_scale,
                          stride_xt, stride_we, stride_wn, stride_swn, stride_w2e, stride_w2n, stride_sw2n,
                          stride_ot, stride_lt,
                          E: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, NUM_GROUPS: tl.constexpr,
                          GROUP_SIZE: tl.constexpr, TOPK_GROUPS: tl.constexpr, G_PAD: tl.constexpr,
                          S_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTMAX: tl.constexpr, RENORM: tl.constexpr,
                          NREAL_FROM_PTR: tl.constexpr, N_SHARED: tl.constexpr, NS_PAD: tl.constexpr,
                          SHARED_GATE: tl.constexpr,
                          UP_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          DOWN_TILES: tl.constexpr, BLOCK_ND: tl.constexpr, BLOCK_KD: tl.constexpr,
                          USE_GDC: tl.constexpr):
    """A token-path step's experts in one launch (the backend's experts option "one_launch"): the
    first T * slots * UP_TILES programs are `_gate_up_token_kernel`'s with ROUTE (each routes its
    pair from the logits row and stores its h columns, then counts itself in on its token's
    counter, ready[t]); the next T * DOWN_TILES programs are `_down_token_kernel`'s, each routing
    its token too and loading every slot's down-projection tile [BLOCK_ND, I] (I <= BLOCK_KD: one
    step) before it waits for ready[t] to reach the token's gate-up programs, then reading h. The
    down projection's weights stream while the gate-up programs run, where two launches read them
    only after the gate-up kernel and its drain.

    No program waits on one after it: blocks start in program order, so every gate-up program has
    started (and runs to its end) before a down program waits (the Triton interpreter runs them in
    that order too). CUDA does not promise that order; the hardware keeps it (docs/DESIGN.md). The
    last down program of a token (a second counter, ready[T + t]) sets both counters back to zero
    for the next launch. h is read from L2 (arrivals.py says why)."""
    pdl_wait(USE_GDC)
    SLOTS: tl.constexpr = TOP_K + N_SHARED
    p = tl.program_id(0)
    up_programs = T * SLOTS * UP_TILES
    if p < up_programs:
        pair = p // UP_TILES
        tile = p - pair * UP_TILES
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        tok = pair // SLOTS
        sel_ids, sel_w, shared_ids, shared_w = _token_route(
            logits_ptr, bias_ptr, nreal_ptr, tok, n_real, routed_scale, stride_lt, E, TOP_K, K_PAD, NUM_GROUPS,
            GROUP_SIZE, TOPK_GROUPS, G_PAD, S_PAD, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD,
            SHARED_GATE)
        e, w = _slot_of(sel_ids, sel_w, shared_ids, shared_w, pair - tok * SLOTS, TOP_K, K_PAD, NS_PAD)
        if tile == 0:
            tl.store(ids_ptr + pair, e)
            tl.store(weights_ptr + pair, w)
        h = _pair_h(x_ptr, w13_ptr, sw13_ptr, e, tok, offs_n, n_mask, D, I, S, stride_xt, stride_we, stride_wn,
                    stride_swn, E, N_SHARED, BLOCK_N, BLOCK_K, EVEN_K)
        tl.store(h_ptr + pair.to(tl.int64) * I + offs_n, h, mask=n_mask)
        tl.debug_barrier()  # every thread's h stores issued before the count that publishes them
        tl.atomic_add(ready_ptr + tok, 1, sem="release", scope="gpu")
    else:
        q = p - up_programs
        tok = q // DOWN_TILES
        offs_n = (q - tok * DOWN_TILES) * BLOCK_ND + tl.arange(0, BLOCK_ND)
        n_mask = offs_n < D
        sel_ids, sel_w, shared_ids, shared_w = _token_route(
            logits_ptr, bias_ptr, nreal_ptr, tok, n_real, routed_scale, stride_lt, E, TOP_K, K_PAD, NUM_GROUPS,
            GROUP_SIZE, TOPK_GROUPS, G_PAD, S_PAD, HAS_BIAS, SOFTMAX, RENORM, NREAL_FROM_PTR, N_SHARED, NS_PAD,
            SHARED_GATE)
        offs_k = tl.arange(0, BLOCK_KD)
        k_mask = offs_k < I
        # Every slot's tile, before h exists: routed slots [K_PAD, BN, BK] (the sentinel and K_PAD's
        # extra columns load nothing), shared chunks [NS_PAD, BN, BK] (chunk c: columns c*I.. of sw2).
        e3 = tl.reshape(sel_ids, (K_PAD, 1, 1))
        live = (e3 < E) & n_mask[None, :, None] & k_mask[None, None, :]
        w_routed = tl.load(w2_ptr + tl.minimum(e3, E - 1).to(tl.int64) * stride_w2e + offs_n[None, :, None] * stride_w2n
                           + offs_k[None, None, :], mask=live, other=0.0)
        c3 = tl.arange(0, NS_PAD)[:, None, None]
        sh_live = ((tl.reshape(shared_ids, (NS_PAD, 1, 1)) < E + N_SHARED) & (c3 < N_SHARED) & n_mask[None, :, None]
                   & (offs_k[None, None, :] < tl.minimum(S - c3 * I, I)))
        w_shared = tl.load(sw2_ptr + c3 * I + offs_n[None, :, None] * stride_sw2n + offs_k[None, None, :],
                           mask=sh_live, other=0.0)
        target = SLOTS * UP_TILES
        seen = tl.atomic_add(ready_ptr + tok, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(ready_ptr + tok, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()
        pairs = tok.to(tl.int64) * SLOTS
        kk = tl.arange(0, K_PAD)
        h_routed = tl.load(h_ptr + (pairs + kk)[:, None] * I + offs_k[None, :],
                           mask=(kk < TOP_K)[:, None] & k_mask[None, :], other=0.0, cache_modifier=".cg")
        part = tl.sum(w_routed.to(tl.float32) * h_routed[:, None, :], axis=2)  # [K_PAD, BN]
        cc = tl.arange(0, NS_PAD)
        h_shared = tl.load(h_ptr + (pairs + TOP_K + cc)[:, None] * I + offs_k[None, :],
                           mask=(cc < N_SHARED)[:, None] & k_mask[None, :], other=0.0, cache_modifier=".cg")
        part_shared = tl.sum(w_shared.to(tl.float32) * h_shared[:, None, :], axis=2)  # [NS_PAD, BN]
        # summed in slot order, as `_down_token_kernel` sums them (a row picked out by adding zeros: exact)
        acc = tl.zeros((BLOCK_ND,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            wj = tl.sum(tl.sum(tl.where(kk[None, :] == j, sel_w, 0.0), axis=1), axis=0)
            acc += wj * tl.sum(tl.where(kk[:, None] == j, part, 0.0), axis=0)
        for c in tl.static_range(N_SHARED):
            wc = tl.sum(tl.sum(tl.where(cc[None, :] == c, shared_w, 0.0), axis=1), axis=0)
            acc += wc * tl.sum(tl.where(cc[:, None] == c, part_shared, 0.0), axis=0)
        tl.store(out_ptr + tok.to(tl.int64) * stride_ot + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
        # The token's last down program: every gate-up program of the token counted in (the wait saw
        # them all) and every down program is past its wait, so both counters go back to zero.
        done = tl.atomic_add(ready_ptr + T + tok, 1, sem="acq_rel", scope="gpu")
        if done == DOWN_TILES - 1:
            tl.store(ready_ptr + tok, 0)
            tl.store(ready_ptr + T + tok, 0)


# ---------------------------------------------------------------------------------------------
# Host wrappers (no host synchronisation; every shape from (T, E, k, I, D, config))
# ---------------------------------------------------------------------------------------------


def _dot_fp32(*dtypes) -> bool:
    """Dots run on bf16/fp16 tensor cores when all operands share that type, else in exact float32.

    Under the interpreter every dot is upcast (launch_math.triton_interpreted says why).
    """
    if triton_interpreted():
        return True
    first = dtypes[0]
    return not (all(d == first for d in dtypes) and first in (torch.bfloat16, torch.float16))


def logits_kernel_for(T: int, E: int, D: int, split: bool = False) -> str:
    """The router logits kernel a step of T tokens launches by default (`route`'s logits_kernel)."""
    # T <= 128: the many-program GEMV, whatever the router size. Folding the logits into the
    # routing kernel (one program per token) left a batch-1 step with one 8-warp program that
    # loads the whole router and then runs ~15 cross-warp reductions (seen on an H200: ~8 us
    # of a 28 us step); split, the GEMV loads in parallel and the top-k runs in one warp. Up to
    # 128 tokens the GEMV and the routing kernel beat both the fused kernel and the tiled GEMM
    # (bench qwen3_next's router on an H200, each captured alone: 5.5 against 7.0 and 10.7 us at 32
    # tokens, 6.6 against 7.2 and 10.8 us at 128; benchmarks/probes/router_logits_probe.py).
    if T <= GEMV_LOGITS_MAX_TOKENS:
        return "gemv"
    # Past it the GEMM, then the routing kernel; with `split` (the backend's router option "split")
    # the GEMM in slices of D with the routing in the last slice's program, one launch
    # (`_split_router_kernel` says why), where one tile holds a token's row of logits and the gate's.
    # "fused" (the logits inside the routing kernel) is never the default: route's callers may
    # still ask for it (tests, benchmarks/kernels/gpu_moe.py).
    return "split" if split and E < DOT_ROUTE_MAX_EXPERTS else "dot"


ALIGN_BLOCK_P = 1024  # pairs one program of the sort places: a step of more is counted in blocks of it first


def align_block_p(num_pairs: int) -> int:
    """The width of one program that places every pair of a step of up to ALIGN_BLOCK_P pairs (a
    power of two; 256 where they fit, a shorter sort): the folds' (`_route_sort_kernel`,
    `_router_kernel`) one program, and past that `sort_tokens`' blocks counted first."""
    return 256 if num_pairs <= 256 else ALIGN_BLOCK_P


# sort_tokens from 257 pairs up to SCAN_MAX_PAIRS: blocks of SCAN_BLOCK_P pairs in one launch, each
# program counting every pair itself (SCANNED), where one program sorted up to 1024 keys (about 55
# shared-memory exchange stages in a chain) or a count kernel ran first. 128 tokens of bench
# qwen3_next's MoE are 640 pairs: 5 programs sorting 128 keys each.
# Measured (moe_bookkeeping.py, bench qwen3_next's MoE, each layout checked first): on an H100 the
# scanned sort took 6.4 / 8.5 us at 128 / 512 tokens against 12.4 / 13.0 for one program of 1024 keys
# and a count then a sort (moe_bookkeeping_scanned_h100_2026-12-06.json).
SCAN_MAX_PAIRS = 4096
SCAN_BLOCK_P = 128
SCAN_CHUNK = tl.constexpr(1024)  # ids a scanning program counts at once
# Past SCAN_MAX_PAIRS, blocks of COUNTED_BLOCK_P counted first: at 4096 tokens (20480 pairs) blocks of
# 512 took 10.2 us against 13.8 for blocks of 1024 on an H100 (same file) and 10.0 against 13.4 on an
# H200 (moe_bookkeeping_h200_2026-12-03.json).
COUNTED_BLOCK_P = 512


def sort_blocks(num_pairs: int) -> tuple[int, bool]:
    """(pairs one `_align_kernel` program places, whether its programs scan every pair for their
    counts) of `sort_tokens` at its defaults: up to 256 pairs one program; up to SCAN_MAX_PAIRS
    blocks of SCAN_BLOCK_P scanned in one launch; past that blocks of COUNTED_BLOCK_P counted first
    by `_align_count_kernel` (a second launch)."""
    if num_pairs <= 256:
        return align_block_p(num_pairs), False
    if num_pairs <= SCAN_MAX_PAIRS:
        return SCAN_BLOCK_P, True
    return COUNTED_BLOCK_P, False


# Routing and sort in one launch (`route_sort_folds`) up to this many tokens. Its one program routes
# every token at once, where `_route_kernel` runs a program per token: ahead by the launch and its
# gap (~2 us a layer in a replayed graph) while the tokens' [T, E] tile is small.
ROUTE_SORT_MAX_TOKENS = 64
ROUTE_TILE_MAX = 4096  # token rows x experts (powers of two) that one program routes at once


def route_tile_rows(E: int) -> int:
    """The token rows `_route_sort_kernel` routes at once for E experts, whatever the step's T (a
    function of E only, so every count it serves launches one kernel variant)."""
    return max(1, min(ROUTE_SORT_MAX_TOKENS, ROUTE_TILE_MAX // next_pow2(E)))


def route_sort_folds(T: int, E: int, slots: int, logits_kernel: str) -> bool:
    """Whether a sorted step of T tokens routes and sorts in one launch (`_route_sort_kernel`): its
    tokens fit the one program's rows (`route_tile_rows`), its pairs one sort block (ALIGN_BLOCK_P),
    and the GEMV computed the logits (with the shared gate's in column E)."""
    return 0 < T <= route_tile_rows(E) and T * slots <= ALIGN_BLOCK_P and logits_kernel == "gemv"


# The router GEMM routes in its epilogue up to this many experts: one BLOCK_N tile of the "dot"
# logits (`_route` takes min(64, ...) columns a program) holds a token's whole row.
DOT_ROUTE_MAX_EXPERTS = 64


def router_folds(T: int, E: int, logits_kernel: str) -> bool:
    """Whether a step of T tokens can run its router (logits and routing) in one launch: after the
    GEMV ("gemv" logits), whose last program to finish routes every token (`_router_kernel`), where
    the tokens fit one routing tile (`route_tile_rows`); after the GEMM ("dot" logits), whose
    programs each route their own rows (`_logits_route_kernel`), where one tile holds every expert
    (DOT_ROUTE_MAX_EXPERTS). A sorted step on the GEMV folds its sort in too, so it also needs
    `route_sort_folds`."""
    if logits_kernel == "gemv":
        return 0 < T <= route_tile_rows(E)
    return logits_kernel == "dot" and T > 0 and E <= DOT_ROUTE_MAX_EXPERTS


def _one_launch_router(T: int, E: int, slots: int, logits_kernel: str, path: str, fold: Optional[bool],
                       asked: bool) -> bool:
    """Whether `fused_moe` runs the router as one launch: asked for, and the step folds
    (`router_folds`; a sorted step on the GEMV by `route_sort_folds`, unless `fold` is False)."""
    if not asked:
        return False
    if path == "sorted" and logits_kernel == "gemv":
        return fold is not False and route_sort_folds(T, E, slots, logits_kernel)
    return router_folds(T, E, logits_kernel)


def routes_in_experts(T: int, E: int, D: int, config: MoEConfig, logits_kernel: Optional[str], asked: bool) -> bool:
    """Whether `fused_moe` routes a step in its gate-up kernel (`route_in_gate_up`): asked for, a
    token-path step, and the GEMV computes the logits (the in-kernel routing reads its row, the
    shared gate's logit in column E)."""
    return asked and config.path == "token" and T > 0 and (logits_kernel or logits_kernel_for(T, E, D)) == "gemv"


def launch_variant(T: int, E: int, D: int, slots: int, config: MoEConfig, logits_kernel: Optional[str] = None,
                   fold: Optional[bool] = None, one_launch_router: bool = False, split_down: bool = False,
                   route_in_experts: bool = False, experts_one_launch: bool = False) -> tuple:
    """Everything an eager step of T tokens picks from T that makes Triton build another kernel: the
    logits kernel (`logits_kernel` where the caller fixes it), the GEMM configs (their tiles are
    constexprs), the sort's width and whether it counts blocks first, whether the routing and
    sort run as one launch (`fold` as `fused_moe` takes it), whether the router is one launch
    (`one_launch_router` as `fused_moe` takes it), and whether a sorted step splits its down
    (`split_down`: the gate-up's other variant and the split combine), and whether a token-path step
    routes in its gate-up kernel (`routes_in_experts`), and whether such a step's experts are one
    launch (`experts_one_launch_fits`). Two token counts with equal
    variants launch the same kernels; the backend's `kernel_variant_tokens` runs one count of each at
    start-up, so a bundle holds them all."""
    logits_kernel = logits_kernel or logits_kernel_for(T, E, D)
    sort = None
    if config.path == "sorted":
        block_p, scanned = sort_blocks(T * slots)
        folded = route_sort_folds(T, E, slots, logits_kernel) if fold is None else fold
        sort = block_p, T * slots > block_p, scanned, folded
    one_launch = _one_launch_router(T, E, slots, logits_kernel, config.path, fold, one_launch_router)
    in_experts = routes_in_experts(T, E, D, config, logits_kernel, route_in_experts)
    # whether the experts fit one launch follows from the config (in the key) and the layer's I
    return (logits_kernel, config, sort, one_launch and not in_experts, split_down and config.path == "sorted",
            in_experts, in_experts and experts_one_launch)


def route(x: torch.Tensor, router_weight: torch.Tensor, router_bias: Optional[torch.Tensor], top_k: int,
          scoring: str, renormalize: bool, routed_scale: float, num_groups: int, topk_groups: int,
          n_real: "int | torch.Tensor | None" = None,
          logits_kernel: Optional[str] = None, n_shared: int = 0, shared_gate: Optional[torch.Tensor] = None,
          gate_in_logits: Optional[bool] = None, one_launch: bool = False):
    """Device-side router: (ids [T,k+n_shared] int32, weights [T,k+n_shared] float32).

    Slots 0..k-1 hold the routed top-k; slots k+c hold chunk c of the shared expert (expert id
    E + c) with weight sigmoid(x . shared_gate), or 1 when shared_gate is None. Rows >= n_real
    get the sentinel id E + n_shared and weight 0 in every slot.
    n_real: host int, a one-element int32 device tensor (read by the kernel, so a captured graph
    follows its value), or None for all rows. logits_kernel: force one of LOGITS_KERNELS (tests); by default chosen from
    T, E and D. gate_in_logits: False makes the routing kernel compute the shared gate's logit even
    after the GEMV (benchmarks compare the two); by default the GEMV does. one_launch: the GEMV's
    last program routes (`router_folds` must allow it), one launch instead of two.
    """
    return _route(x, router_weight, router_bias, top_k, scoring, renormalize, routed_scale, num_groups, topk_groups,
                  n_real, logits_kernel, n_shared, shared_gate, gate_in_logits, one_launch=one_launch)[:2]


def route_sort(x: torch.Tensor, router_weight: torch.Tensor, router_bias: Optional[torch.Tensor], top_k: int,
               scoring: str, renormalize: bool, routed_scale: float, num_groups: int, topk_groups: int,
               block_m: int, n_real: "int | torch.Tensor | None" = None, logits_kernel: Optional[str] = None,
               n_shared: int = 0, shared_gate: Optional[torch.Tensor] = None, fold: Optional[bool] = None,
               one_launch: bool = False, count_ranks: bool = False):
    """`route`, then `sort_tokens` of its ids over E + n_shared experts at block_m: (ids, weights,
    sorted_pairs, block_expert, total). fold: True routes and sorts in one launch (`route_sort_folds`
    must allow it), False in two or three; by default `route_sort_folds` decides. one_launch: the
    GEMV's last program also routes and sorts (the fold, in the GEMV's launch). count_ranks: the
    sort counts each block's ranks instead of sorting them (sort_tokens; the same layout)."""
    T, E = x.shape[0], router_weight.shape[0]
    slots = top_k + n_shared
    logits_kernel = logits_kernel or logits_kernel_for(T, E, x.shape[1])
    allowed = route_sort_folds(T, E, slots, logits_kernel)
    # one launch on the GEMV routes and sorts in it (the fold); on the GEMM the sort stays apart
    on_gemv = one_launch and logits_kernel == "gemv"
    if ((fold or on_gemv) and not allowed) or (on_gemv and fold is False):
        raise ValueError(f"moe: a step of {T} tokens ({E} experts, {slots} slots, {logits_kernel} logits) "
                         f"cannot route and sort in one launch" + (" (fold=False)" if fold is False else ""))
    fold = allowed if fold is None else fold
    if count_ranks:
        check_count_ranks(E + n_shared)
    ids, weights, layout = _route(x, router_weight, router_bias, top_k, scoring, renormalize, routed_scale,
                                  num_groups, topk_groups, n_real, logits_kernel, n_shared, shared_gate,
                                  sort_block_m=block_m if fold else None, one_launch=one_launch,
                                  count_ranks=count_ranks)
    if layout is None:
        layout = sort_tokens(ids, E + n_shared, block_m, count_ranks=count_ranks)
    return (ids, weights, *layout)


def _check_routing(x, router_weight, top_k: int, scoring: str, num_groups: int, topk_groups: int, n_shared: int,
                   shared_gate) -> None:
    """The routing arguments a router launch takes, refused with a one-line message where they do not fit."""
    D = x.shape[1]
    E = router_weight.shape[0]
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"moe: unknown scoring {scoring!r} (expected 'softmax' or 'sigmoid')")
    if num_groups < 1 or E % num_groups:
        raise ValueError(f"moe: {E} experts do not split into {num_groups} groups")
    group_size = E // num_groups
    if num_groups > 1 and not 1 <= topk_groups <= num_groups:
        raise ValueError(f"moe: topk_groups {topk_groups} must be in 1..{num_groups}")
    kept = group_size * (topk_groups if num_groups > 1 else num_groups)
    if not 1 <= top_k <= kept:
        raise ValueError(f"moe: top_k {top_k} must be in 1..{kept} (experts left after group selection)")
    assert x.stride(-1) == 1 and router_weight.stride(-1) == 1, "moe: x and router_weight need a contiguous last dim"
    if shared_gate is not None:
        assert n_shared > 0, "moe: a shared gate without a shared expert"
        assert shared_gate.numel() == D and shared_gate.stride(-1) == 1, (
            f"moe: shared_gate {tuple(shared_gate.shape)} is not a contiguous [1, D={D}]")


def _real_rows(n_real, T: int, ids: torch.Tensor) -> tuple:
    """(nreal_ptr, n_real_int, NREAL_FROM_PTR) of a routing launch: a device count is read by the
    kernel (a captured graph follows its value); a host count, or None (every row), is an argument."""
    if isinstance(n_real, torch.Tensor):
        assert n_real.device == ids.device and n_real.numel() >= 1, (
            "moe: n_real must be a one-element tensor on x's device")
        return n_real, T, True
    return ids, T if n_real is None else int(n_real), False


def _routing_constants(E: int, top_k: int, scoring: str, renormalize: bool, num_groups: int, topk_groups: int,
                       router_bias, from_ptr: bool, n_shared: int, shared_gate) -> dict:
    """The constexprs `_route_select` takes, as every routing launch passes them."""
    group_size = E // num_groups
    return dict(E=E, TOP_K=top_k, K_PAD=next_pow2(top_k), NUM_GROUPS=num_groups, GROUP_SIZE=group_size,
                TOPK_GROUPS=topk_groups if num_groups > 1 else 1, G_PAD=next_pow2(num_groups),
                S_PAD=next_pow2(group_size), HAS_BIAS=router_bias is not None, SOFTMAX=scoring == "softmax",
                RENORM=bool(renormalize), NREAL_FROM_PTR=from_ptr, N_SHARED=n_shared,
                NS_PAD=next_pow2(max(1, n_shared)), SHARED_GATE=shared_gate is not None)


def _launch_logits_gemv(x, router_weight, gate, logits) -> None:
    """`_logits_gemv_kernel` into logits [T, E (+1 with the shared gate `gate`: its logit in column E)]."""
    T, D = x.shape
    E = router_weight.shape[0]
    block_e, block_d = _gemv_blocks(E, D)
    _logits_gemv_kernel[(T, cdiv(E, block_e) + (gate is not None))](
        x, router_weight, gate if gate is not None else router_weight, logits, E, D, x.stride(0),
        router_weight.stride(0), logits.stride(0),
        BLOCK_E=block_e, BLOCK_D=block_d, HAS_GATE=gate is not None, ONE_STEP=D <= block_d, num_warps=4,
        **launch_args(x.device))


def _route(x, router_weight, router_bias, top_k: int, scoring: str, renormalize: bool, routed_scale: float,
           num_groups: int, topk_groups: int, n_real, logits_kernel: Optional[str], n_shared: int, shared_gate,
           gate_in_logits: Optional[bool] = None, sort_block_m: Optional[int] = None, one_launch: bool = False,
           count_ranks: bool = False):
    """`route`'s launches: (ids, weights, None); with sort_block_m, the routing kernel is
    `_route_sort_kernel` and the third item is sort_tokens' (sorted_pairs, block_expert, total),
    each block's ranks counted with count_ranks (else sorted).
    one_launch: `_router_kernel` instead of the GEMV and the routing kernel (it sorts with sort_block_m)."""
    T, D = x.shape
    E = router_weight.shape[0]
    _check_routing(x, router_weight, top_k, scoring, num_groups, topk_groups, n_shared, shared_gate)
    dev = x.device
    ids = torch.empty(T, top_k + n_shared, dtype=torch.int32, device=dev)
    weights = torch.empty(T, top_k + n_shared, dtype=torch.float32, device=dev)
    if logits_kernel is None:
        logits_kernel = logits_kernel_for(T, E, D)
    if logits_kernel not in LOGITS_KERNELS:
        raise ValueError(f"moe: unknown logits kernel {logits_kernel!r}")
    # The GEMV and the split GEMM put the shared gate's logit in column E ("split" always; the
    # GEMV unless gate_in_logits is False).
    gate_in_logits = shared_gate is not None and (
        logits_kernel == "split" or (logits_kernel == "gemv" and gate_in_logits is not False))
    if logits_kernel == "split" and E >= DOT_ROUTE_MAX_EXPERTS:
        raise ValueError(f"moe: the split router holds a token's {E} logits and the gate's in one tile of at most "
                         f"{DOT_ROUTE_MAX_EXPERTS} columns; use the 'dot' logits kernel")
    gate_apart = logits_kernel == "gemv" and shared_gate is not None and not gate_in_logits
    if one_launch and (not router_folds(T, E, logits_kernel) or gate_apart):
        raise ValueError(f"moe: a step of {T} tokens ({E} experts, {logits_kernel} logits"
                         + (", the shared gate's logit outside the GEMV" if shared_gate is not None else "")
                         + ") cannot run its router in one launch (router_folds)")
    logits = torch.empty(T, E + gate_in_logits, dtype=torch.float32, device=dev)
    if sort_block_m is not None:
        assert logits_kernel == "gemv" and (shared_gate is None or gate_in_logits), (
            "moe: one-launch routing and sort reads the shared gate's logit from the GEMV's logits")
        P = ids.numel()
        layout = _sort_buffers(P, E + n_shared, sort_block_m, dev)
        if T == 0:
            return ids, weights, (layout[0], layout[1], torch.zeros(1, dtype=torch.int32, device=dev))
    if T == 0:
        return ids, weights, None
    e_pad = next_pow2(E)
    fused = logits_kernel == "fused"
    if fused or one_launch or logits_kernel == "split":
        pass  # the route kernel, or the router kernel, computes the logits itself
    elif logits_kernel == "gemv":
        _launch_logits_gemv(x, router_weight, shared_gate if gate_in_logits else None, logits)
    else:
        bn = _dot_columns(E)
        bm, bk, warps, stages = LOGITS_DOT_TILE
        _logits_kernel[(cdiv(T, bm), cdiv(E, bn))](
            x, router_weight, logits, T, E, D, x.stride(0), router_weight.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_FP32=_dot_fp32(x.dtype, router_weight.dtype),
            num_warps=warps, num_stages=stages, **launch_args(dev))
    nreal_ptr, n_real_int, from_ptr = _real_rows(n_real, T, ids)
    consts = _routing_constants(E, top_k, scoring, renormalize, num_groups, topk_groups, router_bias, from_ptr,
                                n_shared, shared_gate)
    if logits_kernel == "split":
        _launch_split_router(x, router_weight, router_bias, shared_gate, logits, ids, weights, nreal_ptr, n_real_int,
                             routed_scale, consts)
        return ids, weights, None
    if one_launch and logits_kernel == "dot":
        bm, bk, warps, stages = LOGITS_DOT_TILE
        _logits_route_kernel[(cdiv(T, bm),)](
            x, router_weight, shared_gate if shared_gate is not None else router_weight, logits,
            router_bias if router_bias is not None else logits, ids, weights, nreal_ptr, T, n_real_int,
            float(routed_scale), D, x.stride(0), router_weight.stride(0), **consts,
            BLOCK_M=bm, BLOCK_N=_dot_columns(E), BLOCK_K=bk,
            DOT_FP32=_dot_fp32(x.dtype, router_weight.dtype), num_warps=warps, num_stages=stages,
            **launch_args(dev))
        return ids, weights, None
    if one_launch:
        _launch_router(x, router_weight, router_bias, shared_gate, logits, ids, weights, nreal_ptr, n_real_int,
                       routed_scale, consts, sort_block_m, layout if sort_block_m is not None else None, count_ranks)
        return ids, weights, layout if sort_block_m is not None else None
    if sort_block_m is not None:
        sorted_pairs, block_expert, total = layout
        e_bins = next_pow2(E + n_shared)
        _route_sort_kernel[(1,)](
            logits, router_bias if router_bias is not None else logits, ids, weights, nreal_ptr,
            sorted_pairs, block_expert, total, T, n_real_int, P, float(routed_scale), logits.stride(0), **consts,
            BLOCK_T=route_tile_rows(E), E_BINS=e_bins, BLOCK_M=sort_block_m, BLOCK_P=align_block_p(P),
            E_CHUNK=_pad_chunk(e_bins, sort_block_m), COUNT_RANKS=count_ranks, num_warps=4, **launch_args(dev))
        return ids, weights, layout
    _route_kernel[(T,)](
        x, router_weight, logits, router_bias if router_bias is not None else logits,
        shared_gate if shared_gate is not None else logits, ids, weights,
        nreal_ptr, T, n_real_int, float(routed_scale), D,
        x.stride(0), router_weight.stride(0), logits.stride(0), **consts, E_PAD=e_pad,
        # Fused: the router tile is loaded in at most two steps (a serial chain of DRAM round trips
        # would dominate a batch-1 step); 16K elements over 8 warps is 64 values per thread.
        BLOCK_D=max(16, min(next_pow2(D), 16384 // e_pad)), FUSED_LOGITS=fused,
        # Without the fused GEMV the kernel is a chain of small reductions over E: one warp keeps
        # them in shuffles (no shared memory, no barriers) up to 128 experts.
        num_warps=8 if fused else (1 if e_pad <= 128 else (2 if e_pad <= 512 else 4)),
        # The shared gate is one [D] dot per token: loaded in one step up to D = 2048 (two above), not
        # in a chain of small steps (unpipelined loads: each one a DRAM round trip at batch 1).
        GATE_IN_LOGITS=gate_in_logits, GATE_BLOCK_D=min(2048, next_pow2(D)), **launch_args(dev))
    return ids, weights, None


def _dot_columns(E: int) -> int:
    """BLOCK_N of the router GEMM: the experts a program takes (all of them up to 64)."""
    return min(DOT_ROUTE_MAX_EXPERTS, max(16, next_pow2(E)))


def _gemv_blocks(E: int, D: int) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_D) of the router's GEMV programs: few tokens spread the router over many
    programs, each loading its rows (1 expert, or 4 past 64 experts) of up to 2048 columns in one step."""
    return 1 if E <= 64 else 4, min(2048, next_pow2(D))


def _router_warps(E: int, sort: bool) -> int:
    """Warps of `_router_kernel`'s programs. Its routing tail is a chain of small reductions over
    E: one warp keeps them in shuffles, as `_route_kernel` runs them (no shared memory, no
    barriers), where one warp also holds a GEMV program's one-expert row (BLOCK_E 1, up to 64
    experts). Four where it sorts (as `_route_sort_kernel`) or takes 4 experts a program."""
    return 4 if sort or _gemv_blocks(E, 1)[0] > 1 else 1


def _launch_router(x, router_weight, router_bias, shared_gate, logits, ids, weights, nreal_ptr, n_real_int: int,
                   routed_scale: float, consts: dict, sort_block_m: Optional[int], layout, count_ranks: bool) -> None:
    """`_router_kernel`: the GEMV's programs, the last of them routing (and, with sort_block_m,
    sorting into `layout`'s buffers) every token. consts: `_routing_constants`."""
    T, D = x.shape
    E = router_weight.shape[0]
    dev = x.device
    block_e, block_d = _gemv_blocks(E, D)
    gate = shared_gate is not None
    sort = sort_block_m is not None
    e_bins = next_pow2(E + consts["N_SHARED"])
    sorted_pairs, block_expert, total = layout if sort else (ids, ids, ids)  # never touched without SORT
    arrived = arrival_counters(dev, 1, "moe router")
    _router_kernel[(T, cdiv(E, block_e) + gate)](
        x, router_weight, shared_gate if gate else router_weight, logits,
        router_bias if router_bias is not None else logits, ids, weights, nreal_ptr, sorted_pairs, block_expert,
        total, arrived, T, n_real_int, ids.numel(), float(routed_scale), D, x.stride(0), router_weight.stride(0),
        logits.stride(0), **consts,
        BLOCK_T=route_tile_rows(E) if sort else 1, BLOCK_E=block_e, BLOCK_D=block_d, ONE_STEP=D <= block_d, SORT=sort,
        E_BINS=e_bins,
        BLOCK_M=sort_block_m if sort else 16, BLOCK_P=align_block_p(ids.numel()),
        E_CHUNK=_pad_chunk(e_bins, sort_block_m if sort else 16), COUNT_RANKS=count_ranks,
        num_warps=_router_warps(E, sort),
        **launch_args(dev))


def split_router_shape(T: int, D: int) -> tuple[int, int, int]:
    """(row blocks, slices of D, columns of a slice) of `_split_router_kernel` for T tokens: the
    slices are a function of D alone (their sum order is the logits' bits)."""
    bm, bk = LOGITS_SPLIT_TILE[:2]
    k_slice = max(bk, cdiv(cdiv(D, LOGITS_SPLIT), bk) * bk)
    return cdiv(T, bm), cdiv(D, k_slice), k_slice


def _launch_split_router(x, router_weight, router_bias, shared_gate, logits, ids, weights, nreal_ptr, n_real_int: int,
                         routed_scale: float, consts: dict) -> None:
    """`_split_router_kernel`: the router GEMM in slices of D, the last slice of each row block routing
    it. consts: `_routing_constants`."""
    T, D = x.shape
    E = router_weight.shape[0]
    gate = shared_gate is not None
    bm, bk, warps, stages = LOGITS_SPLIT_TILE
    blocks, split, k_slice = split_router_shape(T, D)
    block_n = max(16, next_pow2(E + gate))
    partials = torch.empty(split, T, block_n, dtype=torch.float32, device=x.device)
    _split_router_kernel[(blocks, split)](
        x, router_weight, shared_gate if gate else router_weight, partials, logits,
        router_bias if router_bias is not None else logits, ids, weights, nreal_ptr,
        arrival_counters(x.device, blocks, "moe router"), T, n_real_int, float(routed_scale), D, x.stride(0),
        router_weight.stride(0), logits.stride(0), **consts,
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=bk, SPLIT=split, K_SLICE=k_slice,
        DOT_FP32=_dot_fp32(x.dtype, router_weight.dtype), num_warps=warps, num_stages=stages, **launch_args(x.device))


def max_sorted_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the padded sorted rows: every hit expert wastes at most BLOCK_M-1 rows."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return cdiv(rows, block_m) * block_m


def _sort_buffers(num_pairs: int, num_experts: int, block_m: int, device) -> tuple:
    """sort_tokens' outputs, unfilled: (sorted_pairs [R], block_expert [R / block_m], total [1]) int32."""
    R = max_sorted_rows(num_pairs, num_experts, block_m)
    return tuple(torch.empty(n, dtype=torch.int32, device=device) for n in (R, R // block_m, 1))


def _pad_chunk(e_bins: int, block_m: int) -> int:
    """Experts whose segments one `_pad_segments` call pads: a [chunk, block_m] tile of at most 4K rows."""
    return max(1, min(e_bins, 4096 // block_m))


def sort_tokens(ids: torch.Tensor, num_experts: int, block_m: int, block_p: Optional[int] = None,
                count_ranks: bool = False, scan: Optional[bool] = None):
    """Group the (token, slot) pairs of `ids` [T,k] by expert, each segment padded to block_m.

    num_experts: E, every id the GEMMs compute (routed experts and the shared expert's chunks);
    ids >= E are padding and left out. Returns (sorted_pairs [R] int32, block_expert [R/block_m]
    int32, total [1] int32) with R = max_sorted_rows(T*k, E, block_m). Entries [0, total) hold,
    expert by expert in id order, the pair ids t*k+j of that expert in increasing order, then the
    sentinel T*k up to the segment's padded end; entries at or past total are unspecified.
    block_p: the pairs one program places (a power of two; benchmarks compare widths), by default
    sort_blocks'. One launch where a block holds every pair, or where the programs scan every pair for
    their counts (scan; by default sort_blocks' choice, at an explicit block_p up to SCAN_MAX_PAIRS
    pairs); else two (counts per block first).
    count_ranks: each block's ranks counted instead of sorted (`_place_pairs`; the same layout;
    moe_config.check_count_ranks says where a count fits).
    """
    P = ids.numel()
    E = num_experts
    dev = ids.device
    sorted_pairs, block_expert, total = _sort_buffers(P, E, block_m, dev)
    if P == 0:
        return sorted_pairs, block_expert, torch.zeros(1, dtype=torch.int32, device=dev)
    default_p, default_scan = sort_blocks(P)
    if scan is None:
        scan = default_scan if block_p is None else P <= SCAN_MAX_PAIRS
    block_p = block_p or default_p
    assert block_p & (block_p - 1) == 0 and (E + 1) * block_p < 2 ** 31, f"moe: sort width {block_p}"
    num_blocks = cdiv(P, block_p)
    e_bins = next_pow2(E)
    if count_ranks:
        check_count_ranks(E)
    scan = scan and num_blocks > 1
    counted = num_blocks > 1 and not scan
    block_counts = torch.empty(num_blocks, e_bins, dtype=torch.int32, device=dev) if counted else ids
    if counted:
        _align_count_kernel[(num_blocks,)](ids, block_counts, P, E=E, E_BINS=e_bins, BLOCK_P=block_p, num_warps=4,
                                           **launch_args(dev))
    e_chunk = _pad_chunk(e_bins, block_m)
    _align_kernel[(num_blocks + cdiv(E, e_chunk),)](
        ids, block_counts, sorted_pairs, block_expert, total, P, num_blocks, E=E, E_BINS=e_bins, BLOCK_M=block_m,
        BLOCK_P=block_p, COUNTED=counted, NB_STEP=max(1, min(64, 4096 // e_bins)), E_CHUNK=e_chunk,
        COUNT_RANKS=count_ranks, SCANNED=scan, num_warps=4,
        **launch_args(dev))
    return sorted_pairs, block_expert, total


def _check_stage(cfg: GemmConfig, path: str) -> None:
    if (cfg.BLOCK_M == 1) != (path == "token"):
        raise ValueError(f"moe: config {cfg} does not belong to the {path} path")


def shared_chunks(shared_width: int, inter: int) -> int:
    """How many width-I chunks the kernels cut a shared expert of width S into (0: no shared expert).

    SwiGLU is separable over intermediate channels, so a shared expert of width S is the sum of
    ceil(S/I) experts of the routed width I (the last one masked past S) that every token selects.
    """
    return cdiv(shared_width, inter) if shared_width else 0


def _shared_operand(shared: Optional[torch.Tensor], routed: torch.Tensor) -> tuple:
    """(tensor, row stride) of a shared-expert weight for a launch; without one the routed tensor
    stands in as a pointer that is never read (the shared branch is compiled out)."""
    return (routed, 0) if shared is None else (shared, shared.stride(0))


def gate_up_sorted(x, w13, sorted_pairs, block_expert, total, slots: int, cfg: GemmConfig, h=None, shared_w13=None,
                   h_shared=None):
    """h [R, I] in x's dtype, rows in sorted order (padding rows hold zeros).

    slots: pairs per token (top_k + the shared expert's chunks). Blocks of expert ids >= E read
    shared_w13 [2S, D]. h_shared [T, S] (the split down): the shared expert's rows go there by
    token instead (a padding token's row is not written), and h's shared rows are left unwritten.
    """
    _check_stage(cfg, "sorted")
    R, D = sorted_pairs.shape[0], x.shape[1]
    E, I = w13.shape[0], w13.shape[1] // 2
    S = 0 if shared_w13 is None else shared_w13.shape[0] // 2
    sw13, stride_swn = _shared_operand(shared_w13, w13)
    bm = cfg.BLOCK_M
    assert R % bm == 0, f"moe: sorted rows {R} are not a multiple of BLOCK_M {bm}"
    if h is None:
        h = torch.empty(R, I, dtype=x.dtype, device=x.device)
    # One loop serves routed and shared blocks, so it may skip the column mask only if both tile evenly.
    even_n = I % cfg.BLOCK_N == 0 and (S == 0 or S % I == 0)
    tokens = h_shared is not None
    assert not tokens or (S > 0 and tuple(h_shared.shape) == (x.shape[0], S) and h_shared.stride(1) == 1), (
        f"moe: h_shared must be [T, S] = [{x.shape[0]}, {S}] with a shared expert, got "
        f"{None if h_shared is None else tuple(h_shared.shape)}")
    _gate_up_sorted_kernel[(R // bm * cdiv(I, cfg.BLOCK_N),)](
        x, w13, sw13, h, h_shared if tokens else h, sorted_pairs, block_expert, total, R // bm, x.shape[0] * slots,
        slots, E, I, S, D, x.stride(0), w13.stride(0), w13.stride(1), stride_swn, h.stride(0),
        h_shared.stride(0) if tokens else 0,
        BLOCK_M=bm, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, DOT_FP32=_dot_fp32(x.dtype),
        EVEN_K=D % cfg.BLOCK_K == 0, EVEN_N=even_n, HAS_SHARED=S > 0, SHARED_TOKENS=tokens,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_args(x.device))
    return h


def down_sorted(h, w2, weights, sorted_pairs, block_expert, total, cfg: GemmConfig, y=None, shared_w2=None):
    """y [P, D] in h's dtype: each (token, slot) pair's expert output times its weight.

    Blocks of expert ids >= E read shared_w2 [D, S].
    """
    _check_stage(cfg, "sorted")
    R, I = h.shape
    E, D = w2.shape[0], w2.shape[1]
    S = 0 if shared_w2 is None else shared_w2.shape[1]
    sw2, stride_swn = _shared_operand(shared_w2, w2)
    P = weights.numel()
    bm = cfg.BLOCK_M
    if y is None:
        y = torch.empty(P, D, dtype=h.dtype, device=h.device)
    even_k = I % cfg.BLOCK_K == 0 and (S == 0 or S % I == 0)  # one loop for routed and shared blocks
    _down_sorted_kernel[(R // bm * cdiv(D, cfg.BLOCK_N),)](
        h, w2, sw2, y, weights, sorted_pairs, block_expert, total, R // bm, P, E, D, I, S,
        h.stride(0), w2.stride(0), w2.stride(1), stride_swn, y.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, GROUP_M=cfg.GROUP_M, DOT_FP32=_dot_fp32(h.dtype),
        EVEN_K=even_k, EVEN_N=D % cfg.BLOCK_N == 0, HAS_SHARED=S > 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_args(h.device))
    return y


def split_maps(sorted_pairs: torch.Tensor, block_expert: torch.Tensor, total: torch.Tensor, block_m: int,
               experts: int, num_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ends int32 [experts]: the end row of each expert's padded segment of the sorted layout, the
    offsets of a grouped GEMM over it; inverse int32 [num_pairs]: each pair's sorted row, unspecified
    for a pair routed to no expert), in one launch of `_split_maps_kernel` on the device: nothing is
    read back, so a captured step makes them too. Blocks at or past `total` (a [1] tensor) and ids
    outside the experts are left out of the ends."""
    ends = torch.empty(experts, dtype=torch.int32, device=sorted_pairs.device)
    inverse = torch.empty(num_pairs, dtype=torch.int32, device=sorted_pairs.device)
    R = sorted_pairs.numel()
    _split_maps_kernel[(cdiv(R, MAPS_BLOCK) + 1,)](
        sorted_pairs, block_expert, total, ends, inverse, R, block_expert.numel(), num_pairs,
        E=experts, E_BINS=next_pow2(experts), BLOCK_M=block_m, BLOCK=MAPS_BLOCK, **launch_args(sorted_pairs.device))
    return ends, inverse


# The split down (`--route 'moe=triton_moe[down=split]'`) from this many tokens: where torch's
# grouped GEMM (CUTLASS on sm90) beat the sorted down kernel at default_config's tiles on the H200
# (97.5 against 125.7 us at 4096 tokens, 58.9 against 71.0 at 2048; grouped_mm_probe_h200_2026-12-04.json).
# The tuned table's down took 88.0 us at 4096 there, and on an H100 the whole split lost at every
# count (DESIGN, "Fusion passes"): the option stays off by default.
SPLIT_DOWN_MIN_TOKENS = 2048


def splits_down(T: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a sorted step of T tokens takes the split down where it is asked for: from
    SPLIT_DOWN_MIN_TOKENS, and on a GPU in bf16 only (torch's grouped GEMM takes no other dtype there)."""
    return T >= SPLIT_DOWN_MIN_TOKENS and (device.type != "cuda" or dtype == torch.bfloat16)


def down_split(h, h_shared, w2, shared_w2, sorted_pairs, block_expert, total, block_m: int, num_pairs: int):
    """The down projections of the split down: (y_routed [R, D] in sorted order, one grouped GEMM
    over the routed experts' segments with w2 [E, D, I] as it is, seen as [E, I, D]; the rows past
    the last routed segment are not written), (y_shared [T, D] or None: h_shared @ shared_w2^T, one
    dense GEMM in token order), and the inverse map of the layout (`split_maps`)."""
    ends, inverse = split_maps(sorted_pairs, block_expert, total, block_m, w2.shape[0], num_pairs)
    y_routed = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)
    y_shared = F.linear(h_shared, shared_w2) if h_shared is not None else None
    return y_routed, y_shared, inverse


def combine_split(y_routed, y_shared, inverse, ids, weights, out, top_k: int, num_experts: int, sentinel: int) -> None:
    """out [T, D]: the split down's combine (`_combine_split_kernel`) of what `down_split` returned;
    num_experts the routed ones."""
    T, slots = ids.shape
    D = out.shape[1]
    block_d = min(2048, next_pow2(D))
    per_thread = max(1, 16 // y_routed.element_size())
    shared = y_shared is not None
    _combine_split_kernel[(T, cdiv(D, block_d))](
        y_routed, inverse, y_shared if shared else y_routed, ids, weights, out, sentinel, num_experts, D,
        y_routed.stride(0), y_shared.stride(0) if shared else 0, out.stride(0), SLOTS=slots, TOP_K=top_k,
        HAS_SHARED=shared, BLOCK_D=block_d, EVEN_D=D % block_d == 0,
        num_warps=max(1, min(8, block_d // (32 * per_thread))), **launch_args(out.device))


def combine(y, ids, out, sentinel: int) -> None:
    """out [T, D] = sum over slots of y [T*slots, D], in slot order, in float32; padding tokens give 0.

    sentinel: the expert id of padding slots (E + the shared expert's chunks).
    """
    T, slots = ids.shape
    D = out.shape[1]
    # A row of up to 2048 columns per program, 16 bytes per thread and slot (8 bf16): full-width
    # vector loads, and all slots' rows in flight before the first add.
    block_d = min(2048, next_pow2(D))
    per_thread = max(1, 16 // y.element_size())
    _combine_kernel[(T, cdiv(D, block_d))](
        y, ids, out, sentinel, D, y.stride(0), out.stride(0), SLOTS=slots, BLOCK_D=block_d,
        EVEN_D=D % block_d == 0, num_warps=max(1, min(8, block_d // (32 * per_thread))), **launch_args(out.device))


# The routing constexprs of a `_gate_up_token_kernel` launch that does not route (ROUTE False): not
# read, and fixed, so the variant does not change with the layer's routing.
_NO_ROUTING = dict(TOP_K=1, K_PAD=1, NUM_GROUPS=1, GROUP_SIZE=1, TOPK_GROUPS=1, G_PAD=1, S_PAD=1, HAS_BIAS=False,
                   SOFTMAX=True, RENORM=False, NREAL_FROM_PTR=False, NS_PAD=1, SHARED_GATE=False)


def gate_up_token(x, w13, ids, cfg: GemmConfig, h=None, shared_w13=None, routing: Optional[dict] = None):
    """h [T*slots, I] float32, one GEMV program per (pair, column tile); padding pairs are skipped.

    Pairs of expert ids >= E read shared_w13 [2S, D]. routing (`route_in_gate_up`): the kernel routes
    each pair itself from the GEMV's logits and writes ids and the routing weights (the dict's
    "weights") as the routing kernel would; without it, ids come from the routing kernel.
    """
    _check_stage(cfg, "token")
    T, D = x.shape
    slots = ids.shape[1]
    E, I = w13.shape[0], w13.shape[1] // 2
    S = 0 if shared_w13 is None else shared_w13.shape[0] // 2
    sw13, stride_swn = _shared_operand(shared_w13, w13)
    if h is None:
        h = torch.empty(T * slots, I, dtype=torch.float32, device=x.device)
    n_shared = shared_chunks(S, I)
    if routing is None:
        args, consts = (x, x, ids, ids, 0, 1.0, 0), dict(_NO_ROUTING, E=E, N_SHARED=n_shared)
    else:
        logits = routing["logits"]
        args = (logits, routing["bias"], routing["nreal_ptr"], routing["weights"], routing["n_real"],
                routing["routed_scale"], logits.stride(0))
        consts = routing["consts"]
        assert consts["E"] == E and consts["N_SHARED"] == n_shared and consts["TOP_K"] + n_shared == slots, (
            f"moe: routing of {consts['E']} experts, {consts['TOP_K']} + {consts['N_SHARED']} slots for a gate-up "
            f"of {E} experts and {slots} slots")
    logits, bias, nreal_ptr, weights, n_real, routed_scale, stride_lt = args
    _gate_up_token_kernel[(T * slots, cdiv(I, cfg.BLOCK_N))](
        x, w13, sw13, h, ids, logits, bias, nreal_ptr, weights, slots, D, I, S, n_real, float(routed_scale),
        x.stride(0), w13.stride(0), w13.stride(1), stride_swn, stride_lt, **consts,
        BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, EVEN_K=D % cfg.BLOCK_K == 0, ROUTE=routing is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_args(x.device))
    return h


def route_in_gate_up(x, router_weight, router_bias, w13, top_k: int, scoring: str, renormalize: bool,
                     routed_scale: float, num_groups: int, topk_groups: int, cfg: GemmConfig,
                     n_real: "int | torch.Tensor | None" = None, n_shared: int = 0, shared_gate=None,
                     shared_w13=None) -> tuple:
    """The router option "in_experts" on the token path: the router's GEMV (the shared gate's logit
    in column E), then `gate_up_token` routing each pair itself. (ids, weights, h) as `route` and
    `gate_up_token` give them: two launches where they take three."""
    ids, weights, routing = _logits_for_experts(x, router_weight, router_bias, top_k, scoring, renormalize,
                                                routed_scale, num_groups, topk_groups, n_real, n_shared, shared_gate)
    h = gate_up_token(x, w13, ids, cfg, shared_w13=shared_w13, routing=routing) if x.shape[0] else None
    return ids, weights, h


def _logits_for_experts(x, router_weight, router_bias, top_k: int, scoring: str, renormalize: bool,
                        routed_scale: float, num_groups: int, topk_groups: int, n_real, n_shared: int,
                        shared_gate) -> tuple:
    """The router's GEMV for expert kernels that route their own pairs: (ids and weights [T, slots],
    which those kernels fill, and the routing arguments they read: the logits and the constants)."""
    T, D = x.shape
    E = router_weight.shape[0]
    _check_routing(x, router_weight, top_k, scoring, num_groups, topk_groups, n_shared, shared_gate)
    ids = torch.empty(T, top_k + n_shared, dtype=torch.int32, device=x.device)
    weights = torch.empty(T, top_k + n_shared, dtype=torch.float32, device=x.device)
    logits = torch.empty(T, E + (shared_gate is not None), dtype=torch.float32, device=x.device)
    if T:
        _launch_logits_gemv(x, router_weight, shared_gate, logits)
    nreal_ptr, n_real_int, from_ptr = _real_rows(n_real, T, ids)
    routing = dict(logits=logits, bias=router_bias if router_bias is not None else logits, nreal_ptr=nreal_ptr,
                   weights=weights, n_real=n_real_int, routed_scale=routed_scale,
                   consts=_routing_constants(E, top_k, scoring, renormalize, num_groups, topk_groups, router_bias,
                                             from_ptr, n_shared, shared_gate))
    return ids, weights, routing


def experts_one_launch_fits(I: int, config: MoEConfig) -> bool:
    """Whether a token-path step's experts can run as one launch (`experts_token`): its down tile
    covers I in one step, so a down program holds every slot's weights while it waits for h."""
    return config.path == "token" and I <= config.down.BLOCK_K


def experts_token(x, w13, w2, out, cfg: MoEConfig, routing_args: tuple, n_real=None, n_shared: int = 0,
                  shared_gate=None, shared_w13=None, shared_w2=None) -> tuple:
    """The router's GEMV, then gate-up and down in one launch (`_experts_token_kernel`) into out
    [T, D]: the router option "in_experts" with the experts option "one_launch". routing_args:
    (router_weight, router_bias, top_k, scoring, renormalize, routed_scale, num_groups, topk_groups).
    Returns (ids, weights) as the routing kernel gives them."""
    T, D = x.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    assert experts_one_launch_fits(I, cfg), f"moe: experts in one launch need a token config whose down tile " \
                                            f"covers I={I} (got {cfg})"
    up, down = cfg.gate_up, cfg.down
    _check_stage(up, "token")
    _check_stage(down, "token")
    router_weight, router_bias, top_k, *rest = routing_args
    ids, weights, routing = _logits_for_experts(x, router_weight, router_bias, top_k, *rest, n_real, n_shared,
                                                shared_gate)
    if T == 0:
        return ids, weights
    slots = ids.shape[1]
    S = 0 if shared_w13 is None else shared_w13.shape[0] // 2
    assert n_shared == shared_chunks(S, I) and routing["consts"]["E"] == E
    sw13, stride_swn = _shared_operand(shared_w13, w13)
    sw2, stride_sw2n = _shared_operand(shared_w2, w2)
    h = torch.empty(T * slots, I, dtype=torch.float32, device=x.device)
    ready = arrival_counters(x.device, 2 * T, "moe experts")
    up_tiles, down_tiles = cdiv(I, up.BLOCK_N), cdiv(D, down.BLOCK_N)
    logits = routing["logits"]
    _experts_token_kernel[(T * (slots * up_tiles + down_tiles),)](
        x, w13, sw13, w2, sw2, h, ids, weights, out, logits, routing["bias"], routing["nreal_ptr"], ready, T, D, I, S,
        routing["n_real"], float(routing["routed_scale"]), x.stride(0), w13.stride(0), w13.stride(1), stride_swn,
        w2.stride(0), w2.stride(1), stride_sw2n, out.stride(0), logits.stride(0), **routing["consts"],
        UP_TILES=up_tiles, BLOCK_N=up.BLOCK_N, BLOCK_K=up.BLOCK_K, EVEN_K=D % up.BLOCK_K == 0,
        DOWN_TILES=down_tiles, BLOCK_ND=down.BLOCK_N, BLOCK_KD=down.BLOCK_K,
        num_warps=up.num_warps, num_stages=up.num_stages, **launch_args(x.device))
    return ids, weights


def down_token(h, w2, ids, weights, out, cfg: GemmConfig, shared_w2=None, one_step: Optional[bool] = None) -> None:
    """out [T, D]: each token's routed and shared-chunk down projections weighted and summed in slot order.

    one_step: False keeps the reduction loop even where one tile covers I (benchmarks time the two);
    by default a reduction of one tile runs without a loop.
    """
    _check_stage(cfg, "token")
    T, slots = ids.shape
    E, D, I = w2.shape
    S = 0 if shared_w2 is None else shared_w2.shape[1]
    sw2, stride_swn = _shared_operand(shared_w2, w2)
    n_shared = shared_chunks(S, I)
    even_k = I % cfg.BLOCK_K == 0
    _down_token_kernel[(T, cdiv(D, cfg.BLOCK_N))](
        h, w2, sw2, ids, weights, out, E, D, I, S, w2.stride(0), w2.stride(1), stride_swn, out.stride(0),
        TOP_K=slots - n_shared, N_SHARED=n_shared, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        EVEN_K=even_k, EVEN_K_SHARED=even_k and S % I == 0, ONE_STEP=I <= cfg.BLOCK_K and one_step is not False,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_args(out.device))


def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, router_bias: Optional[torch.Tensor],
              w13: torch.Tensor, w2: torch.Tensor, shared_w13: Optional[torch.Tensor],
              shared_w2: Optional[torch.Tensor], shared_gate: Optional[torch.Tensor], out: torch.Tensor,
              top_k: int, scoring: str, renormalize: bool, routed_scale: float, num_groups: int, topk_groups: int,
              config: MoEConfig, n_real: "int | torch.Tensor | None" = None,
              logits_kernel: Optional[str] = None, fold: Optional[bool] = None,
              one_launch_router: bool = False, count_ranks: bool = False, split_down: bool = False,
              route_in_experts: bool = False, experts_one_launch: bool = False) -> None:
    """The moe op into `out` [T,D] (rows >= n_real zeroed): arguments and shapes as its schema.
    logits_kernel: the router's logits kernel (`route`), by default chosen from T. fold: whether
    a sorted step routes and sorts in one launch (`route_sort`), by default `route_sort_folds`'s answer.
    one_launch_router: the router's GEMV also routes (and sorts) where the step folds (`router_folds`).
    count_ranks: the sort counts each block's ranks instead of sorting them (`route_sort`).
    split_down: a sorted step's down projections as `down_split` and `combine_split` (the shared
    expert's gate-up rows by token); the caller asks where `splits_down` says.
    route_in_experts: a token-path step on the GEMV's logits routes in its gate-up kernel
    (`route_in_gate_up`), no routing launch; other steps route as without it. experts_one_launch:
    such a step runs its gate-up and down as one launch (`experts_token`) where its down tile covers
    I (`experts_one_launch_fits`)."""
    T, D = x.shape
    E, two_i, D_w = w13.shape
    I = two_i // 2
    assert D_w == D and w2.shape == (E, D, I), (
        f"moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match x {tuple(x.shape)}")
    assert router_weight.shape == (E, D), f"moe: router_weight {tuple(router_weight.shape)} is not [E={E}, D={D}]"
    assert out.shape == x.shape, f"moe: out {tuple(out.shape)} is not x's shape {tuple(x.shape)}"
    S = moe_shared_width(shared_w13, shared_w2, shared_gate, D)
    n_shared = shared_chunks(S, I)
    operands = {"x": x, "w13": w13, "w2": w2, "shared_w13": shared_w13, "shared_w2": shared_w2}
    operands = {name: t for name, t in operands.items() if t is not None}
    assert len({t.dtype for t in operands.values()}) == 1, (
        "moe: x and the expert weights must share a dtype (got "
        + ", ".join(f"{name} {t.dtype}" for name, t in operands.items()) + ")")
    for name, t in (*operands.items(), ("out", out)):
        assert t.stride(-1) == 1, f"moe: {name} needs a contiguous last dimension (stride {t.stride()})"
    # The kernels keep tensor offsets in int32 (64-bit only for an expert's base): check they fit.
    slots = top_k + n_shared
    bm = max(16, config.gate_up.BLOCK_M)
    spans = {"x": T * x.stride(0), "out": T * out.stride(0), "one expert of w13": w13.stride(0),
             "one expert of w2": w2.stride(0), "h": max_sorted_rows(T * slots, E + n_shared, bm) * I,
             "y": T * slots * D, "shared_w13": 2 * S * D, "shared_w2": S * D}
    big = {k: v for k, v in spans.items() if v >= 2 ** 31}
    assert not big, f"moe: offsets past 2^31 elements in {big}; split the step into fewer tokens"
    if T == 0:
        return
    route_args = (x, router_weight, router_bias, top_k, scoring, renormalize, routed_scale, num_groups,
                  topk_groups, n_real)
    shared = dict(n_shared=n_shared, shared_gate=shared_gate, logits_kernel=logits_kernel)
    one_launch = _one_launch_router(T, E, slots, logits_kernel or logits_kernel_for(T, E, D), config.path, fold,
                                    one_launch_router)
    if config.path == "token" and routes_in_experts(T, E, D, config, logits_kernel, route_in_experts):
        if experts_one_launch and experts_one_launch_fits(I, config):
            experts_token(x, w13, w2, out, config, (router_weight, router_bias, *route_args[3:-1]), n_real=n_real,
                          n_shared=n_shared, shared_gate=shared_gate, shared_w13=shared_w13, shared_w2=shared_w2)
            return
        ids, weights, h = route_in_gate_up(*route_args[:3], w13, *route_args[3:-1], config.gate_up, n_real=n_real,
                                           n_shared=n_shared, shared_gate=shared_gate, shared_w13=shared_w13)
        down_token(h, w2, ids, weights, out, config.down, shared_w2=shared_w2)
        return
    if config.path == "token":
        ids, weights = route(*route_args, **shared, one_launch=one_launch)
        h = gate_up_token(x, w13, ids, config.gate_up, shared_w13=shared_w13)
        down_token(h, w2, ids, weights, out, config.down, shared_w2=shared_w2)
        return
    # The shared expert's chunks sort like experts E..E+n_shared-1 (after every routed expert).
    experts = E + n_shared
    ids, weights, sorted_pairs, block_expert, total = route_sort(
        *route_args[:-1], config.gate_up.BLOCK_M, n_real=n_real, **shared, fold=fold, one_launch=one_launch,
        count_ranks=count_ranks)
    if split_down:
        h_shared = torch.empty(T, S, dtype=x.dtype, device=x.device) if S else None
        h = gate_up_sorted(x, w13, sorted_pairs, block_expert, total, slots, config.gate_up, shared_w13=shared_w13,
                           h_shared=h_shared)
        ys = down_split(h, h_shared, w2, shared_w2, sorted_pairs, block_expert, total, config.gate_up.BLOCK_M,
                        T * slots)
        combine_split(*ys, ids, weights, out, top_k, E, experts)
        return
    h = gate_up_sorted(x, w13, sorted_pairs, block_expert, total, slots, config.gate_up, shared_w13=shared_w13)
    y = down_sorted(h, w2, weights, sorted_pairs, block_expert, total, config.down, shared_w2=shared_w2)
    combine(y, ids, out, experts)
