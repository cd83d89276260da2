"""Slot-indexed state pool: recurrent and convolution states of the linear-attention layers.

1. Built from the LayerRegistry: for every linear layer and every state entry of its spec, one
   tensor [num_slots + 1, *entry.shape]. Slot 0 is the padding slot: padded rows of a captured
   batch point at it, and it is never handed to a request.
2. `alloc()` hands out a slot and zeroes it in every layer (a new request starts from the empty
   state; a reused slot must not leak its previous owner's state). `free(slot)` returns it.
3. `copy_slot(src, dst)` copies one request's states to another's slot (a request forked from
   another after their shared prompt).
4. `journal`: on rank 0 of a tensor-parallel run, a list that records every change to the
   buffers made outside a forward (zeroing, copies), for the other ranks to replay on theirs
   (runtime/distributed.py); None elsewhere.

Full-attention layers get nothing here. Sizing is the memory planner's job.
"""

from __future__ import annotations

import torch

from compiler.splitops import LayerRegistry, dtype_from_name

__all__ = ["StatePool", "OutOfSlots", "PADDING_SLOT", "linear_state_buffers"]

PADDING_SLOT = 0


class OutOfSlots(RuntimeError):
    pass


def linear_state_buffers(registry: LayerRegistry, rows: int,
                         device: torch.device) -> dict[int, dict[str, torch.Tensor]]:
    """layer id -> state entry name -> zeros [rows, *shape] for every linear layer (the snapshot pool's layout too)."""
    return {
        layer.layer_id: {name: torch.zeros((rows, *spec.shape), dtype=dtype_from_name(spec.dtype), device=device)
                         for name, spec in layer.state.items()}
        for layer in registry.linear_layers()
    }


class StatePool:
    def __init__(self, registry: LayerRegistry, num_slots: int, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"state pool needs at least one request slot (got {num_slots})")
        self.num_slots = num_slots  # slots a request can hold; the padding slot comes on top
        self.device = torch.device(device)
        self.buffers = linear_state_buffers(registry, num_slots + 1, self.device)  # [num_slots + 1, *shape] each
        self._free: list[int] = list(range(num_slots, PADDING_SLOT, -1))  # pop() hands out slot 1 first
        self.journal: list | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfSlots(f"state pool: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self.zero_slot(slot)
        return slot

    def zero_slot(self, slot: int) -> None:
        if self.journal is not None:
            self.journal.append(("zero_slot", slot))
        for entries in self.buffers.values():
            for t in entries.values():
                t[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Give slot `dst` the states of slot `src` in every layer (a request forked after its prefill)."""
        assert src != PADDING_SLOT and dst != PADDING_SLOT and src != dst, (src, dst)
        if self.journal is not None:
            self.journal.append(("copy_slot", src, dst))
        for entries in self.buffers.values():
            for t in entries.values():
                t[dst].copy_(t[src])

    def free(self, slot: int) -> None:
        assert slot != PADDING_SLOT, "state pool: the padding slot is never handed out, so never freed"
        assert 0 < slot <= self.num_slots and slot not in self._free, f"state pool: slot {slot} freed twice or unknown"
        self._free.append(slot)

    def layer(self, layer_id: int) -> dict[str, torch.Tensor]:
        try:
            return self.buffers[layer_id]
        except KeyError:
            raise KeyError(f"state pool has no linear layer {layer_id} (layers: {sorted(self.buffers)})") from None

    def nbytes(self) -> int:
        return sum(t.nbytes for entries in self.buffers.values() for t in entries.values())
