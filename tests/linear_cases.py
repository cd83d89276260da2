"""Shared by the linear-kernel tests and benchmarks/gpu_linear_decode.py: a decode ExecContext
without a KV pool, and fresh random inputs of one step for a linear op (padding rows NaN)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.splitops import Mode
from runtime.context import ExecContext


def decode_ctx(slots: list[int], num_real: int, device) -> ExecContext:
    """A decode step of len(slots) rows: the first num_real are requests, the rest padding."""
    B = len(slots)
    ctx = ExecContext(
        mode=Mode.DECODE, query_lens=[1] * num_real, cache_lens=[7] * num_real,
        query_start_loc=torch.tensor(list(range(num_real + 1)) + [num_real] * (B - num_real), dtype=torch.int32,
                                     device=device),
        seq_lens=torch.tensor([8] * num_real + [0] * (B - num_real), dtype=torch.int32, device=device),
        state_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        page_table=torch.zeros(B, 1, dtype=torch.int32, device=device),
        slot_mapping=torch.full((B,), -1, dtype=torch.int64, device=device),
        page_size=16, num_tokens=B, num_seqs=B)
    ctx.check()
    return ctx


def random_inputs(op: str, rows: int, num_real: int, dims: tuple[int, int, int, int], conv_channels: int,
                  dtype, g: torch.Generator, k_scale: float) -> dict[str, torch.Tensor]:
    """Inputs of `op` for `rows` rows; rows from num_real on hold NaN (they must never matter).

    dims = (Hk, Hv, Dk, Dv); Lightning keys are scaled by k_scale to keep its sums O(1)."""
    hk, hv, dk, dv = dims
    r = lambda *shape: torch.randn(rows, *shape, generator=g)
    if op == "short_conv":
        x = {"x": r(conv_channels)}
    elif op == "gdn_core":
        x = {"q": F.normalize(r(hk, dk), dim=-1), "k": F.normalize(r(hk, dk), dim=-1), "v": r(hv, dv),
             "g": -F.softplus(r(hv)), "beta": torch.sigmoid(r(hv))}
    elif op == "kda_core":
        x = {"q": F.normalize(r(hv, dk), dim=-1), "k": F.normalize(r(hv, dk), dim=-1), "v": r(hv, dv),
             "g": -F.softplus(r(hv, dk)), "beta": torch.sigmoid(r(hv))}
    else:
        x = {"q": r(hv, dk), "k": r(hv, dk) * k_scale, "v": r(hv, dv)}
    for t in x.values():
        t[num_real:] = float("nan")
    return {name: t.to(dtype) for name, t in x.items()}
