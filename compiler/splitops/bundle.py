"""The target bundle format: compiled code for one (device, torch build) inside an artifact, and what it was built for.

An artifact may hold bundles beside its portable part::

    targets/<key>/bundle.json       what was built, for which target, every file's SHA-256, the signature
    targets/<key>/pieces/*.bin      Inductor-compiled glue (torch._inductor CompiledArtifact, binary)
    targets/<key>/kernels/<cache>/  the kernel caches the pieces and the backends load: Inductor's
                                    (C++ .so on cpu; Triton sources, tuning choices on cuda), Triton's
                                    and FlashInfer's JIT modules (cuda)

A tensor-parallel artifact's bundle (`"ranks": N` in bundle.json) holds one such set per rank,
`targets/<key>/rank<r>/pieces/` and `rank<r>/kernels/`, under one bundle.json: Inductor's generated
code names the device it was compiled for (cuda:r on rank r), so each rank runs pieces compiled
on its own device. The pieces' records and names are the same on every rank (one program, one
structure per piece); `rank_dir(doc, r)` is the prefix of rank r's files.

`<key>` names the target: `cpu-x86_64-torch2.13.0`, `sm90-torch2.11.0-cu128`. Every bundle file is
listed with its SHA-256 in manifest.json (tampering is refused like tampering with weights) and in
bundle.json, whose HMAC signature (runtime/artifact/signing.py) says which installation built it.

1. `target_facts(device)`: what compiled code depends on here (device and its architecture, torch
   build, Python; on cpu the instruction set `-march=native` resolves to, on cuda the CUDA, Triton
   and FlashInfer versions). `target_key(facts)` names the folder; `facts_differences(a, b)` says
   what differs between a bundle and this installation.
2. `bundle_doc(...)` builds bundle.json; `signed_payload(doc)` is the bytes the signature covers
   (the document without its signature); `parse_bundle_doc` reads it back, naming any bad field.
3. `inductor_config(device_type, pdl)`: the Inductor settings pieces are built and loaded with
   (`INDUCTOR_CONFIG` per device type, and Inductor's PDL setting for a bundle built with --pdl).
   Kernel file names are keyed by the compile command, so both sides must use the same settings:
   bundle.json records them and whether the bundle was built with --pdl (`bundle_pdl` reads it).
4. `bundle_norm_linear(doc)`: whether the bundle was built with --norm-linear (its pieces call
   hgc_glue::add_rms_norm_linear for the input norms; each piece's `norm_linear` says how many);
   `bundle_norm_rope(doc)` likewise for --norm-rope (hgc_glue::qk_norm_rope; `norm_rope`), and
   `bundle_sigmoid_gate(doc)` for --sigmoid-gate (hgc_glue::sigmoid_gate; `sigmoid_gate`).

What it does not do: compile (compiler/inductor_pieces.py), sign or check (runtime/artifact/signing.py,
runtime/artifact/bundle.py), or write the artifact (compiler/artifact_writer.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import subprocess

import torch

from .artifact import FORMAT_NAME, FORMAT_VERSION, ArtifactFormatError, check_format, dump_json

__all__ = ["TARGETS", "BUNDLE", "PIECES", "KERNELS", "INDUCTOR_CONFIG", "INDUCTOR_PDL", "CACHE_ENV", "CACHE_SETTINGS",
           "cache_env", "inductor_config", "inductor_has_pdl", "bundle_pdl", "bundle_norm_linear", "bundle_norm_rope",
           "bundle_sigmoid_gate",
           "pin_triton_ptxas",
           "NOT_REPRODUCIBLE", "not_reproducible", "target_facts", "target_key", "describe_target",
           "facts_differences", "bundle_doc", "signed_payload", "parse_bundle_doc", "bundle_dir", "executable_summary",
           "rank_dir", "without_rank_dir"]

TARGETS = "targets"
BUNDLE = "bundle.json"
PIECES = "pieces"
KERNELS = "kernels"

# Inductor settings per device type, the same for building and loading (a kernel's file name is a
# hash of its compile command, so both sides must agree):
# - precompiled headers off: with them on, loading a piece first preprocesses (and, on a machine
#   that never built one, compiles) a header before it even looks for the kernel's .so;
# - cpu: the C++ wrapper, so each piece is one C++ library (its wrapper and all its kernels) instead
#   of one library per kernel: a build compiles (and parses ATen's headers) once per piece, and a
#   step calls no Python between the kernels of a piece. With one compile per piece, a pool of
#   compile workers (each importing torch) costs more than it saves.
# - cuda: Triton's own launcher, not Inductor's static one. A statically launched kernel keeps the
#   path its source had in the build's cache and looks its launch configuration (.best_config) up
#   there, so a run finds the bundle's choices only while the build folder exists, and elsewhere
#   times every candidate again and writes the result into that foreign path, unwatched. Launched
#   from source, a kernel lives in the run's copy of the bundle and finds the choice beside it
#   (benchmarks/probes/inductor_tuning_probe.py shows both on the GPU). The launcher's cost is host time per
#   launch, which a captured piece does not pay.
# - cuda: combo kernels (Inductor's horizontal fusion): the independent small kernels of a piece
#   (the copies, gates and norms a GDN layer computes for its op cores) run as one launch.
#   At decode batch sizes each launch costs more than its bytes (benchmarks/history/compiled_pieces.md,
#   "Sibling projections as one GEMM, and combo kernels").
INDUCTOR_CONFIG = {"cpu": {"cpp_cache_precompile_headers": False, "cpp_wrapper": True, "compile_threads": 1},
                   "cuda": {"cpp_cache_precompile_headers": False, "use_static_cuda_launcher": False,
                            "combo_kernels": True}}
# A cuda bundle built with --pdl: Inductor's Triton kernels launched with programmatic dependent
# launch, as the backends' kernels are then (runtime/backends/kernels/pdl.py). Inductor places their
# waits itself. Present in torch 2.11 and 2.13; an Inductor without it builds the pieces without it,
# and bundle.json's inductor_config says so.
INDUCTOR_PDL = "triton.enable_pdl"


def inductor_has_pdl() -> bool:
    """Whether this torch's Inductor has the PDL setting (INDUCTOR_PDL)."""
    from torch._inductor import config

    return hasattr(config.triton, INDUCTOR_PDL.split(".", 1)[1])


