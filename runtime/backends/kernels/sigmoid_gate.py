"""An attention output's sigmoid gate in one launch of a fixed tile: `sigmoid_gate`.

What it computes (per token t, head h and channel c; the traced glue's two ops, each rounded to the
activation dtype A as torch rounds them):

    out[t, h, c] = round_A(x[t, h, c] * round_A(sigmoid(gate[t, h, c])))

x [T, H, D] (the attention op's output) and gate [T, H, D] (a view of the projection's output: in
Qwen3-Next's GQA layers each head's gate sits beside its q channels) with a contiguous last
dimension; out [T, H, D] contiguous. A [T, D] pair is one head, or where D is wider than ROW_CHUNK
(a gate traced as one [T, heads x head dim] row, as Ling's Lightning gate is; the rewrite leaves
that one to Inductor, which fuses it with the layer's norm) heads of ROW_CHUNK channels.

Why a kernel: Inductor compiled these two ops into one pointwise kernel whose tile the build chose
by timing two candidates, and in step accounts of bench qwen3_next's builds of the same code
(H100 and H200, 2026-12-04 to 12-06) the three GQA layers' gates took either about 125 or about 242
us at 4096 tokens (18 or 33 at 512), build by build, on either card: twice the bytes' time at best.
Here program (token block, head) reads BLOCK_T rows of one head from each input, whole channels at
once, and writes them once: one tile, chosen here, for every step and every build.

The compiled glue calls it as hgc_glue::sigmoid_gate in a bundle built with --sigmoid-gate
(compiler/splitops/glue_ops.py, runtime/backends/glue_kernels.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_math import cdiv, next_pow2

__all__ = ["sigmoid_gate", "BLOCK_T", "ROW_CHUNK"]

# Tokens per program, 4 warps: at bench qwen3_next's heads of 256 bf16 channels a program moves
# 3 x 8 KiB, 16 bytes a thread a load. Fixed, so one variant serves every step (a width from the
# step's token count would make a kernel variant per count, each one the bundle must hold).
BLOCK_T = 16
# The widest row a program reads: a [T, D] pair wider than this is cut into heads of the largest
# power of two up to it that divides D. A program's tile then stays [BLOCK_T, ROW_CHUNK] at most,
# where a whole 2048-channel row (bench bailing_linear's) would be 256 values a thread an input.
ROW_CHUNK = 256


@triton.jit(do_not_specialize=["T"])  # a token count: one compile for every step
def _sigmoid_gate_kernel(x_ptr, g_ptr, out_ptr, T, stride_x_row, stride_x_head, stride_g_row, stride_g_head,
                         H: tl.constexpr, D: tl.constexpr, BLOCK_T_: tl.constexpr, BLOCK_D: tl.constexpr):
    head = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T_ + tl.arange(0, BLOCK_T_)
    c = tl.arange(0, BLOCK_D)
    mask = (offs_t < T)[:, None] & (c < D)[None, :]
    t = offs_t.to(tl.int64)[:, None]
    x = tl.load(x_ptr + t * stride_x_row + head * stride_x_head + c[None, :], mask=mask, other=0.0)
    g = tl.load(g_ptr + t * stride_g_row + head * stride_g_head + c[None, :], mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    s = tl.sigmoid(g.to(tl.float32)).to(dtype)
    out = (x.to(tl.float32) * s.to(tl.float32)).to(dtype)
    tl.store(out_ptr + t * (H * D) + head * D + c[None, :], out, mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out = x * sigmoid(gate), contiguous, in x's dtype (module docstring). x and gate: [T, H, D] or
    [T, D] of one shape and dtype, each with a contiguous last dimension."""
    if x.shape != gate.shape or x.dtype != gate.dtype or x.dim() not in (2, 3):
        raise ValueError(f"sigmoid_gate: x {tuple(x.shape)} {x.dtype} and gate {tuple(gate.shape)} {gate.dtype} "
                         "must be [T, H, D] or [T, D] of one shape and dtype")
    if x.stride(-1) != 1 or gate.stride(-1) != 1:
        raise ValueError("sigmoid_gate: x and gate must have a contiguous last dimension")
    x3, g3 = (_as_heads(t) for t in (x, gate))
    T, H, D = x3.shape
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T:
        _sigmoid_gate_kernel[(cdiv(T, BLOCK_T), H)](
            x3, g3, out, T, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1),
            H=H, D=D, BLOCK_T_=BLOCK_T, BLOCK_D=next_pow2(D), num_warps=4)
    return out.view(x.shape)


def _as_heads(t: torch.Tensor) -> torch.Tensor:
    """[T, H, D] as the kernel reads it: a [T, D] pair as one head, or as heads of ROW_CHUNK channels
    (fewer where that divides D) where D is wider; a view either way (the last dimension is
    contiguous, so its chunks are too)."""
    if t.dim() == 3:
        return t
    D = t.shape[1]
    chunk = math.gcd(D, ROW_CHUNK)  # the largest power of two up to ROW_CHUNK that divides D
    return t.unflatten(1, (D // chunk, chunk)) if D > ROW_CHUNK and chunk >= 64 else t.unsqueeze(1)
