"""Triton kernels compiled for an sm90 card on a machine without one, and what each asks of the card.

Triton needs no GPU to emit PTX, and its wheel carries ptxas and cuobjdump: a kernel can be
compiled for an H100 / H200 here exactly as a launch there compiles it, given the launch's
arguments. Three steps:

1. `record(launch_all)`: the launches `launch_all()` makes under Triton's interpreter, recorded,
   not run (their inputs are never read), with the grid and every argument as a GPU launch
   specialises it: a tensor as its pointer type and whether its address is 16-byte aligned, an
   integer by its value. The kernel modules that pick another path under the interpreter
   (launch_math.triton_interpreted: float32 dots in place of 16-bit ones) are told they run
   compiled, so the launch is the one a GPU makes. TRITON_INTERPRET must be set before triton
   is imported (tests/conftest.py does it on a machine without CUDA).
2. `compile_sm90(launch)`, in a process outside the interpreter: `triton.compile` for
   GPUTarget("cuda", 90, 32) with the signature, constants and attributes Triton's own launcher
   derives (`specialisation`: 16-byte-aligned pointers and integers divisible by 16 carry
   tt.divisibility, an integer equal to 1 is a constant unless the kernel says
   do_not_specialize). Without the divisibility the compiler may not vectorise a load or take
   it through cp.async, and the code would not be what the card runs.
3. `resources(cubin)`: the registers, local memory (spills) and static shared memory cuobjdump
   reports for the kernel, and the count of the SASS instructions that say how it moves and
   multiplies (HGMMA: Hopper's warpgroup tensor cores; HMMA: the older ones; LDGSTS: cp.async,
   a pipelined load; UTMALDG: a TMA load; LDG / STG: plain global loads and stores); with the
   dynamic shared memory of the compile, `programs_per_sm` gives how many programs an SM holds.

Users: tests/runtime/backends/test_pdl.py (the PTX of every decode kernel, for its waits) and
benchmarks/probes/kernel_resources_probe.py (a step's kernels, resources and waves).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import re
import subprocess
from typing import Callable

import torch

__all__ = ["Launch", "record", "specialisation", "compile_sm90", "resources", "programs_per_sm", "SM90",
           "SASS_OPS"]

_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
            torch.int64: "*i64", torch.bool: "*i1", torch.uint8: "*u8"}

# An H100 / H200 SM (the CUDA occupancy limits of compute capability 9.0): registers, shared memory a
# block may take with its 1 KiB reserved, resident warps and blocks; the H200's SM count.
SM90 = {"registers": 65536, "shared_bytes": 228 * 1024, "reserved_shared_bytes": 1024, "warps": 64,
        "blocks": 32, "sms": 132, "register_unit": 256}

SASS_OPS = ("HGMMA", "HMMA", "LDGSTS", "UTMALDG", "LDG", "STG", "LDS", "STS", "BAR")


@dataclasses.dataclass
class Launch:
    """One launch as its kernel's compile needs it: the kernel (module, name), every argument by
    parameter name (a tensor as {"ptr": "*bf16", "aligned": bool}, else its value), the launch
    options (num_warps, num_stages, launch_pdl) and the grid."""

    module: str
    name: str
    args: dict
    options: dict
    grid: list


def _arg(value):
    if isinstance(value, torch.Tensor):
        return {"ptr": _POINTER[value.dtype], "aligned": value.data_ptr() % 16 == 0}
    return value


def record(launch_all: Callable[[], object]) -> list[Launch]:
    """The launches `launch_all()` makes, in order (step 1 of the module docstring); none runs."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: list[Launch] = []

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        params = {n: _arg(v) for n, v in zip(names, args)}
        params.update({k: _arg(v) for k, v in kwargs.items() if k in names})
        options = {k: v for k, v in kwargs.items() if k not in names}
        shape = grid(params) if callable(grid) else grid
        seen.append(Launch(self.fn.__module__, self.fn.__name__, params, options, [int(g) for g in shape]))

    import runtime.backends.kernels as package  # every module of it imported first: a launch site that
    # imports one on its first call must find it told already
    modules = [importlib.import_module(f"{package.__name__}.{info.name}")
               for info in pkgutil.iter_modules(package.__path__)]
    modules = [m for m in modules if hasattr(m, "triton_interpreted")]
    saved = [(m, m.triton_interpreted) for m in modules]
    real_run = InterpretedFunction.run
    InterpretedFunction.run = run
    for m in modules:
        m.triton_interpreted = lambda: False
    try:
        launch_all()
    finally:
        InterpretedFunction.run = real_run
        for m, fn in saved:
            m.triton_interpreted = fn
    return seen


def specialisation(kernel, args: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) for triton.compiler.ASTSource, as Triton's launcher derives
    them from a launch's arguments (step 2 of the module docstring)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = args[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", value
            continue
        divisible = False
        if isinstance(value, dict):  # a tensor
            kind = value["ptr"]
            divisible = value["aligned"] and not p.do_not_specialize_on_alignment
        elif isinstance(value, bool):
            kind = "i1"
        elif isinstance(value, float):
            kind = "fp32"
        else:
            kind = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if not p.do_not_specialize:
                if value == 1:
                    signature[p.name], constexprs[p.name] = "constexpr", 1
                    continue
                divisible = value % 16 == 0 and not p.do_not_specialize_on_alignment
        signature[p.name] = kind
        if divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_sm90(launch: Launch, *, cubin: bool = True, **overrides):
    """The launch's kernel compiled for sm90 (step 2), outside the interpreter; `overrides` replace
    arguments (a constexpr switch). cubin False: stop at the PTX (ptxas left out)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    kernel = getattr(importlib.import_module(launch.module), launch.name)
    options = dict(launch.options)
    source = triton.compiler.ASTSource(kernel, *specialisation(kernel, {**launch.args, **overrides}))
    if cubin:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    make_cubin = CUDABackend.make_cubin
    CUDABackend.make_cubin = lambda self, src, metadata, opts, arch: b""
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    finally:
        CUDABackend.make_cubin = make_cubin


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(cubin: bytes, work_dir: str) -> dict:
    """Registers, local (spill) and static shared bytes of the cubin's kernel, and its SASS op counts
    (step 3)."""
    path = os.path.join(work_dir, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                           check=True).stdout
    fields = {k: int(v) for k, v in re.findall(r"\b(REG|LOCAL|SHARED|STACK):(\d+)", usage)}
    sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
    ops = {op: len(re.findall(rf"\b{op}[.\s]", sass)) for op in SASS_OPS}
    return {"registers": fields.get("REG", 0), "local_bytes": fields.get("LOCAL", 0),
            "static_shared_bytes": fields.get("SHARED", 0), "stack_bytes": fields.get("STACK", 0), "sass": ops}


def programs_per_sm(registers: int, shared_bytes: int, warps: int) -> dict:
    """How many programs of `warps` warps an sm90 SM holds at once, and what limits it: registers
    (allocated per warp in units of 256), shared memory (each block's plus its 1 KiB reserved),
    warps, blocks."""
    per_warp = -(-max(registers, 1) * 32 // SM90["register_unit"]) * SM90["register_unit"]
    limits = {"registers": SM90["registers"] // (per_warp * warps),
              "shared": SM90["shared_bytes"] // (shared_bytes + SM90["reserved_shared_bytes"]),
              "warps": SM90["warps"] // warps, "blocks": SM90["blocks"]}
    fits = min(limits.values())
    return {"programs": fits, "limit": min(limits, key=limits.get), "limits": limits}
