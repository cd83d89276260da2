"""Small values between the host and the device without making the host wait for the device.

`torch.tensor(values, device="cuda")` builds the tensor in pageable host memory and copies it with
a synchronous call: the host waits until every kernel queued before it has run. Between the steps
of a speculative round (a verify step, the draft after it, the next round's chain), or while the
engine lays out its next step with the current one on the device, each such wait leaves the device
idle. From pinned memory the copy is queued behind the queued kernels instead, and the host goes
on; the caching host allocator keeps the pinned block until the copy has left it.

The other way (`HostCopy`): a device tensor's copy into pinned host memory is queued with an event
after it; the host reads the values when it needs them, waiting only for that event. On the CPU
both are plain copies, so the same code runs there.
"""

from __future__ import annotations

import torch

__all__ = ["to_device", "tensor_to_device", "array_to_device", "HostCopy"]


def to_device(values, device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list of numbers) as a tensor on `device`, the copy queued on the current stream."""
    return tensor_to_device(torch.tensor(values, dtype=dtype), device)


def tensor_to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A tensor on `device`, a host one's copy queued on the current stream (from pinned memory on CUDA).
    A torch.device is taken as it is: a step moves several tensors, and parsing it again each time
    is a measurable share of a small step's host time (benchmarks/host/step_host_bench.py)."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def array_to_device(array, device: torch.device) -> torch.Tensor:
    """A numpy array as a tensor on `device` (a torch.device: a caller moving many arrays resolves
    it once), the array itself on the CPU; on cuda the copy is queued on the current stream from a
    pinned copy of it, so the array may be reused as soon as this returns."""
    return tensor_to_device(torch.from_numpy(array), device)


class HostCopy:
    """`values` [N] of the device, copied into pinned host memory on the current stream; `tolist()`
    waits for that copy alone (an event), not for the kernels queued after it."""

    def __init__(self, values: torch.Tensor):
        if values.device.type != "cuda":
            self._host, self._event = values.to("cpu"), None
            return
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
