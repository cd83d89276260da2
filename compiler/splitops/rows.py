"""Row orders: a tensor whose rows a checkpoint stores group by group and a model holds segment by
segment. Depends on torch only (the ground floor).

Qwen3-Next's GDN input projections are stored per key head h: `in_proj_qkvz` rows are
[q_h | k_h | v_h (r value heads) | z_h (r value heads)], `in_proj_ba` rows [b_h | a_h]. The model
holds them segment-major, q of every head, then k, v, z (and b, then a), so the projection's output
is already the conv's channel order and each piece is a slice of one GEMM, with no gather.

`GroupedRows(groups, segments)` states that rearrangement once: a stored tensor's dim-0 rows are
`groups` equal groups, each the consecutive `segments`; held, segment s of every group comes
before segment s + 1 of any. `order()` is the permutation; everything else applies it:

1. models/ read a checkpoint through `to_held` and write one through `to_stored` (its inverse);
2. the compiler records, per checkpoint view of weights.json (artifact.TensorView.rows), the
   order of the rows a rank holds, so the runtime applies `to_held` to what it read: the artifact
   keeps the checkpoint's bytes (copied or linked) and its programs see held rows;
3. tensor parallelism cuts a stored tensor into whole groups (a rank's key heads, with their value
   heads), so a rank's rows are the same rearrangement with fewer groups.

Example (2 groups of segments (2, 1))::

    GroupedRows(2, (2, 1)).order()  # tensor([0, 1, 3, 4, 2, 5]): q0 q0' q1 q1' | v0 v1

What it does not do: decide which tensors are grouped (the model declares them, `row_orders()`).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["GroupedRows"]


@dataclasses.dataclass(frozen=True)
class GroupedRows:
    """Rows stored as `groups` groups of `segments`, held segment-major (module docstring)."""

    groups: int
    segments: tuple[int, ...]

    def __post_init__(self):
        assert self.groups > 0 and self.segments and all(s > 0 for s in self.segments), self

    @property
    def rows(self) -> int:
        return self.groups * sum(self.segments)

    def order(self, device=None) -> torch.Tensor:
        """[rows] int64: held row i is stored row order[i]."""
        width = sum(self.segments)
        stored = torch.arange(self.rows, device=device).view(self.groups, width)
        return torch.cat([piece.reshape(-1) for piece in stored.split(list(self.segments), dim=1)])

    def to_held(self, stored: torch.Tensor) -> torch.Tensor:
        """The stored tensor's rows in held order (a copy)."""
        self._check(stored, "stored")
        return stored.index_select(0, self.order(stored.device))

    def to_stored(self, held: torch.Tensor) -> torch.Tensor:
        """The held tensor's rows in stored order (a copy): the inverse of `to_held`."""
        self._check(held, "held")
        return held.index_select(0, self.order(held.device).argsort())

    def _check(self, t: torch.Tensor, what: str) -> None:
        if t.dim() < 1 or t.shape[0] != self.rows:
            raise ValueError(f"row order {self}: a {what} tensor of shape {list(t.shape)}, expected {self.rows} rows")

    def to_json(self) -> dict:
        return {"groups": self.groups, "segments": list(self.segments)}

    @classmethod
    def from_json(cls, obj: dict) -> "GroupedRows":
        groups, segments = int(obj["groups"]), tuple(int(s) for s in obj["segments"])
        if groups <= 0 or not segments or any(s <= 0 for s in segments):
            raise ValueError(f"groups and segments must be positive, got {obj}")
        return cls(groups, segments)
