"""BackendCapability: what one backend declares it can do. The routing pass reads only this.

A backend class carries its declaration as a class attribute (`capability = BackendCapability(...)`),
so the fact lives beside the code it describes (DESIGN.md: "backend capabilities in the backend's
own declaration"). `runtime/backends/__init__.py` lists the backends of this runtime; the compiler
turns that list into a `CapabilityTable` and routes every op node with it.

Lifecycle of a declaration:

1. A backend module declares `capability` on its class (device, ops, modes, optional layer kinds).
2. `runtime.backends.capability_table()` collects the declarations of every listed backend.
3. The routing pass asks the table, for each op node, which backends on the compile target serve
   that op for that layer kind in every mode, and records the chosen backend's name in the graph.
4. The loader checks that the backend it is handed covers every backend name the artifact routes to.

A device may have several backends: on "cuda", one for full attention (ops gqa_attention,
mla_attention) and one for linear attention (gdn_core, kda_core, ...), each with its own modes and
capture support. A wrapper that composes children (the hybrid backend) declares `children` and
is never a routing target itself: nodes are routed to the leaf that runs them.

This module does not choose between backends (routing does) and does not run anything.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

from compiler.splitops import MODES, OP_SPECS, LayerKind, Mode

__all__ = ["BackendCapability", "CapabilityTable", "CapabilityError"]


class CapabilityError(ValueError):
    """A declaration that contradicts itself or the op vocabulary."""


@dataclasses.dataclass(frozen=True)
class BackendCapability:
    """One backend's declaration.

    Example (a CUDA linear-attention backend that can be captured in decode only)::

        BackendCapability("triton_linear", "cuda",
                          ops=frozenset({"gdn_core", "kda_core", "lightning_core", "short_conv"}),
                          modes_capturable=frozenset({Mode.DECODE, Mode.TARGET_VERIFY}))
    """

    name: str  # unique in a runtime: what routing.json records for each node
    device: str  # "cpu", "cuda", ...: the compile target this backend serves
    ops: frozenset[str]  # hgc op names it implements
    modes_supported: frozenset[Mode] = frozenset(MODES)  # modes it can run at all
    modes_capturable: frozenset[Mode] = frozenset()  # modes in which its kernels may sit in a CUDA graph
    kinds: Optional[frozenset[LayerKind]] = None  # layer kinds it serves; None: any kind the op serves
    priority: int = 0  # among several backends that fit a node, the highest wins (then declaration order)
    children: tuple[str, ...] = ()  # a wrapper: the names of the backends it composes
    doc: str = ""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ops) - set(OP_SPECS))
        if unknown:
            raise CapabilityError(f"backend {self.name!r}: declares ops outside the vocabulary: {unknown}")
        for field in ("modes_supported", "modes_capturable"):
            bad = [m for m in getattr(self, field) if not isinstance(m, Mode)]
            if bad:
                raise CapabilityError(f"backend {self.name!r}: {field} holds non-Mode values {bad}")
        if not set(self.modes_capturable) <= set(self.modes_supported):
            raise CapabilityError(f"backend {self.name!r}: capturable in modes it does not support: "
                                  f"{sorted(m.value for m in set(self.modes_capturable) - set(self.modes_supported))}")

    @property
    def is_wrapper(self) -> bool:
        return bool(self.children)

    def serves(self, op: str, kind: Optional[LayerKind]) -> bool:
        """Whether this backend runs `op` for a layer of `kind` (kind None: an op of no layer kind)."""
        if op not in self.ops:
            return False
        return self.kinds is None or kind is None or kind in self.kinds

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "device": self.device,
            "ops": sorted(self.ops),
            "modes_supported": [m.value for m in MODES if m in self.modes_supported],
            "modes_capturable": [m.value for m in MODES if m in self.modes_capturable],
            "kinds": None if self.kinds is None else sorted(k.value for k in self.kinds),
            "priority": self.priority,
            "children": list(self.children),
        }

    @classmethod
    def from_json(cls, obj: dict) -> "BackendCapability":
        return cls(
            name=str(obj["name"]), device=str(obj["device"]), ops=frozenset(obj["ops"]),
            modes_supported=frozenset(Mode(m) for m in obj["modes_supported"]),
            modes_capturable=frozenset(Mode(m) for m in obj["modes_capturable"]),
            kinds=None if obj.get("kinds") is None else frozenset(LayerKind(k) for k in obj["kinds"]),
            priority=int(obj.get("priority", 0)), children=tuple(obj.get("children", ())),
        )


class CapabilityTable:
    """The declarations of one runtime's backends, in declaration order, looked up by name and device."""

    def __init__(self, capabilities: Iterable[BackendCapability]):
        self.capabilities: tuple[BackendCapability, ...] = tuple(capabilities)
        self._by_name: dict[str, BackendCapability] = {}
        for cap in self.capabilities:
            if cap.name in self._by_name:
                raise CapabilityError(f"two backends declare the name {cap.name!r}")
            self._by_name[cap.name] = cap
        for cap in self.capabilities:
            missing = [c for c in cap.children if c not in self._by_name]
            if missing:
                raise CapabilityError(f"wrapper backend {cap.name!r} names children {missing} that no backend declares")

    def __iter__(self):
        return iter(self.capabilities)

    def __len__(self) -> int:
        return len(self.capabilities)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> BackendCapability:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no backend named {name!r} (backends: {sorted(self._by_name)})") from None

    def devices(self) -> list[str]:
        return sorted({c.device for c in self.capabilities})

    def on_device(self, device: str) -> list[BackendCapability]:
        return [c for c in self.capabilities if c.device == device]

    def candidates(self, op: str, kind: Optional[LayerKind], device: str) -> list[BackendCapability]:
        """Leaf backends on `device` that run `op` for layers of `kind`, best first."""
        fits = [c for c in self.on_device(device) if not c.is_wrapper and c.serves(op, kind)]
        order = {c.name: i for i, c in enumerate(self.capabilities)}
        return sorted(fits, key=lambda c: (-c.priority, order[c.name]))

    def to_json(self) -> list[dict]:
        return [c.to_json() for c in self.capabilities]
