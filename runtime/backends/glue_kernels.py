"""The CUDA kernels of the compiled glue's ops (compiler/splitops/glue_ops.py).

A cuda bundle built without --batch-invariant compiles each plain projection of the glue as a call
of `hgc_glue::small_m_linear` (hgc/build_command.py `small_m_for`), and with --norm-linear a layer's
input norm with its projection as a call of `hgc_glue::add_rms_norm_linear` or `rms_norm_linear`,
and its output projection with the residual add and the post-attention norm after it as a call of
`hgc_glue::linear_add_rms_norm`, with --norm-rope a GQA layer's q / k norms and rotary as a call
of `hgc_glue::qk_norm_rope`, and with --sigmoid-gate an attention output's gate as a call of
`hgc_glue::sigmoid_gate`; Inductor leaves the calls in the piece, and this module says what they
run:

1. `register()` installs `project` as small_m_linear's CUDA kernel, `add_norm_project`,
   `norm_project` and `linear_add_norm` as the norm ops', `norm_rope` as qk_norm_rope's and `gated`
   as sigmoid_gate's, for the process (runtime/artifact/bundle.py calls it before it loads a cuda
   bundle's pieces). A second call does nothing.
2. `project(x, weight)`, per call: x [M, K] with M <= MAX_ROWS, in bf16, whose (N, K, row bucket)
   CONFIGS lists (runtime/backends/kernels/gemv.py: the shapes where the one-launch GEMV beat cuBLAS
   by 5% or more on an H200), both with a contiguous last dimension -> `small_m_linear`, one launch;
   17 to 128 rows whose shape and bucket runtime/backends/kernels/split_k.py's CONFIGS lists (none
   yet: it lists only shapes a GPU run measured faster than cuBLAS) -> `split_k_linear`;
   anything else (a prompt's many rows, a shape or dtype not measured) -> F.linear, what the traced
   glue runs. The choice is made when the call runs, so inside a CUDA graph it is the one made at
   capture: a decode bucket's step replays its GEMVs.
3. `add_norm_project(a, b, norm_weight, weight, eps, unit_offset)` and `norm_project(x, ...)`, per
   call: where `project` would take the GEMV for the normed row (`takes_norm_gemv`: the same test
   on a), the GEMV with the norm in its prologue (runtime/backends/kernels/norm_gemv.py), one
   launch; anything else -> norm_gemv's row kernel (the add and the norm, one launch), then F.linear.
   `linear_add_norm(x, weight, residual, norm_weight, eps, unit_offset)`, per call: where `project`
   would take the GEMV for x (`takes_gemv_norm`), the GEMV with the add in its epilogue and the norm
   in its last program (norm_gemv.py `gemv_add_rms_norm`), one launch; anything else -> F.linear,
   then the row kernel.
4. `norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps, unit_offset)`: qk_norm_rope's
   kernel (`hgc build --norm-rope`): runtime/backends/kernels/norm_rope.py's one launch for q's
   and k's heads, for every step size and float dtype (each row's sums are its own, in one order,
   so the step's size never changes its bits); inputs whose channels are not contiguous are
   copied first.
5. `gated(x, gate)`: sigmoid_gate's kernel (`hgc build --sigmoid-gate`):
   runtime/backends/kernels/sigmoid_gate.py's one launch of a fixed tile, every step size and float
   dtype (an element's result is its own: the step's size never changes its bits); inputs whose
   channels are not contiguous are copied first.
6. `torch_only()`: while it is open, `project` takes F.linear always and the norm ops their row
   kernel and F.linear (an A/B of the same bundle: benchmarks/kernels/step_account.py
   --torch-projections). It acts on what runs or is captured inside it, not on graphs captured before.

The GEMVs only in bf16: CONFIGS were timed in bf16 (gemv.py), and a float32 product reads twice the
bytes, for which nobody measured the kernel against cuBLAS. The GEMV's bits follow the row bucket
(its config), which is why a batch-invariant artifact never calls the op (build_command.small_m_for).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Optional

import torch
import torch.nn.functional as F

from compiler.splitops import glue_ops

__all__ = ["add_norm_project", "gated", "linear_add_norm", "norm_project", "norm_rope", "project", "register",
           "registered",
           "takes_gemv", "takes_split_k",
           "takes_gemv_norm", "takes_norm_gemv", "torch_only"]

_LIB: Optional[torch.library.Library] = None  # kept here: dropping the Library unregisters the kernel
_torch_only = False  # torch_only() sets it: an A/B switch, read at each call
MEASURED_DTYPE = torch.bfloat16  # the dtype CONFIGS were timed in


@functools.cache
def _gemv():
    """runtime/backends/kernels/gemv.py, on first use (it imports triton; a CPU-only install never calls)."""
    return importlib.import_module("runtime.backends.kernels.gemv")


@functools.cache
def _split_k():
    """runtime/backends/kernels/split_k.py, on first use (as `_gemv`)."""
    return importlib.import_module("runtime.backends.kernels.split_k")


@functools.cache
def _norm_rope():
    """runtime/backends/kernels/norm_rope.py, on first use (as `_gemv`)."""
    return importlib.import_module("runtime.backends.kernels.norm_rope")


@functools.cache
def _sigmoid_gate():
    """runtime/backends/kernels/sigmoid_gate.py, on first use (as `_gemv`)."""
    return importlib.import_module("runtime.backends.kernels.sigmoid_gate")


@functools.cache
def _norm_gemv():
    """runtime/backends/kernels/norm_gemv.py, on first use (as `_gemv`)."""
    return importlib.import_module("runtime.backends.kernels.norm_gemv")


def _measured_operands(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a call may take one of our kernels at all: 2-D bf16 operands sharing K, each row of
    unit stride (the kernels read rows so), outside torch_only()."""
    if _torch_only or x.dim() != 2 or weight.dim() != 2 or x.dtype != MEASURED_DTYPE or weight.dtype != x.dtype:
        return False
    return x.shape[1] == weight.shape[1] and x.stride(1) == 1 and weight.stride(1) == 1


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Step 2's choice: whether `project` runs this call's product as the one-launch GEMV."""
    if not _measured_operands(x, weight):
        return False
    gemv = _gemv()
    M, (N, K) = x.shape[0], weight.shape
    return 1 <= M <= gemv.MAX_ROWS and (N, K, gemv.row_bucket(M)) in gemv.CONFIGS


def takes_split_k(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Step 2's choice: whether `project` runs this call's product as the split-K GEMM."""
    if not _measured_operands(x, weight):
        return False
    split_k = _split_k()
    M, (N, K) = x.shape[0], weight.shape
    return split_k.MIN_ROWS <= M <= split_k.MAX_ROWS and (N, K, split_k.row_bucket(M)) in split_k.CONFIGS


