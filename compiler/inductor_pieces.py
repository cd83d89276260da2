"""Compile a program's glue with Inductor, once per distinct structure, into the files of a target bundle.

The op cores stay opaque: they are outside every compiled piece and the runtime calls them in
place between pieces (compiler/splitops/glue.py cuts the graph there), so Inductor sees plain
aten glue, functionalizes nothing of ours and never copies an op's `out`.

1. `glue_segments(gm)` cuts the program; a segment with no outputs (checks only) is skipped.
   Before anything compiles, `segment_pieces` checks that every mode's split plan holds each
   segment whole in one captured piece, where the runtime will install it.
2. `segment_module` + `structure_key`: layers of one structure share one compiled piece (a
   48-layer model needs a handful, not hundreds). With `small_m` (hgc/build_command.py decides),
   the segment's plain projections become calls of the glue op `hgc_glue::small_m_linear` first
   (compiler/splitops/glue_ops.py), so the key and the compiled code both hold them; Inductor
   keeps the op as a call, which the runtime's CUDA kernel for it runs (a one-launch GEMV for few
   rows, torch otherwise). With `norm_linear` as well (`hgc build --norm-linear`), each layer's input
   RMSNorm, with the residual add before it, and the projection reading it become one call of
   `hgc_glue::add_rms_norm_linear` (a GEMV with the norm in its prologue), and its output
   projection with the residual add and the post-attention RMSNorm after it one call of
   `hgc_glue::linear_add_rms_norm` (the add and the norm in the GEMV's epilogue): `use_norm_linear`.
   With `norm_rope` (`hgc build --norm-rope`), a GQA layer's q and k head norms and their rotary
   become one call of `hgc_glue::qk_norm_rope` (one kernel reading each row once): `use_norm_rope`.
   With `sigmoid_gate` (`hgc build --sigmoid-gate`), an attention output's sigmoid gate becomes one
   call of `hgc_glue::sigmoid_gate` (a kernel of a fixed tile): `use_sigmoid_gate`.
3. `fake_inputs(module, device)`: the segment's inputs as fake tensors on the target device, every
   symbolic size (the token count T, the logits row count R) a fresh symbol of one ShapeEnv, hinted
   with the example size the program was traced with. One compile then covers every bucket.
4. `torch._inductor.standalone_compile(module, inputs, dynamic_shapes="from_graph")` (torch 2.8 and
   later; `options={"config_patches": ...}` carries splitops.bundle.inductor_config's settings, with
   Inductor's PDL setting for a --pdl build), then
   `CompiledArtifact.save(format="binary")` into `pieces/<key>.bin`.
5. `inductor_cache_files(cache_dir)`: what Inductor built into the build's cache folder and the
   pieces load at run time (C++ kernels on cpu; Triton kernel sources and tuning choices on cuda),
   less its cache indexes, which the pieces carry themselves.

The caller points Inductor's cache at an empty folder for the build (splitops.bundle.cache_env), so
everything found there afterwards belongs to this build. What it does not do: write bundle.json,
sign, or run kernels of the backends (hgc/build_command.py does; runtime/artifact/bundle.py loads).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable

import torch
import torch.fx

from compiler.splitops.artifact import retarget_meta_devices
from compiler.splitops.bundle import PIECES, inductor_config
from compiler.splitops.errors import CompileError
from compiler.splitops.glue import GlueSplitError, glue_segments, segment_module, segment_pieces, structure_key
from compiler.splitops.glue_ops import (use_norm_linear, use_norm_rope, use_sigmoid_gate,
                                        use_small_m_linear)

__all__ = ["PieceBuildError", "compile_glue", "compile_piece", "drop_metadata_asserts", "fake_inputs", "inductor_cache_files"]

# Inductor's own indexes of what it compiled: the pieces carry those entries inside their .bin.
_CACHE_INDEXES = ("fxgraph", "aotautograd", "locks")


class PieceBuildError(CompileError):
    pass


def _hint(symbol, shape_env) -> int:
    hints = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
    return int(hints[symbol])


def fake_inputs(module: torch.fx.GraphModule, device: torch.device) -> list[torch.Tensor]:
    """Step 3: fake tensors for the module's placeholders on `device`, sharing one symbol per traced
    dimension, and every node's traced value refreshed from them (`example_value`, which
    standalone_compile's "from_graph" reads its fake mode from)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    symbols: dict = {}  # traced symbol -> (new symbol, hint)

    def size(value):
        if isinstance(value, int):
            return value
        expr = value.node.expr
        for s in sorted(expr.free_symbols, key=str):
            if s not in symbols:
                hint = _hint(s, value.node.shape_env)
                # DYNAMIC, not duck-sized: two dimensions whose hints happen to agree stay two symbols
                new = shape_env.create_symbol(hint, ConstantSource(str(s)), dynamic_dim=DimDynamic.DYNAMIC)
                symbols[s] = (new, hint)
        new_expr = expr.xreplace({s: v[0] for s, v in symbols.items()})
        hint = int(expr.xreplace({s: v[1] for s, v in symbols.items()}))
        return shape_env.create_symintnode(new_expr, hint=hint)

    fakes = []
    with mode:
        for node in module.graph.nodes:
            if node.op == "placeholder":
                val = node.meta["val"]
                fakes.append(torch.empty_strided([size(s) for s in val.shape], [size(s) for s in val.stride()],
                                                 dtype=val.dtype, device=device))
    FakeTensorProp(module, mode).propagate_dont_convert_inputs(*fakes)
    for node in module.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
    return fakes


