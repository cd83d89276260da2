"""Per-kernel account of decode steps and per-op account of extend steps, against the card's rates (issues 50, 51).

On the GPU machine (benchmarks/gpu_call.sh installs the wheels), one call for two families:

    python3 benchmarks/kernels/step_account.py --out $OUT --family qwen3_next,kimi_linear   # traced glue
    python3 benchmarks/kernels/step_account.py --out $OUT --artifact ART   # a compiled artifact, its bundle
    python3 benchmarks/kernels/step_account.py --dry-run --out /tmp/acct   # CPU, tiny: the script's own test
    python3 benchmarks/kernels/step_account.py --out $OUT --compiled-pieces --batches 1 --torch-projections

--torch-projections: the same bundle with its projections on torch (runtime/backends/glue_kernels.py
`torch_only()` around the load, the captures and the steps): the A/B of the one-launch GEMV a cuda
bundle's glue calls for a decode step's few rows (docs/DESIGN.md, "Decode's projections as one GEMV
launch"). The traced glue never calls it, so the flag changes nothing without --compiled-pieces.

Per run, once: `rates`, the card's device-to-device copy rate and bf16 matmul rate in this run
(bench_common.device_rates: a 1 GiB copy_ and an 8192^3 GEMM). Per family:

1. load: the artifact (`--artifact`, or `hgc init-model` + `hgc compile` of --family at --size into
   --work: traced glue, or the target bundle with --compiled-pieces), bf16 KV pools, a GraphRunner
   with a whole-step decode graph per --batches and piecewise extend graphs per --extends (one
   request), captured (no start-up parity: this bench accounts, it does not check).
2. decode (issue 50), per batch B: B requests with a 64-token history and their next decode step,
   replayed as the engine runs it. Its time (CUDA events, median of --iters, each from an idle
   device) and its time queued (--iters steps issued without waiting, as the overlapped engine loop
   stages a step while the one before runs: the call's share, median of 5 runs); the kernels of
   --replays replays (torch.profiler; the kernels inside a CUDA graph replay are traced one by one
   on recent CUDA: the JSON says whether they were, and if not the step's eager run is profiled
   instead and the account says so), each position's mean time; each kernel's op and layer
   (account_trace.py: the program's FX nodes under profiler ranges in an eager run of the same
   step, matched to the replay by kernel names); each op's bytes (account_cost.py: weights from
   its parameters, states and KV from the pools' per-layer sizes and the step's lengths), its share
   of the copy rate, and the sum of kernel times against the floor (all bytes at the copy rate).
3. extend (issue 51), per T: one request's T-token prefill, run as the engine runs it (piecewise
   graphs), timed both ways as a decode step is; per op its FLOPs and bytes, time, share of the
   matrix and copy rates, and the sum against the floor (per op node the larger of its FLOP time
   and byte time, summed). Its bucket is laid out for one request, or for --extend-seqs N of them
   (a served artifact's extend buckets hold 256; the short ones, up to 128 tokens, keep a
   one-request key beside, and a one-request step takes it): the same step, with the grids a
   kernel sizes by the bucket's request rows.

--timeline: per step also where its time beyond its kernels goes (account_trace.timeline: the host's
time until `run` returns against the device's, the runner's staging and plan alone, synchronising
lines, the device's idle spans with the host ops during them, a Chrome trace per step in OUT), and
the step timed with a piecewise step's gap-only plans at their backend's first op (the default)
and before its first launch (`GraphRunner.defer_gap_plans`), alternated; the launches through the
Launcher a step and how many missed its cache. --timeline-stacks: the traces with each op's Python
stack (where an eager gap's host time goes; larger files).

Tables group ops by what they are across layers (`gemm linear_attn.in_proj_qkvz`, `moe`, `gdn_core`,
`gdn_fused` where the fusion pass made one GDN mixer op, `glue`...); the JSON (OUT/step_account.json) keeps every kernel in the order it ran with its label
and time, and every op node's (layer, what) cost. A dry run's numbers (CPU: the profiler's CPU ops
stand in for kernels) exercise the arithmetic and the attribution; they are not judged.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "benchmarks", ROOT / "benchmarks" / "kernels"):
    sys.path.insert(0, str(path))

import torch  # noqa: E402

from bench_common import (Stages, back_to_back_ms, compiled_artifact, decode_batch, device_facts,  # noqa: E402
                          device_rates, fmt, host_speed_ms, is_cuda, run_guarded, time_ms, verdict)
from account_cost import KEYS, cost  # noqa: E402
from account_trace import (StepFacts, UNMATCHED, align, labelled, node_labels, per_call,  # noqa: E402
                           profile_kernels, split_compiled, timeline)

PAGE = 16
HISTORY = 64  # tokens each decode request holds before the accounted step (as startup_bench and gpu_e2e)
GPU_DEFAULTS = dict(family="qwen3_next", size="bench", batches="1,128", extends="512,2048,4096", iters=20, replays=5)
DRY_DEFAULTS = dict(family="qwen3_next", size="tiny", batches="1,2", extends="64,128", iters=1, replays=2)
TOP_KERNELS = 12  # kernel names listed in the decode table, the costliest first
TINY_SHARE = 0.01  # ops under this share of a step's kernel time are one "tiny ops" row in the tables


# -- running a step ------------------------------------------------------------------------------


def build_runner(art_dir: Path, args, dev: torch.device):
    """The artifact loaded (its bundle used where it has one for this machine), pools, a captured GraphRunner."""
    from runtime.artifact.loader import load_artifact
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner

    art = load_artifact(art_dir, dev, programs=("main",))
    max_len = -(-max(max(args.extend_list), HISTORY + 1) // PAGE) * PAGE
    kv, st = make_pools(art.registry, max_len, max(*args.batch_list, args.extend_seqs), page_size=PAGE, device=dev,
                        kv_dtype=torch.bfloat16 if dev.type == "cuda" else None)
    ops = art.backends(kv, st).op_table("main")
    graphs = None
    if dev.type != "cuda":
        from testkit.graph_cases import RerunGraphs  # reruns the ops where CUDA graphs would replay
        graphs = RerunGraphs()
    runner = GraphRunner(art.runner(ops), ops, kv, st, dev, decode_buckets=tuple(args.batch_list),
                         extend_buckets=tuple(args.extend_list), max_pages_per_seq=max_len // PAGE,
                         extend_max_seqs=args.extend_seqs,
                         graphs=graphs)
    runner.capture()
    return art, runner, kv, st


def eager_run(runner, step, module):
    """The step run eagerly through `module`: the runner's own eager path (`run_outputs` with no
    key), reached into on purpose to run another module of the same plan (the traced glue where
    the runner runs compiled pieces)."""
    inputs, ctx = runner._fill(step, None)
    runner._plan(ctx, None)
    with runner.ops.step(ctx):
        return runner._call(module, inputs)


def plan_mode(runner, mode):
    from runtime.graphs.buckets import piecewise_plan_mode

    return mode if mode in runner.full_modes else piecewise_plan_mode(runner.program.plans, mode)


def account_step(runner, kv, st, step, key, args, dev) -> dict:
    """One step's kernels (as the runner runs it: `key`), each labelled, and every op's cost."""
    cuda = dev.type == "cuda"
    program, mode = runner.program, plan_mode(runner, step.ctx.mode)
    running = runner._module(step.ctx.mode)
    traced = program.module_for(mode, compiled=False)
    facts = StepFacts.of(step.ctx, kv, st, program.weights)
    # First, before any profiler: one can leave every later launch slower (bench_common, TEARDOWN_CUPTI)
    step_ms = time_ms(lambda: runner.run(step, key), dev, args.iters, warmup=3 if cuda else 1)
    # and as the overlapped engine loop runs steps: each staged while the one before runs
    queued_ms = back_to_back_ms(lambda: runner.run(step, key), dev, steps=args.iters, rounds=5 if cuda else 1)
    costs: dict = {}
    with labelled(traced, node_labels(program, mode, traced), costs, facts):
        eager_run(runner, step, traced)  # each op's cost, from its concrete tensors
    labels = node_labels(program, mode, running)
    with labelled(running, labels):
        if cuda:
            runner.run(step, None)  # warm-up: lazy allocations, kernel loads
        eager = profile_kernels(lambda: runner.run(step, None), cuda)[0]
    split_compiled(eager)
    if cuda:
        runner.run(step, key)
    timed, averaged = per_call(profile_kernels(lambda: runner.run(step, key), cuda, args.replays))
    timed_as = "replay" if key is not None else "eager"
    if not timed and key is not None:
        timed, averaged = per_call(profile_kernels(lambda: runner.run(step, None), cuda, args.replays))
        timed_as = "eager (the profiler reported no kernels inside the graph replay)"
    match = align(timed, eager)
    rec = {"key": str(key), "timed_as": timed_as, "kernel_times": averaged, "step_ms": step_ms,
           "queued_ms": queued_ms, "match": match, "kernels": timed,
           "costs": [{"layer": layer, "what": what, **c} for (layer, what), c in costs.items()]}
    if args.timeline:
        name = f"timeline_{step.ctx.mode.value}_{step.ctx.num_tokens}.json.gz"
        filled = {}
        phases = {"fill": lambda: filled.update(ctx=runner._fill(step, key)[1]),
                  "plan": lambda: runner._plan(filled["ctx"], key)}  # the fill's ctx, as run_outputs plans it
        rec["timeline"] = timeline(lambda: runner.run(step, key), cuda, Path(args.out) / name if cuda else None,
                                   phases, stacks=args.timeline_stacks)
        if cuda:  # the step with the gaps' plans after (the default) and before the first launch, alternated
            times: dict = {True: [], False: []}
            try:
                for defer in (True, False, True, False):
                    runner.defer_gap_plans = defer
                    times[defer].append(time_ms(lambda: runner.run(step, key), dev, args.iters))
            finally:
                runner.defer_gap_plans = True
            rec["timeline"].update(step_ms_gap_plans_deferred=times[True], step_ms_gap_plans_first=times[False])
    return rec


# -- the account ---------------------------------------------------------------------------------


def op_rows(record: dict, rates: dict, extend: bool) -> list[dict]:
    """One row per op node (layer, what): its kernels' time, its cost, its floor and shares."""
    copy, matrix = rates["copy_bytes_per_s"], rates["matmul_flops_per_s"]
    rows: dict = {}
    for c in record["costs"]:
        rows[(c["layer"], c["what"])] = {**c, "us": 0.0, "kernels": 0, "names": {}}
    for k in record["kernels"]:
        layer, what = k["label"] or UNMATCHED
        row = rows.setdefault((layer, what), {"layer": layer, "what": what, **cost(), "us": 0.0, "kernels": 0,
                                              "names": {}})
        row["us"] += k["us"]
        row["kernels"] += 1
        row["names"][k["name"]] = row["names"].get(k["name"], 0.0) + k["us"]
    for row in rows.values():
        row["byte_ms"] = row["bytes"] / copy * 1e3
        row["flop_ms"] = row["flops"] / matrix * 1e3
        row["floor_ms"] = max(row["byte_ms"], row["flop_ms"]) if extend else row["byte_ms"]
    return list(rows.values())


