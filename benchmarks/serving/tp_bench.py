"""Tensor-parallel benchmark: the full-size Qwen3-Next-80B-A3B and Kimi-Linear-48B-A3B architectures
from their published configs, with dummy weights, at TP 2 (one GPU per rank) in one process-group
launch; and the bench-size Qwen3-Next at TP 2 against TP 1, tokens compared.

On the GPU machine (2 GPUs; the 80B model needs more than 78 GiB a rank at TP 2: two H200s):

    bash benchmarks/gpu_call.sh python3 benchmarks/serving/tp_bench.py --out $OUT
    python benchmarks/serving/tp_bench.py --dry-run --out /tmp/tpb     # CPU: tiny configs, float32, gloo,
                                                                # graphs rerun (testkit/graph_cases.py)

The parent process (no CUDA of its own):
1. configs: the published config.json of each full-size release (--configs, default the repo's
   copies in tests/configs, SOURCES.md there says where each came from) and the bench-size
   Qwen3-Next config (`hgc init-model --size bench`'s), each alone in a folder: nothing else is read.
2. compile: `hgc compile --no-weights --no-inductor --tp N --target cuda --dtype bfloat16` of
   each, decode buckets --batches, one small extend bucket, all at once in subprocesses. With
   --compiled-pieces, then `hgc build ART --device cuda` of each, one after another (a TP 2 build
   launches its two ranks, each compiling the glue for its own GPU): the runs then load the
   compiled pieces (the report's `compiled_pieces` per model; 0 where its build failed).
3. tp1: the bench-size artifact compiled for one process, run by one worker on GPU 0.
4. tpN: one launch of N ranks (runtime/dist/launcher.py, as `hgc run --tp N` starts them); rank r on
   GPU r; every rank builds each model's engine in turn (dummy weights made on its GPU, its pools,
   CUDA graphs captured with the all-reduces inside, start-up parity), rank 0 drives and the others
   follow its steps (runtime/dist/distributed.py), then `end_engine` and the next model. A model whose
   rank fails ends the launch (the watchdog stops the others); the parent relaunches for the models
   not yet run, so one failure costs one model.
5. report: JSON (OUT/tp_bench.json, and on stdout), a table on stderr.

Per model, on rank 0 (`measure`):
- start-up: load (dummy weights), capture + parity seconds, the memory lines the engine prints
  (per rank), peak memory.
- decode at each batch B: B requests of a 64-token history, prefilled, then --steps decode
  steps through `engine.step()` (the step sent to every rank, its graphs replayed on every rank,
  the token sampled on rank 0: what a served token costs); per-step ms is their median. Every
  timed step must be a whole-step graph replay (the runner's counters), else the row says so.
- floor: bytes one decode step must read on a rank (benchmarks/gpu_e2e.decode_floor: the rank's
  weights except routed experts, of which min(E, B * top_k) per MoE layer; B embedding rows;
  states read and written; KV of the 65-token context) over the copy rate measured in this run
  (bench_common.device_rates, on the rank's GPU before any model is loaded).
- all-reduce share: torch.profiler over --profile-steps decode steps: the collective kernels'
  time (NCCL's and the symmetric-memory one-shot all-reduce's, replayed from the graphs, traced
  one by one) over the step's wall time, and over all kernel time. A collective kernel also waits
  for the slowest rank to arrive, so the share includes skew. Also the kernels a step runs and,
  for the last profiled step, the device's idle time between its first and last kernel.
- tokens (the bench-size model): greedy tokens of 4 prompts, compared between TP 2 and TP 1 (bf16
  rounds differently when a sum is split over ranks: the first differing step is reported with
  each run's top-1 minus top-2 log-probability there, so a near tie shows as one; see `compare`).

It does not download anything, read a checkpoint, or tune kernels.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

HISTORY = 64  # tokens each decode request holds before the timed steps
# Seconds of --budget-s kept for the tensor-parallel launch after the TP 1 run, and the least a TP 1
# run is started with (its start-up alone took 30 to 100 s on an H200 with cold kernel caches).
TP_LAUNCH_RESERVE_S = 240
TP1_MIN_S = 90
TOKEN_PROMPTS = ((3, 5, 7, 11), tuple(range(20, 37)), tuple(range(100, 140)), (9,) * 24)
GPU = dict(batches=(1, 8, 32, 128), steps=20, warmup=3, profile_steps=5, new_tokens=16, token_budget=512,
           extend_bucket=16, target="cuda", dtype="bfloat16", history=HISTORY)
DRY = dict(batches=(1, 2, 4), steps=3, warmup=1, profile_steps=2, new_tokens=4, token_budget=32,
           extend_bucket=16, target="cpu", dtype="float32", history=8)
# name -> (config source, tensor-parallel ranks or 1); the order runs the cheap check first.
MODELS = {
    "bench_tp1": ("bench", 1),
    "bench_tp2": ("bench", 2),
    "qwen3_next_80b_a3b_tp2": ("qwen3_next_80b_a3b", 2),
    "kimi_linear_48b_a3b_tp2": ("kimi_linear_48b_a3b", 2),
}


# -- the parent: configs, compiles, launches, report -------------------------------------------------


def config_folder(source: str, out: Path, configs: Path, dry: bool) -> Path:
    """A folder holding only config.json: a published release's, or the bench size's."""
    folder = out / "configs" / source
    folder.mkdir(parents=True, exist_ok=True)
    if dry or source == "bench":
        from models.families import get_family  # benchmark side: the runtime never imports models/

        family = "kimi_linear" if source.startswith("kimi") else "qwen3_next"
        config = get_family(family).make_config("tiny" if dry else "bench")
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    else:
        shutil.copy(configs / f"{source}.json", folder / "config.json")
    return folder


def compile_all(names: list[str], out: Path, configs: Path, knobs: dict, routes: list[str]) -> dict:
    """Step 2: every artifact at once (tracing is single-threaded; the host has cores to spare)."""
    procs, report = {}, {}
    for name in names:
        source, tp = MODELS[name]
        art = out / "artifacts" / name
        cmd = [sys.executable, "-m", "hgc", "compile", str(config_folder(source, out, configs, knobs["dry"])),
               "-o", str(art), "--force", "--no-weights", "--no-dumps", "--no-inductor", "--tp", str(tp),
               "--target", knobs["target"],
               "--dtype", knobs["dtype"], "--decode-buckets", ",".join(map(str, knobs["batches"])),
               "--extend-buckets", str(knobs["extend_bucket"]), *[f"--route={r}" for r in routes]]
        log = open(out / f"compile_{name}.log", "w")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), time.perf_counter(), log)
    for name, (proc, t0, log) in procs.items():
        code = proc.wait()
        log.close()
        text = (out / f"compile_{name}.log").read_text()
        report[name] = {"status": "ok" if code == 0 else "error", "seconds": round(time.perf_counter() - t0, 1),
                        "artifact": str(out / "artifacts" / name), "tail": text[-1500:] if code else text[-300:]}
        print(f"[compile {name}] {report[name]['status']} in {report[name]['seconds']} s", file=sys.stderr, flush=True)
    return report


def build_all(names: list[str], out: Path, knobs: dict, left) -> dict:
    """--compiled-pieces: `hgc build` of each artifact in turn (each build uses every GPU its ranks need)."""
    report = {}
    for name in names:
        if left() < 120:
            report[name] = {"status": "skipped: out of time"}
            continue
        t0 = time.perf_counter()
        log = out / f"build_{name}.log"
        with open(log, "w") as f:
            code = subprocess.run([sys.executable, "-m", "hgc", "build", str(out / "artifacts" / name),
                                   "--device", knobs["target"], "--force"], cwd=ROOT, stdout=f,
                                  stderr=subprocess.STDOUT).returncode
        report[name] = {"status": "ok" if code == 0 else f"error (exit {code})",
                        "seconds": round(time.perf_counter() - t0, 1), "tail": log.read_text()[-1200:]}
        print(f"[build {name}] {report[name]['status']} in {report[name]['seconds']} s", file=sys.stderr, flush=True)
    return report


def worker_cmd(args, mode: str, names: list[str]) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--out", str(args.out),
            "--models", ",".join(names), *(["--dry-run"] if args.dry_run else []),
            "--steps", str(args.steps), "--batches", ",".join(map(str, args.batches))]


def run_parent(args, knobs: dict) -> dict:
    from runtime.dist.launcher import launch

    t_start = time.perf_counter()
    out = args.out
    shutil.rmtree(out / "parts", ignore_errors=True)  # a part left by an earlier run would read as this one's
    (out / "parts").mkdir(parents=True)
    configs = Path(args.configs) if args.configs else ROOT / "tests" / "configs"
    names = [n for n in MODELS if n in args.models]
    report = {"knobs": {k: v for k, v in knobs.items()}, "configs": str(configs), "tp": 2,
              "compile": compile_all(names, out, configs, knobs, args.route)}
    ready = [n for n in names if report["compile"][n]["status"] == "ok"]
    left = lambda: args.budget_s - (time.perf_counter() - t_start)  # noqa: E731
    if args.compiled_pieces:
        report["build"] = build_all(ready, out, knobs, left)

    one = [n for n in ready if MODELS[n][1] == 1]
    tp1_s = left() - TP_LAUNCH_RESERVE_S  # the rest is kept for the tensor-parallel launch
    not_run = {}  # model -> why it did not run, for its record
    if one and tp1_s < TP1_MIN_S:
        for n in one:
            not_run[n] = (f"not run: --budget-s {args.budget_s:g} left {max(0.0, tp1_s):.0f} s for the TP 1 run after "
                          f"keeping {TP_LAUNCH_RESERVE_S} s for the TP 2 launch (it needs {TP1_MIN_S} s); raise --budget-s")
    elif one:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
        try:
            report["tp1_exit"] = subprocess.run(worker_cmd(args, "tp1", one), cwd=ROOT, env=env,
                                                timeout=tp1_s).returncode
        except subprocess.TimeoutExpired:
            report["tp1_exit"] = "timeout"
            for n in one:
                not_run[n] = f"timed out: the TP 1 run had {tp1_s:.0f} s of --budget-s {args.budget_s:g}"
    many = [n for n in ready if MODELS[n][1] > 1]
    launches = []
    while many and left() > 90:
        code = launch(2, worker_cmd(args, "tp", many), label="tp_bench", timeout_s=left() - 15)
        done = [n for n in many if (out / "parts" / f"{n}.started").exists()]
        launches.append({"models": many, "exit": code, "started": done})
        if code in (0, 124) or not done:  # done, out of time, or failing before any model
            break
        many = [n for n in many if n not in done]  # the last started one failed: go on without it
    report["launches"] = launches
    report["models"] = {}
    for n in names:
        part = out / "parts" / f"{n}.json"
        rec = json.loads(part.read_text()) if part.exists() else {
            "status": not_run.get(n) or ("not run" if not (out / "parts" / f"{n}.started").exists()
                                         else "failed while starting (see the launch's stderr)")}
        if rec["status"] == "running":  # its process ended under it: another rank failed (see the log)
            rec["status"] = "failed: a rank ended during it (see the launch's stderr)"
        report["models"][n] = rec
    report["tokens_tp2_vs_tp1"] = compare(report["models"].get("bench_tp1", {}), report["models"].get("bench_tp2", {}))
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    return report


def compare(one: dict, two: dict) -> dict:
    """The greedy tokens of TP 2 against TP 1, per prompt: equal, or the first differing step.

    `top_logprobs` holds each step's top {token: logprob}, best first. At the first difference,
    `top2_gap` is each run's top-1 minus top-2 log-probability (how near a tie its choice was). Up
    to and including that step both runs saw the same tokens, so their log-probabilities differ only
    by rounding: `drift` is the largest difference of a token's log-probability between the runs
    (over the tokens in both top lists) at those steps. `swing` is how far the two choices'
    log-probability difference moved between the runs. Each of the two log-probabilities may move
    by the drift, so a swing within twice the drift is a near tie flipped by rounding; a swing far
    beyond it is a fault."""
    a, b = one.get("tokens"), two.get("tokens")
    if not a or not b:
        return {"status": "not compared (a run is missing)"}
    tops_one, tops_two = one.get("top_logprobs"), two.get("top_logprobs")
    rows = []
    for i, (x, y) in enumerate(zip(a, b)):
        first = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), None)
        row = {"equal": x == y, "first_difference": first}
        if tops_one and tops_two:
            same_context = range(len(x) if first is None else first + 1)
            row["drift"] = max((abs(tops_one[i][j][t] - tops_two[i][j][t]) for j in same_context
                                for t in tops_one[i][j].keys() & tops_two[i][j].keys()), default=None)
            if first is not None:
                lp1, lp2 = tops_one[i][first], tops_two[i][first]
                row["top2_gap"] = {run: round(top[0] - top[1], 5) for run, top in
                                   (("tp1", list(lp1.values())), ("tp2", list(lp2.values())))}
                p, q = str(x[first]), str(y[first])
                if {p, q} <= lp1.keys() and {p, q} <= lp2.keys():
                    row["swing"] = round(abs((lp1[p] - lp1[q]) - (lp2[p] - lp2[q])), 5)
        rows.append(row)
    return {"status": "equal" if all(r["equal"] for r in rows) else "differ", "prompts": rows,
            "note": "bf16: a sum split over ranks rounds differently; a difference whose swing is within twice "
                    "the drift of the same-context steps is a near tie, one far beyond it is a fault"}


def print_table(report: dict) -> None:
    print("\nmodel                      B   step ms   floor ms   x floor  all-reduce %  graphs", file=sys.stderr)
    for name, rec in report["models"].items():
        for B, row in sorted((rec.get("decode") or {}).items(), key=lambda kv: int(kv[0])):
            share = row.get("allreduce_share_of_step")
            print(f"{name:26s} {int(B):3d} {row.get('step_ms', float('nan')):9.3f} "
                  f"{row.get('floor_ms', float('nan')):10.3f} {row.get('x_floor', float('nan')):9.2f} "
                  f"{'n/a' if share is None else f'{100 * share:.1f}':>13s}  {row.get('graph_replays')}",
                  file=sys.stderr)
        if rec.get("status") != "ok":
            error = str(rec.get("error") or "")[:200]
            print(f"{name:26s} {rec.get('status')}" + (f": {error}" if error else ""), file=sys.stderr)
    print(f"tokens TP 2 vs TP 1 (bench size): {report['tokens_tp2_vs_tp1'].get('status')}", file=sys.stderr)


# -- a worker: one process, or one rank of a launch ---------------------------------------------------


def log_to(lines: list[str], rank: int):
    def log(line: str) -> None:
        lines.append(line)
        if rank == 0:
            print(f"tp_bench: {line}", file=sys.stderr, flush=True)
    return log


def build(name: str, args, knobs: dict, rank: int, tp: int, device: torch.device, log, tp_lead=None) -> tuple:
    """One model's engine on this rank, as `hgc serve` builds it: dummy weights, pools, backends,
    a started GraphRunner (capture + parity, collectives inside); `tp_lead`: rank 0's group, which
    its engine sends every step to."""
    from runtime.artifact.loader import load_artifact
    from runtime.assembly import EngineOptions, engine_for_artifact

    t0 = time.perf_counter()
    art = load_artifact(args.out / "artifacts" / name, device=device, rank=rank, tp=tp, load_format="dummy")
    loaded = time.perf_counter() - t0
    vocab = int(art.manifest["model"]["vocab_size"])
    slots = max(knobs["batches"])
    options = EngineOptions(slots=slots, max_running=slots, token_budget=knobs["token_budget"],
                            max_model_len=knobs["history"] + knobs["steps"] * 4 + 64, prefix_cache=False)
    graphs = True
    if knobs["dry"]:
        from testkit.graph_cases import RerunGraphs  # the CPU stand-in for CUDA graphs

        graphs = RerunGraphs()
    t0 = time.perf_counter()
    engine = engine_for_artifact(art, options, options.max_model_len, device=device, graphs=graphs, log=log,
                                 tp_lead=tp_lead)
    return art, engine, vocab, {"load_s": round(loaded, 2), "capture_parity_s": round(time.perf_counter() - t0, 2),
                                "compiled_pieces": len(art.compiled.pieces) if art.compiled is not None else 0}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_sweep(engine, vocab: int, B: int, knobs: dict, device) -> dict:
    """B requests of a `history` past, prefilled; then timed decode steps (module docstring)."""
    from runtime.engine.engine import SamplingParams

    g = torch.Generator().manual_seed(B)
    # Requests prefilled in early chunks decode while later ones prefill (continuous batching):
    # enough new tokens that none finishes before the last timed step.
    prefill_steps = -(-B * knobs["history"] // knobs["token_budget"])
    params = SamplingParams(max_new_tokens=prefill_steps + knobs["warmup"] + knobs["steps"]
                            + knobs["profile_steps"] + 8)
    ids = [engine.add_request(torch.randint(2, vocab, (knobs["history"],), generator=g).tolist(), params)
           for _ in range(B)]
    try:
        started: set = set()
        while len(started) < B:  # prefill: every request has its first token, all decode from here
            started |= {o.request_id for o in engine.step() if o.token is not None}
        for _ in range(knobs["warmup"]):
            engine.step()
        before = dict(engine.runner.counters)
        times = []
        for _ in range(knobs["steps"]):
            t0 = time.perf_counter()
            outs = engine.step()  # sampled on the host: the step's device work is in it
            times.append((time.perf_counter() - t0) * 1e3)
            assert len(outs) == B, f"a decode step of {B} requests gave {len(outs)} tokens"
        replays = engine.runner.counters["graph_replays"] - before["graph_replays"]
        profile = profile_steps(engine, knobs["profile_steps"], device)
    finally:
        for i in ids:
            engine.cancel(i)
    step_ms = statistics.median(times)
    row = {"step_ms": round(step_ms, 4), "step_ms_min": round(min(times), 4), "graph_replays": f"{replays}/{len(times)}",
           **profile}
    if profile.get("collective_ms_per_step") is not None:
        row["allreduce_share_of_step"] = round(profile["collective_ms_per_step"] / step_ms, 4)
    return row


def profile_steps(engine, n: int, device) -> dict:
    """torch.profiler over n decode steps: kernels and kernel time per step, the collectives' part
    of it (NCCL's kernels and the symmetric-memory all-reduce's), every kernel with its time and
    calls per step (the costliest first), and for the last step the span from its first kernel to
    its last and the device's idle time inside it (bench_common.device_gaps). On the CPU (dry
    run): the host time of the gloo calls instead."""
    from torch.profiler import ProfilerActivity, profile

    from bench_common import device_gaps, device_kernels, per_call_rows

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with profile(activities=activities) as prof:
        for _ in range(n):
            engine.step()
        sync(device)
    if not cuda:
        gloo = sum(e.cpu_time_total for e in prof.events() if e.name.startswith("gloo:"))  # all_reduce, all_gather
        return {"nccl_ms_per_step": None, "collective_host_ms_per_step": round(gloo / 1e3 / n, 4)}
    ordered = device_kernels(prof)
    per = len(ordered) // max(n, 1)
    gaps = device_gaps(ordered[len(ordered) - per:], top=6)
    rows = per_call_rows(((e.name, e.device_time_total) for e in ordered), n)  # per step: a step's whole inventory

    def ms_per_step(keep) -> float:
        return sum(e.device_time_total for e in ordered if keep(e.name.lower())) / 1e3 / n

    kernel_ms = ms_per_step(lambda name: True)
    nccl = ms_per_step(lambda name: "nccl" in name)
    # The symmetric-memory all-reduce's kernels (torch's one_shot_all_reduce*): every non-NCCL all_reduce.
    symm = ms_per_step(lambda name: "all_reduce" in name and "nccl" not in name)
    return {"kernel_ms_per_step": round(kernel_ms, 4), "kernels_per_step": per,
            "nccl_ms_per_step": round(nccl, 4), "symm_mem_ms_per_step": round(symm, 4),
            "collective_ms_per_step": round(nccl + symm, 4),
            "allreduce_share_of_kernels": round((nccl + symm) / max(kernel_ms, 1e-9), 4),
            "last_step_device_span_ms": gaps.get("device_span_ms"), "last_step_device_idle_ms": gaps.get("device_idle_ms"),
            "kernels": rows}


TOP_LOGPROBS = 20  # alternatives kept per step: enough to find each run's choice in the other's list


def greedy_tokens(engine, knobs: dict) -> tuple[list[list[int]], list[list[dict]]]:
    """Greedy tokens of TOKEN_PROMPTS, and at each step the top TOP_LOGPROBS {token: logprob}, best first."""
    from runtime.engine.engine import SamplingParams

    ids = [engine.add_request(list(p), SamplingParams(max_new_tokens=knobs["new_tokens"], logprobs=TOP_LOGPROBS))
           for p in TOKEN_PROMPTS]
    results = engine.run_until_done()
    tops = [[{str(t): round(v, 5) for t, v in lp.top} for lp in results[i].logprobs] for i in ids]
    return [list(results[i].output_ids) for i in ids], tops


def measure(name: str, art, engine, vocab: int, knobs: dict, device, copy_rate: float, record: dict,
            save) -> None:
    """Rank 0's part for one model (module docstring): decode sweep with floors and profile, tokens."""
    from gpu_e2e import decode_floor  # the floor's one statement, shared with the single-GPU benchmark

    record["decode"] = {}
    for B in knobs["batches"]:
        row = decode_sweep(engine, vocab, B, knobs, device)
        floor = decode_floor(art, engine.kv_pool, engine.state_pool, B, knobs["history"] + 1, copy_rate)
        row.update(floor_ms=round(floor["ms"], 4), floor_bytes=floor, x_floor=round(row["step_ms"] / floor["ms"], 3))
        record["decode"][str(B)] = row
        print(f"tp_bench: {name} B={B}: {row['step_ms']:.3f} ms/step (floor {floor['ms']:.3f} ms; graph replays "
              f"{row['graph_replays']}; collectives {row.get('collective_ms_per_step')} ms/step, "
              f"{row.get('kernels_per_step')} kernels)", file=sys.stderr, flush=True)
        save()
    if name.startswith("bench"):
        record["tokens"], record["top_logprobs"] = greedy_tokens(engine, knobs)
        save()


