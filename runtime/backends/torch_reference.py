"""TorchReferenceBackend: the reference math of every op on a GPU's tensors, eager only.

The CPU reference (cpu_reference.py) is plain torch and runs on any device's tensors. On "cuda"
it is a second implementation of every op beside the kernels (FlashInfer, the Triton linear and
MoE kernels): a layer can be sent to it with `hgc compile --route layers=3:torch_reference` to
take a kernel out of the question when a layer misbehaves, and the GPU tests route one layer
there to show that a layer bound apart from its neighbours runs, and only that layer, on its
backend. It is slow (one request at a time, host loops) and its loops read device values on the
host, so:

- it declares no capturable mode: the split pass puts its nodes in eager gaps in every mode;
- it is `explicit_only`: routing never picks it by priority (a silent fallback to it would be a
  100x slowdown nobody asked for), only a --route that names it.

Lifecycle and hooks are the CPU reference's (nothing to plan, nothing to capture).
"""

from __future__ import annotations

from compiler.splitops import COLLECTIVE_OPS, OP_SPECS, BackendCapability
from runtime.backends.cpu_reference import CPUReferenceBackend

__all__ = ["TorchReferenceBackend"]


class TorchReferenceBackend(CPUReferenceBackend):
    name = "torch_reference"
    capability = BackendCapability(
        name="torch_reference", device="cuda", ops=frozenset(OP_SPECS) - COLLECTIVE_OPS, modes_capturable=frozenset(),
        explicit_only=True,
        doc="the CPU reference's plain-torch math on GPU tensors: eager in every mode, chosen only by --route")
