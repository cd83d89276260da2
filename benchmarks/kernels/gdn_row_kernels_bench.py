"""The fused GDN op's two row kernels of an extend step, a program per row against a program per
block of rows: one command, checks first, JSON to --out.

    python3 benchmarks/kernels/gdn_row_kernels_bench.py --out $OUT              # GPU
    python3 benchmarks/kernels/gdn_row_kernels_bench.py --dry-run --out /tmp/r    # CPU: interpreter, tiny dims

An extend, mixed or verify step of a fused GDN layer runs, around the conv and the chunk kernels,
`qk_gates` (the l2norm of q and k and both gates, over every row) and `gated_rmsnorm` (the gated
RMSNorm of every row's value heads) from runtime/backends/kernels/gdn_fused.py. Both take
`block_rows`: the rows one program takes. This times each kernel at --block-rows (1: a program per
row and head, as the kernels were first written; gdn_fused.BLOCK_ROWS, the default) for steps of
--tokens rows, at the bench dims (testkit/gdn_cases.py BENCH_GDN: Hk 16, Hv 32, Dk = Dv = 128;
bf16), one request whose rows are all real.

For each row count, first the check: every block size's outputs against the mixer's torch ops
(compiler/splitops/gdn_mixer.py: l2norm, gated_rms_norm; the gates as the op computes them) by
||x - ref|| / ||ref|| in float32 (bf16: 1e-2); a failed check skips that count's timing. Then us a
call inside a CUDA graph of --calls calls (median over --replays replays), the bytes each kernel
must move and the rate that makes against the card's copy rate measured in the same run
(bench_common.device_rates). The dry run walks the same code on the CPU at tiny dims; its times
mean nothing.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_facts, device_rates, graph_call_us, is_cuda, rel_err  # noqa: E402
from compiler.splitops.gdn_mixer import gated_rms_norm, l2norm  # noqa: E402
from runtime.backends.kernels import gdn_fused as GF  # noqa: E402
from testkit.gdn_cases import BENCH_GDN, GdnShape  # noqa: E402

EPS = 1e-6
TOL = 1e-2  # bf16: a few roundings of the chain


def inputs(shape: GdnShape, T: int, dtype, device, seed: int = 0) -> dict:
    """One step's tensors: the conv's output, b and a, the layer's gate parameters, the core's output,
    z and the norm's weight; bounds mark all T rows real."""
    g = torch.Generator().manual_seed(seed)
    dims = GF.GdnDims(shape.hk, shape.hv, shape.dk, shape.dv, shape.channels, shape.kernel_width)
    t = dict(mixed=torch.randn(T, dims.channels, generator=g), b=torch.randn(T, shape.hv, generator=g),
             a=torch.randn(T, shape.hv, generator=g), core=torch.randn(T, shape.hv, shape.dv, generator=g),
             z=torch.randn(T, shape.hv, shape.dv, generator=g))
    t = {k: v.to(dtype).to(device) for k, v in t.items()}
    t.update(A_log=torch.randn(shape.hv, generator=g).to(device), dt_bias=torch.randn(shape.hv, generator=g).to(device),
             weight=(1 + 0.1 * torch.randn(shape.dv, generator=g)).to(dtype).to(device),
             bounds=torch.tensor([0, T, T], dtype=torch.int32, device=device),
             out=torch.empty(T, shape.hv, shape.dv, dtype=dtype, device=device))
    return dict(dims=dims, **t)


def run_gates(x: dict, block_rows: int):
    return GF.qk_gates(x["mixed"], x["b"], x["a"], x["A_log"], x["dt_bias"], x["dims"], block_rows=block_rows)


def run_norm(x: dict, block_rows: int):
    GF.gated_rmsnorm(x["core"], x["z"], x["weight"], x["out"], EPS, bounds=x["bounds"], block_rows=block_rows)
    return x["out"]


def check(x: dict, block_rows: int) -> dict:
    """Relative errors of one block size's outputs against the torch ops."""
    d = x["dims"]
    T, kd = x["mixed"].shape[0], d.hk * d.dk
    q, k, _, g, beta = run_gates(x, block_rows)
    mixed = x["mixed"]
    want_g = -x["A_log"].exp() * F.softplus(x["a"].float() + x["dt_bias"])
    errs = dict(q=rel_err(q.float(), l2norm(mixed[:, :kd].reshape(T, d.hk, d.dk)).float()),
                k=rel_err(k.float(), l2norm(mixed[:, kd:2 * kd].reshape(T, d.hk, d.dk)).float()),
                g=rel_err(g, want_g), beta=rel_err(beta.float(), x["b"].sigmoid().float()),
                norm=rel_err(run_norm(x, block_rows).float(),
                             gated_rms_norm(x["core"], x["z"], x["weight"], EPS).float()))
    return {name: float(e) for name, e in errs.items()}


