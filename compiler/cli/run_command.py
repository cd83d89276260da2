"""`hgc run ARTIFACT --prompt-ids "1,2;3"`: prompts through a compiled artifact on the engine.

The artifact's backends are the ones its routing.json names (runtime/binding.py), on the device it
was compiled for (`--device` defaults to its target); with --json the output adds the engine's
per-phase timing, the prompt tokens each request found in the prefix cache, the graph runner's step
counters (on cuda), `executed_backends`: per layer id, the backends the op calls actually
reached, recorded at dispatch, and `compiled`: the target bundle whose pieces ran (kernels built
at start-up, Inductor compiles, the start-up parity of compiled against traced glue).
"""

from __future__ import annotations

import sys
import time

from compiler.cli.errors import UsageError
from compiler.cli.prompts import check_request_limits, check_vocab, parse_prompt_ids, print_outputs, timing_line
from runtime.server.cli import (add_compiled_arguments, add_prefix_cache_arguments, add_speculative_argument,
                                device_arg, device_problem, float_in, int_at_least, prefix_cache_options, token_ids)

__all__ = ["cmd_run", "add_run_arguments"]


def cmd_run(args) -> int:
    """Run prompts through a compiled artifact on the engine (continuous batching, chunked prefill)."""
    from runtime.artifact_docs import config_value, read_artifact
    from runtime.engine import SamplingParams
    from runtime.loader import load_artifact
    from runtime.server.cli import compiled_options
    from runtime.server.model import EngineOptions, engine_for_artifact
    from runtime.speculative import check_draft_program

    prompts = parse_prompt_ids(args.prompt_ids)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop_token_ids=args.stop_ids)
    options = EngineOptions(slots=len(prompts), token_budget=args.max_tokens_per_step,
                            speculative_tokens=args.speculative_tokens, **prefix_cache_options(args))
    # The limits first, from the documents alone: nothing is loaded or allocated for a request that cannot run.
    docs = read_artifact(args.artifact)
    device = args.device or docs.routing.target  # default: the device it was compiled for
    if args.device is None and (why := device_problem(device)) is not None:
        raise UsageError(f"{args.artifact} is compiled for {device} (--target {device}): {why}",
                         hint="recompile the checkpoint with --target cpu to run it here")
    check_vocab(prompts, int(docs.manifest["model"]["vocab_size"]))
    if args.speculative_tokens:
        check_draft_program(docs)
    check_request_limits(prompts, args.max_new_tokens, positions=config_value(docs.manifest, "max_position_embeddings"),
                         registry=docs.registry, weight_bytes=docs.stored_weight_bytes(), device=device)
    art = load_artifact(args.artifact, device=device, progress=args.progress, compiled=compiled_options(args))
    log = lambda line: print(f"hgc run: {line}", file=sys.stderr, flush=True)  # noqa: E731
    engine = engine_for_artifact(art, options, max(map(len, prompts)) + args.max_new_tokens, device=art.device,
                                 graphs=not args.no_graphs, log=log, progress=args.progress)
    ids = [engine.add_request(p, params) for p in prompts]
    start = time.perf_counter()
    results = engine.run_until_done()
    seconds = time.perf_counter() - start
    outputs = [list(results[i].output_ids) for i in ids]
    # what the backends were actually called for, recorded at dispatch (not read from routing.json)
    timing = engine.timing()
    extra = {"timing": timing, "cached_tokens": [results[i].cached_tokens for i in ids],
             "executed_backends": engine.ops.executed_backends()}
    if engine.runner is not None:
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
               '  hgc run artifacts/tiny --prompt-ids "1,2,3" --temperature 0.8 --top-p 0.9 --seed 7 --json')
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--prompt-ids", required=True, help='token ids, prompts separated by ";": "1,2,3;4,5"')
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=16,
                   help="tokens to generate per prompt (checked against the model's positions and free memory)")
    p.add_argument("--temperature", type=float_in(0), default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--top-k", type=int_at_least(0), default=0, help="sample from the k most likely tokens; 0: off")
    p.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p; 1: off")
    p.add_argument("--seed", type=int, default=None,
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
    add_speculative_argument(p)
    add_compiled_arguments(p)
    p.set_defaults(func=cmd_run)
