"""Batch-invariant sum and mean over dimensions, in Triton: one fixed order per row, whatever M.

torch's CUDA reduction picks its launch shape (threads along the reduced dimension, warps per
output, blocks per output) from the number of outputs as well as from the length reduced, so one
row's sum is taken in another order when more rows share the call. On an H200, the float32
`x.pow(2).mean(-1)` of an RMSNorm over [M, 2048] gave another result for a row than the same row
alone in 102 of the 527 rows of M = 2 .. 32 (tests/runtime/backends/test_triton_row_sum.py's GPU test counts it);
the norm's bf16 output then differs now and then, and a verify row of 4 leaves its decode step's bits. Here one program sums one row,
BLOCK lanes at a time from the row's start, then folds the lanes with one tl.sum: the order
follows the row's length and nothing else (BLOCK and the warps are fixed per length).

`sum_dim(x, dim, keepdim, dtype)` and `mean_dim(...)` take the arguments of aten's sum.dim_IntList
and mean.dim: any dims (None or []: all), keepdim, an output dtype (the input is cast to it first,
as torch does); floating inputs accumulate in float32 (float64 in float64), integers and bools in
int64 (bools sum to int64). `ATEN_IMPLS` names them for runtime/backends/batch_invariant_aten.py,
which registers them for CUDA with the matrix products.

It does not: take complex inputs (a ValueError naming the op, where torch would compute them),
reach other reductions (sum without dims, amax, norm, var, softmax, cumsum) or the out= forms, or
aim at speed: a decode step's glue reduces a few rows of a few thousand elements.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_cache import Launcher
from runtime.backends.kernels.launch_math import next_pow2

__all__ = ["ATEN_IMPLS", "mean_dim", "sum_dim"]

_MAX_BLOCK = 1024  # lanes a program adds at a time: a row of 2048 is two loads per lane
_NUM_WARPS = 4


@triton.jit
def _row_sum_kernel(x, out, K, s_row, ACC: tl.constexpr, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    base = x + row * s_row
    acc = tl.zeros([BLOCK], dtype=ACC)
    for k0 in range(0, K, BLOCK):  # always from the row's start, BLOCK at a time
        acc += tl.load(base + k0 + lanes, mask=lanes < K - k0, other=0).to(ACC)
    total = tl.sum(acc, axis=0)
    if MEAN:
        total = total / K
    tl.store(out + row, total.to(out.dtype.element_ty))


_ROW_SUM = Launcher(_row_sum_kernel)


def _dims(op: str, x: torch.Tensor, dim: Optional[Sequence[int]]) -> list[int]:
    """The reduced dims of x, sorted (None or []: all of them), or a ValueError naming the bad one."""
    if dim is None or len(dim) == 0:
        return list(range(x.dim()))
    rank = max(x.dim(), 1)  # a 0-dim tensor takes dim 0 or -1, as torch allows
    dims = set()
    for d in dim:
        if not -rank <= d < rank or d % rank in dims:
            raise ValueError(f"{op}: dim {list(dim)} is out of range or repeated for a tensor of "
                             f"{x.dim()} dimension(s)")
        dims.add(d % rank)
    return sorted(dims) if x.dim() else []


def _reduce(op: str, x: torch.Tensor, dim, keepdim: bool, dtype: Optional[torch.dtype], mean: bool) -> torch.Tensor:
    want = dtype or x.dtype
    if want.is_complex or x.is_complex():
        raise ValueError(f"{op}: complex tensors are not taken by the batch-invariant {op} (got {x.dtype})")
    if mean and not want.is_floating_point:
        raise ValueError(f"{op}: a mean needs a floating input or dtype (got {want})")
    if want != x.dtype:
        x = x.to(want)  # torch casts the input, then reduces
    elif not x.is_floating_point() and x.dtype != torch.int64:
        x = x.to(torch.int64)  # bools and narrower integers sum to int64
    dims = _dims(op, x, dim)
    kept = [d for d in range(x.dim()) if d not in dims]
    K = math.prod(x.shape[d] for d in dims)
    rows = x.permute([*kept, *dims]).reshape(math.prod(x.shape[d] for d in kept), K)  # a copy where the layout needs one
    if K > 1 and rows.stride(1) != 1:
        rows = rows.contiguous()
    result = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if result.numel():
        if K == 0:  # nothing to add: 0, and a mean of nothing is nan, as torch gives
            result.fill_(math.nan if mean else 0)
        else:
            acc = tl.float64 if x.dtype == torch.float64 else tl.float32 if x.is_floating_point() else tl.int64
            _ROW_SUM[(rows.shape[0],)](rows, result, K, rows.stride(0), ACC=acc, MEAN=mean,
                                       BLOCK=min(_MAX_BLOCK, next_pow2(K)), num_warps=_NUM_WARPS)
    shape = [1 if d in dims else s for d, s in enumerate(x.shape)] if keepdim else [x.shape[d] for d in kept]
    return result.view(shape)


def sum_dim(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch.sum(x, dim, keepdim, dtype=dtype), each output summed in one fixed order."""
    return _reduce("sum", x, dim, keepdim, dtype, mean=False)


def mean_dim(x: torch.Tensor, dim=None, keepdim: bool = False, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch.mean(x, dim, keepdim, dtype=dtype): the fixed-order sum divided by the count."""
    return _reduce("mean", x, dim, keepdim, dtype, mean=True)


# aten overload -> function, for batch_invariant_aten.register
ATEN_IMPLS = (("sum.dim_IntList", sum_dim), ("mean.dim", mean_dim))
