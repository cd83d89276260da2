"""Slot-indexed state pool: recurrent and convolution states of the linear-attention layers.

1. Built from the LayerRegistry: for every linear layer and every state entry of its spec, one
   tensor [num_slots + 1, *entry.shape] (`buffers`), a view of its group: the entries of one shape
   and dtype across layers share one tensor [layers, num_slots + 1, *shape] (`groups`,
   `linear_state_buffers`), so zeroing or copying a slot in every layer is one operation per
   group. Slot 0 is the padding slot: padded rows of a captured batch point at it, and it is
   never handed to a request.
2. `alloc()` hands out a slot and zeroes it in every layer (a new request starts from the empty
   state; a reused slot must not leak its previous owner's state). `free(slot)` returns it.
3. `copy_slot(src, dst)` copies one request's states to another's slot (a request forked from
   another after their shared prompt).
4. Speculative decoding (`draft_tokens` D > 0): `verify_buffers` hold, per linear layer and state
   entry, [verify_rows, D, *shape]. A target_verify step feeds each request D + 1 tokens; its
   ops write the state after token i (i < D) of the request in row b of the step into entry
   [b, i], and the state after the last token into the request's slot. `keep_verified` then
   gives each request the state after its last accepted token (runtime/cache/memory_planner.py says
   why D entries, indexed by row, and how many rows).
5. `journal`: on rank 0 of a tensor-parallel run, a list that records every change to the
   buffers made outside a forward (zeroing, copies), for the other ranks to replay on theirs
   (runtime/dist/distributed.py); None elsewhere. (`keep_verified` is not journaled: speculative
   decoding is refused on tensor-parallel ranks.)

Full-attention layers get nothing here. Sizing is the memory planner's job.
"""

from __future__ import annotations

import torch

from compiler.splitops import STATE_DTYPES, LayerRegistry, dtype_from_name
from runtime.step.host_copy import to_device

__all__ = ["StatePool", "OutOfSlots", "PADDING_SLOT", "STATE_DTYPES", "STATE_TORCH_DTYPES", "linear_state_buffers",
           "CONV_HISTORY_CHANNELS_LAST"]

PADDING_SLOT = 0
# What a recurrent state may be kept in (`hgc compile --state-dtype`), as the kernels check it.
STATE_TORCH_DTYPES = tuple(dtype_from_name(name) for name in STATE_DTYPES)


class OutOfSlots(RuntimeError):
    pass


# The convolution history of a linear layer ("conv": [C, K-1], the last K-1 inputs of each channel) is
# stored [K-1, C] and handed out as its transposed view, so a column of the history is C contiguous
# values: the decode conv reads and writes a tile's history in 16-byte vectors along its channels,
# where [C, K-1] gives each channel's K-1 values 2(K-1) bytes apart, read and written one scalar at a
# time (benchmarks/probes/conv_decode_probe.py times both). Every kernel takes both strides
# (kernels/linear.py `history_strided`); torch code sees the same [C, K-1] tensor either way.
CONV_HISTORY_CHANNELS_LAST = True
_HISTORY_ENTRIES = ("conv",)

# Bytes one layer's row of a grouped entry must be a multiple of: every layer's view in a group then
# starts on the alignment a tensor of its own would have, which kernels specialise on.
GROUP_ALIGN = 256


def linear_state_buffers(registry: LayerRegistry, rows: int,
                         device: torch.device) -> tuple[dict[int, dict[str, torch.Tensor]], list[torch.Tensor]]:
    """(layer id -> state entry name -> zeros [rows, *shape] for every linear layer, the groups):
    the state pool's layout, and the snapshot pool's.

    The entries of one shape and dtype, across layers, are views of one tensor [layers, rows,
    *shape], a group, when a row of one is a multiple of GROUP_ALIGN bytes (an entry that is not
    is a group of its own, [1, rows, *shape]). A row moved, zeroed or copied in every layer is then
    one operation per group, not one per layer and entry (a hybrid model has dozens of linear
    layers). The groups depend on the registry alone, so two pools of one registry pair them. A
    convolution history is stored transposed (CONV_HISTORY_CHANNELS_LAST) and handed out as the
    [rows, C, K-1] view of its storage."""
    # (shape, dtype, stored transposed) -> (layer id, entry) in layer order
    members: dict[tuple, list[tuple[int, str]]] = {}
    for layer in registry.linear_layers():
        for name, spec in layer.state.items():
            swapped = CONV_HISTORY_CHANNELS_LAST and name in _HISTORY_ENTRIES and len(spec.shape) >= 2
            key = (tuple(spec.shape), dtype_from_name(spec.dtype), swapped)
            members.setdefault(key, []).append((layer.layer_id, name))
    buffers = {layer.layer_id: {} for layer in registry.linear_layers()}
    groups = []
    for (shape, dtype, swapped), owners in members.items():
        row_bytes = torch.Size(shape).numel() * dtype.itemsize
        stacks = [(owners, len(owners))] if row_bytes % GROUP_ALIGN == 0 else [([o], 1) for o in owners]
        stored = (*shape[:-2], shape[-1], shape[-2]) if swapped else shape
        for owned, count in stacks:
            group = torch.zeros((count, rows, *stored), dtype=dtype, device=device)
            groups.append(group)
            for i, (layer_id, name) in enumerate(owned):
                buffers[layer_id][name] = group[i].transpose(-1, -2) if swapped else group[i]
    # entries in the registry's order within each layer, as callers iterate them
    order = {layer.layer_id: list(layer.state) for layer in registry.linear_layers()}
    return {layer_id: {name: entries[name] for name in order[layer_id]} for layer_id, entries in buffers.items()}, groups


