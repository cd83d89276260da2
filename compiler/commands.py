"""The compiler's commands: `hgc lint`, `hgc compile`, `hgc inspect`, `hgc run`.

`add_arguments(subparsers)` registers them on the CLI's parser (compiler/cli.py); each `cmd_*`
takes the parsed Namespace and returns an exit code: 0 on success, 1 when lints found errors or
the compile / load failed (the message, on stderr, names what and how to fix it). Tables go to
stdout (tabulate), or one JSON document with --json; progress and timings go to stderr.

    hgc lint CKPT [--json]                      trace config.json on the meta device, run the passes, list findings
    hgc compile CKPT -o artifacts/NAME          write an artifact (--force, --link-weights, --plan-only)
    hgc inspect ARTIFACT [--json]               routing table, split plans, lints of an artifact
    hgc run ARTIFACT --prompt-ids "1,2;3"       greedy tokens from the compiled pieces (CPU reference backend)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from tabulate import tabulate

__all__ = ["add_arguments", "cmd_lint", "cmd_compile", "cmd_inspect", "cmd_run", "routing_rows", "split_rows"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"expected increasing positive integers, got {text!r}")
    return values


def _config(args):
    from compiler.passes.context import CompileConfig
    from compiler.splitops.artifact import DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS

    return CompileConfig(target=args.target, dtype=args.dtype,
                         decode_batch_sizes=getattr(args, "decode_buckets", None) or DEFAULT_DECODE_BATCH_SIZES,
                         extend_token_counts=getattr(args, "extend_buckets", None) or DEFAULT_EXTEND_TOKEN_COUNTS)


def _fail(command: str, error: Exception) -> int:
    print(f"hgc {command}: {error}", file=sys.stderr)
    return 1


# -- tables ----------------------------------------------------------------------------------------


def _programs_in_order(by_program: dict) -> list:
    return sorted(by_program, key=lambda p: (p != "main", p))


def routing_rows(routing: dict) -> list[dict]:
    """One row per (program, layer): kind, ops, backend(s), module."""
    rows = []
    for program in _programs_in_order(routing):
        entries = routing[program]
        by_layer = defaultdict(list)
        for e in entries:
            by_layer[e["layer_id"]].append(e)
        for layer_id in sorted(by_layer, key=lambda x: (x is None, x)):
            es = by_layer[layer_id]
            rows.append({"program": program, "layer": layer_id, "kind": es[0]["kind"],
                         "ops": " ".join(e["op"] for e in es),
                         "backend": " ".join(sorted({e["backend"] for e in es})),
                         "module": es[0]["module"].rsplit(".", 1)[-1]})
    return rows


def split_rows(plans: dict) -> list[dict]:
    """One row per (program, mode): piece counts and the layout (C: captured nodes, E: eager ops)."""
    rows = []
    for program in _programs_in_order(plans):
        for mode, plan in plans[program].items():
            parts = []
            for piece in plan.pieces:
                if piece.kind == "captured":
                    parts.append(f"C{len(piece.nodes)}")
                else:
                    parts.append("E[" + ",".join(piece.nodes) + "]")
            layout = " ".join(parts)
            rows.append({"program": program, "mode": mode.value if hasattr(mode, "value") else mode,
                         "pieces": len(plan.pieces), "captured": plan.counts()["captured"],
                         "eager": plan.counts()["eager"],
                         "layout": layout if len(layout) <= 100 else layout[:97] + "..."})
    return rows


def _findings_table(findings) -> str:
    if not findings:
        return "no findings"
    rows = [(f.severity, f.rule, f.where(), f.message, f.fix) for f in findings]
    return tabulate(rows, headers=("severity", "rule", "where", "message", "fix"), tablefmt="simple",
                    maxcolwidths=[None, None, 28, 70, 48])


def _counts(findings) -> dict:
    return {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}


def _layout_summary(registry) -> str:
    kinds = registry.kinds()
    parts = [f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds)]
    drafts = registry.draft_layers()
    return f"{len(kinds)} layers ({', '.join(parts)})" + (f" + {len(drafts)} draft" if drafts else "")


def _plan_report(result, as_json: bool, title: str) -> int:
    from compiler.lints import sort_findings

    ctx, traced = result.ctx, result.traced
    findings = sort_findings(ctx.findings)
    counts = _counts(findings)
    if as_json:
        print(json.dumps({
            "family": traced.family.name, "target": ctx.config.target, "stopped_after": ctx.stopped_after,
            "registry": ctx.registry.to_json(), "layers": routing_rows(ctx.routing),
            "split": split_rows(ctx.split_plans), "counts": counts, "findings": [f.to_json() for f in findings]}))
    else:
        if ctx.routing:
            print(tabulate(routing_rows(ctx.routing), headers="keys", tablefmt="simple"))
            print()
        if ctx.split_plans:
            print(tabulate(split_rows(ctx.split_plans), headers="keys", tablefmt="simple"))
            print()
        print(_findings_table(findings))
        stopped = f"; stopped after {ctx.stopped_after}" if ctx.stopped_after else ""
        print(f"\n{title}: {traced.family.name}, {_layout_summary(ctx.registry)}: {counts['error']} error(s), "
              f"{counts['warning']} warning(s), {counts['info']} info{stopped}")
    return 1 if counts["error"] else 0


# -- commands -------------------------------------------------------------------------------------


def cmd_lint(args) -> int:
    from compiler.passes.base import CompileError
    from compiler.pipeline import plan

    try:
        result = plan(args.checkpoint, _config(args), dump_dir=args.dump_dir)
    except CompileError as e:
        return _fail("lint", e)
    if args.timings:
        result.timing.print_table()
    return _plan_report(result, args.json, "hgc lint")


def cmd_compile(args) -> int:
    from compiler.passes.base import CompileError
    from compiler.pipeline import compile_checkpoint, plan

    try:
        if args.plan_only:
            result = plan(args.checkpoint, _config(args))
            if args.timings:
                result.timing.print_table()
            return _plan_report(result, args.json, "hgc compile --plan-only")
        if not args.output:
            return _fail("compile", ValueError("-o/--output is required (or pass --plan-only)"))
        result, manifest = compile_checkpoint(args.checkpoint, args.output, _config(args), force=args.force,
                                              link_weights=args.link_weights, dumps=not args.no_dumps)
    except CompileError as e:
        return _fail("compile", e)
    counts = _counts(result.ctx.findings)
    result.timing.print_table()  # stderr: one table of every stage
    weights = "linked" if manifest["weights"]["mode"] == "link" else "copied"
    print(f"hgc compile: wrote {args.output} ({result.traced.family.name}, {_layout_summary(result.ctx.registry)}, "
          f"programs {', '.join(result.traced.programs)}, weights {weights}; {counts['warning']} warning(s), "
          f"{counts['info']} info)", file=sys.stderr)
    if args.json:
        print(json.dumps({"artifact": str(args.output), "family": result.traced.family.name, "counts": counts}))
    return 0


def cmd_inspect(args) -> int:
    from compiler.lints import Finding
    from runtime.loader import LoadError, read_artifact

    try:
        docs = read_artifact(args.artifact)
    except LoadError as e:
        return _fail("inspect", e)
    routing = routing_rows(docs.routing["programs"])
    split = split_rows(docs.split_plans)
    findings = [Finding.from_json(f) for f in docs.lints.get("findings", [])]
    m = docs.manifest
    if args.json:
        print(json.dumps({"family": m["family"], "versions": m["versions"], "compile": m["compile"],
                          "buckets": m["buckets"], "weights": m["weights"]["mode"], "layers": routing,
                          "split": split, "findings": [f.to_json() for f in findings]}))
        return 0
    print(f"{args.artifact}: {m['family']} (torch {m['versions']['torch']}, hgc {m['versions']['hgc']}), target "
          f"{m['compile']['target']}, dtype {m['compile']['dtype']}, weights {m['weights']['mode']}")
    print(f"decode buckets {m['buckets']['decode_batch_sizes']}, extend buckets {m['buckets']['extend_token_counts']}\n")
    print(tabulate(routing, headers="keys", tablefmt="simple"))
    print()
    print(tabulate(split, headers="keys", tablefmt="simple"))
    print()
    print(_findings_table(findings))
    return 0


def cmd_run(args) -> int:
    """Run prompts through a compiled artifact on the engine (continuous batching, chunked prefill)."""
    import sys

    from compiler.cli import _check_vocab, _print_outputs, parse_prompt_ids
    from runtime.engine import SamplingParams
    from runtime.graph_runner import CaptureError, ParityError
    from runtime.loader import LoadError, load_artifact
    from runtime.server.cli import prefix_cache_options
    from runtime.server.model import EngineOptions, engine_for_artifact

    prompts = parse_prompt_ids(args.prompt_ids)
    try:
        art = load_artifact(args.artifact, device=args.device)
    except LoadError as e:
        return _fail("run", e)
    _check_vocab(prompts, int(art.manifest["model"]["vocab_size"]))
    log = lambda line: print(f"hgc run: {line}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        options = EngineOptions(slots=len(prompts), token_budget=args.max_tokens_per_step,
                                speculative_tokens=args.speculative_tokens, **prefix_cache_options(args))
        engine = engine_for_artifact(art, options, max(map(len, prompts)) + args.max_new_tokens, device=args.device,
                                     graphs=not args.no_graphs, log=log)
    except (LoadError, CaptureError, ParityError, ValueError) as e:
        return _fail("run", e)
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed,
                                stop_token_ids=frozenset(int(t) for t in args.stop_ids.split(",") if t.strip()))
        ids = [engine.add_request(p, params) for p in prompts]
    except ValueError as e:  # a sampling setting out of range, a stop id that is not an integer
        return _fail("run", e)
    results = engine.run_until_done()
    outputs = [list(results[i].output_ids) for i in ids]
    extra = {"timing": engine.timing(), "cached_tokens": [results[i].cached_tokens for i in ids]}
    if engine.runner is not None:
        extra["steps"] = dict(engine.runner.counters)
    _print_outputs(prompts, outputs, args.json, extra=extra)
    return 0


# -- argparse -------------------------------------------------------------------------------------


def _compile_flags(p) -> None:
    p.add_argument("--target", default="cpu", help="device whose backends the ops are routed to (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the model is traced in; match `hgc generate --dtype` (default: float32)")
    p.add_argument("--timings", action="store_true", help="print the pass timing table on stderr (compile always does)")


def add_arguments(subparsers) -> None:
    p = subparsers.add_parser("lint", help="check a checkpoint (or a folder with only config.json) without weights")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    p.add_argument("--dump-dir", default=None, help="also write the graph dumps (txt, onnx, svg) into this folder")
    _compile_flags(p)
    p.set_defaults(func=cmd_lint)

    p = subparsers.add_parser("compile", help="compile a checkpoint into an artifact folder")
    p.add_argument("checkpoint")
    p.add_argument("-o", "--output", default=None, help="artifact folder to create, e.g. artifacts/NAME")
    p.add_argument("--force", action="store_true", help="replace an existing artifact folder")
    p.add_argument("--link-weights", action="store_true",
                   help="record the checkpoint's safetensors files (size, header hash) instead of copying weights")
    p.add_argument("--plan-only", action="store_true",
                   help="trace and print routing, split plans and lints; write nothing (config.json suffices)")
    p.add_argument("--no-dumps", action="store_true", help="skip dumps/ (text, ONNX and SVG of every pass)")
    p.add_argument("--decode-buckets", type=_ints, default=None, help="decode batch sizes to capture, e.g. 1,2,4,8")
    p.add_argument("--extend-buckets", type=_ints, default=None, help="extend token counts to capture, e.g. 256,512")
    p.add_argument("--json", action="store_true", help="JSON on stdout (with --plan-only: the whole plan)")
    _compile_flags(p)
    p.set_defaults(func=cmd_compile)

    p = subparsers.add_parser("inspect", help="print an artifact's routing table, split plans and lints")
    p.add_argument("artifact")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

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
    p.add_argument("--device", default="cpu", help="cpu (reference backend) or cuda (GPU backends, CUDA graphs)")
    p.add_argument("--no-graphs", action="store_true", help="on cuda: run every step eagerly, capture nothing")
    p.add_argument("--json", action="store_true", help="outputs and per-phase timing as one JSON document")
    from runtime.server.cli import add_prefix_cache_arguments, add_speculative_argument  # flags `hgc serve` has too
    add_prefix_cache_arguments(p)
    add_speculative_argument(p)
    p.set_defaults(func=cmd_run)
