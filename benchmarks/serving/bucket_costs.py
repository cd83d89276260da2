"""Bucket costs: what one step of each extend bucket costs on this device, written for
`hgc compile --bucket-costs FILE` to choose the extend buckets from (compiler/bucket_choice.py).

On the GPU machine, one run:

    python3 benchmarks/serving/bucket_costs.py --out $OUT                       # qwen3_next, bench size, bf16
    python3 benchmarks/serving/bucket_costs.py --out $OUT --family kimi_linear
    python3 benchmarks/serving/bucket_costs.py --dry-run --out /tmp/bc          # CPU: tiny, reference backend,
                                                                                # graphs rerun
    hgc compile CKPT --target cuda --dtype bfloat16 --bucket-costs $OUT/bucket_costs.json -o ART

1. init_compile: `hgc init-model`, `hgc compile` with the default buckets (every candidate).
2. engine: the engine `hgc serve` builds (runtime/assembly.engine_for_artifact: a started
   GraphRunner) with state slots for the mixed steps (the power of two above --mixed-decodes) and
   a step budget of --max-tokens: every extend bucket up to it is captured and parity-checked. The dry run uses testkit/graph_cases.RerunGraphs.
3. extend: per captured extend bucket of T tokens, one fresh request of T tokens (the step a short
   prompt or a prefix hit's suffix of that length is): the median of --iters runs of the built step
   (copy into the static buffers, the backends' plans, the graphs and the eager gaps), timed between
   CUDA events (perf_counter on the CPU).
4. decode: the batch-1 decode step the same way (a request with DECODE_HISTORY tokens), the unit the
   issue's goals are stated in.
5. mixed: what a serving step under load is: --mixed-decodes requests decoding (DECODE_HISTORY tokens
   each) and one fresh prompt filling each extend bucket from twice their count up, against the same
   decodes alone and the same prompt alone (its own bucket), the sum of the parts beside the whole.
   This is the table a token budget (`hgc serve --token-budget`) is chosen from.
Writes OUT/bucket_costs.json (the costs document, compiler/splitops/artifact.py `bucket_costs_doc`)
and OUT/bucket_costs_bench.json (every stage, the buckets the compile would keep), a table last.
"""

from __future__ import annotations

import json
import os
import sys

if "--dry-run" in sys.argv and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from bench_common import Stages, compiled_artifact, decode_batch, engine_script, fmt, time_ms  # noqa: E402

GPU_DEFAULTS = dict(family="qwen3_next", size="bench", iters=20, max_tokens=4096, mixed_decodes=128)
DRY_DEFAULTS = dict(family="qwen3_next", size="tiny", iters=2, max_tokens=32, mixed_decodes=4)
DECODE_HISTORY = 64  # tokens the decode step's request holds already


