"""Whether a split-K Triton GEMM beats cuBLAS at decode's projections of 32 to 128 rows.

In bench qwen3_next's decode step at 128 requests on an H200 the output projections ([128, 4096] x
[4096 -> 2048], 9 GDN and 3 GQA layers) took 11.2 us each in cuBLAS's 64x32 tile, 36% of the copy
rate for their 16.8 MB of weight (`step_account_state_dtype_h200_2026-12-06.md`; the input
projections 17.2 us for 50.6 MB, 69%). With one 64x32 tile an SM, each program streams 768 KB of x
and weight; splitting K puts several programs on an SM, each streaming a share. Here, for each
projection shape of the step and M = 32, 64, 128 (bf16):

1. cuBLAS (`F.linear`) and each candidate config of the runtime's split-K GEMM
   (runtime/backends/kernels/split_k.py, which the glue takes for no shape until measured),
   checked first against x.float() @ w.float().T on fresh random inputs (||y - ref|| / ||ref|| <= 1e-2; a failing config
   is recorded and left out);
2. times, one call in a CUDA graph of many rotating over copies of the weight whose bytes pass 4x
   the L2 (`bench_common.graph_call_us`), median over replays: one launch at any split (a tile's
   last program sums its float32 partials in split order, so the result has one order of sums
   whatever the step).

It prints the entries of split_k.CONFIGS the run measured (a shape and bucket where the best config
beat cuBLAS by 5% or more); only such entries make the glue take the kernel. OUT/split_k_probe.json.

    python3 benchmarks/probes/split_k_probe.py --out $OUT            # GPU
    python3 benchmarks/probes/split_k_probe.py --out /tmp/sk --dry-run  # CPU: the interpreter, tiny shapes
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_facts, device_rates, graph_call_us, rel_err  # noqa: E402
from runtime.backends.kernels.split_k import SplitKConfig, row_bucket, split_k_linear  # noqa: E402

# bench qwen3_next's decode projections (N, K): the GDN and GQA output projections, the GDN input
# projection, GQA's q|k|v.
SHAPES = {"out_proj": (2048, 4096), "gdn_in_proj": (12352, 2048), "gqa_qkv": (9216, 2048)}
DRY_SHAPES = {"out_proj": (32, 64), "gdn_in_proj": (48, 32)}
ROWS, DRY_ROWS = (32, 64, 128), (16,)


def candidates(M: int, dry: bool) -> list[SplitKConfig]:
    if dry:
        return [SplitKConfig(16, 16, 16, 1, 1, 1), SplitKConfig(16, 16, 16, 2, 1, 1)]
    bm = min(128, max(32, M))
    out = []
    for bn, bk, split, warps, stages in ((32, 128, 1, 4, 4), (64, 64, 2, 4, 4), (64, 128, 2, 4, 3),
                                         (32, 128, 2, 4, 4), (64, 64, 4, 4, 4), (32, 64, 4, 4, 4),
                                         (64, 128, 4, 8, 3), (128, 64, 4, 8, 3), (32, 128, 8, 4, 3),
                                         (64, 64, 8, 4, 3)):
        out.append(SplitKConfig(bm, bn, bk, split, warps, stages))
    return out


def run_shape(name: str, N: int, K: int, M: int, device, rates: dict, dry: bool, log) -> dict:
    g = torch.Generator().manual_seed(N + K + M)
    dtype = torch.bfloat16
    x = (torch.randn(M, K, generator=g) * 0.5).to(dtype).to(device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(device)
    ref = x.float().cpu() @ w.float().cpu().T
    bytes_once = (N * K + M * K + M * N) * x.element_size()
    l2 = 50 * 2 ** 20
    rotate = 1 if dry else max(1, -(-4 * l2 // (N * K * x.element_size())))
    weights = [w] + [w.clone() for _ in range(rotate - 1)]
    row = {"shape": name, "N": N, "K": K, "M": M, "bytes": bytes_once,
           "floor_us": bytes_once / rates["copy_bytes_per_s"] * 1e6, "points": []}
    row["torch_rel_err"] = rel_err(F.linear(x, w).float().cpu(), ref)
    row["torch_us"] = graph_call_us(lambda i: F.linear(x, weights[i]), 64, 15, device, rotate)
    for cfg in candidates(M, dry):
        point = {"config": dataclasses.asdict(cfg)}
        try:
            point["rel_err"] = err = rel_err(split_k_linear(x, w, cfg).float().cpu(), ref)
            if err <= 1e-2:
                point["us"] = graph_call_us(lambda i: split_k_linear(x, weights[i], cfg), 64, 15, device, rotate)
        except Exception as e:  # a config the compiler refuses must not end the run
            point["error"] = f"{type(e).__name__}: {e}"[:300]
        row["points"].append(point)
    timed = [p for p in row["points"] if "us" in p]
    if timed:
        best = min(timed, key=lambda p: p["us"])
        row["best_us"], row["best_config"] = best["us"], best["config"]
    log(f"{name:12s} M={M:<4d} floor {row['floor_us']:7.2f} us  cuBLAS {row['torch_us']:7.2f}  "
        f"split-K best {row.get('best_us', float('nan')):7.2f} {tuple(row.get('best_config', {}).values())}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    ap.add_argument("--rows", default=None, help="comma list of M (default 32,64,128)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("split_k_probe: no CUDA device (run with --dry-run on a CPU)")
    device = torch.device("cpu" if dry else "cuda")
    rows = [int(r) for r in args.rows.split(",")] if args.rows else (DRY_ROWS if dry else ROWS)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    doc = {"env": device_facts(dry), "rates": device_rates(), "rows": []}
    for name, (N, K) in (DRY_SHAPES if dry else SHAPES).items():
        for M in rows:
            doc["rows"].append(run_shape(name, N, K, M, device, doc["rates"], dry, lambda s: print(s, flush=True)))
            doc["seconds"] = time.time() - t0
            (args.out / "split_k_probe.json").write_text(json.dumps(doc, indent=1))
    # The CONFIGS entries of runtime/backends/kernels/split_k.py this run measured: a shape and bucket
    # where the best config beat cuBLAS by 5% or more.
    print("split_k.CONFIGS entries (best config at least 1.05x cuBLAS):")
    for r in doc["rows"]:
        if "best_us" in r and r["torch_us"] >= 1.05 * r["best_us"]:
            print(f"    ({r['N']}, {r['K']}, {row_bucket(r['M'])}): SplitKConfig(**{r['best_config']}),  "
                  f"# {r['shape']}: {r['best_us']:.2f} against {r['torch_us']:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
