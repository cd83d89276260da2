"""The weights of an artifact: each program parameter assembled from checkpoint tensors, on the device.

weights.json says which checkpoint tensors (views: offset, shape, stride) fill each model tensor;
they come from weights.safetensors or, with `hgc compile --link-weights`, from the checkpoint's own
files, whose size and header hash are checked.

Linked weights are checked at load by file size and the SHA-256 of each safetensors header
(names, dtypes, shapes, offsets), not of the data: hashing every weight byte at each load is
exactly what linking avoids. The compiler also records the SHA-256 of each whole linked file, and
`hgc verify ARTIFACT --full` (`check_linked_files(docs, data=True)`) re-hashes them: a changed
byte inside a linked tensor is found there, not at load.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from compiler.splitops.artifact import MANIFEST, WEIGHT_MAP, WEIGHTS, ParamSource, safetensors_header
from runtime.artifact_docs import ArtifactDocs, LoadError, check_hash

__all__ = ["WeightFiles", "assemble", "check_linked_files"]


class WeightFiles:
    """name -> (file, safe_open handle) over weights.safetensors or the linked checkpoint files."""

    def __init__(self, docs: ArtifactDocs, device: str):
        from safetensors import safe_open

        root, spec = docs.path, docs.manifest["weights"]
        if spec.get("mode") == "copy":
            paths = [root / spec.get("file", WEIGHTS)]
            check_hash(paths[0], docs.manifest["files"][WEIGHTS], WEIGHTS)
        elif spec.get("mode") == "link":
            paths = [self._linked(root, entry) for entry in spec.get("files", [])]
        else:
            raise LoadError(f"{root / MANIFEST}: weights.mode {spec.get('mode')!r} (expected 'copy' or 'link')")
        self.where: dict[str, object] = {}
        for p in paths:
            handle = safe_open(str(p), framework="pt", device="cpu")
            for name in handle.keys():
                self.where.setdefault(name, handle)

    @staticmethod
    def _linked(root: Path, entry: dict) -> Path:
        candidates = [root / entry["relative_path"], Path(entry["absolute_path"])]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise LoadError(f"{root}: linked weights file {entry['relative_path']} (absolute {entry['absolute_path']}) "
                            f"is missing: the checkpoint moved; recompile or restore it")
        size = found.stat().st_size
        if size != entry["size"]:
            raise LoadError(f"{found}: {size} bytes, the artifact linked a file of {entry['size']} bytes: the checkpoint "
                            f"changed after compile; recompile")
        header, _ = safetensors_header(found)
        if hashlib.sha256(header).hexdigest() != entry["header_sha256"]:
            raise LoadError(f"{found}: its safetensors header differs from the one the artifact linked: the "
                            f"checkpoint changed after compile; recompile")
        return found

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.where[name].get_tensor(name)
        except KeyError:
            raise LoadError(f"weights: tensor {name!r} listed in weights.json is in no weights file") from None


def check_linked_files(docs: ArtifactDocs, data: bool = False, progress=None) -> tuple[int, int]:
    """Each linked checkpoint file: found, its size and header as compiled, and with `data` the
    SHA-256 of the whole file (`progress`: a tqdm-like factory, a bar over the bytes). Returns
    (files, bytes); (0, 0) for copied weights."""
    spec = docs.manifest["weights"]
    if spec.get("mode") != "link":
        return 0, 0
    paths = [(WeightFiles._linked(docs.path, entry), entry) for entry in spec.get("files", [])]
    total = sum(p.stat().st_size for p, _ in paths)
    if not data:
        return len(paths), total
    bar = progress(total=total, desc="hash linked weights", unit="B", unit_scale=True) if progress else None
    for path, entry in paths:
        if not isinstance(entry.get("sha256"), str):
            raise LoadError(f"{docs.path / MANIFEST}: linked file {entry['relative_path']} has no data hash: recompile")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
                if bar is not None:
                    bar.update(len(block))
        if digest.hexdigest() != entry["sha256"]:
            raise LoadError(f"{path}: its data differs from the file the artifact linked (SHA-256 "
                            f"{digest.hexdigest()[:16]}..., recorded {entry['sha256'][:16]}...): the checkpoint "
                            f"changed after compile; recompile")
    if bar is not None:
        bar.close()
    return len(paths), total


def assemble(fqn: str, source: ParamSource, files: WeightFiles, device: str) -> torch.Tensor:
    dtype = getattr(torch, source.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise LoadError(f"{WEIGHT_MAP}: tensor {fqn} has unknown dtype {source.dtype!r}")
    # Always a fresh allocation filled with copy_, as the eager model's load does: a tensor read
    # from safetensors may sit at any 8-byte offset of the file, and CPU kernels pick different
    # vector paths (different rounding) for differently aligned data.
    out = torch.empty(source.shape, dtype=dtype, device=device)
    if source.is_whole():
        t = files.get(source.views[0].name)
        if tuple(t.shape) != source.shape:
            raise LoadError(f"weights: {source.views[0].name} has shape {list(t.shape)}, {fqn} needs {list(source.shape)}")
        return out.copy_(t)
    if sum(v.numel for v in source.views) != source.numel:
        raise LoadError(f"{WEIGHT_MAP}: the views of {fqn} do not cover it exactly")
    for v in source.views:
        t = files.get(v.name)
        if tuple(t.shape) != v.shape:
            raise LoadError(f"weights: {v.name} has shape {list(t.shape)}, its place in {fqn} is {list(v.shape)}")
        out.as_strided(v.shape, v.stride, v.offset).copy_(t)
    return out

