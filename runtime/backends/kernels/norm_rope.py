"""A GQA layer's per-head q / k RMSNorms and partial rotary in one launch: `qk_norm_rope`.

What it computes (per token t and head of q, then of k; models/common.py `RMSNorm` with the
layer's weight, then `apply_rotary`, op for op in float32 where they are):

    n      = round_A((x * rsqrt(mean(x^2) + eps)) * s)       s = 1 + w (unit_offset) or w, float32
    out_c  = round_A(n_c cos(p f_j) -+ n_pair(c) sin(p f_j))  c < rotary_dim (- for the first of a pair)
    out_c  = n_c                                              c >= rotary_dim

with A the activation dtype, p the token's position, f = inv_freq (rope_inv_freq of the layer's
rotary dim and theta, handed in as the model computes it, so each angle is the model's product of
two float32 values), and the pairs GPT-NeoX's (c, c + rotary_dim / 2) or, interleaved, GPT-J's
(2i, 2i + 1), j the pair's index.

Why a kernel: Inductor compiles those ops of a bench qwen3_next GQA layer into kernels that pass
over q more than once (the normed rows written and read back for the rotation): 56.5 us at 4096
tokens in 6 kernels in `benchmarks/probes/rotary_glue_probe.py`'s one-cat form on an H200, and 94
us in the two kernels of a layer's compiled glue in the step accounts, against about 18 us for q
and k read once and written once at the copy rate. Here each program reads its rows once, as three
tiles (`_norm_rope_tile`), and writes them once.

One launch covers q and k: program (token block, head) of grid (cdiv(T, BLOCK_T), Hq + Hk) takes
BLOCK_T tokens of one head, q's heads first. Inputs are views with a contiguous last dimension
(q is a slice of the projection's output, beside its gate); outputs are [T, H, D] contiguous.

Not here: the KV cache append (the attention op's), the output gate, PDL. The compiled glue calls
it as hgc_glue::qk_norm_rope in a bundle built with --norm-rope (compiler/splitops/glue_ops.py,
runtime/backends/glue_kernels.py), off by default until the probe above and a step account time it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from runtime.backends.kernels.launch_math import cdiv, next_pow2, triton_interpreted

__all__ = ["qk_norm_rope", "BLOCK_T"]

# Tokens per program, in 4 warps. Compiled for sm90 at bench qwen3_next's heads of 256
# (benchmarks/probes/kernel_resources_probe.py): 32 registers a thread and 16 programs an SM at 4
# tokens; at 8 tokens in 4 warps 105 registers and 4 programs (the tiles' layouts then go through
# shared memory), as many as 4 tokens hold in 8 warps.
BLOCK_T = 4
# 2 pi in three float32 parts (`_cos_sin`): 6.28125 (8 significant bits), then the float32 nearest
# what is left, then the rest
INV_TWO_PI = tl.constexpr(0.15915494309189535)
TWO_PI_HI = tl.constexpr(6.28125)
TWO_PI_MID = tl.constexpr(0.0019353071693331003)
TWO_PI_LO = tl.constexpr(1.0253131677018246e-11)


@triton.jit
def _norm_rope_tile(x_ptr, w_ptr, out_ptr, pos_ptr, freq_ptr, T, head, stride_row, stride_head, eps,
                    H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, BLOCK_T: tl.constexpr,
                    HALF_P: tl.constexpr, REST_P: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                    INTERLEAVED: tl.constexpr, FAST_TRIG: tl.constexpr):
    """One head's BLOCK_T tokens of x (row stride_row, head stride_head) into out [T, H, D].

    A row is taken as three tiles: the first and the second channel of each rotated pair (NeoX: the
    two halves of the rotary channels, contiguous; GPT-J: the even and the odd ones) and the
    channels past the rotary dim, so every load reads contiguous channels (GPT-J's pairs aside) and
    the angles' cos and sin are taken once a pair, not once a channel."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = offs_t < T
    rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_row + head * stride_head
    dst = out_ptr + offs_t.to(tl.int64)[:, None] * (H * D) + head * D
    HALF: tl.constexpr = ROT // 2
    j = tl.arange(0, HALF_P)
    if INTERLEAVED:
        c1, c2 = 2 * j, 2 * j + 1
    else:
        c1, c2 = j, j + HALF
    cr = ROT + tl.arange(0, REST_P)
    m_pair = m_t[:, None] & (j < HALF)[None, :]
    m_rest = m_t[:, None] & (cr < D)[None, :]
    x1 = tl.load(rows + c1[None, :], mask=m_pair, other=0.0).to(tl.float32)
    x2 = tl.load(rows + c2[None, :], mask=m_pair, other=0.0).to(tl.float32)
    xr = tl.load(rows + cr[None, :], mask=m_rest, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xr * xr, axis=1)) / D + eps)
    n1 = _normed(x1, rstd, w_ptr, c1, j < HALF, out_ptr, UNIT_OFFSET)
    n2 = _normed(x2, rstd, w_ptr, c2, j < HALF, out_ptr, UNIT_OFFSET)
    nr = _normed(xr, rstd, w_ptr, cr, cr < D, out_ptr, UNIT_OFFSET)
    pos = tl.load(pos_ptr + offs_t, mask=m_t, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(freq_ptr + j, mask=j < HALF, other=0.0)[None, :]
    cos, sin = _cos_sin(angle, FAST_TRIG)
    dtype = out_ptr.dtype.element_ty
    tl.store(dst + c1[None, :], (n1 * cos - n2 * sin).to(dtype), mask=m_pair)
    tl.store(dst + c2[None, :], (n2 * cos + n1 * sin).to(dtype), mask=m_pair)
    tl.store(dst + cr[None, :], nr.to(dtype), mask=m_rest)


@triton.jit
def _cos_sin(angle, FAST_TRIG: tl.constexpr):
    """cos and sin of float32 angles. FAST_TRIG (compiled): the angle less k times 2 pi in three parts
    (the first exact in 8 bits, so k * TWO_PI_HI is exact for |k| < 2^16: angles up to about 4e5, a
    position of 4e5 at the highest frequency), k the nearest integer to angle / (2 pi), which leaves
    it within about 0.03 of [-pi, pi]; then the hardware's approximations. Within 4e-6 of the float32
    angle's own cos and sin up to position 262144 (test_norm_rope.py checks the reduction). libdevice's
    accurate cosf and sinf keep a slow path for large arguments, whose registers held an SM to four
    programs in an earlier form of this kernel (124 registers a thread against 87 without them, sm90).
    The interpreter has no libdevice: it takes tl.cos and tl.sin."""
    if FAST_TRIG:
        k = libdevice.rint(angle * INV_TWO_PI)
        r = tl.fma(-k, TWO_PI_HI, angle)
        r = tl.fma(-k, TWO_PI_MID, r)
        r = tl.fma(-k, TWO_PI_LO, r)
        return libdevice.fast_cosf(r), libdevice.fast_sinf(r)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _normed(x, rstd, w_ptr, cols, m_cols, out_ptr, UNIT_OFFSET: tl.constexpr):
    """(x * rstd) * s of channels `cols` in float32, rounded to the output's dtype where the model
    rounds its normed rows, back in float32 for the rotation: s = 1 + w (unit_offset) or w."""
    w = tl.load(w_ptr + cols, mask=m_cols, other=0.0).to(tl.float32)
    s = w + 1.0 if UNIT_OFFSET else w
    return ((x * rstd[:, None]) * s[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)


@triton.jit(do_not_specialize=["T"])  # a token count: one compile for every step
def _qk_norm_rope_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, q_out_ptr, k_out_ptr, pos_ptr, freq_ptr, T,
                         stride_q_row, stride_q_head, stride_k_row, stride_k_head, eps,
                         HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                         BLOCK_T: tl.constexpr, HALF_P: tl.constexpr, REST_P: tl.constexpr,
                         UNIT_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr, FAST_TRIG: tl.constexpr):
    """Program (token block, head): q's head, or k's head - HQ past q's."""
    head = tl.program_id(1)
    if head < HQ:
        _norm_rope_tile(q_ptr, wq_ptr, q_out_ptr, pos_ptr, freq_ptr, T, head, stride_q_row, stride_q_head, eps,
                        H=HQ, D=D, ROT=ROT, BLOCK_T=BLOCK_T, HALF_P=HALF_P, REST_P=REST_P,
                        UNIT_OFFSET=UNIT_OFFSET, INTERLEAVED=INTERLEAVED, FAST_TRIG=FAST_TRIG)
    else:
        _norm_rope_tile(k_ptr, wk_ptr, k_out_ptr, pos_ptr, freq_ptr, T, head - HQ, stride_k_row, stride_k_head,
                        eps, H=HK, D=D, ROT=ROT, BLOCK_T=BLOCK_T, HALF_P=HALF_P, REST_P=REST_P,
                        UNIT_OFFSET=UNIT_OFFSET, INTERLEAVED=INTERLEAVED, FAST_TRIG=FAST_TRIG)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 positions: torch.Tensor, inv_freq: torch.Tensor, eps: float, unit_offset: bool,
                 interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out) [T, Hq, D] and [T, Hk, D], contiguous, in q's dtype (module docstring).

    q [T, Hq, D], k [T, Hk, D]: views with a contiguous last dimension; q_weight, k_weight [D]: the
    norms' weights; positions [T] (integers); inv_freq [rotary_dim / 2] float32, the model's
    rope_inv_freq. The rotary dim is 2 * len(inv_freq), at most D and even."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    rot = 2 * inv_freq.numel()
    if k.shape[0] != T or k.shape[2] != D or q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D] with a "
                         "contiguous last dimension and the same T and D")
    if not 0 < rot <= D or q_weight.shape != (D,) or k_weight.shape != (D,) or positions.shape != (T,):
        raise ValueError(f"qk_norm_rope: rotary dim {rot} must be in 1..{D}, the norm weights [{D}], positions [{T}]")
    if inv_freq.dtype != torch.float32 or k.dtype != q.dtype:
        raise ValueError("qk_norm_rope: inv_freq is float32 and k has q's dtype")
    q_out = torch.empty(T, HQ, D, dtype=q.dtype, device=q.device)
    k_out = torch.empty(T, HK, D, dtype=q.dtype, device=q.device)
    if T:
        _qk_norm_rope_kernel[(cdiv(T, BLOCK_T), HQ + HK)](
            q, k, q_weight, k_weight, q_out, k_out, positions, inv_freq, T,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), float(eps),
            HQ=HQ, HK=HK, D=D, ROT=rot, BLOCK_T=BLOCK_T, HALF_P=next_pow2(rot // 2), REST_P=next_pow2(max(1, D - rot)),
            UNIT_OFFSET=bool(unit_offset), INTERLEAVED=bool(interleaved), FAST_TRIG=not triton_interpreted(),
            num_warps=4)
    return q_out, k_out
