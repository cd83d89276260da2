"""Turn gpu_e2e.py's JSON into a PNG plot and the BENCHMARKS.md section text (it edits no file but its outputs).

    python benchmarks/plots/plot_e2e.py OUT/gpu_e2e.json --png e2e.png            # markdown to stdout
    python benchmarks/plots/plot_e2e.py OUT/gpu_e2e.json --png e2e.png --md e2e.md

The markdown: card, date, torch and command; per family a table (rows decode B, extend T over R
requests, mixed steps; columns our eager / piecewise / full graph, torch.compile, transformers
eager / static, floor, in ms), the eager gaps' share of each extend step, the mixed steps against
their chunk and decode steps alone, start-up (load+capture against torch.compile's warm-up and
transformers' static compile), and the issue's targets, met or missed with the number. The plot:
per family, step latency per row and column (log scale), and the start-up times. Runs on the CPU
machine (matplotlib); the markdown needs no matplotlib.

The row keys of the JSON are named and read here (`step_name`, `parse_step`; gpu_e2e.py imports
them), so this file reads what that one writes without importing torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# (JSON column, heading): the step latencies of gpu_e2e.py's "timings_ms", in table order
COLUMNS = (("eager", "eager"), ("piecewise", "piecewise"), ("full_graph", "full graph"),
           ("torch_compile", "torch.compile"), ("hf_eager", "transformers eager"),
           ("hf_static", "transformers static"), ("floor", "floor"))

# start-up bars in the colour of the step-latency column they belong to (full graph, torch.compile, static)
STARTUP_COLORS = {"load+capture": "C2", "torch.compile warm-up": "C3", "transformers static compile": "C5"}


KINDS = ("decode", "extend", "mixed")  # row kinds, in table order


def step_name(kind: str, n: int, m: int = 1) -> str:
    """The row key of a step in gpu_e2e.py's "timings_ms": decode of n requests ("decode_b8"),
    extend of n tokens over m fresh requests ("extend_t512", "extend_t512_r4": R = 1 has no
    suffix, as in the runs before it had), mixed step of n tokens with m decodes ("mixed_t2048_b8")."""
    if kind == "decode":
        return f"decode_b{n}"
    if kind == "extend":
        return f"extend_t{n}" + (f"_r{m}" if m > 1 else "")
    return f"mixed_t{n}_b{m}"


def parse_step(step: str) -> tuple[str, int, int]:
    """step_name's inverse: (kind, n, m); decode_b8 -> ("decode", 8, 1)."""
    kind, *fields = step.split("_")
    values = {f[0]: int(f[1:]) for f in fields}
    if kind == "decode":
        return kind, values["b"], 1
    return kind, values["t"], values.get("r" if kind == "extend" else "b", 1)


def step_label(step: str) -> str:
    """decode_b8 -> "decode B=8", extend_t512 -> "extend 512", extend_t512_r4 -> "extend 512 (4 requests)",
    mixed_t2048_b8 -> "mixed 2048 (8 decodes)"."""
    kind, n, m = parse_step(step)
    if kind == "decode":
        return f"decode B={n}"
    if kind == "extend":
        return f"extend {n}" + (f" ({m} requests)" if m > 1 else "")
    return f"mixed {n} ({m} decode{'s' if m > 1 else ''})"


def ordered_steps(timings: dict) -> list[str]:
    def key(step):
        kind, n, m = parse_step(step)
        return (KINDS.index(kind), n, m)
    return sorted(timings, key=key)


