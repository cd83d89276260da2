"""`hgc run ARTIFACT --prompt-ids "1,2;3"`: prompts through a compiled artifact on the engine.

The artifact's backends are the ones its routing.json names (runtime/binding.py), on the device it
was compiled for (`--device` defaults to its target); with --json the output adds the engine's
per-phase timing, the prompt tokens each request found in the prefix cache, the graph runner's step
counters (on cuda) and `executed_backends`: per layer id, the backends the op calls actually
reached, recorded at dispatch.
"""

from __future__ import annotations

import sys

from compiler.cli.compile_commands import fail

__all__ = ["cmd_run", "add_run_arguments"]


def cmd_run(args) -> int:
    """Run prompts through a compiled artifact on the engine (continuous batching, chunked prefill)."""
    from compiler.cli.prompts import check_vocab, parse_prompt_ids, print_outputs
    from runtime.engine import SamplingParams
    from runtime.graph_runner import CaptureError, ParityError
    from runtime.loader import LoadError, load_artifact
    from runtime.server.cli import prefix_cache_options
    from runtime.server.model import EngineOptions, engine_for_artifact

    prompts = parse_prompt_ids(args.prompt_ids)
    try:
        art = load_artifact(args.artifact, device=args.device)  # None: the artifact's target
        device = art.device
    except LoadError as e:
        return fail("run", e)
    check_vocab(prompts, int(art.manifest["model"]["vocab_size"]))
    log = lambda line: print(f"hgc run: {line}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        options = EngineOptions(slots=len(prompts), token_budget=args.max_tokens_per_step,
                                speculative_tokens=args.speculative_tokens, **prefix_cache_options(args))
        engine = engine_for_artifact(art, options, max(map(len, prompts)) + args.max_new_tokens, device=device,
                                     graphs=not args.no_graphs, log=log)
    except (LoadError, CaptureError, ParityError, ValueError) as e:
        return fail("run", e)
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed,
                                stop_token_ids=frozenset(int(t) for t in args.stop_ids.split(",") if t.strip()))
        ids = [engine.add_request(p, params) for p in prompts]
    except ValueError as e:  # a sampling setting out of range, a stop id that is not an integer
        return fail("run", e)
    results = engine.run_until_done()
    outputs = [list(results[i].output_ids) for i in ids]
    # what the backends were actually called for, recorded at dispatch (not read from routing.json)
    extra = {"timing": engine.timing(), "cached_tokens": [results[i].cached_tokens for i in ids],
             "executed_backends": engine.ops.executed_backends()}
    if engine.runner is not None:
        extra["steps"] = dict(engine.runner.counters)
    print_outputs(prompts, outputs, args.json, extra=extra)
    return 0


def add_run_arguments(subparsers) -> None:
    p = subparsers.add_parser("run", help="generate from a compiled artifact on the engine (CPU reference or GPU backends)")
    p.add_argument("artifact")
    p.add_argument("--prompt-ids", required=True, help='token ids, prompts separated by ";": "1,2,3;4,5"')
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="seed of each request's sampler (reproducible runs)")
    p.add_argument("--stop-ids", default="", help="comma-separated stop token ids")
    p.add_argument("--max-tokens-per-step", type=int, default=512, help="chunked-prefill token budget per step")
    p.add_argument("--device", default=None,
                   help="the device the artifact was compiled for (default: its --target): its routing.json "
                        "binds that device's backends; on cuda, CUDA graphs")
    p.add_argument("--no-graphs", action="store_true", help="on cuda: run every step eagerly, capture nothing")
    p.add_argument("--json", action="store_true", help="outputs and per-phase timing as one JSON document")
    from runtime.server.cli import add_prefix_cache_arguments, add_speculative_argument  # flags `hgc serve` has too
    add_prefix_cache_arguments(p)
    add_speculative_argument(p)
    p.set_defaults(func=cmd_run)
