"""Multi-turn benchmark: time to first token per turn of many chats at once, with the prefix cache on
and off, its hit rate and snapshot memory; and a short prompt on an idle engine against a decode step.

On the GPU machine, one run:

    python3 benchmarks/serving/multiturn_bench.py --out $OUT                        # qwen3_next, bench, bf16
    python3 benchmarks/serving/multiturn_bench.py --out $OUT --family kimi_linear   # KDA + MLA
    python3 benchmarks/serving/multiturn_bench.py --dry-run --out /tmp/mt           # CPU: tiny, float32, reference
                                                                                    # backend, graphs rerun

1. init_compile: `hgc init-model`, `hgc compile` (on the GPU: --target cuda --dtype bfloat16).
2. engine: one engine as `hgc serve` builds it (runtime/assembly.engine_for_artifact: pools,
   backend, a started GraphRunner, the artifact's extend buckets clipped to --token-budget), a
   state slot per conversation, the prefix cache on. The dry run builds the same with
   testkit/graph_cases.RerunGraphs standing in for CUDA graphs.
3. warm_up: one conversation of two turns with the cache on and off, untimed.
4. short_prompt: on the idle engine, cache off, --iters requests of --short-prompt tokens, each to
   --short-prompt + 1 new tokens: time to first token against the batch-1 decode step (the rest of
   the request's time over its other tokens). Goal (issue 49): the first at most 2x the second.
5. cache_off, cache_on: --conversations chats driven straight on the engine, turn by turn: each turn
   adds --min-user..--max-user new user tokens (random ids, seeded, the same in both runs) to the
   conversation so far, all conversations' requests are added at once and run to their ends (greedy,
   --output tokens each, no stop token); the next turn's prompt is the previous prompt, its output
   and the new user tokens. Per turn: TTFT median and p90 (from add_request to the sampled token on
   the host), prompt and cached tokens (hit rate: cached over prompt tokens), the snapshot pool's
   bytes in use after the turn. The cache is cleared before each run. Each is run --passes times
   (the same chats; the cache cleared before each pass) and a turn's median and p90 are taken over
   every pass's requests: one pass's median of 32 requests moved by a fifth between calls at turn 8
   (`pass_medians_ms` keeps each pass's). Where a turn's time went (`turn_steps`, the last pass's):
   each step that fed prompt tokens with its seconds, requests left waiting for admission, pages
   the cache evicted; per pass, the prefill steps' seconds and the wall time until every request
   had its first token (`pass_prefill_ms`, `pass_prefill_wall_ms`). Goal: turn N's median TTFT with the cache within 1.5x of
   turn 1's (TTFT flat as the conversation grows).
Every stage is wrapped (bench_common.Stages); JSON to OUT/multiturn_bench.json after each stage,
a table last. Goals are judged on the GPU only (bench_common.verdict).
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench_common import Stages, compiled_artifact, engine_script, fmt, target_rows  # noqa: E402
from runtime.engine.engine import Engine, SamplingParams  # noqa: E402

GPU_DEFAULTS = dict(family="qwen3_next", size="bench", conversations=32, turns=8, min_user=64, max_user=256,
                    output=64, short_prompt=32, iters=5, token_budget=512, passes=3)
# The dry run walks every stage on the CPU reference backend: few, short turns keep it under a minute.
DRY_DEFAULTS = dict(family="qwen3_next", size="tiny", conversations=3, turns=3, min_user=8, max_user=24,
                    output=3, short_prompt=8, iters=1, token_budget=32, passes=2)
TARGET_FLAT_TTFT = 1.5  # turn N's median TTFT with the cache over turn 1's
TARGET_SHORT_PROMPT = 2.0  # a short prompt's TTFT over the batch-1 decode step


def p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


class Chats:
    """Each conversation's user turns: random ids, seeded, drawn once, so runs with the cache on and
    off send the same user tokens (their outputs are the model's own in each run)."""

    def __init__(self, vocab: int, conversations: int, turns: int, min_user: int, max_user: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(min_user, max_user + 1, (conversations, turns), generator=g).tolist()
        self.user = [[torch.randint(2, vocab, (n,), generator=g).tolist() for n in row] for row in lens]

    @property
    def turns(self) -> int:
        return len(self.user[0])

    def longest(self, output: int) -> int:
        """The most tokens a conversation holds at its last turn's end."""
        return max(sum(map(len, turns)) for turns in self.user) + self.turns * output


def run_turns(engine: Engine, chats: Chats, output: int, snapshot_bytes) -> list[dict]:
    """Every turn of every conversation, a turn's requests added at once; one row per turn, with
    each request's TTFT (`ttft_s`) and the turn's steps (`turn_steps`)."""
    params = SamplingParams(max_new_tokens=output)
    history: list[list[int]] = [[] for _ in chats.user]
    rows = []
    for turn in range(chats.turns):
        prompts = [h + user[turn] for h, user in zip(history, chats.user)]
        evicted = engine.prefix_cache.tree.evicted_pages if engine.prefix_cache is not None else 0
        ids = [engine.add_request(p, params) for p in prompts]
        steps = turn_steps(engine)
        results = engine.run_until_done()
        done = [results[i] for i in ids]
        prompt_tokens, cached = sum(map(len, prompts)), sum(r.cached_tokens for r in done)
        if engine.prefix_cache is not None:
            steps["evicted_pages"] = engine.prefix_cache.tree.evicted_pages - evicted
        rows.append({"turn": turn + 1, "ttft_s": [r.first_token_s for r in done],
                     "prompt_tokens": prompt_tokens, "cached_tokens": cached, "hit_rate": cached / prompt_tokens,
                     "snapshot_bytes_in_use": snapshot_bytes(), "outputs": [list(r.output_ids) for r in done],
                     "turn_steps": steps})
        history = [p + list(r.output_ids) for p, r in zip(prompts, done)]
    return rows


def turn_steps(engine: Engine) -> dict:
    """Steps the engine until it is idle and says where a turn's time went: each step that fed prompt
    tokens (its prompt and decode tokens, its seconds as the engine records them), the requests
    still waiting for admission after each step() call while any wait, and the prefill steps' sum
    against the wall time until every request had its first token. What tells a turn that is slower per step from one with
    more steps, one that queues for memory, or host time between steps."""
    start, first = engine.numbers.totals["steps"], time.perf_counter()
    waiting, prefill_wall = [], 0.0
    while engine.has_work():
        engine.step()
        if engine.scheduler.waiting:
            waiting.append(len(engine.scheduler.waiting))
        if not prefill_wall and not engine.scheduler.waiting and \
                all(r.first_token_s is not None for r in engine.scheduler.running):
            prefill_wall = time.perf_counter() - first  # every request of the turn has its first token
    taken = engine.numbers.totals["steps"] - start
    records = engine.step_records()[-taken:] if taken else []
    prefill = [r for r in records if r.prefill_tokens]
    return {"steps": taken, "steps_kept": len(records), "waiting_after_step": waiting,
            "prefill_steps": [[r.prefill_tokens, r.decode_tokens, round(1e3 * r.seconds, 3)] for r in prefill],
            "prefill_ms": 1e3 * sum(r.seconds for r in prefill), "prefill_wall_ms": 1e3 * prefill_wall}


def pooled_turn(rows: tuple[dict, ...]) -> dict:
    """One turn's row over its passes: median and p90 over every pass's requests, each pass's median
    beside them; the counts are the last pass's (the same chats give the same prompts every pass)."""
    ttft = [t for r in rows for t in r["ttft_s"]]
    last = {k: v for k, v in rows[-1].items() if k not in ("ttft_s", "outputs")}
    return {**last, "ttft_ms_median": 1e3 * statistics.median(ttft), "ttft_ms_p90": 1e3 * p90(ttft),
            "pass_medians_ms": [1e3 * statistics.median(r["ttft_s"]) for r in rows],
            "pass_prefill_ms": [r["turn_steps"]["prefill_ms"] for r in rows],
            "pass_prefill_wall_ms": [r["turn_steps"]["prefill_wall_ms"] for r in rows]}


def bench(args, rec: dict, save) -> None:
    from runtime.artifact.bundle import CompiledOptions
    from runtime.artifact.loader import load_artifact
    from runtime.assembly import EngineOptions, engine_for_artifact
    from runtime.graphs.runner import GraphRunner

    device = torch.device("cpu" if args.dry_run else "cuda")
    stages = Stages(rec["stages"], skip=args.skip.split(",") if args.skip else (), save=save)
    art_dir = None
    state: dict = {}

    def init_compile():
        nonlocal art_dir
        art_dir = compiled_artifact(args)

    def engine():
        # Kernels this engine's limits need beyond the bundle's are built here (the bench times turns, not start-up).
        art = load_artifact(art_dir, device=str(device), compiled=CompiledOptions(allow_builds=True))
        vocab = int(art.manifest["model"]["vocab_size"])
        chats = Chats(vocab, args.conversations, args.turns, args.min_user, args.max_user)
        max_len = max(chats.longest(args.output), 2 * args.short_prompt + 1)
        options = EngineOptions(slots=args.conversations, token_budget=args.token_budget, page_size=args.page_size,
                                prefix_snapshots=args.prefix_snapshots)
        graphs = True
        if args.dry_run:
            from testkit.graph_cases import RerunGraphs
            graphs = RerunGraphs()
        eng = engine_for_artifact(art, options, max_len, device=device, graphs=graphs,
                                  log=lambda line: print(f"  {line}", flush=True))
        state.update(engine=eng, cache=eng.prefix_cache, chats=chats, vocab=vocab)
        snapshots = eng.prefix_cache.snapshots
        runner = eng.runner
        rec["engine"] = {"device": str(device), "graphs": isinstance(runner, GraphRunner),
                         "token_budget": args.token_budget, "page_size": args.page_size, "max_len": max_len,
                         "kv_pages": eng.kv_pool.num_pages, "snapshots": snapshots.num_snapshots,
                         "snapshot_pool_bytes": snapshots.nbytes(),
                         "keys": [str(k) for k in runner.keys] if isinstance(runner, GraphRunner) else []}

    def cache_on(on: bool) -> Engine:
        # Between runs, the engine idle: the same engine (pools, graphs) with or without its cache.
        eng = state["engine"]
        state["cache"].clear()
        eng.prefix_cache = state["cache"] if on else None
        return eng

    def snapshot_bytes() -> int:
        pool = state["cache"].snapshots
        return (pool.num_snapshots - pool.num_free) * pool.nbytes() // max(pool.num_snapshots, 1)

    def warm_up():
        one = Chats(state["vocab"], 1, 2, args.min_user, args.max_user, seed=1)
        for on in (False, True):
            run_turns(cache_on(on), one, args.output, snapshot_bytes)

    def short_prompt():
        eng, g = cache_on(False), torch.Generator().manual_seed(2)
        runs = []
        for _ in range(args.iters):
            prompt = torch.randint(2, state["vocab"], (args.short_prompt,), generator=g).tolist()
            r = eng.generate(prompt, SamplingParams(max_new_tokens=args.short_prompt + 1))
            runs.append((r.first_token_s, (r.total_s - r.first_token_s) / args.short_prompt))
        rec["short_prompt"] = {"tokens": args.short_prompt,
                               "ttft_ms_median": 1e3 * statistics.median(t for t, _ in runs),
                               "decode_step_ms_median": 1e3 * statistics.median(d for _, d in runs)}

    def chats(on: bool):
        passes = [run_turns(cache_on(on), state["chats"], args.output, snapshot_bytes) for _ in range(args.passes)]
        rec["cache_on" if on else "cache_off"] = {"passes": args.passes, "turns": [pooled_turn(rows) for rows in zip(*passes)]}
        state["outputs_on" if on else "outputs_off"] = [r["outputs"] for r in passes[-1]]

    stages("init_compile", init_compile)
    stages("engine", engine, needs=("init_compile",))
    stages("warm_up", warm_up, needs=("engine",))
    stages("short_prompt", short_prompt, needs=("engine",))
    stages("cache_off", lambda: chats(False), needs=("engine",))
    stages("cache_on", lambda: chats(True), needs=("engine",))
    if "outputs_on" in state and "outputs_off" in state:
        # Greedy on both sides; a bf16 step of another batch layout may round differently, so this is
        # reported, not a goal (the CPU tests check exactness: tests/runtime/cache/).
        pairs = [(a, b) for on, off in zip(state["outputs_on"], state["outputs_off"]) for a, b in zip(on, off)]
        rec["same_outputs"] = sum(a == b for a, b in pairs) / len(pairs)
    if "cache" in state:
        # in_step: the steps write the snapshots inside their chunks (docs/DESIGN.md, "The prefix cache's snapshots")
        rec["prefix_cache"] = {**state["cache"].stats(), "in_step": state["cache"].in_step}
    targets(rec)


def targets(rec: dict) -> None:
    out = {}
    turns = rec.get("cache_on", {}).get("turns") or []
    if len(turns) > 1:
        ratio = turns[-1]["ttft_ms_median"] / turns[0]["ttft_ms_median"]
        out["flat_ttft"] = {"value": ratio, "goal": f"turn {turns[-1]['turn']} / turn 1 <= {TARGET_FLAT_TTFT}x",
                            "met": ratio <= TARGET_FLAT_TTFT}
    short = rec.get("short_prompt")
    if short:
        ratio = short["ttft_ms_median"] / short["decode_step_ms_median"]
        out["short_prompt"] = {"value": ratio, "goal": f"TTFT / decode step <= {TARGET_SHORT_PROMPT}x",
                               "met": ratio <= TARGET_SHORT_PROMPT}
    rec["targets"] = out


def table(rec: dict) -> str:
    rows = [f"{'turn':>4}{'off p50 ms':>12}{'off p90 ms':>12}{'on p50 ms':>11}{'on p90 ms':>11}{'prompt':>9}"
            f"{'hit rate':>10}{'snapshot MB':>13}{'on prefill steps':>18}{'on steps ms':>13}{'on wall ms':>12}"]
    off, on = (rec.get(k, {}).get("turns") or [] for k in ("cache_off", "cache_on"))
    for i in range(max(len(off), len(on))):
        a, b = (off[i] if i < len(off) else {}), (on[i] if i < len(on) else {})
        row = b or a
        rows.append(f"{row['turn']:>4}{fmt(a.get('ttft_ms_median'), '.2f'):>12}{fmt(a.get('ttft_ms_p90'), '.2f'):>12}"
                    f"{fmt(b.get('ttft_ms_median'), '.2f'):>11}{fmt(b.get('ttft_ms_p90'), '.2f'):>11}"
                    f"{row['prompt_tokens']:>9}{fmt(b.get('hit_rate'), '.1%'):>10}"
                    f"{fmt(b.get('snapshot_bytes_in_use', 0) / 2**20 if b else None, '.2f'):>13}"
                    f"{len(b['turn_steps']['prefill_steps']) if b else '-':>18}"
                    f"{fmt(statistics.median(b['pass_prefill_ms']) if b else None, '.2f'):>13}"
                    f"{fmt(statistics.median(b['pass_prefill_wall_ms']) if b else None, '.2f'):>12}")
    short = rec.get("short_prompt")
    if short:
        rows.append(f"short prompt ({short['tokens']} tokens, idle engine): TTFT {fmt(short['ttft_ms_median'], '.2f')} "
                    f"ms, batch-1 decode step {fmt(short['decode_step_ms_median'], '.3f')} ms")
    if "same_outputs" in rec:
        rows.append(f"outputs equal with the cache on and off: {rec['same_outputs']:.0%} of turns")
    return "\n".join(rows + target_rows(rec))


def main(argv: list[str] | None = None) -> dict:
    def add_arguments(p):
        p.add_argument("--conversations", type=int, default=None, help="chats run at once")
        p.add_argument("--turns", type=int, default=None, help="turns per chat")
        p.add_argument("--min-user", type=int, default=None, help="fewest new user tokens a turn adds")
        p.add_argument("--max-user", type=int, default=None, help="most new user tokens a turn adds")
        p.add_argument("--output", type=int, default=None, help="tokens generated per turn (greedy, no stop token)")
        p.add_argument("--short-prompt", type=int, default=None, help="tokens of the idle engine's short prompt")
        p.add_argument("--token-budget", type=int, default=None, help="tokens per engine step (chunked prefill)")
        p.add_argument("--passes", type=int, default=None,
                       help="runs of all the chats, with the cache and without; a turn's TTFT is taken over all of them")
        p.add_argument("--page-size", type=int, default=16)
        p.add_argument("--prefix-snapshots", type=int, default=None,
                       help="snapshot pool size (default: the engine's, one per state slot)")

    def check(a):
        if a.passes < 1:
            raise SystemExit(f"multiturn_bench: --passes {a.passes}: need at least 1")
        if not 1 <= a.min_user <= a.max_user:
            raise SystemExit(f"multiturn_bench: --min-user {a.min_user} and --max-user {a.max_user}: need "
                             f"1 <= min <= max")
        return f"{a.family} {a.size}: {a.conversations} chats x {a.turns} turns, {a.min_user}-{a.max_user} user + " \
               f"{a.output} output tokens a turn"

    return engine_script(argv, __doc__, "multiturn_bench", {"gpu": GPU_DEFAULTS, "dry": DRY_DEFAULTS}, add_arguments,
                         bench, table, check)


if __name__ == "__main__":
    main()
