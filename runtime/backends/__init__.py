"""The backends this runtime can build: the built-in list plus the packages installed beside hgc.

1. `BUILTIN` names every built-in backend class by import path. Paths, not imports: a GPU
   backend's module is imported only when the registry is made, and imports without its kernel
   libraries (it imports them lazily), so a CPU machine can compile for a "cuda" target.
2. `discover()` imports the built-in classes and every class registered by an installed
   distribution under the entry-point group `hgc.backends` (value "module:Class"; the class
   carries its `capability` and defines `build(setup)`), and returns a `BackendRegistry`. A
   plugin that does not import or declares nothing is an error naming its entry point: a backend
   that vanished silently would leave routing to pick another one without saying so.
3. `BackendRegistry.capability_table()` is what the command line hands the compiler (routing
   reads only declarations); `BackendRegistry.backend_class(name)` is what the runtime's binder
   builds the instances routing.json names from; `hgc backends` lists `rows()`.
4. `WRAPPERS` names the classes that forward hooks to other backends (the routed backend set), for
   the compiler's hook-forwarding lint.

Adding a backend: give its class a `capability = BackendCapability(...)` and a `build(setup)`
classmethod, then add its path to BUILTIN, or register it from another package:

    [project.entry-points."hgc.backends"]
    fast_gdn = "my_package.backend:FastGDNBackend"

This module chooses nothing; routing does (compiler/passes/routing.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Iterable

from compiler.splitops import BackendCapability, CapabilityTable
from runtime.backends.protocol import BackendHooks

__all__ = ["BUILTIN", "WRAPPERS", "ENTRY_POINT_GROUP", "BackendRegistry", "BackendDiscoveryError", "discover",
           "wrapper_classes"]

ENTRY_POINT_GROUP = "hgc.backends"

BUILTIN: tuple[str, ...] = (
    "runtime.backends.cpu_reference:CPUReferenceBackend",
    "runtime.backends.torch_reference:TorchReferenceBackend",
    "runtime.backends.flashinfer_attention:FlashInferAttentionBackend",
    "runtime.backends.triton_mla:TritonMLABackend",
    "runtime.backends.triton_linear:TritonLinearBackend",
    "runtime.backends.triton_moe:TritonMoEBackend",
    "runtime.backends.collectives:GlooCollectives",
    "runtime.backends.collectives:NcclCollectives",
    "runtime.backends.collectives:SymmMemAllReduce",
)
WRAPPERS: tuple[str, ...] = (
    "runtime.backends.backend_set:BackendSet",
)


class BackendDiscoveryError(TypeError):
    """A listed or installed backend this runtime cannot use; the message names where it came from."""


def _import(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def wrapper_classes() -> tuple[type, ...]:
    return tuple(_import(p) for p in WRAPPERS)


class BackendRegistry:
    """Backend classes by their capability name, each with where it came from."""

    def __init__(self, entries: Iterable[tuple[type, str]]):
        self._classes: dict[str, type] = {}
        self._sources: dict[str, str] = {}
        for cls, source in entries:
            cap = getattr(cls, "capability", None)
            if not isinstance(cls, type) or not issubclass(cls, BackendHooks):
                raise BackendDiscoveryError(f"{source}: {cls!r} is not a backend class (a subclass of "
                                            f"runtime.backends.protocol.BackendHooks)")
            if not isinstance(cap, BackendCapability):
                raise BackendDiscoveryError(f"{source}: backend {cls.__qualname__} has no `capability` declaration "
                                            f"(a BackendCapability class attribute)")
            if not implements_build(cls):
                raise BackendDiscoveryError(f"{source}: backend {cls.__qualname__} does not define the classmethod "
                                            f"build(setup) the runtime builds it with")
            if cap.name in self._classes:
                raise BackendDiscoveryError(f"two backends declare the name {cap.name!r}: {self._sources[cap.name]} "
                                            f"and {source}; uninstall one")
            self._classes[cap.name] = cls
            self._sources[cap.name] = source

    def names(self) -> list[str]:
        return list(self._classes)

    def __contains__(self, name: str) -> bool:
        return name in self._classes

    def backend_class(self, name: str) -> type:
        return self._classes[name]

    def source(self, name: str) -> str:
        return self._sources[name]

    def capability_table(self) -> CapabilityTable:
        return CapabilityTable((c.capability for c in self._classes.values()), sources=self._sources)

    def with_classes(self, *classes: type, source: str = "added in code") -> "BackendRegistry":
        """This registry plus `classes` (an embedding program, or a test, adds its own backends)."""
        return BackendRegistry([*((self._classes[n], self._sources[n]) for n in self._classes),
                                *((cls, source) for cls in classes)])

    def replacing(self, cls: type, source: str = "replaced in code") -> "BackendRegistry":
        """This registry with `cls` standing in for the backend of its capability's name (a test's
        stand-in that misbehaves on purpose, say)."""
        name = cls.capability.name
        if name not in self._classes:
            raise BackendDiscoveryError(f"{source}: no backend named {name!r} to replace")
        return BackendRegistry([(cls, source) if n == name else (self._classes[n], self._sources[n])
                                for n in self._classes])

    def rows(self) -> list[dict]:
        """One row per backend, for `hgc backends`: its declaration and where it came from."""
        return [{**cls.capability.to_json(), "source": self._sources[name], "doc": cls.capability.doc}
                for name, cls in self._classes.items()]


def implements_build(cls: type) -> bool:
    """Whether `cls` has its own build(setup), not the protocol's refusing declaration."""
    build = getattr(cls, "build", None)
    return callable(build) and not getattr(build, "_hgc_protocol_stub", False)


def _entry_points() -> list[tuple[type, str]]:
    found = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        where = f"entry point {ep.name} = {ep.value}" + (f" (package {dist.name} {dist.version})" if dist else "")
        try:
            cls = ep.load()
        except Exception as e:  # an installed plugin that does not import: say which, never skip it
            raise BackendDiscoveryError(f"{where} (group {ENTRY_POINT_GROUP}) failed to load: "
                                        f"{type(e).__name__}: {e}") from e
        found.append((cls, where))
    return found


def discover() -> BackendRegistry:
    """The built-in backends, then every one installed under the entry-point group `hgc.backends`."""
    builtin = [(_import(path), f"built-in {path}") for path in BUILTIN]
    return BackendRegistry(builtin + _entry_points())
