"""`hgc build ARTIFACT --device cpu|cuda`: add this installation's target bundle to an artifact.

    hgc build artifacts/NAME --device cuda            # on the GPU machine; progress on stderr
    hgc compile CKPT -o artifacts/NAME --target cpu --inductor    # compile, then this, in one command

A bundle (compiler/splitops/bundle.py) holds everything start-up would otherwise compile or tune:
the Inductor-compiled glue of every program and the kernel caches the pieces and the backends
load. Building needs the target device, since kernels are built for the machine at hand.

1. The kernel caches (Inductor's, Triton's, FlashInfer's) point at empty folders under
   `$HGC_HOME/build/<key>/` (default `~/.cache/hgc/build/<key>/`) for the whole build: whatever they
   hold afterwards was built for this bundle. The folders keep their paths from one build to the
   next, because compiled kernels record the path they were compiled at; so builds of one target
   take turns (`build_lock`: a second one waits for the first and says so). A run does not read
   them: Triton's group files, which name the folder, are rewritten to name the loader's copy
   (runtime/artifact/bundle.py `_relocated_group`). On cuda, Triton's cache reads through to the
   kernels earlier builds of the target compiled there, kept beside the folder (hgc/kernel_seed.py),
   and FlashInfer loads the modules they built from there (hgc/flashinfer_seed.py).
2. The portable artifact is loaded (its own checks) and each program's glue is compiled
   (compiler/inductor_pieces.py), one piece per distinct structure; on cuda, unless the artifact
   is batch-invariant, its projections as calls of the GEMV op (`small_m_for`); with --pdl (cuda,
   off by default) every kernel that can launches with programmatic dependent launch: Inductor's
   and the backends' (docs/DESIGN.md, "Programmatic dependent launch"); with the GEMV op, unless
   --no-norm-linear, each layer's norms and the residual adds beside them fold into the
   projections' GEMVs (docs/DESIGN.md, "Norms folded into the GEMVs"); on cuda, unless
   --no-norm-rope, a GQA layer's q / k norms and rotary run as one kernel (docs/DESIGN.md, "A GQA
   layer's q / k norms and rotary as one kernel"), and unless --no-sigmoid-gate an attention
   output's gate. Those are `BundleChoices`.
3. Start-up runs as `hgc run` / `hgc serve` would, with the fresh pieces: on cuda every recorded
   bucket is captured and checked (which builds the FlashInfer modules and Triton kernels of the
   captured shapes and tunes FLA's kernels, into the caches of step 1), and the compiled pieces
   are compared with the traced glue (runtime/graphs/compiled_parity.py).
4. The caches are copied into `kernels/<cache>/`; bundle.json lists every file's SHA-256, says which
   files a second build does not reproduce and why, and is signed with this installation's key
   (runtime/artifact/signing.py, created on first build, mode 0600).
5. compiler/artifact_writer.add_bundle moves the bundle into `targets/<key>/` and lists its files
   in manifest.json. An existing bundle of the same target is replaced only with --force.

Ranks. A tensor-parallel artifact (`hgc compile --tp N`) is built by N ranks, which `hgc build`
launches (runtime/dist/launcher.py; or torchrun, as for `hgc run`): each rank loads its part of the
weights, compiles the glue for its own device (Inductor's code names the device it was compiled
for: cuda:r on rank r), and starts up with the others, collectives included, into kernel caches of
its own (`rank<r>/` under the build folder); rank 0 then checks that every rank cut the same
pieces and writes one bundle of N ranks' pieces and kernels (compiler/splitops/bundle.py). An
artifact compiled with --no-weights starts up on random weights, as `--load-format dummy` does.

What it does not do: compile the checkpoint (`hgc compile`), or decide what may run from a bundle
at start-up (runtime/artifact/bundle.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

__all__ = ["cmd_build", "build_bundle", "check_buildable", "build_on_ranks", "add_build_arguments", "build_root",
           "build_lock", "small_m_for", "pdl_refusal", "norm_linear_refusal", "norm_rope_refusal",
           "sigmoid_gate_refusal", "BundleChoices",
           "add_bundle_choices"]


def small_m_for(docs, device: str) -> bool:
    """Whether the glue's plain projections compile as calls of hgc_glue::small_m_linear, whose CUDA
    kernel runs a decode step's few-row projections as one GEMV launch where that was measured
    faster than cuBLAS (docs/DESIGN.md, "Decode's projections as one GEMV launch").

    cuda only: the CPU has no such kernel, and the op there is F.linear behind one more call.
    Not for a batch-invariant artifact: it promises a row the same bits whatever shares its step,
    and the GEMV's config (hence its order of sums) follows the step's row bucket; such an
    artifact's products go through aten's mm to the fixed-order kernel (runtime/backends/kernels/
    matmul.py), which the op would step around."""
    import torch

    from runtime.artifact.loader import batch_invariant

    return torch.device(device).type == "cuda" and not batch_invariant(docs)


def pdl_refusal(device: str) -> str | None:
    """Why a bundle for `device` cannot be built with --pdl (programmatic dependent launch), or None.
    A CUDA launch attribute of Hopper and later (runtime/backends/kernels/pdl.py MIN_CAPABILITY);
    asked of the GPU here only where there is one (a compile for another machine's GPU is refused
    for its own reasons)."""
    import torch

    kind = torch.device(device).type
    if kind != "cuda":
        return f"programmatic dependent launch is a CUDA launch attribute; a {kind} bundle launches no kernel with it"
    if torch.cuda.is_available():
        from runtime.backends.kernels.pdl import MIN_CAPABILITY

        major, minor = torch.cuda.get_device_capability()
        if major < MIN_CAPABILITY:
            return (f"this GPU is sm{major}{minor}; programmatic dependent launch needs compute capability "
                    f"{MIN_CAPABILITY} or more")
    return None


def norm_linear_refusal(device: str, batch_invariant: bool = False) -> str | None:
    """Why a bundle for `device` cannot be built with --norm-linear (each input RMSNorm folded into
    the GEMV op call of the projection that reads it, each post-attention one into the output
    projection's before it), or None. It rewrites the GEMV op's calls, so
    it goes where the op does (`small_m_for`): cuda, not a batch-invariant artifact."""
    import torch

    kind = torch.device(device).type
    if kind != "cuda":
        return (f"the norms fold into the projections' GEMV, a CUDA kernel; a {kind} bundle's projections "
                f"stay aten's linear")
    if batch_invariant:
        return ("the artifact is batch-invariant: its projections stay aten's linear (a fixed order of sums), so there "
                "is no GEMV to fold a norm into")
    return None


def _one_kernel_refusal(device: str, what: str, of_it: str) -> str | None:
    """Why a bundle for `device` cannot run `what` as one of the glue ops' CUDA kernels (the ops'
    rewrites are for cuda bundles: a cpu one keeps Inductor's code), or None."""
    import torch

    kind = torch.device(device).type
    if kind != "cuda":
        return f"{what} as one CUDA kernel; a {kind} bundle keeps Inductor's code for {of_it}"
    return None


def norm_rope_refusal(device: str) -> str | None:
    """Why a bundle for `device` cannot be built with --norm-rope (a GQA layer's q / k norms and
    rotary as one call of hgc_glue::qk_norm_rope, whose kernel is CUDA's), or None."""
    return _one_kernel_refusal(device, "the q / k norms and rotary run", "them")


def sigmoid_gate_refusal(device: str) -> str | None:
    """Why a bundle for `device` cannot be built with --sigmoid-gate (an attention output's sigmoid
    gate as one call of hgc_glue::sigmoid_gate, whose kernel is CUDA's), or None."""
    return _one_kernel_refusal(device, "the attention output's gate runs", "it")


@dataclasses.dataclass(frozen=True)
class BundleChoices:
    """What a build may change of its bundle, each a flag of `hgc build` and `hgc compile`: one
    record from the flags to the build, the ranks' command lines and the rebuild hint. pdl is off
    until a GPU measures it faster; norm_linear, norm_rope and sigmoid_gate are None where no flag
    named them, which `resolved` turns into the device's default (DEVICE_DEFAULTS)."""

    pdl: bool = False  # --pdl: kernels launched with programmatic dependent launch
    norm_linear: bool | None = None  # --norm-linear / --no-norm-linear: norms folded into the GEMVs beside them
    norm_rope: bool | None = None  # --norm-rope / --no-norm-rope: a GQA layer's q / k norms and rotary as one kernel
    sigmoid_gate: bool | None = None  # --sigmoid-gate / --no-sigmoid-gate: an attention output's gate as one kernel

    @classmethod
    def of(cls, args) -> "BundleChoices":
        def read(name):
            value = getattr(args, name)
            return None if value is None else bool(value)
        return cls(**{f.name: read(f.name) for f in dataclasses.fields(cls)})

    def resolved(self, device: str, gemv_projections: bool) -> "BundleChoices":
        """Every choice decided: one no flag named takes the device's default, given whether the
        build's projections are calls of the GEMV op (`small_m_for`)."""
        import torch

        kind = torch.device(device).type
        return dataclasses.replace(self, **{name: on(kind, gemv_projections) for name, on in DEVICE_DEFAULTS.items()
                                            if getattr(self, name) is None})

    def argv(self) -> list[str]:
        """The flags that ask for these choices (a choice no flag named: none, so a rank resolves
        the same default)."""
        return [_flag(f.name) if value else "--no-" + _flag(f.name)[2:]
                for f in dataclasses.fields(self) if (value := getattr(self, f.name)) is not None
                and (value or f.name in DEVICE_DEFAULTS)]

    def refusal(self, device: str, batch_invariant: bool = False) -> str | None:
        """'--flag: why' for the first choice a bundle for `device` cannot take, or None."""
        whys = {"pdl": lambda: pdl_refusal(device), "norm_linear": lambda: norm_linear_refusal(device, batch_invariant),
                "norm_rope": lambda: norm_rope_refusal(device),
                "sigmoid_gate": lambda: sigmoid_gate_refusal(device)}
        for f in dataclasses.fields(self):
            if getattr(self, f.name) and (why := whys[f.name]()) is not None:
                return f"{_flag(f.name)}: {why}"
        return None


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


# The choices on by default where they apply, by device kind. norm_rope on cuda: measured faster on
# an H100, two bundles in one call (benchmarks/results/step_account_options_h100_2026-12-06.md, the
# glue rows): the compiled glue took 130.0 against 144.9 us of a 512-token step and 772.1 against
# 890.2 at 4096; 57.2 against 55.0 at decode 1 and 84.2 against 85.6 at decode 128. sigmoid_gate on
# cuda: the same A/B (benchmarks/results/step_account_sigmoid_gate_ab_h100_2026-12-06.md) gave the
# three gates 105.9 against Inductor's 124.8 us of a 4096-token step, 12.9 against 18.5 at 512, 5.0
# against 3.5 at decode 1 and 7.5 against 6.6 at decode 128; and its one tile takes away Inductor's
# choice between two tiles about twice apart (242 us at 4096 in other builds of the same code).
# norm_linear wherever the projections are the GEMV op's calls (`small_m_for`): the same kind
# of A/B with the in-experts router and the GDN split in one launch
# (benchmarks/results/step_account_in_experts_folds_ab_h100_2026-12-07.md) gave the folded GEMVs 317
# us of a batch-1 step against 289 plus 41 of norms, 21 launches fewer, and moved the other steps by
# less than their noise (the folded norms 450.5 against Inductor's 478.7 us at 4096 tokens).
DEVICE_DEFAULTS = {"norm_linear": lambda kind, gemv_projections: gemv_projections,
                   "norm_rope": lambda kind, gemv_projections: kind == "cuda",
                   "sigmoid_gate": lambda kind, gemv_projections: kind == "cuda"}


# Each choice's flag help, for `hgc build` (what it does) and `hgc compile` (which builds with it)
_CHOICE_HELP = {
    "pdl": "cuda, compute capability 9 or more: launch the decode step's Triton kernels (ours and Inductor's) "
           "with programmatic dependent launch, each starting while the one before it drains. Off by default: "
           "not yet measured faster (docs/DESIGN.md, \"Programmatic dependent launch\")",
    "norm_linear": "cuda, with the GEMV projections (not a batch-invariant artifact): fold each layer's input "
                   "RMSNorm, and the residual add before it, into the GEMV of the projection that reads it, and its "
                   "post-attention RMSNorm, with the residual add, into the GEMV of the output projection before "
                   "it: two launches fewer per layer at decode. On by default where it applies (measured "
                   "faster at batch-1 decode, the same elsewhere); --no-norm-linear keeps the norms apart "
                   "(docs/DESIGN.md, \"Norms folded into the GEMVs\")",
    "norm_rope": "cuda: run each GQA layer's q and k head RMSNorms and their rotary as one kernel that reads each "
                 "row once (hgc_glue::qk_norm_rope) instead of Inductor's code for them. On by default for cuda "
                 "(measured faster); --no-norm-rope keeps Inductor's code (docs/DESIGN.md, \"A GQA layer's q / k "
                 "norms and rotary as one kernel\")",
    "sigmoid_gate": "cuda: run each attention output's sigmoid gate (x * sigmoid(gate), gate beside q in the "
                    "projection's output) as one kernel of a fixed tile (hgc_glue::sigmoid_gate) instead of "
                    "Inductor's, whose tile the build chooses by timing and which took one of two tiles about "
                    "twice apart at 4096 tokens, build by build. On by default for cuda (measured faster at "
                    "extend, a microsecond slower at decode); --no-sigmoid-gate keeps Inductor's code "
                    "(docs/DESIGN.md, \"An attention output's gate as one kernel\")",
}


def add_bundle_choices(p, compile_command: bool = False) -> None:
    """The BundleChoices flags on a parser: `hgc build`'s, or `hgc compile`'s (which builds with them)."""
    for name, text in _CHOICE_HELP.items():
        # a choice with a device default takes --no-FLAG too; its value is None where neither is given
        action = argparse.BooleanOptionalAction if name in DEVICE_DEFAULTS else "store_true"
        p.add_argument(_flag(name), action=action, default=None if name in DEVICE_DEFAULTS else False,
                       help=f"build the target bundle with `hgc build {_flag(name)}`: {text}" if compile_command
                       else text)


def build_root(key: str) -> Path:
    if os.environ.get("HGC_HOME"):
        return Path(os.environ["HGC_HOME"]) / "build" / key
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "hgc" / "build" / key


def _kernel_seed():
    """hgc/kernel_seed.py, on a cuda build only: it imports triton."""
    from hgc import kernel_seed
    return kernel_seed


def _flashinfer_seed():
    """hgc/flashinfer_seed.py, on a cuda build only (kernel_seed's switch and bound)."""
    from hgc import flashinfer_seed
    return flashinfer_seed


def _copy_caches(caches: dict[str, Path], staged: Path) -> int:
    """Step 4's copy: what each cache gained during the build, under kernels/<cache>/."""
    from compiler.inductor_pieces import inductor_cache_files
    from compiler.splitops.bundle import KERNELS

    count = 0
    for name, folder in caches.items():
        if name == "inductor":
            files = inductor_cache_files(folder)
        elif name == "flashinfer":  # the built modules; their objects and generated sources are not loaded
            files = [p for p in folder.rglob("*.so") if "cached_ops" in p.parts]
        else:
            files = [p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock")]
        for p in sorted(files):
            dest = staged / KERNELS / name / p.relative_to(folder)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest)
            count += 1
    return count


@contextlib.contextmanager
def build_lock(work: Path, log=lambda line: None):
    """Hold the build folder `work` for one build at a time (an exclusive lock on WORK.lock beside it).

    Every build empties the folder before it starts, and the folder cannot move (compiled kernels
    record the path they were built at), so two builds of the same target at once would delete
    and overwrite each other's kernels and write a bundle whose files do not match its hashes. A
    second build waits, and says so."""
    import fcntl

    work.parent.mkdir(parents=True, exist_ok=True)
    with open(work.parent / f"{work.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another hgc build that uses {work}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_bundle(artifact, device: str, *, force: bool = False, slots: int | None = None,
                 max_model_len: int | None = None, log=lambda line: None, group=None,
                 choices: BundleChoices = BundleChoices()) -> dict | None:
    """Steps 1-5 of the module docstring; returns the bundle's document (signed). A tensor-parallel
    artifact is built by its ranks together (`group`: this process's runtime.dist.distributed.RankGroup;
    "Ranks" in the module docstring): rank 0 returns the document, the others None. choices: what
    the bundle adds beyond the defaults (`BundleChoices`; its `refusal` says where it cannot)."""
    import torch

    from compiler.artifact_writer import add_bundle, hgc_version
    from compiler.inductor_pieces import compile_glue
    from compiler.splitops.artifact import PROGRAM_FILES, dump_json, sha256_file
    from compiler.splitops.bundle import (BUNDLE, CACHE_ENV, bundle_dir, bundle_doc, cache_env, pin_triton_ptxas,
                                          signed_payload, target_facts, target_key)
    from runtime.artifact.bundle import CompiledOptions, load_built
    from runtime.artifact.loader import batch_invariant, load_artifact, read_artifact
    from runtime.assembly import EngineOptions, engine_for_artifact
    from runtime.artifact.signing import sign, signing_key

    artifact = Path(artifact)
    docs = read_artifact(artifact)
    rank, tp = (group.rank, group.world_size) if group is not None else (0, 1)
    if docs.tp != tp:
        raise ValueError(f"{artifact}: compiled for --tp {docs.tp}; its bundle is built by {docs.tp} ranks together, "
                         f"which `hgc build` launches")
    check_buildable(docs, device)
    if (why := choices.refusal(device, batch_invariant(docs))) is not None:
        raise ValueError(why)
    choices = choices.resolved(device, small_m_for(docs, device))
    facts = target_facts(device)
    key = target_key(facts)
    if (artifact / bundle_dir(key)).exists() and not force:
        raise FileExistsError(f"{artifact / bundle_dir(key)} exists; pass --force to rebuild it")
    if "flashinfer.jit.env" in sys.modules:
        raise ValueError("flashinfer was imported before the build set its module cache; run `hgc build` in a "
                         "process of its own")
    # A config-only artifact (--no-weights) starts up once on random weights: the pieces and kernels
    # depend on shapes and dtypes only, and parity compares two runs of the same weights.
    load_format = "dummy" if docs.manifest["weights"].get("mode") == "none" else "auto"
    log = log if rank == 0 else (lambda line: None)  # rank 0 speaks for every rank (they build alike)
    on_cuda = torch.device(device).type == "cuda"
    work = build_root(key)
    mine = work / f"rank{rank}" if tp > 1 else work  # this rank's kernel caches
    staged = work / "bundle"
    out = staged / f"rank{rank}" if tp > 1 else staged  # this rank's pieces and kernels in the bundle
    # The folder is emptied first and its path is fixed: one build at a time (rank 0 holds the lock
    # for the ranks, which wait at the barrier until it has emptied the folder).
    with build_lock(work, log) if rank == 0 else contextlib.nullcontext():
        if rank == 0:
            shutil.rmtree(work, ignore_errors=True)
        if group is not None:
            group.barrier()
        caches = {name: mine / name for name in CACHE_ENV}
        for folder in caches.values():
            folder.mkdir(parents=True)
        out.mkdir(parents=True, exist_ok=True)
        log(f"building {key} for {artifact} (kernel caches under {work}"
            + (f"; {tp} ranks, each compiling for its own device" if tp > 1 else "")
            + (", random weights: the artifact has none" if load_format == "dummy" else "") + ")")
        start = time.perf_counter()
        dev = group.device if group is not None else device
        # cuda: Triton's lookups read through to the kernels earlier builds kept (hgc/kernel_seed.py;
        # a cpu build compiles no Triton kernel, and the CPU path never imports triton)
        seeds = _kernel_seed().seed_folder(work) / mine.relative_to(work) if on_cuda else None
        seed = seeds / "triton" if seeds else None
        seeded = _kernel_seed().kept(seed) if seed else set()
        with cache_env(caches, _kernel_seed().settings(seed) if seed else None):
            pin_triton_ptxas(torch.device(device).type)  # the run does the same (runtime/artifact/bundle.py)
            # and FlashInfer's modules load from those earlier builds kept (hgc/flashinfer_seed.py)
            modules = _flashinfer_seed().use(seeds / "flashinfer") if seeds else None
            art = load_artifact(artifact, dev, compiled=CompiledOptions(enabled=False), rank=rank, tp=tp,
                                load_format=load_format)
            small_m = small_m_for(docs, device)
            log("glue projections: " + ("calls of hgc_glue::small_m_linear (one GEMV launch for a few rows)" if small_m
                                        else f"aten's linear ({'batch-invariant' if on_cuda else device})"))
            if choices.pdl:
                log("programmatic dependent launch: on (Inductor's kernels and the backends' decode kernels)")
            if choices.norm_linear:
                log("norms: folded into the GEMVs beside them (hgc_glue::add_rms_norm_linear, linear_add_rms_norm)")
            if choices.norm_rope:
                log("q / k norms and rotary: one kernel per GQA layer (hgc_glue::qk_norm_rope)")
            if choices.sigmoid_gate:
                log("attention output gates: one kernel each (hgc_glue::sigmoid_gate)")
            records, pieces = compile_glue({p: ep.graph_module for p, ep in art.programs.items()}, art.split_plans,
                                           dev, out, caches["inductor"], log=log, small_m=small_m,
                                           **dataclasses.asdict(choices))
            files = {name: sha256_file(out / name) for name in pieces}
            sources = {p: docs.manifest["files"][PROGRAM_FILES[p]] for p in art.programs}
            # load_built switches PDL as the document says, before the start-up below captures
            doc = bundle_doc(key, facts, records, sources, pieces, files, time.perf_counter() - start, hgc_version(),
                             small_m=small_m, **dataclasses.asdict(choices))
            art.compiled = load_built(doc, out, caches)
            buckets = docs.manifest["buckets"]
            options = EngineOptions(slots=slots or (max(buckets["decode_batch_sizes"]) if on_cuda else 2),
                                    token_budget=max(buckets["extend_token_counts"]) if on_cuda else 64,
                                    prefix_cache=False)
            model_len = max_model_len or min(4096, int(docs.manifest["config"].get("max_position_embeddings") or 4096))
            log("start-up with the compiled pieces" + (" (capture and parity of every bucket)" if on_cuda else ""))
            engine = engine_for_artifact(art, options, model_len, device=dev, log=log)
            del engine
            if on_cuda:
                torch.cuda.synchronize()
            taken = _flashinfer_seed().take(*modules) if modules else []  # into the build's folder: the bundle's
        copied = _copy_caches(caches, out)
        if seed:
            log(_kernel_seed().keep_and_say(caches["triton"], seed, seeded))
        if modules:
            log(_flashinfer_seed().keep_and_say(*modules, taken))
        parity = art.compiled.report()["parity"]
        if group is not None:  # what rank 0 checks and records of the others, once they are done
            (mine / "rank.json").write_text(json.dumps({"programs": records, "parity": parity}))
            group.barrier()
        if rank > 0:
            return None
        by_rank = [json.loads((work / f"rank{r}" / "rank.json").read_text()) for r in range(tp)] if tp > 1 else []
        for r, other in enumerate(by_rank):
            if other["programs"] != json.loads(json.dumps(records)):  # one program: the same pieces on every rank
                raise ValueError(f"{artifact}: rank {r} cut its glue into other pieces than rank 0 did; the ranks "
                                 f"of one artifact must run one program")
        files = {p.relative_to(staged).as_posix(): sha256_file(p) for p in sorted(staged.rglob("*")) if p.is_file()}
        doc = bundle_doc(key, facts, records, sources, pieces, files, time.perf_counter() - start, hgc_version(),
                         ranks=tp, small_m=small_m, **dataclasses.asdict(choices))
        doc["parity"] = parity
        if by_rank:  # every rank's start-up compared its own pieces with its traced glue
            doc["parity_per_rank"] = [other["parity"] for other in by_rank]
        doc["signature"] = sign(signed_payload(doc), signing_key(create=True))
        (staged / BUNDLE).write_bytes(dump_json(doc))
        add_bundle(artifact, key, staged, facts, force=force)
        log(f"wrote {artifact / bundle_dir(key)}: {len(pieces)} compiled piece(s) for "
            f"{sum(len(r) for r in records.values())} glue segment(s)" + (f" on each of {tp} ranks" if tp > 1 else "")
            + f", {copied} kernel file(s){' per rank' if tp > 1 else ''}, in {time.perf_counter() - start:.1f} s")
        return doc


def check_buildable(docs, device: str) -> None:
    """The refusals that need nothing loaded: checked before a tensor-parallel build launches its ranks."""
    import torch

    artifact = docs.path
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"hgc build {artifact} --device cuda: this machine has no CUDA device; build on the GPU "
                         f"machine the artifact will run on")
    if device == "cuda" and torch.cuda.device_count() < docs.tp:
        raise ValueError(f"hgc build {artifact} --device cuda: compiled for --tp {docs.tp}, built by {docs.tp} ranks "
                         f"with a GPU each; this machine has {torch.cuda.device_count()}")
    if docs.manifest["compile"].get("overlap"):
        raise ValueError(f"{artifact}: compiled with --overlap; compiled pieces cannot be split across its two "
                         f"streams yet (runtime/graphs/side_stream.py): it runs its traced glue, or recompile without "
                         f"--overlap")
    target = docs.routing.target
    if torch.device(target).type != torch.device(device).type:
        raise ValueError(f"{artifact}: compiled for target {target!r} (its backends run there); build with "
                         f"--device {torch.device(target).type}")


