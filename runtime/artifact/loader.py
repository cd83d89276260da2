"""Load an hgc artifact without executing code from it, and run its programs on the backends routing.json names.

    art = load_artifact("artifacts/tiny")                  # checks, weights bound, no code run
    ops = BoundOps(art.backends(kv_pool, state_pool).for_program("main"))
    forward = art.bind(ops)                                # every op node bound to its routed instance
    tokens = greedy_generate(forward, ops, kv_pool, state_pool, prompts, 8)

Lifecycle, one module per role:

1. runtime/artifact/docs.py: `read_artifact(path)` reads manifest.json, checks versions and the
   SHA-256 of every file, and parses the registry, routing.json, split.json and lints.json.
   `hgc inspect` stops here.
2. runtime/artifact/pt2_check.py: each .pt2 archive is checked for anything torch.export.load could use to
   run code, then loaded from the checked bytes.
   `load_programs(docs)` loads them, and `check_model_facts` checks the manifest's vocabulary and
   hidden size (and config.json's copy of them) against the main program's embedding and logits.
3. runtime/artifact/weights.py: weights.json says which checkpoint tensors fill each program parameter;
   a rank of a tensor-parallel artifact reads only its part of each (sharding.json), and
   `load_format="dummy"` makes them random instead of reading any. They are read on a thread of
   their own while step 2 deserializes the programs and step 5 opens the bundle.
4. runtime/artifact/binding.py: `LoadedArtifact.backends(kv_pool, state_pool)` builds the instances
   routing.json names (and only those); `runner(ops, program)` binds every op node of the program
   to the instance its entry names and checks the bound graph against routing.json before
   anything runs; `ProgramRunner` re-applies the split plan recorded for each mode
   (`compiler.splitops.artifact.apply_split_plan`; the compiler's passes are never imported).
5. runtime/artifact/bundle.py: where the artifact holds a target bundle for this installation, its compiled
   pieces are checked, consented to and loaded (`compiled`: CompiledOptions); each mode's split
   module then runs them in place of the traced glue (runtime/artifact/compiled_glue.py), and
   `module_for(mode, compiled=False)` still gives the traced glue (the start-up check's reference).
6. An artifact compiled with --batch-invariant (manifest "compile"), loaded on a CUDA device, sends
   every matrix product and every sum or mean over dims of the process to fixed-order kernels
   (runtime/backends/batch_invariant_aten.py `install`: one order for any row count): the glue's
   products, compiled or traced, call aten's mm and addmm, and the traced glue's norms its sum and mean.
   Its backends' batch-invariant choices are in routing.json already (routing set them).
7. runtime/graphs/side_stream.py: on a CUDA device, each captured piece with side branches (split.json,
   `hgc compile --overlap`) is rewritten to fork its branches onto a second stream and join them
   back (`module_for`); on the CPU the nodes run in graph order. Side branches and compiled
   pieces do not combine yet (a compiled segment is one call, it cannot be split across
   streams): the runner refuses the pair.

What it does not do: allocate caches (runtime pools), schedule requests (the engine), capture
CUDA graphs (the graph runner), choose a backend (routing did), or trust anything it has not checked.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from typing import Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind

from compiler.splitops import LayerRegistry, Mode
from compiler.splitops.artifact import (PROGRAM_FILES, PROGRAM_INPUTS, WEIGHT_MAP, ArtifactFormatError, SplitPlan,
                                        apply_split_plan, load_json, parse_weights_doc, piece_module_names,
                                        program_outputs)
from runtime.artifact.docs import ArtifactDocs, LoadError, config_value, read_artifact
from runtime.artifact.binding import Backends, bind_graph, build_backends, check_binding
from runtime.artifact.bundle import CompiledBundle, CompiledOptions, open_bundle
from runtime.cache.memory_planner import MemoryPlanError, check_fits
from runtime.artifact.pt2_check import check_pt2_bytes, load_program
from runtime.graphs.side_stream import CudaSideStream, StreamPlanError, stream_piece
from runtime.artifact.weights import WeightFiles, assemble, check_load_format, whole_shapes

__all__ = ["LoadError", "ArtifactDocs", "LoadedArtifact", "ProgramRunner", "read_artifact", "load_artifact",
           "check_pt2_bytes", "load_programs", "check_model_facts", "CompiledOptions", "programs_for_run"]


class ProgramRunner:
    """One program bound to one op table: `runner(mode, *user inputs)` runs the mode's recorded split.

    It returns what the program returns: logits, or (logits, hidden) where `outputs` names two
    (compiler/splitops/artifact.py `program_outputs`)."""

    def __init__(self, name: str, program, plans: dict[Mode, SplitPlan], weights: list[torch.Tensor], ops,
                 device: torch.device, docs: ArtifactDocs, outputs: tuple[str, ...] = ("logits",), glue=None,
                 streams=None):
        """glue: the program's CompiledGlue (runtime/artifact/compiled_glue.py), or None to run the traced glue.
        streams: what runs the plans' side branches (None: a CudaSideStream on a CUDA device, nothing
        elsewhere; False: nothing: the nodes run in graph order, what a benchmark compares with)."""
        self.name, self.program, self.plans, self.ops, self.device = name, program, plans, ops, device
        branched = [m.value for m, plan in plans.items() if plan.side_branches()]
        if branched and glue is not None:
            raise LoadError(f"{docs.path}: the {name} program has side-stream branches (hgc compile --overlap; modes "
                            f"{', '.join(branched)}) and a target bundle of compiled pieces: the two do not combine "
                            f"yet; run with --no-compiled, or recompile without --overlap")
        if streams is None and branched and torch.device(device).type == "cuda":
            streams = CudaSideStream(torch.device(device))
        self.streams = streams or None
        self.weights = weights
        self.outputs = tuple(outputs)
        sig = program.graph_signature
        self.num_mutations = sum(1 for s in sig.output_specs if s.kind != OutputKind.USER_OUTPUT)
        self._bound = bind_graph(program.graph_module, name, docs, ops, device)
        check_binding(self._bound, name, docs, ops)  # start-up: what is bound is what routing.json says
        self.glue = glue
        if glue is not None:
            glue.check(program.graph_module)
        self._by_plan: dict[tuple, torch.fx.GraphModule] = {}

    def module_for(self, mode: Mode, compiled: bool = True) -> torch.fx.GraphModule:
        """The mode's split module; with the compiled pieces in place of the glue unless `compiled` is
        False. The program is split once per plan: the compiled module shares the traced one's
        pieces where no glue was compiled (runtime/artifact/compiled_glue.py)."""
        plan = self.plans[Mode(mode)]
        pieces = tuple((p.kind, p.nodes, p.branches) for p in plan.pieces)
        if (False, pieces) not in self._by_plan:
            try:
                split = apply_split_plan(self._bound, plan)
            except ArtifactFormatError as e:
                raise LoadError(f"{self.name} program: {e}") from None
            if self.streams is not None:
                self._fork_branches(split, plan)
            self._by_plan[False, pieces] = split
        if not (compiled and self.glue is not None):
            return self._by_plan[False, pieces]
        if (True, pieces) not in self._by_plan:
            self._by_plan[True, pieces] = self.glue.install(self._by_plan[False, pieces], plan)
        return self._by_plan[True, pieces]

    def _fork_branches(self, split: torch.fx.GraphModule, plan: SplitPlan) -> None:
        """Step 7 of the module docstring: each captured piece with side branches forks them."""
        for piece, name in zip(plan.pieces, piece_module_names(plan)):
            if piece.branches:
                where = f"{self.name} {plan.mode.value} piece {piece.index}"
                try:
                    stream_piece(getattr(split, name), piece.branches, self.streams, where)
                except StreamPlanError as e:
                    raise LoadError(str(e)) from None

    def user_outputs(self, mode: Mode, inputs, compiled: bool = True) -> list:
        """The program's user outputs (flat) for one call in `mode` (call inside `ops.step(ctx)`)."""
        outputs = self.module_for(mode, compiled)(*self.weights, *inputs)
        return list(outputs)[self.num_mutations:]

    def __call__(self, mode: Mode, *inputs):
        return pytree.tree_unflatten(self.user_outputs(mode, inputs), self.program.call_spec.out_spec)


