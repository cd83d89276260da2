"""A program's compiled glue under Inductor setting variants: each distinct glue piece timed at several token counts.

    python3 benchmarks/kernels/glue_config_bench.py --out $OUT                  # GPU: bench qwen3_next, bf16
    python3 benchmarks/kernels/glue_config_bench.py --out $OUT --tokens 1,4096 --variants bundle,per_block
    python3 benchmarks/kernels/glue_config_bench.py --dry-run --out /tmp/gcb      # CPU: tiny, C++ glue

Why: the bundle compiles every glue piece once for all token counts, with combo kernels on
(compiler/splitops/bundle.py INDUCTOR_CONFIG: the small kernels of a decode step as one launch). At
a 4096-token extend a GQA layer's glue took 0.27 ms, 0.17 ms of it in two combo kernels
(benchmarks/history/linear_extend.md). This weighs the settings piece by piece, at decode and
prompt sizes alike, before the bundle's settings change:

1. the artifact (bench_common.compiled_artifact: `hgc compile`, traced glue) of --family/--size,
   loaded on random weights; its main program's glue segments as `hgc build` cuts them
   (compiler/splitops/glue.py), with the build's rewrites (the projections' GEMV op, `small_m_for`;
   the device's default bundle choices, or --[no-]sigmoid-gate's where given), one per distinct
   structure (--max-segments of them, largest first);
2. per variant (`VARIANTS`: bundle = INDUCTOR_CONFIG; no_combo = combo kernels off; per_block = a
   block size per combo sub-kernel; fixed_pointwise = Inductor's pointwise kernels at their first
   candidate tile, none timed), each piece compiled as the build compiles it
   (inductor_pieces.compile_piece) and called once at the largest token count first, as the build's
   tuning step calls it (a kernel that times its candidate tiles keeps the choice of its first
   launch); a setting this torch lacks marks the variant skipped;
3. per token count T (every symbolic size of the piece set to T): fresh random inputs (floats
   N(0, 0.1^2), integer and bool inputs 0, which every index and position accepts); each variant's
   outputs checked against the traced segment run eagerly on the same inputs (relative error of the
   norm, within CHECK_TOL of the dtype, else its times are not taken), then one call's time inside
   a CUDA graph of --calls calls, median of --replays (bench_common.graph_call_us), and kernels per
   call (torch.profiler).

Writes $OUT/glue_config_bench.json and prints a table: per piece and T, each variant's us and
kernels, and the sum over pieces weighted by how many segments each piece serves in the program
(what a step of T tokens spends in glue, one request). The dry run walks it on the CPU (C++
kernels, times mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_common

import torch  # noqa: E402

from bench_common import compiled_artifact, device_facts, graph_call_us, kernels_per_call, rel_err  # noqa: E402
from compiler.inductor_pieces import compile_piece, drop_metadata_asserts  # noqa: E402
from compiler.splitops.artifact import retarget_meta_devices  # noqa: E402
from compiler.splitops.bundle import INDUCTOR_CONFIG  # noqa: E402
from compiler.splitops.glue import glue_segments, segment_module, structure_key  # noqa: E402
from compiler.splitops.glue_ops import use_norm_linear, use_norm_rope, use_sigmoid_gate, use_small_m_linear  # noqa: E402

# setting overrides on top of the device's INDUCTOR_CONFIG
VARIANTS = {"bundle": {}, "no_combo": {"combo_kernels": False},
            "per_block": {"combo_kernel_per_subkernel_blocks": True},
            "fixed_pointwise": {"triton.autotune_pointwise": False}}
CHECK_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def pieces(gm: torch.fx.GraphModule, small_m: bool, limit: int, norm_linear: bool = False, norm_rope: bool = False,
           sigmoid_gate: bool = False) -> list[dict]:
    """The program's distinct glue pieces, each with how many segments it serves, largest first,
    rewritten as the build rewrites them (compiler/inductor_pieces.py compile_glue)."""
    by_key: dict[str, dict] = {}
    for segment in glue_segments(gm):
        if not segment.outputs:
            continue
        module = segment_module(gm, segment)
        if small_m:
            use_small_m_linear(module)
        if norm_linear:
            use_norm_linear(module)
        if norm_rope:
            use_norm_rope(module)
        if sigmoid_gate:
            use_sigmoid_gate(module)
        entry = by_key.setdefault(structure_key(module), {"module": module, "first": segment.nodes[0],
                                                          "nodes": len(segment.nodes), "segments": 0})
        entry["segments"] += 1
    return sorted(by_key.values(), key=lambda e: -e["nodes"])[:limit]


def concrete_inputs(module: torch.fx.GraphModule, T: int, device, generator) -> list[torch.Tensor]:
    """Random inputs of the module's placeholders, laid out as their strides say, every symbolic size set to T."""
    def size(v):
        return v if isinstance(v, int) else int(v.node.expr.xreplace({s: T for s in v.node.expr.free_symbols}))

    out = []
    for node in module.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):
            raise ValueError(f"placeholder {node.name} is {type(val).__name__}, not a tensor")
        shape = [size(s) for s in val.shape]
        if val.dtype.is_floating_point:
            t = (0.1 * torch.randn(shape, generator=generator)).to(val.dtype)
        else:
            t = torch.zeros(shape, dtype=val.dtype)
        # with the placeholder's strides: a compiled piece checks them (a slice of a wider tensor,
        # such as q out of the projection's output, is not contiguous)
        strided = torch.empty_strided(shape, [size(s) for s in val.stride()], dtype=val.dtype, device=device)
        out.append(strided.copy_(t))
    return out