class StatePool:
    def __init__(self, registry: LayerRegistry, num_slots: int, device: torch.device | str = "cpu", *,
                 draft_tokens: int = 0, verify_rows: int = 0):
        """draft_tokens: D of speculative decoding (0: none); verify_rows: the most requests a
        target_verify step holds, padding included (memory_planner.plan_memory's intermediate_rows)."""
        if num_slots < 1:
            raise ValueError(f"state pool needs at least one request slot (got {num_slots})")
        if draft_tokens < 0 or (draft_tokens > 0) != (verify_rows > 0):
            raise ValueError(f"state pool: draft_tokens {draft_tokens} and verify_rows {verify_rows} must both be "
                             f"positive (speculative decoding) or both 0")
        self.num_slots = num_slots  # slots a request can hold; the padding slot comes on top
        self.device = torch.device(device)
        # [num_slots + 1, *shape] each, views of the groups [layers, num_slots + 1, *shape]
        self.buffers, self.groups = linear_state_buffers(registry, num_slots + 1, self.device)
        self.draft_tokens, self.verify_rows = draft_tokens, verify_rows
        # [verify_rows, D, *shape] each: entry [b, i] is the state after token i of the verify step's request b
        self.verify_buffers = {
            layer_id: {name: t.new_zeros((verify_rows, draft_tokens, *t.shape[1:])) for name, t in entries.items()}
            for layer_id, entries in self.buffers.items()} if draft_tokens else {}
        self._free: list[int] = list(range(num_slots, PADDING_SLOT, -1))  # pop() hands out slot 1 first
        self.journal: list | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """A free slot: zero, as every free slot is (`free` zeroes it), so a new request's first
        step finds no state of its last owner and waits for no zeroing of its own."""
        if not self._free:
            raise OutOfSlots(f"state pool: all {self.num_slots} slots are in use")
        return self._free.pop()

    def zero_slot(self, slot: int) -> None:
        if self.journal is not None:
            self.journal.append(("zero_slot", slot))
        # One multi-tensor launch over the groups, not one zero_ per layer and entry: a new
        # request's slot is zeroed on the engine loop's thread, between steps.
        torch._foreach_zero_(self._slot_views(slot))

    def copy_slot(self, src: int, dst: int) -> None:
        """Give slot `dst` the states of slot `src` in every layer (a request forked after its prefill)."""
        assert src != PADDING_SLOT and dst != PADDING_SLOT and src != dst, (src, dst)
        if self.journal is not None:
            self.journal.append(("copy_slot", src, dst))
        torch._foreach_copy_(self._slot_views(dst), self._slot_views(src))

    def _slot_views(self, slot: int) -> list[torch.Tensor]:
        """The slot's row in every layer: [layers, *shape] per group."""
        return [group[:, slot] for group in self.groups]

    def free(self, slot: int) -> None:
        """Give the slot back, zeroed: queued behind the steps that used it, off the path of the next
        request's first step (whose time to first token would otherwise wait for it)."""
        assert slot != PADDING_SLOT, "state pool: the padding slot is never handed out, so never freed"
        assert 0 < slot <= self.num_slots and slot not in self._free, f"state pool: slot {slot} freed twice or unknown"
        self.zero_slot(slot)
        self._free.append(slot)

    def layer(self, layer_id: int) -> dict[str, torch.Tensor]:
        try:
            return self.buffers[layer_id]
        except KeyError:
            raise KeyError(f"state pool has no linear layer {layer_id} (layers: {sorted(self.buffers)})") from None

    def verify_layer(self, layer_id: int, tokens: int, rows: int) -> dict[str, torch.Tensor]:
        """The layer's intermediate states for a target_verify step of `rows` requests of `tokens`
        tokens each, refusing one they cannot hold (a pool made without speculative decoding, or
        for fewer draft tokens or rows)."""
        if tokens - 1 > self.draft_tokens or rows > self.verify_rows:
            raise ValueError(f"state pool: a target_verify step of {rows} request(s) x {tokens} tokens needs "
                             f"intermediate states for {tokens - 1} draft tokens and {rows} rows; this pool holds "
                             f"{self.draft_tokens} x {self.verify_rows} (build it with draft_tokens and verify_rows)")
        self.layer(layer_id)  # a clear KeyError for a layer that is not linear
        return self.verify_buffers[layer_id]

    def keep_verified(self, slots: list[int], accepted: list[int]) -> None:
        """After a target_verify step: request b of the step (slot slots[b]) accepted accepted[b]
        of its D + 1 tokens (1 <= accepted <= D + 1). Its slot already holds the state after
        the last token; for accepted <= D it takes the state after token accepted - 1 instead."""
        D = self.draft_tokens
        rows = [b for b, a in enumerate(accepted) if a <= D]
        assert all(1 <= a <= D + 1 for a in accepted), f"accepted counts {accepted} outside 1..{D + 1}"
        if not rows:
            return
        # queued, not waited for: the verify round's next step is laid out meanwhile (runtime/step/host_copy.py)
        row_index = to_device(rows, self.device)
        entry_index = to_device([accepted[b] - 1 for b in rows], self.device)
        slot_index = to_device([slots[b] for b in rows], self.device)
        for layer_id, entries in self.buffers.items():
            for name, t in entries.items():
                t[slot_index] = self.verify_buffers[layer_id][name][row_index, entry_index]

    def nbytes(self) -> int:
        return sum(t.nbytes for entries in self.buffers.values() for t in entries.values())

    def verify_nbytes(self) -> int:
        return sum(t.nbytes for entries in self.verify_buffers.values() for t in entries.values())
