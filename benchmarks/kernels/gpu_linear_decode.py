"""Check and time the Triton linear-attention decode kernels on one GPU, against their floor and FLA.

One script for one call on the GPU machine (it never needs a second):

1. Device facts and the device-to-device copy bandwidth, measured in this run (bytes read +
   written); every floor below is bytes over that rate.
2. For each kernel (GDN Hk 16 -> Hv 32, KDA H 32, Lightning H 16 and H 32, all D 128; the
   Qwen3-Next short conv C 8192, K 4) and batch (1, 8, 32, 64, 256; batches above 1 end in padding
   rows on the padding slot): bf16 inputs, random non-zero states, outputs poisoned with NaN;
   two consecutive steps through TritonLinearBackend checked against the CPU reference backend
   (float32), plus float32 inputs at batch 8. Checked: every output written, padding rows zero,
   padding and free slots untouched, ||x - ref|| / ||ref|| of outputs and updated states.
3. Timing: a CUDA graph of many launches rotating over enough independent pools and inputs that
   the L2 cannot hold them (decode states come from HBM in a real step), median of replays per
   launch; triton.testing.do_bench (median, L2 flushed) as a second opinion. The default tile
   choice and a sweep of tile widths / warps, each sweep point checked for correctness first.
4. FLA 0.6.0, in a subprocess (a crash there cannot take the results above with it): the
   recurrent kernels on the same kind of inputs, timed as a user must run them over a slot pool
   (gather the states by slot, run, scatter them back; KDA also through its in-place
   `ssm_state_indices` path), checked against the reference too.
5. FLA chunk vs fused_recurrent GDN at T=1024 (a reported 0.41 relative disagreement), each
   against the reference, for raw / half / fully normalised q and k; the in-kernel l2norm path
   (reported to crash) in a subprocess of its own, last.
6. `pytest -m gpu tests/gpu/test_gpu_linear_kernels.py` in a subprocess.
7. A short table last; everything in $OUT/gpu_linear_decode.json (subprocess output in
   $OUT/gpu_linear_decode_subprocess.log).

`--dry-run` walks the same code on the CPU through Triton's interpreter at tiny dims (timings
meaningless), to validate the script without a GPU. `--state-dtype bfloat16` keeps the recurrent
states in bfloat16 (`hgc compile --state-dtype`) on both sides of every check, and the floors count
their bytes; `--cases` picks kernels by name; `--sweep walk` sweeps the recurrent kernels' tiles
walked by a few programs an SM (`triton_linear[decode_tiles=walk]`) against the one-tile default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Triton picks interpreted or compiled kernels when they are decorated (at import), so the dry
# run's choice must be in the environment before torch/triton or the kernels are imported.
if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from compiler.splitops import STATE_DTYPES, LayerKind, LayerRegistry, LayerSpec, TensorSpec, dtype_from_name  # noqa: E402
from runtime.backends.kernels import linear as TL  # noqa: E402
from runtime.backends.cpu_reference import CPUReferenceBackend, gated_recurrence  # noqa: E402
from runtime.backends.triton_linear import TritonLinearBackend  # noqa: E402
from runtime.step.context import ExecContext  # noqa: E402
from runtime.cache.state_pool import PADDING_SLOT, StatePool  # noqa: E402
from bench_common import device_facts, device_rates, ensure_einops, fmt, is_cuda, rel_err, run_gpu_pytest  # noqa: E402
from testkit.linear_cases import decode_ctx  # noqa: E402

START = time.time()
OUT_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}
STATE_TOL = 1e-4
# bfloat16 states (--state-dtype) are rounded after the step on both sides: an element may sit one
# bfloat16 step apart
STATE_TOLS = {"float32": STATE_TOL, "bfloat16": 1e-2}
STATE_DTYPE = "float32"  # --state-dtype: the recurrent states' (main sets it before any problem is made)


# ---------------------------------------------------------------------------------------------
# cases and problems
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # table label
    op: str  # hgc op
    kind: LayerKind
    hk: int = 0
    hv: int = 0
    dk: int = 0
    dv: int = 0
    channels: int = 0  # short_conv only
    width: int = 0

    @property
    def recurrent(self) -> bool:
        return self.op != "short_conv"

    @property
    def entry(self) -> str:
        return "recurrent" if self.recurrent else "conv"


REAL_CASES = [
    Case("gdn", "gdn_core", LayerKind.GDN, 16, 32, 128, 128),
    Case("kda", "kda_core", LayerKind.KDA, 32, 32, 128, 128),
    Case("lightning_h16", "lightning_core", LayerKind.LIGHTNING, 16, 16, 128, 128),
    Case("lightning_h32", "lightning_core", LayerKind.LIGHTNING, 32, 32, 128, 128),
    Case("short_conv", "short_conv", LayerKind.GDN, channels=8192, width=4),
]
DRY_CASES = [
    Case("gdn", "gdn_core", LayerKind.GDN, 2, 4, 16, 16),
    Case("kda", "kda_core", LayerKind.KDA, 4, 4, 16, 16),
    Case("lightning_h2", "lightning_core", LayerKind.LIGHTNING, 2, 2, 16, 16),
    Case("lightning_h4", "lightning_core", LayerKind.LIGHTNING, 4, 4, 16, 16),
    Case("short_conv", "short_conv", LayerKind.GDN, channels=48, width=4),
]
RECURRENT_SWEEP = [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 4), (128, 8)]  # (BV, warps)
CONV_SWEEP = [(32, 1), (64, 1), (128, 2), (256, 4), (512, 4), (1024, 4)]  # (channels, warps)
# --sweep walk: the recurrent kernels' tiles walked by a few programs an SM (RecurrentConfig.walk),
# (BV, warps, programs an SM, stages), the one-tile default (64, 4) first as the baseline; the deeper
# pipelines (3 and 4 stages) keep more state in flight in shared memory than any one-tile program
# keeps in registers (docs/DESIGN.md, "Recurrent states in bfloat16").
WALK_SWEEP = [(64, 4, 0, 2), (64, 4, 2, 2), (64, 4, 3, 2), (64, 4, 4, 2), (64, 4, 2, 3), (64, 4, 3, 3),
              (64, 4, 2, 4), (32, 4, 4, 2), (32, 4, 4, 3), (32, 2, 6, 2), (32, 2, 8, 2), (128, 8, 1, 2),
              (128, 8, 2, 2)]
SWEEP = "tiles"  # --sweep (main sets it)


def num_real_rows(B: int) -> int:
    """Batches above 1 end in padding rows (about an eighth), as a padded graph bucket would."""
    return B if B == 1 else B - max(1, B // 8)


def make_pool(case: Case, num_slots: int, device, gen: torch.Generator) -> StatePool:
    if case.recurrent:
        state = {"recurrent": TensorSpec((case.hv, case.dk, case.dv), STATE_DTYPE)}
    else:
        state = {"conv": TensorSpec((case.channels, case.width - 1), "float32")}
    pool = StatePool(LayerRegistry([LayerSpec(0, case.kind, state=state)]), num_slots, device)
    t = pool.layer(0)[case.entry]
    t.copy_(torch.randn(t.shape, generator=gen) * 0.5)  # a non-zero state: zeros hide wrong indexing
    return pool


def make_inputs(case: Case, B: int, num_real: int, dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decode step's inputs on the CPU; padding rows hold NaN, which must never matter."""
    r = lambda *shape: torch.randn(B, *shape, generator=gen)
    if case.op == "short_conv":
        x = {"x": r(case.channels)}
    elif case.op == "gdn_core":
        x = {"q": F.normalize(r(case.hk, case.dk), dim=-1), "k": F.normalize(r(case.hk, case.dk), dim=-1),
             "v": r(case.hv, case.dv), "g": -F.softplus(r(case.hv)), "beta": torch.sigmoid(r(case.hv))}
    elif case.op == "kda_core":
        x = {"q": F.normalize(r(case.hv, case.dk), dim=-1), "k": F.normalize(r(case.hv, case.dk), dim=-1),
             "v": r(case.hv, case.dv), "g": -F.softplus(r(case.hv, case.dk)), "beta": torch.sigmoid(r(case.hv))}
    else:
        x = {"q": r(case.hv, case.dk), "k": r(case.hv, case.dk) * 0.1, "v": r(case.hv, case.dv)}
    for t in x.values():
        t[num_real:] = float("nan")
    return {n: t.to(dtype) for n, t in x.items()}


