"""The weights of an artifact: each program parameter assembled from checkpoint tensors, on the device.

weights.json says which checkpoint tensors (views: offset, shape, stride) fill each model tensor;
they come from weights.safetensors or, with `hgc compile --link-weights`, from the checkpoint's own
files, whose size and header hash are checked.

Tensor parallel: a rank of a --tp N artifact reads only its part of each tensor, with safetensors'
`get_slice` over the ranges sharding.json's spec gives it (compiler/splitops/sharding.py), so no
rank reads the whole model; the views of weights.json are already the rank's (the programs are a
rank's). Tensors the model computes from its config (computed.safetensors) are read the same way.

Row orders: a view may say that the program holds the checkpoint tensor's rows in another order
(compiler/splitops/rows.py: Qwen3-Next's GDN projections, stored per key head, held q | k | v | z |
b | a). The files keep the checkpoint's order; `assemble` rearranges the rows this rank read, a
rank's rows being whole groups (its key heads), so the order recorded is the rank's.

`--load-format dummy`: every checkpoint tensor is random instead, N(0, 0.02) in float32 from a
generator on the device seeded by the tensor's name, made whole and then cut like a file's tensor,
so a rank of tp 2 holds exactly the values a tp 1 run holds (their tokens can be compared), and a
full-size release runs from config.json alone (an artifact compiled with --no-weights).

Linked weights are checked at load by file size and the SHA-256 of each safetensors header
(names, dtypes, shapes, offsets), not of the data: hashing every weight byte at each load is
exactly what linking avoids. The compiler also records the SHA-256 of each whole linked file, and
`hgc verify ARTIFACT --full` (`check_linked_files(docs, data=True)`) re-hashes them: a changed
byte inside a linked tensor is found there, not at load.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
from pathlib import Path

import torch

from compiler.splitops.artifact import COMPUTED, MANIFEST, WEIGHT_MAP, WEIGHTS, ParamSource, safetensors_header
from runtime.artifact.docs import ArtifactDocs, LoadError, check_hash

__all__ = ["WeightFiles", "assemble", "check_linked_files", "check_load_format", "dummy_tensor", "whole_shapes",
           "LOAD_FORMATS", "DUMMY_STD"]

LOAD_FORMATS = ("auto", "dummy")  # auto: the artifact's weights; dummy: random ones (module docstring)
DUMMY_STD = 0.02


class WeightFiles:
    """name -> this rank's part of a checkpoint tensor: from weights.safetensors, the linked checkpoint
    files or computed.safetensors, or random (`dummy`).

    The SHA-256 of each copied file is checked on a thread of its own (hashlib holds no GIL) while
    the caller reads tensors: a multi-GB file is hashed in the time its tensors take to reach the
    device, not before them. Nothing read may be used before `checked()` returns: it waits for the
    hashes and raises the first mismatch."""

    def __init__(self, docs: ArtifactDocs, device: str, rank: int = 0, dummy: bool = False,
                 whole_shapes: dict[str, tuple[int, ...]] | None = None):
        from safetensors import safe_open

        root, spec = docs.path, docs.manifest["weights"]
        self.sharding, self.rank, self.device, self.dummy = docs.sharding, rank, device, dummy
        self.whole_shapes = whole_shapes or {}
        paths, hashed = [], []
        if dummy:
            pass  # nothing is read: `get` makes every checkpoint tensor
        elif spec.get("mode") == "copy":
            paths = [root / spec.get("file", WEIGHTS)]
            hashed.append((paths[0], docs.manifest["files"][WEIGHTS], WEIGHTS))
        elif spec.get("mode") == "link":
            paths = [self._linked(root, entry) for entry in spec.get("files", [])]
        elif spec.get("mode") == "none":
            check_load_format(docs, "auto")  # raises: the artifact has no weights to read
        else:
            raise LoadError(f"{root / MANIFEST}: weights.mode {spec.get('mode')!r} (expected 'copy', 'link' or 'none')")
        if COMPUTED in docs.manifest["files"]:
            hashed.append((root / COMPUTED, docs.manifest["files"][COMPUTED], COMPUTED))
            paths.append(root / COMPUTED)
        hashing = concurrent.futures.ThreadPoolExecutor(max(1, len(hashed)), thread_name_prefix="hgc-hash")
        self._hashing = [hashing.submit(check_hash, *check) for check in hashed]
        hashing.shutdown(wait=False)  # its threads end with their hashes
        self.where: dict[str, object] = {}
        try:
            for p in paths:
                handle = safe_open(str(p), framework="pt", device="cpu")
                for name in handle.keys():
                    self.where.setdefault(name, handle)
        except Exception:
            self.checked()  # a file that fails its hash is the error to report, not what parsing it did
            raise

    def checked(self) -> None:
        """Wait for every file's hash check; raise the first mismatch (LoadError)."""
        for check in self._hashing:
            check.result()

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

    def _ranges(self, name: str):
        """(dim, [(start, stop), ...]) of this rank's part of `name`, or None for the whole tensor."""
        if self.sharding is None:
            return None
        spec = self.sharding.spec(name)
        return None if spec.replicated else (spec.dim, spec.rank_slices(self.rank, self.sharding.tp))

    def get(self, name: str) -> torch.Tensor:
        ranges = self._ranges(name)
        if name not in self.where:
            if not self.dummy:
                raise LoadError(f"weights: tensor {name!r} listed in weights.json is in no weights file")
            return self._cut(self._random(name), ranges)
        handle = self.where[name]
        if ranges is None:
            return handle.get_tensor(name)
        dim, spans = ranges
        part = handle.get_slice(name)
        pieces = [part[(slice(None),) * dim + (slice(a, b),)] for a, b in spans]  # only these bytes are read
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    @staticmethod
    def _cut(t: torch.Tensor, ranges) -> torch.Tensor:
        if ranges is None:
            return t
        dim, spans = ranges
        pieces = [t.narrow(dim, a, b - a) for a, b in spans]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    def _random(self, name: str) -> torch.Tensor:
        if name not in self.whole_shapes:
            raise LoadError(f"weights: no shape known for tensor {name!r} (weights.json does not list it)")
        return dummy_tensor(name, self.whole_shapes[name], self.device)


