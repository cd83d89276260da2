"""The LayerRegistry: one entry per layer id saying what the layer is. The single source of truth.

Routing binds op nodes to backends by looking layer ids up here; the runtime sizes its KV pool
and state pool from it; lints compare the traced graph against it. Models build it from their
config (normalising interval / list / 1-indexed quirks once, in `models/`), and the artifact
stores it as JSON so the runtime never needs `models/`.

Example::

    >>> reg = LayerRegistry([
    ...     LayerSpec(0, LayerKind.GDN, state={"recurrent": TensorSpec((4, 8, 8), "float32")}),
    ...     LayerSpec(1, LayerKind.FULL_GQA, kv={"k": TensorSpec((2, 8), "bfloat16"),
    ...                                          "v": TensorSpec((2, 8), "bfloat16")}),
    ... ])
    >>> [l.layer_id for l in reg.full_layers()]
    [1]
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Iterable, Iterator

import torch

__all__ = [
    "LayerKind",
    "TensorSpec",
    "LayerSpec",
    "LayerRegistry",
    "RegistryError",
    "FULL_KINDS",
    "LINEAR_KINDS",
    "dtype_from_name",
    "STATE_DTYPES",
]


class RegistryError(ValueError):
    """A registry that contradicts itself (duplicate ids, a draft id clashing with a main id...)."""


class LayerKind(str, enum.Enum):
    FULL_GQA = "full_gqa"  # softmax attention, grouped-query heads, paged K/V
    FULL_MLA = "full_mla"  # softmax attention over a compressed latent (DeepSeek-style MLA)
    GDN = "gdn"  # Gated DeltaNet (Qwen3-Next, Qwen3.5)
    KDA = "kda"  # Kimi Delta Attention: per-channel gated delta rule
    LIGHTNING = "lightning"  # simple GLA with a constant per-head decay (Bailing, MiniMax)


FULL_KINDS = frozenset({LayerKind.FULL_GQA, LayerKind.FULL_MLA})
LINEAR_KINDS = frozenset({LayerKind.GDN, LayerKind.KDA, LayerKind.LIGHTNING})


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RegistryError(f"unknown dtype name {name!r}")
    return dtype


# The dtypes a linear layer's recurrent state may be kept in (`hgc compile --state-dtype`). Kernels
# read it into float32 and round what they store; bfloat16 halves the bytes a decode step moves
# (at 128 requests the state is most of them) and keeps float32's range, which a state summing
# many tokens needs: float16 could overflow, so it is not offered.
STATE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one cache entry: per token for KV, per slot for state."""

    shape: tuple[int, ...]
    dtype: str  # a torch dtype name: "float32", "bfloat16", ...

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, obj: dict) -> "TensorSpec":
        return cls(tuple(int(s) for s in obj["shape"]), str(obj["dtype"]))


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer id. Full layers have `kv` (per-token entries), linear layers `state` (per slot)."""

    layer_id: int
    kind: LayerKind
    draft: bool = False  # an MTP / NextN draft layer, with an id of its own after the main layers
    kv: dict[str, TensorSpec] = dataclasses.field(default_factory=dict)
    state: dict[str, TensorSpec] = dataclasses.field(default_factory=dict)
    mlp: str = "moe"  # "moe" (one hgc.moe op) or "dense" (plain MLP in the graph)
    module: str = ""  # the module class that implements it: informational, never used to route

    @property
    def is_full(self) -> bool:
        return self.kind in FULL_KINDS

    @property
    def is_linear(self) -> bool:
        return self.kind in LINEAR_KINDS

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(s.nbytes for s in self.kv.values())

    @property
    def state_bytes_per_slot(self) -> int:
        return sum(s.nbytes for s in self.state.values())

    def to_json(self) -> dict:
        return {
            "layer_id": self.layer_id,
            "kind": self.kind.value,
            "draft": self.draft,
            "kv": {k: v.to_json() for k, v in self.kv.items()},
            "state": {k: v.to_json() for k, v in self.state.items()},
            "mlp": self.mlp,
            "module": self.module,
        }

    @classmethod
    def from_json(cls, obj: dict) -> "LayerSpec":
        return cls(
            layer_id=int(obj["layer_id"]),
            kind=LayerKind(obj["kind"]),
            draft=bool(obj.get("draft", False)),
            kv={k: TensorSpec.from_json(v) for k, v in obj.get("kv", {}).items()},
            state={k: TensorSpec.from_json(v) for k, v in obj.get("state", {}).items()},
            mlp=str(obj.get("mlp", "moe")),
            module=str(obj.get("module", "")),
        )


class LayerRegistry:
    """An ordered, validated list of LayerSpec, looked up by layer id."""

    def __init__(self, layers: Iterable[LayerSpec]):
        self.layers: tuple[LayerSpec, ...] = tuple(layers)
        self._by_id: dict[int, LayerSpec] = {}
        main_ids = {l.layer_id for l in self.layers if not l.draft}
        for layer in self.layers:
            if layer.layer_id in self._by_id:
                clash = "a draft id clashes with a main layer id" if (
                    layer.draft and layer.layer_id in main_ids) else "duplicate layer id"
                raise RegistryError(f"registry: {clash}: layer {layer.layer_id}")
            if layer.is_full and (not layer.kv or layer.state):
                raise RegistryError(f"registry: layer {layer.layer_id} ({layer.kind.value}) needs kv entries and no state")
            if layer.is_linear and (not layer.state or layer.kv):
                raise RegistryError(f"registry: layer {layer.layer_id} ({layer.kind.value}) needs state entries and no kv")
            self._by_id[layer.layer_id] = layer

    def __iter__(self) -> Iterator[LayerSpec]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, layer_id: int) -> bool:
        return layer_id in self._by_id

    def __getitem__(self, layer_id: int) -> LayerSpec:
        try:
            return self._by_id[layer_id]
        except KeyError:
            raise KeyError(f"layer {layer_id} is not in the registry (ids: {sorted(self._by_id)})") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerRegistry) and self.layers == other.layers

    def full_layers(self) -> list[LayerSpec]:
        return [l for l in self.layers if l.is_full]

    def linear_layers(self) -> list[LayerSpec]:
        return [l for l in self.layers if l.is_linear]

    def main_layers(self) -> list[LayerSpec]:
        return [l for l in self.layers if not l.draft]

    def draft_layers(self) -> list[LayerSpec]:
        return [l for l in self.layers if l.draft]

    def kinds(self) -> list[str]:
        """The kind of each main layer in id order: the layout golden tests compare against."""
        return [l.kind.value for l in sorted(self.main_layers(), key=lambda l: l.layer_id)]

    def with_state_dtype(self, dtype: str) -> "LayerRegistry":
        """This registry with every linear layer's recurrent state ("recurrent") kept in `dtype`
        (one of STATE_DTYPES); convolution windows keep the model's dtype."""
        if dtype not in STATE_DTYPES:
            raise RegistryError(f"registry: recurrent state dtype {dtype!r}; one of {', '.join(STATE_DTYPES)}")

        def kept(layer: LayerSpec) -> LayerSpec:
            if "recurrent" not in layer.state:
                return layer
            spec = layer.state["recurrent"]
            return dataclasses.replace(layer, state={**layer.state, "recurrent": TensorSpec(spec.shape, dtype)})
        return LayerRegistry(kept(layer) for layer in self.layers)

    def to_json(self) -> list[dict]:
        return [l.to_json() for l in self.layers]

    @classmethod
    def from_json(cls, obj: list[dict]) -> "LayerRegistry":
        return cls(LayerSpec.from_json(o) for o in obj)
