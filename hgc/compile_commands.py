"""The compiler's commands: `hgc lint`, `hgc compile`, `hgc inspect`, `hgc verify`, `hgc backends`.

`add_arguments(subparsers)` registers them on the CLI's parser (hgc/__init__.py); each `cmd_*`
takes the parsed Namespace and returns an exit code: 0 on success, 2 when lints found errors (or,
with --memory-gb, one rank does not fit). A refusal (CompileError, LoadError, ...) is raised, and
hgc/errors.py prints it as one line and picks the exit code. Tables go to stdout
(tabulate), or one JSON document with --json; progress and timings go to stderr.

    hgc lint CKPT [--json]                      trace config.json on the meta device, run the passes, list findings
    hgc compile CKPT -o artifacts/NAME          write an artifact (--force, --link-weights, --plan-only, --inductor,
                                                --pdl, --norm-linear, --tp N, --no-weights)
    hgc inspect ARTIFACT [--json]               routing table, split plans, sharding, bundles, lints of an artifact
    hgc verify ARTIFACT [--full]                re-hash every file (with --full, linked checkpoint data too)
    hgc backends [--json]                       every backend routing can choose, and where it came from
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from tabulate import tabulate

from compiler.splitops.registry import STATE_DTYPES
from hgc.errors import EXIT_BAD_INPUT, UsageError
from hgc.serve_command import float_in, int_at_least

__all__ = ["add_arguments", "cmd_lint", "cmd_compile", "cmd_inspect", "cmd_verify", "cmd_backends", "routing_rows",
           "split_rows", "side_branch_rows", "bundle_rows", "TARGETS"]

# The devices a compile can route to: the devices the built-in backends declare.
TARGETS = ("cpu", "cuda")


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


def _buckets(args) -> dict:
    """CompileConfig's bucket fields: --bucket-costs chooses the extend buckets from measured costs
    (compiler/bucket_choice.py), --decode-buckets / --extend-buckets set them, else the defaults."""
    from compiler.bucket_choice import choose_extend_buckets, read_bucket_costs
    from compiler.splitops.artifact import DEFAULT_DECODE_BATCH_SIZES, DEFAULT_EXTEND_TOKEN_COUNTS

    decode, extend = getattr(args, "decode_buckets", None), getattr(args, "extend_buckets", None)
    costs_file = getattr(args, "bucket_costs", None)
    fields = {"decode_batch_sizes": decode or DEFAULT_DECODE_BATCH_SIZES,
              "extend_token_counts": extend or DEFAULT_EXTEND_TOKEN_COUNTS,
              "buckets_chosen_by": "flags" if decode or extend else "defaults"}
    if costs_file:
        if extend:
            raise UsageError("--bucket-costs chooses the extend buckets from the measured costs: drop --extend-buckets")
        costs = read_bucket_costs(costs_file)
        fields.update(extend_token_counts=choose_extend_buckets(costs), buckets_chosen_by="measured",
                      bucket_costs=costs)
    return fields


def _config(args):
    from compiler.passes.context import CompileConfig

    return CompileConfig(target=args.target, dtype=args.dtype, **_buckets(args),
                         routes=tuple(args.route or ()), tp=args.tp, overlap=bool(args.overlap),
                         overlap_min_bytes=args.overlap_min_bytes, batch_invariant=bool(args.batch_invariant),
                         state_dtype=args.state_dtype)


# -- tables ----------------------------------------------------------------------------------------


def _programs_in_order(by_program: dict) -> list:
    return sorted(by_program, key=lambda p: (p != "main", p))


def routing_rows(routing: dict) -> list[dict]:
    """One row per (program, layer): kind, ops, backend(s), what chose them (priority, or the --route,
    whose text carries any kernel options it set), the fused ops and the pattern each stands for
    (gdn_fused=gdn; '-': none), module. routing.json has every node's options."""
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
                         "fused": " ".join(f"{e['op']}={e['fused']}" for e in es if e.get("fused")) or "-",
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
                         "eager": plan.counts()["eager"], "side branches": len(plan.side_branches()),
                         "layout": layout if len(layout) <= 100 else layout[:97] + "..."})
    return rows


def side_branch_rows(plans: dict) -> list[dict]:
    """One row per side-stream branch (hgc compile --overlap), the modes whose plans hold it merged:
    where it forks and joins, its nodes, the op it overlaps, the size rule's bytes at one token."""
    rows: dict[tuple, dict] = {}
    for program in _programs_in_order(plans):
        for mode, plan in plans[program].items():
            for piece, b in plan.side_branches():
                row = rows.setdefault((program, b), {
                    "program": program, "modes": [], "pieces": [], "fork after": b.fork_after or "(piece start)",
                    "side nodes": f"{len(b.nodes)}: {b.nodes[0]}..{b.nodes[-1]}" if len(b.nodes) > 1 else b.nodes[0],
                    "join before": b.join_before or "(piece end)", "beside": b.anchor,
                    "side bytes": b.side_bytes, "main bytes": b.main_bytes})
                row["modes"].append(mode.value if hasattr(mode, "value") else mode)
                row["pieces"].append(piece)
    return [{**r, "modes": " ".join(r["modes"]), "pieces": " ".join(map(str, r["pieces"]))} for r in rows.values()]


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


