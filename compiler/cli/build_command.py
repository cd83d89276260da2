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
   take turns (`build_lock`: a second one waits for the first and says so).
2. The portable artifact is loaded (its own checks) and each program's glue is compiled
   (compiler/inductor_pieces.py), one piece per distinct structure.
3. Start-up runs as `hgc run` / `hgc serve` would, with the fresh pieces: on cuda every recorded
   bucket is captured and checked (which builds the FlashInfer modules and Triton kernels of the
   captured shapes and tunes FLA's kernels, into the caches of step 1), and the compiled pieces
   are compared with the traced glue (runtime/compiled_parity.py).
4. The caches are copied into `kernels/<cache>/`; bundle.json lists every file's SHA-256, says which
   files a second build does not reproduce and why, and is signed with this installation's key
   (runtime/signing.py, created on first build, mode 0600).
5. compiler/artifact_writer.add_bundle moves the bundle into `targets/<key>/` and lists its files
   in manifest.json. An existing bundle of the same target is replaced only with --force.

What it does not do: compile the checkpoint (`hgc compile`), or decide what may run from a bundle
at start-up (runtime/bundle.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

__all__ = ["cmd_build", "build_bundle", "add_build_arguments", "build_root", "build_lock"]


def build_root(key: str) -> Path:
    if os.environ.get("HGC_HOME"):
        return Path(os.environ["HGC_HOME"]) / "build" / key
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "hgc" / "build" / key


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
                 max_model_len: int | None = None, log=lambda line: None) -> dict:
    """Steps 1-5 of the module docstring; returns the bundle's document (signed)."""
    import torch

    from compiler.artifact_writer import add_bundle, hgc_version
    from compiler.inductor_pieces import compile_glue
    from compiler.splitops.artifact import PROGRAM_FILES, dump_json, sha256_file
    from compiler.splitops.bundle import (BUNDLE, CACHE_ENV, bundle_dir, bundle_doc, cache_env, pin_triton_ptxas,
                                          signed_payload, target_facts, target_key)
    from runtime.bundle import CompiledOptions, load_built
    from runtime.loader import load_artifact, read_artifact
    from runtime.server.model import EngineOptions, engine_for_artifact
    from runtime.signing import sign, signing_key

    artifact = Path(artifact)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"hgc build {artifact} --device cuda: this machine has no CUDA device; build on the GPU "
                         f"machine the artifact will run on")
    docs = read_artifact(artifact)
    if docs.tp > 1:
        raise ValueError(f"{artifact}: compiled for --tp {docs.tp}; compiled pieces are not built for a "
                         f"tensor-parallel artifact yet (none has been checked on ranks): its ranks run the traced glue")
    if docs.manifest["compile"].get("overlap"):
        raise ValueError(f"{artifact}: compiled with --overlap; compiled pieces cannot be split across its two "
                         f"streams yet (runtime/side_stream.py): it runs its traced glue, or recompile without --overlap")
    target = docs.routing.target
    if torch.device(target).type != torch.device(device).type:
        raise ValueError(f"{artifact}: compiled for target {target!r} (its backends run there); build with "
                         f"--device {torch.device(target).type}")
    facts = target_facts(device)
    key = target_key(facts)
    if (artifact / bundle_dir(key)).exists() and not force:
        raise FileExistsError(f"{artifact / bundle_dir(key)} exists; pass --force to rebuild it")
    if "flashinfer.jit.env" in sys.modules:
        raise ValueError("flashinfer was imported before the build set its module cache; run `hgc build` in a "
                         "process of its own")
    work = build_root(key)
    with build_lock(work, log):  # the folder is emptied first and its path is fixed: one build at a time
        shutil.rmtree(work, ignore_errors=True)
        caches = {name: work / name for name in CACHE_ENV}
        for folder in caches.values():
            folder.mkdir(parents=True)
        staged = work / "bundle"
        log(f"building {key} for {artifact} (kernel caches under {work})")
        start = time.perf_counter()
        with cache_env(caches):
            pin_triton_ptxas(torch.device(device).type)  # the run does the same (runtime/bundle.py)
            art = load_artifact(artifact, device, compiled=CompiledOptions(enabled=False))
            records, pieces = compile_glue({p: ep.graph_module for p, ep in art.programs.items()}, art.split_plans,
                                           device, staged, caches["inductor"], log=log)
            files = {name: sha256_file(staged / name) for name in pieces}
            sources = {p: docs.manifest["files"][PROGRAM_FILES[p]] for p in art.programs}
            doc = bundle_doc(key, facts, records, sources, pieces, files, time.perf_counter() - start, hgc_version())
            art.compiled = load_built(doc, staged, caches)
            buckets = docs.manifest["buckets"]
            on_gpu = torch.device(device).type == "cuda"
            options = EngineOptions(slots=slots or (max(buckets["decode_batch_sizes"]) if on_gpu else 2),
                                    token_budget=max(buckets["extend_token_counts"]) if on_gpu else 64,
                                    prefix_cache=False)
            model_len = max_model_len or min(4096, int(docs.manifest["config"].get("max_position_embeddings") or 4096))
            log("start-up with the compiled pieces" + (" (capture and parity of every bucket)" if on_gpu else ""))
            engine = engine_for_artifact(art, options, model_len, device=device, log=log)
            del engine
            if on_gpu:
                torch.cuda.synchronize()
        copied = _copy_caches(caches, staged)
        files = {p.relative_to(staged).as_posix(): sha256_file(p) for p in sorted(staged.rglob("*")) if p.is_file()}
        doc = bundle_doc(key, facts, records, sources, pieces, files, time.perf_counter() - start, hgc_version())
        doc["parity"] = art.compiled.report()["parity"]
        doc["signature"] = sign(signed_payload(doc), signing_key(create=True))
        (staged / BUNDLE).write_bytes(dump_json(doc))
        add_bundle(artifact, key, staged, facts, force=force)
        log(f"wrote {artifact / bundle_dir(key)}: {len(pieces)} compiled piece(s) for "
            f"{sum(len(r) for r in records.values())} glue segment(s), {copied} kernel file(s), in "
            f"{time.perf_counter() - start:.1f} s")
        return doc


def cmd_build(args) -> int:
    """Its refusals (CompileError, LoadError, ValueError) reach the CLI's one failure scheme."""
    log = lambda line: print(f"hgc build: {line}", file=sys.stderr, flush=True)  # noqa: E731
    build_bundle(args.artifact, args.device, force=args.force, slots=args.slots, max_model_len=args.max_model_len,
                 log=log)
    return 0


def add_build_arguments(subparsers) -> None:
    p = subparsers.add_parser(
        "build", help="add this installation's target bundle (compiled pieces, kernels) to an artifact",
        description="Compile an artifact's glue with Inductor for this machine's device and torch build, start it "
                    "up once (every bucket captured and checked on cuda), and write what the kernel caches gained, "
                    "signed with this installation's key, into targets/<key>/ of the artifact.",
        epilog="examples:\n  hgc build artifacts/tiny --device cpu\n  hgc build artifacts/bench --device cuda --force")
    p.add_argument("artifact", help="artifact folder written by `hgc compile`")
    p.add_argument("--device", required=True, choices=("cpu", "cuda"), help="the device the bundle is built for "
                                                                            "(this machine's)")
    p.add_argument("--force", action="store_true", help="replace an existing bundle of this target")
    p.add_argument("--slots", type=int, default=None,
                   help="cuda: state slots of the start-up run (default: the largest decode bucket, so every bucket "
                        "is captured)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest request of the start-up run (default: "
                                                                   "min(4096, the model's positions))")
    p.set_defaults(func=cmd_build)