def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] (contiguous, as the op's fake kernel says): step 2."""
    if takes_gemv(x, weight):
        return _gemv().small_m_linear(x, weight)
    if takes_split_k(x, weight):
        split_k = _split_k()
        M, (N, K) = x.shape[0], weight.shape
        return split_k.split_k_linear(x, weight, split_k.CONFIGS[(N, K, split_k.row_bucket(M))])
    return F.linear(x, weight)


def takes_norm_gemv(a: torch.Tensor, b: Optional[torch.Tensor], norm_weight: torch.Tensor,
                    weight: torch.Tensor) -> bool:
    """Step 3's choice: whether the norm ops run this call as the GEMV with the norm in its prologue:
    where `project` would take the GEMV for the normed row (a's shape, dtype and strides), b (when
    given) like a, the norm weight one contiguous float row."""
    if not takes_gemv(a, weight):
        return False
    if b is not None and (b.shape != a.shape or b.dtype != a.dtype or b.stride(1) != 1):
        return False
    return _norm_weight_row(norm_weight)


def _norm_weight_row(norm_weight: torch.Tensor) -> bool:
    """Whether a norm weight is what the norm GEMV kernels read: one contiguous float row."""
    return norm_weight.dim() == 1 and norm_weight.is_floating_point() and norm_weight.stride(0) == 1


def _norm_rows(a, b, norm_weight, eps: float, unit_offset: bool):
    """The row kernel on [rows, K] views (any leading dims): (normed, summed or None) of a's shape."""
    K = a.shape[-1]
    flat = [t.reshape(-1, K) if t is not None else None for t in (a, b)]
    flat = [t if t is None or t.stride(-1) == 1 else t.contiguous() for t in flat]
    normed, summed = _norm_gemv().add_rms_norm_rows(*flat, norm_weight.contiguous(), eps, unit_offset)
    return normed.view(a.shape), summed.view(a.shape) if summed is not None else None


def _norm_rows_then_linear(a, b, norm_weight, weight, eps: float, unit_offset: bool):
    """Step 3's other path: the row kernel, then F.linear; (out, summed or None)."""
    normed, summed = _norm_rows(a, b, norm_weight, eps, unit_offset)
    return F.linear(normed, weight), summed


def add_norm_project(a: torch.Tensor, b: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                     eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_linear: (linear(RMSNorm(a + b), weight), a + b), contiguous: step 3."""
    if takes_norm_gemv(a, b, norm_weight, weight):
        return _norm_gemv().add_rms_norm_gemv(a, b, norm_weight, weight, eps, unit_offset)
    return _norm_rows_then_linear(a, b, norm_weight, weight, eps, unit_offset)


def norm_project(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool) -> torch.Tensor:
    """rms_norm_linear: linear(RMSNorm(x), weight), contiguous: step 3 without the add."""
    if takes_norm_gemv(x, None, norm_weight, weight):
        return _norm_gemv().add_rms_norm_gemv(x, None, norm_weight, weight, eps, unit_offset)[0]
    return _norm_rows_then_linear(x, None, norm_weight, weight, eps, unit_offset)[0]


def takes_gemv_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    norm_weight: torch.Tensor) -> bool:
    """Step 3's choice for linear_add_rms_norm: the GEMV with the add and the norm in its epilogue
    where `project` would take the GEMV, the residual [M, N] like the product, the norm weight one
    contiguous float row."""
    if not takes_gemv(x, weight):
        return False
    if residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype or residual.stride(1) != 1:
        return False
    return _norm_weight_row(norm_weight)


def linear_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_add_rms_norm: (RMSNorm(residual + linear(x, weight)), residual + linear(x, weight)),
    contiguous: step 3 with the norm after the projection (the GEMV's epilogue, else F.linear then
    the row kernel for the add and the norm)."""
    if takes_gemv_norm(x, weight, residual, norm_weight):
        return _norm_gemv().gemv_add_rms_norm(x, weight, residual, norm_weight, eps, unit_offset)
    return _norm_rows(residual, F.linear(x, weight), norm_weight, eps, unit_offset)


def norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
              positions: torch.Tensor, inv_freq: torch.Tensor, eps: float,
              unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope: (q's rows normed and rotated, k's), contiguous: step 4."""
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    return _norm_rope().qk_norm_rope(q, k, q_weight.contiguous(), k_weight.contiguous(), positions,
                                     inv_freq.float().contiguous(), eps, unit_offset)


def gated(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """sigmoid_gate: x * sigmoid(gate), contiguous: step 5."""
    x, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, gate))
    return _sigmoid_gate().sigmoid_gate(x, gate)


def register() -> None:
    """Step 1: the ops' CUDA kernels (the CompositeExplicitAutograd references of glue_ops still
    serve every other device)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library(glue_ops.NAMESPACE, "IMPL")
    lib.impl("small_m_linear", project, "CUDA")
    lib.impl("add_rms_norm_linear", add_norm_project, "CUDA")
    lib.impl("rms_norm_linear", norm_project, "CUDA")
    lib.impl("linear_add_rms_norm", linear_add_norm, "CUDA")
    lib.impl("qk_norm_rope", norm_rope, "CUDA")
    lib.impl("sigmoid_gate", gated, "CUDA")
    _LIB = lib


def registered() -> bool:
    return _LIB is not None


@contextlib.contextmanager
def torch_only():
    """Step 6: F.linear for every projection made inside the block."""
    global _torch_only
    before, _torch_only = _torch_only, True
    try:
        yield
    finally:
        _torch_only = before
