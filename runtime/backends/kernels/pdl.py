"""Programmatic dependent launch (PDL) for the decode step's Triton kernels: the switch and its helpers.

A batch-1 decode step is a chain of short kernels in one CUDA graph, each waiting for the one
before it to finish and drain before its first program starts. On Hopper (compute capability 9)
a kernel launched with the programmatic-stream-serialization attribute (Triton: the launch option
`launch_pdl=True`) may start while the kernel before it drains: its programs run up to
`gdc_wait()` (PTX `griddepcontrol.wait`), which blocks until the previous kernel has completed and
its memory is visible, and `gdc_launch_dependents()` (`griddepcontrol.launch_dependents`) lets the
next kernel begin launching. `hgc build --pdl` decides it for a bundle (docs/DESIGN.md,
"Programmatic dependent launch"); off by default.

The rule every kernel here follows when launched with PDL (its `USE_GDC` constexpr True): in every
program, and before any early return, it calls `pdl_wait` before it reads anything an earlier
kernel of the step may write (activations, states, KV, routing tables, counters, step buffers) and
before it writes anything at all (a buffer it writes may still be read by the previous kernel).
Only weights, never written while serving, may be read before the wait: a GEMV streams its weight
tile while the previous kernel drains, which is where the overlap pays. `pdl_wait` lets the next
kernel launch right after the wait. Every PDL kernel waits for its predecessor's completion, so
completion is transitive down the chain; a kernel launched without PDL keeps ordinary stream order.

1. `enable(on)` / `enabled()`: the process-wide switch, off by default. The runtime turns it on
   when it loads a cuda bundle built with --pdl (runtime/artifact/bundle.py), before start-up
   captures, so the build's start-up and every run launch (and the bundle holds) the same kernels:
   `launch_pdl` is a compile option, part of a Triton kernel's key.
2. `launch_options(device)`: `{"launch_pdl": True}` where the switch is on, the device is CUDA of
   compute capability 9 or more and Triton is not interpreted; else `{}`.
3. `launch_args(device)`: what a launch site passes, the kernel's `USE_GDC` constexpr (whether
   launch_options gave anything) with those options.
4. `pdl_wait(USE_GDC)`, called in a kernel: the wait and the release of the next kernel where
   USE_GDC, nothing otherwise (a False constexpr compiles the calls away: the kernel is as before).

What it does not cover: kernels that are not ours (cuBLAS, FlashInfer, torch's own) launch
without PDL; Inductor's kernels take it from Inductor's own setting (compiler/splitops/bundle.py
`inductor_config`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.backends.kernels.launch_math import triton_interpreted

__all__ = ["enable", "enabled", "launch_args", "launch_options", "pdl_wait", "MIN_CAPABILITY"]

MIN_CAPABILITY = 9  # Hopper: griddepcontrol and the programmatic-serialization launch attribute

_on = False
_capable: dict[int, bool] = {}  # CUDA device index -> compute capability >= MIN_CAPABILITY (asked once)
_PDL = {"launch_pdl": True}
_NONE: dict = {}
# launch_args' two answers, made once: a decode step asks at every launch
_ARGS_ON = {"USE_GDC": True, **_PDL}
_ARGS_OFF = {"USE_GDC": False}


def enable(on: bool) -> None:
    """Turn PDL on or off for the kernel launches that follow, in this process."""
    global _on
    _on = bool(on)


def enabled() -> bool:
    return _on


def _device_capable(device: torch.device) -> bool:
    index = device.index if device.index is not None else torch.cuda.current_device()
    capable = _capable.get(index)
    if capable is None:
        capable = _capable[index] = torch.cuda.get_device_capability(index)[0] >= MIN_CAPABILITY
    return capable


def launch_options(device) -> dict:
    """The launch options a kernel that follows the rule takes on `device` (a torch.device or a
    name): `{"launch_pdl": True}` or `{}`. Read-only: callers unpack it."""
    if not _on:
        return _NONE
    device = device if isinstance(device, torch.device) else torch.device(device)
    if device.type != "cuda" or triton_interpreted() or not _device_capable(device):
        return _NONE
    return _PDL


def launch_args(device) -> dict:
    """`launch_options(device)` with the kernel's USE_GDC constexpr: `kernel[grid](..., **launch_args(dev))`."""
    return _ARGS_ON if launch_options(device) else _ARGS_OFF


@triton.jit
def pdl_wait(USE_GDC: tl.constexpr):
    """Where USE_GDC: wait for the previous kernel's completion and memory, then let the next kernel
    launch (the module docstring's rule says where a kernel calls it)."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
