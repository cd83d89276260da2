"""The collectives of a tensor-parallel program, on torch.distributed's process group.

The sharding pass (compiler/passes/sharding.py) places `hgc.all_reduce` after every partial
result (row-parallel projections, the MoE block over its slice of every expert) and
`hgc.all_gather` after a vocabulary-parallel lm_head; routing binds them here like any op. One
implementation, two declarations: `gloo` on the CPU (the CPU reference of a collective is gloo's,
the same torch.distributed call) and `nccl` on CUDA.

Lifecycle:

1. The runtime starts the process group before it loads the artifact (runtime/distributed.py:
   one process per rank, gloo or NCCL, every collective under the group's timeout), so `build`
   finds it and refuses to build without one, or with a world size other than the one the
   program's gathers were traced for.
2. No hook plans anything: a collective's only input is its tensor, whose shape fixes the call;
   there is no per-step metadata, so the hooks say so and return.
3. Each call sums (or gathers) over every rank of the group. Padding rows are summed too: they
   are zeros on every rank (padded outputs are zeroed before they get here), and a CUDA graph
   replays a fixed-size collective anyway, so the padded rows ride along rather than cutting the
   tensor per step.

Under CUDA graph capture the NCCL calls are recorded like kernels (every rank captures and
replays the same buckets in the same order: the graph runner's start-up is deterministic);
gloo runs only eagerly (the CPU has no graphs). What it does not do: choose the group, time out
(the group's timeout does), or decide where a collective goes.
"""

from __future__ import annotations

import torch

from compiler.splitops import MODES, BackendCapability
from runtime.backends.protocol import BackendHooks, BackendSetup

__all__ = ["GlooCollectives", "NcclCollectives"]

_OPS = frozenset({"all_reduce", "all_gather"})


class _Collectives(BackendHooks):
    """all_reduce / all_gather over the default torch.distributed group."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    @classmethod
    def build(cls, setup: BackendSetup) -> "_Collectives":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{cls.capability.name}: the program has tensor-parallel collectives (layers "
                               f"{setup.layer_ids()}) and no torch.distributed process group is running; run the "
                               f"artifact with `hgc run --tp N` / `hgc serve --tp N` (or under torchrun)")
        world = dist.get_world_size()
        for call in setup.calls:
            if call.op == "all_gather":
                width, gathered = call.shapes["x"][-1], call.shapes["out"][-1]
                if gathered != width * world:
                    raise ValueError(f"{cls.capability.name}: layer {call.layer_id}'s gather was traced for "
                                     f"{gathered // width} ranks, the process group has {world}")
        return cls(world)

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Nothing to allocate: a collective's buffers are its operands."""

    def init_replay_state(self, ctx, bucket: int) -> None:
        """Nothing to stage: a collective reads no step metadata."""

    def init_step_metadata(self, ctx) -> None:
        """Nothing to plan: the tensor's shape is the whole call."""

    def init_chunk_metadata(self, ctx, chunk_size: int) -> None:
        """Nothing to plan per chunk either."""

    def all_reduce(self, ctx, out: torch.Tensor, layer_id: int) -> None:
        import torch.distributed as dist

        dist.all_reduce(out)

    def all_gather(self, ctx, x: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
        import torch.distributed as dist

        # out[..., r*C:(r+1)*C] = rank r's x: gather rank-major into [tp * R, C] (the layout both
        # gloo and NCCL gather into), then lay the ranks side by side along the last dimension.
        staged = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(staged, x.contiguous())
        out.copy_(staged.view(self.world_size, *x.shape).movedim(0, -2).reshape(out.shape))


class GlooCollectives(_Collectives):
    name = "gloo"
    capability = BackendCapability(
        name="gloo", device="cpu", ops=_OPS, modes_capturable=frozenset(MODES),
        doc="all-reduce and all-gather over torch.distributed's gloo group (tensor parallel on CPUs)")


class NcclCollectives(_Collectives):
    name = "nccl"
    capability = BackendCapability(
        name="nccl", device="cuda", ops=_OPS, modes_capturable=frozenset(MODES),
        doc="all-reduce and all-gather over torch.distributed's NCCL group, captured in CUDA graphs")