def _plan_report(result, args, title: str) -> int:
    from hgc.memory_report import memory_facts, memory_lines
    from compiler.lints import sort_findings

    ctx, traced = result.ctx, result.traced
    findings = sort_findings(ctx.findings)
    counts = _counts(findings)
    memory = memory_facts(traced, ctx.registry, ctx.tp, args.memory_gb, args.max_model_len)
    if args.json:
        print(json.dumps({
            "family": traced.family.name, "target": ctx.config.target, "stopped_after": ctx.stopped_after,
            "registry": ctx.registry.to_json(), "layers": routing_rows(ctx.routing),
            "split": split_rows(ctx.split_plans), "side_branches": side_branch_rows(ctx.split_plans),
            "counts": counts, "findings": [f.to_json() for f in findings],
            "memory": {k: v for k, v in memory.items() if k != "table"}}))
    else:
        if ctx.routing:
            print(tabulate(routing_rows(ctx.routing), headers="keys", tablefmt="simple"))
            print()
        if ctx.split_plans:
            print(tabulate(split_rows(ctx.split_plans), headers="keys", tablefmt="simple"))
            print()
            _print_overlap(_overlap_rule(result.fingerprints), side_branch_rows(ctx.split_plans))
        print(_findings_table(findings))
        print()
        print(memory_lines(memory))
        stopped = f"; stopped after {ctx.stopped_after}" if ctx.stopped_after else ""
        print(f"\n{title}: {traced.family.name}, {_layout_summary(ctx.registry)}: {counts['error']} error(s), "
              f"{counts['warning']} warning(s), {counts['info']} info{stopped}")
    if memory["fits"] is False:  # a MemoryPlanError's class: bad input, the table above says by how much
        print(f"{title}: does not fit: {memory['error']}", file=sys.stderr)
    return EXIT_BAD_INPUT if counts["error"] or memory["fits"] is False else 0


# -- commands -------------------------------------------------------------------------------------


def cmd_lint(args) -> int:
    from hgc.wiring import toolchain
    from compiler.pipeline import plan

    result = plan(args.checkpoint, _config(args), toolchain(), dump_dir=args.dump_dir, progress=args.progress)
    if args.timings:
        result.timing.print_table()
    return _plan_report(result, args, "hgc lint")


