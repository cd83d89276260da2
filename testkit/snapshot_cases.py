"""In-step snapshots of the Triton kernels, checked the same way on the CPU (Triton's interpreter,
small dims) and on the GPU (real dims): tests/runtime/backends/test_triton_step_snapshots.py and
tests/gpu/test_gpu_step_snapshots.py.

- `check_chunk_snapshots`: chunk_extend over a step of several requests, some with a snapshot row
  (inside a chunk, at a chunk's first row, in the first chunk, past several chunks), against the
  same launch without snapshots (outputs and slots must not move by a bit), against a launch of each
  request's first r rows alone from the same state (same chunk length and tiles: what the snapshot
  must equal), and against the reference recurrence of those rows (float32 on the host).
- `check_conv_snapshots`: the extend conv's history after a request's first r tokens (r below and
  above K-1: from the old history and from x), against a launch of those tokens alone.

Each returns plain numbers and flags; the tests choose the bounds (bit for bit in float32 under the
interpreter, relative errors on the GPU where tensor cores round)."""

from __future__ import annotations

import numpy as np
import torch

from runtime.backends.cpu_reference import gated_recurrence
from runtime.backends.kernels import chunk as TC
from runtime.backends.kernels.launch_math import token_blocks
from runtime.backends.kernels.linear import (CONV_EXTEND_BLOCK_T, GATE_CONSTANT, GATE_PER_HEAD, StepSnapshots,
                                             short_conv_extend)
from testkit.linear_cases import rel_err

# (tokens of the step, snapshot row or -1) per request, for chunks of BLOCK_T = 16 rows: row 21 is
# 5 rows into chunk 1, row 32 a chunk's first row, row 1 inside the first chunk, row 50 past three
# chunks; one request has none.
CHUNK_REQUESTS = [(37, 21), (5, -1), (48, 32), (20, 1), (61, 50)]
BLOCK_T = 16
# The same places for the 64-row chunks of long steps (real dims, on the GPU): 5 rows into chunk 2,
# a chunk's first row, inside the first chunk, past seven chunks.
LONG_CHUNK_REQUESTS = [(300, 133), (5, -1), (200, 128), (70, 1), (500, 450)]


def _chunk_inputs(rows: int, hk: int, hv: int, dk: int, dv: int, delta: bool, dtype, g: torch.Generator) -> dict:
    r = lambda *shape: torch.randn(rows, *shape, generator=g)
    x = {"q": torch.nn.functional.normalize(r(hk, dk), dim=-1), "k": torch.nn.functional.normalize(r(hk, dk), dim=-1),
         "v": r(hv, dv)}
    if delta:
        x["gate"] = -torch.nn.functional.softplus(r(hv)) * 0.3
        x["beta"] = torch.sigmoid(r(hv))
    else:
        x["gate"] = -torch.rand(hv, generator=g) * 0.3  # Lightning: one constant log-decay a head
        x["beta"] = None
    return {name: None if t is None else (t if name == "gate" else t.to(dtype)) for name, t in x.items()}


def _launch(x: dict, rows: slice | list, lens: list[int], slots: list[int], state: torch.Tensor, delta: bool,
            device, block_t: int, snapshots: StepSnapshots | None = None) -> torch.Tensor:
    """chunk_extend over `rows` of the inputs as requests of `lens` tokens on `slots`; the outputs."""
    pick = lambda t: None if t is None else (t if t.dim() == 1 else t[rows]).to(device)
    q, k, v, gate, beta = (pick(x[n]) for n in ("q", "k", "v", "gate", "beta"))
    out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=device)
    bounds = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int64, device=device)
    chunks = torch.from_numpy(token_blocks(np.asarray(lens), block_t)).to(device)
    hv, dv = v.shape[1], v.shape[2]
    config = TC.chunk_config(1, hv, dv, torch.device(device))  # one tile choice for every launch compared
    TC.chunk_extend(q, k, v, gate, beta, out, state, torch.tensor(slots, dtype=torch.int64, device=device), bounds,
                    chunks, q.shape[2] ** -0.5, GATE_PER_HEAD if delta else GATE_CONSTANT, block_t=block_t,
                    config=config, snapshots=snapshots)
    return out


