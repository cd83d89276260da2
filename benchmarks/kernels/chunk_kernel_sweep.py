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

    python benchmarks/kernels/chunk_kernel_sweep.py --out OUT   # on the GPU machine: every config, both families
    python benchmarks/kernels/chunk_kernel_sweep.py --out OUT --quick   # GDN, QUICK_CONFIGS, fewer reps: < 3 min
    python benchmarks/kernels/chunk_kernel_sweep.py --out OUT --dry-run   # CPU, interpreter, tiny dims

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
from runtime.backends.kernels.launch_math import token_blocks  # noqa: E402
from runtime.backends.protocol import plan_eager_step  # noqa: E402
from runtime.backends.kernels.linear import GATE_CONSTANT, GATE_PER_HEAD  # noqa: E402
from runtime.backends.triton_linear import TritonLinearBackend  # noqa: E402
from runtime.cache.state_pool import StatePool  # noqa: E402
from testkit.linear_cases import step_ctx  # noqa: E402

CHECK_LENS = [0, 1, 100, 64, 300, 1000]
CHECK_TOL = 1e-2
SHAPES = [(512, 1), (2048, 1), (4096, 1), (4096, 4), (4096, 16)]  # tokens x requests of equal length
DRY_SHAPES = [(64, 1), (64, 4)]
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


def config_for(R: int, H: int, D: int, device, override: dict) -> TC.ChunkConfig:
    return dataclasses.replace(TC.chunk_config(R, H, D, torch.device(device)), **override)


def launch_case(spec, lens: list[int], device, seed: int):
    """chunk_extend's arguments for requests of `lens` rows, random states in distinct slots."""
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
                  chunks=torch.from_numpy(token_blocks(np.array(lens), TC.CHUNK_T)).to(device))
    return x, states, slots, tables


def run(spec, x: dict, state: torch.Tensor, tables: dict, out: torch.Tensor, cfg: TC.ChunkConfig) -> None:
    op, _, hk, hv, dk, dv = spec
    TC.chunk_extend(x["q"], x["k"], x["v"], x["g"], x.get("beta"), out, state, tables["slots"], tables["bounds"],
                    tables["chunks"], dk ** -0.5, GATE_CONSTANT if op == "lightning_core" else GATE_PER_HEAD,
                    config=cfg)


@functools.lru_cache(maxsize=None)
def check_case(spec, device):
    """The check's launch (CHECK_LENS requests from random states) and its reference, once per family:
    (lens, inputs, states, slots, tables, reference outputs [rows, Hv, Dv], reference states)."""
    op, _, hk, hv, dk, dv = spec
    lens = [min(n, 40) for n in CHECK_LENS] if device == "cpu" else CHECK_LENS
    x, states, slots, tables = launch_case(spec, lens, device, seed=7)
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


def check(spec, device, override: dict) -> dict:
    """One launch of CHECK_LENS requests against the recurrence, per request."""
    op, _, hk, hv, dk, dv = spec
    lens, x, states, slots, tables, ref_out, ref_states = check_case(spec, device)
    dev_states = states.to(device, copy=True)  # the launch writes it; the cached case's stays as it was
    out = torch.zeros(sum(lens), hv, dv, dtype=torch.bfloat16, device=device)
    run(spec, {k: v.to(device) for k, v in x.items()}, dev_states, tables, out,
        config_for(len(lens), hv, dv, device, override))
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
        wanted = configs(args.dry_run)
        if chosen:
            unknown = set(chosen.split(",")) - set(wanted)
            if unknown:
                ap.error(f"--configs: unknown {sorted(unknown)}; known: {sorted(wanted)}")
            wanted = {name: wanted[name] for name in chosen.split(",")}
        for name, override in wanted.items():
            fam["checks"][name] = c = check(spec, device, override)
            print(f"{family} check {name}: out {c['out_rel_err']:.2e} state {c['state_rel_err']:.2e} "
                  f"{'ok' if c['ok'] else 'FAIL'}", flush=True)
            if c["ok"]:
                passing[name] = override
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")] if args.shapes \
            else DRY_SHAPES if args.dry_run else SHAPES
        for T, R in shapes:
            if time.time() - started > budget_s:
                fam["timings"].append({"tokens": T, "requests": R, "skipped": "budget"})
                continue
            row = {"tokens": T, "requests": R, "ours": {}}
            if not args.dry_run:
                row["fla"] = time_fla(spec, T, R, device, reps)
                print(f"{family} {T}x{R} FLA: wall {row['fla']['wall_ms']:.3f} kernels "
                      f"{row['fla']['kernel_ms']:.3f} ms", flush=True)
            for name, override in passing.items():
                row["ours"][name] = t = time_ours(spec, T, R, device, override, reps)
                parts = ", ".join(f"{k.split('_chunk_')[-1][:12]} {v:.3f}" for k, v in t["kernels"].items())
                print(f"{family} {T}x{R} {name}: wall {t['wall_ms']:.3f} ms"
                      + (f", kernels {t['kernel_ms']:.3f} ({parts})" if t["kernels"] else ""), flush=True)
            row["summary"] = best = summary(row)
            if best:
                print(f"{family} {T}x{R} best {best['best']}: {best['best_ms']:.3f} ms"
                      + (f", default {best['default_ms']:.3f}" if "default_ms" in best else "")
                      + (f", FLA {best['fla_ms']:.3f}" if "fla_ms" in best else ""), flush=True)
            fam["timings"].append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunk_kernel_sweep.json").write_text(json.dumps(result, indent=1))
    failed = [f"{f} {n}" for f, fam in result["families"].items() for n, c in fam["checks"].items() if not c["ok"]]
    if failed:
        print(f"checks failed: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
