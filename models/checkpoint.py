"""Hugging Face style checkpoint directories: config.json plus safetensors (single or sharded).

Reading never unpickles: safetensors only. Every error names the file and the field or tensor
at fault. Writing goes to a temporary folder that is renamed into place, so an interrupted
write leaves no half checkpoint.

Tensor dtypes: every tensor must be stored in the dtype config.json declares (`torch_dtype` /
`dtype`, float32 when absent), or in float32. The float32 exception is the one documented cast:
published bfloat16 checkpoints keep some small tensors (gate logs, biases, norms) in float32, and
the model casts every tensor to its own dtype on load. Anything else (an integer tensor, float64,
float16 in a bfloat16 checkpoint) is refused naming the tensor: a cast would change the weights
silently.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.common import CheckpointError

__all__ = ["read_config", "CheckpointReader", "write_checkpoint", "INDEX_NAME", "SINGLE_NAME", "STORED_DTYPES",
           "check_stored_dtype", "check_output_folder", "check_safetensors_header"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors' dtype codes of the floating types a checkpoint tensor may be stored in
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def check_stored_dtype(path: Path, name: str, stored: str, declared: torch.dtype) -> None:
    """Refuse a tensor stored in another dtype than config.json declares (float32 is accepted: the
    module docstring says why)."""
    if STORED_DTYPES.get(stored) in (declared, torch.float32):
        return
    want = str(declared).removeprefix("torch.")
    raise CheckpointError(f"{path}: tensor {name!r} is stored as {stored}, config.json declares {want} "
                          f"(torch_dtype); rewrite the tensor in {want} or float32, or fix config.json")


def read_config(ckpt_dir: str | os.PathLike) -> dict:
    path = Path(ckpt_dir) / "config.json"
    if not Path(ckpt_dir).is_dir():
        raise CheckpointError(f"{ckpt_dir}: not a directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a checkpoint directory needs config.json)")
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable: {e}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object at the top level")
    return obj


class CheckpointReader:
    """Maps tensor name -> file for a checkpoint directory and reads tensors lazily (mmap).

    `dtype`: the dtype config.json declares; every tensor's stored dtype is checked against it."""

    def __init__(self, ckpt_dir: str | os.PathLike, dtype: torch.dtype | None = None):
        self.dir = Path(ckpt_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e}") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.dir}: no *.safetensors files and no {INDEX_NAME}")
            weight_map = None
        self.files = files
        self._handles = {}
        self.location: dict[str, str] = {}
        for fname in files:
            handle = self._open(fname)
            for name in handle.keys():
                if name in self.location:
                    raise CheckpointError(f"{self.dir / fname}: tensor {name!r} also stored in {self.location[name]}")
                if dtype is not None:
                    check_stored_dtype(self.dir / fname, name, handle.get_slice(name).get_dtype(), dtype)
                self.location[name] = fname
        if weight_map is not None:
            for name, fname in weight_map.items():
                if self.location.get(name) != fname:
                    raise CheckpointError(f"{index}: lists tensor {name!r} in {fname}, which does not hold it")

    def _open(self, fname: str):
        path = self.dir / fname
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {INDEX_NAME})")
        # Its header first, field by field: a parser's complaint about random bytes names neither
        # the file nor what is wrong ("cannot fit 'int' into an index-sized integer").
        check_safetensors_header(path)
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from None
        self._handles[fname] = handle
        return handle

    def names(self) -> set[str]:
        return set(self.location)

    def get(self, name: str) -> torch.Tensor:
        fname = self.location[name]  # KeyError for an absent tensor: the caller names it
        return self._handles[fname].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.location[name]].get_slice(name).get_shape())

    def where(self, name: str) -> Path:
        return self.dir / self.location[name]


# bytes per element of each safetensors dtype code
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
               "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def check_safetensors_header(path: Path) -> dict:
    """A safetensors file's header, checked field by field against the file: the 8-byte length, the
    JSON, and each tensor's dtype, shape and data_offsets (inside the data, as long as the shape
    says). Returns the header; refuses the first bad field, naming the file (and the tensor)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > size - 8:
            raise CheckpointError(f"{path}: not a safetensors file: its header length (first 8 bytes) says {n} "
                                  f"bytes, the file has {size - 8} after it (truncated or not safetensors)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file: its header is not a JSON object")
    data = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: header entry is not an object")
        if entry.get("dtype") not in _ITEM_BYTES:
            raise CheckpointError(f"{where}: field 'dtype' is {entry.get('dtype')!r}, not a safetensors dtype")
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: field 'shape' is {shape!r}, not a list of sizes")
        offsets = entry.get("data_offsets")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where}: field 'data_offsets' is {offsets!r}, not [begin, end]")
        if offsets[1] > data:
            raise CheckpointError(f"{path}: truncated: {size} bytes, tensor {name!r} ends at byte {8 + n + offsets[1]}")
        numel = 1
        for d in shape:
            numel *= d
        if offsets[1] - offsets[0] != numel * _ITEM_BYTES[entry["dtype"]]:
            raise CheckpointError(f"{where}: field 'data_offsets' spans {offsets[1] - offsets[0]} bytes, its shape "
                                  f"{shape} of {entry['dtype']} needs {numel * _ITEM_BYTES[entry['dtype']]}")
    return header


def check_output_folder(out: Path, overwrite: bool) -> None:
    """Refuse to write a checkpoint over an existing `out`, unless `overwrite` and it is a
    checkpoint folder or an empty one: --force never deletes someone's other files."""
    if not out.exists():
        return
    if not overwrite:
        raise FileExistsError(f"{out}: already exists; pass --force to replace it, or choose another -o")
    if not out.is_dir():
        raise FileExistsError(f"{out}: exists and is not a folder; choose another -o")
    entries = list(out.iterdir())
    if not entries or ((out / "config.json").is_file() and any(out.glob("*.safetensors"))):
        return
    shown = ", ".join(sorted(e.name for e in entries)[:3]) + (", ..." if len(entries) > 3 else "")
    raise FileExistsError(f"{out}: refusing to replace it with --force: it is not a checkpoint folder (no "
                          f"config.json beside *.safetensors; it holds {shown}); --force replaces only a checkpoint "
                          f"or an empty folder")


def write_checkpoint(out_dir: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor],
                     shard_bytes: int | None = None, extra_files: dict[str, str] | None = None,
                     overwrite: bool = False, progress=None) -> Path:
    """Write config.json and safetensors shards (with an index when more than one) atomically.

    `overwrite` replaces a checkpoint folder or an empty one, and refuses anything else.
    `progress`: a tqdm-like factory, for a bar over the shards as they are written."""
    out = Path(out_dir)
    check_output_folder(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name in sorted(tensors):
            t = tensors[name].detach().contiguous().cpu()
            if shard_bytes and size and size + t.nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t.clone() if t.untyped_storage().nbytes() != t.nbytes else t
            size += t.nbytes
        n = len(shards)
        files = [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        pairs = list(zip(files, shards))
        for fname, shard in progress(pairs, desc="write shards", unit="shard") if progress else pairs:
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        if n > 1:
            weight_map = {name: fname for fname, shard in pairs for name in shard}
            total = sum(t.nbytes for t in tensors.values())
            (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                     indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
