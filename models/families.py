"""The family table: family id -> how to read its config, build its model and its registry.

Each family module (models/qwen3_next.py, ...) declares one `Family`. Commands take a family id
(`--family qwen3_next`); checkpoints are matched to a family by their config's `model_type`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from compiler.splitops import LayerRegistry
from models.common import CheckpointError, HybridLM

__all__ = ["Family", "FAMILY_IDS", "get_family", "family_for_config", "SIZES"]

SIZES = ("tiny", "small", "bench")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # the family id used by every command
    model_types: tuple[str, ...]  # config.json model_type values it serves
    text_config: Callable[[dict], dict]  # config.json -> the flat text-model config (validated)
    registry: Callable[[dict], LayerRegistry]  # text config -> registry (main + draft layers)
    # (text config, tp=1) -> model with uninitialised weights: the whole model, or one rank of tp
    # (models/common.py, "Tensor parallelism")
    build: Callable[..., HybridLM]
    make_config: Callable[[str], dict]  # size -> a complete config.json for `hgc init-model`
    init_weights: Callable[[HybridLM, int], None]  # seeded random weights of sensible scale
    transformers_loadable: bool  # whether transformers' AutoModelForCausalLM reads our checkpoints
    # Prefixes of checkpoint tensors that this text config deliberately leaves unread (a vision
    # tower, an MTP layer the config does not enable). Any other unknown tensor is an error.
    unread_tensors: Callable[[dict], tuple[str, ...]] = lambda text_config: ()


FAMILY_IDS = ("qwen3_next", "qwen3_5", "kimi_linear", "bailing_linear")
_MODULES = {"qwen3_next": "models.qwen3_next", "qwen3_5": "models.qwen3_5",
            "kimi_linear": "models.kimi_linear", "bailing_linear": "models.bailing_linear"}


def get_family(name: str) -> Family:
    if name not in _MODULES:
        raise ValueError(f"unknown family {name!r} (families: {', '.join(FAMILY_IDS)})")
    return importlib.import_module(_MODULES[name]).FAMILY


def family_for_config(config: dict, source: str = "config.json") -> Family:
    model_type = config.get("model_type")
    if model_type is None:
        raise CheckpointError(f"{source}: no 'model_type' field")
    for name in FAMILY_IDS:
        family = get_family(name)
        if model_type in family.model_types:
            return family
    known = sorted(t for n in FAMILY_IDS for t in get_family(n).model_types)
    raise CheckpointError(f"{source}: unknown model_type {model_type!r} (hgc serves: {', '.join(known)})")
