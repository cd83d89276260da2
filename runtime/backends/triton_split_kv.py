"""Split-KV attention pieces shared by the Triton attention kernels (triton_gqa.py, triton_mla.py).

Both kernels split each query row's keys over several programs, keep an online softmax in
float32 and base 2 inside each split, and merge the splits afterwards. What they share lives here,
once: the online-softmax step of one key tile, a split's normalised result, the number of splits
for a launch, and the combine pass.

It does not: address the paged cache (each kernel finds its keys its own way) or store K/V rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.launch_cache import Launcher

__all__ = ["LOG2E", "MAX_SPLITS", "combine_splits", "num_splits_for", "softmax_step", "split_result"]

LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * LOG2E)


@triton.jit
def softmax_step(m, l, s):
    """One key tile of an online softmax in base 2: running max m [M] and sum l [M], this tile's
    scaled scores s [M, N] (-inf where a row sees no key) -> (new max, rescale of the old
    accumulator, the tile's weights [M, N], new sum)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    # A row that has seen no key yet keeps m = -inf: subtract 0 instead, so its weights are
    # exp2(-inf) = 0 rather than NaN.
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_sub)
    w = tl.exp2(s - m_sub[:, None])
    return m_new, alpha, w, l * alpha + tl.sum(w, 1)


@triton.jit
def split_result(acc, m, l):
    """A split's normalised output and base-2 log-sum-exp (-inf and zeros where it saw no key)."""
    has = l > 0
    lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
    return acc / tl.where(has, l, 1.0)[:, None], lse


# The split count is a run-time argument of every kernel here, never a specialization: it follows
# a launch's row count (num_splits_for), and an eager step's rows are any number, so as a constexpr
# (or a specialized int) it would make kernels that no build saw, built in the middle of serving and
# missing from the artifact's bundle. One kernel serves every count up to MAX_SPLITS.
MAX_SPLITS = 32


@triton.jit(do_not_specialize=["num_splits"])
def _combine_kernel(part_o, part_lse, out, s_o_t, s_o_h, num_heads, num_splits,
                    R: tl.constexpr, MAX_SPLITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, MAX_SPLITS)
    used = sp < num_splits
    r = tl.arange(0, R)
    base = (t * num_heads + h) * num_splits
    lse = tl.load(part_lse + base + sp, mask=used, other=float("-inf"))
    m = tl.max(lse, 0)
    live = lse > float("-inf")
    w = tl.where(live, tl.exp2(tl.where(live, lse - m, 0.0)), 0.0)
    o = tl.load(part_o + (base + sp)[:, None] * R + r[None, :], mask=used[:, None], other=0.0)
    res = tl.sum(w[:, None] * o, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(out + t * s_o_t + h * s_o_h + r, res.to(out.dtype.element_ty))


_COMBINE = Launcher(_combine_kernel)  # eager gaps repeat its arguments (launch_cache.py)


def num_splits_for(rows: int, head_blocks: int, num_sms: int) -> int:
    """Splits per (row, head block): enough programs for about two waves, a power of two <= 32."""
    want = max(1, -(-2 * num_sms // max(rows * head_blocks, 1)))
    splits = 1
    while splits < want and splits < MAX_SPLITS:
        splits *= 2
    return splits


def combine_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """Merge the split pass's partial outputs: part_o [(row * H + head) * splits + split, Dv] float32
    and their base-2 log-sum-exp part_lse (-inf: the split saw no key) into out [rows, H, Dv]
    (unit last stride). A row and head whose splits all saw no key gets zeros."""
    T, H, DV = out.shape
    assert out.stride(-1) == 1
    assert 1 <= num_splits <= MAX_SPLITS, f"split-KV attention: {num_splits} splits (1 to {MAX_SPLITS})"
    _COMBINE[(T, H)](part_o, part_lse, out, out.stride(0), out.stride(1), H, num_splits,
                            R=DV, MAX_SPLITS=MAX_SPLITS, num_warps=4)