_METADATA_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def drop_metadata_asserts(graph: torch.fx.Graph) -> int:
    """Erase export's dtype checks (aten._assert_tensor_metadata) from a piece's graph; how many.

    They check what the trace already fixed, at run time too, and as readers of a value they are
    not pointwise, which changes what Inductor fuses around them (its post-grad passes keep or
    split a value's producers by whether every reader is pointwise). On an H200, bench qwen3_next,
    the per-kernel account after dropping them (benchmarks/history/prefix_cache.md, "Short steps'
    kernels ..."), against the last one before (commit a06d6ff; the compiled glue's graphs differ by
    these asserts alone): the GDN layer's gated-norm glue kernel took 1.3 us at batch 1 against 4.7-5.1, the batch-1 decode step's glue 0.116 ms against 0.146, the step 0.973 ms against 1.047.
    The device copy before each out_proj GEMM (memcpy32_post) is still there: it is not theirs."""
    asserts = [n for n in graph.nodes if n.op == "call_function" and n.target is _METADATA_ASSERT]
    for node in asserts:
        graph.erase_node(node)
    return len(asserts)


def compile_piece(module: torch.fx.GraphModule, device: torch.device, config_patches: dict | None = None):
    """Step 4 for one segment module (`segment_module`), retargeted to `device` in place: its
    CompiledArtifact, for every value of its symbolic sizes. config_patches: the Inductor settings
    (default: `inductor_config`'s for the device without PDL; benchmarks/kernels/glue_config_bench.py
    weighs others; a bundle is always built and loaded with `inductor_config`'s)."""
    from torch._inductor import standalone_compile

    retarget_meta_devices(module.graph, device)
    drop_metadata_asserts(module.graph)
    module.recompile()
    inputs = fake_inputs(module, device)
    patches = dict(inductor_config(device.type) if config_patches is None else config_patches)
    with torch.no_grad():
        return standalone_compile(module, inputs, dynamic_shapes="from_graph", options={"config_patches": patches})


def _code_files(cache_dir: Path) -> set[Path]:
    return {p for p in cache_dir.rglob("*") if p.suffix in (".py", ".cpp") and p.is_file()}


