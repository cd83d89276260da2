"""Decode step latency per batch size from startup_bench.py's JSON, one panel per family, as a PNG.

    python benchmarks/plots/plot_decode.py --png decode.png \
        qwen3_next=benchmarks/results/startup_bench_qwen3_next_teardown_h200_2026-11-28.json \
        kimi_linear=benchmarks/results/startup_bench_kimi_linear_teardown_h200_2026-11-28.json \
        --before qwen3_next=benchmarks/results/gpu_e2e_qwen3_next_h200_2026-11-26.json

Each panel: the built artifact's full-graph decode step and its piecewise step (`variants.compiled.
decode`), transformers' compiled static-cache decode where the run has it (`transformers.hf_static`),
all from one run on one card; and, with --before, the full-graph step of an earlier gpu_e2e.py run
(`families.F.timings_ms.decode_bB.full_graph`), labelled with that run's date and model size, which
may differ from the run's own. Milliseconds per step, both axes log scale. Runs on the CPU machine
(matplotlib); it reads the files and writes the PNG, nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


COLORS = {"full": "C0", "piecewise": "C1", "transformers": "C2", "before": "C3"}


def _pairs(items: list[str], flag: str) -> dict[str, Path]:
    out = {}
    for item in items:
        family, sep, path = item.partition("=")
        if not sep or not family or not path:
            raise SystemExit(f"plot_decode: {flag} takes FAMILY=FILE, got {item!r}")
        out[family] = Path(path)
    return out


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"plot_decode: {path}: {e}") from None


def series(run: dict, before: dict | None, family: str) -> dict[str, dict[int, float]]:
    """label -> {batch: ms} for one family's panel."""
    decode = run.get("variants", {}).get("compiled", {}).get("decode")
    if not decode:
        raise SystemExit(f"plot_decode: {family}: the run has no variants.compiled.decode timings")
    out = {"full graph (compiled pieces)": {int(b): r["step_ms"] for b, r in decode.items()},
           "piecewise (compiled pieces)": {int(b): r["piecewise_ms"] for b, r in decode.items()
                                           if r.get("piecewise_ms") is not None}}
    hf = ((run.get("transformers") or {}).get("hf_static") or {}).get("per_batch") or {}
    if hf:
        out["transformers static-cache compiled"] = {int(b): r["decode_ms"] for b, r in hf.items()
                                                     if r.get("decode_ms") is not None}
    if before is not None:
        timings = before.get("families", {}).get(family, {}).get("timings_ms", {})
        rows = {int(k.removeprefix("decode_b")): v["full_graph"] for k, v in timings.items()
                if k.startswith("decode_b") and v.get("full_graph") is not None}
        if not rows:
            raise SystemExit(f"plot_decode: {family}: the --before file has no decode full-graph timings for it")
        out[f"before: full graph, traced glue ({before.get('date', '?')[:10]}, size {before.get('size')})"] = rows
    return {label: s for label, s in out.items() if s}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="FAMILY=FILE", help="startup_bench.py JSON per family")
    p.add_argument("--before", action="append", default=[], metavar="FAMILY=FILE",
                   help="gpu_e2e.py JSON whose full-graph decode is drawn as the earlier numbers")
    p.add_argument("--png", type=Path, required=True, help="where the plot goes")
    args = p.parse_args(argv)
    runs, befores = _pairs(args.runs, "a run"), _pairs(args.before, "--before")
    unknown = sorted(set(befores) - set(runs))
    if unknown:
        raise SystemExit(f"plot_decode: --before names {unknown}, which no run names")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.2), squeeze=False)
    for ax, (family, path) in zip(axes[0], runs.items()):
        run = _read(path)
        before = _read(befores[family]) if family in befores else None
        for label, points in series(run, before, family).items():
            batches = sorted(points)
            kind = label.split()[0].rstrip(":")  # one colour per kind of line in every panel
            ax.plot(batches, [points[b] for b in batches], marker="o", label=label, color=COLORS[kind],
                    linestyle="--" if kind == "before" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch (requests per decode step)")
        ax.set_ylabel("ms per decode step")
        ax.set_title(f"{family} ({run.get('size')}), {run.get('device', '?')}, {str(run.get('date', '?'))[:10]}",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"plot_decode: wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
