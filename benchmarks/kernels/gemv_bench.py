"""The few-row GEMV (runtime/backends/kernels/gemv.py) against cuBLAS at decode's projections: checks
first, then a sweep of launch configs per shape, JSON and a markdown table to --out.

    python3 benchmarks/kernels/gemv_bench.py --out $OUT              # GPU: bench qwen3_next's shapes
    python3 benchmarks/kernels/gemv_bench.py --out $OUT --families qwen3_next,kimi_linear,bailing_linear
    python3 benchmarks/kernels/gemv_bench.py --out /tmp/g --dry-run  # CPU: Triton's interpreter, tiny shapes

Shapes: every distinct (N, K) of the projection weights of each --families' bench meta model (nn.Linear
and FusedLinear modules, the layers and the MTP layer: models.loader.build_meta_model over the
family's make_config("bench")) and its logits head (vocabulary x hidden: 151936 x 2048 for
qwen3_next); rows M = 1, 2, 4, 8 (--rows); bf16.

1. Check: for every shape and M, the config the kernel would take today (gemv.config_for) against
   the float32 product x.float() @ w.float().T on fresh random inputs, by ||y - ref|| / ||ref||;
   above 1e-2 the script stops there, before timing anything.
2. Copy rate: a 1 GiB device-to-device copy, bytes read plus written (bench_common.device_rates),
   in the same run: the denominator of every "% copy" below.
3. Sweep, M by M (M = 1 for every shape first): for each candidate config (`candidates`: FMA and
   DOT tiles, the default among them) one checked call (the same 1e-2, a failure recorded and the
   config left out), then the time of one call with the L2 defeated: the call rotates over copies
   of the weight whose bytes together pass 4x the L2 (50 MB on an H200), --calls calls (a multiple
   of the copies) captured in one CUDA graph, replayed --replays times, median over replays divided
   by the calls. torch's F.linear (cuBLAS) the same way in the same run, and its kernels per call
   (torch.profiler; ours too, which should be 1).
4. Per (shape, M): the best config, its us, GB/s (weight, x and out bytes once) and % of the copy
   rate; torch's us, kernels per call, and torch us / ours. OUT/gemv_bench.json after every shape,
   OUT/gemv_bench.md at the end, and the CONFIGS entries that the run would put in gemv.py, printed:
   the (shape, M bucket)s where the best config beat cuBLAS by 5% (WIN) or more.

The dry run walks the same flow on the CPU in Triton's interpreter at tiny shapes (the meta model's
shapes are still listed): its times are one eager call's wall time and mean nothing.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_facts, device_rates, fmt, graph_call_us, is_cuda, kernels_per_call, rel_err  # noqa: E402
from runtime.backends.kernels import gemv as G  # noqa: E402
from runtime.backends.kernels.launch_math import next_pow2  # noqa: E402

ROWS = (1, 2, 4, 8)
DRY_SHAPES = [("dry small", 48, 40), ("dry odd", 70, 33)]
TOL = 1e-2
L2_TIMES = 4  # weight copies rotated per timing: their bytes together pass this many L2s
WIN = 1.05  # torch us / ours a shape needs for a CONFIGS entry: a smaller lead is within one run's spread


def bench_shapes(families: list[str]) -> list[tuple[str, int, int]]:
    """(modules, N, K) for every distinct projection weight of each family's bench meta model (its
    nn.Linear and FusedLinear modules) and its logits head (vocabulary x hidden), families named
    before the modules ("qwen3_next: lm_head"); one row per (N, K) however many share it."""
    from models.common import FusedLinear
    from models.families import get_family
    from models.loader import build_meta_model

    found: dict[tuple[int, int], set[str]] = {}
    for name in families:
        family = get_family(name)
        text = family.text_config(family.make_config("bench"))
        model = build_meta_model(family, text)
        for module_name, module in model.named_modules():
            if isinstance(module, (torch.nn.Linear, FusedLinear)):
                found.setdefault(tuple(module.weight.shape), set()).add(f"{name}: " + re.sub(r"\.\d+\.", ".*.", module_name))
        found.setdefault((int(text["vocab_size"]), int(text["hidden_size"])), set()).add(f"{name}: lm_head")
    return [(", ".join(sorted(names)), n, k) for (n, k), names in sorted(found.items())]


def candidates(N: int, K: int, rows: int, dry: bool) -> list[G.GemvConfig]:
    """The configs swept for (N, K, M bucket): the default first, then FMA tiles that fit the
    registers at this bucket (narrow, reading a large share of K per step) and DOT tiles."""
    C = G.GemvConfig
    if dry:
        pool = [C(8, 16), C(4, 64), C(16, 16, 4, 2, True)]
    else:
        full = min(next_pow2(K), 4096)
        # the narrow FMA tiles with a K loop (1-2 columns, 8 warps) keep N / BLOCK_N programs in flight at
        # 4-8 rows, where a wide tile leaves a 2048-column projection too few (the output projection lost there)
        pool = [C(1, full), C(2, full), C(2, 1024), C(4, 2048), C(4, 1024, 8), C(8, 512),
                C(1, 1024, 8), C(2, 512, 8), C(1, 512, 4),
                C(16, 256, 4, 4, True), C(32, 256, 4, 4, True), C(16, 512, 4, 3, True), C(64, 128, 4, 4, True)]
    chosen = [G.default_config(N, K, rows)]
    for c in pool:
        if c not in chosen and (c.DOT or c.fma_fits(rows)):
            chosen.append(c)
    return chosen


def describe(c: G.GemvConfig) -> str:
    return (f"{'dot' if c.DOT else 'fma'} n{c.BLOCK_N} k{c.BLOCK_K} w{c.num_warps} s{c.num_stages}")


class Case:
    """One (N, K, M): fresh random bf16 inputs, enough weight copies to defeat the L2, the reference."""

    def __init__(self, N: int, K: int, M: int, device, dtype, l2_bytes: int, seed: int):
        g = torch.Generator(device).manual_seed(seed)  # drawn where they live: the lm head is 311M numbers
        self.N, self.K, self.M = N, K, M
        w = (torch.randn(N, K, generator=g, device=device) * K ** -0.5).to(dtype)
        self.x = torch.randn(M, K, generator=g, device=device).to(dtype)
        assert not torch.backends.cuda.matmul.allow_tf32, "the float32 reference must not take TF32"
        self.ref = self.x.float() @ w.float().T
        itemsize = w.element_size()
        self.weight_bytes = N * K * itemsize
        self.bytes = self.weight_bytes + (M * K + M * N) * itemsize  # weight, x and out, once
        copies = 1 if device.type == "cpu" else max(1, math.ceil(L2_TIMES * l2_bytes / self.weight_bytes))
        self.weights = [w] + [w.clone() for _ in range(copies - 1)]
        self.out = torch.empty(M, N, dtype=dtype, device=device)

    def ours(self, config, i: int = 0):
        return G.small_m_linear(self.x, self.weights[i], self.out, config=config)

    def torch(self, i: int = 0):
        return F.linear(self.x, self.weights[i])

    def check(self, config) -> float:
        return rel_err(G.small_m_linear(self.x, self.weights[0], config=config), self.ref)


def check_all(shapes, rows, device, dtype, l2_bytes: int) -> list[dict]:
    """Step 1: the config each (shape, M) takes today against the float32 product."""
    out = []
    for what, N, K in shapes:
        for M in rows:
            case = Case(N, K, M, device, dtype, 0, seed=N * 7 + K + M)
            config = G.config_for(N, K, M)
            err = case.check(config)
            out.append({"what": what, "N": N, "K": K, "M": M, "config": describe(config), "rel_err": err,
                        "ok": err <= TOL})
            del case
    return out


def sweep(what: str, N: int, K: int, M: int, device, dtype, env: dict, copy_rate: float, args) -> dict:
    """Step 3 for one (shape, M): every candidate checked and timed, torch timed, the best kept."""
    case = Case(N, K, M, device, dtype, env["l2_bytes"], seed=N * 7 + K + M + 1)
    copies, dry = len(case.weights), device.type != "cuda"
    rows = G.row_bucket(M)
    tried, failed, errors = [], [], []
    for config in candidates(N, K, rows, dry):
        try:
            err = case.check(config)
        except Exception as e:  # a config the compiler refuses (shared memory, registers): left out, not a wrong result
            errors.append({"config": describe(config), "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        if not err <= TOL:
            failed.append({"config": describe(config), "rel_err": err})
            continue
        us = graph_call_us(lambda i, c=config: case.ours(c, i), args.calls, args.replays, device, rotate=copies)
        tried.append({"config": describe(config), "params": dataclasses.asdict(config), "rel_err": err, "us": us})
    torch_us = graph_call_us(case.torch, args.calls, args.replays, device, rotate=copies)
    row = {"what": what, "N": N, "K": K, "M": M, "bucket": rows, "weight_copies": copies, "bytes": case.bytes,
           "tried": tried, "failed": failed, "errors": errors, "torch_us": torch_us,
           "torch_kernels": kernels_per_call(case.torch)}
    default = describe(G.default_config(N, K, rows))
    row["default_us"] = next((t["us"] for t in tried if t["config"] == default), None)
    if tried:
        best = min(tried, key=lambda t: t["us"])
        gbs = case.bytes / (best["us"] * 1e-6) / 1e9
        params = G.GemvConfig(**best["params"])
        row.update(best=best["config"], best_params=best["params"], us=best["us"], gb_s=gbs,
                   pct_copy=100 * gbs * 1e9 / copy_rate, ratio=torch_us / best["us"],
                   kernels=kernels_per_call(lambda: case.ours(params)))
    return row


def table_entries(rows: list[dict]) -> list[str]:
    """The CONFIGS lines for gemv.py: the best config of each (N, K, bucket) measured (of the largest
    M measured in a bucket, where several share one: the bucket's config serves up to it), for the
    buckets where it beat cuBLAS by WIN at least: a shape in the table is one the GEMV wins."""
    best = {}
    for r in sorted(rows, key=lambda r: r["M"]):
        best.pop((r["N"], r["K"], r["bucket"]), None)
        if "best_params" in r and r["ratio"] >= WIN:
            best[(r["N"], r["K"], r["bucket"])] = r
    lines = []
    for _, r in sorted(best.items()):
        p = r["best_params"]
        lines.append(f"    ({r['N']}, {r['K']}, {r['bucket']}): GemvConfig(BLOCK_N={p['BLOCK_N']}, "
                     f"BLOCK_K={p['BLOCK_K']}, num_warps={p['num_warps']}, num_stages={p['num_stages']}, "
                     f"DOT={p['DOT']}),")
    return lines


def markdown(doc: dict) -> str:
    env = doc["env"]
    dry = " (dry run: times mean nothing)" if env["dry_run"] else ""
    lines = [f"# GEMV sweep: {env['device']}, {env['date']}{dry}", "",
             f"Copy rate {doc['copy_rate_gb_s']:.0f} GB/s (read + write); bf16; L2 defeated by rotating "
             f"weight copies ({L2_TIMES}x the L2).", "",
             "| weight | N | K | M | best config | us | GB/s | % copy | default us | torch us "
             "| kernels ours / torch | torch / ours |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["results"]:
        lines.append(f"| {r['what']} | {r['N']} | {r['K']} | {r['M']} | {r.get('best', 'none passed')} "
                     f"| {fmt(r.get('us'), '.2f')} | {fmt(r.get('gb_s'), '.0f')} | {fmt(r.get('pct_copy'))} "
                     f"| {fmt(r.get('default_us'), '.2f')} | {fmt(r['torch_us'], '.2f')} "
                     f"| {fmt(r.get('kernels'))} / {fmt(r['torch_kernels'])} | {fmt(r.get('ratio'), '.2f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated M (default 1,2,4,8)")
    ap.add_argument("--families", default="qwen3_next",
                    help="families whose bench projections are swept, comma-separated (default qwen3_next; "
                         "kimi_linear, bailing_linear: the MLA families' shapes)")
    ap.add_argument("--calls", type=int, default=40, help="calls captured in one graph (rounded to the copies)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop sweeping new (shape, M) after this many seconds (what ran is kept)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not is_cuda():
        ap.error("needs a CUDA GPU (or --dry-run)")
    start = time.perf_counter()
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.bfloat16
    rows = [int(m) for m in args.rows.split(",")]
    env = device_facts(dry)
    model_shapes = bench_shapes([f for f in args.families.split(",") if f])
    shapes = DRY_SHAPES if dry else model_shapes
    doc = {"env": env, "model_shapes": model_shapes, "shapes": shapes, "rows": rows, "tolerance": TOL, "win": WIN,
           "calls_per_graph": args.calls, "replays": args.replays}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gemv_bench.json"

    doc["check"] = check_all(shapes, rows, device, dtype, env["l2_bytes"])
    bad = [c for c in doc["check"] if not c["ok"]]
    if bad:
        path.write_text(json.dumps(doc, indent=1))
        for c in bad:
            print(f"CHECK FAILED: {c['what']} N={c['N']} K={c['K']} M={c['M']} {c['config']}: "
                  f"rel err {c['rel_err']:.2e} > {TOL}", file=sys.stderr)
        return 1
    print(f"checked {len(doc['check'])} (shape, M): rel err <= {max(c['rel_err'] for c in doc['check']):.2e}",
          flush=True)

    rates = device_rates()
    doc["copy_rate_gb_s"] = rates["copy_bytes_per_s"] / 1e9
    doc["copy_method"] = rates["method"]
    doc["results"] = []
    for M in rows:  # M by M: a run cut short has every shape at M = 1
        for what, N, K in shapes:
            if args.time_budget_s is not None and time.perf_counter() - start > args.time_budget_s:
                doc["cut_short"] = f"time budget {args.time_budget_s} s reached before N={N} K={K} M={M}"
                break
            r = sweep(what, N, K, M, device, dtype, env, rates["copy_bytes_per_s"], args)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the weight copies of this shape back before the next
            doc["results"].append(r)
            path.write_text(json.dumps(doc, indent=1))
            print(f"N={N} K={K} M={M}: {r.get('best')} {r.get('us', float('nan')):.2f} us "
                  f"({r.get('pct_copy', float('nan')):.1f}% copy), torch {r['torch_us']:.2f} us "
                  f"x{r.get('ratio', float('nan')):.2f}" + (f", FAILED {r['failed']}" if r["failed"] else "")
                  + (f", {len(r['errors'])} configs refused by the compiler" if r["errors"] else ""),
                  flush=True)
        if "cut_short" in doc:
            break
    doc["table_entries"] = table_entries(doc["results"])
    doc["seconds"] = time.perf_counter() - start
    path.write_text(json.dumps(doc, indent=1))
    (args.out / "gemv_bench.md").write_text(markdown(doc))
    print(markdown(doc))
    print("CONFIGS entries this run would choose (runtime/backends/kernels/gemv.py):")
    print("\n".join(doc["table_entries"]) or "    (none)")
    failed = [(r["N"], r["K"], r["M"], f) for r in doc["results"] for f in r["failed"]]
    for f in failed:
        print(f"CHECK FAILED in the sweep: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