def defined_outputs(module: torch.fx.GraphModule) -> list[int]:
    """Positions of the module's outputs that it computes: not the empty buffers it makes for the
    op cores that follow (their contents are whatever memory held)."""
    (out,) = [n for n in module.graph.nodes if n.op == "output"]
    args = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    return [i for i, a in enumerate(args)
            if isinstance(a, torch.fx.Node) and "empty" not in str(a.target)
            and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype.is_floating_point]


def outputs(result, keep: list[int]) -> list[torch.Tensor]:
    items = result if isinstance(result, (list, tuple)) else [result]
    return [items[i] for i in keep]


def run(args) -> dict:
    from runtime.artifact.bundle import CompiledOptions
    from runtime.artifact.loader import load_artifact

    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda":
        from runtime.backends import glue_kernels
        glue_kernels.register()  # the GEMV op's kernel, as a cuda bundle's loader registers it
    art = load_artifact(compiled_artifact(args), device, compiled=CompiledOptions(enabled=False), load_format="dummy",
                        programs=("main",))
    gm = art.programs["main"].graph_module
    base = INDUCTOR_CONFIG[device.type]
    known = set(torch._inductor.config._config)  # the settings this torch has
    doc = {"env": device_facts(args.dry_run), "config": {k: str(v) for k, v in vars(args).items()},
           "variants": {}, "pieces": []}
    for name in args.variants.split(","):
        patch = VARIANTS[name]
        missing = [k for k in patch if k not in known]
        doc["variants"][name] = {"patch": patch, "skipped": f"this torch has no {missing}" if missing else None}
    generator = torch.Generator().manual_seed(0)
    from hgc.build_command import BundleChoices, small_m_for
    small_m = small_m_for(art.docs, device.type)
    choices = BundleChoices(sigmoid_gate=args.sigmoid_gate).resolved(device.type, small_m)
    rewrites = {name: bool(getattr(choices, name)) for name in ("norm_linear", "norm_rope", "sigmoid_gate")}
    doc["rewrites"] = rewrites
    for entry in pieces(gm, small_m=small_m, limit=args.max_segments, **rewrites):
        module = entry.pop("module")
        # as compile_piece prepares it: on the device, without export's dtype asserts (the eager reference)
        retarget_meta_devices(module.graph, device)
        drop_metadata_asserts(module.graph)
        module.recompile()
        row = {**entry, "tokens": {}}
        compiled = {}
        for name, v in doc["variants"].items():
            if v["skipped"] is None:
                # compile_piece retargets and rewrites the module in place: each variant compiles a copy
                compiled[name] = compile_piece(copy.deepcopy(module), device, {**base, **v["patch"]})
        keep = defined_outputs(module)
        first = concrete_inputs(module, max(args.tokens), device, generator)
        with torch.no_grad():
            for fn in compiled.values():  # the build's tuning step: the first launch at the largest count
                fn(*first)
        for T in args.tokens:
            inputs = concrete_inputs(module, T, device, generator)
            with torch.no_grad():
                ref = outputs(module(*inputs), keep)
                cell = {}
                for name, fn in compiled.items():
                    got = outputs(fn(*inputs), keep)
                    err = max((rel_err(g.float(), r.float()) for g, r in zip(got, ref)), default=0.0)
                    ok = len(got) == len(ref) and err <= CHECK_TOL[ref[0].dtype if ref else torch.float32]
                    cell[name] = {"rel_err": err, "ok": ok}
                    if ok:
                        cell[name]["us"] = graph_call_us(lambda _, f=fn: f(*inputs), args.calls, args.replays, device)
                        cell[name]["kernels"] = kernels_per_call(lambda f=fn: f(*inputs))
            row["tokens"][str(T)] = cell
        doc["pieces"].append(row)
        print(f"piece from {row['first']} ({row['nodes']} nodes, {row['segments']} segments): "
              + "; ".join(f"T={T} " + ", ".join(f"{n} {c.get('us', float('nan')):.1f} us" for n, c in cell.items())
                          for T, cell in row["tokens"].items()), flush=True)
    ran = [name for name, v in doc["variants"].items() if v["skipped"] is None]
    doc["step_us"] = {T: {name: sum(p["segments"] * p["tokens"][T][name].get("us", float("nan"))
                                    for p in doc["pieces"]) for name in ran}
                      for T in map(str, args.tokens)}
    return doc


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU: tiny model, C++ glue; times mean nothing")
    ap.add_argument("--family", default="qwen3_next")
    ap.add_argument("--size", default=None, help="model size (default: bench; dry run: tiny)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/glue_config_work"), help="where the artifact is built")
    ap.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,32,512,4096; dry run 1,8)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--max-segments", type=int, default=16, help="the largest distinct pieces to take")
    ap.add_argument("--sigmoid-gate", action=argparse.BooleanOptionalAction, default=None,
                    help="rewrite the attention outputs' gates as hgc build --sigmoid-gate does (default: the "
                         "device's default, as a build's)")
    ap.add_argument("--calls", type=int, default=20, help="calls captured in one graph")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown} (known: {', '.join(VARIANTS)})")
    args.size = args.size or ("tiny" if args.dry_run else "bench")
    args.tokens = [int(t) for t in (args.tokens or ("1,8" if args.dry_run else "1,32,512,4096")).split(",")]
    doc = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "glue_config_bench.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"\nglue of one step, us (segments weighted; {args.family} {args.size})")
    names = list(next(iter(doc["step_us"].values()), {}))
    print("| tokens | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for T, row in doc["step_us"].items():
        print(f"| {T} | " + " | ".join(f"{row[n]:.1f}" for n in names) + " |")
    return doc


if __name__ == "__main__":
    main()
