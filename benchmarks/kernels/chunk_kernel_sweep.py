"""Our chunk kernels (runtime/backends/kernels/chunk.py) per kernel, config by config, beside FLA's.

For GDN (Qwen3-Next's 16 key / 32 value heads of 128) and Lightning (16 heads of 128), bf16:

1. Each config is first checked against the CPU reference (cpu_reference.gated_recurrence, float32)
   on one launch of requests of 0, 1, 100, 64, 300 and 1000 rows from random states: outputs and
   final states by relative error of the norm (bound 1e-2, the GPU tests'). A config that fails is
   reported and not timed.
2. Then, per step shape (tokens x requests), each passing config's three launches (`chunk_extend`
   alone: its kernels and its launch path) are timed: wall time per call (triton.testing.do_bench,
   median) and the profiler's kernel time, split by kernel (solve, state, output).
3. FLA's chunk kernels for the same layer, in the same run: the backend with chunk_impl="fla"
   (planned once; one more layer per call), wall and kernel time, split by kernel name.

Configs are named ChunkConfig overrides (`configs`): the default beside candidates for each kernel's
tiles (the state kernel's Dv tile, warps and pipelining stages; the output kernel's Dv and key
tiles and warps; the solve's warps, and T through the matrix workspace instead of registers) and
float32 operands, so a run tells which to make the default per shape (chunk_config). Shapes: one
request of 512, 2048 and 4096 tokens, 4 x 1024, 16 x 256.

`--short`: the steps of the short captured buckets instead (16, 32, 64 and 128 tokens of one
request, 4 x 32), each timed as its graph runs it: the bucket's tables (the padding rows as one
more request, the bucket's request rows, min(tokens, --bucket-seqs), most of them empty) and
workspaces of its own; candidates are the chunk length (a "block_t" key; by default
chunk.chunk_length of the tokens), the single-chunk tiles against the long steps' ("long tiles"),
the solve's column split, Dv tiles and warps (SHORT_CONFIGS). Then the extend conv at the same
steps (qwen3_next's 8192 channels, K 4; GDN only), over the bucket's conv-block table: its channel
tiles and warps in both layouts (the [token block, channels] tile; row streaming, "rows ..."),
each checked against a float32 torch conv first, beside a plain device copy of the same bytes (the
copy-rate reference; every line gives its GB/s of x read and out written).

    python benchmarks/kernels/chunk_kernel_sweep.py --out OUT   # on the GPU machine: every config, both families
    python benchmarks/kernels/chunk_kernel_sweep.py --out OUT --quick   # GDN, QUICK_CONFIGS, fewer reps: < 3 min
    python benchmarks/kernels/chunk_kernel_sweep.py --out OUT --dry-run   # CPU, interpreter, tiny dims
    python benchmarks/kernels/chunk_kernel_sweep.py --out OUT --short --families gdn   # short buckets, the conv
    # the conv at long prompts (the chunk kernels' default config alone at those steps):
    python benchmarks/kernels/chunk_kernel_sweep.py --out OUT --short --families gdn --configs default --shapes 4096x1

Writes OUT/chunk_kernel_sweep.json and prints one line per (shape, config).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench_common import device_ms_by_kernel, is_cuda, rel_err  # noqa: E402
from compiler.splitops import Mode  # noqa: E402
from gpu_linear_extend import DRY, REAL, bench_ms, call, consts, make_inputs, out_for, registry  # noqa: E402
from runtime.backends.kernels import chunk as TC  # noqa: E402
from runtime.backends.cpu_reference import gated_recurrence  # noqa: E402
from runtime.backends.kernels import linear as TL  # noqa: E402
from runtime.backends.kernels.launch_math import cdiv, token_blocks  # noqa: E402
from runtime.backends.protocol import plan_eager_step  # noqa: E402
from runtime.backends.kernels.linear import GATE_CONSTANT, GATE_PER_HEAD  # noqa: E402
from runtime.backends.triton_linear import TritonLinearBackend  # noqa: E402
from runtime.cache.state_pool import PADDING_SLOT, StatePool  # noqa: E402
from testkit.linear_cases import captured_chunk_tables, step_ctx  # noqa: E402

CHECK_LENS = [0, 1, 100, 64, 300, 1000]
CHECK_TOL = 1e-2
SHAPES = [(512, 1), (2048, 1), (4096, 1), (4096, 4), (4096, 16)]  # tokens x requests of equal length
DRY_SHAPES = [(64, 1), (64, 4)]
SHORT_SHAPES = [(16, 1), (32, 1), (64, 1), (128, 1), (128, 4)]  # --short: the short captured buckets' steps
DRY_SHORT_SHAPES = [(16, 1), (32, 2)]
BUCKET_SEQS = 32  # request rows of a short bucket's tables: Buckets.extend_rows(t) = min(t, extend_max_seqs)
QUICK_CONFIGS = ["default", "solve scratch", "solve 8 warps", "state bv16", "state bv64 3 stages",
                 "out bv128 8 warps"]
QUICK_REPS = 25  # triton.testing.do_bench's rep (ms of timing) per shape and config with --quick; else 100
BUDGET_S, QUICK_BUDGET_S = 240.0, 120.0  # no new shape is timed past these seconds (the last shape's timings follow)


def configs(dry: bool) -> dict[str, dict]:
    """Named ChunkConfig overrides; the fields not named keep chunk_config's choice for the shape."""
    if dry:  # tiny dims (Dk = Dv = 16): the candidates' smallest tiles
        return {"default": {}, "f32-dots": {"low_precision_dots": False},
                "tiles 16": {"block_v": 16, "out_block_v": 16, "out_key_block": 16, "state_stages": 2},
                "solve scratch": {"solve_in_registers": False}}
    return {
        "default": {},
        "f32 dots": {"low_precision_dots": False},
        # the state kernel: the sequential walk (one program per request, value head and Dv tile)
        "state 1 stage": {"state_stages": 1},
        "state bv16": {"block_v": 16, "state_stages": 3},
        "state bv16 2 warps": {"block_v": 16, "num_warps": 2, "state_stages": 3},
        "state bv32": {"block_v": 32, "state_stages": 3},
        "state bv64 3 stages": {"block_v": 64, "state_stages": 3},
        "state 4 stages": {"state_stages": 4},
        "state 8 warps": {"num_warps": 8},
        # the output kernel: one program per (chunk, value head, Dv tile)
        "out bv32": {"out_block_v": 32},
        "out bv128": {"out_block_v": 128},
        "out bv128 8 warps": {"out_block_v": 128, "out_warps": 8},
        "out bv128 kb128": {"out_block_v": 128, "out_key_block": 128, "out_warps": 8},
        "out 8 warps": {"out_warps": 8},
        # the solve: one program per (chunk, value head)
        "solve scratch": {"solve_in_registers": False},
        "solve 2 warps": {"solve_warps": 2},
        "solve 8 warps": {"solve_warps": 8},
    }


