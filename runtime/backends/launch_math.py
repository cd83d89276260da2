"""Integer helpers and tables that size kernel launches on the host.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in current Triton: called from
host code, each goes through Triton's constexpr unwrapping (a few microseconds a call), and a
decode step's launch paths called them about 150 times (benchmarks/startup_bench.py's piecewise host
profile). These are the same integer functions in plain Python, for host code; kernels keep Triton's.
`token_blocks` is the (sequence, block) table the extend kernels (ours and FLA's) walk.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cdiv", "next_pow2", "token_blocks"]


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
