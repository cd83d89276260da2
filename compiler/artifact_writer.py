"""Write an artifact folder atomically: a staging folder beside the target, renamed into place.

1. `staging_folder(out, force)` refuses an existing output (unless force, and with force anything
   but an hgc artifact or an empty folder: --force replaces an artifact, never someone's files),
   an output that is or holds the checkpoint, and an unwritable parent, each with a clear message.
   It removes the staging folders that killed compiles left beside the output (`.NAME.partial-*`,
   `.NAME.old-*`: those no live process holds a lock on), makes a hidden staging folder in the
   same parent, locks it for as long as this compile runs, and yields it.
2. The compile runs with its dumps written into the staging folder; `write_artifact` then writes
   graph.pt2 (and draft.pt2), the weights (copied, or linked with --link-weights: size, header
   hash and data hash of each file), weights.json, the checkpoint's tokenizer files if it has
   them, routing.json, split.json, lints.json, and last manifest.json with the SHA-256 of every
   file, sealed with the hash of its own content.
3. On success the staging folder is renamed to the output (an existing one, with --force, is
   moved aside first and deleted after); on any failure or interrupt (Ctrl-C included) it is
   deleted, so no half-written artifact is ever left under the output name.
4. Later, `add_bundle` moves a built target bundle (`hgc build`) into targets/<key>/, lists its
   files in manifest.json and reseals it.

Weights are copied byte for byte from the checkpoint's safetensors files, streamed tensor by
tensor (memory stays flat whatever the model size), under their checkpoint names. With
--no-weights (a folder holding only config.json) there are none: the manifest says mode "none"
and the runtime fills every tensor with random values (`--load-format dummy`). A tensor-parallel
compile adds sharding.json and, for a model that computes tensors from its config which ranks
slice (Bailing's Lightning decays), computed.safetensors with their whole values.

The format itself (names, documents) is compiler/splitops/artifact.py, shared with the loader.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: staging folders are not locked, and never swept
    fcntl = None

import torch

from compiler.splitops.errors import CompileError
from compiler.splitops import MODES, op_schemas
from compiler.splitops.artifact import (COMPUTED, FORMAT_NAME, FORMAT_VERSION, LINTS, MANIFEST, PROGRAM_FILES,
                                        PROGRAM_INPUTS, ROUTING, SHARDING, SPLIT, WEIGHT_MAP, WEIGHTS, dump_json,
                                        program_outputs, routing_doc, safetensors_header, seal_manifest, sha256_file,
                                        sharding_doc, split_doc, weights_doc)

__all__ = ["ArtifactWriteError", "staging_folder", "sweep_stale_staging", "write_artifact", "checkpoint_index",
           "hgc_version", "lints_doc", "add_bundle"]


class ArtifactWriteError(CompileError):
    pass


def hgc_version() -> str:
    try:
        from importlib.metadata import version
        return version("hgc")
    except Exception:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            import tomllib
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except Exception:
            return "unknown"


def _replaceable(out: Path) -> str | None:
    """Why --force must not replace `out` (None: it is an hgc artifact, or empty)."""
    entries = list(out.iterdir())
    if not entries:
        return None
    try:
        manifest = json.loads((out / MANIFEST).read_bytes())
    except (OSError, ValueError):
        manifest = None
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT_NAME:
        return None
    shown = ", ".join(sorted(e.name for e in entries)[:3]) + (", ..." if len(entries) > 3 else "")
    return (f"it is not an hgc artifact (no {MANIFEST} of format {FORMAT_NAME!r}; it holds {shown}); --force "
            f"replaces only an artifact or an empty folder: choose another -o, or move the folder away yourself")


def _lock(folder: Path) -> int | None:
    """Hold an exclusive lock on `folder` for as long as the returned descriptor is open; None if
    another process holds it. The lock dies with its process, so a killed compile's folder is free."""
    if fcntl is None:
        return None
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_stale_staging(parent: Path, name: str) -> list[Path]:
    """Remove `.NAME.partial-*` and `.NAME.old-*` folders in `parent` that no live compile holds."""
    removed = []
    if fcntl is None:
        return removed
    for folder in sorted(parent.glob(f".{name}.partial-*")) + sorted(parent.glob(f".{name}.old-*")):
        if not folder.is_dir() or folder.is_symlink():
            continue
        try:
            fd = _lock(folder)
        except FileNotFoundError:  # another compile's sweep took it since the glob
            continue
        if fd is None:  # a compile into the same place is running: its folder is not stale
            continue
        try:
            previous = folder / name
            if folder.name.startswith(f".{name}.old-") and previous.is_dir() and not (parent / name).exists():
                os.replace(previous, parent / name)  # killed between moving the old artifact aside and the new in
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return removed