# An override's key: chunk.TABLE_PROGRAMS_PER_SM for its launches (the programs a walking grid
# keeps over the bucket's padded table; a count past the table's rows launches a program a row).
PER_SM = "table programs an SM"
A_PROGRAM_A_ROW = {PER_SM: 10 ** 9}


def short_configs(dry: bool) -> dict[str, dict]:
    """--short's candidates: named overrides of the single-chunk tiles, "block_t" the chunk length
    (else chunk_length of the step's tokens), "long tiles" the long steps' tiles, PER_SM the
    programs an SM that the kernels keep over the padded table ("a program a row": none walk)."""
    if dry:
        return {"default": {}, "chunk 64": {"block_t": 64}, "long tiles": {"long tiles": True, "block_t": 64},
                "chunk 16": {"block_t": 16}, "out bv16": {"out_block_v": 16}, "a program a row": A_PROGRAM_A_ROW,
                # no floor: one request's rows of programs, so the tiny dims' grids walk too
                "walk 0 an SM": {PER_SM: 0}}
    return {
        "default": {},
        "a program a row": A_PROGRAM_A_ROW,  # the kernels over padded tables before they walked them
        "walk 1 an SM": {PER_SM: 1},
        "walk 2 an SM": {PER_SM: 2},
        "walk 4 an SM": {PER_SM: 4},
        "walk 8 an SM": {PER_SM: 8},
        "walk 16 an SM": {PER_SM: 16},
        # what captured short steps ran before: 64-row chunks, the long steps' tiles
        "before": {"block_t": 64, "long tiles": True},
        "chunk 64": {"block_t": 64},
        "chunk 32": {"block_t": 32},
        "chunk 16": {"block_t": 16},
        "long tiles": {"long tiles": True},
        "solve 1 col": {"solve_col_tiles": 1},
        "solve 2 cols": {"solve_col_tiles": 2},
        "solve 4 cols": {"solve_col_tiles": 4},
        "solve 2 warps": {"solve_warps": 2},
        "solve 8 warps": {"solve_warps": 8},
        "state bv16": {"block_v": 16},
        "state bv64": {"block_v": 64},
        "state 2 warps": {"num_warps": 2},
        "state 8 warps": {"num_warps": 8},
        "state 2 stages": {"state_stages": 2},
        "out bv16": {"out_block_v": 16},
        "out bv64": {"out_block_v": 64},
        "narrow": {"block_v": 16, "out_block_v": 16, "solve_col_tiles": 4},
        "out 2 warps": {"out_warps": 2},
        "out 8 warps": {"out_warps": 8},
        "out kb128": {"out_key_block": 128},
        "all 2 warps": {"num_warps": 2, "solve_warps": 2, "out_warps": 2},
    }


