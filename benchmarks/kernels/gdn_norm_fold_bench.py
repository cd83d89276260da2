"""A fused GDN mixer's gated norm in the chunk output kernel against its own launch after the
chunk kernels: one command, checks first, JSON to --out.

    python3 benchmarks/kernels/gdn_norm_fold_bench.py --out $OUT              # GPU
    python3 benchmarks/kernels/gdn_norm_fold_bench.py --dry-run --out /tmp/f    # CPU: interpreter, tiny dims

An extend step of a fused GDN layer on our chunk kernels ends in the core's outputs and then
`gated_rmsnorm` (runtime/backends/kernels/gdn_fused.py), which reads them back with z and writes
the layer's output. With triton_linear's extend_norm=in_output the chunk output kernel applies the
norm as it stores each row (`chunk_extend(gated_norm=...)`, kernels/chunk.py `GatedNorm`): a launch
a layer fewer and the core's write and read gone, its programs a head's whole Dv row wide
instead of the default tile's half of bench's 128 columns. This times both at the bench dims
(Hk 16, Hv 32, Dk = Dv = 128, bf16) for one request of each of --tokens rows and for 4 x 1024.

First the check, on one launch of requests of 0, 1, 100, 64, 300 and 1000 rows from random states
(chunk_kernel_sweep.py's): both ways' outputs against the CPU reference (cpu_reference's
recurrence in float32, the core rounded to bf16, then the mixer's gated_rms_norm) by
||x - ref|| / ||ref|| (bound 2e-2: the chunk kernels' 1e-2 and the norm's roundings), and against
each other (1e-2). A failed check skips the timing. Then
per shape: us a call inside a CUDA graph of --calls calls (median over --replays replays) of the
three chunk kernels and the norm's launch against the three with the norm folded, and the
profiler's time per kernel. The dry run walks the same code on the CPU at tiny dims; its times mean
nothing.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))  # chunk_kernel_sweep, gpu_linear_extend

import torch  # noqa: E402

from bench_common import device_facts, device_ms_by_kernel, graph_call_us, is_cuda, rel_err  # noqa: E402
from chunk_kernel_sweep import check_case, launch_case  # noqa: E402
from compiler.splitops.gdn_mixer import gated_rms_norm  # noqa: E402
from gpu_linear_extend import DRY, REAL  # noqa: E402
from runtime.backends.kernels import chunk as TC  # noqa: E402
from runtime.backends.kernels.gdn_fused import gated_rmsnorm  # noqa: E402
from runtime.backends.kernels.linear import GATE_PER_HEAD  # noqa: E402

EPS = 1e-6
# against the reference: the chunk kernels' bf16 bound (chunk_kernel_sweep.py's 1e-2) and two
# roundings more (the norm, its product with the weight); between the two ways: the order of a row's sums
TOL, SAME_TOL = 2e-2, 1e-2


def norm_inputs(T: int, hv: int, dv: int, device, seed: int) -> TC.GatedNorm:
    """z as a strided view (the mixer's projection hands it so) and a weight near one."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, hv, dv + 64, generator=g).bfloat16()[..., :dv]
    weight = (1 + 0.1 * torch.randn(dv, generator=g)).bfloat16()
    return TC.GatedNorm(z.to(device), weight.to(device), EPS)


def step(spec, x: dict, state, tables: dict, out, core, gated: TC.GatedNorm, fold: bool, bounds) -> None:
    """One layer's core and norm, folded (into `out` directly) or apart (core, then the norm's launch)."""
    dk = spec[4]
    TC.chunk_extend(x["q"], x["k"], x["v"], x["g"], x["beta"], out if fold else core, state, tables["slots"],
                    tables["bounds"], tables["chunks"], dk ** -0.5, GATE_PER_HEAD,
                    gated_norm=gated if fold else None)
    if not fold:
        gated_rmsnorm(core, gated.z, gated.weight, out, gated.eps, bounds=bounds)


def padded_bounds(tables: dict, T: int) -> torch.Tensor:
    """The request bounds, then the step's rows: gated_rmsnorm's `bounds` (real rows end at the second-to-last)."""
    b = tables["bounds"]
    return torch.cat([b, b.new_tensor([T])])


def check(spec, device) -> dict:
    _, _, hk, hv, dk, dv = spec
    lens, x, states, slots, tables, ref_core, _ = check_case(spec, device)
    T = sum(lens)
    gated = norm_inputs(T, hv, dv, device, seed=11)
    want = gated_rms_norm(ref_core.bfloat16(), gated.z.cpu(), gated.weight.cpu(), EPS)
    x = {k: v.to(device) for k, v in x.items()}
    got = {}
    for fold in (True, False):
        out = torch.full((T, hv, dv), float("nan"), dtype=torch.bfloat16, device=device)
        core = torch.empty_like(out)
        step(spec, x, states.to(device, copy=True), tables, out, core, gated, fold, padded_bounds(tables, T))
        got["folded" if fold else "apart"] = out.float().cpu()
    errs = {name: rel_err(o, want) for name, o in got.items()}
    errs["folded_vs_apart"] = rel_err(got["folded"], got["apart"])
    errs["ok"] = (all(bool(torch.isfinite(o).all()) for o in got.values()) and max(errs["folded"], errs["apart"]) <= TOL
                  and errs["folded_vs_apart"] <= SAME_TOL)
    return errs


def time_shape(spec, T: int, R: int, device, calls: int, replays: int) -> dict:
    _, _, hk, hv, dk, dv = spec
    x, states, _, tables = launch_case(spec, [T // R] * R, device, seed=T + R)
    x = {k: v.to(device) for k, v in x.items()}
    state = states.to(device)
    gated = norm_inputs(T, hv, dv, device, seed=T)
    out = torch.empty(T, hv, dv, dtype=torch.bfloat16, device=device)
    core = torch.empty_like(out)
    bounds = padded_bounds(tables, T)
    row = {}
    for name, fold in (("apart", False), ("folded", True)):
        fn = lambda fold=fold: step(spec, x, state, tables, out, core, gated, fold, bounds)  # noqa: E731
        us = graph_call_us(lambda i: fn(), calls, replays, device)
        kernels = device_ms_by_kernel(fn)
        row[name] = {"us": us, "kernels_us": {k: 1e3 * v for k, v in kernels.items()}}
        print(f"{R} x {T // R} tokens, norm {name}: {us:.1f} us"
              + "".join(f"; {k} {1e3 * v:.1f}" for k, v in kernels.items()), flush=True)
    row["folded_over_apart"] = row["folded"]["us"] / row["apart"]["us"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Writes OUT/gdn_norm_fold_bench.json and prints a line per shape and way.")
    p.add_argument("--out", type=Path, required=True, help="folder for gdn_norm_fold_bench.json")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[512, 2048, 4096],
                   help="one request of each of these many rows, comma-separated (default 512,2048,4096); "
                        "4 x 1024 is timed too")
    p.add_argument("--calls", type=int, default=10, help="calls in the timed CUDA graph (default 10)")
    p.add_argument("--replays", type=int, default=10, help="replays timed, median taken (default 10)")
    p.add_argument("--dry-run", action="store_true", help="the CPU interpreter at tiny dims (times mean nothing)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if is_cuda() else "cpu")
    if device.type != "cuda" and not args.dry_run:
        p.error("no CUDA device here: run with --dry-run on the CPU")
    spec = DRY["gdn"] if args.dry_run else REAL["gdn"]
    shapes = [(T, 1) for T in args.tokens] + [(4096, 4)]
    if args.dry_run:
        shapes = [(64, 1), (64, 4)]
    rec = {"env": device_facts(args.dry_run), "spec": list(spec[2:]), "check": check(spec, str(device)), "rows": {}}
    print(f"check: {rec['check']}", flush=True)
    if rec["check"]["ok"]:
        for T, R in shapes:
            rec["rows"][f"{R}x{T // R}"] = time_shape(spec, T, R, device, args.calls, args.replays)
    else:
        print("check failed: nothing timed", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gdn_norm_fold_bench.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0 if rec["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
