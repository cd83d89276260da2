"""The backend protocol, declared once: the hooks the runtime calls and the op methods it binds.

A backend is an object the runtime hands to `BoundOps`. It owns how ops run on one device
(kernels, planned metadata, static buffers for graph replay); the pools own the caches. Lifecycle
of a backend, in the order the runtime calls it:

1. Construction: `Backend.build(setup)` for an artifact (the runtime's binder calls it once per
   instance routing.json names, with a `BackendSetup`: the pools, the device, the op calls routed
   to the instance with their layer ids, dtypes and shapes, and the kernel options routing
   recorded), or the constructor directly over the pools (the eager baseline, tests).
2. `init_capture_state(max_tokens, max_seqs)`: once, before the graph runner captures anything.
3. For every step:
   a. a step replayed from one whole-step graph: `init_replay_state(ctx, bucket)`, then replay
      (or, where the backend's `replay_state_in_graph(mode)` says so, the hook is recorded in the
      graph at capture and the replay alone refills its buffers);
   b. an eager step: `init_step_metadata(ctx)`, then, for an EXTEND or MIXED step,
      `init_chunk_metadata(ctx, chunk_size)`, then the forward, whose op calls arrive as
      `backend.<op>(ctx, *op_args)` (arguments in the op's schema order);
   c. a piecewise step (captured pieces with eager gaps): as b, then `init_replay_state(ctx,
      bucket)` before the forward, for the ops that sit inside the captured pieces (a backend set's
      member whose nodes all sit in the gaps: `plan_gap_step` instead of b).

Every hook is abstract: a backend that has nothing to plan says so in its own method (with a
docstring saying why), so a wrapper that forgets to forward a hook cannot be instantiated (and
the compiler's hook lint reports it), never a skipped plan (docs/DESIGN.md failure 3).
`__init_subclass__` also checks, when a backend class is defined, that each hook and op method it
has accepts the protocol's arguments (failure 4).

Op methods are declared here with the op's schema, but a backend implements only the ops in its
`supported_ops` (taken from its `capability` declaration when it has one); the protocol's own op
methods raise `OpNotSupported`. Nothing in the protocol is a silent default.

This module does not decide which backend serves which layer (the compiler's routing pass does,
from the declarations of compiler/splitops/capability.py) nor compose backends (`backend_set.py`
forwards the hooks to the instances a routing table names; runtime/artifact/binding.py binds the ops).
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from typing import Callable, ClassVar, Optional

import torch

from compiler.splitops import LINEAR_KINDS, OP_SPECS, CallFacts, Mode
from runtime.step.context import ExecContext

__all__ = ["plan_eager_step", "BackendHooks", "BackendSetup", "HOOK_NAMES", "OP_NAMES", "LINEAR_STATE_OPS",
           "OpNotSupported", "ProtocolError", "implements", "protocol_args", "check_backend"]

HOOK_NAMES: tuple[str, ...] = ("init_capture_state", "init_replay_state", "init_step_metadata", "init_chunk_metadata")
OP_NAMES: tuple[str, ...] = tuple(OP_SPECS)
# The ops that read and write a linear layer's state (the recurrent matrix, the conv window).
LINEAR_STATE_OPS = frozenset(name for name, spec in OP_SPECS.items() if spec.stateful and spec.kinds & LINEAR_KINDS)


class OpNotSupported(NotImplementedError):
    """An op was called on a backend that does not declare it in `supported_ops`."""


class ProtocolError(TypeError):
    """A backend that contradicts the protocol: a hook or op it cannot take, an op it declares but lacks."""


@dataclasses.dataclass(frozen=True)
class BackendSetup:
    """What a backend class is handed to build one instance for an artifact (`BackendHooks.build`).

    `calls` are the op nodes routing.json routes to this instance, in every program (main and
    draft), with the facts read off the loaded graph: a backend that must know its layers before
    the first step (FlashInfer fixes heads, scale and dtypes at plan time) reads them here, from
    the graph the runtime executes, not from a model config.
    """

    kv_pool: object  # runtime.cache.kv_pool.KVPool
    state_pool: object  # runtime.cache.state_pool.StatePool
    device: torch.device
    calls: tuple[CallFacts, ...]
    options: dict[str, str]  # the kernel options routing resolved (capability.options), by name
    snapshots: object = None  # runtime.cache.snapshot_pool.SnapshotPool of the prefix cache (None: caching off)

    def layer_ids(self, *ops: str) -> list[int]:
        """The layer ids of the routed calls (of `ops` only, when given), sorted, each once."""
        return sorted({int(c.layer_id) for c in self.calls if not ops or c.op in ops})

    def first_call(self, layer_id: int, ops: tuple[str, ...] = ()) -> Optional[CallFacts]:
        return next((c for c in self.calls if c.layer_id == layer_id and (not ops or c.op in ops)), None)


def _op_stub(name: str):
    """The protocol's body for op `name`: refuse loudly, naming what the backend does declare."""

    def op(self, ctx, *args):
        raise OpNotSupported(f"backend {self.name!r} does not implement hgc.{name} "
                             f"(it declares {sorted(self.supported_ops)}); route it to another backend")

    op._hgc_protocol_stub = True  # how `implements` tells a declaration from an implementation
    return op


