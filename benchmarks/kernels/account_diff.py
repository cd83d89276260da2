"""Two step accounts of the same steps, kernel by kernel: what one bundle's options changed.

    python3 benchmarks/kernels/account_diff.py A/step_account.json B/step_account.json
    python3 benchmarks/kernels/account_diff.py \
        benchmarks/results/step_account_options_plain_h100_2026-12-06.json.gz \
        benchmarks/results/step_account_options_opts_h100_2026-12-06.json.gz

Reads two JSONs of benchmarks/kernels/step_account.py (gzipped or not) taken in one call, as an A/B
of bundles built with and without an option is (`gpu_measure.sh account_serving` with TAG). For each
step both accounts hold (decode B, extend T) it prints the two step times, then every kernel name
whose time in a step (all its launches summed) moved by --min-us or more: launches and us in each,
the change, and the ops the account labelled it with. A kernel one bundle lacks has 0 there, so an
option that swaps kernels shows as the kernels it removed and the ones it added. Kernel times are
the accounts' own (means over their calls); nothing is measured here.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

__all__ = ["load", "kernel_totals", "diff_steps", "main"]


def load(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def kernel_totals(step: dict) -> dict[str, tuple[int, float, frozenset]]:
    """name -> (launches, us summed, the ops it was labelled with) over one step's kernels."""
    launches, us, ops = defaultdict(int), defaultdict(float), defaultdict(set)
    for k in step["kernels"]:
        launches[k["name"]] += 1
        us[k["name"]] += k["us"]
        ops[k["name"]].add(k["label"][1])
    return {name: (launches[name], us[name], frozenset(ops[name])) for name in launches}


def _steps(doc: dict) -> dict[str, dict]:
    """'family decode B=n' / 'family extend T=n' -> that step's account."""
    out = {}
    for family, fam in doc["families"].items():
        for kind, label in (("decode", "B"), ("extend", "T")):
            for n, step in fam.get(kind, {}).items():
                if "kernels" in step:
                    out[f"{family} {kind} {label}={n}"] = step
    return out


def diff_steps(a: dict, b: dict, min_us: float) -> list[dict]:
    """Per step both accounts hold: {step, a_ms, b_ms, rows: [(name, a, b, change us, ops)]},
    rows by change, the ones that moved by min_us or more."""
    sa, sb = _steps(a), _steps(b)
    result = []
    for key in (k for k in sa if k in sb):
        ta, tb = kernel_totals(sa[key]), kernel_totals(sb[key])
        rows = []
        for name in sorted(set(ta) | set(tb)):
            na, ua, oa = ta.get(name, (0, 0.0, frozenset()))
            nb, ub, ob = tb.get(name, (0, 0.0, frozenset()))
            if abs(ub - ua) >= min_us:
                rows.append((name, (na, ua), (nb, ub), ub - ua, sorted(oa | ob)))
        rows.sort(key=lambda r: r[3])
        result.append({"step": key, "a_ms": sa[key]["step_ms"], "b_ms": sb[key]["step_ms"], "rows": rows})
    return result


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path, help="the first account's JSON (.json or .json.gz)")
    ap.add_argument("b", type=Path, help="the second account's JSON")
    ap.add_argument("--min-us", type=float, default=3.0, help="list kernels whose step time moved by this much")
    args = ap.parse_args(argv)
    steps = diff_steps(load(args.a), load(args.b), args.min_us)
    for s in steps:
        print(f"== {s['step']}: step {s['a_ms']:.3f} ms against {s['b_ms']:.3f} ms (A, B)")
        for name, (na, ua), (nb, ub), change, ops in s["rows"]:
            print(f"  {name[:64]:64s} {', '.join(ops):24s} {na:3d} {ua:9.1f} | {nb:3d} {ub:9.1f}  {change:+9.1f} us")
    return steps


if __name__ == "__main__":
    main()