def inductor_config(device_type: str, pdl: bool = False) -> dict:
    """The Inductor settings a bundle's pieces are built and loaded with: the device type's
    INDUCTOR_CONFIG, with INDUCTOR_PDL on for a cuda bundle built with --pdl (where Inductor has it)."""
    settings = dict(INDUCTOR_CONFIG[device_type])
    if pdl and device_type == "cuda" and inductor_has_pdl():
        settings[INDUCTOR_PDL] = True
    return settings


def bundle_pdl(doc: dict) -> bool:
    """Whether a bundle.json says its kernels launch with PDL (`hgc build --pdl`); a bundle built
    before the field existed did not."""
    return bool(doc.get("pdl", False))


def bundle_norm_linear(doc: dict) -> bool:
    """Whether a bundle.json says its input norms were folded into their projections (`hgc build
    --norm-linear`); a bundle built before the field existed did not fold them."""
    return bool(doc.get("norm_linear", False))


def bundle_norm_rope(doc: dict) -> bool:
    """Whether a bundle.json says its GQA layers' q / k norms and rotary are calls of qk_norm_rope
    (`hgc build --norm-rope`); a bundle built before the field existed has none."""
    return bool(doc.get("norm_rope", False))


def bundle_sigmoid_gate(doc: dict) -> bool:
    """Whether a bundle.json says its attention outputs' sigmoid gates are calls of sigmoid_gate
    (`hgc build --sigmoid-gate`); a bundle built before the field existed has none."""
    return bool(doc.get("sigmoid_gate", False))

# kernels/<cache>/ in a bundle <-> the environment variable that points its library at that cache.
# The build empties and fills these folders; a run points them at its checked copy of the bundle's.
CACHE_ENV = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR",
             "flashinfer": "FLASHINFER_WORKSPACE_BASE"}
# Triton keeps autotuning choices (FLA's kernels tune) in its cache only when asked to.
CACHE_SETTINGS = {"TRITON_CACHE_AUTOTUNING": "1"}

# Files a second build does not reproduce byte for byte, and why (bundle.json says so per file):
# (path prefix or suffix, why). Everything else is: generated code and the libraries compiled from
# it, built at the same path (the build folder's path is fixed: compilers record it).
NOT_REPRODUCIBLE = (
    (PIECES + "/", "a CompiledArtifact holds Inductor's cache entries, which record compile timings and a "
                   "per-compile key; the code it runs is reproducible (`code_sha256` of the piece, and its "
                   "kernels' files)"),
    (".best_config", "an autotuning choice, made by timing candidates on the build machine"),
    (f"{KERNELS}/triton/", "Triton's cache records the autotuning run's measurements beside the kernels"),
    (f"{KERNELS}/flashinfer/", "FlashInfer's modules are built by nvcc and a linker whose output is not "
                               "byte-stable"),
)


def without_rank_dir(f: str) -> str:
    """A bundle file's path below its rank's folder (the path itself in a one-process bundle)."""
    head, _, rest = f.partition("/")
    return rest if rest and head.startswith("rank") and head[4:].isdigit() else f


