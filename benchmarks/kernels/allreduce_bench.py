"""All-reduce latency on the GPUs of one host: NCCL against the symmetric-memory one-shot kernel.

    python3 benchmarks/kernels/allreduce_bench.py --out $OUT            # two GPUs (--world N for more)

First the check (testkit/collective_checks.check_against_nccl: every path against NCCL's sums,
eager and in graph replays); nothing is timed if it fails. Then per message size (bf16), on
every rank at once: one CUDA graph of --calls back-to-back all-reduces of one tensor, replayed
--iters times between CUDA events; the median replay over the calls is the time of one
all-reduce as a decode graph runs it (launched from a graph, one after another). Rows: NCCL
(`dist.all_reduce`) and the one-shot kernel (runtime/backends/collectives.SymmMemAllReduce
with a buffer as large as the largest size, so the crossover is measured, not assumed), and
their ratio. Decode steps of a 2048-wide model all-reduce 4 KiB a request. JSON to
OUT/allreduce_bench.json, a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from testkit.collective_checks import check_against_nccl, run_ranks  # noqa: E402

SIZES_KIB = (4, 16, 64, 256, 512, 1024, 2048, 4096, 8192)


def time_sizes(rank: int, world: int, device: torch.device, calls: int = 32, iters: int = 20) -> list[dict]:
    import torch.distributed as dist

    from runtime.backends.collectives import SymmMemAllReduce

    one_shot = SymmMemAllReduce.with_buffer(world, max(SIZES_KIB) << 10, device)
    paths = {"nccl": lambda t: dist.all_reduce(t), "one_shot": lambda t: one_shot.all_reduce(None, t, 0)}
    rows = []
    for kib in SIZES_KIB:
        row = {"kib": kib}
        for name, reduce in paths.items():
            # Values stay finite over calls x (iters + warm-up) doublings only if they start small.
            x = torch.full(((kib << 10) // 2,), 2.0 ** -100, device=device, dtype=torch.bfloat16)
            reduce(x)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    reduce(x)
            times = []
            for i in range(iters + 3):
                x.fill_(2.0 ** -100)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                if i >= 3:
                    times.append(start.elapsed_time(end) * 1e3 / calls)
            row[f"{name}_us"] = round(statistics.median(times), 2)
        row["nccl_over_one_shot"] = round(row["nccl_us"] / row["one_shot_us"], 2)
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--world", type=int, default=2, help="ranks (GPUs of this host)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "world": args.world}
    checks = run_ranks(check_against_nccl, world=args.world)
    bad = [r for rows in checks for r in rows if not r["ok"]]
    report["check"] = {"rows": sum(len(r) for r in checks), "failed": bad}
    print(f"check against NCCL: {report['check']['rows']} rows, {len(bad)} failed", flush=True)
    if not bad:
        report["timings"] = run_ranks(time_sizes, world=args.world)[0]
    (args.out / "allreduce_bench.json").write_text(json.dumps(report, indent=1))
    if bad:
        print(json.dumps(bad[:5], indent=1))
        return 1
    print(f"{'KiB':>6} {'NCCL us':>9} {'one-shot us':>12} {'ratio':>6}")
    for r in report["timings"]:
        print(f"{r['kib']:>6} {r['nccl_us']:>9.2f} {r['one_shot_us']:>12.2f} {r['nccl_over_one_shot']:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