def run_worker(args, knobs: dict) -> int:
    """`--worker tp1`: the models alone in this process. `--worker tp`: this process is one rank
    of a launch; every model in turn (module docstring, step 4)."""
    from bench_common import device_facts, device_rates
    from runtime.dist.distributed import follow, join

    group = None
    if args.worker == "tp":
        # A collective may wait 10 minutes: loading a full-size release and building its kernels
        # can take the ranks minutes, never quite in step (a death is the watchdog's, not this).
        group = join(2, "cpu" if knobs["dry"] else "cuda", timeout_s=600, label="tp_bench")
    rank, tp = (group.rank, group.world_size) if group else (0, 1)
    device = group.device if group else torch.device("cpu" if knobs["dry"] else "cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rates = device_rates() if rank == 0 else None  # before any model: the whole GPU is free
    parts = args.out / "parts"
    for name in args.models:
        record = {"status": "running", "rank_count": tp, "device": device_facts(knobs["dry"]), "rates": rates}
        save = lambda: (parts / f"{name}.json").write_text(json.dumps(record, indent=1)) if rank == 0 else None  # noqa: E731
        if rank == 0:
            (parts / f"{name}.started").write_text("")
        lines: list[str] = []
        try:
            art, engine, vocab, start = build(name, args, knobs, rank, tp, device, log_to(lines, rank),
                                              group if rank == 0 else None)
        except Exception as e:
            # It ends this process: the other ranks are inside the same collectives and cannot go on
            # without it (the watchdog stops them); the parent relaunches for the models after this one.
            record.update(status="error", error=f"{type(e).__name__}: {e}", startup_log=lines,
                          traceback=traceback.format_exc()[-4000:])
            save()
            raise
        record.update(start, startup_log=lines)
        if device.type == "cuda":
            record["peak_memory_gib_after_start"] = round(torch.cuda.max_memory_allocated(device) / (1 << 30), 2)
        if rank > 0:
            follow(engine, group)  # until rank 0 ends this engine
        else:
            try:
                with torch.no_grad():
                    measure(name, art, engine, vocab, knobs, device, rates["copy_bytes_per_s"], record, save)
                record["status"] = "ok"
            except Exception as e:  # a step that failed on rank 0 leaves the others inside it: stop all
                record.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
                save()
                print(f"tp_bench: {name} failed: {record['error']}", file=sys.stderr, flush=True)
                os._exit(4)
            save()
            if group:
                group.end_engine()
        del art, engine
        gc.collect()  # the runner's graphs and pools go before the next model's weights come
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if group:
        if rank > 0:
            group.channel.recv()  # rank 0's STOP: closing first would look like a death to its watchdog
        group.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny configs, float32, gloo, graphs rerun")
    p.add_argument("--models", default=",".join(MODELS), help=f"subset of {', '.join(MODELS)}")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,32,128; dry run 1,2,4)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size")
    p.add_argument("--configs", default=None, help="folder of the published configs (default tests/configs)")
    p.add_argument("--route", action="append", default=[], help="passed to every `hgc compile` (--route)")
    p.add_argument("--budget-s", type=float, default=470.0, help="no stage starts after this many seconds; a build (--compiled-pieces) "
                        "starts only with 120 s of them left, a tensor-parallel launch with 90 s")
    p.add_argument("--compiled-pieces", action="store_true",
                   help="`hgc build` every artifact after compiling it, so the runs load compiled pieces")
    p.add_argument("--worker", choices=("tp1", "tp"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    knobs = dict(DRY if args.dry_run else GPU, dry=args.dry_run)
    if args.batches:
        knobs["batches"] = tuple(int(b) for b in args.batches.split(","))
    if args.steps:
        knobs["steps"] = args.steps
    args.batches, args.steps = knobs["batches"], knobs["steps"]
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        p.error(f"--models: unknown {sorted(unknown)} (known: {', '.join(MODELS)})")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:  # a rank ends as the CLI's ranks do (runtime/dist/distributed.py, step 6)
        from runtime.dist.distributed import end_rank_process

        end_rank_process(run_worker(args, knobs))
    report = run_parent(args, knobs)
    (args.out / "tp_bench.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