def _locked_tempdir(prefix: str, parent: Path) -> tuple[Path, int | None]:
    """A new hidden folder in `parent`, locked. A sweep may take a folder between its creation and
    the lock (before it is opened, or after: it then has no links left); another is made."""
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        try:
            fd = _lock(tmp)
        except FileNotFoundError:  # swept before it could be opened
            continue
        if fcntl is None or (fd is not None and os.fstat(fd).st_nlink > 0):
            return tmp, fd
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def staging_folder(out: str | os.PathLike, force: bool = False, protect: list[Path] | None = None):
    out = Path(out)
    resolved = out.resolve()
    for p in protect or []:
        p = Path(p).resolve()
        if resolved == p or p.is_relative_to(resolved):
            raise ArtifactWriteError(f"{out}: refusing to write an artifact over {p} (it holds the checkpoint)")
    if out.exists() and not out.is_dir():
        raise ArtifactWriteError(f"{out}: exists and is not a folder; choose another output path")
    if out.exists() and not force:
        raise ArtifactWriteError(f"{out}: already exists; pass --force to replace it, or choose another -o")
    if out.exists() and (why := _replaceable(out)) is not None:
        raise ArtifactWriteError(f"{out}: refusing to replace it with --force: {why}")
    parent = out.parent if str(out.parent) else Path(".")
    fds: list[int] = []
    try:
        parent.mkdir(parents=True, exist_ok=True)
        sweep_stale_staging(parent, out.name)
        tmp, fd = _locked_tempdir(f".{out.name}.partial-", parent)
        fds += [fd] if fd is not None else []
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the artifact gets the usual permissions
    except OSError as e:
        raise ArtifactWriteError(f"{out}: cannot write into {parent} ({e.strerror or e}); choose a writable "
                                 f"output folder with -o") from None
    try:
        yield tmp
        if out.exists():
            old, fd = _locked_tempdir(f".{out.name}.old-", parent)
            fds += [fd] if fd is not None else []
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)


# -- documents --------------------------------------------------------------------------------------


def lints_doc(ctx) -> dict:
    from compiler.lints import sort_findings
    findings = sort_findings(ctx.findings)
    counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "counts": counts,
            "findings": [f.to_json() for f in findings]}


# -- weights ------------------------------------------------------------------------------------------


def checkpoint_index(ckpt_dir: Path, checkpoint_files) -> dict[str, tuple[Path, dict, int]]:
    """name -> (file, header entry, data start) for every tensor of the checkpoint's safetensors files
    (`checkpoint_files(ckpt_dir)`: the toolchain's list, which validates index, duplicates and truncation)."""
    out = {}
    for fname in checkpoint_files(ckpt_dir):
        path = ckpt_dir / fname
        header_bytes, header = safetensors_header(path)
        for name, entry in header.items():
            if name != "__metadata__":
                out[name] = (path, entry, len(header_bytes))
    return out


def _check_sources(sources, index, computed=(), shard_facts=None) -> list[str]:
    """The checkpoint tensors the programs need, each checked against the index: present, and of
    the shape the model expects (the whole model's, for a rank of a tensor-parallel compile)."""
    needed = sorted({v.name for src in sources.values() for v in src.views} - set(computed))
    for name in needed:
        if name not in index:
            raise ArtifactWriteError(f"checkpoint: tensor {name!r} is missing (the model needs it); fix the checkpoint "
                                     f"or its config.json")
    shapes = {v.name: v.shape for src in sources.values() for v in src.views}
    shapes.update({name: fact.whole for name, fact in (shard_facts or {}).items()})
    for name in needed:
        got = tuple(index[name][1]["shape"])
        if got != shapes[name]:
            raise ArtifactWriteError(f"{index[name][0]}: tensor {name!r} has shape {list(got)}, the model expects "
                                     f"{list(shapes[name])} from config.json")
    return needed


