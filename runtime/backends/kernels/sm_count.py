"""How many streaming multiprocessors a device has: the one statement kernels size their grids by.

On a CPU (Triton's interpreter, in the tests) the answer is 132, an H100's and H200's count, so
the interpreter walks the same tiles and splits a GPU launch would.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["num_sms", "CPU_STAND_IN_SMS"]

CPU_STAND_IN_SMS = 132


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_STAND_IN_SMS
