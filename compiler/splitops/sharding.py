"""Tensor parallelism's vocabulary: how one checkpoint tensor is cut across ranks, and the one
divisibility rule. Depends on nothing but the standard library (the ground floor).

A rank program (compiler/frontend.py traces one per compile, shared by every rank) holds the
rank's shapes: every quantity tensor parallelism splits (attention heads, linear-attention heads,
MLP and expert widths, the vocabulary rows of lm_head) divided by the rank count, KV heads
replicated where there are fewer of them than ranks. Three facts live here:

1. `split_count(total, tp, what, where)` is the rule every split obeys: a quantity divides over
   the ranks, or (`replicate=True`, KV heads) the rank count is a multiple of it, each head then
   held by tp / total ranks. Anything else is a `ShardingError` naming the layer, the
   quantity and the rank counts that would work. models/ calls it while building a rank model.
2. `ShardSpec`: how rank r reads its part of one checkpoint tensor: along one dimension, a
   sequence of segments (a fused q|k|v projection has three), each cut into `parts` equal
   chunks, rank r taking chunk r * parts // tp of every segment. parts == tp is a plain split;
   parts < tp holds each chunk on tp / parts ranks (replicated KV heads); no dimension means the
   whole tensor on every rank. The sharding pass derives one spec per tensor
   (compiler/passes/sharding.py); the runtime slices with it (runtime/artifact/weights.py).
3. `rank_slices(spec, rank, tp)`: the (start, stop) ranges of that rank, what safetensors'
   get_slice reads, so no rank reads more than its part.

What it does not do: decide where a tensor is cut (the sharding pass does), read files.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .errors import CompileError

__all__ = ["ShardingError", "ShardSpec", "split_count", "divisors", "REPLICATED"]


class ShardingError(CompileError):
    """A sharding that cannot hold: a count that does not divide over the ranks, or shapes that disagree."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_count(total: int, tp: int, what: str, where: str, replicate: bool = False) -> int:
    """`total` things (heads, channels, rows) over `tp` ranks: the count on each rank.

    `replicate`: fewer things than ranks is allowed when tp is a multiple of total; each rank
    then holds one, shared by tp / total ranks (KV heads of grouped-query attention).
    `where` names the layer (or tensor) for the error: "layer 3 (full_gqa)".
    """
    if tp < 1:
        raise ShardingError(f"tensor parallel: --tp must be at least 1 (got {tp})")
    if total % tp == 0:
        return total // tp
    if replicate and tp % total == 0:
        return 1
    fits = divisors(total)
    also = f", or a multiple of {total} (each {what.rstrip('s')} then replicated)" if replicate else ""
    raise ShardingError(f"tensor parallel {tp}: {where}: {total} {what} do not divide over {tp} ranks; "
                        f"--tp must divide {total} ({', '.join(map(str, fits))}){also}")


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """How every rank reads its part of one tensor.

    `dim` None: replicated, every rank reads the whole tensor. Otherwise `segments` are the
    consecutive (full length, parts) runs along `dim`, covering it; rank r reads chunk
    r * parts // tp of each and the chunks, concatenated in order, are its tensor.

    Example (Qwen3-Next's conv1d weight, channels q | k | v, tp 2)::

        ShardSpec(0, ((2048, 2), (2048, 2), (4096, 2)))   # rank 1: rows 1024:2048, 3072:4096, 6144:8192
    """

    dim: Optional[int]
    segments: tuple[tuple[int, int], ...] = ()

    @property
    def replicated(self) -> bool:
        return self.dim is None

    def rank_slices(self, rank: int, tp: int) -> list[tuple[int, int]]:
        """[(start, stop), ...] along `dim` that rank `rank` of `tp` reads, in order."""
        assert self.dim is not None and 0 <= rank < tp, (self, rank, tp)
        out, base = [], 0
        for length, parts in self.segments:
            chunk = length // parts
            index = rank * parts // tp
            out.append((base + index * chunk, base + (index + 1) * chunk))
            base += length
        return out

    def rank_shape(self, full_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full_shape)
        shape = list(full_shape)
        shape[self.dim] = sum(length // parts for length, parts in self.segments)
        return tuple(shape)

    def describe(self, tp: int) -> str:
        """For dumps and `hgc inspect`: 'replicated', 'dim 0 / 2', 'dim 0 / 2 in 3 segments',
        'dim 0: 1 of 2 parts, each on 2 ranks'."""
        if self.dim is None:
            return "replicated"
        parts = {p for _, p in self.segments}
        cut = f"dim {self.dim} / {tp}" if parts == {tp} else f"dim {self.dim}: " + ", ".join(
            f"{length // p} of {length}" + (f" (each on {tp // p} ranks)" if p < tp else "")
            for length, p in self.segments)
        return cut + (f" in {len(self.segments)} segments" if len(self.segments) > 1 and parts == {tp} else "")

    def to_json(self) -> dict:
        return {"dim": self.dim, "segments": [list(s) for s in self.segments]}

    @classmethod
    def from_json(cls, obj: dict) -> "ShardSpec":
        dim = obj.get("dim")
        return cls(None if dim is None else int(dim), tuple((int(a), int(b)) for a, b in obj.get("segments", ())))


REPLICATED = ShardSpec(None)
