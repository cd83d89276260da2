"""Compile benchmark: wall time and peak memory of `hgc compile` on a family's `bench` checkpoint.

    python benchmarks/host/compile_bench.py --family qwen3_next [--workdir /tmp/hgc-bench] [--out results.json]

For each family asked for:

1. make the bench checkpoint with the family's own init (`hgc init-model --size bench`), once: it
   is reused from the work folder when present;
2. compile it in a fresh Python process (so nothing of step 1 is resident) and measure there:
   wall time of the compile, RSS after imports, peak RSS (getrusage ru_maxrss);
3. print one line per family and write every result as JSON.

Memory "beyond the weights": the compile never loads a weight tensor (tracing runs on the meta
device, weights are copied file to file in chunks), so the peak RSS of the compile process is all
memory beyond the weights; the weights' size is reported beside it. Targets: under 60 s wall
and under 2 GB beyond the weights on 2 CPU cores. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from models.families import FAMILY_IDS  # noqa: E402

# Runs in the child process: compile and report. Kept as source text so the child imports only
# what a real `hgc compile` imports.
_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {repo!r})
from hgc.wiring import toolchain
from compiler.passes.context import CompileConfig
from compiler.pipeline import compile_checkpoint
rss_import = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
result, manifest = compile_checkpoint({ckpt!r}, {out!r}, CompileConfig(), toolchain(), force=True, dumps={dumps!r})
wall = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rows = [[stage, program, seconds] for stage, program, seconds in result.timing.rows]
print(json.dumps({{"wall_s": wall, "rss_import_bytes": rss_import, "rss_peak_bytes": peak, "stages": rows,
                  "nodes": {{p: len(list(g.graph.nodes)) for p, g in result.ctx.programs.items()}}}}))
"""


def _weights_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))


def bench_family(family: str, workdir: Path, dumps: bool) -> dict:
    ckpt = workdir / f"{family}-bench"
    if not (ckpt / "config.json").is_file():
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hgc", "init-model", "--family", family, "--size", "bench",
                        "--seed", "0", "-o", str(ckpt), "--force"], cwd=REPO, check=True)
        print(f"{family}: bench checkpoint written in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    out = workdir / f"{family}-bench-artifact"
    code = _CHILD.format(repo=str(REPO), ckpt=str(ckpt), out=str(out), dumps=dumps)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{family}: compile failed:\n{proc.stderr[-4000:]}")
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    weights = _weights_bytes(ckpt)
    return {
        "family": family,
        "wall_s": round(child["wall_s"], 2),
        "rss_peak_mb": round(child["rss_peak_bytes"] / 2**20, 1),
        "rss_after_imports_mb": round(child["rss_import_bytes"] / 2**20, 1),
        "rss_growth_during_compile_mb": round((child["rss_peak_bytes"] - child["rss_import_bytes"]) / 2**20, 1),
        "beyond_weights_mb": round(child["rss_peak_bytes"] / 2**20, 1),  # no weight is ever resident
        "weights_mb": round(weights / 2**20, 1),
        "dumps": dumps,
        "graph_nodes": child["nodes"],
        "stages_s": {f"{s} {p}".strip(): round(t, 3) for s, p, t in child["stages"]},
        "within_targets": child["wall_s"] < 60 and child["rss_peak_bytes"] < 2 * 2**30,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", choices=FAMILY_IDS, help="repeatable; default: all four")
    parser.add_argument("--workdir", default="/tmp/hgc-bench", help="where checkpoints and artifacts go")
    parser.add_argument("--out", default=None, help="JSON results file (default: WORKDIR/compile_bench.json)")
    parser.add_argument("--no-dumps", action="store_true", help="compile without dumps/")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for family in args.family or FAMILY_IDS:
        r = bench_family(family, workdir, dumps=not args.no_dumps)
        results.append(r)
        print(f"{family:16s} compile {r['wall_s']:7.2f} s   peak RSS {r['rss_peak_mb']:8.1f} MB "
              f"(weights {r['weights_mb']:.0f} MB, never resident)   {'ok' if r['within_targets'] else 'OVER TARGET'}")
    doc = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
           "results": results}
    out = Path(args.out) if args.out else workdir / "compile_bench.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"results: {out}", file=sys.stderr)
    return 0 if all(r["within_targets"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