def make_consts(case: Case, dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    if case.op == "short_conv":
        return {"weight": (torch.randn(case.channels, case.width, generator=gen) * 0.5).to(dtype),
                "bias": torch.randn(case.channels, generator=gen).to(dtype)}
    if case.op == "lightning_core":
        return {"decay": -torch.linspace(0.02, 1.0, case.hv)}
    return {}


@dataclasses.dataclass
class Problem:
    """A decode step's worth of everything on one device: pool, slots, inputs, out."""

    case: Case
    pool: StatePool
    slots: list[int]
    num_real: int
    x: dict[str, torch.Tensor]
    consts: dict[str, torch.Tensor]
    out: torch.Tensor
    ctx: ExecContext

    @property
    def state(self) -> torch.Tensor:
        return self.pool.layer(0)[self.case.entry]

    @property
    def touched(self) -> list[int]:
        return self.slots[:self.num_real]


def make_problem(case: Case, B: int, dtype, device, seed: int) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    num_slots = B + 4  # a few slots no request holds: they must stay untouched
    pool = make_pool(case, num_slots, device, gen)
    num_real = num_real_rows(B)
    perm = (torch.randperm(num_slots, generator=gen) + 1).tolist()  # slots out of row order
    slots = perm[:num_real] + [PADDING_SLOT] * (B - num_real)
    x = {n: t.to(device) for n, t in make_inputs(case, B, num_real, dtype, gen).items()}
    consts = {n: t.to(device) for n, t in make_consts(case, dtype, gen).items()}
    shape = (B, case.channels) if case.op == "short_conv" else (B, case.hv, case.dv)
    out = torch.full(shape, float("nan"), dtype=dtype, device=device)
    return Problem(case, pool, slots, num_real, x, consts, out, decode_ctx(slots, num_real, device))


def call_op(backend, p: Problem, ctx: ExecContext | None = None, x=None, out=None) -> None:
    """The op through a backend, exactly as the runtime calls it."""
    ctx, x, out = ctx or p.ctx, x or p.x, p.out if out is None else out
    c = p.case
    if c.op == "short_conv":
        backend.short_conv(ctx, x["x"], p.consts["weight"], p.consts["bias"], out, 0, True)
    elif c.op == "gdn_core":
        backend.gdn_core(ctx, x["q"], x["k"], x["v"], x["g"], x["beta"], out, 0, c.dk ** -0.5)
    elif c.op == "kda_core":
        backend.kda_core(ctx, x["q"], x["k"], x["v"], x["g"], x["beta"], out, 0, c.dk ** -0.5)
    else:
        backend.lightning_core(ctx, x["q"], x["k"], x["v"], p.consts["decay"], out, 0, c.dk ** -0.5)


def reference_step(p: Problem, state_before: torch.Tensor, x_cpu: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, ...] in p.out's dtype, state after) from the CPU reference backend, float32."""
    c = p.case
    ref_pool = StatePool(LayerRegistry([LayerSpec(0, c.kind, state={c.entry: TensorSpec(
        tuple(state_before.shape[1:]), str(state_before.dtype).removeprefix("torch."))})]), state_before.shape[0] - 1)
    ref_pool.layer(0)[c.entry].copy_(state_before)
    ref = CPUReferenceBackend(None, ref_pool)
    cpu = Problem(c, ref_pool, p.slots, p.num_real, x_cpu, {n: t.cpu() for n, t in p.consts.items()},
                  torch.full(tuple(p.out.shape), float("nan"), dtype=p.out.dtype),
                  decode_ctx(p.slots, p.num_real, "cpu"))
    call_op(ref, cpu)
    return cpu.out, ref_pool.layer(0)[c.entry]




def check_against(p: Problem, out: torch.Tensor, state_after: torch.Tensor, state_before: torch.Tensor,
                  out_ref: torch.Tensor, state_ref: torch.Tensor) -> dict:
    """Every check of one step, as numbers and flags."""
    out, state_after = out.cpu(), state_after.cpu()
    untouched = [s for s in range(state_before.shape[0]) if s not in p.touched]
    r = {
        "out_rel_err": rel_err(out[:p.num_real], out_ref[:p.num_real]),
        "state_rel_err": rel_err(state_after[p.touched], state_ref[p.touched]),
        "all_written": bool(torch.isfinite(out).all()),
        "padding_rows_zero": bool(out[p.num_real:].eq(0).all()),
        "other_slots_untouched": bool(torch.equal(state_after[untouched], state_before[untouched])),
    }
    tol = OUT_TOL[p.out.dtype]
    state_tol = STATE_TOLS[str(state_after.dtype).removeprefix("torch.")]
    r["ok"] = (r["out_rel_err"] <= tol and r["state_rel_err"] <= state_tol and r["all_written"]
               and r["padding_rows_zero"] and r["other_slots_untouched"])
    return r


# ---------------------------------------------------------------------------------------------
# bytes, floors, timing
# ---------------------------------------------------------------------------------------------


def bytes_and_flops(case: Case, B: int, num_real: int, in_bytes: int) -> tuple[int, int]:
    """Fewest bytes a decode launch must move (each once) and its float operations."""
    if case.op == "short_conv":
        C, K = case.channels, case.width
        state = 2 * num_real * C * (K - 1) * 4
        io = num_real * C * in_bytes + B * C * in_bytes + C * (K + 1) * in_bytes  # x, out, weight+bias
        return state + io + B * 8, num_real * C * (2 * K + 4)
    hk, hv, dk, dv = case.hk, case.hv, case.dk, case.dv
    state = 2 * num_real * hv * dk * dv * dtype_from_name(STATE_DTYPE).itemsize  # read + write
    g = hv * dk if case.op == "kda_core" else (hv if case.op == "gdn_core" else 0)
    beta = hv if case.op != "lightning_core" else 0
    per_row = (2 * hk * dk + hv * dv + g + beta) * in_bytes
    out = B * hv * dv * in_bytes
    # per state element: two reductions (2 FMA), decay, update FMA: 7 flops (Lightning: 5)
    flops = num_real * hv * dk * dv * (7 if case.op != "lightning_core" else 5)
    return state + num_real * per_row + out + B * 8, flops




def time_calls(calls: list, min_calls: int = 32, replays: int = 15) -> dict:
    """Median time per call of `calls` run in turn inside one CUDA graph (launch gaps included).

    The calls touch different buffers; graph replays keep launch overhead at what a captured
    decode step pays. On the CPU (dry run) it only times the interpreter, once.
    """
    if not is_cuda():
        t0 = time.perf_counter()
        for c in calls:
            c()
        return {"us": (time.perf_counter() - t0) / len(calls) * 1e6, "method": "cpu-wall (interpreter)"}
    for c in calls:  # compile, autotune and allocate outside the capture
        c()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    reps = max(1, math.ceil(min_calls / len(calls)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for c in calls:
                c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    n = reps * len(calls)
    del graph
    return {"us": statistics.median(times) / n, "spread_us": (max(times) - min(times)) / n, "calls_per_replay": n,
            "method": "cuda-graph"}


def do_bench_us(fn) -> float | None:
    """triton.testing.do_bench median (it flushes the L2 before every call), or None on the CPU."""
    if not is_cuda():
        return None
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3



def sets_for(touched_bytes: int, l2_bytes: int, cap: int = 32) -> int:
    """Independent problem copies so that one rotation over them is 4x the L2."""
    return max(1, min(cap, math.ceil(4 * l2_bytes / max(touched_bytes, 1))))


class Budget:
    def __init__(self, seconds: float):
        self.deadline = START + seconds

    def left(self) -> float:
        return self.deadline - time.time()


# ---------------------------------------------------------------------------------------------
# part 1: our kernels
# ---------------------------------------------------------------------------------------------


def timing_sets(case: Case, B: int, p: Problem, device, env: dict) -> list[Problem]:
    """p and more independent problems: one rotation over them is 4x the L2 (states come from HBM)."""
    nbytes, _ = bytes_and_flops(case, B, p.num_real, 2)
    n_sets = sets_for(nbytes, env["l2_bytes"]) if is_cuda() else 1
    return [p] + [make_problem(case, B, p.out.dtype, device, seed=5000 + 17 * i + B) for i in range(n_sets - 1)]


def calls_for(case: Case, sets: list[Problem], config) -> list:
    kw = {"recurrent_config": config} if case.recurrent else {"conv_config": config}
    backends = [TritonLinearBackend(s.pool, **kw) for s in sets]
    return [(lambda b=b, s=s: call_op(b, s)) for b, s in zip(backends, sets)]


def run_case(case: Case, B: int, device, env: dict, log) -> dict:
    """Checks (two steps, default tiles; float32 inputs at batch 8) and the default tiles' timing."""
    dtype = torch.bfloat16
    res: dict = {"kernel": case.name, "op": case.op, "batch": B}
    p = make_problem(case, B, dtype, device, seed=1000 + B)
    res["real_rows"] = p.num_real
    nbytes, flops = bytes_and_flops(case, B, p.num_real, 2)
    res["bytes"], res["flops"] = nbytes, flops
    res["floor_us"] = nbytes / env["copy_bytes_per_s"] * 1e6

    # (a) correctness: two consecutive steps through the backend with its default tiles
    backend = TritonLinearBackend(p.pool)
    steps, before = [], p.state.cpu()
    gen = torch.Generator().manual_seed(2000 + B)
    x_cpu = {n: t.cpu() for n, t in p.x.items()}
    for step in range(2):
        if step:
            x_cpu = make_inputs(case, B, p.num_real, dtype, gen)
            for n, t in x_cpu.items():
                p.x[n].copy_(t)
        out_ref, state_ref = reference_step(p, before, x_cpu)
        p.out.fill_(float("nan"))
        call_op(backend, p)
        after = p.state.cpu()
        steps.append(check_against(p, p.out, after, before, out_ref, state_ref))
        before = after
    res["checks"] = steps
    res["ok"] = all(s["ok"] for s in steps)
    res["out_rel_err"] = max(s["out_rel_err"] for s in steps)
    res["state_rel_err"] = max(s["state_rel_err"] for s in steps)
    cfg = (TL.recurrent_config(B, case.hv, case.dk, case.dv, p.state.device) if case.recurrent
           else TL.conv_config(case.channels))
    res["default_config"] = dataclasses.asdict(cfg)

    # float32 inputs at batch 8 (tolerance 1e-4)
    if B == 8 or (not is_cuda() and B == min(env["batches"])):
        pf = make_problem(case, B, torch.float32, device, seed=3000 + B)
        before = pf.state.cpu()
        out_ref, state_ref = reference_step(pf, before, {n: t.cpu() for n, t in pf.x.items()})
        call_op(TritonLinearBackend(pf.pool), pf)
        res["float32_check"] = check_against(pf, pf.out, pf.state, before, out_ref, state_ref)
        res["ok"] = res["ok"] and res["float32_check"]["ok"]
        del pf

    # (b) timing of the default tiles
    sets = timing_sets(case, B, p, device, env)
    res["timing_sets"] = len(sets)
    t = time_calls(calls_for(case, sets, None))
    res["time_us"], res["timing"] = t["us"], t
    res["ratio_to_floor"] = t["us"] / res["floor_us"]
    res["do_bench_us"] = do_bench_us(calls_for(case, [p], None)[0])
    log(f"  {case.name:14s} B={B:<4d} check {'ok ' if res['ok'] else 'FAIL'} out {res['out_rel_err']:.1e} "
        f"state {res['state_rel_err']:.1e} cfg {tuple(res['default_config'].values())} "
        f"{t['us']:9.2f} us  floor {res['floor_us']:8.2f} us")
    del sets, p
    if is_cuda():
        torch.cuda.empty_cache()
    return res


def run_sweep(case: Case, B: int, device, env: dict, budget: Budget, log) -> dict:
    """Tile shapes around the default, each checked against the reference on the first step, then timed."""
    p = make_problem(case, B, torch.bfloat16, device, seed=1000 + B)  # the same data as run_case
    initial = p.state.clone()
    x0 = {n: t.clone() for n, t in p.x.items()}
    out_ref, state_ref = reference_step(p, initial.cpu(), {n: t.cpu() for n, t in p.x.items()})
    sets = timing_sets(case, B, p, device, env)
    space = (RECURRENT_SWEEP if SWEEP == "tiles" else WALK_SWEEP) if case.recurrent else CONV_SWEEP
    points = []
    for a, w, *walk in space:
        if budget.left() < env["reserve_s"]:
            points.append({"skipped": "time budget"})
            break
        if case.recurrent:
            if a > triton.next_power_of_2(case.dv) or triton.next_power_of_2(case.dk) * a < 32 * w:
                continue
            config = TL.RecurrentConfig(a, w, *walk)
        else:
            if a < 32 * w or a > 2 * triton.next_power_of_2(case.channels):
                continue
            config = TL.ConvConfig(a, w)
        point = {"config": dataclasses.asdict(config)}
        try:
            p.state.copy_(initial)
            for n, t in x0.items():
                p.x[n].copy_(t)
            p.out.fill_(float("nan"))
            calls_for(case, [p], config)[0]()
            point["check"] = check_against(p, p.out, p.state, initial.cpu(), out_ref, state_ref)
            if point["check"]["ok"]:
                point["us"] = time_calls(calls_for(case, sets, config), replays=7)["us"]
        except Exception as e:  # a config the compiler refuses must not end the run
            point["error"] = f"{type(e).__name__}: {e}"[:500]
        points.append(point)
    res: dict = {"sweep": points}
    timed = [q for q in points if "us" in q]
    if timed:
        best = min(timed, key=lambda q: q["us"])
        res["best_us"], res["best_config"] = best["us"], best["config"]
        log(f"  sweep {case.name:14s} B={B:<4d} best {tuple(best['config'].values())} {best['us']:9.2f} us "
            f"({len(timed)} points)")
    del sets, p, initial
    if is_cuda():
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# part 2 (subprocess): FLA's recurrent kernels on the same problems
# ---------------------------------------------------------------------------------------------




def fla_part(cases: list[Case], batches: list[int], device, env: dict, log, save) -> dict:
    res: dict = {"available": False}
    note = ensure_einops()
    if note:
        res["note"] = note
    try:
        import fla
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        res["version"] = getattr(fla, "__version__", "?")
    except Exception as e:
        res["error"] = f"fla not importable: {type(e).__name__}: {e}"
        return res
    fns = {"gdn_core": fused_recurrent_gated_delta_rule}
    try:
        from fla.ops.kda import fused_recurrent_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        fns["kda_core"] = (fused_recurrent_kda, fused_recurrent_kda_fwd)
    except Exception as e:
        res["kda_error"] = f"{type(e).__name__}: {e}"
    try:
        from fla.ops.simple_gla import fused_recurrent_simple_gla
        fns["lightning_core"] = fused_recurrent_simple_gla
    except Exception as e:
        res["simple_gla_error"] = f"{type(e).__name__}: {e}"
    res["available"] = True
    res["results"] = []

    def variants(p: Problem) -> dict:
        """name -> (full call as a user runs it over the pool, kernel-only call)."""
        c, x, st = p.case, p.x, p.state
        idx = torch.tensor(p.slots, dtype=torch.int64, device=st.device)
        scale = c.dk ** -0.5
        q4, k4, v4 = x["q"].unsqueeze(1), x["k"].unsqueeze(1), x["v"].unsqueeze(1)  # [B, T=1, H, D]
        h0 = st.index_select(0, idx)  # for the kernel-only timing
        if c.op == "gdn_core":
            fr = fns["gdn_core"]
            g3, b3 = x["g"].unsqueeze(1), x["beta"].unsqueeze(1)

            def full():
                o, ht = fr(q4, k4, v4, g=g3, beta=b3, scale=scale, initial_state=st.index_select(0, idx),
                           output_final_state=True)
                st.index_copy_(0, idx, ht)
                p.out.copy_(o.squeeze(1))
            return {"gather+fused_recurrent+scatter": (
                full, lambda: fr(q4, k4, v4, g=g3, beta=b3, scale=scale, initial_state=h0, output_final_state=True))}
        if c.op == "kda_core" and "kda_core" in fns:
            public, fwd = fns["kda_core"]
            g4, b3 = x["g"].unsqueeze(1), x["beta"].unsqueeze(1)
            out4 = p.out.view(p.out.shape[0], 1, *p.out.shape[1:])

            def inplace():
                fwd(q=q4, k=k4, v=v4, g=g4, beta=b3, scale=scale, initial_state=st, inplace_final_state=True,
                    ssm_state_indices=idx, out=out4)

            def gathered():
                o, ht = public(q4, k4, v4, g4, b3, scale=scale, initial_state=st.index_select(0, idx),
                               output_final_state=True)
                st.index_copy_(0, idx, ht)
                p.out.copy_(o.squeeze(1))
            return {"in-place ssm_state_indices": (inplace, inplace),
                    "gather+fused_recurrent_kda+scatter": (
                        gathered, lambda: public(q4, k4, v4, g4, b3, scale=scale, initial_state=h0,
                                                 output_final_state=True))}
        if c.op == "lightning_core" and "lightning_core" in fns:
            fr = fns["lightning_core"]
            decay = p.consts["decay"]

            def full():
                o, ht = fr(q4, k4, v4, g_gamma=decay, scale=scale, initial_state=st.index_select(0, idx),
                           output_final_state=True)
                st.index_copy_(0, idx, ht)
                p.out.copy_(o.squeeze(1))
            return {"gather+fused_recurrent_simple_gla+scatter": (
                full, lambda: fr(q4, k4, v4, g_gamma=decay, scale=scale, initial_state=h0, output_final_state=True))}
        return {}

    for case in cases:
        if not case.recurrent:
            continue
        for B in batches:
            p = make_problem(case, B, torch.bfloat16, device, seed=1000 + B)
            initial = p.state.clone()
            out_ref, state_ref = reference_step(p, initial.cpu(), {n: t.cpu() for n, t in p.x.items()})
            nbytes, _ = bytes_and_flops(case, B, p.num_real, 2)
            n_sets = sets_for(nbytes, env["l2_bytes"]) if is_cuda() else 1
            sets = [p] + [make_problem(case, B, torch.bfloat16, device, seed=5000 + 17 * i + B)
                          for i in range(n_sets - 1)]
            for name in variants(p):
                r = {"kernel": case.name, "batch": B, "path": name}
                try:
                    p.state.copy_(initial)
                    p.out.fill_(float("nan"))
                    full, _ = variants(p)[name]
                    with torch.no_grad():
                        full()
                    after = p.state.cpu()
                    chk = check_against(p, p.out, after, initial.cpu(), out_ref, state_ref)
                    # FLA has no notion of a padding slot: it gathers and scatters slot 0 too.
                    chk["padding_slot_written"] = not torch.equal(after[PADDING_SLOT], initial[PADDING_SLOT].cpu())
                    r["check"] = chk
                    with torch.no_grad():
                        r["time_us"] = time_calls([variants(s)[name][0] for s in sets])["us"]
                        r["kernel_only_us"] = time_calls([variants(s)[name][1] for s in sets])["us"]
                        r["do_bench_us"] = do_bench_us(variants(p)[name][0])
                except Exception as e:
                    r["error"] = f"{type(e).__name__}: {e}"
                    r["traceback"] = traceback.format_exc()[-2000:]
                log(f"  fla {case.name:14s} B={B:<4d} {name:42s} "
                    + (f"{r['time_us']:9.1f} us  out err {r['check']['out_rel_err']:.1e}" if "time_us" in r
                       else r.get("error", "?")[:100]))
                res["results"].append(r)
                save(res)  # a crash further on keeps what is done
            del sets, p
            if is_cuda():
                torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# part 3 (subprocess): FLA chunk vs fused_recurrent GDN over a long sequence
# ---------------------------------------------------------------------------------------------


CHUNK_VARIANTS = {
    # name: (normalise q, normalise k, use_qk_l2norm_in_kernel, float32 gates, call fused_recurrent positionally)
    "as_reported_raw_qk": (False, False, False, False, False),
    "q_raw_k_normalised": (False, True, False, False, False),  # FLA's own docstring example
    "q_and_k_normalised": (True, True, False, False, False),
    "raw_qk_with_l2norm_in_kernel": (False, False, True, True, False),  # the reported crash
    # fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, ...): a call written like
    # chunk's (q, k, v, g, beta) hands beta over as gk, a per-channel decay four dims wide.
    "recurrent_called_positionally": (False, True, False, False, True),
}


def fla_chunk_part(device, dry: bool, variants: list[str], log, save) -> dict:
    """FLA chunk vs fused_recurrent GDN over one long sequence, each against the reference."""
    res: dict = {}
    ensure_einops()
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:
        return {"error": f"fla not importable: {type(e).__name__}: {e}"}
    T, Hk, Hv, D = (64, 2, 4, 16) if dry else (1024, 16, 32, 128)
    res["dims"] = {"T": T, "Hk": Hk, "Hv": Hv, "D": D, "dtype": "bfloat16", "initial_state": "zeros",
                   "gates": "g = logsigmoid(rand), beta = sigmoid(rand) (FLA's docstring example)"}
    for name in variants:
        norm_q, norm_k, in_kernel, f32_gates, positional = CHUNK_VARIANTS[name]
        gen = torch.Generator().manual_seed(7)
        q, k = torch.randn(1, T, Hk, D, generator=gen), torch.randn(1, T, Hk, D, generator=gen)
        v = torch.randn(1, T, Hv, D, generator=gen)
        g = F.logsigmoid(torch.rand(1, T, Hv, generator=gen))
        beta = torch.rand(1, T, Hv, generator=gen).sigmoid()
        q = F.normalize(q, dim=-1) if norm_q else q
        k = F.normalize(k, dim=-1) if norm_k else k
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        g, beta = (t.to(torch.float32 if f32_gates else torch.bfloat16) for t in (g, beta))
        # the reference sees exactly what the kernels see (after their own l2norm when asked)
        qr, kr = q.float(), k.float()
        if in_kernel:
            qr = qr / torch.sqrt((qr * qr).sum(-1, keepdim=True) + 1e-6)
            kr = kr / torch.sqrt((kr * kr).sum(-1, keepdim=True) + 1e-6)
        rep = Hv // Hk
        S = torch.zeros(Hv, D, D)
        o_ref = gated_recurrence(qr[0].repeat_interleave(rep, 1), kr[0].repeat_interleave(rep, 1), v[0],
                                 g[0].float().unsqueeze(-1), beta[0], S, D ** -0.5)
        r = {"ref_out_norm": float(o_ref.double().norm()), "ref_finite": bool(torch.isfinite(o_ref).all()),
             "setup": dict(zip(("norm_q", "norm_k", "l2norm_in_kernel", "float32_gates", "positional"),
                               CHUNK_VARIANTS[name]))}
        qd, kd, vd, gd, bd = (t.to(device) for t in (q, k, v, g, beta))
        calls = {
            "chunk": lambda: chunk_gated_delta_rule(qd, kd, vd, g=gd, beta=bd, scale=D ** -0.5,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=in_kernel),
            "fused_recurrent": (
                (lambda: fused_recurrent_gated_delta_rule(qd, kd, vd, gd, bd, scale=D ** -0.5,
                                                          output_final_state=True)) if positional else
                (lambda: fused_recurrent_gated_delta_rule(qd, kd, vd, g=gd, beta=bd, scale=D ** -0.5,
                                                          output_final_state=True,
                                                          use_qk_l2norm_in_kernel=in_kernel))),
        }
        outs = {}
        for fname, fn in calls.items():
            try:
                with torch.no_grad():
                    o, ht = fn()
                if is_cuda():
                    torch.cuda.synchronize()
                outs[fname] = (o[0].float().cpu(), ht[0].float().cpu())
                r[f"{fname}_out_rel_err"] = rel_err(outs[fname][0], o_ref)
                r[f"{fname}_state_rel_err"] = rel_err(outs[fname][1], S)
                r[f"{fname}_finite"] = bool(torch.isfinite(outs[fname][0]).all())
            except Exception as e:
                r[f"{fname}_error"] = f"{type(e).__name__}: {e}"[:500]
        if len(outs) == 2:
            r["chunk_vs_recurrent_rel"] = rel_err(outs["chunk"][0], outs["fused_recurrent"][0])
        res[name] = r
        save(res)  # a crash in the next variant keeps this one
        log(f"  chunk-vs-recurrent {name}: " + ", ".join(
            f"{k_}={v_:.3g}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in r.items() if k_ != "setup"))
    return res


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------




def run_subprocess(args, part: str, extra: list[str], timeout: float, log_file, log) -> dict:
    """Run a part of this script in its own process; a crash or hang there stays there."""
    if timeout < 20:
        return {"error": f"skipped: only {timeout:.0f} s of the time budget left"}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "part.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--result", str(result),
               "--batches", ",".join(map(str, args.batch_list)), "--copy-bytes-per-s", str(args.copy_bytes_per_s),
               "--state-dtype", args.state_dtype] + (["--cases", args.cases] if args.cases else [])
        cmd += (["--dry-run"] if args.dry_run else []) + extra
        log(f"[{time.time() - START:6.0f}s] subprocess {part} {' '.join(extra)} (timeout {timeout:.0f} s)")
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                  cwd=str(ROOT))
            output, rc = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as e:
            output, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
        log_file.write(f"==== {part} {' '.join(extra)} rc={rc} ({time.time() - t0:.0f} s)\n{output}\n")
        log_file.flush()
        for line in output.splitlines():
            if line.startswith("  "):
                log(line)
        try:
            data = json.loads(result.read_text()) if result.exists() else {}
        except ValueError:  # killed while writing
            data = {}
        if rc != 0:
            data.setdefault("error", f"subprocess rc={rc}; tail: {output[-800:]}")
        return data






def summary_table(results: dict) -> str:
    env = results["env"]
    lines = [f"device: {env.get('device')}  torch {env['torch']}  triton {env['triton']}  "
             f"copy {env['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write)  fla: "
             f"{results.get('fla', {}).get('version', 'n/a')}"]
    fla_best: dict = {}  # (kernel, batch) -> the fastest FLA path, preferring paths that matched the reference
    for r in results.get("fla", {}).get("results", []):
        if "time_us" in r:
            r["matched"] = r["check"]["out_rel_err"] <= 1e-2 and r["check"]["state_rel_err"] <= STATE_TOL
            key, cur = (r["kernel"], r["batch"]), fla_best.get((r["kernel"], r["batch"]))
            if cur is None or (r["matched"], -r["time_us"]) > (cur["matched"], -cur["time_us"]):
                fla_best[key] = r
    head = (f"{'kernel':14s} {'B':>4s} {'real':>4s} {'time us':>8s} {'floor us':>8s} {'x floor':>7s} "
            f"{'best us':>8s} {'best cfg':>9s} {'FLA us':>8s} {'FLA/ours':>8s} {'err out':>8s} {'err st':>8s} ok")
    lines += [head, "-" * len(head)]
    for r in results["kernels"]:
        if "error" in r:
            lines.append(f"{r['kernel']:14s} {r['batch']:4d} ERROR {r['error'][:90]}")
            continue
        f = fla_best.get((r["kernel"], r["batch"]))
        best_cfg = "/".join(str(v) for v in r["best_config"].values()) if r.get("best_config") else "-"
        lines.append(
            f"{r['kernel']:14s} {r['batch']:4d} {r['real_rows']:4d} {r['time_us']:8.1f} {r['floor_us']:8.1f} "
            f"{r['ratio_to_floor']:7.2f} {fmt(r.get('best_us')):>8s} {best_cfg:>9s} "
            f"{fmt(f['time_us'] if f else None) + ('' if not f or f['matched'] else '!'):>8s} "
            f"{fmt(f['time_us'] / r['time_us'] if f else None, '.2f'):>8s} "
            f"{r['out_rel_err']:8.1e} {r['state_rel_err']:8.1e} {'ok' if r['ok'] else 'FAIL'}")
    lines.append("FLA us: the fastest FLA path that matched the reference ('!': none matched) as a user runs it over "
                 "a slot pool (KDA: in-place ssm_state_indices or gather; others: gather states by slot + "
                 "fused_recurrent + scatter back). best cfg: BV/warps (conv: channels/warps).")
    paths: dict = {}
    for r in results.get("fla", {}).get("results", []):
        paths.setdefault((r["kernel"], r["path"]), []).append(r)
    for (kernel, path), rows in paths.items():
        ok = [r for r in rows if "check" in r]
        errs = (f"out err <= {max(r['check']['out_rel_err'] for r in ok):.1e}, state err <= "
                f"{max(r['check']['state_rel_err'] for r in ok):.1e}") if ok else "no result"
        times = " ".join(f"{r['batch']}:{fmt(r.get('time_us'))}/{fmt(r.get('kernel_only_us'))}" for r in rows)
        bad = [r["batch"] for r in rows if "error" in r]
        lines.append(f"FLA {kernel:14s} {path:42s} {errs}; B:us/kernel-only us {times}"
                     + (f"; errors at B={bad}" if bad else ""))
    # targets from the issue
    for kernel in sorted({r["kernel"] for r in results["kernels"] if "error" not in r}):
        rows = [r for r in results["kernels"] if r["kernel"] == kernel and "error" not in r]
        small = [r for r in rows if r["batch"] <= 64]
        worst = max(small, key=lambda r: r["ratio_to_floor"]) if small else None
        t1 = ("n/a" if worst is None else ("PASS" if worst["ratio_to_floor"] <= 2.0 else "FAIL")
              + f" (worst {worst['ratio_to_floor']:.2f}x at B={worst['batch']})")
        ups = [(fla_best[(kernel, r["batch"])]["time_us"] / r["time_us"], r["batch"]) for r in rows
               if (kernel, r["batch"]) in fla_best]
        t2 = "n/a" if not ups else (("PASS" if min(ups)[0] > 1.0 else "FAIL")
                                    + f" (min {min(ups)[0]:.2f}x at B={min(ups)[1]})")
        ok = "all checks ok" if all(r["ok"] for r in rows) else "CHECK FAILURES"
        lines.append(f"target {kernel:14s} <=2x floor at B<=64: {t1:32s} faster than FLA: {t2:28s} {ok}")
    for part in ("fla_chunk", "fla_chunk_l2norm"):
        ch = results.get(part, {})
        for name, r in ch.items():
            if not isinstance(r, dict) or name == "dims":
                continue
            errs = {k: r[k][:120] for k in ("chunk_error", "fused_recurrent_error") if k in r}
            lines.append(f"FLA GDN T={ch.get('dims', {}).get('T')} {name:30s} rel err vs ref: chunk "
                         f"{fmt(r.get('chunk_out_rel_err'), '.2e')}  fused_recurrent "
                         f"{fmt(r.get('fused_recurrent_out_rel_err'), '.2e')}  chunk vs recurrent "
                         f"{fmt(r.get('chunk_vs_recurrent_rel'), '.2e')}  ref finite {r.get('ref_finite')}"
                         + (f"  {errs}" if errs else ""))
        if "error" in ch:
            lines.append(f"{part}: {ch['error'][:200]}")
    if "error" in results.get("fla", {}):
        lines.append(f"FLA: {results['fla']['error'][:200]}")
    pt = results.get("pytest", {})
    lines.append(f"pytest -m gpu tests/gpu/test_gpu_linear_kernels.py: {pt.get('summary') or pt.get('error', 'n/a')}")
    lines.append(f"total {time.time() - START:.0f} s")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_linear_decode_out"), help="folder for the JSON results")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny dims")
    ap.add_argument("--batches", default=None, help="comma list (default 1,8,32,64,256; dry run 1,3,8)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--state-dtype", default="float32", choices=STATE_DTYPES,
                    help="what the recurrent states are kept in (hgc compile --state-dtype); the FLA parts "
                         "run over the same")
    ap.add_argument("--cases", default=None, help="comma list of kernel names (default: all: gdn, kda, "
                                                   "lightning_h16, lightning_h32, short_conv)")
    ap.add_argument("--sweep", default="tiles", choices=("tiles", "walk"),
                    help="the recurrent kernels' sweep: one program a tile at each width and warps (tiles), or "
                         "tiles walked by a few programs an SM, the one-tile default first (walk)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-pytest", action="store_true")
    ap.add_argument("--budget-s", type=float, default=520.0,
                    help="time budget after imports (the device allows 600 s a command, wheel install included)")
    # internal: one part run in a subprocess
    ap.add_argument("--part", default="main", choices=["main", "fla", "fla-chunk"])
    ap.add_argument("--result", default=None)
    ap.add_argument("--variants", default="as_reported_raw_qk,q_raw_k_normalised,q_and_k_normalised")
    ap.add_argument("--copy-bytes-per-s", type=float, default=None)
    args = ap.parse_args(argv)
    args.batch_list = [int(b) for b in args.batches.split(",")] if args.batches else (
        [1, 3, 8] if args.dry_run else [1, 8, 32, 64, 256])
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    device = "cuda" if not dry else "cpu"
    cases = DRY_CASES if dry else REAL_CASES
    if args.cases:
        cases = [c for c in cases if c.name in args.cases.split(",")]
    global STATE_DTYPE, SWEEP
    STATE_DTYPE, SWEEP = args.state_dtype, args.sweep
    log = lambda msg: print(msg, flush=True)

    if args.part != "main":  # a subprocess: one part, its JSON to --result
        env = device_facts(dry)
        env["copy_bytes_per_s"] = args.copy_bytes_per_s or device_rates()["copy_bytes_per_s"]
        def save(data):  # whole files only: the parent may read it after a crash
            tmp = Path(args.result).with_suffix(".tmp")
            tmp.write_text(json.dumps(data, indent=1, default=str))
            tmp.replace(args.result)
        try:
            if args.part == "fla":
                data = fla_part(cases, args.batch_list, device, env, log, save)
            else:
                data = fla_chunk_part(device, dry, args.variants.split(","), log, save)
        except Exception as e:
            data = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        save(data)
        return 0

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    env = device_facts(dry)
    rates = device_rates()
    env["copy_bytes_per_s"], env["copy"] = rates["copy_bytes_per_s"], rates
    env["batches"], env["state_dtype"] = args.batch_list, args.state_dtype
    args.copy_bytes_per_s = rates["copy_bytes_per_s"]
    log(f"{env['device']}: copy {rates['copy_bytes_per_s'] / 1e12:.3f} TB/s; batches {args.batch_list}")
    results: dict = {"env": env, "kernels": []}
    json_path = out_dir / "gpu_linear_decode.json"

    def save():
        json_path.write_text(json.dumps(results, indent=1, default=str))

    # 1. checks and the default tiles' timing of every kernel and batch
    for case in cases:
        for B in args.batch_list:
            try:
                results["kernels"].append(run_case(case, B, device, env, log))
            except Exception as e:
                results["kernels"].append({"kernel": case.name, "batch": B, "error": f"{type(e).__name__}: {e}",
                                           "traceback": traceback.format_exc()[-3000:]})
                log(f"  {case.name} B={B}: ERROR {type(e).__name__}: {e}")
            save()

    with open(out_dir / "gpu_linear_decode_subprocess.log", "w") as lf:
        # 2. FLA on the same problems, then its chunk vs recurrent study (subprocesses)
        if not args.no_fla:
            results["fla"] = run_subprocess(args, "fla", [], min(240, budget.left() - 200), lf, log)
            save()
            results["fla_chunk"] = run_subprocess(args, "fla-chunk", [], min(150, budget.left() - 170), lf, log)
            save()
        # 3. the tile sweep, with what time is left (reserve: pytest and the crash check)
        if not args.no_sweep:
            log(f"[{time.time() - START:6.0f}s] tile sweep")
            env["reserve_s"] = 0 if dry or args.no_pytest else 150  # kept for the GPU tests
            # the hard small batches first, in case the budget ends the sweep early
            order = {b: i for i, b in enumerate([1, 8, 64, 256, 32])}
            for r in sorted(results["kernels"], key=lambda r: order.get(r["batch"], 9)):
                if "error" in r or budget.left() < env["reserve_s"]:
                    continue
                case = next(c for c in cases if c.name == r["kernel"])
                try:
                    r.update(run_sweep(case, r["batch"], device, env, budget, log))
                except Exception as e:
                    r["sweep_error"] = f"{type(e).__name__}: {e}"
                save()
        # 4. the GPU tests, 5. the reported crash, alone and last
        if not args.no_pytest:
            results["pytest"] = run_gpu_pytest("tests/gpu/test_gpu_linear_kernels.py", min(150, budget.left() - 60),
                                                out_dir / "pytest.log")
            save()
        if not args.no_fla:
            results["fla_chunk_l2norm"] = run_subprocess(
                args, "fla-chunk", ["--variants", "raw_qk_with_l2norm_in_kernel,recurrent_called_positionally"],
                min(90, budget.left() - 5), lf, log)
            save()
    table = summary_table(results)
    results["table"] = table
    save()
    print("\n" + table, flush=True)
    print(f"\nresults: {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
