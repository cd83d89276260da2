"""The norms folded into decode's GEMVs (`hgc build --norm-linear`) against the two launches each
replaces: checks first, then times, JSON and a table to --out.

    python3 benchmarks/kernels/norm_gemv_bench.py --out $OUT               # GPU: bench qwen3_next's shapes
    python3 benchmarks/kernels/norm_gemv_bench.py --out /tmp/n --dry-run   # CPU: Triton's interpreter, tiny

Cases, bf16, rows M = 1, 2, 4, 8 (--rows), each with the launch configs the glue kernels take: the
plain GEMV's of its shape (gemv.config_for) for the unfused pair, the fused kernel's (the input norm's
own where norm_gemv.NORM_CONFIGS has one, `norm_config_for`) for the fused one:

- input norm (runtime/backends/kernels/norm_gemv.py `add_rms_norm_gemv`: the residual add and the
  RMSNorm in the GEMV's prologue) at the GDN input projection (N 12352, K 2048) and GQA's q|k|v (9216 x
  2048); unfused: the row kernel (`add_rms_norm_rows`: the add and the norm, one launch, as
  Inductor's fused kernel is) then the GEMV (`gemv.small_m_linear`);
- post-attention norm (`gemv_add_rms_norm`: the add in the GEMV's epilogue, the norm in its last
  program) at the output projection (2048 x 4096); unfused: the GEMV, then the row kernel.

1. Check: fused and unfused against the float32 CPU reference (glue_ops' ops: the traced glue's),
   ||y - ref|| / ||ref|| of the output and of summed, on fresh random inputs; above 1e-2 the case
   is recorded failed and not timed.
2. Time: one call inside a CUDA graph of --calls calls over copies of the weight that together pass
   4x the L2 (none is cached), --replays replays, median divided by the calls (bench_common
   `graph_call_us`); kernels per call (torch.profiler). unfused us / fused us is the ratio.
3. --sweep: the fused kernel again at each config of `candidates` (its own tile, not the plain
   GEMV's: a fused program reads the rows and the norm weight besides its weight tile and reduces
   the row itself, so fewer, wider programs may pay where the plain GEMV's narrow ones won), each
   checked before it is timed; the best and unfused us / best us per case. The entries a table of
   fused configs would take are printed last.

OUT/norm_gemv_bench.json after every case, a table last. The dry run walks the same flow in Triton's
interpreter at tiny shapes: its times are one eager call's wall time and mean nothing.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_facts, fmt, graph_call_us, is_cuda, kernels_per_call, rel_err  # noqa: E402
from compiler.splitops.glue_ops import rms_norm_rows  # noqa: E402
from runtime.backends.kernels import gemv as G  # noqa: E402
from runtime.backends.kernels import norm_gemv as NG  # noqa: E402
from runtime.backends.kernels.launch_math import next_pow2  # noqa: E402

# (case, N, K): bench qwen3_next's projections beside its norms; the dry run's are tiny
SHAPES = [("input norm: GDN in_proj", 12352, 2048), ("input norm: GQA qkv", 9216, 2048),
          ("post-attention norm: o_proj", 2048, 4096)]
DRY_SHAPES = [("input norm: GDN in_proj", 40, 64), ("post-attention norm: o_proj", 48, 96)]
TOL = 1e-2
L2_TIMES = 4  # weight copies that together pass this many times the L2
EPS = 1e-6


class Case:
    """One (kind, N, K, M): fresh random inputs, weight copies past the L2, the CPU reference."""

    def __init__(self, what: str, N: int, K: int, M: int, device, l2_bytes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.what, self.N, self.K, self.M = what, N, K, M
        self.post = what.startswith("post")
        width = N if self.post else K  # the normed row's: the output for the post-attention norm
        dt = torch.bfloat16
        w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dt)
        self.x = torch.randn(M, K, generator=g).to(dt).to(device)  # the projection's input (post) or residual a
        self.b = torch.randn(M, width, generator=g).to(dt).to(device)  # the residual (post) or the update b
        self.norm_w = (torch.randn(width, generator=g) * 0.2).to(dt).to(device)
        self.config = G.config_for(N, K, M)  # the plain GEMV's, the unfused pair's
        # the fused kernel's as the glue launches it: the input norm's own where NORM_CONFIGS has one
        self.fused_config = self.config if self.post else NG.norm_config_for(N, K, M)
        cpu = [t.cpu() for t in (self.x, self.b, self.norm_w)]
        if self.post:  # summed = residual + x @ w^T, then the norm
            summed = cpu[1] + F.linear(cpu[0], w)
            self.ref = (rms_norm_rows(summed, cpu[2], EPS, True), summed)
        else:  # summed = a + b, the norm, then the projection
            summed = cpu[0] + cpu[1]
            self.ref = (F.linear(rms_norm_rows(summed, cpu[2], EPS, True), w), summed)
        w = w.to(device)
        copies = 1 if device.type == "cpu" else max(1, math.ceil(L2_TIMES * l2_bytes / (N * K * 2)))
        self.weights = [w] + [w.clone() for _ in range(copies - 1)]

    def fused(self, i: int = 0, config=None):
        config = config or self.fused_config
        if self.post:
            return NG.gemv_add_rms_norm(self.x, self.weights[i], self.b, self.norm_w, EPS, True, config=config)
        return NG.add_rms_norm_gemv(self.x, self.b, self.norm_w, self.weights[i], EPS, True, config=config)

    def unfused(self, i: int = 0):
        if self.post:
            y = G.small_m_linear(self.x, self.weights[i], config=self.config)
            return NG.add_rms_norm_rows(self.b, y, self.norm_w, EPS, True)
        normed, summed = NG.add_rms_norm_rows(self.x, self.b, self.norm_w, EPS, True)
        return G.small_m_linear(normed, self.weights[i], config=self.config), summed

    def check(self, fn) -> dict:
        got = fn()
        errs = {"out": rel_err(got[0], self.ref[0]), "summed": rel_err(got[1], self.ref[1])}
        return {**errs, "ok": all(e <= TOL for e in errs.values())}


def candidates(K: int, M: int) -> list[G.GemvConfig]:
    """The fused kernel's configs a sweep times at rows M: up to 2 rows the one-step FMA tile over the
    whole K (K <= 4096) at 1 to 16 columns and 4 or 8 warps, where its float32 products stay in the
    registers (GemvConfig.fma_fits); from 4 rows DOT tiles of 16 to 64 columns, 64 to 256 of K."""
    rows = G.row_bucket(M)
    if rows <= 2:
        block_k = next_pow2(K)
        if block_k > 4096:
            return []
        out = [G.GemvConfig(BLOCK_N=n, BLOCK_K=block_k, num_warps=w) for n in (1, 2, 4, 8, 16) for w in (4, 8)]
        return [c for c in out if c.fma_fits(rows)]
    return [G.GemvConfig(BLOCK_N=n, BLOCK_K=k, num_warps=4, num_stages=4, DOT=True)
            for n in (16, 32, 64) for k in (64, 128, 256) if k <= max(16, next_pow2(K))]


def sweep_case(case: Case, device, calls: int, replays: int, unfused_us: float | None) -> dict:
    """Step 3: the fused kernel at each candidate config, checked, then timed (on the CPU the first
    and the last candidate: the interpreter's times mean nothing, the flow is what a dry run walks)."""
    rotate = len(case.weights)
    configs = candidates(case.K, case.M)
    if device.type == "cpu":
        configs = configs[:1] + configs[-1:]
    runs = []
    for cfg in configs:
        run = {"config": repr(cfg), "check": case.check(lambda: case.fused(0, cfg))}
        if run["check"]["ok"]:
            run["us"] = graph_call_us(lambda i: case.fused(i, cfg), calls, replays, device, rotate=rotate)
        runs.append(run)
    timed = [r for r in runs if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    return {"runs": runs, "best": best,
            "ratio": unfused_us / best["us"] if best and unfused_us else None}


def run_case(case: Case, device, calls: int, replays: int, sweep: bool = False) -> dict:
    row = {"case": case.what, "N": case.N, "K": case.K, "M": case.M, "config": repr(case.config),
           "fused_config": repr(case.fused_config),
           "check": {"fused": case.check(case.fused), "unfused": case.check(case.unfused)}}
    if not all(c["ok"] for c in row["check"].values()):
        return row
    rotate = len(case.weights)
    for name in ("fused", "unfused"):
        fn = getattr(case, name)
        row[name] = {"us": graph_call_us(fn, calls, replays, device, rotate=rotate), "kernels": kernels_per_call(fn)}
    row["ratio"] = row["unfused"]["us"] / row["fused"]["us"]
    if sweep:
        row["sweep"] = sweep_case(case, device, calls, replays, row["unfused"]["us"])
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    ap.add_argument("--rows", default=None, help="comma-separated M (default 1,2,4,8; dry run 1,3)")
    ap.add_argument("--calls", type=int, default=48, help="calls captured in one graph")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time the fused kernel at each candidate config")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not is_cuda():
        ap.error("needs a CUDA GPU (or --dry-run)")
    device = torch.device("cpu" if dry else "cuda")
    env = device_facts(dry)
    rows = [int(m) for m in (args.rows or ("1,3" if dry else "1,2,4,8")).split(",")]
    doc = {"env": env, "rows": rows, "tolerance": TOL, "results": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for seed, (what, N, K) in enumerate(DRY_SHAPES if dry else SHAPES):
        for M in rows:
            case = Case(what, N, K, M, device, env["l2_bytes"], seed=100 * seed + M)
            doc["results"].append(run_case(case, device, args.calls, args.replays, args.sweep))
            (args.out / "norm_gemv_bench.json").write_text(json.dumps(doc, indent=2))
    print(f"{'case':30s} {'N':>6} {'K':>5} {'M':>2} {'check':>6} {'fused us':>9} {'kernels':>8} {'unfused us':>11} "
          f"{'kernels':>8} {'ratio':>6}")
    for r in doc["results"]:
        ok = all(c["ok"] for c in r["check"].values())
        f, u = r.get("fused", {}), r.get("unfused", {})
        print(f"{r['case']:30s} {r['N']:>6} {r['K']:>5} {r['M']:>2} {'ok' if ok else 'FAIL':>6} "
              f"{fmt(f.get('us'), '.2f'):>9} {fmt(f.get('kernels'), '.0f'):>8} {fmt(u.get('us'), '.2f'):>11} "
              f"{fmt(u.get('kernels'), '.0f'):>8} {fmt(r.get('ratio'), '.2f'):>6}")
    if args.sweep:
        print_sweep(doc["results"])
    return doc


def print_sweep(results: list[dict]) -> None:
    """Per case the sweep's best config against the unfused pair, then the entries a table of fused
    configs keyed like gemv.CONFIGS, (N, K, M bucket), would take: where the best beat the unfused pair."""
    print(f"\n{'case':30s} {'N':>6} {'K':>5} {'M':>2} {'configs':>7} {'best us':>8} {'unfused/best':>12}  best config")
    entries = []
    for r in results:
        sw = r.get("sweep")
        if not sw:
            continue
        best = sw["best"] or {}
        print(f"{r['case']:30s} {r['N']:>6} {r['K']:>5} {r['M']:>2} {len(sw['runs']):>7} "
              f"{fmt(best.get('us'), '.2f'):>8} {fmt(sw['ratio'], '.2f'):>12}  {best.get('config', 'n/a')}")
        if sw["ratio"] and sw["ratio"] > 1:
            entries.append(f"    ({r['N']}, {r['K']}, {G.row_bucket(r['M'])}): {best['config']},  # {r['case']}")
    print("fused configs that beat the unfused pair:" if entries else "no fused config beat the unfused pair")
    print("\n".join(entries))


if __name__ == "__main__":
    main()
