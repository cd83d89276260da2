"""The split-KV combine pass (runtime/backends/kernels/split_kv.py `_combine_kernel`) at each chunk of
partial rows it merges at a time.

The combine walks a row's partials a chunk at a time (`combine_chunk`: 4, or all 32 of a row of 32
splits), one loop iteration after another, each waiting for its own loads. In chunks of four, a
one-request decode step of bench qwen3_next (32 splits a GQA row) took eight iterations, 3.85 us a
launch on an H100 (step_account_options_h100_2026-12-06), where the one-tile combine before took
1.8 us on an H200. A wider chunk has fewer iterations and holds more registers ([CHUNK, Dv] float32
a program), which is what one tile cost an extend step's combine (2 splits, 4096 rows). Per chunk
and step shape:

1. `_combine_kernel` with that CHUNK (on 4 warps, the launch its H200 results were taken with) on
   fresh random partials (some splits empty, as a short row's are), checked against a float64 merge
   of the same partials (relative error of the norm);
2. timed in a CUDA graph (bench_common.graph_call_us).

    bash benchmarks/gpu_call.sh python3 benchmarks/probes/combine_chunk_probe.py --out $OUT
    python3 benchmarks/probes/combine_chunk_probe.py --dry-run --out /tmp/comb   # CPU: interpreted, small

Shapes: bench qwen3_next's GQA layer (16 query heads, head dim 256); rows and split counts as the
step accounts' steps launch them: decode 1 (32 splits), decode 128 (2), extend 512 and 4096 (2).
`--launches` times instead, at the chunk in use, each launch: heads a program (1, 2, 4, 8; a program
a row and head is 8,192 programs of 2 KiB of partials at 512 rows of 2 splits) and warps (1, 2, 4).
Writes OUT/combine_chunk_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # the kernel in Triton's interpreter, chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from bench_common import device_facts, graph_call_us, rel_err  # noqa: E402
from runtime.backends.kernels import split_kv  # noqa: E402
from runtime.backends.kernels.pdl import launch_args  # noqa: E402

CHECK_TOL = 1e-2  # bfloat16 outputs against the float64 merge
HEADS, DV = 16, 256
STEPS = {"decode_1": (1, 32), "decode_128": (128, 2), "extend_512": (512, 2), "extend_4096": (4096, 2)}
DRY_STEPS = {"decode_1": (1, 32), "extend_8": (8, 2)}
CHUNKS = (4, 8, 16, 32)


def partials(rows: int, splits: int, device, g: torch.Generator):
    """part_o [rows * H * splits, Dv] float32 and part_lse [rows * H * splits] (base 2), a quarter of
    the splits past the first empty (-inf), as a row shorter than the split count leaves them."""
    n = rows * HEADS * splits
    part_o = torch.randn(n, DV, generator=g)
    part_lse = torch.randn(n, generator=g) * 4
    empty = (torch.rand(rows * HEADS, splits, generator=g) < 0.25)
    empty[:, 0] = False
    part_lse = part_lse.view(rows * HEADS, splits).masked_fill(empty, float("-inf")).view(-1)
    return part_o.to(device), part_lse.to(device)


def reference(part_o, part_lse, rows: int, splits: int) -> torch.Tensor:
    o = part_o.double().cpu().view(rows, HEADS, splits, DV)
    lse = part_lse.double().cpu().view(rows, HEADS, splits)
    w = torch.exp2(lse - lse.max(-1, keepdim=True).values)
    return (w.unsqueeze(-1) * o).sum(2) / w.sum(-1, keepdim=True)


# --launches: (heads a program, warps) at the chunk in use; (1, 4) the launch before COMBINE_WARPS
LAUNCHES = [(h, w) for h in (1, 2, 4, 8) for w in (1, 2, 4)]
DRY_LAUNCHES = [(1, 4), (4, 1)]


def launch(chunk: int, part_o, part_lse, out, splits: int, heads: int = 1, warps: int = 4) -> None:
    rows = out.shape[0]
    split_kv._combine_kernel[(rows, HEADS // heads)](part_o, part_lse, out, out.stride(0), out.stride(1), HEADS,
                                                     splits, R=DV, MAX_SPLITS=split_kv.MAX_SPLITS, CHUNK=chunk,
                                                     HEADS=heads, num_warps=warps, **launch_args(out.device))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU: Triton's interpreter, small steps")
    p.add_argument("--launches", action="store_true",
                   help="instead of the chunks: heads a program (1, 2, 4, 8) and warps (1, 2, 4) at the chunk in use")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    doc = {"env": device_facts(args.dry_run), "steps": {}}
    g = torch.Generator().manual_seed(0)
    for name, (rows, splits) in (DRY_STEPS if args.dry_run else STEPS).items():
        part_o, part_lse = partials(rows, splits, device, g)
        want = reference(part_o, part_lse, rows, splits)
        row = doc["steps"][name] = {"rows": rows, "splits": splits, "in_use": split_kv.combine_chunk(splits)}
        variants = ([(f"heads_{h}_warps_{w}", row["in_use"], h, w)
                     for h, w in (DRY_LAUNCHES if args.dry_run else LAUNCHES)] if args.launches
                    else [(f"chunk_{chunk}", chunk, 1, 4) for chunk in CHUNKS])
        for label, chunk, heads, warps in variants:
            out = torch.empty(rows, HEADS, DV, dtype=torch.bfloat16, device=device)
            launch(chunk, part_o, part_lse, out, splits, heads, warps)
            err = rel_err(out, want)
            if err > CHECK_TOL:
                raise SystemExit(f"combine {label} at {name}: rel err {err:.2e} against the float64 merge")
            us = graph_call_us(lambda i: launch(chunk, part_o, part_lse, out, splits, heads, warps), 50, 20, device)
            row[label] = {"us": round(us, 3), "rel_err": err}
            print(f"{name:12s} {label}: {us:8.2f} us (rel err {err:.1e})", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "combine_chunk_probe.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())