def compile_glue(programs: dict[str, torch.fx.GraphModule], plans: dict, device: str | torch.device, out_dir: Path,
                 cache_dir: Path, log: Callable[[str], None] = lambda line: None,
                 small_m: bool = False, pdl: bool = False, norm_linear: bool = False,
                 norm_rope: bool = False, sigmoid_gate: bool = False) -> tuple[dict, dict]:
    """Steps 1-4 for every program; plans: program -> mode -> SplitPlan (split.json). Returns
    (programs: program -> segment records with the piece file running each, pieces: file ->
    {structure, nodes, seconds, code_sha256, small_m_linear, norm_linear, norm_rope, sigmoid_gate}: small_m_linear, how
    many of the piece's projections call a GEMV op, 0 without `small_m`; norm_linear, how many of those
    carry their input norm, 0 without `norm_linear`, which needs `small_m`; norm_rope, how many calls
    of qk_norm_rope hold a layer's q / k norms and rotary, 0 without `norm_rope`; sigmoid_gate, how
    many calls of sigmoid_gate gate an attention output, 0 without `sigmoid_gate`). `pdl`: the pieces'
    Triton kernels launch with programmatic dependent launch (`inductor_config`). Piece files are
    written under out_dir/pieces/; Inductor's cache must point at cache_dir (cache_env)."""
    if norm_linear and not small_m:
        raise ValueError("compile_glue: norm_linear folds norms into the GEMV op's projections; it needs small_m")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    (out_dir / PIECES).mkdir(parents=True, exist_ok=True)
    settings = inductor_config(device.type, pdl)
    by_key: dict[str, str] = {}
    pieces: dict[str, dict] = {}
    records: dict[str, list[dict]] = {}
    order = sorted(programs, key=lambda p: p != "main")  # main first: its pieces are the ones reused
    segments = {p: glue_segments(programs[p]) for p in order}
    for program in order:
        for plan in plans[program].values():
            try:
                segment_pieces(segments[program], plan, program)
            except GlueSplitError as e:
                raise PieceBuildError(f"inductor: {e}; recompile the artifact") from None
    todo = [(p, programs[p], s) for p in order for s in segments[p]]
    for i, (program, gm, segment) in enumerate(todo, 1):
        record = {**segment.to_json(), "piece": None}
        records.setdefault(program, []).append(record)
        if not segment.outputs:
            continue
        module = segment_module(gm, segment)
        projections = use_small_m_linear(module) if small_m else 0
        norms = use_norm_linear(module) if norm_linear else 0
        rotaries = use_norm_rope(module) if norm_rope else 0
        gates = use_sigmoid_gate(module) if sigmoid_gate else 0
        key = structure_key(module)
        if key in by_key:
            record["piece"] = by_key[key]
            log(f"piece {i}/{len(todo)} ({program}, {len(segment.nodes)} nodes from {segment.nodes[0]}): "
                f"same code as {by_key[key]}")
            continue
        name = f"{PIECES}/{key[:16]}.bin"
        start = time.perf_counter()
        before = _code_files(cache_dir)
        try:
            compile_piece(module, device, settings).save(path=str(out_dir / name), format="binary")
        except Exception as e:  # Inductor's errors are of many kinds; name the segment either way
            raise PieceBuildError(f"inductor: {program} program, glue from node {segment.nodes[0]} to "
                                  f"{segment.nodes[-1]} ({len(segment.nodes)} nodes) failed to compile: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; build with "
                                  f"--no-inductor to run the traced glue") from e
        seconds = time.perf_counter() - start
        code = hashlib.sha256()
        for path in sorted(_code_files(cache_dir) - before):
            code.update(path.name.encode() + b"\0" + path.read_bytes())
        by_key[key] = record["piece"] = name
        pieces[name] = {"structure": key, "nodes": len(segment.nodes), "seconds": round(seconds, 2),
                        "code_sha256": code.hexdigest(), "small_m_linear": projections, "norm_linear": norms,
                        "norm_rope": rotaries, "sigmoid_gate": gates}
        log(f"piece {i}/{len(todo)} ({program}, {len(segment.nodes)} nodes from {segment.nodes[0]}"
            + (f", {projections} GEMV projection(s)" if projections else "")
            + (f", {norms} with their input norm" if norms else "")
            + (f", {rotaries} q / k norm and rotary call(s)" if rotaries else "")
            + (f", {gates} sigmoid gate call(s)" if gates else "") + f"): compiled in {seconds:.1f} s")
    return records, pieces


def inductor_cache_files(cache_dir: Path) -> list[Path]:
    """Step 5: the files Inductor built into cache_dir, less its cache indexes."""
    return sorted(p for p in cache_dir.rglob("*") if p.is_file() and not p.name.endswith(".lock")
                  and p.relative_to(cache_dir).parts[0] not in _CACHE_INDEXES)
