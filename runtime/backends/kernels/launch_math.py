"""Integer helpers and tables that size kernel launches on the host.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in current Triton: called from
host code, each goes through Triton's constexpr unwrapping (a few microseconds a call), and a
decode step's launch paths called them about 150 times (benchmarks/serving/startup_bench.py's piecewise host
profile). These are the same integer functions in plain Python, for host code; kernels keep Triton's.
`token_blocks` is the (sequence, block) table the extend kernels (ours and FLA's) walk.
`triton_interpreted` says whether launches run in Triton's interpreter (the CPU tests).
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["cdiv", "next_pow2", "token_blocks", "triton_interpreted"]


def triton_interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET set, the CPU tests). Read
    at each call, as Triton reads it when a kernel is first run. The interpreter (seen with triton
    3.9) multiplies bf16 dot operands as their raw uint16 bits, so kernels that take 16-bit dots on
    the GPU take float32 ones there: the upcast is exact, and the GPU tests check the 16-bit path."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def token_blocks(lens: np.ndarray, size: int) -> np.ndarray:
    """[N, 2] int64 (sequence, block) rows: block j of sequence r covers its tokens j*size .. j*size+size-1.
    lens [S] int64; sequences of length 0 get no row. FLA's chunk indices (and our chunk kernels'
    table) are this with chunks of 64; the extend conv's token blocks with its block size. numpy,
    not torch: on the GPU machine torch's CPU repeat_interleave over a few hundred elements took from
    0.04 to 15 ms a call, erratically (BENCHMARKS.md, the extend conv section)."""
    lens = np.asarray(lens, dtype=np.int64)
    counts = (lens + size - 1) // size
    seq = np.repeat(np.arange(lens.size, dtype=np.int64), counts)
    first = np.cumsum(counts) - counts  # each sequence's first row
    return np.stack([seq, np.arange(seq.size, dtype=np.int64) - first[seq]], 1)