@dataclasses.dataclass
class LoadedArtifact:
    docs: ArtifactDocs
    programs: dict  # name -> ExportedProgram (weightless)
    weights: dict[str, torch.Tensor]  # model FQN -> tensor on the device
    program_fqns: dict[str, dict[str, str]]
    device: torch.device
    compiled: CompiledBundle | None = None  # the target bundle whose pieces run the glue, if any

    @property
    def manifest(self) -> dict:
        return self.docs.manifest

    @property
    def registry(self) -> LayerRegistry:
        return self.docs.registry

    @property
    def batch_invariant(self) -> bool:
        """Compiled with --batch-invariant: the engine runs prompt chunks apart from decodes."""
        return batch_invariant(self.docs)

    @property
    def split_plans(self) -> dict[str, dict[Mode, SplitPlan]]:
        return self.docs.split_plans

    def routed_backends(self, program: str = "main") -> list[str]:
        """The backends routing.json names for a program, in order of first use."""
        return self.docs.routing.backend_names(program)

    def backends(self, kv_pool, state_pool, registry=None, snapshots=None) -> Backends:
        """The instances routing.json names, built over the pools (runtime/artifact/binding.py build_backends)."""
        return build_backends(self.docs, self.programs, kv_pool, state_pool, self.device, registry, snapshots)

    def runner(self, ops, program: str = "main", streams=None) -> ProgramRunner:
        """The program with every op node bound to the instance of `ops.backend` its routing entry names.
        `streams`: what runs side branches (ProgramRunner; default: a CUDA side stream on a CUDA device)."""
        if program not in self.programs:
            loaded = "" if program not in self.docs.programs else " loaded (load_artifact(..., programs=...) left it out)"
            raise LoadError(f"{self.docs.path}: no {program} program{loaded} (programs: {sorted(self.programs)})")
        ep = self.programs[program]
        lifted = [s.target for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
        tensors = [self.weights[self.program_fqns[program][fqn]] for fqn in lifted]
        glue = self.compiled.glue(program) if self.compiled is not None else None
        return ProgramRunner(program, ep, self.split_plans[program], tensors, ops, self.device, self.docs,
                             program_outputs(program, self.docs.programs), glue, streams)

    def forward_for(self, mode: Mode | str, ops, program: str = "main") -> Callable:
        """The program's forward in one mode: (input_ids, positions, logits_index) -> logits for "main"
        (the main program's hidden states, where it returns them, are left out: `bind(all_outputs=True)`)."""
        run = self.runner(ops, program)
        mode = Mode(mode)
        pick = _pick_outputs(run, program, all_outputs=False)
        return lambda *inputs: pick(run(mode, *inputs))

    def bind(self, ops, program: str = "main", all_outputs: bool = False) -> Callable:
        """The program's forward, choosing each step's plan from `ops.ctx.mode` (call inside `ops.step(ctx)`).

        "main" returns logits, as a family model's forward does; with `all_outputs` it returns
        every output `program_outputs` names (logits, hidden) where there are two. "draft" always
        returns (logits, hidden)."""
        run = self.runner(ops, program)
        pick = _pick_outputs(run, program, all_outputs)

        def forward(*inputs):
            if ops.ctx is None:
                raise LoadError("artifact forward called outside a runtime step (use `with ops.step(ctx):`)")
            return pick(run(ops.ctx.mode, *inputs))

        forward.__name__ = f"{self.docs.family}_{program}_forward"
        forward.runner = run  # the start-up check of compiled pieces runs the same program both ways
        return forward


def _pick_outputs(run: ProgramRunner, program: str, all_outputs: bool) -> Callable:
    """What a bound forward hands back: the main program's logits alone unless every output is asked for."""
    if program == "main" and not all_outputs and len(run.outputs) > 1:
        return lambda outputs: outputs[0]
    return lambda outputs: outputs


def load_programs(docs: ArtifactDocs, names: tuple[str, ...] | None = None) -> dict:
    """Each program of the manifest (or those `names` lists), its archive checked
    (runtime/artifact/pt2_check.py) and loaded."""
    files = docs.manifest["files"]
    programs = {}
    for program in select_programs(docs, names):
        fname = PROGRAM_FILES[program]
        if fname not in files:
            raise LoadError(f"{docs.path}: program {program} has no {fname} listed in manifest.json")
        programs[program] = load_program(docs.path / fname, files[fname])
    return programs


def _embedding_and_logits(ep) -> tuple[list | None, list | None]:
    """(the token embedding's [vocab, hidden], the logits' shape) as the main program's graph has them."""
    embedding = logits = None
    for node in ep.graph.nodes:
        if embedding is None and node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
            val = node.args[0].meta.get("val")
            embedding = list(val.shape) if isinstance(val, torch.Tensor) else None
        if node.op == "output":
            user = [a for a in pytree.tree_leaves(node.args[0]) if isinstance(a, torch.fx.Node)]
            val = user[-len(ep.graph_signature.user_outputs)].meta.get("val") if user else None
            logits = list(val.shape) if isinstance(val, torch.Tensor) else None
    return embedding, logits


def check_model_facts(docs: ArtifactDocs, main_program) -> None:
    """manifest.json's `model` (and config.json's copy) against the main program: the vocabulary
    is the embedding's rows and the logits' width, the hidden size the embedding's width. The
    runtime checks prompt ids against the recorded vocabulary; a wrong one would index past the
    embedding."""
    embedding, logits = _embedding_and_logits(main_program)
    if embedding is None or logits is None:
        raise LoadError(f"{docs.path / PROGRAM_FILES['main']}: no token embedding or no logits output in the main "
                        f"program: recompile")
    found = {"vocab_size": embedding[0], "hidden_size": embedding[1]}
    if isinstance(logits[-1], int) and logits[-1] != found["vocab_size"]:
        raise LoadError(f"{docs.path / PROGRAM_FILES['main']}: logits have width {logits[-1]}, the embedding "
                        f"{found['vocab_size']} rows: recompile")
    model = docs.manifest.get("model") if isinstance(docs.manifest.get("model"), dict) else {}
    for name, value in found.items():
        for where, recorded in ((f"model.{name}", model.get(name)), (f"config {name}", config_value(docs.manifest, name))):
            if recorded is not None and recorded != value:
                raise LoadError(f"{docs.path / 'manifest.json'}: {where} is {recorded!r}, the main program's embedding "
                                f"says {value} ({PROGRAM_FILES['main']}): the manifest does not describe this program")


def check_programs(docs: ArtifactDocs, programs: dict, program_fqns: dict[str, dict[str, str]]) -> None:
    """Each loaded program against weights.json (every lifted parameter has a source) and against
    what this runtime calls it with and expects back."""
    check_model_facts(docs, programs["main"])
    for program, ep in programs.items():
        lifted = [s.target for s in ep.graph_signature.input_specs if s.kind != InputKind.USER_INPUT]
        unmapped = [f for f in lifted if f not in program_fqns.get(program, {})]
        if unmapped:
            raise LoadError(f"{docs.path}: {WEIGHT_MAP} does not say where {program} parameter {unmapped[0]!r} comes from")
        users = [s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
        if tuple(users) != PROGRAM_INPUTS[program]:
            raise LoadError(f"{docs.path}: the {program} program takes {users}, expected {list(PROGRAM_INPUTS[program])}")
        outputs = program_outputs(program, docs.programs)
        returned = sum(s.kind == OutputKind.USER_OUTPUT for s in ep.graph_signature.output_specs)
        recorded = docs.manifest["programs"][program].get("outputs")
        if returned != len(outputs) or (recorded is not None and tuple(recorded) != outputs):
            raise LoadError(f"{docs.path}: the {program} program returns {returned} output(s) (manifest: {recorded}); "
                            f"this runtime expects {list(outputs)}: recompile the checkpoint with this hgc")


def read_weights(docs: ArtifactDocs, sources: dict, device: torch.device, rank: int, load_format: str, progress,
                 stop: threading.Event | None = None) -> dict[str, torch.Tensor]:
    """Step 3: model FQN -> its tensor on `device`, each file's hash checked (while its tensors are read,
    before any is returned). `stop` set: return early (the caller has failed and will not use them)."""
    try:  # before any byte is read: a model too large for the device says by how much, per rank
        more = (f"compile with a larger --tp than {docs.tp} (each rank then holds less)" if docs.tp > 1
                else "compile with --tp N to spread the weights over N GPUs")
        # On a GPU this is the process's first CUDA call (the context, seconds): here, on the weights'
        # thread, it overlaps the programs' load.
        check_fits({"weights": sum(src.nbytes for src in sources.values())}, device, docs.tp, fix=more)
    except MemoryPlanError as e:
        raise LoadError(f"{docs.path}: {e}") from None
    weight_files = WeightFiles(docs, str(device), rank=rank, dummy=load_format == "dummy",
                               whole_shapes=whole_shapes(sources, docs.sharding))
    items = sources.items()
    if progress is not None:
        items = progress(items, total=len(sources), desc="load weights", unit="tensor")
    weights = {}
    try:
        for fqn, src in items:
            if stop is not None and stop.is_set():
                break
            weights[fqn] = assemble(fqn, src, weight_files, str(device))
    except Exception:
        weight_files.checked()  # a file that fails its hash is the error to report, not what reading it did
        raise
    if stop is None or not stop.is_set():  # stopped: the caller drops them, and need not wait for the hash
        weight_files.checked()  # checked while their tensors were read: nothing is handed on before
    return weights


def load_artifact(path: str | os.PathLike, device: str | torch.device | None = "cpu",
                  expected_pipeline: str | None = None, progress=None,
                  compiled: CompiledOptions = CompiledOptions(), *, rank: int = 0, tp: int = 1,
                  load_format: str = "auto", programs: tuple[str, ...] | None = None) -> LoadedArtifact:
    """Steps 1-3 and 5 of the module docstring. `device` None: the device the artifact was compiled for
    (its routing target: the device its backends run on). `expected_pipeline`: the pipeline
    fingerprint (manifest "pipeline_sha256") this runtime accepts; None accepts any pipeline of
    this format. `progress`: a tqdm-like factory, for a bar over the weights as they are read.
    `compiled`: whether and how a target bundle's compiled pieces may run (an artifact without
    bundles runs its traced glue whatever it says). `rank` of `tp`: which part of a
    tensor-parallel artifact's weights to load (the artifact must have been compiled for that
    `tp`). `load_format`: "auto" (the artifact's weights) or "dummy" (random ones, runtime/artifact/weights.py).
    `programs`: which of the artifact's programs to load (default: all). A run without speculative
    decoding names only "main": the draft's program and its compiled pieces are then not
    deserialized, a part of start-up that a run which never drafts would pay for nothing. (The
    weights are read whole either way: each program lifts every parameter of the model.)"""
    docs = read_artifact(path)
    programs = select_programs(docs, programs)
    check_load_format(docs, load_format)
    if docs.tp != tp or not 0 <= rank < tp:
        how = f"hgc run --tp {docs.tp} (or torchrun with {docs.tp} processes)" if docs.tp > 1 else "one process (no --tp)"
        raise LoadError(f"{docs.path}: compiled for --tp {docs.tp}, asked to run as rank {rank} of {tp}: run it with "
                        f"{how}, or recompile with `hgc compile --tp {tp}`")
    if device is None:
        device = docs.routing.target
    if expected_pipeline is not None and docs.manifest.get("pipeline_sha256") != expected_pipeline:
        raise LoadError(f"{docs.path}: compiled by another pipeline (fingerprint "
                        f"{str(docs.manifest.get('pipeline_sha256'))[:12]}..., expected {expected_pipeline[:12]}...): "
                        f"recompile with this hgc")
    device = torch.device(device)
    files = docs.manifest["files"]
    if WEIGHT_MAP not in files:
        raise LoadError(f"{docs.path}: {WEIGHT_MAP} is not listed in manifest.json")
    try:
        sources, program_fqns = parse_weights_doc(load_json(docs.path / WEIGHT_MAP), WEIGHT_MAP)
    except ArtifactFormatError as e:
        raise LoadError(f"{docs.path}: {e}") from None
    # The weights (hashing the file, reading it, copying to the device: I/O and copies that release
    # the GIL) are read on a thread of their own while this one deserializes the programs and opens
    # the bundle (Python): the load takes the longer of the two instead of their sum.
    stop = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hgc-weights") as pool:
        reading = pool.submit(read_weights, docs, sources, device, rank, load_format, progress, stop)
        warm = triton_cache_key_function() if device.type == "cuda" else None
        if warm is not None:
            pool.submit(warm)
        try:
            loaded = load_programs(docs, programs)
            check_programs(docs, loaded, program_fqns)
            # After the programs: every file the bundle's code comes from is checked and consented to
            # first (runtime/artifact/bundle.py); the weights are data, checked on their thread meanwhile.
            bundle = open_bundle(docs, device, compiled, rank, programs)
        except BaseException:
            stop.set()  # the weights thread stops at its next tensor; its own error, if any, is dropped
            raise
        weights = reading.result()
    if batch_invariant(docs):
        install_batch_invariant_kernels(docs, device)
    return LoadedArtifact(docs, loaded, weights, program_fqns, device, bundle)


def batch_invariant(docs: ArtifactDocs) -> bool:
    """Whether the artifact was compiled with --batch-invariant (its manifest's compile settings)."""
    compiled = docs.manifest.get("compile")
    return isinstance(compiled, dict) and compiled.get("batch_invariant") is True


def install_batch_invariant_kernels(docs: ArtifactDocs, device: torch.device) -> None:
    """Step 6: torch's CUDA matrix products and sums over dims in one fixed order, for the whole
    process (Inductor's compiled glue calls aten's extern mm, so no piece needs rebuilding). A CPU
    device cannot keep the promise: the compile refuses that target, and a load there is refused too."""
    if device.type != "cuda":
        raise LoadError(f"{docs.path}: compiled with --batch-invariant, whose fixed-order kernels run on CUDA only; "
                        f"asked to load on {device}")
    from runtime.backends import batch_invariant_aten
    batch_invariant_aten.install()


def triton_cache_key_function():
    """Triton's function for its cache key of this installation, for a thread to call beside the
    programs' load; None without Triton (a CPU-only install).

    The first kernel a process looks up in Triton's cache (the bundle's compiled pieces, our own
    kernels) makes Triton hash its compiler's sources and its shared library (`triton_key`, cached
    for the process): 0.37 s of a start-up on the GPU machine (benchmarks/history/compiled_pieces.md, "Where a
    start-up goes now"), nearly all of it SHA-256 over file reads, which release the GIL. On a thread of its
    own it costs the start-up nothing. Triton is imported here, on the calling thread (the load
    imports it anyway): two threads importing one package's modules at once is where Python's
    import locks can refuse with a deadlock error."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return None
    return triton_key


def programs_for_run(speculative_tokens: int) -> tuple[str, ...] | None:
    """load_artifact's `programs` for a run: every program where it drafts (the draft program is
    the MTP layer), the main program alone otherwise."""
    return None if speculative_tokens else ("main",)


def select_programs(docs: ArtifactDocs, names: tuple[str, ...] | None) -> tuple[str, ...]:
    """The programs a load asks for, in the artifact's order: all of them by default; "main" always."""
    if names is None:
        return tuple(docs.programs)
    unknown = [n for n in names if n not in docs.programs]
    if unknown:
        raise LoadError(f"{docs.path}: no {unknown[0]} program to load (programs: {sorted(docs.programs)})")
    if "main" not in names:
        raise LoadError(f"{docs.path}: a load needs the main program (asked for {sorted(names)})")
    return tuple(p for p in docs.programs if p in names)

