"""Write an artifact folder atomically: a staging folder beside the target, renamed into place.

1. `staging_folder(out, force)` refuses an existing output (unless force), an output that is or
   holds the checkpoint, and an unwritable parent, each with a clear message; it makes a hidden
   temporary folder in the same parent and yields it.
2. The compile runs with its dumps written into the staging folder; `write_artifact` then writes
   graph.pt2 (and draft.pt2), the weights (copied, or linked with --link-weights), weights.json,
   the checkpoint's tokenizer files if it has them, routing.json, split.json, lints.json, and
   last manifest.json with the SHA-256 of every file.
3. On success the staging folder is renamed to the output (an existing one, with --force, is
   moved aside first and deleted after); on any failure or interrupt it is deleted, so no
   half-written artifact is ever left under the output name.

Weights are copied byte for byte from the checkpoint's safetensors files, streamed tensor by
tensor (memory stays flat whatever the model size), under their checkpoint names.

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

import torch

from compiler.splitops.errors import CompileError
from compiler.splitops import MODES, op_schemas
from compiler.splitops.artifact import (FORMAT_NAME, FORMAT_VERSION, LINTS, MANIFEST, PROGRAM_FILES,
                                        PROGRAM_INPUTS, ROUTING, SPLIT, WEIGHT_MAP, WEIGHTS, dump_json, program_outputs,
                                        routing_doc, safetensors_header, sha256_file, split_doc, weights_doc)

__all__ = ["ArtifactWriteError", "staging_folder", "write_artifact", "checkpoint_index", "hgc_version", "lints_doc"]


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
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the artifact gets the usual permissions
    except OSError as e:
        raise ArtifactWriteError(f"{out}: cannot write into {parent} ({e.strerror or e}); choose a writable "
                                 f"output folder with -o") from None
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def _check_sources(sources, index) -> list[str]:
    needed = sorted({v.name for src in sources.values() for v in src.views})
    for name in needed:
        if name not in index:
            raise ArtifactWriteError(f"checkpoint: tensor {name!r} is missing (the model needs it); fix the checkpoint "
                                     f"or its config.json")
    shapes = {v.name: v.shape for src in sources.values() for v in src.views}
    for name in needed:
        got = tuple(index[name][1]["shape"])
        if got != shapes[name]:
            raise ArtifactWriteError(f"{index[name][0]}: tensor {name!r} has shape {list(got)}, the model expects "
                                     f"{list(shapes[name])} from config.json")
    return needed


def copy_weights(dest: Path, names: list[str], index) -> str:
    """A safetensors file holding `names` (sorted), their bytes copied from the checkpoint in chunks.

    Returns the file's SHA-256, computed while writing (the manifest needs it; reading gigabytes
    back just to hash them would double the write time)."""
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
    return digest.hexdigest()


def link_weights(artifact_out: Path, names: list[str], index) -> list[dict]:
    """The checkpoint files holding `names`, with what the loader checks: size and header SHA-256.

    Each file is recorded twice: relative to the artifact folder (the pair moves together) and
    absolute (the artifact moves alone); the loader takes the first that exists.
    """
    files = sorted({index[n][0] for n in names})
    entries = []
    for path in files:
        header, _ = safetensors_header(path)
        entries.append({
            "relative_path": os.path.relpath(path.resolve(), artifact_out.resolve()),
            "absolute_path": str(path.resolve()),
            "size": path.stat().st_size,
            "header_sha256": hashlib.sha256(header).hexdigest(),
        })
    return entries


# -- the artifact --------------------------------------------------------------------------------------


def write_artifact(tmp: Path, out: Path, result, index, ckpt_dir: Path, tokenizer_files, link: bool = False) -> dict:
    """Write every file of the artifact into `tmp` (which becomes `out`); returns the manifest.

    `index` is `checkpoint_index(ckpt_dir, ...)`: where each checkpoint tensor's bytes are.
    `tokenizer_files(ckpt_dir)`: the checkpoint's tokenizer files (data only: JSON and a Jinja
    template), copied so a served artifact needs nothing from the checkpoint folder; the runtime
    owns the list of names (compiler/toolchain.py)."""
    traced, ctx = result.traced, result.ctx
    names = _check_sources(traced.tensors, index)
    for program, ep in traced.programs.items():
        torch.export.save(ep, tmp / PROGRAM_FILES[program])
    known: dict[str, str] = {}  # file -> SHA-256 already computed
    if link:
        weights = {"mode": "link", "files": link_weights(out, names, index)}
    else:
        known[WEIGHTS] = copy_weights(tmp / WEIGHTS, names, index)
        weights = {"mode": "copy", "file": WEIGHTS}
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
    (tmp / MANIFEST).write_bytes(dump_json(manifest))
    return manifest

