"""The CUDA kernel of the compiled glue's projection op, `hgc_glue::small_m_linear` (compiler/splitops/glue_ops.py).

A cuda bundle built without --batch-invariant compiles each plain projection of the glue as a call
of that op (hgc/build_command.py `small_m_for`); Inductor leaves the call in the piece, and this
module says what it runs:

1. `register()` installs `project` as the op's CUDA kernel, for the process (runtime/artifact/bundle.py
   calls it before it loads a cuda bundle's pieces). A second call does nothing.
2. `project(x, weight)`, per call: x [M, K] with M <= MAX_ROWS, in bf16, whose (N, K, row bucket)
   CONFIGS lists (runtime/backends/kernels/gemv.py: the shapes where the one-launch GEMV beat cuBLAS
   by 5% or more on an H200), both with a contiguous last dimension -> `small_m_linear`, one launch;
   anything else (a prompt's many rows, a shape or dtype not measured) -> F.linear, what the traced
   glue runs. The choice is made when the call runs, so inside a CUDA graph it is the one made at
   capture: a decode bucket's step replays its GEMVs.
3. `torch_only()`: while it is open, `project` takes F.linear always (an A/B of the same bundle:
   benchmarks/kernels/step_account.py --torch-projections). It acts on what runs or is captured
   inside it, not on graphs captured before.

Only bf16: CONFIGS were timed in bf16 (gemv.py), and a float32 product reads twice the bytes, for
which nobody measured the kernel against cuBLAS. The GEMV's bits follow the row bucket (its config),
which is why a batch-invariant artifact never calls the op (build_command.small_m_for).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Optional

import torch
import torch.nn.functional as F

from compiler.splitops import glue_ops

__all__ = ["project", "register", "registered", "takes_gemv", "torch_only"]

_LIB: Optional[torch.library.Library] = None  # kept here: dropping the Library unregisters the kernel
_torch_only = False  # torch_only() sets it: an A/B switch, read at each call
MEASURED_DTYPE = torch.bfloat16  # the dtype CONFIGS were timed in


@functools.cache
def _gemv():
    """runtime/backends/kernels/gemv.py, on first use (it imports triton; a CPU-only install never calls)."""
    return importlib.import_module("runtime.backends.kernels.gemv")


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Step 2's choice: whether `project` runs this call's product as the one-launch GEMV."""
    if _torch_only or x.dim() != 2 or weight.dim() != 2 or x.dtype != MEASURED_DTYPE or weight.dtype != x.dtype:
        return False
    gemv = _gemv()
    M, (N, K) = x.shape[0], weight.shape
    if not 1 <= M <= gemv.MAX_ROWS or x.shape[1] != K:
        return False
    if x.stride(1) != 1 or weight.stride(1) != 1:  # the kernel reads rows with a unit stride
        return False
    return (N, K, gemv.row_bucket(M)) in gemv.CONFIGS


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] (contiguous, as the op's fake kernel says): step 2."""
    if takes_gemv(x, weight):
        return _gemv().small_m_linear(x, weight)
    return F.linear(x, weight)


def register() -> None:
    """Step 1: `project` as hgc_glue::small_m_linear's CUDA kernel (the CompositeExplicitAutograd
    F.linear of glue_ops still serves every other device)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library(glue_ops.NAMESPACE, "IMPL")
    lib.impl("small_m_linear", project, "CUDA")
    _LIB = lib


def registered() -> bool:
    return _LIB is not None


@contextlib.contextmanager
def torch_only():
    """Step 3: F.linear for every call made inside the block."""
    global _torch_only
    before, _torch_only = _torch_only, True
    try:
        yield
    finally:
        _torch_only = before
