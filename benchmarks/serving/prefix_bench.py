"""Prefix-cache benchmark: time to first token of a shared prefix plus a short suffix, hit against
miss, and what taking snapshots costs a miss.

On the GPU machine, one run:

    python3 benchmarks/serving/prefix_bench.py --out $OUT                # qwen3_next, bench size, bf16, CUDA graphs
    python3 benchmarks/serving/prefix_bench.py --dry-run --out /tmp/pb   # CPU: tiny size, float32, reference backend,
                                                                         # graphs rerun (testkit/graph_cases.py)

1. init_compile: `hgc init-model`, `hgc compile` (on the GPU: --target cuda --dtype bfloat16).
2. engine: one engine as `hgc serve` builds it (runtime/assembly.engine_for_artifact: pools,
   backend, a started GraphRunner), the prefix cache on, --token-budget per step. The dry run
   builds the same with testkit/graph_cases.RerunGraphs standing in for CUDA graphs.
3. warm_up: one request of each kind below, untimed, so kernels are built before anything is timed.
4. miss_no_cache: --iters requests, each a fresh random prefix of --prefix tokens and a suffix
   of --suffix, with the engine's prefix cache set aside: the plain prefill.
5. miss_cache: the same requests' kind with the cache on: the prefill plus the snapshots it takes
   (their copies, and a split step where a snapshot point is not a chunk end).
6. hit: per iteration a fresh prefix; two requests with different suffixes cache it (the second
   snapshots the point where the two part, if no chunk end put one there), then a third suffix is
   timed: it reuses the prefix and prefills its suffix only.
7. hit_timeline: --iters more hits as in 6 under the profiler (bench_common.request_timeline: the
   host's time before the device starts, the kernels, the device's idle gaps), then cProfile of
   --iters more (the host functions that take the most).
8. snapshot_copy: one snapshot's copy alone (every linear layer's state of one slot), and the bytes.
Time to first token: from add_request to the sampled token on the host (Engine's first_token_s;
sampling reads the logits, so the device work is in it). Medians over --iters. Targets (issue 49):
the hit at least 10x faster than miss_no_cache; miss_cache within 5% of miss_no_cache. Every stage
is wrapped (bench_common.Stages); JSON to OUT/prefix_bench.json after each stage, a table last.
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench_common import (Stages, compiled_artifact, engine_script, fmt, host_profile, request_timeline,  # noqa: E402
                          synchronizer, target_rows, time_ms)
from runtime.engine.engine import Engine, SamplingParams  # noqa: E402

GPU_DEFAULTS = dict(family="qwen3_next", size="bench", prefix=2048, suffix=32, iters=5, token_budget=512)
# The dry run walks every stage on the CPU reference backend: a prefix of a few pages keeps it short.
DRY_DEFAULTS = dict(family="qwen3_next", size="tiny", prefix=64, suffix=8, iters=2, token_budget=32)
TARGET_SPEEDUP = 10.0
TARGET_SNAPSHOT_OVERHEAD = 0.05


def first_token(engine: Engine, prompt: list[int]) -> dict:
    """One request alone, to its first token: its TTFT, cached tokens, prefilled tokens and steps."""
    steps_before = len(engine.step_records())
    result = engine.generate(prompt, SamplingParams(max_new_tokens=1))
    steps = engine.step_records()[steps_before:]
    return {"ttft_s": result.first_token_s, "cached_tokens": result.cached_tokens, "token": result.output_ids[0],
            "prefilled_tokens": sum(r.prefill_tokens for r in steps), "steps": len(steps)}


class Requests:
    """Fresh random prefixes and suffixes, so that no timed request finds another's prefix by chance."""

    def __init__(self, vocab: int, prefix: int, suffix: int, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        self.vocab, self.prefix, self.suffix = vocab, prefix, suffix

    def ids(self, n: int) -> list[int]:
        return torch.randint(2, self.vocab, (n,), generator=self.g).tolist()

    def new_prefix(self) -> list[int]:
        return self.ids(self.prefix)

    def prompt(self, prefix: list[int]) -> list[int]:
        return prefix + self.ids(self.suffix)


def summary(runs: list[dict]) -> dict:
    ttft = [r["ttft_s"] for r in runs]
    return {"ttft_ms_median": 1e3 * statistics.median(ttft), "ttft_ms": [1e3 * t for t in ttft],
            "cached_tokens": runs[-1]["cached_tokens"], "prefilled_tokens": runs[-1]["prefilled_tokens"],
            "steps": runs[-1]["steps"]}


def bench(args, rec: dict, save) -> None:
    from runtime.artifact.bundle import CompiledOptions
    from runtime.artifact.loader import load_artifact
    from runtime.assembly import EngineOptions, engine_for_artifact
    from runtime.graphs.runner import GraphRunner

    device = torch.device("cpu" if args.dry_run else "cuda")
    stages = Stages(rec["stages"], skip=args.skip.split(",") if args.skip else (), save=save)
    art_dir = None

    def init_compile():
        nonlocal art_dir
        art_dir = compiled_artifact(args)

    state: dict = {}

    def engine():
        # The bundle's kernels were built for the start-up the compile ran; this engine's own limits
        # may need others, which are built here (the bench times steps, not the start-up).
        art = load_artifact(art_dir, device=str(device), compiled=CompiledOptions(allow_builds=True))
        vocab = int(art.manifest["model"]["vocab_size"])
        options = EngineOptions(slots=4, token_budget=args.token_budget, page_size=args.page_size)
        max_len, log = args.prefix + 2 * args.suffix + 1, lambda line: print(f"  {line}", flush=True)
        graphs = True
        if args.dry_run:
            from testkit.graph_cases import RerunGraphs
            graphs = RerunGraphs()
        eng = engine_for_artifact(art, options, max_len, device=device, graphs=graphs, log=log)
        state.update(engine=eng, cache=eng.prefix_cache, requests=Requests(vocab, args.prefix, args.suffix))
        rec["engine"] = {"device": str(device), "graphs": isinstance(eng.runner, GraphRunner), "token_budget": args.token_budget,
                         "page_size": args.page_size, "kv_pages": eng.kv_pool.num_pages,
                         "snapshots": eng.prefix_cache.snapshots.num_snapshots,
                         "snapshot_interval": eng.prefix_cache.config.snapshot_interval,
                         "in_step": eng.prefix_cache.in_step}

    def counters() -> dict:
        eng = state["engine"]
        return dict(eng.runner.counters) if eng.runner is not None else {}

    def cache_on(on: bool) -> Engine:
        # Between requests, the engine idle: the same engine (pools, graphs) with or without its cache.
        eng = state["engine"]
        state["cache"].clear()
        eng.prefix_cache = state["cache"] if on else None
        return eng

    def misses(on: bool, iters: int) -> list[dict]:
        eng, reqs = cache_on(on), state["requests"]
        return [first_token(eng, reqs.prompt(reqs.new_prefix())) for _ in range(iters)]

    def hits(iters: int) -> list[dict]:
        eng, reqs = cache_on(True), state["requests"]
        runs = []
        for _ in range(iters):
            prefix = reqs.new_prefix()
            first_token(eng, reqs.prompt(prefix))
            first_token(eng, reqs.prompt(prefix))
            timed_prompt = reqs.prompt(prefix)
            runs.append(first_token(eng, timed_prompt))
            runs[-1]["token_without_cache"] = first_token(cache_on(False), timed_prompt)["token"]
            eng = cache_on(True)
        return runs

    def hit_timeline():
        # Where a hit's time goes: the host before the device starts, the kernels (the restore's
        # copies among them), the device's idle gaps; then cProfile of the same hits' host side.
        eng, reqs, pending = cache_on(True), state["requests"], []

        def seed():  # on an empty cache, as `hits` does: a small snapshot pool would evict the prefix's
            cache_on(True)
            prefix = reqs.new_prefix()
            first_token(eng, reqs.prompt(prefix))
            first_token(eng, reqs.prompt(prefix))
            pending.append(reqs.prompt(prefix))

        rec["hit_timeline"] = request_timeline(seed, lambda: first_token(eng, pending.pop()), device, iters=args.iters)
        sync = synchronizer(device)
        rec["hit_host_profile"] = host_profile(lambda: first_token(eng, pending.pop()), iters=args.iters, top=25,
                                               sync=lambda: (sync(), seed(), sync()))

    def warm_up():
        misses(False, 1)
        misses(True, 1)
        hits(1)

    def snapshot_copy():
        cache = state["cache"]
        slot, snapshot = 1, 0
        ms = time_ms(lambda: cache.snapshots.save(cache.state_pool, [slot], [snapshot]), device, iters=20)
        rec["snapshot_copy"] = {"ms": ms, "bytes": cache.snapshots.nbytes() // max(cache.snapshots.num_snapshots, 1)}
        cache.clear()

    stages("init_compile", init_compile)
    stages("engine", engine, needs=("init_compile",))
    stages("warm_up", warm_up, needs=("engine",))
    for name, fn in (("miss_no_cache", lambda: misses(False, args.iters)),
                     ("miss_cache", lambda: misses(True, args.iters)),
                     ("hit", lambda: hits(args.iters))):
        runs = stages(name, fn, needs=("engine",))
        if runs is not None:
            rec[name] = summary(runs)
            if name == "hit":
                rec[name]["same_first_token"] = all(r["token"] == r["token_without_cache"] for r in runs)
    stages("hit_timeline", hit_timeline, needs=("engine",))
    stages("snapshot_copy", snapshot_copy, needs=("engine",))
    rec["graph_counters"] = counters() if "engine" in state else {}
    targets(rec)


def targets(rec: dict) -> None:
    miss, cached, hit = (rec.get(k, {}).get("ttft_ms_median") for k in ("miss_no_cache", "miss_cache", "hit"))
    out = {}
    if miss and hit:
        speedup = miss / hit
        out["hit_speedup"] = {"value": speedup, "goal": f">= {TARGET_SPEEDUP}x", "met": speedup >= TARGET_SPEEDUP}
    if miss and cached:
        overhead = cached / miss - 1
        out["snapshot_overhead"] = {"value": overhead, "goal": f"< {TARGET_SNAPSHOT_OVERHEAD:.0%}",
                                    "met": overhead < TARGET_SNAPSHOT_OVERHEAD}
    rec["targets"] = out


def table(rec: dict) -> str:
    rows = [f"{'run':<15}{'ttft ms':>10}{'cached':>8}{'prefilled':>10}{'steps':>6}"]
    for name in ("miss_no_cache", "miss_cache", "hit"):
        r = rec.get(name)
        if r:
            rows.append(f"{name:<15}{fmt(r['ttft_ms_median'], '.2f'):>10}{r['cached_tokens']:>8}"
                        f"{r['prefilled_tokens']:>10}{r['steps']:>6}")
    if "snapshot_copy" in rec:
        rows.append(f"snapshot copy: {fmt(rec['snapshot_copy']['ms'], '.3f')} ms for "
                    f"{rec['snapshot_copy']['bytes']:,} bytes")
    return "\n".join(rows + target_rows(rec))


def main(argv: list[str] | None = None) -> dict:
    def add_arguments(p):
        p.add_argument("--prefix", type=int, default=None, help="shared prefix tokens")
        p.add_argument("--suffix", type=int, default=None, help="tokens after the prefix")
        p.add_argument("--token-budget", type=int, default=None, help="tokens per engine step (chunked prefill)")
        p.add_argument("--page-size", type=int, default=16)

    return engine_script(argv, __doc__, "prefix_bench", {"gpu": GPU_DEFAULTS, "dry": DRY_DEFAULTS}, add_arguments,
                         bench, table, lambda a: f"{a.family} {a.size}: prefix {a.prefix} + suffix {a.suffix}")


if __name__ == "__main__":
    main()
