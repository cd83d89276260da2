"""`hgc run ARTIFACT --prompt-ids "1,2;3"`: prompts through a compiled artifact on the engine.

The artifact's backends are the ones its routing.json names (runtime/artifact/binding.py), on the device it
was compiled for (`--device` defaults to its target); with --json the output adds the engine's
per-phase timing, the prompt tokens each request found in the prefix cache, the graph runner's step
counters (on cuda), `executed_backends`: per layer id, the backends the op calls actually
reached, recorded at dispatch, and `compiled`: the target bundle whose pieces ran (kernels built
at start-up, Inductor compiles, the start-up parity of compiled against traced glue).

`--tp N` runs a tensor-parallel artifact on N ranks (runtime/dist/distributed.py): the command launches
them (runtime/dist/launcher.py) or, under torchrun, is one of them; rank 0 prints, the others follow
its steps. `--load-format dummy` runs random weights (an artifact compiled with --no-weights).
"""

from __future__ import annotations

import sys
import time

from hgc.errors import UsageError
from hgc.prompts import check_request_limits, check_vocab, parse_prompt_ids, print_outputs, timing_line
from hgc.serve_command import (SEED_LIMIT, add_compiled_arguments, add_overlap_argument, add_prefix_cache_arguments,
                                add_speculative_argument, add_tp_arguments, compiled_options, device_arg, device_problem,
                                float_in, int_at_least, prefix_cache_options, schedule_options, start_ranks, token_ids)

__all__ = ["cmd_run", "add_run_arguments"]


