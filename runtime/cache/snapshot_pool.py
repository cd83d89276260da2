"""Snapshot pool: saved copies of a request's linear-layer state, for the prefix cache.

A hybrid model's cached prefix is its full-attention KV pages plus the state every linear layer
had after the prefix's last token: the recurrent matrix and the convolution window. This pool
holds such states, one per snapshot id, in the state pool's layout:

1. Built from the LayerRegistry: for every linear layer and every state entry, one tensor
   [num_snapshots, *entry.shape] of the state pool's dtype, grouped across layers as the state
   pool's are (runtime/cache/state_pool.linear_state_buffers). With no linear layers it holds
   nothing, and any number of ids costs no memory.
2. `alloc()` hands out an id, `free(id)` returns it; the radix cache (runtime/cache/radix_cache.py)
   keeps the ids its nodes hold.
3. `save(state_pool, slots, ids)` copies the state of request slots into snapshots;
   `restore(state_pool, ids, slots)` copies snapshots into request slots. One copy per group
   (every layer's entries of one shape) for each pair, or one indexed copy per group for all the
   pairs of a step when there are more than DIRECT_PAIRS, issued on the host
   side of a step (never inside a captured graph), on the stream that runs the steps, so it is
   ordered after the step that wrote the state and before the next one that reads it.
4. A step may write a snapshot itself, at an id the prefix cache gave it: the backends that own
   linear state and say so (`writes_step_snapshots`) are built with this pool and write the state
   at a point inside a request's chunk into `buffers` (runtime/cache/prefix_cache.py, in-step).

On rank 0 of a tensor-parallel run, `journal` records each save and restore for the other ranks
to replay on their pools (runtime/dist/distributed.py); None elsewhere.

It does not decide when to snapshot (runtime/cache/prefix_cache.py does) nor how many snapshots fit
(the memory planner does).
"""

from __future__ import annotations

import torch

from compiler.splitops import LayerRegistry
from runtime.cache.state_pool import StatePool, linear_state_buffers
from runtime.step.host_copy import to_device

__all__ = ["SnapshotPool", "OutOfSnapshots"]


# Up to this many (source, destination) pairs are copied row by row; more go as one indexed copy per group.
DIRECT_PAIRS = 2


class OutOfSnapshots(RuntimeError):
    pass


class SnapshotPool:
    def __init__(self, registry: LayerRegistry, num_snapshots: int, device: torch.device | str = "cpu"):
        if num_snapshots < 0:
            raise ValueError(f"snapshot pool: the number of snapshots must be >= 0 (got {num_snapshots})")
        self.num_snapshots = num_snapshots
        self.device = torch.device(device)
        # [num_snapshots, *shape] each, views of the groups [layers, num_snapshots, *shape] (the state pool's)
        self.buffers, self.groups = linear_state_buffers(registry, num_snapshots, self.device)
        self._free: list[int] = list(range(num_snapshots - 1, -1, -1))  # pop() hands out id 0 first
        self.journal: list | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSnapshots(f"snapshot pool: all {self.num_snapshots} snapshots are in use")
        return self._free.pop()

    def free(self, snapshot: int) -> None:
        assert 0 <= snapshot < self.num_snapshots and snapshot not in self._free, (
            f"snapshot pool: snapshot {snapshot} freed twice or unknown")
        self._free.append(snapshot)

    def save(self, state_pool: StatePool, slots: list[int], snapshots: list[int]) -> None:
        """snapshot[snapshots[i]] = state of slot slots[i], in every linear layer."""
        if self.journal is not None:
            self.journal.append(("save", list(slots), list(snapshots)))
        self._copy(state_pool.groups, slots, self.groups, snapshots)

    def restore(self, state_pool: StatePool, snapshots: list[int], slots: list[int]) -> None:
        """state of slot slots[i] = snapshot[snapshots[i]], in every linear layer."""
        if self.journal is not None:
            self.journal.append(("restore", list(snapshots), list(slots)))
        self._copy(self.groups, snapshots, state_pool.groups, slots)

    def _copy(self, src_groups: list, src: list[int], dst_groups: list, dst: list[int]) -> None:
        """Row dst[i] of every layer's entries = row src[i]: one indexed copy per group (`linear_state_buffers`)."""
        assert len(src) == len(dst) and [(g.shape[0], g.shape[2:], g.dtype) for g in src_groups] == [
            (g.shape[0], g.shape[2:], g.dtype) for g in dst_groups], "snapshot pool: built for another registry than the state pool"
        if not src:
            return
        if len(src) <= DIRECT_PAIRS:
            # A hit restores one snapshot and a step saves one or two: a strided copy of row src[i]
            # per group each is one kernel and no index upload, where the indexed copy below takes
            # two index uploads and a gather into a temporary before its scatter, all ahead of the
            # step that waits for them (a hit's time to first token).
            for source, target in zip(src_groups, dst_groups):
                for s, d in zip(src, dst):
                    target[:, d].copy_(source[:, s])
            return
        # Queued from pinned memory, not a synchronous copy that would wait for every queued step
        # kernel (runtime/step/host_copy.py): the engine loop lays out the next step meanwhile.
        src_index = to_device(src, self.device)
        dst_index = to_device(dst, self.device)
        for source, target in zip(src_groups, dst_groups):  # [layers, rows, *shape] each
            target.index_copy_(1, dst_index, source.index_select(1, src_index))

    def nbytes(self) -> int:
        return sum(t.nbytes for entries in self.buffers.values() for t in entries.values())
