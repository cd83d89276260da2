"""Write an artifact folder atomically: a staging folder beside the target, renamed into place.

1. `staging_folder(out, force)` refuses an existing output (unless force, and with force anything
   but an hgc artifact or an empty folder: --force replaces an artifact, never someone's files),
   an output that is or holds the checkpoint, and an unwritable parent, each with a clear message.
   It removes the staging folders that killed compiles left beside the output (`.NAME.partial-*`,
   `.NAME.old-*`: those no live process holds a lock on), claims the output with the one hidden
   staging folder `.NAME.partial-claim` (an exclusive mkdir, locked for as long as this compile
   runs: a second compile into the same output exits 2 naming the first's pid) and yields it.
2. The compile runs with its dumps written into the staging folder; `write_artifact` then writes
   graph.pt2 (and draft.pt2), the weights (copied, or linked with --link-weights: size, header
   hash and data hash of each file), weights.json, the checkpoint's tokenizer files if it has
   them, routing.json, split.json, lints.json, and last manifest.json with the SHA-256 of every
   file, sealed with the hash of its own content.
3. On success the staging folder is renamed to the output (an existing one, with --force, is
   moved aside first and deleted after). Whatever appeared at the output while the compile ran is
   refused, never replaced, unless --force was given (and it is an artifact or empty). On any failure or interrupt (Ctrl-C included) the staging
   folder is deleted, so no half-written artifact is ever left under the output name.
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
import errno
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

from compiler.lints.base import Finding
from compiler.splitops.errors import CompileError
from compiler.splitops import MODES, op_schemas
from compiler.splitops.artifact import (COMPUTED, FORMAT_NAME, FORMAT_VERSION, LINTS, MANIFEST, PROGRAM_FILES,
                                        PROGRAM_INPUTS, ROUTING, SHARDING, SPLIT, WEIGHT_MAP, WEIGHTS, dump_json,
                                        program_outputs, routing_doc, safetensors_header, seal_manifest, sha256_file,
                                        sharding_doc, split_doc, weights_doc)

__all__ = ["ArtifactWriteError", "WRITE_FINDINGS", "staging_folder", "sweep_stale_staging", "write_artifact", "checkpoint_index",
           "hgc_version", "lints_doc", "add_bundle"]


class ArtifactWriteError(CompileError):
    pass


# Findings of the writer itself (added to lints.json beside the passes' and printed by `hgc compile`).
UNUSED_TENSORS, NO_TOKENIZER = "unused_tensors", "no_tokenizer"
WRITE_FINDINGS = (UNUSED_TENSORS, NO_TOKENIZER)


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


def _owner_file(parent: Path, out: Path) -> Path:
    """Beside the claimed staging folder (never in it: the manifest lists that folder's files): the
    pid of the compile that holds the output, for the message of the one refused."""
    return parent / f".{out.name}.partial-claim.pid"


def _claim(parent: Path, out: Path) -> tuple[Path, int | None]:
    """The output's one staging folder, made by an exclusive mkdir and locked for the whole compile:
    a second compile into the same output finds it held and is refused, naming the first. A folder
    left by a killed compile holds no lock: it is removed and claimed again."""
    tmp = parent / f".{out.name}.partial-claim"
    while True:
        try:
            tmp.mkdir()
        except FileExistsError:
            try:
                fd = _lock(tmp)
            except FileNotFoundError:  # its owner finished (or was swept) since the mkdir
                continue
            if fd is None:
                try:
                    owner = f"pid {_owner_file(parent, out).read_text().strip()}"
                except OSError:
                    owner = "another process"
                raise ArtifactWriteError(f"{out}: another hgc compile ({owner}) is writing it now; wait for it to "
                                         f"end, or choose another -o") from None
            shutil.rmtree(tmp, ignore_errors=True)  # stale: no live process holds it
            os.close(fd)
            continue
        try:
            fd = _lock(tmp)
        except FileNotFoundError:  # taken for stale between the mkdir and the lock
            continue
        if fcntl is not None and (fd is None or os.fstat(fd).st_nlink == 0):
            if fd is not None:
                os.close(fd)
            continue
        _owner_file(parent, out).write_text(str(os.getpid()))
        return tmp, fd


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the staging folder to `out`, which did not exist a moment ago. A folder that appeared
    since with something in it makes the rename fail (ENOTEMPTY): it is refused, never replaced."""
    try:
        os.replace(tmp, out)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise ArtifactWriteError(f"{out}: appeared while this compile ran; nothing was replaced: pass --force to "
                                     f"replace it, or choose another -o") from None
        raise


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
        tmp, fd = _claim(parent, out)
        fds += [fd] if fd is not None else []
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the artifact gets the usual permissions
    except OSError as e:
        raise ArtifactWriteError(f"{out}: cannot write into {parent} ({e.strerror or e}); choose a writable "
                                 f"output folder with -o") from None
    try:
        yield tmp
        if out.exists() and not force:
            raise ArtifactWriteError(f"{out}: appeared while this compile ran; nothing was replaced: pass --force to "
                                     f"replace it, or choose another -o")
        if out.exists():
            if (why := _replaceable(out)) is not None:  # someone's files put there since the start
                raise ArtifactWriteError(f"{out}: refusing to replace it with --force: {why}")
            old, fd = _locked_tempdir(f".{out.name}.old-", parent)
            fds += [fd] if fd is not None else []
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _owner_file(parent, out).unlink(missing_ok=True)
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


# safetensors dtype code -> torch dtype, for the floating types whose values are checked while copied
_FLOAT_CODES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CHUNK = 1 << 24  # bytes read at once: a multiple of every item size


def _tensor_chunks(name: str, index, buffer: bytearray, allow_non_finite: bool):
    """The stored bytes of checkpoint tensor `name`, as views of `buffer` one chunk at a time. A
    floating tensor's values are counted as they pass: NaN or inf is refused naming the tensor
    and the count (they always give garbage text), unless `allow_non_finite`."""
    path, entry, start = index[name]
    begin, end = entry["data_offsets"]
    dtype = None if allow_non_finite else _FLOAT_CODES.get(entry["dtype"])
    bad = 0
    with open(path, "rb") as src:
        src.seek(start + begin)
        left = end - begin
        while left > 0:
            got = src.readinto(memoryview(buffer)[:min(left, _CHUNK)])
            if not got:
                raise ArtifactWriteError(f"{path}: truncated while copying tensor {name!r}")
            if dtype is not None:
                values = torch.frombuffer(buffer, dtype=dtype, count=got // dtype.itemsize)
                bad += int(values.numel() - torch.isfinite(values).sum())
            yield memoryview(buffer)[:got]
            left -= got
    if bad:
        count = (end - begin) // dtype.itemsize
        raise ArtifactWriteError(f"{path}: tensor {name!r} has {bad} non-finite value(s) (NaN or inf) of {count}; "
                                 f"pass --allow-non-finite to compile it anyway")


def copy_weights(dest: Path, names: list[str], index, progress=None, allow_non_finite: bool = False) -> str:
    """A safetensors file holding `names` (sorted), their bytes copied from the checkpoint in chunks
    and checked on the way (`_tensor_chunks`).

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
    buffer = bytearray(_CHUNK)
    with open(dest, "wb") as out:
        for head in (len(blob).to_bytes(8, "little"), blob):
            out.write(head)
            digest.update(head)
        for name in names:
            for chunk in _tensor_chunks(name, index, buffer, allow_non_finite):
                out.write(chunk)
                digest.update(chunk)
                if bar is not None:
                    bar.update(len(chunk))
    if bar is not None:
        bar.close()
    return digest.hexdigest()


def check_linked_values(names: list[str], index, allow_non_finite: bool) -> None:
    """The values of linked tensors, checked as a copy would check them (they are not copied)."""
    if allow_non_finite:
        return
    buffer = bytearray(_CHUNK)
    for name in names:
        for _ in _tensor_chunks(name, index, buffer, allow_non_finite):
            pass


def unused_tensors_finding(index, needed: list[str], traced) -> Finding | None:
    """One warning listing the checkpoint's tensors no program reads: usually the wrong checkpoint
    or a layer the family does not map. Tensors the family leaves unread on purpose (an MTP layer
    the config does not enable, a vision tower) are not listed."""
    unread = traced.family.unread_tensors(traced.text_config)
    unused = sorted(set(index) - set(needed) - set(traced.computed) - {n for n in index if n.startswith(unread)})
    if not unused:
        return None
    shown = ", ".join(unused[:5]) + (f", ... ({len(unused)} in all)" if len(unused) > 5 else "")
    return Finding(UNUSED_TENSORS, "warning", f"{len(unused)} checkpoint tensor(s) no program reads: {shown}",
                   "check that the checkpoint is the model config.json describes (a missing layer mapping leaves "
                   "its tensors unread)")


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


@contextlib.contextmanager
def _without_canonical_form_test():
    """torch.export.save without the test torch's serializer runs on every program it serializes.

    After serializing, `ExportedProgramSerializer.serialize` canonicalizes a deep copy of the
    serialized program ("Test canonical form is well defined", torch/_export/serde/serialize.py)
    and throws the copy away: nothing of it is written, and it took about three quarters of the
    save of a tiny model's programs (deep copies of every node's fields). graph.pt2 is the same
    bytes without it (tests/compiler/test_compiler_artifact.py checks them against a save with it).
    The serializer finds the function in its module when it calls it, so it is swapped there for
    the save and put back after; a torch whose serializer has no such function saves as it does."""
    try:
        from torch._export.serde import serialize
    except ImportError:
        yield
        return
    real = getattr(serialize, "canonicalize", None)
    if real is None:
        yield
        return
    serialize.canonicalize = lambda ep, constants=None: ep
    try:
        yield
    finally:
        serialize.canonicalize = real


def write_artifact(tmp: Path, out: Path, result, index, ckpt_dir: Path, tokenizer_files, link: bool = False,
                   progress=None, allow_non_finite: bool = False) -> dict:
    """Write every file of the artifact into `tmp` (which becomes `out`); returns the manifest.

    `index` is `checkpoint_index(ckpt_dir, ...)`: where each checkpoint tensor's bytes are; None
    for a compile without weights (mode "none").
    `tokenizer_files(ckpt_dir)`: the checkpoint's tokenizer files (data only: JSON and a Jinja
    template), copied so a served artifact needs nothing from the checkpoint folder; the runtime
    owns the list of names (compiler/toolchain.py). `progress`: a tqdm-like factory (bars over
    the weight bytes)."""
    traced, ctx = result.traced, result.ctx
    for program, ep in traced.programs.items():
        with _without_canonical_form_test():
            torch.export.save(ep, tmp / PROGRAM_FILES[program])
    known: dict[str, str] = {}  # file -> SHA-256 already computed
    if index is None:
        weights = {"mode": "none"}
    else:
        names = _check_sources(traced.tensors, index, traced.computed, traced.shard_facts)
        if link:
            check_linked_values(names, index, allow_non_finite)
            weights = {"mode": "link", "files": link_weights(out, names, index, progress)}
        else:
            known[WEIGHTS] = copy_weights(tmp / WEIGHTS, names, index, progress, allow_non_finite)
            weights = {"mode": "copy", "file": WEIGHTS}
        if (unused := unused_tensors_finding(index, names, traced)) is not None:
            ctx.findings.append(unused)
    if traced.computed:
        _write_computed(tmp, traced.computed, index)
    tokenizer = tokenizer_files(Path(ckpt_dir))
    if "tokenizer.json" not in tokenizer:
        ctx.findings.append(Finding(NO_TOKENIZER, "warning", f"{ckpt_dir} has no tokenizer.json: the artifact "
                                    f"serves token ids only (a text or chat request is refused)",
                                    "put the model's tokenizer.json beside config.json, or serve with --tokenizer DIR"))
    for name, data in tokenizer.items():
        (tmp / name).write_bytes(data)
    docs = {
        WEIGHT_MAP: weights_doc(traced.tensors, traced.program_fqns),
        ROUTING: routing_doc(ctx.config.target, ctx.config.routes, ctx.capabilities,
                             {p: ctx.routing.get(p, []) for p in ctx.program_names},
                             {p: ctx.fusion.get(p, {}).get("unfused", []) for p in ctx.program_names}),
        SPLIT: split_doc({p: ctx.split_plans[p] for p in ctx.program_names}, ctx.config.extend_token_counts),
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
                    "extend_token_counts": list(ctx.config.extend_token_counts),
                    "chosen_by": ctx.config.buckets_chosen_by,
                    **({"measured": ctx.config.bucket_costs.to_json()} if ctx.config.bucket_costs else {})},
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