def build_on_ranks(artifact, device: str, tp: int, force: bool = False,
                   choices: BundleChoices = BundleChoices()) -> int:
    """`hgc build` of a tensor-parallel artifact from a process that is not one of its ranks: launch
    them (runtime/dist/launcher.py), each running this command; their exit status."""
    from runtime.dist.launcher import launch

    argv = [sys.executable, "-m", "hgc", "build", str(artifact), "--device", device,
            *(["--force"] if force else []), *choices.argv()]
    return launch(tp, argv, "hgc build")


def cmd_build(args) -> int:
    """Its refusals (CompileError, LoadError, ValueError) reach the CLI's one failure scheme. A
    tensor-parallel artifact: this process launches its ranks (or is one of them)."""
    import torch

    from hgc.errors import UsageError
    from runtime.dist.distributed import join, launched_rank
    from runtime.artifact.loader import read_artifact

    log = lambda line: print(f"hgc build: {line}", file=sys.stderr, flush=True)  # noqa: E731
    choices = BundleChoices.of(args)
    if (why := choices.refusal(args.device)) is not None:
        raise UsageError(why)  # before anything is read: a flag the device cannot take
    docs = read_artifact(args.artifact, verify_hashes=False)  # the build's own read checks the hashes
    tp, group = docs.tp, None
    if tp > 1:
        if not launched_rank():
            check_buildable(docs, args.device)  # one line here, not one per rank
            return build_on_ranks(args.artifact, args.device, tp, force=args.force, choices=choices)
        group = join(tp, torch.device(args.device).type, label="hgc build")
        args.rank = group.rank
    try:
        build_bundle(args.artifact, args.device, force=args.force, slots=args.slots,
                     max_model_len=args.max_model_len, log=log, group=group, choices=choices)
        if group is not None and not group.leader:
            group.wait_for_stop()  # rank 0 is writing the bundle; it sends STOP when it is done
    finally:
        if group is not None:
            group.close()
    return 0