def config_for(R: int, H: int, D: int, device, override: dict, rows: int | None = None) -> TC.ChunkConfig:
    """chunk_config's tiles for R requests (single-chunk tiles where `rows` fit a chunk) with the
    override's ChunkConfig fields."""
    fields = {k: v for k, v in override.items() if k not in ("block_t", "long tiles", PER_SM)}
    single = rows is not None and TC.takes_short_tiles(rows) and not override.get("long tiles")
    return dataclasses.replace(TC.chunk_config(R, H, D, torch.device(device), single), **fields)


def launch_case(spec, lens: list[int], device, seed: int, block_t: int = TC.CHUNK_T):
    """chunk_extend's arguments for requests of `lens` rows, random states in distinct slots; the
    chunk table of `block_t`-row chunks."""
    op, _, hk, hv, dk, dv = spec
    T = sum(lens)
    g = torch.Generator().manual_seed(seed)
    x = make_inputs(spec, T, T, g)
    if op == "lightning_core":
        x["g"] = consts(spec, "cpu")["decay"].float()
    R = len(lens)
    states = torch.randn(R + 2, hv, dk, dv, generator=g) * 0.1
    slots = list(range(2, R + 2))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tables = dict(slots=torch.tensor(slots, device=device), bounds=torch.from_numpy(cu).to(device),
                  chunks=torch.from_numpy(token_blocks(np.array(lens), block_t)).to(device))
    return x, states, slots, tables


def run(spec, x: dict, state: torch.Tensor, tables: dict, out: torch.Tensor, cfg: TC.ChunkConfig,
        block_t: int | None = None, workspaces=None) -> None:
    op, _, hk, hv, dk, dv = spec
    TC.chunk_extend(x["q"], x["k"], x["v"], x["g"], x.get("beta"), out, state, tables["slots"], tables["bounds"],
                    tables["chunks"], dk ** -0.5, GATE_CONSTANT if op == "lightning_core" else GATE_PER_HEAD,
                    block_t=block_t or TC.CHUNK_T, config=cfg, workspaces=workspaces)


