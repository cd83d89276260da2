"""The artifact's documents: read manifest.json, check versions and hashes, parse the JSON documents.

    docs = read_artifact("artifacts/tiny")     # what `hgc inspect` shows; nothing is executed

1. manifest.json: the format version, its seal (`manifest_sha256`: an edited field is refused),
   the torch version (major.minor must match the compiler's: .pt2 files are not stable across
   releases), the op schemas the programs were traced with, and the SHA-256 of every listed
   file; a file it does not list is refused.
2. The registry (in the manifest), routing.json (the binding: runtime/artifact/binding.py executes it),
   split.json (what is captured per mode), lints.json and, for a tensor-parallel artifact,
   sharding.json are parsed with the format module's helpers (compiler/splitops/artifact.py),
   which name the file and field of anything malformed.
3. The facts the runtime uses are cross-checked against the documents they describe
   (`check_documents`): the programs against the registry's draft layers, routing.json and
   split.json; each routing entry's layer kind against the registry; the layer count against
   config.json's; the rank count of sharding.json against the compile's --tp. The loader then
   checks vocabulary and hidden size against the programs (runtime/artifact/loader.py).
4. `verify_files(docs)` re-hashes every listed file, those the loader hashes while reading them
   included (`hgc verify`).

`LoadError` is the one error of loading: every refusal names the file, the field or the layer,
and what to do. What it does not do: load programs (runtime/artifact/pt2_check.py), weights
(runtime/artifact/weights.py) or bind anything (runtime/artifact/binding.py).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from compiler.splitops import LayerRegistry, Mode, op_schemas  # also registers the hgc ops graphs call
from compiler.splitops.artifact import (DRAFT_GRAPH, GRAPH, LINTS, MANIFEST, PROGRAM_FILES, ROUTING, SHARDING, SPLIT,
                                        WEIGHTS, ArtifactFormatError, RoutingTable, Sharding, SplitPlan, check_format,
                                        check_manifest_seal, load_json, parse_routing_doc, parse_sharding_doc,
                                        parse_split_doc,
                                        sha256_file)

__all__ = ["LoadError", "ArtifactDocs", "read_artifact", "check_hash", "HASHED_ON_LOAD", "check_documents",
           "config_value", "verify_files"]


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
    sharding: Sharding | None = None  # a tensor-parallel artifact's sharding.json (None: one device)

    @property
    def tp(self) -> int:
        """The rank count the programs are one rank of (1: not tensor parallel)."""
        return self.sharding.tp if self.sharding is not None else 1

    @property
    def family(self) -> str:
        return self.manifest["family"]

    @property
    def programs(self) -> list[str]:
        return list(self.manifest["programs"])

    def stored_weight_bytes(self) -> int:
        """Bytes of the weight files as stored (weights.safetensors, or the linked checkpoint files)."""
        spec = self.manifest["weights"]
        if spec.get("mode") == "link":
            return sum(int(entry.get("size", 0)) for entry in spec.get("files", []))
        path = self.path / spec.get("file", WEIGHTS)
        return path.stat().st_size if path.is_file() else 0


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
        check_manifest_seal(manifest, str(root / MANIFEST))
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
    for name in (ROUTING, SPLIT, LINTS, SHARDING):
        if not verify_hashes and name in files:  # these are parsed below: always checked
            check_hash(root / name, files[name], name)
    try:
        registry = LayerRegistry.from_json(manifest["registry"])
        routing = parse_routing_doc(load_json(root / ROUTING), ROUTING)
        split_plans = parse_split_doc(load_json(root / SPLIT), SPLIT)
        lints = check_format(load_json(root / LINTS), LINTS)
        sharding = parse_sharding_doc(load_json(root / SHARDING), SHARDING) if SHARDING in files else None
    except (ArtifactFormatError, KeyError, ValueError, TypeError) as e:
        raise LoadError(f"{root}: {e}") from None
    docs = ArtifactDocs(root, manifest, registry, routing, split_plans, lints, sharding)
    check_documents(docs)
    return docs


def config_value(manifest: dict, name: str):
    """`name` from the manifest's copy of config.json (its text_config first, where it has one)."""
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return text.get(name, config.get(name))


