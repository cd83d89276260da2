"""Launching a Triton kernel again with the same arguments, without Triton's per-launch binding.

`kernel[grid](*args)` binds and specializes every argument on each call: Python work of tens of
microseconds per launch (benchmarks/serving/startup_bench.py's piecewise host profile: Triton's `run`, its
binder and `native_specialize_impl` were the largest share of a piecewise decode step's host time).
An eager gap between captured pieces launches its kernels with the same arguments on every step
of a bucket: the captured pieces' outputs, the pools and the static step buffers sit at fixed
addresses, and the strides and tiles follow the bucket.

`Launcher` keeps, per exact argument list (each tensor's address and dtype, every other value, the
grid and the launch options), the kernel Triton compiled for that list, and launches it through
the compiled kernel's own launcher (what Triton's `run` ends with). Identical arguments on the same
device specialize identically, so it is the kernel Triton's path would pick; any other list (a new
buffer, another length, another device) goes through Triton's path, which then remembers it.
Under the interpreter (TRITON_INTERPRET=1, the CPU tests) Triton returns no compiled kernel and
every launch takes Triton's path.
"""

from __future__ import annotations

import collections

import torch

__all__ = ["Launcher"]


class Launcher:
    """`Launcher(kernel)[grid](*args, **kwargs)` launches like `kernel[grid](*args, **kwargs)`."""

    # False: every launch takes Triton's path (benchmarks/serving/startup_bench.py times piecewise steps
    # both ways in one process).
    enabled = True
    # Every Launcher made (module-level, one per kernel): `totals` sums their counts.
    made: list["Launcher"] = []

    def __init__(self, kernel, size: int = 256):
        self.kernel, self.size = kernel, size
        self._compiled: collections.OrderedDict = collections.OrderedDict()
        self.hits = self.misses = 0
        self._hooks = None  # triton.knobs.runtime, once a kernel is remembered (no import before)
        Launcher.made.append(self)

    @classmethod
    def totals(cls) -> tuple[int, int]:
        """(hits, misses) over every Launcher so far: a benchmark takes the difference around a step
        to see how many of its launches took Triton's path (a miss: new arguments, or the interpreter)."""
        return sum(x.hits for x in cls.made), sum(x.misses for x in cls.made)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(tuple(grid), args, kwargs)

    @staticmethod
    def _key(grid: tuple, args: tuple, kwargs: dict) -> tuple:
        tensor = torch.Tensor
        return (grid, tuple([(a.data_ptr(), a.dtype) if isinstance(a, tensor) else a for a in args]),
                tuple(kwargs.items()))

    def launch(self, grid: tuple, args: tuple, kwargs: dict) -> None:
        if not Launcher.enabled:
            self.kernel[grid](*args, **kwargs)
            return
        key = self._key(grid, args, kwargs)
        entry = self._compiled.get(key)
        if entry is not None:
            device = self._device()
            if entry[2] != device:
                entry = None  # compiled for another device (Triton keeps a cache per device too)
        if entry is None:
            self.misses += 1
            compiled = self.kernel[grid](*args, **kwargs)
            self._remember(key, compiled, len(args), kwargs)
            return
        self.hits += 1
        compiled, tail, _ = entry
        stream = self._stream(device)
        # Triton's launch hooks, read at each launch as its own run does (a profiler may add one)
        enter, leave = self._hooks.launch_enter_hook, self._hooks.launch_exit_hook
        full = (*args, *tail)
        # A launch hook (a profiler's) gets the metadata Triton's path would give it.
        metadata = compiled.launch_metadata(grid, stream, *full) if getattr(enter, "calls", enter) else None
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, metadata, enter, leave, *full)

    # The current device and its current stream: the two torch calls Triton's CUDA driver binds its
    # get_current_device / get_current_stream to, without its driver's lookups. Only reached once
    # Triton has compiled a kernel, so never on a machine without CUDA.
    @staticmethod
    def _device() -> int:
        return torch.cuda.current_device()

    @staticmethod
    def _stream(device: int):
        return torch._C._cuda_getCurrentRawStream(device)

    def _remember(self, key: tuple, compiled, positional: int, kwargs: dict) -> None:
        # The compiled kernel's launcher takes every parameter in order, constexprs included
        # (as Triton's own run passes them): the ones after the positional arguments come from
        # the keywords or their defaults; the keywords that are not parameters are options
        # (num_warps), fixed by the key.
        if compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            return  # the interpreter, or a Triton whose compiled kernels launch otherwise: its own path
        from triton import knobs

        self._hooks = knobs.runtime  # Triton's launch hooks, as its own run reads them
        tail = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in self.kernel.params[positional:])
        self._compiled[key] = (compiled, tail, self._device())
        if len(self._compiled) > self.size:
            self._compiled.popitem(last=False)
