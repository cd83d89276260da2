"""Host time of a replayed step before its graph launches: GraphRunner.build and the staging copy.

    python benchmarks/host/stage_host_bench.py --out /tmp/stb                          # CPU
    python benchmarks/host/stage_host_bench.py --out /tmp/stb --baseline-ref main      # before/after
    python benchmarks/host/stage_host_bench.py --out $OUT --device cuda                # GPU machine

For a step with a capture key, everything the host does between the scheduler's items and the
graph's launch is `runner.build(items)` (the layout, padded to the key) and `runner._fill(step, key)`
(the static buffers filled and sent: one host-to-device copy per dtype). On an idle engine that time
adds straight to a short prompt's time to first token (issue 49), the device waiting. Measured per key:

- decode_bB: B decoding requests of --context cached tokens each (B = 1, 8, 128);
- extend_t32: one 32-token prompt; extend_t512: four 128-token prompts.

Columns, each a median over --reps repetitions (perf_counter, the paths interleaved so a drifting
host speed hits them alike): `build`, `fill` and `total` (both, one call after the other) of the
runner's path; `host_built`: `build_step` padded to the key, then `_fill` copying its tensors in (the
path a step the runner did not lay out takes). --baseline-ref GITREF measures GITREF's code in a
process of its own (`git archive` into OUT/baseline-src), whose runner path is then the one of that
commit, and the table shows both. The layout does not depend on the model's size, so a tiny
Qwen3-Next (compiled for the CPU, never run) stands in; on cuda the static buffers and their copies
are real. JSON to OUT/stage_host_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))  # code_root
from code_root import code_root, unpacked  # noqa: E402

CODE = code_root(sys.argv[1:])
sys.path.insert(0, str(CODE))  # the runtime measured: first on the path

import torch

NAME = "stage_host_bench"
PAGE = 16
# (case, mode, requests, tokens per request)
CASES = (("decode_b1", "decode", 1, 1), ("decode_b8", "decode", 8, 1), ("decode_b128", "decode", 128, 1),
         ("extend_t32", "extend", 1, 32), ("extend_t512", "extend", 4, 128))
COLUMNS = ("build", "fill", "total", "host_built")


def artifact(work: Path) -> Path:
    """A tiny Qwen3-Next compiled for the CPU in `work` (kept for the next run)."""
    from hgc import main as hgc

    ckpt, art = work / "qwen3_next-tiny", work / "qwen3_next-tiny-art-cpu"
    if not (art / "manifest.json").is_file():
        if not (ckpt / "config.json").is_file():
            assert hgc(["init-model", "--family", "qwen3_next", "--size", "tiny", "--seed", "0", "-o", str(ckpt),
                        "--force"]) == 0
        assert hgc(["compile", str(ckpt), "-o", str(art), "--force", "--no-dumps", "--target", "cpu"]) == 0
    return art


def measure(art_dir: Path, device: torch.device, context: int, reps: int) -> dict:
    """Each case's medians in microseconds (COLUMNS), and its key."""
    from compiler.splitops import Mode
    from runtime.artifact.loader import load_artifact
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.cache.batch import SeqState, build_step
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner
    from runtime.step.bound_ops import BoundOps

    art = load_artifact(art_dir, device="cpu")
    out = {}
    for name, mode, requests, tokens in CASES:
        cached = context if mode == "decode" else 0
        kv, st = make_pools(art.registry, max(context, tokens) + PAGE, requests, page_size=PAGE)
        items = [(SeqState(st.alloc(), pages=kv.alloc(kv.pages_for(cached + tokens)), num_cached=cached),
                  [7] * tokens) for _ in range(requests)]
        ops = BoundOps(CPUReferenceBackend(kv, st))
        runner = GraphRunner(art.runner(ops), ops, kv, st, device, decode_buckets=(1, 8, 128),
                             extend_buckets=(32, 512), extend_max_seqs=32,
                             max_pages_per_seq=kv.pages_for(max(context, tokens) + PAGE))
        runner.sealed = True  # as after capture: build pads to the key; no graph is launched here
        step, key = runner.build(items)
        assert key is not None and key.mode == (Mode.DECODE if mode == "decode" else Mode.EXTEND), key
        del step

        times = {c: [] for c in COLUMNS}
        for _ in range(reps):  # interleaved: a drift of the host's speed hits both paths alike
            t0 = time.perf_counter()
            step, key = runner.build(items)
            t1 = time.perf_counter()
            runner._fill(step, key)
            t2 = time.perf_counter()
            del step  # as the engine does: the step is not held while the next is built
            host = build_step(items, kv, "cpu", mode=key.mode, pad_tokens_to=key.tokens, pad_seqs_to=key.seqs,
                              max_pages=runner.max_pages)
            runner._fill(host, key)
            t3 = time.perf_counter()
            for c, t in zip(COLUMNS, (t1 - t0, t2 - t1, t2 - t0, t3 - t2)):
                times[c].append(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out[name] = {"key": str(key), **{c: round(1e6 * statistics.median(t), 2) for c, t in times.items()}}
        print(f"  {name} ({key}): " + ", ".join(f"{c} {out[name][c]:.1f} us" for c in COLUMNS), flush=True)
    return out


def baseline(args, argv: list[str], art_dir: Path) -> dict:
    """This script over GITREF's code, in a process of its own, on the same artifact; its JSON record."""
    out = Path(args.out)
    src = unpacked(args.baseline_ref, out / "baseline-src")
    kept, skip = [], False
    for a in argv:  # this run's flags but those the baseline sets itself
        if skip:
            skip = False
        elif a in ("--baseline-ref", "--out", "--code-root", "--artifact"):
            skip = True
        elif not a.startswith(("--baseline-ref=", "--out=", "--code-root=", "--artifact=")):
            kept.append(a)
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, __file__, *kept, "--out", str(out / "baseline"), "--artifact", str(art_dir),
                    "--code-root", str(src)], env=env, check=True)
    return json.loads((out / "baseline" / f"{NAME}.json").read_text())


