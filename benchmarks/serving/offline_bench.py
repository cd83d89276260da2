"""Offline throughput benchmark: serve_bench's request mix fed straight to the engine, no HTTP.

What `hgc serve` could give at most: the same requests, the same engine, nothing between them.
On the GPU machine (benchmarks/serving/serve_bench.py --offline runs it in the same call as the served
levels, on the same artifact):

    python3 benchmarks/serving/offline_bench.py --artifact /tmp/bench --out $OUT --concurrency 1,8,32,128
    python3 benchmarks/serving/offline_bench.py --out $OUT       # compiles qwen3_next bench bf16 itself
    python3 benchmarks/serving/offline_bench.py --dry-run --out /tmp/ob   # CPU: tiny, reference backend
    python3 benchmarks/serving/offline_bench.py --artifact /tmp/bench --out $OUT/on --overlap-schedule
    python3 benchmarks/serving/offline_bench.py --artifact /tmp/bench --out $OUT/off --no-overlap-schedule

1. artifact: --artifact, or `hgc init-model` and `hgc compile` (bench_common.compiled_artifact).
2. engine: the engine `hgc serve` builds for serve_bench (runtime/assembly.engine_for_artifact:
   CUDA graphs on cuda, prefix cache on, --token-budget tokens a step), sized as serve_bench sizes
   the server (serve_bench.sizing: a slot per worker of the highest concurrency).
3. warm_up: one short request, untimed.
4. all_at_once: the requests of the highest concurrency's level (serve_bench.level_requests,
   --iters per worker) queued together, stepped until every one has finished.
5. closed_loop_cN, per --concurrency N: the level serve_bench sends at concurrency N (the same
   prompts), N in flight: when one finishes, the next is added before the next step.
   Per run: output tokens per second and steps per second over its wall time; the requests
   finished and tokens generated, by this loop's count and by Engine.stats(); the engine's
   overlapped and synchronous steps (how often the overlapped schedule applied; none with
   --no-overlap-schedule, which runs the same levels without it, to measure its gain). On cuda, the GPU
   busy fraction and the host time per step over a window of --profile-steps steps (torch.profiler,
   CUDA activity only) opened at the first step after a request has finished (the batch then holds
   decodes and new prompts alike): busy = the union of the window's kernel and copy intervals over
   its wall time; host ms per step = the window's wall time not covered by them, per step (the
   part of a step the device waits for the host). The profiler slows the host, so the window is
   left out of the tokens and steps per second. On the CPU host and device are one: both are
   reported as not measured.
6. serve_vs_run (on by default in the dry run, --serve-vs-run elsewhere): issue 53's CPU measure.
   `hgc serve` on the artifact takes 16 concurrent streamed requests of 32 prompt tokens and 64
   new tokens (ignore_eos, through serve_bench's client), then `hgc run` in a process of its own
   takes the same 16 prompts at once; the ratio of their output tokens per second (`hgc run`'s:
   its generated tokens over the seconds of its engine steps, from its --json timing). A
   measurement, not a gate: CPU machines are shared and noisy (goal of issue 53: >= 0.8).

Every stage is wrapped (bench_common.Stages); JSON to OUT/offline_bench.json after each stage, a
table last. It does not check tokens (the engine's tests do).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # serve_bench, imported by file name like bench_common
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

# bench_common first: it sets the profiler's environment before torch is imported
from bench_common import Stages, compiled_artifact, device_kernels, engine_script, fmt, target_rows  # noqa: E402
from serve_bench import DRY, GPU, WARM_UP, bench as serve_levels, level_requests, parse_mix, sizing  # noqa: E402
from hgc.serve_command import DEFAULT_TOKEN_BUDGET, add_overlap_argument, int_at_least, schedule_options  # noqa: E402
import torch  # noqa: E402
from runtime.engine.engine import SamplingParams  # noqa: E402
from runtime.graphs.runner import GraphRunner  # noqa: E402
from testkit.helpers import ServerProcess  # noqa: E402

GPU_DEFAULTS = dict(family="qwen3_next", size="bench", iters=GPU["requests_per_worker"],
                    concurrency=GPU["concurrency"], mix=GPU["mix"], profile_steps=50, serve_vs_run=False)
DRY_DEFAULTS = dict(family="qwen3_next", size="tiny", iters=DRY["requests_per_worker"],
                    concurrency=DRY["concurrency"], mix=DRY["mix"], profile_steps=0, serve_vs_run=True)
# Issue 53's CPU measure: 16 streamed requests through `hgc serve` against `hgc run` on the same prompts.
SERVE_VS_RUN = dict(requests=16, prompt_tokens=32, new_tokens=64)
SERVE_VS_RUN_GOAL = 0.8


class ProfiledWindow:
    """A window of engine steps under torch.profiler (CUDA activity only), on cuda; on the CPU it
    never opens. `step()` runs one engine step, opening the window at the first `steady` step and
    closing it after `steps` steps (or at `close()`, when the run ends inside it)."""

    def __init__(self, device, steps: int):
        self.wanted = steps if torch.device(device).type == "cuda" else 0
        self.device = device
        self.prof = None
        self.closed = False
        self.steps = self.tokens = 0
        self.spans: dict[str, float] = {}  # perf_counter marks: open, start, stop, closed

    def step(self, engine, steady: bool) -> list:
        if self.wanted and steady and self.prof is None:
            self._open()
        outputs = engine.step()
        if self.prof is not None and not self.closed:
            self.steps += 1
            self.tokens += sum(out.token is not None for out in outputs)
            if self.steps == self.wanted:
                self.close()
        return outputs

    def _open(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.spans["open"] = time.perf_counter()
        torch.cuda.synchronize(self.device)  # the window's kernels are its steps' alone
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.prof.start()
        self.spans["start"] = time.perf_counter()

    def close(self) -> None:
        if self.prof is None or self.closed:
            return
        torch.cuda.synchronize(self.device)
        self.spans["stop"] = time.perf_counter()
        self.prof.stop()
        self.spans["closed"] = time.perf_counter()
        self.closed = True

    def excluded_s(self) -> float:
        """Wall seconds the window took from the run, profiler start and stop included."""
        return self.spans["closed"] - self.spans["open"] if self.closed else 0.0

    def report(self) -> dict:
        """The window's steps, tokens and wall time, the device's busy fraction over it and the host
        milliseconds per step it was not covered by device work (None off cuda)."""
        if not self.closed:
            return {"steps": 0, "tokens": 0, "wall_s": 0.0, "gpu_busy": None, "host_ms_per_step": None}
        wall = self.spans["stop"] - self.spans["start"]
        busy = busy_seconds(device_kernels(self.prof))
        return {"steps": self.steps, "tokens": self.tokens, "wall_s": wall, "gpu_busy": busy / wall,
                "host_ms_per_step": 1e3 * (wall - busy) / self.steps}


def busy_seconds(kernels) -> float:
    """Seconds covered by at least one of these device events (profiler events in start order):
    the union of their intervals, so that kernels on two streams at once count once."""
    busy, end = 0.0, None
    for e in kernels:
        start, stop = e.time_range.start, e.time_range.end  # microseconds
        if end is None or start > end:
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy / 1e6


def run_requests(engine, requests: list[tuple[list[int], int]], in_flight: int | None, profile_steps: int) -> dict:
    """Step the engine over these (prompt, output tokens) requests, greedy, every output exactly
    that long: at most `in_flight` live at once (None: all queued at once), the next added as soon
    as one finishes."""
    queue = collections.deque(requests)
    window = ProfiledWindow(engine.device, profile_steps)
    before = engine.stats()
    live, results, steps, step_tokens = set(), [], 0, 0

    def top_up():
        while queue and (in_flight is None or len(live) < in_flight):
            prompt, max_tokens = queue.popleft()
            live.add(engine.add_request(prompt, SamplingParams(max_new_tokens=max_tokens)))

    start = time.perf_counter()
    top_up()
    while engine.has_work():
        outputs = window.step(engine, steady=bool(results))
        steps += 1
        step_tokens += sum(out.token is not None for out in outputs)
        for out in outputs:
            if out.finished:
                live.remove(out.request_id)
                results.append(engine.pop_result(out.request_id))
        top_up()
    wall = time.perf_counter() - start
    window.close()
    after, profiled = engine.stats(), window.report()
    timed_s = wall - window.excluded_s()
    return {"in_flight": in_flight, "requests": len(requests), "finished": len(results),
            "output_tokens": sum(len(r.output_ids) for r in results), "step_tokens": step_tokens,
            "expected_output_tokens": sum(n for _, n in requests), "steps": steps,
            "engine_requests_finished": after["requests_finished"] - before["requests_finished"],
            "engine_tokens_generated": after["tokens_generated"] - before["tokens_generated"],
            "engine_steps": after["steps"] - before["steps"], "wall_s": wall,
            "overlapped_steps": after["overlapped_steps"] - before["overlapped_steps"],
            "synchronous_steps": after["synchronous_steps"] - before["synchronous_steps"],
            # what kind of steps the load made: a step with prompt tokens counts as prefill
            **{key: after[key] - before[key] for key in ("prefill_steps", "decode_steps", "prefill_tokens", "preemptions")},
            "output_tokens_per_s": (step_tokens - profiled["tokens"]) / timed_s,
            "steps_per_s": (steps - profiled["steps"]) / timed_s,
            "gpu_busy": profiled["gpu_busy"], "host_ms_per_step": profiled["host_ms_per_step"],
            "profiled_window": {k: profiled[k] for k in ("steps", "tokens", "wall_s")}}


def hgc_run(art_dir: Path, device: str, prompts: list[list[int]], new_tokens: int, threads: int,
            flags: tuple[str, ...] = ()) -> dict:
    """`hgc run --json` on these prompts in a process of its own, with `threads` torch CPU threads
    (OMP_NUM_THREADS: the command has no flag for them): output tokens per second over the
    seconds of its engine steps (prefill and decode), and the tokens it generated."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS=str(threads))
    ids = ";".join(",".join(map(str, p)) for p in prompts)
    proc = subprocess.run([sys.executable, "-m", "hgc", "run", str(art_dir), "--prompt-ids", ids, "--max-new-tokens",
                           str(new_tokens), "--device", device, "--json", "--quiet", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"hgc run exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    doc = json.loads(proc.stdout)
    tokens = sum(len(o["output_ids"]) for o in doc["outputs"])
    seconds = doc["timing"]["prefill_s"] + doc["timing"]["decode_s"]
    return {"requests": len(doc["outputs"]), "output_tokens": tokens, "step_seconds": seconds,
            "output_tokens_per_s": tokens / seconds}


def serve_vs_run(art_dir: Path, device: str, seed: int, threads: int, flags: tuple[str, ...] = ()) -> dict:
    """Issue 53's CPU measure (step 6 of the module docstring), both commands with `threads` torch
    threads and the engine `flags` both take (--overlap-schedule or --no-overlap-schedule)."""
    n, mix = SERVE_VS_RUN["requests"], ((SERVE_VS_RUN["prompt_tokens"], SERVE_VS_RUN["new_tokens"]),)
    size = sizing((n,), mix)
    server = ServerProcess([str(art_dir), "--device", device, "--slots", str(size["slots"]),
                            "--max-model-len", str(size["max_model_len"]), "--threads", str(threads), *flags])
    server.wait_ready(timeout=600)
    try:
        served = asyncio.run(serve_levels(server.url, None, (n,), mix, 1, seed))
    finally:
        server.stop()
    level = served["levels"][0]
    if level["errors"]:
        raise RuntimeError(f"hgc serve: {level['errors']} of {level['requests']} requests failed, e.g. "
                           f"{next(r['error'] for r in level['records'] if 'error' in r)}")
    prompts = [p for p, _ in level_requests(mix, n, 1, int(served["model_card"]["vocab_size"]), seed)]
    run = hgc_run(art_dir, device, prompts, SERVE_VS_RUN["new_tokens"], threads, flags)
    return {**SERVE_VS_RUN,
            "served": {k: level[k] for k in ("requests", "output_tokens", "wall_s", "output_tokens_per_s",
                                             "ttft_median_s", "itl_median_s")},
            "run": run, "ratio": level["output_tokens_per_s"] / run["output_tokens_per_s"]}


def bench(args, rec: dict, save) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        run_stages(args, rec, save)
    finally:
        torch.set_num_threads(threads)  # a caller's (a test process's) setting is its own


def run_stages(args, rec: dict, save) -> None:
    from runtime.artifact.bundle import CompiledOptions
    from runtime.artifact.loader import load_artifact
    from runtime.assembly import EngineOptions, engine_for_artifact

    stages = Stages(rec["stages"], skip=args.skip.split(",") if args.skip else (), save=save)
    state: dict = {}

    def artifact():
        state["art_dir"] = compiled_artifact(args)

    def engine():
        # The bundle's kernels were built for the start-up the compile ran; this engine's limits
        # may need others, built here (the bench times steps, not the start-up).
        art = load_artifact(state["art_dir"], device=args.device, compiled=CompiledOptions(allow_builds=True))
        size = sizing(args.concurrency, args.mix)
        options = EngineOptions(slots=size["slots"], token_budget=args.token_budget,
                                max_model_len=size["max_model_len"], **schedule_options(args))
        eng = engine_for_artifact(art, options, size["max_model_len"], device=art.device,
                                  log=lambda line: print(f"  {line}", flush=True))
        state.update(engine=eng, vocab=int(art.manifest["model"]["vocab_size"]), device=str(art.device))
        rec["engine"] = {"device": str(art.device), "graphs": isinstance(eng.runner, GraphRunner), **size,
                         "token_budget": args.token_budget, "prefix_cache": eng.prefix_cache is not None,
                         "overlap": eng.overlap, "decodes_apart_from": eng.decodes_apart_from}

    def requests(concurrency: int) -> list[tuple[list[int], int]]:
        return level_requests(args.mix, concurrency, args.iters, state["vocab"], args.seed)

    def warm_up():
        run_requests(state["engine"], [WARM_UP], None, 0)

    def level(name: str, concurrency: int, in_flight: int | None):
        rec["runs"][name] = {"mode": "all_at_once" if in_flight is None else "closed_loop",
                             **run_requests(state["engine"], requests(concurrency), in_flight, args.profile_steps)}

    rec["runs"] = {}
    stages("artifact", artifact)
    stages("engine", engine, needs=("artifact",))
    stages("warm_up", warm_up, needs=("engine",))
    stages("all_at_once", level, "all_at_once", max(args.concurrency), None, needs=("engine",))
    for c in args.concurrency:
        stages(f"closed_loop_c{c}", level, f"closed_loop_c{c}", c, c, needs=("engine",))
    state.pop("engine", None)  # its pools go before a server loads the artifact again
    if args.serve_vs_run:
        flags = ("--overlap-schedule",) if args.overlap_schedule else ("--no-overlap-schedule",)
        if args.decodes_apart_from is not None:
            flags += ("--decodes-apart-from", str(args.decodes_apart_from))
        measure = stages("serve_vs_run", serve_vs_run, state.get("art_dir"), state.get("device"), args.seed,
                         args.threads, flags, needs=("engine",))
        if measure is not None:
            rec["serve_vs_run"] = measure
            rec["targets"] = {"serve_over_run": {"value": measure["ratio"], "goal": f">= {SERVE_VS_RUN_GOAL}",
                                                 "met": measure["ratio"] >= SERVE_VS_RUN_GOAL, "on_cpu": True}}


def table(rec: dict) -> str:
    rows = ["| run | in flight | requests | out tok/s | steps/s | GPU busy | host ms/step | overlapped steps |",
            "|" + "---|" * 8]
    for name, r in rec.get("runs", {}).items():
        steps = r["overlapped_steps"] + r["synchronous_steps"]
        rows.append(f"| {name} | {r['in_flight'] or 'all'} | {r['finished']}/{r['requests']} | "
                    f"{fmt(r['output_tokens_per_s'])} | {fmt(r['steps_per_s'])} | "
                    f"{fmt(r['gpu_busy'], '.0%', 'not measured')} | "
                    f"{fmt(r['host_ms_per_step'], '.2f', 'not measured')} | {r['overlapped_steps']}/{steps} |")
    m = rec.get("serve_vs_run")
    if m:
        rows.append(f"serve vs run, {m['requests']} x {m['prompt_tokens']}:{m['new_tokens']} streamed: hgc serve "
                    f"{fmt(m['served']['output_tokens_per_s'])} tok/s, hgc run {fmt(m['run']['output_tokens_per_s'])} "
                    f"tok/s, ratio {fmt(m['ratio'], '.2f')}")
    return "\n".join(rows + target_rows(rec))


def concurrency_list(text: str) -> tuple[int, ...]:
    """--concurrency: comma-separated positive numbers of requests in flight, e.g. 1,8,32,128."""
    try:
        levels = tuple(int(x) for x in text.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers, e.g. 1,8,32,128")
    return levels


def main(argv: list[str] | None = None) -> dict:
    def add_arguments(p):
        p.add_argument("--device", default=None, help="the device to run the artifact on (default: the one it was compiled for)")
        p.add_argument("--concurrency", type=concurrency_list, default=None,
                       help=f"requests in flight per closed-loop run (default {GPU['concurrency']}, dry "
                            f"{DRY['concurrency']})")
        p.add_argument("--mix", type=parse_mix, default=None, help="prompt:output pairs, as serve_bench's --mix")
        p.add_argument("--token-budget", type=int_at_least(1), default=DEFAULT_TOKEN_BUDGET,
                       help="tokens per engine step (default: hgc serve's)")
        p.add_argument("--seed", type=int, default=0, help="prompt seed, as serve_bench's --seed (same prompts)")
        p.add_argument("--profile-steps", type=int_at_least(0), default=None,
                       help="steps of each run under the profiler, for the GPU busy fraction (default 50 on cuda)")
        p.add_argument("--threads", type=int_at_least(1), default=1,
                       help="torch CPU threads of this process, the server and hgc run (tiny models on a shared CPU "
                            "only lose to more)")
        add_overlap_argument(p)  # hgc serve's schedule flags, for the engine and serve_vs_run's hgc serve and hgc run
        p.add_argument("--serve-vs-run", action=argparse.BooleanOptionalAction, default=None,
                       help="issue 53's measure: hgc serve against hgc run (default: on in the dry run only)")

    return engine_script(argv, __doc__, "offline_bench", {"gpu": GPU_DEFAULTS, "dry": DRY_DEFAULTS}, add_arguments,
                         bench, table, lambda a: f"offline: {a.artifact or f'{a.family} {a.size}'}, in flight "
                                                 f"{a.concurrency}, mix {a.mix}, {a.iters} requests per worker")


if __name__ == "__main__":
    main()