def rank_dir(doc: dict, rank: int) -> str:
    """The prefix of rank `rank`'s pieces and kernels in the bundle `doc` ("" for one process)."""
    return f"rank{rank}/" if int(doc.get("ranks", 1)) > 1 else ""


def not_reproducible(files) -> dict[str, str]:
    """file -> why a rebuild may change it, for the bundle files NOT_REPRODUCIBLE covers."""
    out = {}
    for f in sorted(files):
        g = without_rank_dir(f)
        why = next((w for pattern, w in NOT_REPRODUCIBLE if g.startswith(pattern) or g.endswith(pattern)), None)
        if why is not None:
            out[f] = why
    return out


def pin_triton_ptxas(device_type: str) -> None:
    """cuda: settle, before anything compiles, which ptxas builds every Triton kernel of this process.

    Triton keys its kernel cache and its autotuning results by the ptxas version. Inductor points
    TRITON_PTXAS_PATH at torch's own ptxas, but only on the path that compiles one of its kernels,
    in whichever process does it: a build compiles its pieces in worker processes, a run loads them
    in its own, so the backends' kernels (ours, FLA's) were built with one ptxas and looked up with
    another. benchmarks/probes/bundle_keys_probe.py found every one of them compiled again at a run's
    start-up, with metadata equal to the bundle's copy but another key. Taking Inductor's own choice
    first, in the build and in the run, gives both the same."""
    if device_type != "cuda":
        return
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # an Inductor that does not choose: Triton's own ptxas everywhere
        return
    _set_triton_ptxas_path()


@contextlib.contextmanager
def cache_env(folders: dict[str, str], extra: dict[str, str] | None = None):
    """The kernel caches (CACHE_ENV names -> folders) and the `extra` variables set for the block, the
    environment restored after."""
    values = {CACHE_ENV[name]: str(path) for name, path in folders.items()}
    values.update(CACHE_SETTINGS)
    values.update(extra or {})
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bundle_dir(key: str) -> str:
    return f"{TARGETS}/{key}"


def _cpu_target() -> tuple[str, str]:
    """(the -march value, SHA-256 of every instruction-set flag) that g++'s `-march=native` resolves to.

    Inductor compiles C++ kernels with -march=native: a bundle runs only where that resolves the same."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        compiler = get_cpp_compiler()
    except Exception:  # an Inductor without the helper: the compiler it would call by default
        compiler = "g++"
    try:
        out = subprocess.run([compiler, "-march=native", "-E", "-v", "-"], input="", capture_output=True,
                             text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return "unknown", "unknown"
    flags = sorted({w for line in out.splitlines() if " -march=" in line for w in line.split() if w.startswith("-m")})
    march = next((w.split("=", 1)[1] for w in flags if w.startswith("-march=")), "unknown")
    return march, hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16]


def target_facts(device: str | torch.device) -> dict:
    """What the compiled code of a bundle depends on, for this installation and `device`."""
    device = torch.device(device)
    facts = {"device": device.type, "torch": torch.__version__, "torch_git": str(torch.version.git_version),
             "python": ".".join(platform.python_version_tuple()[:2])}
    if device.type == "cpu":
        # ATen's capability, not Inductor's pick_vec_isa(): that one compiles a test program the first
        # time it is asked, and asking must not build anything.
        march, flags = _cpu_target()
        facts.update(machine=platform.machine(), vec_isa=torch.backends.cpu.get_cpu_capability().lower(),
                     march=march, march_flags=flags)
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        facts.update(arch=f"sm{major}{minor}", gpu=torch.cuda.get_device_name(device), cuda=str(torch.version.cuda),
                     triton=_version("triton"), flashinfer=_version("flashinfer-python"))
    else:
        raise ValueError(f"no compiled target for device {device}: build for cpu or cuda")
    return facts


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def target_key(facts: dict) -> str:
    """The bundle's folder name: device (and architecture) and torch release."""
    release = str(facts["torch"]).split("+")[0]
    if facts["device"] == "cpu":
        return f"cpu-{facts['machine']}-torch{release}"
    return f"{facts['arch']}-torch{release}-cu{str(facts['cuda']).replace('.', '')}"


def describe_target(facts: dict) -> str:
    """One line for messages: the key and the facts people compare."""
    extra = (f"{facts.get('vec_isa')}, -march={facts.get('march')}" if facts.get("device") == "cpu"
             else f"{facts.get('gpu')}, CUDA {facts.get('cuda')}, triton {facts.get('triton')}")
    return f"{target_key(facts)} (torch {facts.get('torch')}, python {facts.get('python')}, {extra})"


