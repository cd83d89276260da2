"""Small host values (indices, token ids) to the device without making the host wait for it.

`torch.tensor(values, device="cuda")` builds the tensor in pageable host memory and copies it with
a synchronous call: the host waits until every kernel queued before it has run. Between the steps
of a speculative round (a verify step, the draft after it, the next round's chain) each such wait
leaves the device idle while the host lays out the next step. From pinned memory the copy is
queued behind the queued kernels instead, and the host goes on; the caching host allocator keeps
the pinned block until the copy has left it.
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "array_to_device"]


def to_device(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list of numbers) as a tensor on `device`, the copy queued on the current stream."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def array_to_device(array, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor on `device` (a torch.device: a caller moving many arrays resolves
    it once), the array itself on the CPU; on cuda the copy is queued on the current stream from a
    pinned copy of it, so the array may be reused as soon as this returns."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