def copy_weights(dest: Path, names: list[str], index, progress=None) -> str:
    """A safetensors file holding `names` (sorted), their bytes copied from the checkpoint in chunks.

    Returns the file's SHA-256, computed while writing (the manifest needs it; reading gigabytes
    back just to hash them would double the write time). `progress`: a tqdm-like factory."""
    digest = hashlib.sha256()
    header, offset = {}, 0
    for name in names:
        _, entry, _ = index[name]
        begin, end = entry["data_offsets"]
        header[name] = {"dtype": entry["dtype"], "shape": entry["shape"], "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors pads its header to 8 bytes
    bar = progress(total=offset, desc="write weights", unit="B", unit_scale=True) if progress else None
    with open(dest, "wb") as out:
        for head in (len(blob).to_bytes(8, "little"), blob):
            out.write(head)
            digest.update(head)
        for name in names:
            path, entry, start = index[name]
            begin, end = entry["data_offsets"]
            with open(path, "rb") as src:
                src.seek(start + begin)
                left = end - begin
                while left > 0:
                    chunk = src.read(min(left, 1 << 24))
                    if not chunk:
                        raise ArtifactWriteError(f"{path}: truncated while copying tensor {name!r}")
                    out.write(chunk)
                    digest.update(chunk)
                    left -= len(chunk)
                    if bar is not None:
                        bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return digest.hexdigest()


def link_weights(artifact_out: Path, names: list[str], index, progress=None) -> list[dict]:
    """The checkpoint files holding `names`, with what the loader checks (size and header SHA-256)
    and what `hgc verify --full` checks (the SHA-256 of the whole file: reading it once here is the
    price of being able to tell, later, that a byte of a linked tensor changed).

    Each file is recorded twice: relative to the artifact folder (the pair moves together) and
    absolute (the artifact moves alone); the loader takes the first that exists.
    """
    files = sorted({index[n][0] for n in names})
    entries = []
    if progress is not None:
        files = progress(files, desc="hash linked weights", unit="file")
    for path in files:
        header, _ = safetensors_header(path)
        entries.append({
            "relative_path": os.path.relpath(path.resolve(), artifact_out.resolve()),
            "absolute_path": str(path.resolve()),
            "size": path.stat().st_size,
            "header_sha256": hashlib.sha256(header).hexdigest(),
            "sha256": sha256_file(path),
        })
    return entries


# -- the artifact --------------------------------------------------------------------------------------


def _write_computed(tmp: Path, computed: dict, index) -> None:
    from safetensors.torch import save_file

    clash = sorted(set(computed) & set(index or {}))
    if clash:
        raise ArtifactWriteError(f"checkpoint: tensor {clash[0]!r} is also one the model computes from config.json; "
                                 f"the family must name its computed tensors apart")
    save_file({name: t.detach().contiguous().cpu() for name, t in sorted(computed.items())}, str(tmp / COMPUTED),
              metadata={"format": "pt"})


def write_artifact(tmp: Path, out: Path, result, index, ckpt_dir: Path, tokenizer_files, link: bool = False,
                   progress=None) -> dict:
    """Write every file of the artifact into `tmp` (which becomes `out`); returns the manifest.

    `index` is `checkpoint_index(ckpt_dir, ...)`: where each checkpoint tensor's bytes are; None
    for a compile without weights (mode "none").
    `tokenizer_files(ckpt_dir)`: the checkpoint's tokenizer files (data only: JSON and a Jinja
    template), copied so a served artifact needs nothing from the checkpoint folder; the runtime
    owns the list of names (compiler/toolchain.py). `progress`: a tqdm-like factory (bars over
    the weight bytes)."""
    traced, ctx = result.traced, result.ctx
    for program, ep in traced.programs.items():
        torch.export.save(ep, tmp / PROGRAM_FILES[program])
    known: dict[str, str] = {}  # file -> SHA-256 already computed
    if index is None:
        weights = {"mode": "none"}
    else:
        names = _check_sources(traced.tensors, index, traced.computed, traced.shard_facts)
        if link:
            weights = {"mode": "link", "files": link_weights(out, names, index, progress)}
        else:
            known[WEIGHTS] = copy_weights(tmp / WEIGHTS, names, index, progress)
            weights = {"mode": "copy", "file": WEIGHTS}
    if traced.computed:
        _write_computed(tmp, traced.computed, index)
    tokenizer = tokenizer_files(Path(ckpt_dir))
    for name, data in tokenizer.items():
        (tmp / name).write_bytes(data)
    docs = {
        WEIGHT_MAP: weights_doc(traced.tensors, traced.program_fqns),
        ROUTING: routing_doc(ctx.config.target, ctx.config.routes, ctx.capabilities,
                             {p: ctx.routing.get(p, []) for p in ctx.program_names}),
        SPLIT: split_doc({p: ctx.split_plans[p] for p in ctx.program_names}),
        LINTS: lints_doc(ctx),
    }
    if ctx.tp > 1:
        from compiler.passes.sharding import sharding_summary
        docs[SHARDING] = sharding_doc(sharding_summary(ctx))
    for name, doc in docs.items():
        (tmp / name).write_bytes(dump_json(doc))
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        rel = path.relative_to(tmp).as_posix()
        files[rel] = known.get(rel) or sha256_file(path)
    fingerprints = result.fingerprints
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "versions": {"hgc": hgc_version(), "torch": torch.__version__, "python": platform.python_version()},
        "op_schemas": op_schemas(),
        "family": traced.family.name,
        "model_type": traced.config.get("model_type"),
        "config": traced.config,
        "model": {"vocab_size": int(traced.text_config["vocab_size"]),
                  "hidden_size": int(traced.text_config["hidden_size"])},
        "compile": ctx.config.to_json(),
        "buckets": {"decode_batch_sizes": list(ctx.config.decode_batch_sizes),
                    "extend_token_counts": list(ctx.config.extend_token_counts)},
        "registry": ctx.registry.to_json(),
        "programs": {p: {"file": PROGRAM_FILES[p], "inputs": list(PROGRAM_INPUTS[p]),
                         "outputs": list(program_outputs(p, traced.programs)), "example_sizes": traced.sizes,
                         "modes": [m.value for m in MODES]} for p in traced.programs},
        "passes": fingerprints,
        "pipeline_sha256": hashlib.sha256(dump_json(fingerprints)).hexdigest(),
        "weights": weights,
        "tokenizer": sorted(tokenizer),
        "files": files,
    }
    manifest = seal_manifest(manifest)
    (tmp / MANIFEST).write_bytes(dump_json(manifest))
    return manifest