def bench(args, rec: dict, save) -> None:
    from compiler.bucket_choice import choose_extend_buckets
    from compiler.splitops import Mode
    from compiler.splitops.artifact import BucketCosts, bucket_costs_doc
    from runtime.artifact.bundle import CompiledOptions
    from runtime.artifact.loader import load_artifact
    from runtime.assembly import EngineOptions, engine_for_artifact
    from runtime.cache.batch import SeqState

    device = torch.device("cpu" if args.dry_run else "cuda")
    stages = Stages(rec["stages"], skip=args.skip.split(",") if args.skip else (), save=save)
    state: dict = {}

    def init_compile():
        state["art_dir"] = compiled_artifact(args)

    def engine():
        art = load_artifact(state["art_dir"], device=str(device), compiled=CompiledOptions(allow_builds=True))
        graphs = True
        if args.dry_run:
            from testkit.graph_cases import RerunGraphs
            graphs = RerunGraphs()
        # slots for the mixed steps (their decodes and one prompt), a power of two as hgc serve's
        # --slots usually is: the extend graphs then hold as many request rows as a server's
        slots = 1 << (args.mixed_decodes + 1).bit_length()
        eng = engine_for_artifact(art, EngineOptions(slots=slots, token_budget=args.max_tokens,
                                                     prefix_cache=False),
                                  max(args.max_tokens, DECODE_HISTORY) + 1, device=device, graphs=graphs,
                                  log=lambda line: print(f"  {line}", flush=True))
        if eng.runner is None or not hasattr(eng.runner, "keys"):
            raise RuntimeError("bucket costs need captured graphs: the engine started without a graph runner")
        state.update(engine=eng, vocab=int(art.manifest["model"]["vocab_size"]))
        rec["engine"] = {"device": str(device), "keys": [str(k) for k in eng.runner.keys]}

    def timed(items) -> float:
        runner = state["engine"].runner
        step, key = runner.build(items)
        if key is None:
            raise RuntimeError(f"a step of {sum(len(t) for _, t in items)} tokens found no captured key")
        return time_ms(lambda: runner.run(step, key), device, iters=args.iters)

    def prompt_ms(tokens: int, g: torch.Generator, decodes=()) -> float:
        """One fresh prompt of `tokens` tokens in a step (beside `decodes`' items), timed; freed after."""
        runner = state["engine"].runner
        seq = SeqState(runner.state_pool.alloc())
        try:
            return timed([*decodes, (seq, torch.randint(1, state["vocab"], (tokens,), generator=g).tolist())])
        finally:
            runner.kv_pool.free(seq.pages)
            runner.state_pool.free(seq.slot)

    def extend_tokens() -> list[int]:
        return sorted({k.tokens for k in state["engine"].runner.keys if k.mode == Mode.EXTEND})

    def extend():
        g = torch.Generator().manual_seed(0)
        state["extend_ms"] = {tokens: prompt_ms(tokens, g) for tokens in extend_tokens()}

    def mixed():
        eng, g, n = state["engine"], torch.Generator().manual_seed(2), args.mixed_decodes
        rows = []
        with decode_batch(eng.runner, eng.runner.state_pool, n, state["vocab"], g, DECODE_HISTORY) as items:
            decodes_ms = timed(items)
            for bucket in (t for t in extend_tokens() if t >= 2 * n):
                prompt = bucket - n
                whole, alone = prompt_ms(prompt, g, items), prompt_ms(prompt, g)
                rows.append({"decodes": n, "prompt_tokens": prompt, "step_tokens": bucket, "mixed_ms": whole,
                             "decodes_alone_ms": decodes_ms, "prompt_alone_ms": alone,
                             "mixed_over_parts": whole / (decodes_ms + alone),
                             "prompt_tokens_per_ms": prompt / whole})
        rec["mixed"] = rows

    def decode():
        eng, g = state["engine"], torch.Generator().manual_seed(1)
        with decode_batch(eng.runner, eng.runner.state_pool, 1, state["vocab"], g, DECODE_HISTORY) as items:
            state["decode_ms"] = {1: timed(items)}

    stages("init_compile", init_compile)
    stages("engine", engine, needs=("init_compile",))
    stages("extend", extend, needs=("engine",))
    stages("decode", decode, needs=("engine",))
    stages("mixed", mixed, needs=("engine",))
    if "extend_ms" in state:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        costs = BucketCosts(name, tuple(sorted(state["extend_ms"].items())),
                            tuple(sorted(state.get("decode_ms", {}).items())))
        doc = bucket_costs_doc(costs, model=f"{args.family} {args.size}", dtype=args.dtype or "", iters=args.iters)
        (Path(args.out) / "bucket_costs.json").write_text(json.dumps(doc, indent=1) + "\n")
        rec["costs"] = doc
        rec["kept"] = list(choose_extend_buckets(costs))


def table(rec: dict) -> str:
    costs = rec.get("costs") or {}
    extend, decode = costs.get("extend_ms", {}), costs.get("decode_ms", {})
    kept = set(rec.get("kept") or ())
    rows = [f"{'extend tokens':>14}{'step ms':>10}{'x decode':>10}  kept"]
    unit = decode.get("1")
    for tokens, ms in extend.items():
        rows.append(f"{tokens:>14}{fmt(ms, '.3f'):>10}{fmt(ms / unit if unit else None, '.2f'):>10}  "
                    f"{'yes' if int(tokens) in kept else 'no'}")
    if unit:
        rows.append(f"batch-1 decode step: {fmt(unit, '.3f')} ms")
    if rec.get("mixed"):
        rows.append(f"{'decodes':>8}{'prompt':>8}{'step ms':>10}{'decodes ms':>12}{'prompt ms':>11}{'whole/parts':>13}"
                    f"{'prompt tok/ms':>15}")
        rows += [f"{m['decodes']:>8}{m['prompt_tokens']:>8}{m['mixed_ms']:>10.3f}{m['decodes_alone_ms']:>12.3f}"
                 f"{m['prompt_alone_ms']:>11.3f}{m['mixed_over_parts']:>13.2f}{m['prompt_tokens_per_ms']:>15.1f}"
                 for m in rec["mixed"]]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    def add_arguments(p):
        p.add_argument("--max-tokens", type=int, default=None, help="the largest extend bucket measured")
        p.add_argument("--mixed-decodes", type=int, default=None,
                       help="requests decoding in the mixed steps (default 128 on the GPU)")

    return engine_script(argv, __doc__, "bucket_costs_bench", {"gpu": GPU_DEFAULTS, "dry": DRY_DEFAULTS},
                         add_arguments, bench, table, lambda a: f"{a.family} {a.size}: extend buckets up to "
                                                            f"{a.max_tokens} tokens")


if __name__ == "__main__":
    main()
