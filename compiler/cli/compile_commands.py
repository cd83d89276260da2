"""The compiler's commands: `hgc lint`, `hgc compile`, `hgc inspect`, `hgc backends`.

`add_arguments(subparsers)` registers them on the CLI's parser (compiler/cli/__init__.py); each `cmd_*`
takes the parsed Namespace and returns an exit code: 0 on success, 1 when lints found errors or
the compile / load failed (the message, on stderr, names what and how to fix it). Tables go to
stdout (tabulate), or one JSON document with --json; progress and timings go to stderr.

    hgc lint CKPT [--json]                      trace config.json on the meta device, run the passes, list findings
    hgc compile CKPT -o artifacts/NAME          write an artifact (--force, --link-weights, --plan-only)
    hgc inspect ARTIFACT [--json]               routing table, split plans, lints of an artifact
    hgc backends [--json]                       every backend routing can choose, and where it came from
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from tabulate import tabulate

__all__ = ["add_arguments", "cmd_lint", "cmd_compile", "cmd_inspect", "cmd_backends", "routing_rows", "split_rows",
           "fail"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(" ", "").split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"expected increasing positive integers, got {text!r}")
    return values


def _route(text: str):
    from compiler.passes.routing import parse_route
    from compiler.splitops.errors import CompileError

    try:
        return parse_route(text)
    except CompileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _config(args):
    from compiler.passes.context import CompileConfig
    from compiler.splitops.artifact import DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS

    return CompileConfig(target=args.target, dtype=args.dtype,
                         decode_batch_sizes=getattr(args, "decode_buckets", None) or DEFAULT_DECODE_BATCH_SIZES,
                         extend_token_counts=getattr(args, "extend_buckets", None) or DEFAULT_EXTEND_TOKEN_COUNTS,
                         routes=tuple(args.route or ()))


def fail(command: str, error: Exception) -> int:
    print(f"hgc {command}: {error}", file=sys.stderr)
    return 1


# -- tables ----------------------------------------------------------------------------------------


def _programs_in_order(by_program: dict) -> list:
    return sorted(by_program, key=lambda p: (p != "main", p))


def routing_rows(routing: dict) -> list[dict]:
    """One row per (program, layer): kind, ops, backend(s), what chose them (priority, or the --route,
    whose text carries any kernel options it set), module. routing.json has every node's options."""
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
                         "backend": " ".join(dict.fromkeys(e["backend"] for e in es)),
                         "chosen_by": " ".join(sorted({e.get("chosen_by", "priority") for e in es})),
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
    from compiler.cli.wiring import toolchain
    from compiler.pipeline import plan
    from compiler.splitops.errors import CompileError

    try:
        result = plan(args.checkpoint, _config(args), toolchain(), dump_dir=args.dump_dir)
    except CompileError as e:
        return fail("lint", e)
    if args.timings:
        result.timing.print_table()
    return _plan_report(result, args.json, "hgc lint")


def cmd_compile(args) -> int:
    from compiler.cli.wiring import toolchain
    from compiler.pipeline import compile_checkpoint, plan
    from compiler.splitops.errors import CompileError

    try:
        tools = toolchain()
        if args.plan_only:
            result = plan(args.checkpoint, _config(args), tools)
            if args.timings:
                result.timing.print_table()
            return _plan_report(result, args.json, "hgc compile --plan-only")
        if not args.output:
            return fail("compile", ValueError("-o/--output is required (or pass --plan-only)"))
        result, manifest = compile_checkpoint(args.checkpoint, args.output, _config(args), tools, force=args.force,
                                              link_weights=args.link_weights, dumps=not args.no_dumps)
    except CompileError as e:
        return fail("compile", e)
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
        raw_routing = json.loads((docs.path / "routing.json").read_text())
    except LoadError as e:
        return fail("inspect", e)
    routing = routing_rows(raw_routing["programs"])
    routes = list(docs.routing.routes)
    split = split_rows(docs.split_plans)
    findings = [Finding.from_json(f) for f in docs.lints.get("findings", [])]
    m = docs.manifest
    if args.json:
        print(json.dumps({"family": m["family"], "versions": m["versions"], "compile": m["compile"],
                          "routes": routes, "buckets": m["buckets"], "weights": m["weights"]["mode"],
                          "backends": raw_routing["backends"], "layers": routing, "split": split,
                          "findings": [f.to_json() for f in findings]}))
        return 0
    print(f"{args.artifact}: {m['family']} (torch {m['versions']['torch']}, hgc {m['versions']['hgc']}), target "
          f"{m['compile']['target']}, dtype {m['compile']['dtype']}, weights {m['weights']['mode']}")
    print(f"routes: {' '.join(routes) if routes else 'none (every node by priority)'}")
    print(f"decode buckets {m['buckets']['decode_batch_sizes']}, extend buckets {m['buckets']['extend_token_counts']}\n")
    print(tabulate(routing, headers="keys", tablefmt="simple"))
    print()
    print(tabulate(split, headers="keys", tablefmt="simple"))
    print()
    print(_findings_table(findings))
    return 0


def cmd_backends(args) -> int:
    """Every backend routing can choose: built-in, and installed under the entry-point group hgc.backends."""
    from runtime.backends import BackendDiscoveryError, discover

    try:
        rows = discover().rows()
    except BackendDiscoveryError as e:
        return fail("backends", e)
    if args.json:
        print(json.dumps({"backends": rows}))
        return 0
    table = [(r["name"], r["device"], " ".join(r["ops"]), " ".join(r["modes_supported"]),
              " ".join(r["modes_capturable"]) or "-", " ".join(r["dtypes"]) if r["dtypes"] else "any",
              r["priority"] if not r["explicit_only"] else f"{r['priority']} (only by --route)", r["source"])
             for r in rows]
    print(tabulate(table, headers=("backend", "device", "ops", "modes", "capturable", "dtypes", "priority", "from"),
                   tablefmt="simple", maxcolwidths=[None, None, 36, 24, 24, 20, None, 48]))
    return 0


# -- argparse -------------------------------------------------------------------------------------


def _compile_flags(p) -> None:
    p.add_argument("--target", default="cpu", help="device whose backends the ops are routed to (default: cpu)")
    p.add_argument("--route", action="append", type=_route, default=None, metavar="OP=BACKEND|layers=3,7:BACKEND",
                   help="bind every node of an op (gdn_core=cpu_reference) or of layers (layers=3,7:torch_reference) "
                        "to a backend, optionally with kernel options (gqa_attention=flashinfer[extend_impl=paged]); "
                        "repeatable; recorded in the manifest; `hgc backends` lists the backends")
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

    p = subparsers.add_parser("backends", help="list the backends routing can choose (built-in and installed plugins)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_backends)
