"""The backends this runtime has, and their capability declarations.

1. `BACKENDS` names every backend class by import path; `WRAPPERS` names the classes that compose
   other backends (the hybrid wrapper). Paths, not imports: a GPU backend's module is imported only
   when asked for, and must import without its kernel libraries (it imports them lazily), so a
   CPU machine can compile for a "cuda" target.
2. `capability_table()` imports each listed backend and collects its `capability` class attribute:
   the table the compiler routes with. Several backends may serve one device (for example one for
   full attention and one for linear attention on "cuda").
3. `wrapper_classes()` gives the wrappers to the compiler's hook-forwarding lint.

Adding a backend: give its class a `capability = BackendCapability(...)` and add its path here.
This module chooses nothing; routing does (compiler/passes/routing.py).
"""

from __future__ import annotations

import importlib

from runtime.backends.capability import BackendCapability, CapabilityTable

__all__ = ["BACKENDS", "WRAPPERS", "backend_classes", "wrapper_classes", "capability_table",
           "BackendCapability", "CapabilityTable"]

BACKENDS: tuple[str, ...] = (
    "runtime.backends.cpu_reference:CPUReferenceBackend",
    "runtime.backends.flashinfer_attention:FlashInferAttentionBackend",
    "runtime.backends.triton_linear_backend:TritonLinearBackend",
    "runtime.backends.triton_moe:TritonMoEBackend",
)
WRAPPERS: tuple[str, ...] = (
    "runtime.backends.hybrid:HybridBackend",
)


def _import(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def backend_classes() -> tuple[type, ...]:
    return tuple(_import(p) for p in BACKENDS)


def wrapper_classes() -> tuple[type, ...]:
    """Wrapper classes; a listed module that is absent from this checkout is skipped."""
    found = []
    for path in WRAPPERS:
        try:
            found.append(_import(path))
        except ModuleNotFoundError as e:
            if e.name != path.partition(":")[0]:
                raise
    return tuple(found)


def capability_table() -> CapabilityTable:
    caps = []
    for cls in backend_classes():
        cap = getattr(cls, "capability", None)
        if not isinstance(cap, BackendCapability):
            raise TypeError(f"backend {cls.__module__}.{cls.__name__} has no `capability` declaration "
                            f"(a BackendCapability class attribute)")
        caps.append(cap)
    return CapabilityTable(caps)