def kernel_bytes(x: dict) -> dict:
    """Bytes each kernel must move: qk_gates reads q | k and b, a and writes q, k, g, beta;
    gated_rmsnorm reads core and z and writes out."""
    d, T = x["dims"], x["mixed"].shape[0]
    e = x["mixed"].element_size()
    return dict(qk_gates=T * (4 * d.hk * d.dk * e + d.hv * (3 * e + 4)),
                gated_rmsnorm=3 * T * d.hv * d.dv * e)


def bench(args) -> dict:
    device = torch.device("cuda" if is_cuda() else "cpu")
    shape = BENCH_GDN if not args.dry_run else GdnShape(2, 4, 16, 16, 4)
    dtype = torch.bfloat16
    rates = device_rates() if device.type == "cuda" else {}
    rec = {"env": device_facts(args.dry_run), "rates": rates, "shape": dataclasses.asdict(shape), "rows": {}}
    copy = rates.get("copy_bytes_per_s")
    for T in args.tokens:
        x = inputs(shape, T, dtype, device)
        row = rec["rows"][str(T)] = {"check": {str(b): check(x, b) for b in args.block_rows}}
        worst = max(max(errs.values()) for errs in row["check"].values())
        row["check_ok"] = worst <= TOL
        if not row["check_ok"]:
            print(f"{T} rows: check failed (worst relative error {worst:.2e}); not timed", flush=True)
            continue
        row["bytes"] = kernel_bytes(x)
        for name, fn in (("qk_gates", run_gates), ("gated_rmsnorm", run_norm)):
            for b in args.block_rows:
                us = graph_call_us(lambda i, b=b, fn=fn: fn(x, b), args.calls, args.replays, device)
                rate = row["bytes"][name] / (us * 1e-6)
                row.setdefault(name, {})[str(b)] = dict(us=us, copy_rate_pct=100 * rate / copy if copy else None)
                print(f"{T} rows, {name}, {b} rows a program: {us:.1f} us", flush=True)
    return rec


def table(rec: dict) -> str:
    lines = ["| rows | kernel | " + " | ".join(f"{b} rows a program, us (% copy)" for b in rec["block_rows"]) + " |",
             "|---:|---|" + "---:|" * len(rec["block_rows"])]
    for T, row in rec["rows"].items():
        for name in ("qk_gates", "gated_rmsnorm"):
            if name not in row:
                continue
            cells = []
            for b in rec["block_rows"]:
                r = row[name][str(b)]
                pct = f" ({r['copy_rate_pct']:.0f}%)" if r["copy_rate_pct"] is not None else ""
                cells.append(f"{r['us']:.1f}{pct}")
            lines.append(f"| {T} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Writes OUT/gdn_row_kernels_bench.json and prints a table.")
    p.add_argument("--out", type=Path, required=True, help="folder for gdn_row_kernels_bench.json")
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[512, 2048, 4096],
                   help="rows of the steps timed, comma-separated (default 512,2048,4096)")
    p.add_argument("--block-rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, GF.BLOCK_ROWS],
                   help=f"rows a program takes, powers of two, comma-separated (default 1,{GF.BLOCK_ROWS})")
    p.add_argument("--calls", type=int, default=20, help="calls in the timed CUDA graph (default 20)")
    p.add_argument("--replays", type=int, default=10, help="replays timed, median taken (default 10)")
    p.add_argument("--dry-run", action="store_true", help="the CPU interpreter at tiny dims (times mean nothing)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.tokens = [min(t, 40) for t in args.tokens]
    bad = [b for b in args.block_rows if b < 1 or b & (b - 1)]
    if bad:
        p.error(f"--block-rows: {bad} are not powers of two")
    rec = bench(args)
    rec["block_rows"] = args.block_rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gdn_row_kernels_bench.json").write_text(json.dumps(rec, indent=1))
    print(table(rec))
    return 0 if all(r["check_ok"] for r in rec["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