def cmd_run(args) -> int:
    """Run prompts through a compiled artifact on the engine (continuous batching, chunked prefill)."""
    from runtime.artifact.docs import config_value, read_artifact
    from runtime.engine.engine import SamplingParams
    from runtime.assembly import EngineOptions
    from runtime.engine.speculative import check_draft_program
    from runtime.artifact.weights import check_load_format

    prompts = parse_prompt_ids(args.prompt_ids)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop_token_ids=args.stop_ids)
    options = EngineOptions(slots=len(prompts), token_budget=args.max_tokens_per_step,
                            speculative_tokens=args.speculative_tokens, **schedule_options(args),
                            **prefix_cache_options(args))
    # The limits first, from the documents alone: nothing is loaded, allocated or launched for a
    # request that cannot run.
    docs = read_artifact(args.artifact)
    check_load_format(docs, args.load_format)
    device = args.device or docs.routing.target  # default: the device it was compiled for
    if args.device is None and (why := device_problem(device)) is not None:
        raise UsageError(f"{args.artifact} is compiled for {device} (--target {device}): {why}",
                         hint="recompile the checkpoint with --target cpu to run it here")
    check_vocab(prompts, int(docs.manifest["model"]["vocab_size"]))
    if args.speculative_tokens:
        check_draft_program(docs)
    # a rank holds about 1/tp of the stored weights (its cut tensors; the loader checks its exact bytes)
    check_request_limits(prompts, args.max_new_tokens, positions=config_value(docs.manifest, "max_position_embeddings"),
                         registry=docs.registry, weight_bytes=docs.stored_weight_bytes() // docs.tp, device=device)
    code, group = start_ranks(args, "run")
    if code is not None:
        return code  # this process launched the ranks; they have ended
    try:
        return _run(args, prompts, params, options, group.device if group is not None else device, group)
    finally:
        if group is not None:
            group.close()


def _run(args, prompts, params, options, device, group) -> int:
    """`hgc run` in one process: the only one (group None), rank 0 of a tensor-parallel launch (which
    adds the requests and prints), or another rank (which follows rank 0's steps until it stops)."""
    from runtime.dist.distributed import follow
    from runtime.artifact.loader import load_artifact, programs_for_run
    from runtime.assembly import engine_for_artifact

    rank, tp = (group.rank, group.world_size) if group is not None else (0, 1)
    progress = args.progress if rank == 0 else None  # rank 0 speaks for every rank (they load and start alike)
    art = load_artifact(args.artifact, device=device, progress=progress, compiled=compiled_options(args),
                        rank=rank, tp=tp, load_format=args.load_format,
                        programs=programs_for_run(options.speculative_tokens))

    def log(line: str) -> None:  # the memory plan, what start-up did; nothing with --quiet
        if rank == 0 and not args.quiet:
            print(f"hgc run: {line}", file=sys.stderr, flush=True)

    engine = engine_for_artifact(art, options, max(map(len, prompts)) + args.max_new_tokens, device=art.device,
                                 graphs=not args.no_graphs, log=log, progress=progress,
                                 tp_lead=group if rank == 0 else None)
    if rank > 0:
        follow(engine, group)  # rank 0's steps, until it sends STOP
        return 0
    ids = [engine.add_request(p, params) for p in prompts]
    start = time.perf_counter()
    results = engine.run_until_done()
    seconds = time.perf_counter() - start
    outputs = [list(results[i].output_ids) for i in ids]
    # what the backends were actually called for, recorded at dispatch (not read from routing.json)
    timing = engine.timing()
    extra = {"timing": timing, "cached_tokens": [results[i].cached_tokens for i in ids],
             "executed_backends": engine.ops.executed_backends()}
    if engine.runner.counters:  # a graph runner's: graph replays, piecewise and eager steps
        extra["steps"] = dict(engine.runner.counters)
    if art.compiled is not None:  # the target bundle that ran: kernels built at start-up, parity
        extra["compiled"] = art.compiled.report()
    if not args.quiet:
        decode = timing["decode_tokens_per_s"]
        print(timing_line("run", outputs, seconds, f"prefill {timing['prefill_tokens']} token(s) in "
                          f"{timing['prefill_s']:.2f} s" + (f", decode {decode:.1f} tok/s" if decode else "")
                          + f", {art.device}"), file=sys.stderr)
    print_outputs(prompts, outputs, args.json, extra=extra)
    return 0


def add_run_arguments(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="generate from a compiled artifact on the engine (CPU reference or GPU backends)",
        description="Run prompts through a compiled artifact on the engine (continuous batching, chunked prefill, "
                    "the prefix cache), on the backends its routing.json names; on cuda, from captured CUDA graphs. "
                    "Prints each prompt and its new tokens, and a timing line on stderr.",
        epilog='examples:\n  hgc run artifacts/tiny --prompt-ids "1,2,3;4,5" --max-new-tokens 8\n'
               '  hgc run artifacts/tiny --prompt-ids "1,2,3" --temperature 0.8 --top-p 0.9 --seed 7 --json\n'
               '  hgc run artifacts/tiny-tp2 --tp 2 --prompt-ids "1,2,3"   # compiled with --tp 2; rank 0 prints')
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--prompt-ids", required=True, help='token ids, prompts separated by ";": "1,2,3;4,5"')
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=16,
                   help="tokens to generate per prompt (checked against the model's positions and free memory)")
    p.add_argument("--temperature", type=float_in(0), default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--top-k", type=int_at_least(0), default=0, help="sample from the k most likely tokens; 0: off")
    p.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p; 1: off")
    p.add_argument("--seed", type=int_at_least(0, SEED_LIMIT), default=None,
                   help="seed of each request's sampler, for reproducible runs (default: unseeded)")
    p.add_argument("--stop-ids", type=token_ids, default=frozenset(), metavar="ID,ID,...",
                   help="comma-separated token ids that end a prompt's generation (default: none)")
    p.add_argument("--max-tokens-per-step", type=int_at_least(1), default=512,
                   help="chunked-prefill token budget per engine step")
    p.add_argument("--device", default=None, type=device_arg, metavar="{cpu,cuda,cuda:N}",
                   help="the device the artifact was compiled for (default: its --target): its routing.json "
                        "binds that device's backends; on cuda, CUDA graphs")
    p.add_argument("--no-graphs", action="store_true", help="on cuda: run every step eagerly, capture nothing")
    p.add_argument("--json", action="store_true", help="outputs and per-phase timing as one JSON document")
    add_prefix_cache_arguments(p)  # the flags `hgc serve` has too
    add_overlap_argument(p)
    add_speculative_argument(p)
    add_compiled_arguments(p)
    add_tp_arguments(p)
    p.set_defaults(func=cmd_run)