def add_build_arguments(subparsers) -> None:
    p = subparsers.add_parser(
        "build", help="add this installation's target bundle (compiled pieces, kernels) to an artifact",
        description="Compile an artifact's glue with Inductor for this machine's device and torch build, start it "
                    "up once (every bucket captured and checked on cuda), and write what the kernel caches gained, "
                    "signed with this installation's key, into targets/<key>/ of the artifact. On cuda, the Triton "
                    "kernels and FlashInfer modules an earlier build of the same target made are taken as the build "
                    "asks for them (kept in ~/.cache/hgc/build/<key>.seed/, or $HGC_HOME/build/<key>.seed/; "
                    "HGC_FRESH_KERNELS=1 builds every one anew).",
        epilog="examples:\n  hgc build artifacts/tiny --device cpu\n  hgc build artifacts/bench --device cuda --force\n"
               "  hgc build artifacts/big-tp2 --device cuda    # compiled with --tp 2: launches 2 ranks, one GPU each")
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--device", required=True, choices=("cpu", "cuda"), help="the device the bundle is built for "
                                                                            "(this machine's)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle of this target")
    add_bundle_choices(p)
    p.add_argument("--slots", type=int, default=None,
                   help="cuda: state slots of the start-up run (default: the largest decode bucket, so every bucket "
                        "is captured)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest request of the start-up run (default: "
                                                                   "min(4096, the model's positions))")
    p.set_defaults(func=cmd_build)