def check_documents(docs: ArtifactDocs) -> None:
    """The manifest's facts against the documents they describe (step 3 of the module docstring)."""
    root, manifest, registry = docs.path, docs.manifest, docs.registry
    programs = manifest["programs"]
    if not isinstance(programs, dict) or "main" not in programs:
        raise LoadError(f"{root / MANIFEST}: field 'programs' must name the main program")
    for program in programs:
        if program not in PROGRAM_FILES or program not in docs.split_plans:
            raise LoadError(f"{root}: program {program!r} has no split plan or is unknown to this runtime")
    has_draft = bool(registry.draft_layers())
    if has_draft != ("draft" in programs):
        raise LoadError(f"{root / MANIFEST}: field 'programs' is {sorted(programs)}, but the registry has "
                        f"{len(registry.draft_layers())} draft layer(s): the manifest does not describe this model")
    for name, listed in ((ROUTING, docs.routing.programs), (SPLIT, docs.split_plans)):
        if set(listed) != set(programs):
            raise LoadError(f"{root}: {name} has programs {sorted(listed)}, manifest.json {sorted(programs)}")
    for program, entries in docs.routing.programs.items():
        for e in entries:
            if e.layer_id not in registry or (e.kind is not None and e.kind != registry[e.layer_id].kind.value):
                found = registry[e.layer_id].kind.value if e.layer_id in registry else "not in the registry"
                raise LoadError(f"{root / ROUTING}: {program} node {e.node} is layer {e.layer_id} of kind {e.kind!r}; "
                                f"the registry says {found}")
    layers = config_value(manifest, "num_hidden_layers")
    if isinstance(layers, int) and layers != len(registry.main_layers()):
        raise LoadError(f"{root / MANIFEST}: config num_hidden_layers is {layers}, the registry has "
                        f"{len(registry.main_layers())} main layers")
    compiled = manifest.get("compile") if isinstance(manifest.get("compile"), dict) else {}
    if compiled.get("tp", 1) != docs.tp:  # sharding.json is there exactly when the compile asked for ranks
        found = "no sharding.json" if docs.sharding is None else f"a sharding.json for {docs.tp} ranks"
        raise LoadError(f"{root / MANIFEST}: compiled with --tp {compiled.get('tp', 1)}, but the artifact has "
                        f"{found}: recompile")


def verify_files(docs: ArtifactDocs, progress=None) -> tuple[int, int]:
    """Re-hash every file manifest.json lists (read_artifact skips those the loader hashes as it
    reads them); returns (files, bytes). `progress`: a tqdm-like factory for a bar over the bytes."""
    files = docs.manifest["files"]
    total = sum((docs.path / name).stat().st_size for name in files)
    bar = progress(total=total, desc="verify files", unit="B", unit_scale=True) if progress else None
    for name, digest in sorted(files.items()):
        check_hash(docs.path / name, digest, name)
        if bar is not None:
            bar.update((docs.path / name).stat().st_size)
    if bar is not None:
        bar.close()
    return len(files), total


# Files whose hash `load_artifact` checks on the bytes it reads anyway (read once, not twice).
HASHED_ON_LOAD = {GRAPH, DRAFT_GRAPH, WEIGHTS}


def check_hash(path: Path, expected: str, name: str, data: bytes | None = None) -> None:
    import hashlib
    got = hashlib.sha256(data).hexdigest() if data is not None else sha256_file(path)
    if got != expected:
        raise LoadError(f"{path}: SHA-256 {got[:16]}... does not match manifest.json ({str(expected)[:16]}...): "
                        f"{name} was modified or corrupted after compile; recompile")
