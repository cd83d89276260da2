"""The collectives of a tensor-parallel program, on torch.distributed's process group.

The sharding pass (compiler/passes/sharding.py) places `hgc.all_reduce` after every partial
result (row-parallel projections, the MoE block over its slice of every expert) and
`hgc.all_gather` after a vocabulary-parallel lm_head; routing binds them here like any op. One
implementation, two declarations: `gloo` on the CPU (the CPU reference of a collective is gloo's,
the same torch.distributed call) and `nccl` on CUDA.

Lifecycle:

1. The runtime starts the process group before it loads the artifact (runtime/dist/distributed.py:
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

`symm_mem` (CUDA, all-reduce only, chosen by routing over `nccl` where it fits) sums small
tensors with PyTorch's symmetric-memory one-shot all-reduce (`torch.ops.symm_mem`, peer-to-peer
loads over NVLink, no multicast): one kernel that copies this rank's tensor into a buffer every
rank can read, waits for its peers at a barrier of signal pads, and adds every rank's buffer.
NCCL's ring takes two protocol rounds through its own channels for the same message; a decode
step of a tensor-parallel model runs two all-reduces a layer of a few KiB each, where that
latency, not bandwidth, is the cost (benchmarks/kernels/allreduce_bench.py measures both in graphs).
Above `ONE_SHOT_MAX_BYTES` the one-shot read of every peer's whole tensor loses to the ring,
so larger tensors (extend steps) go through NCCL, as do tensors whose byte size is not a whole
number of 4-byte words (the kernel's smallest unit): the choice is the tensor's byte size, which
every rank shares, so all ranks always meet in the same collective.
"""

from __future__ import annotations

import torch

from compiler.splitops import MODES, BackendCapability
from runtime.backends.protocol import BackendHooks, BackendSetup

__all__ = ["GlooCollectives", "NcclCollectives", "SymmMemAllReduce", "ONE_SHOT_MAX_BYTES"]

_OPS = frozenset({"all_reduce", "all_gather"})
# The largest tensor the one-shot all-reduce sums (a batch-256 decode step of a 2048-wide model in
# bf16); its symmetric buffer is this size on every rank.
ONE_SHOT_MAX_BYTES = 1 << 20
_VECTOR_BYTES = 16  # the one-shot kernel moves 16-byte vectors: the copy-in path needs that alignment
_WORD_BYTES = 4  # and at least 4-byte words: a tensor of another byte size goes through NCCL


class _Collectives(BackendHooks):
    """all_reduce / all_gather over the default torch.distributed group."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    @classmethod
    def build(cls, setup: BackendSetup) -> "_Collectives":
        cls._check_group(setup)
        import torch.distributed as dist

        return cls(dist.get_world_size())

    @classmethod
    def _check_group(cls, setup: BackendSetup) -> None:
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


class SymmMemAllReduce(NcclCollectives):
    """all_reduce through symmetric memory's one-shot kernel up to ONE_SHOT_MAX_BYTES, NCCL above (module docstring)."""

    name = "symm_mem"
    capability = BackendCapability(
        name="symm_mem", device="cuda", ops=frozenset({"all_reduce"}), modes_capturable=frozenset(MODES),
        dtypes=frozenset({"float32", "bfloat16"}), priority=1,
        doc=f"all-reduce of tensors up to {ONE_SHOT_MAX_BYTES >> 10} KiB with PyTorch's symmetric-memory one-shot "
            f"kernel (peer loads over NVLink), larger ones over NCCL; GPUs of one host")

    def __init__(self, world_size: int, buffer: torch.Tensor, group_name: str):
        super().__init__(world_size)
        self.buffer = buffer  # uint8, rendezvoused on every rank: its size is the largest one-shot sum
        self.group_name = group_name

    @classmethod
    def build(cls, setup: BackendSetup) -> "SymmMemAllReduce":
        cls._check_group(setup)
        import torch.distributed as dist
        import torch.distributed._symmetric_memory  # noqa: F401 - registers torch.ops.symm_mem

        ops = torch.ops.symm_mem
        way_out = "route the all-reduces to NCCL (`hgc compile --route all_reduce=nccl`)"
        if not (hasattr(ops, "one_shot_all_reduce_copy_out") and hasattr(ops, "one_shot_all_reduce")):
            raise RuntimeError(f"symm_mem: this torch ({torch.__version__}) has no symmetric-memory one-shot "
                               f"all-reduce; {way_out}")
        device, world = setup.device, dist.get_world_size()
        if device.type != "cuda":
            raise RuntimeError(f"symm_mem: runs on CUDA devices, this rank has {device}; {way_out}")
        # Every rank must reach every other rank's buffer: one host, peer access between its GPUs.
        if world > torch.cuda.device_count():
            raise RuntimeError(f"symm_mem: {world} ranks on a host with {torch.cuda.device_count()} GPUs (the "
                               f"one-shot all-reduce reads peers' memory on one host); {way_out}")
        blind = [d for d in range(torch.cuda.device_count())
                 if d != device.index and not torch.cuda.can_device_access_peer(device.index, d)]
        if blind:
            raise RuntimeError(f"symm_mem: GPU {device.index} cannot access GPUs {blind} as peers; {way_out}")
        # A collective at build: every rank builds the same backends in the same order (runtime/artifact/binding.py).
        return cls.with_buffer(world, ONE_SHOT_MAX_BYTES, device)

    @classmethod
    def with_buffer(cls, world: int, nbytes: int, device: torch.device) -> "SymmMemAllReduce":
        """An instance whose one-shot sums go up to `nbytes` (a collective: every rank calls it)."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name
        # The CUDA backend: buffers shared through CUDA's IPC handles among the host's GPUs, which
        # is all a one-shot sum on one host needs (NVSHMEM, when installed, brings its own bootstrap).
        if symm_mem.get_backend(device) != "CUDA":
            symm_mem.set_backend("CUDA")
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group_name)
        return cls(world, buffer, group_name)

    def path(self, out: torch.Tensor) -> str:
        """How `all_reduce` sums `out`: "one_shot" (one kernel), "staged" (copied into the buffer
        first: off the 16-byte grid or not contiguous) or "nccl" (too large, or not whole 4-byte
        words). Byte size and layout only, which every rank shares."""
        nbytes = out.numel() * out.element_size()
        if nbytes > self.buffer.numel() or nbytes % _WORD_BYTES:
            return "nccl"
        aligned = out.data_ptr() % _VECTOR_BYTES == 0 and nbytes % _VECTOR_BYTES == 0
        return "one_shot" if out.is_contiguous() and aligned else "staged"

    def all_reduce(self, ctx, out: torch.Tensor, layer_id: int) -> None:
        if out.numel() == 0:
            return None
        path = self.path(out)
        if path == "nccl":
            return super().all_reduce(ctx, out, layer_id)
        staged = self.buffer[:out.numel() * out.element_size()].view(out.dtype)
        if path == "one_shot":
            # One kernel: copy in, barrier, sum every rank's buffer into `out` (each thread writes
            # only the elements it copied in before the barrier, so `out` may be the local input).
            flat = out.view(-1)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", self.group_name, flat)
        else:
            # A tensor the vector copy cannot take: stage it, sum into a fresh tensor, copy back.
            staged.copy_(out.reshape(-1))
            out.copy_(torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name).view(out.shape))