def check_chunk_snapshots(dims: tuple[int, int, int, int], delta: bool, dtype, device, seed: int = 0,
                          requests=CHUNK_REQUESTS, block_t: int = BLOCK_T) -> dict:
    """dims = (Hk, Hv, Dk, Dv). The step of `requests` in chunks of `block_t` rows from random states, with and without
    snapshots, and a launch per snapshot of its request's first r rows alone. Returns whether the
    outputs and slots matched bit for bit, the worst snapshot's relative error against that launch
    (0.0: bit for bit) and against the float32 reference recurrence, whether the ids not asked for
    were left alone, and whether any snapshot was all zeros."""
    hk, hv, dk, dv = dims
    g = torch.Generator().manual_seed(seed)
    lens = [n for n, _ in requests]
    starts = np.concatenate([[0], np.cumsum(lens)])
    x = _chunk_inputs(int(starts[-1]), hk, hv, dk, dv, delta, dtype, g)
    slots = [4, 1, 6, 2, 5]  # not in row order
    initial = torch.randn(8, hv, dk, dv, generator=g) * 0.5

    def fresh():
        return initial.clone().to(device)

    plain = fresh()
    out_plain = _launch(x, slice(None), lens, slots, plain, delta, device, block_t)
    state = fresh()
    pool = torch.zeros(len(lens) + 1, hv, dk, dv, device=device)
    ids = [len(lens) - b for b in range(len(lens))]  # not the request's index either
    tables = [torch.tensor(t, dtype=torch.int64, device=device) for t in ([r for _, r in requests], ids)]
    out = _launch(x, slice(None), lens, slots, state, delta, device, block_t, StepSnapshots(*tables, pool))
    worst_launch = worst_ref = 0.0
    written = []
    for b, ((n, r), start) in enumerate(zip(requests, starts)):
        if r < 0:
            continue
        alone = fresh()
        _launch(x, slice(int(start), int(start) + r), [r], [slots[b]], alone, delta, device, block_t)
        snap = pool[ids[b]].cpu()
        worst_launch = max(worst_launch, 0.0 if torch.equal(snap, alone[slots[b]].cpu()) else
                           rel_err(snap, alone[slots[b]]))
        ref_state = initial[slots[b]].clone()
        rows = slice(int(start), int(start) + r)
        gate = x["gate"][rows] if delta else x["gate"].expand(r, hv)
        gated_recurrence(x["q"][rows].repeat_interleave(hv // hk, 1), x["k"][rows].repeat_interleave(hv // hk, 1),
                         x["v"][rows], gate[..., None], None if x["beta"] is None else x["beta"][rows].float(),
                         ref_state, 1.0)
        worst_ref = max(worst_ref, rel_err(snap, ref_state))
        written.append(ids[b])
    unasked = [i for i in range(pool.shape[0]) if i not in written]
    return {"outputs_same": bool(torch.equal(out.cpu(), out_plain.cpu())),
            "slots_same": bool(torch.equal(state.cpu(), plain.cpu())),
            "outputs_vs_plain": rel_err(out.float(), out_plain.float()), "slots_vs_plain": rel_err(state, plain),
            "snapshot_vs_prefix_launch": worst_launch, "snapshot_vs_reference": worst_ref,
            "unasked_ids_zero": bool(not pool[unasked].any()),
            "none_zero": all(bool(pool[i].any()) for i in written)}


# (tokens, snapshot row or -1) per request of the conv's step: rows 1 and 2 reach into the old
# history (K = 4 keeps 3 inputs), 9 and 40 only into x (40: in the request's second token block).
CONV_REQUESTS = [(5, 1), (3, 2), (12, 9), (2, -1), (45, 40)]


def _conv_launch(x, w, lens, slots, state, device, snapshots=None):
    rows, channels = x.shape
    bounds = torch.tensor(np.concatenate([[0], np.cumsum(lens), [rows]]), dtype=torch.int64, device=device)
    blocks = torch.from_numpy(token_blocks(np.asarray(lens + [rows - sum(lens)]), CONV_EXTEND_BLOCK_T)).to(device)
    out = torch.full((rows, channels), float("nan"), dtype=x.dtype, device=device)
    short_conv_extend(x.to(device), w.to(device), None, out, state, torch.tensor(slots, dtype=torch.int64,
                      device=device), bounds, blocks, True, snapshots=snapshots)
    return out


def check_conv_snapshots(channels: int, K: int, dtype, device, seed: int = 0) -> dict:
    """The extend conv over CONV_REQUESTS (and 3 padding rows) from random histories, with and
    without snapshots, and a launch per snapshot of its request's first r tokens alone. Returns
    whether outputs and slots matched bit for bit, whether every snapshot equals that launch's
    history bit for bit, and whether the ids not asked for were left alone."""
    g = torch.Generator().manual_seed(seed)
    lens = [n for n, _ in CONV_REQUESTS]
    starts = np.concatenate([[0], np.cumsum(lens)])
    x = torch.randn(int(starts[-1]) + 3, channels, generator=g).to(dtype)
    w = torch.randn(channels, K, generator=g).to(dtype)
    slots = [3, 6, 1, 4, 2]
    initial = torch.randn(8, channels, K - 1, generator=g)
    plain = initial.clone().to(device)
    out_plain = _conv_launch(x, w, lens, slots, plain, device)
    state = initial.clone().to(device)
    pool = torch.zeros(len(lens) + 1, channels, K - 1, device=device)
    ids = [len(lens) - b for b in range(len(lens))]
    tables = [torch.tensor(t, dtype=torch.int64, device=device) for t in ([r for _, r in CONV_REQUESTS], ids)]
    out = _conv_launch(x, w, lens, slots, state, device, StepSnapshots(*tables, pool))
    same, written = True, []
    for b, ((n, r), start) in enumerate(zip(CONV_REQUESTS, starts)):
        if r < 0:
            continue
        alone = initial.clone().to(device)
        _conv_launch(x[int(start):int(start) + r], w, [r], [slots[b]], alone, device)
        same &= bool(torch.equal(pool[ids[b]].cpu(), alone[slots[b]].cpu()))
        written.append(ids[b])
    unasked = [i for i in range(pool.shape[0]) if i not in written]
    return {"outputs_same": bool(torch.equal(out.cpu(), out_plain.cpu())),
            "slots_same": bool(torch.equal(state.cpu(), plain.cpu())), "snapshots_exact": same,
            "unasked_ids_zero": bool(not pool[unasked].any())}