def dummy_tensor(name: str, shape: tuple[int, ...], device: str = "cpu") -> torch.Tensor:
    """The whole checkpoint tensor `name` under `--load-format dummy`: a function of its name and
    shape alone, so every rank count cuts the same values (module docstring)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & ((1 << 63) - 1)
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=generator, device=device) * DUMMY_STD


def check_load_format(docs: ArtifactDocs, load_format: str) -> None:
    """Refuse, before anything is read or launched, a load format the artifact cannot run: an unknown
    one, or its own weights when it was compiled without any."""
    if load_format not in LOAD_FORMATS:
        raise LoadError(f"--load-format {load_format!r}: expected one of {', '.join(LOAD_FORMATS)}")
    if load_format == "auto" and docs.manifest["weights"].get("mode") == "none":
        raise LoadError(f"{docs.path}: compiled with --no-weights: it has no weights; run it with --load-format dummy "
                        f"(random weights), or compile the checkpoint with its safetensors")


def whole_shapes(sources: dict[str, ParamSource], sharding) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> its whole shape, from weights.json's (rank) views and sharding.json's specs."""
    out = {}
    for source in sources.values():
        for v in source.views:
            shape = list(v.shape)
            if sharding is not None and not sharding.spec(v.name).replicated:
                spec = sharding.spec(v.name)
                shape[spec.dim] = sum(length for length, _ in spec.segments)
            out[v.name] = tuple(shape)
    return out


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
        if v.rows is not None:
            if v.rows.rows != v.shape[0]:
                raise LoadError(f"{WEIGHT_MAP}: {v.name} has {v.shape[0]} rows, its row order {v.rows} is for "
                                f"{v.rows.rows}")
            t = v.rows.to_held(t)  # the checkpoint's row order -> the program's (module docstring)
        out.as_strided(v.shape, v.stride, v.offset).copy_(t)
    return out