def summarize(rows: list[dict], rates: dict) -> dict:
    """Rows of the same `what` over every layer, the costliest first, and the step's totals."""
    by_what: dict = {}
    for r in rows:
        g = by_what.setdefault(r["what"], {"what": r["what"], "ops": 0, "kernels": 0, "us": 0.0, **cost(),
                                           "floor_ms": 0.0, "names": {}})
        g["ops"] += 1
        for key in ("kernels", "us", *KEYS, "floor_ms"):
            g[key] += r[key]
        for name, us in r["names"].items():
            g["names"][name] = g["names"].get(name, 0.0) + us
    groups = sorted(by_what.values(), key=lambda g: -g["us"])
    kernel_ms = sum(g["us"] for g in groups) / 1e3
    for g in groups:
        g["ms"] = g["us"] / 1e3
        seconds = g["ms"] / 1e3
        g["copy_share"] = g["bytes"] / seconds / rates["copy_bytes_per_s"] if seconds else None
        g["matrix_share"] = g["flops"] / seconds / rates["matmul_flops_per_s"] if seconds else None
        g["main_kernels"] = [n for n, _ in sorted(g.pop("names").items(), key=lambda kv: -kv[1])[:2]]
    floor = sum(g["floor_ms"] for g in groups)
    return {"groups": groups, "kernel_ms": kernel_ms, "bytes": sum(g["bytes"] for g in groups),
            "unfused_glue_bytes": sum(g["unfused"] for g in groups),
            "flops": sum(g["flops"] for g in groups), "floor_ms": floor,
            "over_floor": kernel_ms / floor if floor else None}


