"""The batch-invariant switch: torch's CUDA matrix products and sums over dims, process-wide, to
kernels whose every row is computed in one fixed order whatever the number of rows.

`install()` registers, for the CUDA dispatch key, runtime/backends/kernels/matmul.py's aten::mm,
addmm and bmm (and their out= forms) and runtime/backends/kernels/row_sum.py's aten::sum.dim_IntList
and mean.dim. Every such call of the process, whoever makes it, runs there from then on. A runtime
installs it to serve an artifact compiled with `hgc compile --batch-invariant` (runtime/artifact/loader.py):
the eager glue calls these ops through torch (its RMSNorms and L2 norms are sum.dim / mean.dim
over the last dim) and Inductor's compiled glue calls mm/addmm as extern kernels, so the override
reaches them without recompiling anything.

It does not reach the reductions Inductor's compiled glue generates itself, nor any op outside
the two modules' lists (their docstrings say which).

`products_to_torch()` gives the products back to torch for a while: the speculative decoder
captures the draft program's graphs inside it (runtime/engine/speculative.py). A draft's numbers choose
what is proposed, never what a request keeps (the verify step's rows decide that, and they stay
fixed-order), and torch's products are the faster ones at a draft step's single row.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional, Sequence

import torch

__all__ = ["install", "installed", "products_routed", "products_to_torch", "register", "uninstall"]

_LIB: Optional[torch.library.Library] = None  # kept here: dropping the Library unregisters its kernels
_ROUTED = {"products": False, "sums": False}  # what _LIB routes


def register(dispatch_key: str, impls: Sequence[tuple[str, Callable]]) -> torch.library.Library:
    """A Library with each (aten overload, function) of `impls` registered for `dispatch_key`. The
    functions take the ops' arguments as they come (keyword ones by keyword) and never call the op
    they replace, which would come back to them. Tests register for the CPU key (the interpreter)."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": the point
        warnings.simplefilter("ignore", UserWarning)
        for name, fn in impls:
            lib.impl(name, fn, dispatch_key)
    return lib


def install(log: Optional[Callable[[str], None]] = None, *, sums: bool = True, products: bool = True) -> None:
    """Route the products and sums named above on CUDA to the fixed-order kernels, for the whole
    process (the module docstring says why a runtime does). A second call does nothing. `sums`
    False leaves sums and means to torch (benchmarks time what the row sums cost against that);
    `products` False, the products (`products_to_torch`)."""
    global _LIB
    if _LIB is not None:
        return
    from runtime.backends.kernels import matmul as triton_matmul, row_sum as triton_row_sum  # Triton's: a CPU-only install never gets here
    _LIB = register("CUDA", (triton_matmul.ATEN_IMPLS if products else ()) +
                    (triton_row_sum.ATEN_IMPLS if sums else ()))
    _ROUTED.update(products=products, sums=sums)
    if log is not None:
        log("batch-invariant kernels: aten mm/addmm/bmm and sum/mean over dims on CUDA run in one fixed order")


def installed() -> bool:
    """Whether install() has routed them (and uninstall() has not undone it)."""
    return _LIB is not None


def products_routed() -> bool:
    """Whether the matrix products run the fixed-order kernel now."""
    return _LIB is not None and _ROUTED["products"]


def uninstall() -> None:
    """Give the CUDA ops back to torch's own kernels (tests and benchmarks compare both)."""
    global _LIB
    if _LIB is not None:
        _LIB._destroy()
        _LIB = None
        _ROUTED.update(products=False, sums=False)


@contextlib.contextmanager
def products_to_torch():
    """Within: the matrix products run torch's own kernels again; the sums stay as installed. For
    work whose numbers never reach a request's output (module docstring). Nothing installed: as is."""
    if not products_routed():
        yield
        return
    sums = _ROUTED["sums"]
    uninstall()
    install(sums=sums, products=False)
    try:
        yield
    finally:
        uninstall()
        install(sums=sums, products=True)