def cmd_compile(args) -> int:
    from hgc.wiring import toolchain
    from compiler.pipeline import compile_checkpoint, plan

    inductor = _inductor_wanted(args)
    if isinstance(inductor, Exception):
        raise UsageError(str(inductor))
    from hgc.build_command import BundleChoices

    choices = BundleChoices.of(args)
    if (why := _choices_refusal(args, inductor, choices)) is not None:
        raise UsageError(why)
    tools = toolchain()
    if args.plan_only:
        result = plan(args.checkpoint, _config(args), tools, progress=args.progress)
        if args.timings:
            result.timing.print_table()
        return _plan_report(result, args, "hgc compile --plan-only")
    if not args.output:
        raise UsageError("-o/--output is required (or pass --plan-only)", hint="e.g. hgc compile CKPT -o artifacts/NAME")
    result, manifest = compile_checkpoint(args.checkpoint, args.output, _config(args), tools, force=args.force,
                                          link_weights=args.link_weights, dumps=not args.no_dumps,
                                          weights=not args.no_weights, progress=args.progress,
                                          allow_non_finite=args.allow_non_finite)
    counts = _counts(result.ctx.findings)
    from compiler.artifact_writer import WRITE_FINDINGS

    for finding in result.ctx.findings:  # the writer's own (weights, tokenizer): one line each
        if finding.rule in WRITE_FINDINGS:
            print(f"hgc compile: warning: {finding.message} (fix: {finding.fix})", file=sys.stderr)
    if not args.quiet:
        result.timing.print_table()  # stderr: one table of every stage
    weights = {"link": "linked", "copy": "copied",
               "none": "none (run with --load-format dummy)"}[manifest["weights"]["mode"]]
    print(f"hgc compile: wrote {args.output} ({result.traced.family.name}, {_layout_summary(result.ctx.registry)}, "
          f"programs {', '.join(result.traced.programs)}, weights {weights}; {counts['warning']} warning(s), "
          f"{counts['info']} info)", file=sys.stderr)
    if (note := _no_bundle_note(args)) is not None:
        print(note, file=sys.stderr)
    if inductor and args.tp > 1:  # the ranks build it together, each in a process of its own
        from hgc.build_command import build_on_ranks
        device = args.target.split(":")[0]
        code = build_on_ranks(args.output, device, args.tp, force=True, choices=choices)
        if code != 0:
            flags = "".join(" " + flag for flag in choices.argv())
            raise RuntimeError(f"{args.output}: the artifact is written, but building its bundle on {args.tp} ranks "
                               f"failed (exit status {code}, the ranks' errors above); rebuild it with `hgc build "
                               f"{args.output} --device {device} --force{flags}`")
    elif inductor:
        from hgc.build_command import build_bundle
        build_bundle(args.output, args.target, force=True, choices=choices,
                     log=lambda line: print(f"hgc compile: {line}", file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps({"artifact": str(args.output), "family": result.traced.family.name, "counts": counts}))
    return 0


def _bundle_problems(args) -> list[str]:
    """What stands in the way of building a target bundle here (empty: nothing)."""
    import torch

    device = args.target.split(":")[0]
    problems = []
    if args.overlap:
        problems.append("--overlap: compiled pieces run each glue run as one call, which cannot be split across the "
                        "overlap pass's two streams yet")
    if device not in ("cpu", "cuda"):
        problems.append(f"no compiled target for --target {args.target} (cpu or cuda)")
    elif device == "cuda" and not torch.cuda.is_available():
        problems.append("this machine has no CUDA device to build the bundle on; run `hgc build ARTIFACT --device "
                        "cuda` on the GPU machine")
    elif device == "cuda" and torch.cuda.device_count() < args.tp:
        problems.append(f"--tp {args.tp}: the bundle is built by {args.tp} ranks, one GPU each, and this machine has "
                        f"{torch.cuda.device_count()}; run `hgc build ARTIFACT --device cuda` where the ranks will run")
    return problems


def _inductor_wanted(args):
    """Whether `hgc compile` builds a target bundle. --inductor: yes, or an error naming what stands
    in the way. --no-inductor: no. Neither: yes for a cuda target on a machine with a CUDA device
    (a start-up from the bundle builds no kernel, and its decode steps run fewer, fused ones:
    BENCHMARKS.md), otherwise no, with a note (`_no_bundle_note`) saying why and how to add it later."""
    if args.inductor is False or args.plan_only:
        return False
    problems = _bundle_problems(args)
    if args.inductor is None:  # the default
        return args.target.split(":")[0] == "cuda" and not problems
    return ValueError(f"--inductor: {problems[0]}") if problems else True


def _no_bundle_refusal(args, inductor: bool) -> str | None:
    """Why a flag that decides something of the target bundle (BundleChoices) has nothing to
    decide: this compile builds no bundle (None: it builds one)."""
    if inductor:
        return None
    problems = [] if args.inductor is False or args.plan_only else _bundle_problems(args)
    return ("it is a choice of the target bundle, and this compile builds none ("
            + (problems[0] if problems else "--no-inductor or --plan-only") + ")")


def _choices_refusal(args, inductor: bool, choices) -> str | None:
    """Why `hgc compile` cannot build with the bundle choices it was given (None: it can): each is a
    decision of the target bundle (hgc/build_command.py `BundleChoices.refusal`: the device, and
    --norm-linear's GEMV projections, which a batch-invariant artifact has none of), so the compile
    must build one."""
    why = choices.refusal(args.target.split(":")[0], batch_invariant=bool(args.batch_invariant))
    if why is None and choices.argv() and (none := _no_bundle_refusal(args, inductor)) is not None:
        why = f"{choices.argv()[0]}: {none}"
    return why


def _no_bundle_note(args) -> str | None:
    """Why a default cuda compile made no target bundle (None: it made one, or was not asked to).
    Said after the artifact is written: a compile that fails says its own cause first."""
    if args.inductor is not None or args.target.split(":")[0] != "cuda" or not (problems := _bundle_problems(args)):
        return None
    return f"hgc compile: no compiled pieces in this artifact: {problems[0]}"


def cmd_inspect(args) -> int:
    from compiler.lints import Finding
    from runtime.artifact.loader import read_artifact

    docs = read_artifact(args.artifact)
    raw_routing = json.loads((docs.path / "routing.json").read_text())
    routing = routing_rows(raw_routing["programs"])
    routes = list(docs.routing.routes)
    split = split_rows(docs.split_plans)
    branches = side_branch_rows(docs.split_plans)
    findings = [Finding.from_json(f) for f in docs.lints.get("findings", [])]
    m = docs.manifest
    bundles = bundle_rows(m, docs.path)
    graphs = extend_graph_rows(json.loads((docs.path / "split.json").read_text()), docs.split_plans, m["buckets"])
    if args.json:
        print(json.dumps({"family": m["family"], "versions": m["versions"], "compile": m["compile"],
                          "routes": routes, "buckets": {**m["buckets"], "extend_rows": extend_rows(m["buckets"])},
                          "extend_graphs": graphs,
                          "weights": m["weights"]["mode"],
                          "backends": raw_routing["backends"], "layers": routing,
                          "unfused": raw_routing.get("unfused", {}), "split": split,
                          "side_branches": branches,
                          "findings": [f.to_json() for f in findings], "bundles": bundles,
                          "sharding": None if docs.sharding is None else _sharding_json(docs.sharding)}))
        return 0
    print(f"{args.artifact}: {m['family']} (torch {m['versions']['torch']}, hgc {m['versions']['hgc']}), target "
          f"{m['compile']['target']}, dtype {m['compile']['dtype']}, weights {m['weights']['mode']}")
    print(f"routes: {' '.join(routes) if routes else 'none (every node by priority)'}")
    kept = {layer["state"]["recurrent"]["dtype"] for layer in m["registry"] if "recurrent" in layer.get("state", {})}
    if kept - {"float32"}:
        source = "hgc compile --state-dtype" if m["compile"].get("state_dtype") else "config.json's mamba_ssm_dtype"
        print(f"recurrent states: {', '.join(sorted(kept))} ({source})")
    if m["compile"].get("batch_invariant"):
        print("numerics: batch-invariant (hgc compile --batch-invariant: decode and verify rows computed as the "
              "request's own decode step would be)")
    print(bucket_line(m["buckets"]))
    for program in _programs_in_order(graphs):
        print(extend_graph_line(program, graphs[program]))
    print()
    print(tabulate(routing, headers="keys", tablefmt="simple"))
    for program, entries in raw_routing.get("unfused", {}).items():
        for e in entries:
            print(f"{program} layer {e['layer_id']}: {e['pattern']} left unfused: {e['reason']}")
    print()
    print(tabulate(split, headers="keys", tablefmt="simple"))
    print()
    _print_overlap(_overlap_rule(m["passes"]), branches)
    if docs.sharding is not None:
        _print_sharding(docs.sharding)
    if bundles:
        print(tabulate(bundles, headers="keys", tablefmt="simple"))
    else:
        print(f"no target bundles (the glue runs traced; `hgc build {args.artifact} --device DEVICE` adds one)")
    print()
    print(_findings_table(findings))
    return 0


def _overlap_rule(fingerprints: list[dict]) -> int | None:
    """The overlap pass's size rule, from the pipeline's pass fingerprints (None: it did not run)."""
    return next((f["config"]["min_bytes"] for f in fingerprints if f["name"] == "overlap"), None)


def _print_overlap(min_bytes: int | None, branches: list[dict]) -> None:
    """Whether the compile ran the overlap pass (`min_bytes`: its size rule, None: it did not run),
    and its side-stream branches."""
    if min_bytes is None:
        print("overlap: off (hgc compile --overlap puts independent branches on a second CUDA stream)\n")
        return
    print(f"overlap: on ({len(branches)} side-stream branch(es); size rule {min_bytes} bytes at one token); on CUDA "
          f"each runs on a second stream between its fork and join, on the CPU in graph order")
    if branches:
        print(tabulate(branches, headers="keys", tablefmt="simple"))
    print()


def _sharding_json(sharding) -> dict:
    return {k: v for k, v in sharding.doc.items() if k not in ("format", "format_version")}


def _print_sharding(sharding) -> None:
    """sharding.json as tables: each layer's per-rank caches against the whole model's, every collective."""
    doc, cut = sharding.doc, sum(not s.replicated for s in sharding.tensors.values())
    print(f"tensor parallel {sharding.tp}: MoE as {doc.get('moe')}; {len(sharding.tensors)} checkpoint tensors, "
          f"{cut} cut across ranks, {len(sharding.tensors) - cut} replicated")
    layers = [{"layer": l["layer_id"], "kind": l["kind"] + (" (draft)" if l["draft"] else ""),
               "per rank (of the whole)": "; ".join(f"{name} {e['rank']} of {e['whole']}"
                                                    for name, e in l["entries"].items())} for l in doc["layers"]]
    print(tabulate(layers, headers="keys", tablefmt="simple"))
    print()
    rows = [{"program": program, "node": c["node"], "op": c["op"], "layer": c["layer_id"], "after": c["after"],
             "why": c["why"]} for program in _programs_in_order(doc["collectives"]) for c in doc["collectives"][program]]
    print(tabulate(rows, headers="keys", tablefmt="simple", maxcolwidths=[None, None, None, None, None, 90]))
    print()


def cmd_verify(args) -> int:
    """Everything the loader checks, without loading weights, and the hashes it skips: every listed
    file re-hashed, the manifest's seal, the programs' archives, the facts cross-checked, linked
    checkpoint files (with --full, their data)."""
    from runtime.artifact.docs import read_artifact, verify_files
    from runtime.artifact.loader import check_model_facts, load_programs
    from runtime.artifact.weights import check_linked_files

    progress = args.progress
    docs = read_artifact(args.artifact)
    files, nbytes = verify_files(docs, progress)
    check_model_facts(docs, load_programs(docs)["main"])
    linked, linked_bytes = check_linked_files(docs, data=args.full, progress=progress)
    what = ""
    if linked:
        what = (f"; {linked} linked checkpoint file(s) ({linked_bytes / 1e6:.1f} MB): "
                + ("data re-hashed" if args.full else "size and header (--full re-hashes their data)"))
    print(f"hgc verify: {args.artifact}: {files} file(s) ({nbytes / 1e6:.1f} MB) match manifest.json, "
          f"manifest seal, programs and model facts check out{what}")
    return 0


def extend_rows(buckets: dict) -> dict[str, list[int]]:
    """Request rows of each recorded extend bucket's keys, by its token count, as a run captures
    them (runtime/graphs/buckets.py: the largest decode bucket, at most the bucket's tokens; and one
    request beside that in the small buckets)."""
    from runtime.graphs.buckets import Buckets, extend_seqs

    decode, extend = buckets["decode_batch_sizes"], buckets["extend_token_counts"]
    table = Buckets(tuple(decode), tuple(extend), extend_seqs(max(decode, default=1), extend))
    return {str(t): list(table.extend_seq_rows(t)) for t in table.extend}


def extend_graph_rows(split_doc: dict, plans, buckets: dict) -> dict[str, list[dict]]:
    """How each extend bucket is captured, per program: split.json's record (`extend_graphs`), or,
    for an artifact written before it, the same rule over its plans and recorded buckets."""
    from compiler.splitops.artifact import extend_graphs

    recorded = split_doc.get("extend_graphs")
    if recorded is not None:
        return recorded
    return {program: extend_graphs(by_mode, buckets["extend_token_counts"]) for program, by_mode in plans.items()}


def extend_graph_line(program: str, rows: list[dict]) -> str:
    """One program's extend buckets as whole-step graphs or pieces, runs of one kind together, and why."""
    runs: list[tuple[str, list[int]]] = []
    for row in rows:
        if runs and runs[-1][0] == row["graph"]:
            runs[-1][1].append(row["tokens"])
        else:
            runs.append((row["graph"], [row["tokens"]]))
    kinds = ", ".join(f"{' '.join(map(str, tokens))} {'whole-step' if kind == 'whole' else 'pieces'}"
                      for kind, tokens in runs)
    return f"extend graphs ({program}): {kinds}: {rows[0]['why'] if rows else ''}"


def bucket_line(buckets: dict) -> str:
    """The capture buckets, extend ones as tokens x requests, and how they were chosen; where they
    were chosen from measured costs, the cost of each measured extend bucket's step."""
    from compiler.splitops.artifact import parse_bucket_costs

    chosen = {"defaults": "the format's defaults, not measured",
              "flags": "set by --decode-buckets / --extend-buckets, not measured",
              None: "how they were chosen is not recorded (compiled before hgc recorded it), not measured"}
    extend = " ".join(f"{t}x{','.join(map(str, rows))}" for t, rows in extend_rows(buckets).items())
    line = f"decode buckets {buckets['decode_batch_sizes']}, extend buckets (tokens x requests) {extend}: "
    if buckets.get("chosen_by") != "measured":
        return line + chosen.get(buckets.get("chosen_by"), str(buckets.get("chosen_by")))
    costs = parse_bucket_costs(buckets.get("measured"), "manifest.json buckets.measured")
    kept = set(buckets["extend_token_counts"])
    steps = ", ".join(f"{t}{'' if t in kept else ' (not kept)'} {ms:.3g}" for t, ms in costs.extend_ms)
    decode = ", ".join(f"{b} {ms:.3g}" for b, ms in costs.decode_ms)
    return (line + f"chosen from step costs measured on {costs.device}\n  extend step ms by tokens: {steps}"
            + (f"\n  decode step ms by requests: {decode}" if decode else ""))


def gemv_projections(doc: dict) -> str:
    """A bundle.json's projections per forward that call the GEMV op (compiler/splitops/glue_ops.py),
    by program: every glue segment counted with its piece's count ("main 37, draft 4"); "off" for a
    bundle built without it (cpu, batch-invariant), "-" for one built before it existed."""
    if "small_m_linear" not in doc:
        return "-"
    return _per_forward(doc, "small_m_linear") if doc["small_m_linear"] else "off"


def folded_norms(doc: dict) -> str:
    """A bundle.json's norms per forward folded into the GEMVs beside them (`hgc build --norm-linear`:
    calls of hgc_glue::add_rms_norm_linear, rms_norm_linear or linear_add_rms_norm), by program as
    `gemv_projections` counts; "off" for a bundle built without it (one from before the field too)."""
    from compiler.splitops.bundle import bundle_norm_linear

    return _per_forward(doc, "norm_linear") if bundle_norm_linear(doc) else "off"


def norm_rope_calls(doc: dict) -> str:
    """A bundle.json's calls of hgc_glue::qk_norm_rope per forward (a cuda bundle's default, `hgc build
    --no-norm-rope` none: each a GQA layer's q / k norms and rotary), by program as `gemv_projections`
    counts; "off" for a bundle built without it (a cpu one, one from before the field too)."""
    from compiler.splitops.bundle import bundle_norm_rope

    return _per_forward(doc, "norm_rope") if bundle_norm_rope(doc) else "off"


def sigmoid_gate_calls(doc: dict) -> str:
    """A bundle.json's calls of hgc_glue::sigmoid_gate per forward (`hgc build --sigmoid-gate`: each
    an attention output's gate), by program as `gemv_projections` counts; "off" for a bundle built
    without it (one from before the field too)."""
    from compiler.splitops.bundle import bundle_sigmoid_gate

    return _per_forward(doc, "sigmoid_gate") if bundle_sigmoid_gate(doc) else "off"


def _per_forward(doc: dict, count: str) -> str:
    """A piece count of bundle.json per program ("main 37, draft 4"): every glue segment counted with
    its piece's count, so a structure shared by many layers counts once per layer."""
    pieces, programs = doc["pieces"], doc["programs"]
    return ", ".join(f"{p} {sum(pieces[r['piece']].get(count, 0) for r in programs[p] if r['piece'])}"
                     for p in sorted(programs, key=lambda p: p != "main"))  # main first


def pdl_column(doc: dict) -> str:
    """Whether a bundle.json's kernels launch with programmatic dependent launch (`hgc build --pdl`):
    "on" or "off" (a bundle built before the field existed: off)."""
    from compiler.splitops.bundle import bundle_pdl

    return "on" if bundle_pdl(doc) else "off"


def bundle_rows(manifest: dict, root: Path | None = None) -> list[dict]:
    """One row per target bundle of an artifact: what it was built for, and its files; with the
    artifact's folder `root`, how many projections run through the GEMV op, how many input norms are
    folded into them and whether its kernels launch with PDL (its bundle.json)."""
    from compiler.splitops.bundle import KERNELS, PIECES, bundle_dir, describe_target, without_rank_dir

    rows = []
    for key, entry in sorted((manifest.get("targets") or {}).items()):
        prefix = bundle_dir(key) + "/"
        files = [f[len(prefix):] for f in manifest["files"] if f.startswith(prefix)]
        ranks = {f.split("/")[0] for f in files if without_rank_dir(f) != f}
        files = list(map(without_rank_dir, files))  # a tensor-parallel bundle: every rank's files counted
        rows.append({"bundle": prefix.rstrip("/"), "built for": describe_target(entry.get("facts") or {}),
                     "ranks": len(ranks) or 1,
                     "pieces": sum(f.startswith(PIECES + "/") for f in files),
                     "kernel files": sum(f.startswith(KERNELS + "/") for f in files)})
        if root is not None and entry.get("bundle"):
            doc = json.loads((Path(root) / entry["bundle"]).read_text())
            rows[-1]["GEMV projections"] = gemv_projections(doc)
            rows[-1]["folded norms"] = folded_norms(doc)
            rows[-1]["q/k norm+rope calls"] = norm_rope_calls(doc)
            rows[-1]["sigmoid gate calls"] = sigmoid_gate_calls(doc)
            rows[-1]["PDL"] = pdl_column(doc)
    return rows


def capturable_column(row: dict) -> str:
    """The modes a backend may be captured in, then the ops captured in more under some options
    (ops with the same modes and options on one entry): "decode target_verify; gdn_core +extend
    +mixed (chunk_impl=triton)"; a capture bounded by an option says so: "(steps up to
    whole_extend_tokens)"."""
    text = " ".join(row["modes_capturable"]) or "-"
    grouped: dict[tuple, list[str]] = {}
    for extra in row.get("op_capture") or ():
        key = (tuple(extra["modes"]), tuple(extra["when"].items()), extra.get("up_to", ""))
        grouped.setdefault(key, []).append(extra["op"])
    for (modes, when, up_to), ops in grouped.items():
        conditions = [f"{k}={v}" for k, v in when] + ([f"steps up to {up_to}"] if up_to else [])
        text += f"; {' '.join(ops)} " + " ".join(f"+{m}" for m in modes) + (f" ({', '.join(conditions)})"
                                                                          if conditions else "")
    return text


def dtypes_column(row: dict) -> str:
    """The activation dtypes a backend runs, then each op that runs more under some options:
    "bfloat16 float16; gqa_attention +float32 (decode_impl=triton, extend_impl=triton)"."""
    text = " ".join(row["dtypes"]) if row["dtypes"] else "any"
    for extra in row.get("option_dtypes") or ():
        when = ", ".join(f"{k}={v}" for k, v in extra["when"].items())
        text += f"; {extra['op']} " + " ".join(f"+{d}" for d in extra["dtypes"]) + f" ({when})"
    return text


def cmd_backends(args) -> int:
    """Every backend routing can choose: built-in, and installed under the entry-point group hgc.backends."""
    from runtime.backends import discover

    rows = discover().rows()
    if args.json:
        print(json.dumps({"backends": rows}))
        return 0
    table = [(r["name"], r["device"], " ".join(r["ops"]), " ".join(r["modes_supported"]),
              capturable_column(r), dtypes_column(r),
              r["priority"] if not r["explicit_only"] else f"{r['priority']} (only by --route)",
              options_column(r.get("options") or {}, r.get("choice_ops") or ()), invariant_column(r), r["source"])
             for r in rows]
    print(tabulate(table, headers=("backend", "device", "ops", "modes", "capturable", "dtypes", "priority",
                                   "options (default first)", "batch-invariant", "from"),
                   tablefmt="simple", maxcolwidths=[None, None, 36, 24, 24, 20, None, None, 24, 48]))
    return 0


def invariant_column(row: dict) -> str:
    """What `hgc compile --batch-invariant` sets on a backend ("always": nothing to set; "-": it has no
    batch-invariant kernels and is refused under that flag), and for which ops when not all."""
    declared = row.get("batch_invariant")
    if declared is None:
        return "-"
    text = "\n".join(f"{k}={v}" for k, v in declared.items()) or "always"
    ops = row.get("batch_invariant_ops")
    return text + (f"\n({' '.join(ops)} only)" if ops is not None else "")


def options_column(options: dict, scopes=()) -> str:
    """A backend's kernel options as `--route OP=BACKEND[name=choice]` takes them, one a line:
    name=a|b|c, the default (what routing records when the route names none) first; a choice that
    serves some ops only (`choice_ops`) on a line of its own: "(triton: gqa_attention only)"."""
    lines = []
    for name, choices in options.items():
        lines.append(f"{name}={'|'.join(map(str, choices))}")
        lines += [f"({s['choice']}: {' '.join(s['ops'])} only)" for s in scopes if s["option"] == name]
    return "\n".join(lines) or "-"


# -- argparse -------------------------------------------------------------------------------------


def _compile_flags(p) -> None:
    p.add_argument("--target", default="cpu", choices=TARGETS,
                   help="device whose backends the ops are routed to")
    p.add_argument("--route", action="append", type=_route, default=None, metavar="OP=BACKEND|layers=3,7:BACKEND",
                   help="bind every node of an op (gdn_core=cpu_reference) or of layers (layers=3,7:torch_reference) "
                        "to a backend, optionally with kernel options (gqa_attention=flashinfer[extend_impl=paged]); "
                        "repeatable; recorded in the manifest; `hgc backends` lists the backends and their kernel "
                        "options (default: each node by priority); gdn_fused=unfused (or layers=3:unfused) keeps "
                        "the GDN mixers the fusion pass would make one op")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the model is traced in; match `hgc generate --dtype`")
    p.add_argument("--state-dtype", default=None, choices=STATE_DTYPES,
                   help="dtype linear layers keep their recurrent state in (kernels compute in float32 either way). "
                        "bfloat16 halves the bytes of every state read and written, which at 128 decoding requests "
                        "are most of a step's, and holds twice the requests in the same memory; the state is then "
                        "rounded after every step, so greedy tokens can differ from a float32 state's. vLLM keeps "
                        "Qwen3-Next's in the model dtype. Default: the checkpoint's mamba_ssm_dtype (Qwen3.5's "
                        "configs ask for float32), else float32")
    p.add_argument("--timings", action="store_true", help="print the pass timing table on stderr (compile always does)")
    p.add_argument("--tp", type=int_at_least(1), default=1, metavar="N",
                   help="tensor-parallel ranks: trace one rank's program (heads and widths split, collectives "
                        "placed by the sharding pass); a count that does not divide is an error naming the layer")
    p.add_argument("--memory-gb", type=float_in(0, low_open=True), default=None, metavar="G",
                   help="with lint / --plan-only: one GPU's memory; plan one request of --max-model-len tokens per "
                        "rank and fail, saying by how much per rank, when it does not fit")
    p.add_argument("--max-model-len", type=int_at_least(1), default=4096, metavar="N",
                   help="the request --memory-gb is checked with, in tokens")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="run independent branches of each captured piece on a second CUDA stream (the shared "
                        "expert beside the MoE op's router and routed experts, which this takes out of the fused "
                        "op): the overlap pass, shown in split.json, the dumps and `hgc inspect`. Off by default "
                        "(--no-overlap) until a GPU measurement shows a gain: benchmarks/serving/overlap_bench.py times the "
                        "MoE layer and the decode step with and without it at batch 1, 8, 32, 128. On the CPU the "
                        "branches run in order (same tokens). Not with --tp > 1 or --inductor yet")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=False,
                   help="batch-invariant numerics (--target cuda): every decode and target_verify row is computed bit "
                        "for bit as the request's own decode step alone would be, whatever else shares its step, so "
                        "speculative decoding gives plain decoding's greedy tokens in bf16 too. Routing sets each "
                        "backend's batch-invariant kernel options (fixed attention splits, fixed MoE tiles) and refuses "
                        "backends without them; the runtime sends the glue's matrix products to a Triton kernel of "
                        "one launch shape and runs prompt chunks apart from decodes. Slower steps: BENCHMARKS.md "
                        "\"Batch-invariant numerics\" measures by how much. Not with --tp > 1")
    p.add_argument("--overlap-min-bytes", type=int_at_least(0), default=None, metavar="BYTES",
                   help="with --overlap: the size rule, bytes each branch and the work it overlaps must move at one "
                        "token (default: 1 MiB, compiler/passes/overlap.py says why)")