class BackendHooks(abc.ABC):
    """Abstract base of every backend. Subclasses set `name` and `supported_ops` and implement the hooks."""

    name: ClassVar[str] = "abstract"
    HOOKS: ClassVar[tuple[str, ...]] = HOOK_NAMES  # what the compiler's hook lint reads as "the protocol's hooks"
    # The hgc ops this backend runs: taken from the class's `capability.ops` when it has a capability
    # declaration, else set here as a class attribute. An instance may narrow it to a subset in
    # __init__ (a backend that can run every op may be asked to serve only some of them).
    supported_ops: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for hook in HOOK_NAMES + OP_NAMES:
            _check_signature(cls, hook)
        # One fact, one place: a class with a capability declaration (compiler/splitops/capability.py)
        # serves the ops it declares there; a second, different list would be a second source of truth.
        capability = getattr(cls, "capability", None)
        if capability is not None:
            declared = cls.__dict__.get("supported_ops")
            if declared is None:
                cls.supported_ops = frozenset(capability.ops)
            elif frozenset(declared) != frozenset(capability.ops):
                raise ProtocolError(f"{cls.__name__}: supported_ops {sorted(declared)} disagrees with its capability "
                                    f"declaration's ops {sorted(capability.ops)}; declare the ops once")
        unknown = set(cls.supported_ops) - set(OP_NAMES)
        if unknown:
            raise ProtocolError(f"{cls.__name__}.supported_ops names ops outside the vocabulary: {sorted(unknown)}")

    def _build_stub(cls, setup: BackendSetup) -> "BackendHooks":
        """One instance for the calls of `setup`; every backend a routing table can name defines it."""
        raise ProtocolError(f"backend class {cls.__module__}.{cls.__qualname__} does not define "
                            f"`build(setup)`, so the runtime cannot build it for an artifact; define the "
                            f"classmethod (runtime/backends/protocol.py BackendSetup says what it is given)")

    _build_stub._hgc_protocol_stub = True
    build = classmethod(_build_stub)
    del _build_stub

    # -- graph capture ----------------------------------------------------------------------

    @abc.abstractmethod
    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Once, before the graph runner captures its first CUDA graph (never during a step).

        Allocate the static metadata buffers every captured graph reads, sized for the largest
        bucket: `max_tokens` rows and `max_seqs` requests. Capture and replay only copy into them.
        """

    @abc.abstractmethod
    def init_replay_state(self, ctx: ExecContext, bucket: int) -> None:
        """Before capturing the graph of `bucket` (with a dummy step) and before every replay of it.

        `bucket` is the padded request count the graph was captured for; `ctx` is already padded
        to it (ctx.num_seqs == bucket, padded rows on the padding slot). Copy this step's metadata
        into the static buffers the captured kernels read. For a whole-step graph
        `init_step_metadata` is not called; for a piecewise step (`plan_piecewise_step`) the
        backends with a node in an eager gap planned it just before (the gaps run on that plan), and
        this hook reaches only backends whose ops are captured in the step's mode (the backend set
        forwards it to the instances with a node inside a captured piece of the step's mode, as
        split.json says). So a backend whose every node of the mode is captured gets this hook
        alone: it plans the whole step here.
        """

    # Where init_replay_state runs for a whole-step graph. Not hooks of their own: the graph runner
    # calls `replay_state_on_host` before each replay and `replay_state_captured` inside the capture,
    # and each calls init_replay_state exactly where `replay_state_in_graph` says it belongs.

    def replay_state_in_graph(self, mode: Mode) -> bool:
        """Whether init_replay_state, for a whole-step graph of `mode`, may be recorded in the graph.

        True only where the hook launches nothing but device work (copies, elementwise kernels)
        that reads the step's device tensors, at the addresses the graph runner keeps for the
        bucket, and depends on the host only through what the bucket fixes (its request count and
        rows per request). The graph then refills this backend's buffers itself, and a replay
        calls nothing on it (host time per decode step). The protocol answers False: the hook runs
        on the host before every replay, which is always correct."""
        return False

    def replay_state_on_host(self, ctx: ExecContext, bucket: int) -> None:
        """Before a whole-step replay: init_replay_state, unless the graph holds it."""
        if not self.replay_state_in_graph(Mode(ctx.mode)):
            self.init_replay_state(ctx, bucket)

    def replay_state_captured(self, ctx: ExecContext, bucket: int) -> None:
        """Inside a whole-step capture, before the step's first op: init_replay_state where the graph holds it."""
        if self.replay_state_in_graph(Mode(ctx.mode)):
            self.init_replay_state(ctx, bucket)

    def plan_piecewise_step(self, ctx: ExecContext, bucket: int, chunk_size: int,
                            plan_mode: Mode | None = None, first_piece_stages: bool = False,
                            defer_gaps: Callable[["BackendHooks", Callable[[], None]], None] | None = None) -> None:
        """Before a piecewise step (captured pieces around eager gaps): the gaps' plan
        (`plan_eager_step`), then `init_replay_state` for the pieces. Not a hook of its own: a
        backend set sends the first to the members with a node in an eager gap of the step's mode
        and the second to those with a node in a captured piece, so a member whose nodes are all
        captured plans nothing that its replay state would replace (a linear backend's host-built
        extend tables). A member with nodes on both sides gets both, in that order, and its
        `init_replay_state` must keep the eager plan for the ops in the gaps (Kimi's KDA beside its
        captured short conv: runtime/backends/triton_linear.py). `plan_mode`: the mode
        whose split plan the step runs, where it is not the step's own (a decode step through the
        extend plan's pieces: the graph runner's piecewise decode). `first_piece_stages`: the
        step's first captured piece records `stage_in_first_piece` (below), so what that stages is
        not staged again here; a lone backend stages nothing there and plans everything here.
        `defer_gaps(member, plan)`: the runner's way to run a member's plan just before that
        member's first op of the step, after the pieces before that op were launched (the device
        busy with them meanwhile); a backend set hands it the plans of its members that own nodes
        in the gaps alone (FlashInfer's prefill plan in a long extend step, needed first at the
        first attention layer). A lone backend owns the pieces' nodes too and plans now."""
        plan_eager_step(self, ctx, chunk_size)
        self.init_replay_state(ctx, bucket)

    def plan_gap_step(self, ctx: ExecContext, bucket: int, chunk_size: int) -> None:
        """Before a piecewise step, for a member of a backend set whose nodes of the step's plan
        all sit in its eager gaps (none in a captured piece: `plan_piecewise_step` sends such a
        member this, or hands it to `defer_gaps`): the plan its gap ops read. `ctx` is padded to
        `bucket` as for init_replay_state, its tensors the runner's staged ones. The protocol plans
        an eager step (`plan_eager_step`): always correct. A backend whose gap ops can run on its
        captured steps' static tables, made on the device from the staged step, may plan those here
        instead (no host-built tables, the same buffers every step of the bucket:
        runtime/backends/triton_linear.py under chunk_impl=flashinfer)."""
        plan_eager_step(self, ctx, chunk_size)

    def stage_in_first_piece(self, ctx: ExecContext, bucket: int, plan_mode: Mode) -> None:
        """Inside the capture of a piecewise decode or target_verify step's first captured piece,
        before its first op: the init_replay_state that piece's graph may hold, so a replay leaves
        it off the host. Only a backend with no node in the step's eager gaps and whose hook is
        device work alone (`replay_state_in_graph`) may be staged there: a gap's op runs on the
        host and reads what the hook planned on the host. The protocol stages nothing (a lone
        backend may own a gap's node): always correct."""

    def writes_step_snapshots(self, snapshots) -> bool:
        """Whether this backend's linear-state ops (LINEAR_STATE_OPS) write a step's in-step
        snapshots into `snapshots` (the prefix cache's SnapshotPool): for each request b with
        ExecContext.snapshot_rows[b] = r >= 0, the state after its first r tokens of the step, in
        every entry of the layer, at id snapshot_ids[b], in the pool's layout (what `save` writes).
        The prefix cache then snapshots at a point inside a chunk without ending the step there.
        The protocol answers False: the cache ends a chunk at each snapshot point instead, which
        is always correct. Only backends that may run those ops are asked (`BackendSet`)."""
        return False

    def kernel_variant_tokens(self, max_tokens: int) -> tuple[int, ...]:
        """Token counts of eager extend steps that, run once each at start-up, launch every kernel
        variant this backend's eager steps of up to `max_tokens` tokens can pick.

        A Triton kernel is built again for each set of constexprs; a backend that picks tiles or
        kernels from the step's token count (the fused MoE) would otherwise build one at serving
        time for a count start-up never ran, outside the artifact's bundle (docs/DESIGN.md "Why a
        run finds every kernel the build made"). The graph runner runs these steps after capture,
        in the build and in every run alike. The protocol answers none: right for a backend whose
        kernels the layer shapes alone fix; the run's start-up watch names any kernel built then."""
        return ()

    # -- per step -----------------------------------------------------------------------------

    @abc.abstractmethod
    def init_step_metadata(self, ctx: ExecContext) -> None:
        """Once per step that is not replayed from a graph, after the step is built, before the forward.

        Plan what the step's op calls share (index arrays on the device, attention plans), so
        the op methods do no host-side planning of their own.
        """

    @abc.abstractmethod
    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Once per EXTEND or MIXED step, after `init_step_metadata`, before the forward.

        `chunk_size` is the engine's token budget per step: the longest piece of one request's
        prompt a step can carry. Backends that split long extends (chunked-prefix MLA attention,
        chunked linear-attention kernels) plan chunk boundaries and size workspaces here.
        """

    # -- ops (schema order after ctx; each writes `out` in place and returns None) ------------

    gqa_attention = _op_stub("gqa_attention")
    mla_attention = _op_stub("mla_attention")
    gdn_core = _op_stub("gdn_core")
    kda_core = _op_stub("kda_core")
    lightning_core = _op_stub("lightning_core")
    short_conv = _op_stub("short_conv")
    gdn_fused = _op_stub("gdn_fused")
    moe = _op_stub("moe")
    all_reduce = _op_stub("all_reduce")
    all_gather = _op_stub("all_gather")


# The arguments the runtime passes to each hook and op method, after self: a backend's method
# must accept them positionally (the backend set forwards hooks positionally).
_PROTOCOL_ARGS: dict[str, tuple[str, ...]] = {
    "init_capture_state": ("max_tokens", "max_seqs"),
    "init_replay_state": ("ctx", "bucket"),
    "init_step_metadata": ("ctx",),
    "init_chunk_metadata": ("ctx", "chunk_size"),
    "gqa_attention": ("ctx", "q", "k", "v", "out", "layer_id", "scale"),
    "mla_attention": ("ctx", "q_latent", "q_rope", "kv_latent", "k_rope", "out", "layer_id", "scale"),
    "gdn_core": ("ctx", "q", "k", "v", "g", "beta", "out", "layer_id", "scale"),
    "kda_core": ("ctx", "q", "k", "v", "g", "beta", "out", "layer_id", "scale"),
    "lightning_core": ("ctx", "q", "k", "v", "decay", "out", "layer_id", "scale"),
    "short_conv": ("ctx", "x", "weight", "bias", "out", "layer_id", "silu"),
    "gdn_fused": ("ctx", "qkv", "z", "b", "a", "conv_weight", "A_log", "dt_bias", "norm_weight", "out", "layer_id",
                  "k_heads", "scale", "eps"),
    "moe": ("ctx", "x", "router_weight", "router_bias", "w13", "w2", "shared_w13", "shared_w2", "shared_gate",
            "out", "layer_id", "top_k", "scoring", "renormalize", "routed_scale", "num_groups", "topk_groups"),
    "all_reduce": ("ctx", "out", "layer_id"),
    "all_gather": ("ctx", "x", "out", "layer_id"),
}
assert set(_PROTOCOL_ARGS) == set(HOOK_NAMES + OP_NAMES), "every hook and op needs its protocol arguments"


def protocol_args(name: str) -> tuple[str, ...]:
    """The arguments (after self) the runtime passes to hook or op `name`."""
    return _PROTOCOL_ARGS[name]


def _check_signature(cls: type, name: str) -> None:
    method = getattr(cls, name, None)
    if method is None or getattr(method, "_hgc_protocol_stub", False) or getattr(method, "__isabstractmethod__", False):
        return
    args = _PROTOCOL_ARGS[name]
    try:
        inspect.signature(method).bind(None, *args)  # None stands for self
    except TypeError as e:
        raise ProtocolError(
            f"{cls.__name__}.{name}{inspect.signature(method)} does not accept the protocol's arguments "
            f"(self, {', '.join(args)}): {e}") from None


def implements(backend, op: str) -> bool:
    """Whether `backend` has its own method for op (not the protocol's refusing stub)."""
    method = getattr(type(backend), op, None)
    return callable(method) and not getattr(method, "_hgc_protocol_stub", False)


def check_backend(backend) -> None:
    """Refuse an object that is not a protocol backend, or declares an op it does not implement."""
    if not isinstance(backend, BackendHooks):
        raise ProtocolError(
            f"{type(backend).__name__} does not implement the backend protocol "
            f"(runtime/backends/protocol.py BackendHooks: {', '.join(HOOK_NAMES)})")
    unknown = sorted(set(backend.supported_ops) - set(OP_NAMES))
    lacking = sorted(op for op in backend.supported_ops if not implements(backend, op))
    beyond = sorted(set(backend.supported_ops) - set(type(backend).supported_ops))
    problems = [f"{what} {ops}" for what, ops in (("unknown ops", unknown), ("ops it does not implement", lacking),
                                                   ("ops beyond its class's declaration", beyond)) if ops]
    if problems:
        raise ProtocolError(f"backend {backend.name!r}: supported_ops names {'; '.join(problems)}")


def plan_eager_step(backend: BackendHooks, ctx: ExecContext, chunk_size: int) -> None:
    """Step 3b above, before an eager step's forward: step metadata, and chunk metadata outside decode."""
    backend.init_step_metadata(ctx)
    if ctx.mode != Mode.DECODE:
        backend.init_chunk_metadata(ctx, chunk_size)