def top_kernels(kernels: list[dict], n: int = TOP_KERNELS) -> list[dict]:
    """Kernel names by their time per step over every launch, with the ops that launched them."""
    by_name: dict = {}
    for k in kernels:
        row = by_name.setdefault(k["name"], {"name": k["name"], "launches": 0, "us": 0.0, "ops": set()})
        row["launches"] += 1
        row["us"] += k["us"]
        row["ops"].add((k["label"] or UNMATCHED)[1])
    rows = sorted(by_name.values(), key=lambda r: -r["us"])[:n]
    return [{**r, "ms": r["us"] / 1e3, "ops": sorted(r["ops"])} for r in rows]


def account(record: dict, rates: dict, extend: bool) -> dict:
    rows = op_rows(record, rates, extend)
    summary = summarize(rows, rates)
    record.update(ops=rows, summary=summary, top_kernels=top_kernels(record["kernels"]),
                  kernels_per_step=len(record["kernels"]))
    return record


# -- tables --------------------------------------------------------------------------------------


def _grouped(groups: list[dict], total_ms: float, rates: dict) -> list[dict]:
    """The groups, those under TINY_SHARE of the step's kernel time folded into one row."""
    big = [g for g in groups if total_ms and g["ms"] >= TINY_SHARE * total_ms]
    tiny = [g for g in groups if g not in big]
    if tiny:
        row = {"what": f"tiny ops ({len(tiny)} kinds)", "main_kernels": []}
        for key in ("ops", "kernels", "ms", "flops", "bytes", "floor_ms"):
            row[key] = sum(g[key] for g in tiny)
        seconds = row["ms"] / 1e3
        row["copy_share"] = row["bytes"] / seconds / rates["copy_bytes_per_s"] if seconds else None
        row["matrix_share"] = row["flops"] / seconds / rates["matmul_flops_per_s"] if seconds else None
        big.append(row)
    return big