@functools.lru_cache(maxsize=None)
def check_case(spec, device, block_t: int = TC.CHUNK_T):
    """The check's launch (CHECK_LENS requests from random states) and its reference, once per family
    and chunk length: (lens, inputs, states, slots, tables, reference outputs [rows, Hv, Dv],
    reference states)."""
    op, _, hk, hv, dk, dv = spec
    lens = [min(n, 40) for n in CHECK_LENS] if device == "cpu" else CHECK_LENS
    x, states, slots, tables = launch_case(spec, lens, device, seed=7, block_t=block_t)
    ref_states = states.clone()
    ref_out = torch.zeros(sum(lens), hv, dv)
    at = 0
    for n, slot in zip(lens, slots):
        rows = slice(at, at + n)
        q, k = (x[name][rows].float().repeat_interleave(hv // hk, dim=1) for name in ("q", "k"))
        gate = x["g"].expand(n, hv) if op == "lightning_core" else x["g"][rows]
        beta = x["beta"][rows].float() if "beta" in x else None
        ref_out[rows] = gated_recurrence(q, k, x["v"][rows].float(), gate[..., None], beta, ref_states[slot],
                                         dk ** -0.5)
        at += n
    return lens, x, states, slots, tables, ref_out, ref_states


def with_programs_an_sm(override: dict, fn) -> None:
    """fn() with chunk.TABLE_PROGRAMS_PER_SM as the override names it (PER_SM; else as it is)."""
    held = TC.TABLE_PROGRAMS_PER_SM
    TC.TABLE_PROGRAMS_PER_SM = override.get(PER_SM, held)
    try:
        fn()
    finally:
        TC.TABLE_PROGRAMS_PER_SM = held


def check(spec, device, override: dict, rows: int | None = None, bucket_seqs: int | None = None) -> dict:
    """One launch of CHECK_LENS requests against the recurrence, per request, in the override's
    chunk length (--short: chunk_length of `rows` where it names none) and tiles (those of a step of
    `rows` rows); with `bucket_seqs` over tables padded as a captured bucket's (captured_chunk_tables:
    that many request rows, at least the requests'), so the kernels walk them as the timed steps do."""
    op, _, hk, hv, dk, dv = spec
    block_t = override.get("block_t") or (TC.chunk_length(rows) if rows else TC.CHUNK_T)
    lens, x, states, slots, tables, ref_out, ref_states = check_case(spec, device, block_t)
    if bucket_seqs is not None:
        padded = captured_chunk_tables(lens, slots, sum(lens), max(len(lens), bucket_seqs), block_t, device)
        tables = dict(zip(("slots", "bounds", "chunks"), padded))
    dev_states = states.to(device, copy=True)  # the launch writes it; the cached case's stays as it was
    out = torch.zeros(sum(lens), hv, dv, dtype=torch.bfloat16, device=device)
    cfg = config_for(len(lens), hv, dv, device, override, rows)
    with_programs_an_sm(override, lambda: run(spec, {k: v.to(device) for k, v in x.items()}, dev_states, tables,
                                              out, cfg, block_t))
    out, dev_states = out.float().cpu(), dev_states.cpu()
    worst_out = worst_state = 0.0
    at = 0
    for n, slot in zip(lens, slots):
        if n:
            worst_out = max(worst_out, rel_err(out[at:at + n], ref_out[at:at + n]))
        worst_state = max(worst_state, rel_err(dev_states[slot], ref_states[slot]))
        at += n
    ok = worst_out <= CHECK_TOL and worst_state <= CHECK_TOL and bool(torch.isfinite(out).all())
    return {"out_rel_err": worst_out, "state_rel_err": worst_state, "ok": ok}


def time_ours(spec, T: int, R: int, device, override: dict, reps: int) -> dict:
    op, _, hk, hv, dk, dv = spec
    x, states, _, tables = launch_case(spec, [T // R] * R, device, seed=T + R)
    x = {k: v.to(device) for k, v in x.items()}
    state = states.to(device)
    out = torch.empty(T, hv, dv, dtype=torch.bfloat16, device=device)
    cfg = config_for(R, hv, dv, device, override)
    fn = lambda: run(spec, x, state, tables, out, cfg)  # noqa: E731
    if device != "cpu":  # the first call compiles the kernels; Triton's interpreter compiles nothing
        fn()
    split = device_ms_by_kernel(fn)
    return {"wall_ms": bench_ms(fn, reps), "kernel_ms": sum(split.values()) if split else None, "kernels": split,
            "config": dataclasses.asdict(cfg)}


def time_short(spec, T: int, R: int, device, override: dict, reps: int, bucket_seqs: int) -> dict:
    """One step of R requests of T / R tokens as the captured bucket of T rows runs it: the padded
    tables of min(T, bucket_seqs) request rows (captured_chunk_tables, in the chunk length's rows),
    the tiles of one request (triton_linear._graph_chunk_config), workspaces of the step's own."""
    op, _, hk, hv, dk, dv = spec
    block_t = override.get("block_t") or TC.chunk_length(T)
    seqs = max(R, min(T, bucket_seqs))
    x, states, slots, _ = launch_case(spec, [T // R] * R, device, seed=T + R)
    x = {k: v.to(device) for k, v in x.items()}
    state = states.to(device)
    slots_t, bounds, chunks = captured_chunk_tables([T // R] * R, slots, T, seqs, block_t, device)
    tables = dict(slots=slots_t, bounds=bounds, chunks=chunks)
    out = torch.empty(T, hv, dv, dtype=torch.bfloat16, device=device)
    cfg = config_for(1, hv, dv, device, override, T)
    work = TC.ChunkWorkspaces.allocate(T, chunks.shape[0], hv, dk, dv, torch.bfloat16, op != "lightning_core",
                                       torch.device(device))

    def fn() -> None:
        with_programs_an_sm(override, lambda: run(spec, x, state, tables, out, cfg, block_t, work))

    if device != "cpu":
        fn()
    split = device_ms_by_kernel(fn)
    return {"wall_ms": bench_ms(fn, reps), "kernel_ms": sum(split.values()) if split else None, "kernels": split,
            "config": dataclasses.asdict(cfg), "block_t": block_t, "bucket_seqs": seqs,
            "programs_an_sm": override.get(PER_SM, TC.TABLE_PROGRAMS_PER_SM)}


def conv_configs(dry: bool) -> dict[str, TL.ConvConfig | str | None]:
    """The extend conv's candidates at short steps: "default" the backend's choice for a captured
    step (conv_extend_takes_rows over the padded table, every request row the bucket could hold:
    conv_extend_rows_config, else conv_extend_config from the table's length); "one request" the
    tile for one request of the bucket's rows; then fixed tiles. The
    table's empty rows are programs too (each loads the table and the bounds before it returns),
    so a narrower tile multiplies them: the sweep weighs that against the real blocks' latency.
    "rows ...": the row-streaming layout (ConvConfig.rows; x read once, 8 channels a thread),
    "rows default" conv_extend_rows_config, the backend's choice."""
    named = {"default": "table", "one request": None, "rows default": "rows"}
    tiles = [(32, 1)] if dry else [(32, 1), (32, 2), (32, 4), (64, 1), (64, 2), (64, 4), (128, 2), (128, 4),
                                   (256, 4), (256, 8)]
    named.update({f"c{bc} w{w}": TL.ConvConfig(bc, w) for bc, w in tiles})
    rows = [(256, 1)] if dry else [(256, 1), (512, 2), (1024, 4)]
    named.update({f"rows c{bc} w{w}": TL.ConvConfig(bc, w, rows=True) for bc, w in rows})
    return named


def conv_reference(x, weight, bias, hist, lens) -> torch.Tensor:
    """float32 causal depthwise conv with silu of each request's rows after its K-1 history columns."""
    K = weight.shape[1]
    out, at = [], 0
    for r, n in enumerate(lens):
        window = torch.cat([hist[r].float(), x[at:at + n].float().T], 1)  # [C, K-1+n]
        y = torch.stack([(window[:, t:t + K] * weight.float()).sum(1) for t in range(n)], 0) + bias.float()
        out.append(y * torch.sigmoid(y))
        at += n
    return torch.cat(out, 0)


def conv_case(C: int, K: int, T: int, R: int, bucket_seqs: int, device):
    """The extend conv's arguments for R requests of T / R tokens as the captured bucket of T rows
    and B = max(R, min(T, bucket_seqs)) request rows runs them (triton_linear._StaticExtendPlan):
    slots [B+1] (past the real ones the padding slot), bounds [B+3] (the padding requests and the
    always-empty request B without rows, then request B+1 the padding rows: none, the T rows are
    real), the block table of those requests, padded with rows naming request B to T/32 + B + 1."""
    g = torch.Generator().manual_seed(T + R)
    lens = [T // R] * R
    seqs = max(R, min(T, bucket_seqs))
    x = torch.randn(T, C, generator=g).bfloat16()
    weight, bias = (torch.randn(C, K, generator=g) * 0.5).bfloat16(), torch.randn(C, generator=g).bfloat16()
    state = torch.randn(R + 1, C, K - 1, generator=g)  # slot 0: the padding slot
    full = np.zeros(seqs + 2, dtype=np.int64)
    full[:R] = lens
    blocks = token_blocks(full, TL.CONV_EXTEND_BLOCK_T)
    table = np.tile(np.array([seqs, 0], dtype=np.int64), (cdiv(T, TL.CONV_EXTEND_BLOCK_T) + seqs + 1, 1))
    table[:blocks.shape[0]] = blocks
    slots = torch.tensor(list(range(1, R + 1)) + [PADDING_SLOT] * (seqs + 1 - R))
    args = dict(x=x, weight=weight, bias=bias, state=state, slots=slots,
                bounds=torch.from_numpy(np.concatenate([[0], np.cumsum(full)]).astype(np.int64)),
                blocks=torch.from_numpy(table))
    return lens, {k: v.to(device) for k, v in args.items()}


def conv_run(args: dict, out: torch.Tensor, config) -> None:
    TL.short_conv_extend(args["x"], args["weight"], args["bias"], out, args["state"], args["slots"], args["bounds"],
                         args["blocks"], True, config=config)


def conv_config_of(name, chosen, T: int, C: int, K: int, blocks: int, device):
    if chosen is None:
        return TL.conv_extend_config(cdiv(T, TL.CONV_EXTEND_BLOCK_T), C, torch.device(device))
    if chosen == "table":
        if TL.conv_extend_takes_rows(T, blocks, K):
            return TL.conv_extend_rows_config(C)
        return TL.conv_extend_config(blocks, C, torch.device(device))
    if chosen == "rows":
        return TL.conv_extend_rows_config(C)
    return chosen


COPY_REFERENCE = "copy (copy-rate reference)"  # not a conv: out.copy_(x), the same bytes moved


def conv_rate(entry: dict, moved: int) -> str:
    """', GB/s' of an entry's bytes read and written over its kernel time (its wall time off the GPU)."""
    ms = entry.get("kernel_ms") or entry["wall_ms"]
    entry["gb_s"] = moved / ms / 1e6
    return f", {entry['gb_s']:.0f} GB/s"


def sweep_conv(C: int, K: int, shapes, device, reps: int, bucket_seqs: int, dry: bool) -> dict:
    """Each conv candidate checked on every short shape against conv_reference, then timed there;
    beside them a plain device copy of x into a [T, C] tensor (COPY_REFERENCE): the rate the conv's
    floor (read x once, write out once) is bound by."""
    rows = {}
    for T, R in shapes:
        lens, args = conv_case(C, K, T, R, bucket_seqs, device)
        want = conv_reference(args["x"].cpu(), args["weight"].cpu(), args["bias"].cpu(),
                              args["state"].cpu()[1:R + 1], lens)
        row = rows[f"{T}x{R}"] = {}
        moved = 2 * args["x"].numel() * args["x"].element_size()  # x read once, out written once
        copy_out = torch.empty_like(args["x"])
        fn = lambda: copy_out.copy_(args["x"])  # noqa: E731
        fn()
        split = device_ms_by_kernel(fn)
        entry = row[COPY_REFERENCE] = {"ok": True, "bytes": moved, "wall_ms": bench_ms(fn, reps),
                                       "kernel_ms": sum(split.values()) if split else None}
        print(f"conv {T}x{R} {COPY_REFERENCE}: wall {entry['wall_ms']:.4f} ms"
              + (f", kernel {entry['kernel_ms']:.4f} ms" if entry.get("kernel_ms") else "")
              + conv_rate(entry, moved), flush=True)
        for name, chosen in conv_configs(dry).items():
            cfg = conv_config_of(name, chosen, T, C, K, args["blocks"].shape[0], device)
            fresh = dict(args, state=args["state"].clone())
            out = torch.full((T, C), float("nan"), dtype=torch.bfloat16, device=device)
            conv_run(fresh, out, cfg)
            err = rel_err(out.float().cpu(), want)
            entry = row[name] = {"config": dataclasses.asdict(cfg), "rel_err": err, "ok": err <= CHECK_TOL}
            if entry["ok"]:
                fn = lambda: conv_run(fresh, out, cfg)  # noqa: E731
                split = device_ms_by_kernel(fn)
                entry.update(wall_ms=bench_ms(fn, reps), kernel_ms=sum(split.values()) if split else None)
            print(f"conv {T}x{R} {name} {cfg.block_c}/{cfg.num_warps}{' rows' if cfg.rows else ''}: err {err:.1e}"
                  + (f", wall {entry['wall_ms']:.4f} ms" if entry["ok"] else " FAIL")
                  + (f", kernel {entry['kernel_ms']:.4f} ms" if entry.get("kernel_ms") else "")
                  + (conv_rate(entry, moved) if entry["ok"] else ""), flush=True)
    return rows


def time_fla(spec, T: int, R: int, device, reps: int) -> dict:
    """One more layer of a planned step through FLA's chunk kernels (the backend's chunk_impl="fla")."""
    lens = [T // R] * R
    pool = StatePool(registry(spec), R + 1, device)
    pool.layer(0)["recurrent"].normal_().mul_(0.1)
    ctx = step_ctx(Mode.EXTEND, [(i + 1, 0, n) for i, n in enumerate(lens)], 0, 0, device)
    x = {k: v.to(device) for k, v in make_inputs(spec, T, T, torch.Generator().manual_seed(T + R)).items()}
    c = consts(spec, device)
    out = out_for(spec, T, device)
    fla = TritonLinearBackend(pool, chunk_impl="fla")
    plan_eager_step(fla, ctx, T)
    fn = lambda: call(fla, spec, ctx, x, c, out)  # noqa: E731
    fn()
    split = device_ms_by_kernel(fn)
    return {"wall_ms": bench_ms(fn, reps), "kernel_ms": sum(split.values()) if split else None, "kernels": split}


def summary(row: dict) -> dict | None:
    """The fastest config of one timed shape by kernel time (wall time where the profiler gave none),
    beside the default's and FLA's kernel time."""
    def ms(t: dict) -> float:
        return t["kernel_ms"] if t.get("kernel_ms") else t["wall_ms"]
    if not row.get("ours"):
        return None
    best = min(row["ours"], key=lambda name: ms(row["ours"][name]))
    out = {"best": best, "best_ms": ms(row["ours"][best])}
    if "default" in row["ours"]:
        out["default_ms"] = ms(row["ours"]["default"])
    if row.get("fla"):
        out["fla_ms"] = ms(row["fla"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for chunk_kernel_sweep.json")
    ap.add_argument("--dry-run", action="store_true", help="CPU: Triton's interpreter, tiny dims, no FLA")
    ap.add_argument("--quick", action="store_true",
                    help=f"GDN only, configs {', '.join(QUICK_CONFIGS)}, do_bench rep {QUICK_REPS} ms: one GPU run "
                         f"in under 3 minutes (--families and --configs still override)")
    ap.add_argument("--families", default=None, help="comma-separated (default: gdn,lightning; gdn with --quick)")
    ap.add_argument("--configs", default=None, help="comma-separated config names to run (default: all)")
    ap.add_argument("--shapes", default=None, help="comma-separated TOKENSxREQUESTS (default: %s)"
                    % ",".join(f"{t}x{r}" for t, r in SHAPES))
    ap.add_argument("--short", action="store_true",
                    help="the short captured buckets' steps (SHORT_SHAPES, as their graphs run them) with "
                         "SHORT_CONFIGS, then the extend conv's tiles at those steps")
    ap.add_argument("--bucket-seqs", type=int, default=BUCKET_SEQS,
                    help=f"--short: request rows of a bucket's tables, at most its tokens (default {BUCKET_SEQS})")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"stop timing new shapes after this many seconds (default {BUDGET_S}, {QUICK_BUDGET_S} with "
                         f"--quick)")
    args = ap.parse_args()
    families = args.families or ("gdn" if args.quick else "gdn,lightning")
    # the dry run's configs are few already (tiny dims): --quick keeps them all
    chosen = args.configs or (",".join(QUICK_CONFIGS) if args.quick and not args.dry_run else None)
    reps = QUICK_REPS if args.quick else 100
    budget_s = args.budget_s if args.budget_s is not None else QUICK_BUDGET_S if args.quick else BUDGET_S
    device = "cpu" if args.dry_run else "cuda"
    specs = DRY if args.dry_run else REAL
    started = time.time()
    result = {"device": torch.cuda.get_device_name() if is_cuda() else "cpu", "torch": torch.__version__,
              "families": {}}
    for family in families.split(","):
        spec = specs[family]
        fam = result["families"][family] = {"checks": {}, "timings": []}
        passing = {}
        wanted = short_configs(args.dry_run) if args.short else configs(args.dry_run)
        if chosen:
            unknown = set(chosen.split(",")) - set(wanted)
            if unknown:
                ap.error(f"--configs: unknown {sorted(unknown)}; known: {sorted(wanted)}")
            wanted = {name: wanted[name] for name in chosen.split(",")}
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")] if args.shapes \
            else (DRY_SHORT_SHAPES if args.dry_run else SHORT_SHAPES) if args.short \
            else DRY_SHAPES if args.dry_run else SHAPES
        # --short: a config's chunk length and tiles follow the step's rows, so each is checked as
        # every shape's step takes it (the same launch checked once)
        for name, override in wanted.items():
            checked = {}
            for rows in sorted({T for T, _ in shapes}) if args.short else [None]:
                cfg = config_for(1, spec[3], spec[5], device, override, rows)
                key = (override.get("block_t") or (TC.chunk_length(rows) if rows else TC.CHUNK_T), cfg)
                if key not in checked:
                    checked[key] = check(spec, device, override, rows, args.bucket_seqs if args.short else None)
            c = fam["checks"][name] = {"out_rel_err": max(v["out_rel_err"] for v in checked.values()),
                                       "state_rel_err": max(v["state_rel_err"] for v in checked.values()),
                                       "ok": all(v["ok"] for v in checked.values())}
            print(f"{family} check {name}: out {c['out_rel_err']:.2e} state {c['state_rel_err']:.2e} "
                  f"{'ok' if c['ok'] else 'FAIL'}", flush=True)
            if c["ok"]:
                passing[name] = override
        for T, R in shapes:
            if time.time() - started > budget_s:
                fam["timings"].append({"tokens": T, "requests": R, "skipped": "budget"})
                continue
            row = {"tokens": T, "requests": R, "ours": {}}
            if not args.dry_run and not args.short:
                row["fla"] = time_fla(spec, T, R, device, reps)
                print(f"{family} {T}x{R} FLA: wall {row['fla']['wall_ms']:.3f} kernels "
                      f"{row['fla']['kernel_ms']:.3f} ms", flush=True)
            for name, override in passing.items():
                row["ours"][name] = t = (time_short(spec, T, R, device, override, reps, args.bucket_seqs)
                                         if args.short else time_ours(spec, T, R, device, override, reps))
                parts = ", ".join(f"{k.split('_chunk_')[-1][:12]} {v:.3f}" for k, v in t["kernels"].items())
                print(f"{family} {T}x{R} {name}: wall {t['wall_ms']:.3f} ms"
                      + (f", kernels {t['kernel_ms']:.3f} ({parts})" if t["kernels"] else ""), flush=True)
            row["summary"] = best = summary(row)
            if best:
                print(f"{family} {T}x{R} best {best['best']}: {best['best_ms']:.3f} ms"
                      + (f", default {best['default_ms']:.3f}" if "default_ms" in best else "")
                      + (f", FLA {best['fla_ms']:.3f}" if "fla_ms" in best else ""), flush=True)
            fam["timings"].append(row)
        if args.short and family == "gdn":
            C, K = specs["conv"][3], specs["conv"][4]  # (op, kind, 0, C, K, 0)
            result["conv"] = sweep_conv(C, K, shapes, device, reps, args.bucket_seqs, args.dry_run)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunk_kernel_sweep.json").write_text(json.dumps(result, indent=1))
    failed = [f"{f} {n}" for f, fam in result["families"].items() for n, c in fam["checks"].items() if not c["ok"]]
    failed += [f"conv {shape} {n}" for shape, row in result.get("conv", {}).items() for n, c in row.items()
               if not c["ok"]]
    if failed:
        print(f"checks failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
