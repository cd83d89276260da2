"""Integer helpers that size kernel launches on the host.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions in current Triton: called from
host code, each goes through Triton's constexpr unwrapping (a few microseconds a call), and a
decode step's launch paths called them about 150 times (benchmarks/startup_bench.py's piecewise host
profile). These are the same integer functions in plain Python, for host code; kernels keep Triton's.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()