def decode_table(name: str, rec: dict, rates: dict, dry: bool) -> list[str]:
    s = rec["summary"]
    lines = [f"### {name}: decode B={rec['batch']} ({rec['timed_as']}, {rec['kernels_per_step']} kernels, step "
             f"{rec['step_ms']:.3f} ms{_queued(rec)})", "",
             "| op | ops | kernels | kernel ms | MB | floor ms | % copy rate | main kernel |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for g in _grouped(s["groups"], s["kernel_ms"], rates):
        share = fmt(g["copy_share"] * 100 if g.get("copy_share") is not None else None, ".0f")
        lines.append(f"| {g['what']} | {g['ops']} | {g['kernels']} | {g['ms']:.4f} | {g['bytes'] / 1e6:.2f} | "
                     f"{g['floor_ms']:.4f} | {share} | {(g['main_kernels'] or [''])[0][:60]} |")
    lines.append(f"| **sum** | | {rec['kernels_per_step']} | {s['kernel_ms']:.4f} | {s['bytes'] / 1e6:.2f} | "
                 f"{s['floor_ms']:.4f} | {fmt(100 / s['over_floor'] if s['over_floor'] else None, '.0f')} | "
                 f"kernels {fmt(s['over_floor'], '.2f')}x the floor ({verdict(None, dry) if dry else 'measured'}) |")
    lines += ["", _notes(rec), "", "| kernel | launches | ms | ops |", "|---|---:|---:|---|"]
    lines += [f"| {k['name'][:70]} | {k['launches']} | {k['ms']:.4f} | {', '.join(k['ops'])[:60]} |"
              for k in rec["top_kernels"]]
    return lines


def extend_table(name: str, rec: dict, rates: dict, dry: bool) -> list[str]:
    s = rec["summary"]
    lines = [f"### {name}: extend {rec['tokens']} tokens, 1 request ({rec['timed_as']}, {rec['kernels_per_step']} "
             f"kernels, step {rec['step_ms']:.3f} ms{_queued(rec)})", "",
             "| op | ops | kernels | kernel ms | GFLOP | MB | floor ms | % matrix rate | % copy rate |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in _grouped(s["groups"], s["kernel_ms"], rates):
        matrix = fmt(g["matrix_share"] * 100 if g.get("matrix_share") is not None else None, ".0f")
        copy = fmt(g["copy_share"] * 100 if g.get("copy_share") is not None else None, ".0f")
        lines.append(f"| {g['what']} | {g['ops']} | {g['kernels']} | {g['ms']:.4f} | {g['flops'] / 1e9:.2f} | "
                     f"{g['bytes'] / 1e6:.2f} | {g['floor_ms']:.4f} | {matrix} | {copy} |")
    lines.append(f"| **sum** | | {rec['kernels_per_step']} | {s['kernel_ms']:.4f} | {s['flops'] / 1e9:.2f} | "
                 f"{s['bytes'] / 1e6:.2f} | {s['floor_ms']:.4f} | kernels {fmt(s['over_floor'], '.2f')}x the floor "
                 f"({verdict(None, dry) if dry else 'measured'}) | |")
    return lines + ["", _notes(rec)]


def _queued(rec: dict) -> str:
    """The step queued behind another (the engine loop's steady state) where the record has it."""
    return f", {rec['queued_ms']:.3f} ms queued" if rec.get("queued_ms") is not None else ""


def _notes(rec: dict) -> str:
    s, m = rec["summary"], rec["match"]
    return (f"Glue moves {s['unfused_glue_bytes'] / 1e6:.1f} MB between its unfused ops (not in the floor). "
            f"Kernels labelled by their eager twins: {m['matched_by_name']} by name, {m['matched_by_position']} by "
            f"position, {m['unmatched']} unmatched; kernel times: {rec['kernel_times']}.")


def tables(doc: dict) -> str:
    dry = bool(doc["config"]["dry_run"])
    rates = doc.get("rates") or {}
    out = [f"## step account ({doc['env'].get('device')}; copy {fmt(rates.get('copy_bytes_per_s', 0) / 1e9, '.0f')} "
           f"GB/s, matmul {fmt(rates.get('matmul_flops_per_s', 0) / 1e12, '.0f')} TFLOP/s"
           f"{'; host ' + fmt(doc['env']['host_speed_ms'], '.2f') + ' ms' if 'host_speed_ms' in doc['env'] else ''}"
           f"{'; projections on torch (--torch-projections)' if doc['config'].get('torch_projections') else ''}"
           f"{'; dry run: CPU ops stand in for kernels, numbers not judged' if dry else ''})", ""]
    for family, rec in doc["families"].items():
        for B, r in rec.get("decode", {}).items():
            out += decode_table(family, r, rates, dry) + [""]
        for T, r in rec.get("extend", {}).items():
            out += extend_table(family, r, rates, dry) + [""]
        failed = {n: s["error"].splitlines()[0][:200] for n, s in rec.get("stages", {}).items()
                  if s.get("status") == "error"}
        if failed or rec.get("fatal"):
            out.append(f"{family}: failed {failed or rec.get('fatal')}")
    return "\n".join(out)


# -- the script ----------------------------------------------------------------------------------


def timeline_text(tl: dict) -> str:
    """A step's timeline (account_trace.timeline) in a few lines for the log."""
    if not tl:
        return ""
    lines = [f"    step ms, the gaps' plans at their first op {tl['step_ms_gap_plans_deferred']}, before the first "
             f"launch {tl['step_ms_gap_plans_first']}",
             f"    host {tl['host_call_us']:.0f} us to return, device {tl['device_call_us']:.0f} us; host phases "
             f"{ {k: round(v) for k, v in tl['phases_us'].items()} }; syncs {tl['syncs']}; Launcher launches "
             f"{tl['launcher_launches']:.0f}, {tl['launcher_misses']:.0f} of them missed",
             f"    profiled: wall {tl['profiled_wall_us']:.0f} us, device busy {tl['device_busy_us']:.0f}, idle "
             f"{tl['device_idle_us']:.0f} (before the first kernel {tl['idle_before_first_us']:.0f}, after the last "
             f"{tl['idle_after_last_us']:.0f}, {tl['gaps_count']} gaps of {tl['gaps_at_least_us']:.0f} us or more: "
             f"{tl['gaps_sum_us']:.0f})"]
    lines += [f"      gap {g['us']:.0f} us at {g['at_us']:.0f}: after {g['after']!r}, before {g['before']!r}; host "
              f"{g['host']}" for g in tl["longest_gaps"][:6]]
    return "\n".join(lines)


def run_family(family: str, args, doc: dict, save) -> None:
    from runtime.cache.batch import SeqState

    dev = torch.device("cuda" if not args.dry_run and is_cuda() else "cpu")
    rec = doc["families"].setdefault(family, {"stages": {}})
    stage = Stages(rec["stages"], skip=args.skip, save=save)
    ctx: dict = {}

    def load():
        fam_args = types.SimpleNamespace(**{**vars(args), "family": family})
        art_dir = Path(args.artifact) if args.artifact else compiled_artifact(fam_args)
        art, runner, kv, st = build_runner(art_dir, args, dev)
        ctx.update(art=art, runner=runner, kv=kv, st=st, vocab=int(art.manifest["model"]["vocab_size"]))
        rec.update(artifact=str(art_dir), compiled_bundle=art.compiled is not None, keys=[str(k) for k in runner.keys],
                   gemv_projections=art.compiled.doc.get("small_m_linear") if art.compiled else None)
    stage("load", load)
    g = torch.Generator().manual_seed(0)

    def decode(B):
        runner = ctx["runner"]
        with decode_batch(runner, ctx["st"], B, ctx["vocab"], g, HISTORY) as items:
            step, key = runner.build(items)
            r = account_step(runner, ctx["kv"], ctx["st"], step, key, args, dev)
        r["batch"] = B
        rec.setdefault("decode", {})[str(B)] = account(r, doc["rates"], extend=False)
        s = r["summary"]
        print(f"  decode B={B}: {r['kernels_per_step']} kernels, {s['kernel_ms']:.3f} ms of kernels against a "
              f"{s['floor_ms']:.3f} ms floor; step {r['step_ms']:.3f} ms{_queued(r)}; {r['match']}", flush=True)
        if r.get("timeline"):
            print(timeline_text(r["timeline"]), flush=True)

    def extend(T):
        runner, st = ctx["runner"], ctx["st"]
        seq = SeqState(st.alloc())
        try:
            step, key = runner.build([(seq, torch.randint(1, ctx["vocab"], (T,), generator=g).tolist())])
            r = account_step(runner, ctx["kv"], st, step, key, args, dev)
        finally:
            runner.kv_pool.free(seq.pages)
            st.free(seq.slot)
        r["tokens"] = T
        rec.setdefault("extend", {})[str(T)] = account(r, doc["rates"], extend=True)
        s = r["summary"]
        print(f"  extend T={T}: {r['kernels_per_step']} kernels, {s['kernel_ms']:.3f} ms of kernels against a "
              f"{s['floor_ms']:.3f} ms floor; step {r['step_ms']:.3f} ms{_queued(r)}; {r['match']}", flush=True)
        if r.get("timeline"):
            print(timeline_text(r["timeline"]), flush=True)

    for B in args.batch_list:
        stage(f"decode_b{B}", decode, B, needs=["load"])
    for T in args.extend_list:
        stage(f"extend_t{T}", extend, T, needs=["load"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for step_account.json")
    p.add_argument("--work", default=None, help="folder for checkpoints and artifacts (default: OUT/work)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny size, reference backend: the script's own test")
    p.add_argument("--family", help="families, comma-separated: qwen3_next (default), kimi_linear, bailing_linear, ...")
    p.add_argument("--size", help=f"default {GPU_DEFAULTS['size']} ({DRY_DEFAULTS['size']} with --dry-run)")
    p.add_argument("--batches", help="decode batch sizes (default 1,128)")
    p.add_argument("--extends", help="extend token counts, one request each (default 512,2048,4096)")
    p.add_argument("--extend-seqs", type=int, default=1,
                   help="request rows of the extend buckets (default 1; a served artifact's hold 256): the same "
                        "one-request step replayed in a bucket laid out for that many requests (above 128 tokens: "
                        "the short buckets keep a one-request key)")
    p.add_argument("--iters", type=int, help="timed steps per step time (median)")
    p.add_argument("--replays", type=int, help="profiled calls per step (each kernel's mean over them)")
    p.add_argument("--artifact", default=None,
                   help="an artifact to account (with its target bundle where it has one for this machine) instead "
                        "of compiling --family; one family then")
    p.add_argument("--compiled-pieces", action="store_true",
                   help="compile with the target bundle (Inductor-compiled glue, every kernel built ahead; minutes on "
                        "the GPU); default: the traced glue")
    p.add_argument("--route", action="append", default=[], help="passed to hgc compile --route (repeatable)")
    p.add_argument("--torch-projections", action="store_true",
                   help="the compiled glue's projections on torch's F.linear instead of the one-launch GEMV (the A/B "
                        "of runtime/backends/glue_kernels.py; with --compiled-pieces or a bundled --artifact)")
    p.add_argument("--timeline", action="store_true",
                   help="also one profiled run of each step with the host: the device's idle spans, the longest "
                        "listed with the host ops during them, and a Chrome trace per step (OUT/timeline_*.json.gz)")
    p.add_argument("--timeline-stacks", action="store_true",
                   help="with --timeline: the traces carry each op's Python stack (where a gap's host time goes)")
    p.add_argument("--skip", default="", help="stages to skip, comma-separated (load, decode_bB, extend_tT)")
    args = p.parse_args(argv)
    if args.timeline_stacks and not args.timeline:
        p.error("--timeline-stacks: it adds the stacks to --timeline's traces; pass --timeline too")
    for key, value in (DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.batch_list = [int(b) for b in args.batches.split(",")]
        args.extend_list = [int(t) for t in args.extends.split(",")]
    except ValueError:
        p.error(f"--batches {args.batches} / --extends {args.extends}: comma-separated integers")
    families = [f for f in args.family.split(",") if f]
    if args.artifact and len(families) > 1:
        p.error("--artifact: one artifact is one family; give one --family (or none)")
    if args.compiled_pieces and len(families) > 1:
        # A bundle points FlashInfer's module cache at its own copy before anything imports FlashInfer
        # (runtime/artifact/bundle.py), so a second family's bundle cannot load in the same process.
        p.error(f"--compiled-pieces: one family per run (each bundle must load before FlashInfer is imported); "
                f"run the script once for each of {','.join(families)}")
    if args.artifact and not (Path(args.artifact) / "manifest.json").is_file():
        p.error(f"--artifact {args.artifact}: no manifest.json there")
    if not args.dry_run and not is_cuda():
        p.error("no CUDA device: run with --dry-run on the CPU")
    args.skip = [s for s in args.skip.split(",") if s]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.work = args.work or str(out / "work")
    args.dtype, args.config, args.batch_invariant = None, None, False  # what bench_common.compiled_artifact reads
    # A step's time between its kernels is host time (staging, launches), and lent machines' hosts
    # differ: a fixed pure-Python workload's time beside it says whether two accounts' hosts compare.
    doc = {"env": {**device_facts(args.dry_run), "host_speed_ms": host_speed_ms()},
           "config": {k: v for k, v in vars(args).items()}, "stages": {}, "families": {}}
    path = out / "step_account.json"

    def save():
        path.write_text(json.dumps(doc, indent=1, default=str))

    Stages(doc["stages"], save=save)("rates", lambda: doc.__setitem__("rates", device_rates()))
    if "rates" not in doc:
        raise SystemExit("could not measure the card's rates: every floor needs them (see the traceback above)")
    from runtime.backends import glue_kernels

    # The op's kernel chooses when a piece runs or is captured: the switch holds over every capture and step.
    with glue_kernels.torch_only() if args.torch_projections else contextlib.nullcontext():
        for family in families:
            run_guarded(family, doc["families"].setdefault(family, {"stages": {}}),
                        lambda family=family: run_family(family, args, doc, save))
    save()
    text = tables(doc)
    (out / "step_account.md").write_text(text + "\n")
    print(text)
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
