"""Checkpoint directory -> family model with its weights, and the reverse for `hgc init-model`.

1. read config.json, find the family by model_type, let the family validate its text config;
2. build the model on the meta device (no memory), then materialise it on the target device;
3. check the checkpoint's tensor names against the model's (missing, extra, mis-shaped, stored in
   another dtype than config.json declares: models/checkpoint.py), naming the file and the
   tensor, and copy the tensors in.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from models.checkpoint import CheckpointReader, check_output_folder, read_config, write_checkpoint
from models.common import CheckpointError, HybridLM
from models.families import Family, family_for_config, get_family
from models.tokenizer import tokenizer_files_for_config

__all__ = ["load_config", "build_meta_model", "load_checkpoint", "init_checkpoint", "config_dtype", "check_model_limits"]


def config_dtype(text_config: dict) -> torch.dtype:
    name = text_config.get("torch_dtype") or text_config.get("dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"config.json: field 'torch_dtype' / 'dtype' has unknown value {name!r}")
    return dtype


def load_config(ckpt_dir: str | os.PathLike) -> tuple[Family, dict, dict]:
    """(family, config.json as written, the family's validated flat text config)."""
    config = read_config(ckpt_dir)
    source = str(Path(ckpt_dir) / "config.json")
    family = family_for_config(config, source)
    # before the family reads it: its per-layer lists of a billion layers would take minutes
    for fields in (config, config.get("text_config")):
        if isinstance(fields, dict):
            check_model_limits(fields, source)
    return family, config, family.text_config(config)


# Sizes past which a config cannot be a model hgc builds, refused before anything is built: a
# billion layers would trace for hours; a dimension past int32 breaks the kernels' indexing.
MAX_LAYERS = 1024  # the deepest published models have about 130
MAX_DIM = 2 ** 31 - 1
MAX_TENSOR_ELEMENTS = 2 ** 36  # the embedding (vocab_size x hidden_size): 128 GiB in bfloat16
_DIMS = ("hidden_size", "vocab_size", "intermediate_size", "moe_intermediate_size", "num_experts",
         "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_model_limits(text: dict, source: str) -> None:
    """Refuse config fields no machine could build a model of, naming the field and the limit."""
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and layers > MAX_LAYERS:
        raise CheckpointError(f"{source}: num_hidden_layers is {layers}; hgc builds at most {MAX_LAYERS} layers")
    for field in _DIMS:
        value = text.get(field)
        if isinstance(value, int) and value > MAX_DIM:
            raise CheckpointError(f"{source}: {field} is {value}, past the limit of {MAX_DIM} (2^31 - 1: the "
                                  f"kernels index with 32-bit integers)")
    vocab, hidden = text.get("vocab_size"), text.get("hidden_size")
    if isinstance(vocab, int) and isinstance(hidden, int) and vocab * hidden > MAX_TENSOR_ELEMENTS:
        raise CheckpointError(f"{source}: vocab_size {vocab} x hidden_size {hidden} is {vocab * hidden} embedding "
                              f"values, past the limit of {MAX_TENSOR_ELEMENTS} (2^36) for one tensor")


def build_meta_model(family: Family, text_config: dict) -> HybridLM:
    """The model with meta tensors: structure, registry and tensor shapes, no memory."""
    with torch.device("meta"):
        return family.build(text_config)


def load_checkpoint(ckpt_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> tuple[Family, dict, HybridLM]:
    family, _, text = load_config(ckpt_dir)
    model = build_meta_model(family, text).to_empty(device=device).to(dtype)
    reader = CheckpointReader(ckpt_dir, dtype=config_dtype(text))
    expected = model.checkpoint_shapes()
    unread = family.unread_tensors(text)
    extra = sorted(n for n in reader.names() - set(expected) if not n.startswith(unread))
    if extra:
        raise CheckpointError(f"{reader.where(extra[0])}: unexpected tensor {extra[0]!r} "
                              f"(not part of a {family.name} model with this config.json; {len(extra)} such)")
    missing = sorted(set(expected) - reader.names())
    if missing:
        raise CheckpointError(f"{ckpt_dir}: missing tensor {missing[0]!r} ({len(missing)} missing; "
                              f"files: {', '.join(reader.files)})")

    for name, (shape, _) in expected.items():
        found = reader.shape(name)
        if found != shape:
            raise CheckpointError(f"{reader.where(name)}: tensor {name!r} has shape {list(found)}, "
                                  f"expected {list(shape)} from config.json")
    model.load_checkpoint_tensors(reader.get, source=str(ckpt_dir))
    model.eval()
    return family, text, model


def init_checkpoint(family_name: str, size: str, seed: int, out_dir: str | os.PathLike,
                    shard_bytes: int | None = 2 << 30, overwrite: bool = False, log=None,
                    progress=None) -> Path:
    """Write a seeded random checkpoint of a family in its real file format. Progress lines go to
    `log` (default: sys.stderr as it is at the call, not as it was when this module was imported).
    `progress`: a tqdm-like factory, for a bar over the stages (a bench model takes minutes) and the
    shards."""
    log = log if log is not None else sys.stderr
    family = get_family(family_name)
    config = family.make_config(size)
    text = family.text_config(config)
    check_output_folder(Path(out_dir), overwrite)  # before minutes of work, not after
    print(f"hgc init-model: building {family.name} ({size}) ...", file=log, flush=True)
    stages = progress(total=3, desc="init-model: build", unit="stage") if progress else None
    model = family.build(text)
    if stages is not None:
        stages.set_description("init-model: init weights")
        stages.update()
    family.init_weights(model, seed)
    model = model.to(config_dtype(text))
    if stages is not None:
        stages.set_description("init-model: write")
        stages.update()
    n_params = sum(p.numel() for p in model.parameters())
    line = f"hgc init-model: {n_params / 1e6:.1f}M parameters, writing {out_dir} ..."
    if stages is not None:  # through the bar: a plain print lands after the drawn bar and leaves it part-drawn
        stages.write(line, file=log)
    else:
        print(line, file=log, flush=True)
    # A small trained tokenizer rides along so the server's text and chat paths work offline.
    tokenizer = tokenizer_files_for_config(config, text)
    try:
        return write_checkpoint(out_dir, config, model.checkpoint_tensors(), shard_bytes=shard_bytes,
                                extra_files=tokenizer, overwrite=overwrite, progress=progress)
    finally:
        if stages is not None:
            stages.update()
            stages.close()