def add_arguments(subparsers) -> None:
    from hgc.build_command import add_bundle_choices

    p = subparsers.add_parser(
        "lint", help="check a checkpoint (or a folder with only config.json) without weights",
        description="Trace config.json on the meta device (no weights are read), run every pass, and print the "
                    "routing table, the split plans, the lint findings and the memory one rank needs. Exit code 2 "
                    "when a finding is an error (or, with --memory-gb, when one rank does not fit).",
        epilog="examples:\n  hgc lint /tmp/ckpt --target cuda --dtype bfloat16\n"
               "  hgc lint /tmp/config-only --tp 2 --memory-gb 80")
    p.add_argument("checkpoint", help="checkpoint folder (config.json; weights are not needed)")
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    p.add_argument("--dump-dir", default=None, metavar="DIR",
                   help="also write the graph dumps (txt, onnx, layer picture svg) into this folder (default: none)")
    _compile_flags(p)
    p.set_defaults(func=cmd_lint)

    p = subparsers.add_parser(
        "compile", help="compile a checkpoint into an artifact folder",
        description="Trace a checkpoint, route every op node to a backend, split the graph at the linear-attention "
                    "ops, run the lints, and write the artifact folder (written whole, or not at all).",
        epilog="examples:\n  hgc compile /tmp/ckpt -o artifacts/tiny\n"
               "  hgc compile /tmp/ckpt -o artifacts/tiny-cuda --target cuda --dtype bfloat16\n"
               "  hgc compile /tmp/ckpt --plan-only\n"
               "  hgc compile /tmp/config-only -o artifacts/big-tp2 --tp 2 --no-weights   # run with --load-format dummy")
    p.add_argument("checkpoint", help="checkpoint folder: config.json and *.safetensors")
    p.add_argument("-o", "--output", default=None, metavar="DIR",
                   help="artifact folder to create, e.g. artifacts/NAME (required unless --plan-only)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing artifact folder (only an hgc artifact or an empty folder is replaced)")
    p.add_argument("--link-weights", action="store_true",
                   help="record the checkpoint's safetensors files (size, header and data hashes) instead of "
                        "copying the weights")
    p.add_argument("--allow-non-finite", action="store_true",
                   help="copy weights holding NaN or inf (a research checkpoint) instead of refusing them")
    p.add_argument("--plan-only", action="store_true",
                   help="trace and print routing, split plans and lints; write nothing (config.json suffices)")
    p.add_argument("--no-dumps", action="store_true", help="skip dumps/ (text, ONNX and layer picture of every pass)")
    p.add_argument("--no-weights", action="store_true",
                   help="compile config.json alone (no safetensors needed); run the artifact with --load-format dummy")
    p.add_argument("--decode-buckets", type=_ints, default=None, metavar="N,N,...",
                   help="decode batch sizes to capture, e.g. 1,2,4,8 (default: 1,2,4,...,256)")
    p.add_argument("--extend-buckets", type=_ints, default=None, metavar="N,N,...",
                   help="extend token counts to capture, e.g. 32,256,512; a bucket of t tokens holds min(t, largest "
                        "decode bucket) requests (default: 16,32,...,4096)")
    p.add_argument("--bucket-costs", default=None, metavar="FILE",
                   help="choose the extend buckets from step costs measured on the target (a file written by "
                        "benchmarks/serving/bucket_costs.py): a bucket is kept where it saves a tenth over the next "
                        "larger one; the costs are recorded and `hgc inspect` shows them")
    p.add_argument("--json", action="store_true", help="JSON on stdout (with --plan-only: the whole plan)")
    p.add_argument("--inductor", action=argparse.BooleanOptionalAction, default=None,
                   help="also build this machine's target bundle: the glue between op cores compiled by Inductor "
                        "and every kernel start-up needs, inside the artifact (`hgc build`). Default: on for "
                        "--target cuda on a machine with a CUDA device (and, with --tp N, N of them; not with "
                        "--overlap yet), off elsewhere; --no-inductor turns it off. With --tp N the N ranks build "
                        "it, each for its own device. --inductor where it cannot be built is an error (without a "
                        "CUDA device: run `hgc build ARTIFACT --device cuda` on the GPU machine)")
    add_bundle_choices(p, compile_command=True)
    _compile_flags(p)
    p.set_defaults(func=cmd_compile)

    p = subparsers.add_parser(
        "inspect", help="print an artifact's routing table, split plans and lints",
        description="Read an artifact's documents (hashes and versions checked, nothing executed) and print its "
                    "routing table (backend per layer and op, and what chose it), split plans and lint findings.",
        epilog="example:\n  hgc inspect artifacts/tiny --json")
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    p.set_defaults(func=cmd_inspect)

    p = subparsers.add_parser(
        "verify", help="re-hash every file of an artifact (with --full, linked checkpoint data too)",
        description="Check an artifact as the loader would, without loading weights, and re-hash every file it "
                    "lists: the manifest's seal, versions, documents, the programs' archives, the model facts "
                    "against the programs, and linked checkpoint files (size and header; their data with --full).",
        epilog="examples:\n  hgc verify artifacts/tiny\n  hgc verify artifacts/linked --full")
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--full", action="store_true",
                   help="also re-hash the data of linked checkpoint files (reads every byte of them)")
    p.set_defaults(func=cmd_verify)

    p = subparsers.add_parser(
        "backends", help="list the backends routing can choose (built-in and installed plugins)",
        description="Every backend routing can choose, built-in or installed under the entry-point group "
                    "hgc.backends, with its declaration: device, ops, modes, capturable modes, dtypes, priority, "
                    "kernel options (each name=choices, the default first).",
        epilog="example:\n  hgc backends --json")
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    p.set_defaults(func=cmd_backends)
