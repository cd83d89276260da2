"""The fused MoE's bookkeeping stages in torch: the sorted layout (`sort_tokens`' contract) and the
combine's sum, exact, so the kernels are checked bit for bit (tests/runtime/backends/test_triton_moe.py,
tests/gpu/test_gpu_moe.py, benchmarks/kernels/moe_bookkeeping.py)."""

from __future__ import annotations

import torch


def sorted_layout_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [total] int32, block_expert [total / block_m] int32) on the CPU for experts 0..E-1: each
    expert's pair ids in increasing order, then the sentinel P up to a multiple of block_m."""
    flat = ids.reshape(-1).long().cpu()
    P = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat[flat < num_experts], minlength=num_experts).tolist()
    rows, blocks, at = [], [], 0
    for e, n in enumerate(counts):
        size = -(-n // block_m) * block_m
        rows += order[at:at + n].tolist() + [P] * (size - n)
        blocks += [e] * (size // block_m)
        at += n
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(blocks, dtype=torch.int32)


def combine_reference(y: torch.Tensor, ids: torch.Tensor, sentinel: int, dtype: torch.dtype = torch.float32):
    """out [T, D] in `dtype`: each token's live slots (id < sentinel) of y [T*slots, D] added in slot
    order in float32, on y's device; rows of padding slots are never read."""
    T, slots = ids.shape
    rows = y.view(T, slots, -1)
    acc = torch.zeros(T, rows.shape[-1], dtype=torch.float32, device=y.device)
    for j in range(slots):
        acc += torch.where((ids[:, j] < sentinel)[:, None], rows[:, j].float(), 0.0)
    return acc.to(dtype)