def table(rec: dict) -> str:
    base = (rec.get("baseline") or {}).get("cases", {})
    head = "| case | key | " + " | ".join(f"{c} us" for c in COLUMNS)
    head += " | baseline total us | baseline / now |" if base else " |"
    rows = [f"code: {rec['code']}, device {rec['device']}, {rec['reps']} reps", head,
            "|" + "---|" * (2 + len(COLUMNS) + (2 if base else 0))]
    for name, case in rec["cases"].items():
        row = f"| {name} | {case['key']} | " + " | ".join(f"{case[c]:.1f}" for c in COLUMNS)
        if name in base:
            row += f" | {base[name]['total']:.1f} | {base[name]['total'] / case['total']:.2f}x |"
        else:
            row += " |"
        rows.append(row)
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help=f"folder for {NAME}.json")
    p.add_argument("--work", default=None, help="folder for the tiny checkpoint and artifact (default: OUT/work)")
    p.add_argument("--artifact", default=None, help="a CPU-target artifact compiled already (default: compile one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--context", type=int, default=512, help="cached tokens of each decoding request")
    p.add_argument("--reps", type=int, default=2000)
    p.add_argument("--baseline-ref", default=None, help="also measure GITREF's code, in a process of its own")
    p.add_argument("--code-root", default=None, help=argparse.SUPPRESS)  # read before the imports
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    art_dir = Path(args.artifact) if args.artifact else artifact(Path(args.work or out / "work"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the host path is one thread
    try:
        rec = {"code": str(CODE), "device": args.device, "reps": args.reps, "context": args.context,
               "baseline_ref": args.baseline_ref,
               "cases": measure(art_dir, torch.device(args.device), args.context, args.reps)}
    finally:
        torch.set_num_threads(threads)
    (out / f"{NAME}.json").write_text(json.dumps(rec, indent=1))
    if args.baseline_ref:
        rec["baseline"] = baseline(args, argv, art_dir)
        (out / f"{NAME}.json").write_text(json.dumps(rec, indent=1))
    print(table(rec))
    return rec


if __name__ == "__main__":
    main()