def fmt(value, digits: int = 3, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def startup(rec: dict) -> dict:
    """Start-up seconds: ours (load + capture of every bucket + parity), torch.compile's warm-up,
    transformers' static-cache compile summed over batch sizes."""
    hf = rec.get("transformers", {}).get("static_compile_s")
    return {"load+capture": rec.get("load_capture_s"),
            "torch.compile warm-up": rec.get("torch_compile", {}).get("warmup_s"),
            "transformers static compile": sum(hf.values()) if hf else None}


def family_markdown(family: str, rec: dict, size: str) -> list[str]:
    params = rec.get("params", 0)
    count = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    lines = [f"### {family} ({size}, {count} parameters, backend {rec.get('backend', '-')})", ""]
    if rec.get("fatal"):
        lines += [f"The run stopped: {rec['fatal']}", ""]
    bad = {k: v.get("error") or v.get("reason") for k, v in rec.get("stages", {}).items() if v["status"] != "ok"}
    if bad:
        lines += ["Stages skipped or failed: " + "; ".join(f"{k} ({v})" for k, v in bad.items()), ""]
    timings = rec.get("timings_ms", {})
    lines += ["| step (ms) | " + " | ".join(h for _, h in COLUMNS) + " |",
              "|---|" + "---:|" * len(COLUMNS)]
    for step in ordered_steps(timings):
        lines.append(f"| {step_label(step)} | " + " | ".join(fmt(timings[step].get(c)) for c, _ in COLUMNS) + " |")
    lines.append("")
    loop = {step: row["full_graph_loop"] for step, row in timings.items() if "full_graph_loop" in row}
    if loop:
        lines += ["Full graph with a serving loop's host work per token (step built on the host, argmax read "
                  "back), what the transformers target compares: " + ", ".join(
                      f"{step_label(s)} {ms:.3f} ms" for s, ms in loop.items()) + ".", ""]
    gaps = rec.get("extend_eager_gaps", {})
    if gaps:
        # keys: the step's name after "extend_t" ("512", "512_r4")
        lines += ["Eager pieces of a piecewise extend step: " + ", ".join(
            f"{step_label('extend_t' + T)} {g['fraction']:.1%} ({g['gap_ms']:.3f} of "
            f"{g['step_ms']:.3f} ms, {g['eager_pieces']} pieces)"
            for T, g in sorted(gaps.items(), key=lambda kv: parse_step("extend_t" + kv[0])[1:])) + ".", ""]
    mixed = rec.get("mixed", {})
    if mixed:
        lines += ["Mixed steps (B decodes of a 64-token history, then one fresh request's chunk filling the step to "
                  "its token count), against the chunk alone plus the decode step alone, each as the runner runs "
                  "it (ms):", "",
                  "| step | key | eager | graphs | eager gaps | chunk alone | decode alone | alone, summed | "
                  "graphs / alone |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for step in ordered_steps(mixed):
            m, t = mixed[step], timings.get(step, {})
            chunk, decode = m.get("chunk_alone", {}), m.get("decode_alone", {})
            lines.append(f"| {step_label(step)}, chunk {m['chunk_tokens']} | {m.get('key') or 'eager'} | "
                         f"{fmt(t.get('eager'))} | {fmt(t.get('piecewise'))} | "
                         f"{'-' if m.get('fraction') is None else format(m['fraction'], '.1%')} | "
                         f"{fmt(chunk.get('graphs'))} | {fmt(decode.get('graphs'))} | {fmt(m.get('alone_ms'))} | "
                         f"{fmt(m.get('graphs_over_alone'), 2)} |")
        lines.append("")
    times = startup(rec)
    start = rec.get("start", {})
    lines.append(f"Start-up: load+capture {fmt(times['load+capture'], 1, ' s')} (load {fmt(rec.get('load_s'), 1)}, "
                 f"capture of {len(start.get('keys', []))} buckets {fmt(start.get('capture_s'), 1)}, parity "
                 f"{fmt(start.get('parity_s'), 1)}); torch.compile warm-up "
                 f"{fmt(times['torch.compile warm-up'], 1, ' s')}"
                 + (f"; transformers static-cache compile {fmt(times['transformers static compile'], 1)} s over the "
                    f"batch sizes" if times["transformers static compile"] is not None else "") + ".")
    compiled = rec.get("torch_compile", {})
    if "tokens_vs_uncompiled" in compiled:
        c, n = compiled["counters"], compiled["tokens_vs_uncompiled"]
        lines.append(f"torch.compile: {c['unique_graphs']} graphs, {c['graph_breaks']} graph breaks, "
                     f"{c['cudagraph_skips']} cudagraph skips; greedy tokens vs the uncompiled model: "
                     f"{n['mismatched']} of {n['tokens']} differ.")
    hf = rec.get("transformers")
    if hf:
        lines.append(f"transformers {hf['version']}: fla installed {hf['fla_installed']}, causal_conv1d installed "
                     f"{hf['causal_conv1d_installed']}; kernel fallbacks it logged: "
                     + ("; ".join(m.split(". ")[0] for m in hf.get("kernel_messages", {})) or "none") + ".")
    tokens = rec.get("tokens_graph_vs_eager")
    if tokens:
        first = tokens["first_diff"]
        lines.append(f"Our graphs vs our eager steps: {tokens['mismatched']} of {tokens['tokens']} greedy tokens "
                     f"differ" + (f" (first at step {first})." if first is not None else "."))
    lines += ["", "| target | limit | measured | |", "|---|---|---:|---|"]
    for t in rec.get("targets", []):
        verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
        lines.append(f"| {t['target']} | {t['limit']} | {fmt(t['value'], 2)} | {verdict} |")
    return lines + [""]


def markdown(doc: dict) -> str:
    copy = doc.get("copy", {}).get("copy_bytes_per_s")
    lines = ["## End-to-end: hgc runtime vs torch.compile vs transformers", "",
             f"{doc['device']}, {doc['date']}, torch {doc['torch']}, transformers {doc.get('transformers', '-')}"
             + (f", copy bandwidth {copy / 1e12:.2f} TB/s (read + written)" if copy else "")
             + (" (dry run on a CPU: the numbers mean nothing)" if doc.get("dry_run") else "") + ".", "",
             f"    {doc['command']}", "",
             "Decode: one step of B requests with a 64-token history each; extend: a prefill of T tokens over R "
             "fresh requests (equal shares, the remainder on the first; R = 1 unless the row says); mixed: a step "
             "of T tokens holding B decodes and one request's prefill chunk; median ms. transformers: per token of "
             "`generate` (the step, sampling and its host loop), prefill = forward of the same T tokens as a batch "
             "of R rows (left-padded where the shares differ). Floor: bytes a decode step must read (weights with "
             "min(E, B x top_k) routed experts per layer, states read and written, KV) over the copy bandwidth.", ""]
    for family, rec in doc["families"].items():
        lines += family_markdown(family, rec, doc["size"])
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(doc["families"].items())
    fig, axes = plt.subplots(len(families), 2, figsize=(15, 4.5 * len(families)), squeeze=False,
                             gridspec_kw={"width_ratios": [4, 1]})
    for (family, rec), (ax, ax_start) in zip(families, axes):
        timings = rec.get("timings_ms", {})
        steps = ordered_steps(timings)
        width = 0.8 / len(COLUMNS)
        for i, (column, heading) in enumerate(COLUMNS):
            xs = [s + (i - len(COLUMNS) / 2 + 0.5) * width for s, step in enumerate(steps) if column in timings[step]]
            ys = [timings[step][column] for step in steps if column in timings[step]]
            if ys:
                ax.bar(xs, ys, width, label=heading, color=f"C{i}", hatch="//" if column == "floor" else None)
        ax.set_xticks(range(len(steps)), [step_label(s) for s in steps], rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{family} ({doc['size']})")
        ax.legend(fontsize=7, ncol=2)
        times = {k: v for k, v in startup(rec).items() if v is not None}
        ax_start.bar(range(len(times)), list(times.values()), color=[STARTUP_COLORS[k] for k in times])
        ax_start.set_xticks(range(len(times)), [k.replace(" ", "\n", 1) for k in times], fontsize=7)
        ax_start.set_ylabel("seconds")
        ax_start.set_title("start-up")
    fig.suptitle(f"{doc['device']}, {doc['date']}, torch {doc['torch']}" + (" (dry run)" if doc.get("dry_run") else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", help="gpu_e2e.json written by benchmarks/serving/gpu_e2e.py")
    p.add_argument("--png", help="write the plot here (needs matplotlib)")
    p.add_argument("--md", help="write the markdown section here (default: stdout)")
    args = p.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    text = markdown(doc)
    if args.md:
        Path(args.md).write_text(text + "\n")
    else:
        print(text)
    if args.png:
        plot(doc, Path(args.png))
        print(f"plot: {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