# -- target bundles -------------------------------------------------------------------------------


def add_bundle(artifact: Path, key: str, staged: Path, facts: dict, force: bool = False) -> dict:
    """Move a built bundle folder (compiler/splitops/bundle.py) into artifact/targets/<key>/ and list
    it in manifest.json: every file's SHA-256 under "files", the bundle under "targets". Returns the
    manifest. An existing bundle of that key is replaced only with `force`.

    The new manifest is written beside the old one first and renamed over it last, after the
    bundle folder is in place: an interrupted build leaves either the old artifact or one whose
    unlisted bundle files the loader refuses by name, never a manifest listing absent files."""
    from compiler.splitops.artifact import load_json
    from compiler.splitops.bundle import BUNDLE, bundle_dir

    artifact = Path(artifact)
    dest = artifact / bundle_dir(key)
    if dest.exists() and not force:
        raise ArtifactWriteError(f"{dest}: a bundle for {key} exists; pass --force to replace it")
    manifest = load_json(artifact / MANIFEST, "manifest")
    prefix = bundle_dir(key) + "/"
    files = {name: sha for name, sha in manifest["files"].items() if not name.startswith(prefix)}
    files.update({prefix + p.relative_to(staged).as_posix(): sha256_file(p)
                  for p in sorted(staged.rglob("*")) if p.is_file()})
    targets = dict(manifest.get("targets") or {})
    targets[key] = {"bundle": prefix + BUNDLE, "facts": facts}
    manifest.update(files=files, targets=targets)
    manifest = seal_manifest(manifest)  # the loader checks the seal: the bundle's entries are the compiler's
    pending = artifact / f".{MANIFEST}.pending"
    pending.write_bytes(dump_json(manifest))
    old = None
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{key}.old-", dir=dest.parent))
        os.replace(dest, old / key)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(staged), str(dest))
    os.replace(pending, artifact / MANIFEST)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return manifest