def facts_differences(built: dict, here: dict) -> list[str]:
    """'field: bundle X, here Y' for each fact that differs."""
    return [f"{k}: bundle {built.get(k)!r}, here {here.get(k)!r}" for k in sorted(set(built) | set(here))
            if built.get(k) != here.get(k)]


def executable_summary(files) -> str:
    """The bundle's files by folder, for a refusal: every one of them is code or code's data (pieces run
    Python generated by Inductor; kernels are shared objects, cubins and their tuning choices)."""
    folders: dict[str, int] = {}
    for f in map(without_rank_dir, files):  # a tensor-parallel bundle: the ranks' files together
        folder = "/".join(f.split("/")[:2]) if f.startswith(KERNELS + "/") else f.split("/")[0]
        folders[folder] = folders.get(folder, 0) + 1
    return ", ".join(f"{folder}/ ({n} file{'s' * (n != 1)})" for folder, n in sorted(folders.items()))


def bundle_doc(key: str, facts: dict, programs: dict, programs_sha256: dict, pieces: dict, files: dict,
               seconds: float, hgc: str, ranks: int = 1, small_m: bool = False, pdl: bool = False,
               norm_linear: bool = False, norm_rope: bool = False, sigmoid_gate: bool = False) -> dict:
    """bundle.json without its signature. programs: program -> segment records (glue.GlueSegment.to_json()
    plus the piece file that runs it, or None); programs_sha256: program -> SHA-256 of the .pt2 it was
    built from; pieces: file -> {structure, code_sha256, nodes, small_m_linear, norm_linear, norm_rope,
    sigmoid_gate}
    (rank 0's, where there are ranks); files: path inside the bundle -> SHA-256; ranks: the
    tensor-parallel ranks it holds
    pieces for; small_m: whether the glue's projections were rewritten to the GEMV op
    (compiler/splitops/glue_ops.py; each piece's `small_m_linear` says how many it calls); pdl:
    whether the kernels launch with programmatic dependent launch (`hgc build --pdl`: the pieces
    built with `inductor_config`'s PDL setting, the backends' kernels switched on at load); norm_linear:
    whether the input norms were folded into their projections (`hgc build --norm-linear`; each
    piece's `norm_linear` says how many); norm_rope: whether each GQA layer's q / k norms and rotary
    are one call of hgc_glue::qk_norm_rope (`hgc build --norm-rope`; each piece's `norm_rope` says
    how many); sigmoid_gate: whether attention outputs' sigmoid gates are calls of
    hgc_glue::sigmoid_gate (`hgc build --sigmoid-gate`; each piece's `sigmoid_gate` says how many)."""
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "target": key, "facts": facts,
            **({"ranks": ranks} if ranks > 1 else {}),
            "inductor_config": inductor_config(facts["device"], pdl), "small_m_linear": small_m, "pdl": pdl,
            "norm_linear": norm_linear, "norm_rope": norm_rope, "sigmoid_gate": sigmoid_gate,
            "programs": programs,
            "programs_sha256": programs_sha256, "pieces": pieces, "files": files,
            "not_reproducible": not_reproducible(files),
            "build": {"seconds": round(seconds, 1), "hgc": hgc}}


def signed_payload(doc: dict) -> bytes:
    return dump_json({k: v for k, v in doc.items() if k != "signature"})


def parse_bundle_doc(doc, source: str) -> dict:
    """bundle.json checked for the fields the loader reads; raises ArtifactFormatError naming the field."""
    check_format(doc, source)
    for field, kind in (("target", str), ("facts", dict), ("programs", dict), ("pieces", dict), ("files", dict),
                        ("inductor_config", dict)):
        if not isinstance(doc.get(field), kind):
            raise ArtifactFormatError(f"{source}: field {field!r} missing or not a {kind.__name__}")
    for program, records in doc["programs"].items():
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise ArtifactFormatError(f"{source}: programs.{program} must be a list of segment records")
        for r in records:
            if r.get("piece") is not None and r["piece"] not in doc["pieces"]:
                raise ArtifactFormatError(f"{source}: programs.{program} segment {r.get('index')} names piece "
                                          f"{r['piece']!r}, which 'pieces' does not list")
    for flag in ("pdl", "norm_linear", "norm_rope", "sigmoid_gate"):
        if not isinstance(doc.get(flag, False), bool):
            raise ArtifactFormatError(f"{source}: field {flag!r} must be true or false, not {doc[flag]!r}")
    ranks = doc.get("ranks", 1)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ArtifactFormatError(f"{source}: field 'ranks' must be a positive integer, not {ranks!r}")
    for rank in range(ranks):
        for name in doc["pieces"]:
            if rank_dir(doc, rank) + name not in doc["files"]:
                raise ArtifactFormatError(f"{source}: piece {rank_dir(doc, rank)}{name} is not listed in 'files'")
    return doc
