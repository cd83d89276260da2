"""The compile pipeline: the one ordered list of passes, and the whole compile flow.

    checkpoint dir --frontend--> programs (main, draft) --passes--> routing, split plans, lints
                   --artifact_writer--> artifacts/NAME/

Flow of `compile_checkpoint` (what `hgc compile` runs):

1. make a staging folder beside the output (nothing appears under the output name until the end);
2. `plan`: trace the checkpoint's config on the meta device (compiler/frontend.py), build the
   CompileContext, run the passes below with the dump and timing instruments;
3. stop with `LintFailure` if any lint error was found;
4. write the programs, weights and documents (compiler/artifact_writer.py), then rename the
   staging folder into place.

`hgc lint` and `hgc compile --plan-only` run `plan` alone, on a folder that may hold only
config.json. Nothing else in hgc decides the order of passes. With `--tp N` (N > 1) the programs
are one rank's and the sharding pass runs first; tp 1 compiles exactly as before.

Every entry point takes a `Toolchain` (compiler/toolchain.py): the backends' capability table, the
model reader and the checkpoint's file lists, handed in by the command line; the pipeline imports
neither models/ nor runtime/.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional

from compiler.frontend import TracedModel, trace_checkpoint
from compiler.lints import BACKEND_RULES, CAPTURE_RULES, REGISTRY_RULES, sort_findings
from compiler.passes.annotate import AnnotateOpsPass
from compiler.passes.base import CompileError, CompilePass
from compiler.passes.context import CompileConfig, CompileContext
from compiler.passes.fusion import FusionPass
from compiler.passes.instruments import DumpInstrument, ProgressInstrument, TimingInstrument
from compiler.passes.lints import LintPass
from compiler.passes.manager import PassManager
from compiler.passes.overlap import OverlapPass
from compiler.passes.routing import RoutingPass
from compiler.passes.shared_expert import SharedExpertPass
from compiler.passes.sharding import ShardingPass
from compiler.passes.split import SplitPass
from compiler.splitops.artifact import DUMPS
from compiler.toolchain import Toolchain

__all__ = ["build_passes", "plan", "run_passes", "compile_checkpoint", "CompileResult", "LintFailure", "make_context"]


def build_passes(config: CompileConfig) -> list[CompilePass]:
    # -- tensor parallel: each weight's cut across ranks, collectives as op nodes (--tp > 1 only) --
    sharding = [ShardingPass(config.tp)] if config.tp > 1 else []
    # -- --overlap only (off by default until a GPU benchmark shows a gain): shared experts out of
    #    the moe op before routing sees the graph, side-stream branches once the pieces exist ------
    unfuse = [SharedExpertPass()] if config.overlap else []
    overlap = [OverlapPass(config.overlap_min_bytes)] if config.overlap else []
    return sharding + [
        # -- facts: what each op node is (op, layer id, registry kind, module) -------------------
        AnnotateOpsPass(),
        # -- the graphs against the LayerRegistry; errors stop here (routing needs known layers) --
        LintPass("lint_registry", REGISTRY_RULES),
        # -- one op node for a region a backend of the target runs as one (--route OP=unfused keeps it)
        FusionPass(),
        *unfuse,
        # -- binding: each op node to a backend of the target device ------------------------------
        RoutingPass(),
        # -- partition: one order-preserving plan per mode, gaps at ops declared eager ------------
        SplitPass(),
        *overlap,
        # -- what the plans would capture, and the backend wrappers --------------------------------
        LintPass("lint_capture", CAPTURE_RULES + BACKEND_RULES),
    ]


class LintFailure(CompileError):
    def __init__(self, findings):
        self.findings = findings
        lines = "\n".join(f"  {f.line()}" for f in findings)
        super().__init__(f"{len(findings)} lint error(s); nothing was written:\n{lines}")


@dataclasses.dataclass
class CompileResult:
    traced: TracedModel
    ctx: CompileContext
    fingerprints: list[dict]
    timing: TimingInstrument

    def errors(self):
        return sort_findings(self.ctx.errors())


def make_context(traced: TracedModel, config: CompileConfig, toolchain: Toolchain) -> CompileContext:
    if traced.tp != config.tp:
        raise CompileError(f"pipeline: the programs were traced for --tp {traced.tp}, the compile asks for {config.tp}")
    return CompileContext(
        registry=traced.registry, capabilities=toolchain.capabilities, config=config,
        programs={name: ep.graph_module for name, ep in traced.programs.items()},
        signatures={name: ep.graph_signature for name, ep in traced.programs.items()},
        backend_wrappers=toolchain.backend_wrappers, missing_weights=traced.missing,
        tp=traced.tp, whole_registry=traced.whole_registry, shard_facts=traced.shard_facts,
        weight_sources=weight_sources(traced))


def weight_sources(traced: TracedModel) -> dict[str, dict]:
    """program -> weight placeholder name -> the ParamSource (checkpoint views) that fills it."""
    out = {}
    for program, ep in traced.programs.items():
        fqns = traced.program_fqns.get(program, {})
        out[program] = {s.arg.name: traced.tensors[fqns[s.target]] for s in ep.graph_signature.input_specs
                        if s.target in fqns}
    return out


def plan(ckpt_dir, config: CompileConfig, toolchain: Toolchain, dump_dir: Optional[Path] = None,
         timing: Optional[TimingInstrument] = None, progress=None) -> CompileResult:
    """Trace and run every pass; findings are in result.ctx (a lint error does not raise here).
    `progress`: a tqdm-like factory (hgc/progress.py), for a bar over the passes."""
    timing = timing or TimingInstrument()
    start = time.perf_counter()
    traced = trace_checkpoint(ckpt_dir, config.dtype, toolchain.read_model, tp=config.tp,
                              state_dtype=config.state_dtype)
    timing.add("00 export", "+".join(traced.programs), time.perf_counter() - start)
    return run_passes(traced, config, toolchain, dump_dir, timing, progress=progress)


def run_passes(traced: TracedModel, config: CompileConfig, toolchain: Optional[Toolchain] = None,
               dump_dir: Optional[Path] = None, timing: Optional[TimingInstrument] = None,
               ctx: Optional[CompileContext] = None, progress=None) -> CompileResult:
    """The passes of `build_passes` over traced programs (`ctx`: a prepared context, for tests;
    otherwise one is made with `toolchain`)."""
    timing = timing or TimingInstrument()
    if ctx is None:
        if toolchain is None:
            raise ValueError("run_passes: pass a toolchain (or a prepared context)")
        ctx = make_context(traced, config, toolchain)
    passes = build_passes(config)
    instruments = [timing] + ([DumpInstrument(dump_dir, timing=timing)] if dump_dir is not None else [])
    if progress is not None:
        instruments.append(ProgressInstrument(progress, len(passes)))
    manager = PassManager(passes, instruments)
    manager.run(ctx)
    return CompileResult(traced, ctx, manager.fingerprints(), timing)


def compile_checkpoint(ckpt_dir, out, config: CompileConfig, toolchain: Toolchain, force: bool = False,
                       link_weights: bool = False, dumps: bool = True,
                       timing: Optional[TimingInstrument] = None, weights: bool = True,
                       progress=None, allow_non_finite: bool = False) -> tuple[CompileResult, dict]:
    """`weights` False: compile config.json alone (a folder may hold nothing else); the artifact has
    no weights and runs with random ones (`hgc run --load-format dummy`). `progress`: a tqdm-like
    factory (hgc/progress.py). `allow_non_finite`: copy weights holding NaN or inf (research
    checkpoints) instead of refusing them."""
    from compiler.artifact_writer import checkpoint_index, staging_folder, write_artifact

    out, ckpt = Path(out), Path(ckpt_dir)
    timing = timing or TimingInstrument()
    with staging_folder(out, force=force, protect=[ckpt]) as tmp:
        # first: a folder without weights fails before the trace
        index = checkpoint_index(ckpt, toolchain.checkpoint_files) if weights else None
        result = plan(ckpt, config, toolchain, dump_dir=tmp / DUMPS if dumps else None, timing=timing,
                      progress=progress)
        if result.errors():
            raise LintFailure(result.errors())
        start = time.perf_counter()
        manifest = write_artifact(tmp, out, result, index, ckpt, toolchain.tokenizer_files, link=link_weights,
                                  progress=progress, allow_non_finite=allow_non_finite)
        timing.add("write artifact", "", time.perf_counter() - start)
    return result, manifest
