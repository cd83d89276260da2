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
and k read once and written once at the copy rate. Here each program reads its rows once (and the
rotated channels' partners a second time, from the cache) and writes them once.

One launch covers q and k: program (token block, head) of grid (cdiv(T, BLOCK_T), Hq + Hk) takes
BLOCK_T tokens of one head, q's heads first. Inputs are views with a contiguous last dimension
(q is a slice of the projection's output, beside its gate); outputs are [T, H, D] contiguous.

Not here: the KV cache append (the attention op's), the output gate, PDL. Not yet called by the
compiled glue: the probe above times it against Inductor's kernels first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_math import cdiv, next_pow2

__all__ = ["qk_norm_rope", "BLOCK_T"]

BLOCK_T = 8  # tokens per program: an [8, 256] tile of bench qwen3_next's heads is 16 values a thread in 4 warps


@triton.jit
def _norm_rope_tile(x_ptr, w_ptr, out_ptr, pos_ptr, freq_ptr, T, head, stride_row, stride_head, eps,
                    H: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr, INTERLEAVED: tl.constexpr):
    """One head's BLOCK_T tokens of x (row stride_row, head stride_head) into out [T, H, D]."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    m_t, m_d = offs_t < T, offs_d < D
    mask = m_t[:, None] & m_d[None, :]
    rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_row + head * stride_head
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + offs_d, mask=m_d, other=0.0).to(tl.float32)
    s = w + 1.0 if UNIT_OFFSET else w
    normed = ((x * rstd[:, None]) * s[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    # The rotated channels' partners, loaded again (from the cache) and normed with their own scale:
    # a register tile cannot be indexed by channel, a second load can
    HALF: tl.constexpr = ROT // 2
    rotated = offs_d < ROT
    if INTERLEAVED:
        pair, first, j = offs_d ^ 1, (offs_d % 2) == 0, offs_d // 2
    else:
        pair = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        first, j = offs_d < HALF, offs_d % HALF
    pair = tl.where(rotated, pair, offs_d)
    xp = tl.load(rows + pair[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
    sp = tl.load(w_ptr + pair, mask=m_d & rotated, other=0.0).to(tl.float32)
    sp = sp + 1.0 if UNIT_OFFSET else sp
    partner = ((xp * rstd[:, None]) * sp[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
    pos = tl.load(pos_ptr + offs_t, mask=m_t, other=0).to(tl.float32)
    freq = tl.load(freq_ptr + j, mask=rotated, other=0.0)
    angle = pos[:, None] * freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)
    turned = tl.where(first[None, :], normed * cos - partner * sin, normed * cos + partner * sin)
    out = tl.where(rotated[None, :], turned, normed)
    dst = out_ptr + offs_t.to(tl.int64)[:, None] * (H * D) + head * D + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])  # a token count: one compile for every step
def _qk_norm_rope_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, q_out_ptr, k_out_ptr, pos_ptr, freq_ptr, T,
                         stride_q_row, stride_q_head, stride_k_row, stride_k_head, eps,
                         HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                         INTERLEAVED: tl.constexpr):
    """Program (token block, head): q's head, or k's head - HQ past q's."""
    head = tl.program_id(1)
    if head < HQ:
        _norm_rope_tile(q_ptr, wq_ptr, q_out_ptr, pos_ptr, freq_ptr, T, head, stride_q_row, stride_q_head, eps,
                        H=HQ, D=D, ROT=ROT, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, UNIT_OFFSET=UNIT_OFFSET,
                        INTERLEAVED=INTERLEAVED)
    else:
        _norm_rope_tile(k_ptr, wk_ptr, k_out_ptr, pos_ptr, freq_ptr, T, head - HQ, stride_k_row, stride_k_head,
                        eps, H=HK, D=D, ROT=ROT, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, UNIT_OFFSET=UNIT_OFFSET,
                        INTERLEAVED=INTERLEAVED)


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
            HQ=HQ, HK=HK, D=D, ROT=rot, BLOCK_T=BLOCK_T, BLOCK_D=next_pow2(D), UNIT_OFFSET=bool(unit_offset),
            INTERLEAVED=bool(interleaved), num_warps=4)
    return q_out, k_out
