"""Open an artifact's target bundle: check it, ask for consent, load its compiled pieces, build nothing.

    bundle = open_bundle(docs, "cpu", CompiledOptions())   # None: the artifact holds no bundle
    glue = bundle.glue("main")                              # runtime/artifact/compiled_glue.py installs it

The portable part of an artifact (graph, weights, plans) loads without running code from it; a
bundle (compiler/splitops/bundle.py) is code, so it gets its own steps:

1. select: manifest.json "targets" lists the bundles. None at all: the artifact runs its traced
   glue as before. Bundles, but none for this installation's target: refused, naming both and the
   command that rebuilds (`--no-compiled` runs the traced glue instead).
2. check: bundle.json (hash checked on the bytes read, like every file the loader reads) was built
   for exactly this target (torch build, Python, CPU instruction set or GPU architecture, CUDA,
   Triton, FlashInfer), with our Inductor settings, from the programs this artifact holds (their
   .pt2 hashes), for the artifact's rank count (a tensor-parallel bundle holds each rank's pieces
   and kernels; a rank materializes and loads only its own), and lists exactly the bundle files
   manifest.json lists (whose hashes read_artifact checked: a flipped byte is refused like
   tampered weights).
3. consent: the signature verifies under this installation's key (runtime/artifact/signing.py), or the user
   passed --trust-compiled. Otherwise refused, naming the executable files, how to trust them and
   how to rebuild them here.
4. materialize: the kernel caches are copied into a private folder, each file's SHA-256 checked on
   the bytes copied, so what runs is what was checked (the artifact stays read-only). Triton's group
   files, which name a kernel's files by absolute path (the build folder's), are written there
   naming the copy's (`_relocated_group`).
5. load: every piece with `CompiledArtifact.load` under the Inductor settings bundle.json says it
   was built with, Inductor's cache pointed at the copy, inside a `KernelWatch`: a kernel the bundle
   lacks would be built now, which is an error naming it unless --allow-kernel-builds. The glue ops
   a piece may call are defined first (compiler/splitops/glue_ops.py), and on cuda their kernels
   registered (runtime/backends/glue_kernels.py) and programmatic dependent launch switched as the
   bundle says (runtime/backends/kernels/pdl.py). On cuda the process's kernel caches stay pointed
   at the copy, and `watch()` around capture and parity names any kernel built or tuned there
   (runtime/assembly.py wraps start-up in it).

What it does not do: replace the traced glue (runtime/artifact/compiled_glue.py), compare compiled with
traced (runtime/graphs/compiled_parity.py), or build bundles (hgc/build_command.py).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from compiler.splitops import glue_ops  # noqa: F401 (defines the hgc_glue ops a piece may call)
from compiler.splitops.artifact import PROGRAM_FILES, ArtifactFormatError
from compiler.splitops.bundle import (BUNDLE, CACHE_ENV, CACHE_SETTINGS, KERNELS, bundle_dir, bundle_pdl, cache_env,
                                      describe_target, executable_summary, facts_differences, inductor_config,
                                      parse_bundle_doc, pin_triton_ptxas, rank_dir, signed_payload,
                                      target_facts, target_key)
from runtime.artifact.docs import ArtifactDocs, LoadError, check_hash
from runtime.artifact.signing import SigningKeyError, key_id, key_path, signing_key, verify

__all__ = ["CompiledOptions", "BundleError", "KernelBuildError", "CompiledBundle", "KernelWatch", "open_bundle",
           "bundles_of", "load_built"]


class BundleError(LoadError):
    pass


class KernelBuildError(BundleError):
    """A kernel the bundle lacks, found being built (or tuned) at start-up."""


@dataclasses.dataclass(frozen=True)
class CompiledOptions:
    """What the user allows: `hgc run` / `hgc serve` flags."""

    enabled: bool = True  # --no-compiled: ignore bundles, run the traced glue
    trust: bool = False  # --trust-compiled: run a bundle this installation did not sign
    allow_builds: bool = False  # --allow-kernel-builds: build what the bundle lacks at start-up


def bundles_of(manifest: dict) -> dict[str, dict]:
    """manifest.json "targets": bundle key -> {"bundle": path of its bundle.json, "facts": ...}."""
    targets = manifest.get("targets") or {}
    if not isinstance(targets, dict):
        raise LoadError("manifest.json: field 'targets' must map bundle keys to their bundle.json")
    return targets


def _rebuild(docs: ArtifactDocs, device: str, force: bool = False) -> str:
    return f"`hgc build {docs.path} --device {device}{' --force' if force else ''}`"


# -- kernel builds --------------------------------------------------------------------------------

# Triton's cache files a kernel's files under one folder per cache key, with a group file,
# __grp__<kernel>.json, that lists them: {"child_paths": {file name: absolute path}}. A lookup takes
# the kernel from those paths if every one exists, and builds it again (rewriting the group) if not.
TRITON_GROUP = "__grp__"


# What a new file in a cache means: a kernel built (or tuned) now, named by its file.
_BUILT = {"inductor": lambda p: p.suffix in (".so", ".cubin", ".hsaco", ".best_config"),
          "triton": lambda p: p.name.startswith(TRITON_GROUP),
          "flashinfer": lambda p: p.suffix == ".so"}


def _in_parallel(fn, items: list) -> list:
    """fn over items on a few threads: file reads and SHA-256 release the GIL, and a bundle holds
    a thousand kernel files or more (one after another they were seconds of every start-up)."""
    if len(items) < 16:
        return [fn(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="hgc-bundle") as pool:
        return list(pool.map(fn, items))


def _snapshot(folders: dict[str, Path]) -> dict[str, str]:
    """cache/file -> SHA-256 of its bytes. By content, not time: loading a piece writes the tuning
    choices it recorded at compile time again, the same bytes, which is no build."""
    found = [(f"{name}/{p.relative_to(folder)}", p) for name, folder in folders.items()
             for p in (Path(folder).rglob("*") if Path(folder).is_dir() else ()) if p.is_file() and _BUILT[name](p)]
    digests = _in_parallel(lambda item: hashlib.sha256(item[1].read_bytes()).hexdigest(), found)
    return {name: digest for (name, _), digest in zip(found, digests)}


def _inductor_compiles(counters) -> int:
    return counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"]


class KernelWatch:
    """Builds during a block: C++ kernels Inductor would compile (refused as they start, unless
    allowed) and any kernel a cache gains (Triton, FlashInfer, Inductor tuning), found by comparing
    the caches before and after. `builds` counts them; `inductor_compiles` counts graphs Inductor
    compiled instead of finding them in a piece: its FX graph cache's misses, and its bypasses (a
    graph the cache cannot key is compiled without a miss being counted)."""

    def __init__(self, folders: dict[str, Path], allow: bool, remedy: str):
        self.folders, self.allow, self.remedy = folders, allow, remedy
        self.builds: list[str] = []
        self.inductor_compiles = 0
        self.snapshot_seconds = 0.0  # reading the caches before and after: the watch's own cost

    def _refuse(self, what: str, rebuilt: bool = False):
        how = "of the bundle was rebuilt or tuned again" if rebuilt else "is not in the bundle and would be built"
        return KernelBuildError(f"kernel {what} {how} at start-up; {self.remedy}, or pass --allow-kernel-builds to "
                                f"build it now")

    def __enter__(self):
        # Inductor has no switch that forbids compiling; every C++ build goes through CppBuilder.build,
        # so that one entry is wrapped for the block (start-up, single-threaded) and put back after.
        from torch._dynamo.utils import counters
        from torch._inductor.cpp_builder import CppBuilder

        began = time.perf_counter()
        self._before = _snapshot(self.folders)
        self.snapshot_seconds += time.perf_counter() - began
        self._compiles = _inductor_compiles(counters)
        self._build = CppBuilder.build
        watch = self

        def build(builder, *args, **kwargs):
            name = Path(builder.get_target_file_path()).name
            if not watch.allow:
                raise watch._refuse(name)
            watch.builds.append(name)
            return watch._build(builder, *args, **kwargs)

        CppBuilder.build = build
        return self

    def __exit__(self, kind, error, tb):
        from torch._dynamo.utils import counters
        from torch._inductor.cpp_builder import CppBuilder

        CppBuilder.build = self._build
        self.inductor_compiles += _inductor_compiles(counters) - self._compiles
        if kind is None:
            began = time.perf_counter()
            after = _snapshot(self.folders)
            self.snapshot_seconds += time.perf_counter() - began
            new = sorted(f for f, sha in after.items() if self._before.get(f) != sha)
            new = [f for f in new if Path(f).name not in self.builds]
            if new and not self.allow:
                raise self._refuse(", ".join(new[:3]) + (f" (and {len(new) - 3} more)" if len(new) > 3 else ""),
                                   rebuilt=new[0] in self._before)
            self.builds += new
        return False


class ServingWatch:
    """After start-up: Triton kernels built while serving, i.e. a step needed a kernel variant the
    bundle lacks (one that no start-up step launched: docs/DESIGN.md "Why a run finds every kernel
    the build made"). Triton files each kernel in a folder of its own at the top of its cache, so
    one listing of that folder finds it. `check()` looks at most once per `interval_s`, names each
    new kernel once through `log` (the build already happened: a warning with the remedy, not a
    refusal of the request) and keeps it in `builds`."""

    def __init__(self, folder: Path, remedy: str, log: Callable[[str], None], interval_s: float = 1.0):
        self.folder, self.remedy, self.log, self.interval_s = Path(folder), remedy, log, interval_s
        self.builds: list[str] = []
        self._seen = self._entries()
        self._next = time.monotonic() + interval_s

    def _entries(self) -> set[str]:
        try:
            return {entry.name for entry in os.scandir(self.folder)}
        except FileNotFoundError:
            return set()

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        entries = self._entries()
        new = sorted(entries - self._seen)
        self._seen = entries
        for folder in new:
            names = sorted(p.name for p in (self.folder / folder).glob("*.json") if not p.name.startswith(TRITON_GROUP))
            self.builds.append(f"triton/{folder}")
            self.log(f"warning: Triton built kernel {', '.join(names) or folder} while serving: the bundle lacks "
                     f"it, so this step waited for a build; {self.remedy}")


# -- the bundle ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class CompiledBundle:
    """An opened bundle: its pieces loaded, its caches materialized."""

    key: str
    facts: dict
    doc: dict
    pieces: dict  # piece file -> callable(*inputs) -> outputs
    caches: dict[str, Path]  # CACHE_ENV name -> the private copy
    options: CompiledOptions
    remedy: str
    load_seconds: float = 0.0
    load_phases: dict = dataclasses.field(default_factory=dict)  # seconds per step of open_bundle
    watches: list = dataclasses.field(default_factory=list)
    parity: list = dataclasses.field(default_factory=list)  # start-up reports: compiled against traced glue
    # A build's own start-up (load_built): its kernels choose their launch configurations now, for
    # the bundle; a run loads those choices (GraphRunner's `tuning_step`)
    building: bool = False

    def glue(self, program: str):
        from runtime.artifact.compiled_glue import CompiledGlue
        if program not in self.doc["programs"]:
            raise BundleError(f"bundle {self.key} holds no compiled glue for the {program} program; {self.remedy}")
        return CompiledGlue(program, self.doc["programs"][program], self.pieces, self.key)

    def watch(self) -> KernelWatch:
        """A KernelWatch over this bundle's caches (start-up: capture and parity)."""
        w = KernelWatch(self.caches, self.options.allow_builds, self.remedy)
        self.watches.append(w)
        return w

    def serving_watch(self, log: Callable[[str], None]) -> ServingWatch:
        """A ServingWatch over this bundle's Triton cache, from now on (after start-up)."""
        return ServingWatch(self.caches["triton"], self.remedy, log)

    def report(self) -> dict:
        """What `hgc run --json` says about it: kernels built at start-up must be 0."""
        worst = [o["rel_err"] for r in self.parity for o in r["ops"]]
        return {"target": self.key, "pieces": len(self.pieces), "load_seconds": round(self.load_seconds, 2),
                "load_phases_s": self.load_phases,
                "watch_seconds": round(sum(w.snapshot_seconds for w in self.watches), 3),
                "kernel_builds": sum(len(w.builds) for w in self.watches),
                "built": [b for w in self.watches for b in w.builds],  # what --allow-kernel-builds let build
                "inductor_compiles": sum(w.inductor_compiles for w in self.watches),
                "parity": [{"step": r.get("key", r["mode"]), "logits_rel_err": r["logits"],
                            "worst_op_rel_err": r["worst_op"], "rtol": r["rtol"]} for r in self.parity],
                "worst_op_rel_err": max(worst, default=None)}


def _select(docs: ArtifactDocs, device: torch.device) -> tuple[str, dict] | None:
    """Step 1."""
    targets = bundles_of(docs.manifest)
    if not targets:
        return None
    here = target_facts(device)
    key = target_key(here)
    if key not in targets:
        built = "; ".join(describe_target(t["facts"]) if t.get("facts") else k for k, t in sorted(targets.items()))
        raise BundleError(f"{docs.path}: compiled pieces were built for {built}; this installation is "
                          f"{describe_target(here)}: rebuild them here with {_rebuild(docs, device.type)}, or pass "
                          f"--no-compiled to run the traced glue")
    return key, here


def _read_doc(docs: ArtifactDocs, key: str) -> dict:
    name = f"{bundle_dir(key)}/{BUNDLE}"
    files = docs.manifest["files"]
    if name not in files:
        raise BundleError(f"{docs.path}: manifest.json names bundle {key} but does not list {name}")
    path = docs.path / name
    data = path.read_bytes()
    check_hash(path, files[name], name, data)
    try:
        return parse_bundle_doc(json.loads(data), name)
    except (ValueError, ArtifactFormatError) as e:
        raise BundleError(f"{docs.path}: {e}") from None


def _check(docs: ArtifactDocs, key: str, doc: dict, here: dict, device: torch.device) -> None:
    """Step 2."""
    rebuild = _rebuild(docs, device.type, force=True)  # a bundle of this key is there: it is replaced
    differences = facts_differences(doc["facts"], here)
    if differences:
        raise BundleError(f"{docs.path}: bundle {key} was built for {describe_target(doc['facts'])}; this installation "
                          f"is {describe_target(here)} ({'; '.join(differences[:3])}): rebuild it here with {rebuild}")
    settings = inductor_config(device.type, bundle_pdl(doc))  # what its pieces load with
    if doc["inductor_config"] != settings:
        raise BundleError(f"{docs.path}: bundle {key} was built with Inductor settings {doc['inductor_config']}, this "
                          f"runtime loads with {settings}: rebuild it with {rebuild}")
    files = docs.manifest["files"]
    for program, sha in (doc.get("programs_sha256") or {}).items():
        if files.get(PROGRAM_FILES.get(program, "")) != sha:
            raise BundleError(f"{docs.path}: bundle {key} was built from another {program} program than this "
                              f"artifact's {PROGRAM_FILES.get(program)}: rebuild it with {rebuild}")
    missing = [p for p in docs.programs if p not in doc["programs"]]
    if missing:
        raise BundleError(f"{docs.path}: bundle {key} has no compiled glue for the {missing[0]} program: rebuild it "
                          f"with {rebuild}")
    prefix = bundle_dir(key) + "/"
    listed = {f[len(prefix):]: sha for f, sha in files.items() if f.startswith(prefix) and f != prefix + BUNDLE}
    if listed != doc["files"]:
        odd = sorted(set(listed) ^ set(doc["files"])) or sorted(f for f in listed if listed[f] != doc["files"][f])
        raise BundleError(f"{docs.path}: bundle {key}: {BUNDLE} and manifest.json disagree on {prefix}{odd[0]}: the "
                          f"bundle was modified after it was built; rebuild it with {rebuild}")


def _consent(docs: ArtifactDocs, key: str, doc: dict, device: torch.device, options: CompiledOptions) -> None:
    """Step 3."""
    if options.trust:
        return
    try:
        key_bytes = signing_key(create=False)
    except SigningKeyError as e:
        raise BundleError(str(e)) from None
    signature = doc.get("signature") or {}
    if key_bytes is not None and verify(signed_payload(doc), signature, key_bytes):
        return
    if key_bytes is None:
        why = f"this installation has no signing key ({key_path()}), so it built none"
    elif signature.get("key_id") and signature.get("key_id") != key_id(key_bytes):
        why = (f"it was signed by another installation's key ({signature.get('key_id')}; ours, {key_path()}, is "
               f"{key_id(key_bytes)})")
    else:
        why = "its signature does not verify under this installation's key"
    raise BundleError(f"{docs.path}: bundle {bundle_dir(key)} holds executable code "
                      f"({executable_summary(doc['files'])}) "
                      f"that this installation did not build: {why}; pass --trust-compiled to run it, rebuild it here "
                      f"with {_rebuild(docs, device.type, force=True)}, or pass --no-compiled to run the traced glue")


def _materialize(docs: ArtifactDocs, key: str, doc: dict, rank: int) -> dict[str, Path]:
    """Step 4: kernels/<cache>/... (this rank's, in a tensor-parallel bundle) into a private folder,
    checked while copied."""
    root = Path(tempfile.mkdtemp(prefix="hgc-kernels-"))
    atexit.register(shutil.rmtree, root, True)
    caches = {name: root / name for name in CACHE_ENV}
    for folder in caches.values():
        folder.mkdir()
    base = docs.path / bundle_dir(key)
    mine = rank_dir(doc, rank)
    kernels = []
    for rel, sha in sorted(doc["files"].items()):
        if not rel.startswith(mine):
            continue  # another rank's
        parts = rel[len(mine):].split("/")
        if parts[0] != KERNELS:
            continue
        if len(parts) < 3 or parts[1] not in CACHE_ENV or ".." in parts:
            raise BundleError(f"{docs.path}: bundle {key} file {rel} is not under kernels/<cache>/ "
                              f"(caches: {', '.join(CACHE_ENV)})")
        dest = caches[parts[1]].joinpath(*parts[2:])
        dest.parent.mkdir(parents=True, exist_ok=True)
        kernels.append((rel, sha, dest))

    def copy(kernel):
        rel, sha, dest = kernel
        data = (base / rel).read_bytes()
        check_hash(base / rel, sha, f"{bundle_dir(key)}/{rel}", data)
        if dest.name.startswith(TRITON_GROUP) and dest.is_relative_to(caches["triton"]):
            data = _relocated_group(data, dest.parent, f"{bundle_dir(key)}/{rel}")
        dest.write_bytes(data)
        if rel.endswith(".so"):
            dest.chmod(0o755)

    _in_parallel(copy, kernels)  # the first file that fails its hash raises here
    return caches


def _relocated_group(data: bytes, folder: Path, what: str) -> bytes:
    """A Triton group file's bytes with its files' paths in `folder`, the copy's folder of that cache
    key. As built they name the build folder, which the next build of the target empties: a lookup
    would then find the files of only the kernels that build made again, build the others at
    start-up (refused, "rebuilt"), and meanwhile read the files from outside the checked copy."""
    try:
        doc = json.loads(data)
        children = doc["child_paths"]
        doc["child_paths"] = {name: str(folder / Path(path).name) for name, path in children.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BundleError(f"{what}: not a Triton cache group file ({{\"child_paths\": {{file: path}}}}): "
                          f"{type(e).__name__}: {e}") from None
    return json.dumps(doc).encode()


def _load_pieces(base: Path, doc: dict, rank: int = 0, programs: tuple[str, ...] | None = None) -> dict:
    """Step 5's loads: each piece (this rank's) checked against bundle.json, then handed to Inductor.
    `programs`: only the pieces their glue segments name (default: all)."""
    from torch._inductor import CompiledArtifact, config

    device = doc["facts"]["device"]
    if device == "cuda":
        _cuda_kernels_for(doc)
    pieces = {}
    names = doc["pieces"] if programs is None else {r["piece"] for p in programs for r in doc["programs"].get(p, [])
                                                    if r["piece"] is not None}  # None: a segment left traced
    for name in sorted(names):
        rel = rank_dir(doc, rank) + name
        path = base / rel
        check_hash(path, doc["files"][rel], f"{bundle_dir(doc['target'])}/{rel}", path.read_bytes())
        with config.patch(inductor_config(device, bundle_pdl(doc))):  # the settings it was built with
            pieces[name] = CompiledArtifact.load(path=str(path), format="binary")
    return pieces


def _cuda_kernels_for(doc: dict) -> None:
    """What a cuda bundle's pieces and start-up launch: the glue ops' kernels registered (its
    projections call hgc_glue::small_m_linear, and with --norm-linear its input norms
    add_rms_norm_linear or rms_norm_linear), and programmatic dependent launch on or off as the
    bundle was built (`hgc build --pdl`), before any capture: the build's start-up and every run
    then launch, and the bundle holds, the same kernels (launch_pdl is part of a Triton kernel's key)."""
    from runtime.backends import glue_kernels
    from runtime.backends.kernels import pdl

    glue_kernels.register()
    pdl.enable(bundle_pdl(doc))


def load_built(doc: dict, root: Path, caches: dict[str, Path], rank: int = 0) -> CompiledBundle:
    """A bundle built in this process and not yet in an artifact (`hgc build` runs it once before
    bundling the kernels its start-up builds): its pieces (rank `rank`'s) from `root`, Inductor's
    cache at the build's own folder, builds allowed (building is the point)."""
    bundle = CompiledBundle(doc["target"], doc["facts"], doc, {}, caches, CompiledOptions(allow_builds=True), "",
                            building=True)
    with cache_env({"inductor": caches["inductor"]}), bundle.watch():
        bundle.pieces = _load_pieces(root, doc, rank)
    return bundle


def _point_process_at(caches: dict[str, Path]) -> None:
    """cuda: the backends' kernels (FlashInfer modules, Triton kernels) load from the copy at capture."""
    fi = sys.modules.get("flashinfer.jit.env")
    if fi is not None and Path(str(getattr(fi, "FLASHINFER_BASE_DIR", ""))) != caches["flashinfer"]:
        raise BundleError("flashinfer was imported before the artifact was loaded, so its module cache cannot point "
                          "at the bundle's copy; load the artifact before anything imports flashinfer")
    os.environ.update({CACHE_ENV[name]: str(path) for name, path in caches.items()})
    os.environ.update(CACHE_SETTINGS)
    pin_triton_ptxas("cuda")
    try:
        from flashinfer.jit import env as jit_env
    except ImportError:  # no FlashInfer here: no backend will ask for one of its modules
        return
    # FlashInfer loads a module found in its AOT folder as it is and runs its ninja build for any other.
    # The bundle holds the build's products without its inputs (generated sources, object files), so
    # ninja would redo every module; with the AOT folder at the copy's module folder they load as built,
    # and a module the bundle lacks is still built (into the same folder), where the KernelWatch sees it.
    jit_env.FLASHINFER_AOT_DIR = jit_env.FLASHINFER_JIT_DIR


def open_bundle(docs: ArtifactDocs, device: str | torch.device, options: CompiledOptions = CompiledOptions(),
                rank: int = 0, programs: tuple[str, ...] | None = None) -> CompiledBundle | None:
    """Steps 1-5 of the module docstring; None when compiled pieces are off or the artifact has none.
    `rank`: which rank's pieces and kernels a tensor-parallel artifact's bundle gives this process.
    `programs`: whose pieces to load (default: every program's); the others' glue is not asked for."""
    if not options.enabled:
        return None
    device = torch.device(device)
    selected = _select(docs, device)
    if selected is None:
        return None
    key, here = selected
    marks = [time.perf_counter()]
    doc = _read_doc(docs, key)
    _check(docs, key, doc, here, device)
    if doc.get("ranks", 1) != docs.tp:
        raise BundleError(f"{docs.path}: bundle {key} holds pieces for {doc.get('ranks', 1)} rank(s), the artifact "
                          f"runs on {docs.tp}: rebuild it with {_rebuild(docs, device.type, force=True)}")
    _consent(docs, key, doc, device, options)
    marks.append(time.perf_counter())
    caches = _materialize(docs, key, doc, rank)
    marks.append(time.perf_counter())
    remedy = f"rebuild the bundle with {_rebuild(docs, device.type, force=True)}"
    bundle = CompiledBundle(key, here, doc, {}, caches, options, remedy)
    if device.type == "cuda":
        _point_process_at(caches)
    with cache_env({"inductor": caches["inductor"]}), bundle.watch():
        bundle.pieces = _load_pieces(docs.path / bundle_dir(key), doc, rank, programs)
    marks.append(time.perf_counter())
    bundle.load_seconds = marks[-1] - marks[0]
    bundle.load_phases = dict(zip(("check_and_consent", "materialize", "pieces"),
                                  (round(b - a, 3) for a, b in zip(marks, marks[1:]))))
    return bundle
