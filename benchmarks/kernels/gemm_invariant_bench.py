"""The batch-invariant matrix product (runtime/backends/kernels/matmul.py) against cuBLAS, on the GPU.

    python3 benchmarks/kernels/gemm_invariant_bench.py --out $OUT/gemm        # bf16, bench qwen3_next's projections
    python3 benchmarks/kernels/gemm_invariant_bench.py --out /tmp/g --dry-run  # CPU: Triton's interpreter, tiny shapes

For each (N, K) of the bench model's glue products (the GDN and attention projections, the output
projections, the vocabulary head) and each row count M (a decode step's 1 to 32 rows, a verify
step's 4 per request, a prompt chunk's 512):

1. checked first, on fresh random inputs: both kernels against the CPU's float32 product (relative
   error of the norm), and the kernel's rows at M against its rows at M = 1 (torch.equal): the
   property it exists for; cuBLAS's rows are compared the same way, to show what it does;
2. timed: median milliseconds of each between CUDA events, and the ratio kernel / cuBLAS.

JSON to OUT/gemm_invariant_bench.json, a table on stdout. What it does not time: the products
inside a step (spec_bench.py --batch-invariant times whole steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench_common import device_facts, time_ms  # noqa: E402

# (what, N, K) of bench qwen3_next (models/qwen3_next.py "bench"): hidden 2048, 16 GDN key heads and
# 32 value heads of 128, 16 query heads of 256 (gated), 2 kv heads, vocabulary 151936.
SHAPES = [("gdn in_proj_qkvz", 12288, 2048), ("gdn out_proj", 2048, 4096), ("attention q_proj", 8192, 2048),
          ("attention o_proj", 2048, 4096), ("lm_head", 151936, 2048)]
ROWS = [1, 8, 32, 128, 512]
DRY_SHAPES = [("small", 48, 40), ("odd", 70, 33)]
DRY_ROWS = [1, 5, 70]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def measure(n: int, k: int, rows: list[int], device: torch.device, dtype: torch.dtype, iters: int) -> list[dict]:
    from runtime.backends.kernels import matmul as triton_matmul

    g = torch.Generator().manual_seed(n * 31 + k)
    a_all = (torch.randn(max(rows), k, generator=g) * 0.5).to(device, dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device, dtype)  # a weight [N, K], multiplied transposed
    b = w.t()
    first_ours = triton_matmul.mm(a_all[:1], b)
    first_cublas = torch.mm(a_all[:1], b)
    out = []
    for m in rows:
        a = a_all[:m]
        ref = a.float().cpu() @ b.float().cpu()
        ours, cublas = triton_matmul.mm(a, b), torch.mm(a, b)
        row = {"M": m, "rel_err": rel(ours, ref), "cublas_rel_err": rel(cublas, ref),
               "row0_same_bits": bool(torch.equal(ours[:1], first_ours)),
               "cublas_row0_same_bits": bool(torch.equal(cublas[:1], first_cublas))}
        row["ours_ms"] = time_ms(lambda: triton_matmul.mm(a, b), device, iters)
        row["cublas_ms"] = time_ms(lambda: torch.mm(a, b), device, iters)
        row["ratio"] = row["ours_ms"] / row["cublas_ms"]
        out.append(row)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gemm_invariant_bench.json")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes: the script's own test")
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 50; 2 in a dry run)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    iters = args.iters or (2 if args.dry_run else 50)
    shapes, rows = (DRY_SHAPES, DRY_ROWS) if args.dry_run else (SHAPES, ROWS)
    rec = {"env": device_facts(args.dry_run), "dtype": str(dtype).replace("torch.", ""), "shapes": []}
    for what, n, k in shapes:
        rec["shapes"].append({"what": what, "N": n, "K": k, "rows": measure(n, k, rows, device, dtype, iters)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_invariant_bench.json").write_text(json.dumps(rec, indent=1))
    print(f"{'product':<18} {'N':>7} {'K':>5} {'M':>4} {'ours ms':>8} {'cuBLAS ms':>9} {'ratio':>6} "
          f"{'rel err':>8} {'row 0 same (ours/cuBLAS)':>25}")
    for s in rec["shapes"]:
        for r in s["rows"]:
            print(f"{s['what']:<18} {s['N']:>7} {s['K']:>5} {r['M']:>4} {r['ours_ms']:>8.4f} {r['cublas_ms']:>9.4f} "
                  f"{r['ratio']:>6.2f} {r['rel_err']:>8.1e} {str(r['row0_same_bits']) + '/' + str(r['cublas_row0_same_bits']):>25}")
    return rec


if __name__ == "__main__":
    main()
