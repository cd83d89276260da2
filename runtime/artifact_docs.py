"""The artifact's documents: read manifest.json, check versions and hashes, parse the JSON documents.

    docs = read_artifact("artifacts/tiny")     # what `hgc inspect` shows; nothing is executed

1. manifest.json: the format version, the torch version (major.minor must match the compiler's:
   .pt2 files are not stable across releases), the op schemas the programs were traced with, and
   the SHA-256 of every listed file; a file it does not list is refused.
2. The registry (in the manifest), routing.json (the binding: runtime/binding.py executes it),
   split.json (what is captured per mode) and lints.json are parsed with the format module's
   helpers (compiler/splitops/artifact.py), which name the file and field of anything malformed.

`LoadError` is the one error of loading: every refusal names the file, the field or the layer,
and what to do. What it does not do: load programs (runtime/pt2_check.py), weights
(runtime/weights.py) or bind anything (runtime/binding.py).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from compiler.splitops import LayerRegistry, Mode, op_schemas  # also registers the hgc ops graphs call
from compiler.splitops.artifact import (DRAFT_GRAPH, GRAPH, LINTS, MANIFEST, PROGRAM_FILES, ROUTING, SPLIT, WEIGHTS,
                                        ArtifactFormatError, RoutingTable, SplitPlan, check_format, load_json,
                                        parse_routing_doc, parse_split_doc, sha256_file)

__all__ = ["LoadError", "ArtifactDocs", "read_artifact", "check_hash", "HASHED_ON_LOAD"]


class LoadError(ValueError):
    """An artifact this runtime refuses; the message names the file, the field and what to do."""


@dataclasses.dataclass
class ArtifactDocs:
    """Everything in an artifact except the programs and the weights: checked, parsed JSON."""

    path: Path
    manifest: dict
    registry: LayerRegistry
    routing: RoutingTable
    split_plans: dict[str, dict[Mode, SplitPlan]]
    lints: dict

    @property
    def family(self) -> str:
        return self.manifest["family"]

    @property
    def programs(self) -> list[str]:
        return list(self.manifest["programs"])


def _torch_release(version: str) -> tuple[str, str]:
    parts = version.split("+")[0].split(".")
    return parts[0], parts[1] if len(parts) > 1 else "0"


def _listed_files(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(out)


def _check_op_schemas(root: Path, manifest: dict) -> None:
    """The programs call hgc ops positionally in the schemas they were traced with: refuse an
    artifact whose ops differ from this runtime's, naming each op that changed."""
    recorded = manifest.get("op_schemas")
    if not isinstance(recorded, dict):
        raise LoadError(f"{root / MANIFEST}: no 'op_schemas' (compiled by an hgc that did not record its op "
                        f"vocabulary): recompile the checkpoint with this hgc")
    here = op_schemas()
    changed = sorted(name for name in set(recorded) | set(here) if recorded.get(name) != here.get(name))
    if changed:
        detail = "; ".join(f"hgc.{n}: artifact {recorded.get(n, 'absent')}, runtime {here.get(n, 'absent')}"
                           for n in changed[:2])
        raise LoadError(f"{root}: compiled for other hgc op schemas ({', '.join(changed)} changed: {detail}); "
                        f"recompile the checkpoint with this hgc")


def read_artifact(path: str | os.PathLike, verify_hashes: bool = True) -> ArtifactDocs:
    root = Path(path)
    if not root.is_dir():
        raise LoadError(f"{root}: not an artifact folder (compile one with `hgc compile CHECKPOINT -o {root}`)")
    try:
        manifest = check_format(load_json(root / MANIFEST, "manifest"), str(root / MANIFEST))
    except ArtifactFormatError as e:
        raise LoadError(str(e)) from None
    for field in ("versions", "family", "registry", "programs", "files", "weights"):
        if field not in manifest:
            raise LoadError(f"{root / MANIFEST}: field {field!r} missing")
    _check_op_schemas(root, manifest)
    built, here = manifest["versions"].get("torch", "?"), torch.__version__
    if _torch_release(built) != _torch_release(here):
        raise LoadError(f"{root}: compiled with torch {built}, this runtime has torch {here}; .pt2 programs are not "
                        f"portable across torch releases: recompile with this torch")
    files = manifest["files"]
    if not isinstance(files, dict):
        raise LoadError(f"{root / MANIFEST}: field 'files' must map file names to SHA-256")
    present = [f for f in _listed_files(root) if f != MANIFEST]
    unlisted = sorted(set(present) - set(files))
    if unlisted:
        raise LoadError(f"{root}: file(s) {unlisted[:3]} are not listed in manifest.json (an artifact holds only what "
                        f"the compiler wrote)")
    for name, digest in sorted(files.items()):
        target = (root / name)
        if ".." in Path(name).parts or Path(name).is_absolute():
            raise LoadError(f"{root / MANIFEST}: listed file {name!r} lies outside the artifact")
        if not target.is_file() or target.is_symlink():
            raise LoadError(f"{root}: listed file {name} is missing (or not a plain file): the artifact is incomplete")
        if verify_hashes and name not in HASHED_ON_LOAD:
            check_hash(target, digest, name)
    for name in (ROUTING, SPLIT, LINTS):
        if name not in files:
            raise LoadError(f"{root}: {name} is not listed in manifest.json")
        if not verify_hashes:  # these are parsed below: always checked
            check_hash(root / name, files[name], name)
    try:
        registry = LayerRegistry.from_json(manifest["registry"])
        routing = parse_routing_doc(load_json(root / ROUTING), ROUTING)
        split_plans = parse_split_doc(load_json(root / SPLIT), SPLIT)
        lints = check_format(load_json(root / LINTS), LINTS)
    except (ArtifactFormatError, KeyError, ValueError, TypeError) as e:
        raise LoadError(f"{root}: {e}") from None
    for program in manifest["programs"]:
        if program not in PROGRAM_FILES or program not in split_plans:
            raise LoadError(f"{root}: program {program!r} has no split plan or is unknown to this runtime")
    return ArtifactDocs(root, manifest, registry, routing, split_plans, lints)


# Files whose hash `load_artifact` checks on the bytes it reads anyway (read once, not twice).
HASHED_ON_LOAD = {GRAPH, DRAFT_GRAPH, WEIGHTS}


def check_hash(path: Path, expected: str, name: str, data: bytes | None = None) -> None:
    import hashlib
    got = hashlib.sha256(data).hexdigest() if data is not None else sha256_file(path)
    if got != expected:
        raise LoadError(f"{path}: SHA-256 {got[:16]}... does not match manifest.json ({str(expected)[:16]}...): "
                        f"{name} was modified or corrupted after compile; recompile")
