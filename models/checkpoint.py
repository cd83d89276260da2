"""Hugging Face style checkpoint directories: config.json plus safetensors (single or sharded).

Reading never unpickles: safetensors only. Every error names the file and the field or tensor
at fault. Writing goes to a temporary folder that is renamed into place, so an interrupted
write leaves no half checkpoint.
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

__all__ = ["read_config", "CheckpointReader", "write_checkpoint", "INDEX_NAME", "SINGLE_NAME"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


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
    """Maps tensor name -> file for a checkpoint directory and reads tensors lazily (mmap)."""

    def __init__(self, ckpt_dir: str | os.PathLike):
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
                self.location[name] = fname
        if weight_map is not None:
            for name, fname in weight_map.items():
                if self.location.get(name) != fname:
                    raise CheckpointError(f"{index}: lists tensor {name!r} in {fname}, which does not hold it")

    def _open(self, fname: str):
        path = self.dir / fname
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (listed in {INDEX_NAME})")
        # A truncated file can still have a whole header: check the data length it declares
        # first, so the message says "truncated" rather than a parser's complaint.
        self._check_length(path)
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{path}: not a readable safetensors file: {e}") from None
        self._handles[fname] = handle
        return handle

    @staticmethod
    def _check_length(path: Path) -> None:
        """The data section must be as long as the header's offsets say (catches truncation)."""
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (no header)")
            n = int.from_bytes(head, "little")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"{path}: truncated or corrupt header") from None
        try:
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (AttributeError, KeyError, TypeError, ValueError, IndexError):
            raise CheckpointError(f"{path}: not a safetensors header (no tensor data offsets)") from None
        size = path.stat().st_size
        if size < 8 + n + end:
            raise CheckpointError(f"{path}: truncated: {size} bytes, the header describes {8 + n + end}")

    def names(self) -> set[str]:
        return set(self.location)

    def get(self, name: str) -> torch.Tensor:
        fname = self.location[name]  # KeyError for an absent tensor: the caller names it
        return self._handles[fname].get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.location[name]].get_slice(name).get_shape())

    def where(self, name: str) -> Path:
        return self.dir / self.location[name]


def write_checkpoint(out_dir: str | os.PathLike, config: dict, tensors: dict[str, torch.Tensor],
                     shard_bytes: int | None = None, extra_files: dict[str, str] | None = None,
                     overwrite: bool = False) -> Path:
    """Write config.json and safetensors shards (with an index when more than one) atomically."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out}: already exists")
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
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_NAME), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({name: fname for name in shard})
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
