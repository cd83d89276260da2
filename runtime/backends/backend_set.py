"""BackendSet: the backend instances one routing table names, behind the protocol's hooks.

1. The runtime's binder (runtime/artifact/binding.py) builds one instance per backend (and kernel options)
   that routing.json names, and for each program a BackendSet over the instances that own a node
   of it (`members`, by instance key, in routing order), with `captured`: per mode, the members
   owning a node inside a captured piece of that mode's split plan, and `gaps`: those owning a
   node in an eager gap of it, both read from split.json.
2. Each hook of the protocol is written out below and forwarded to members explicitly:
   `init_capture_state`, `init_step_metadata` and `init_chunk_metadata` to every member (each owns
   a node of the step), `init_replay_state` to the members captured in the step's mode (in a
   piecewise step the others run in the eager gaps on the plan `init_step_metadata` made; their
   replay hook would refuse the mode, or make them treat an eager step as a replayed one). A
   piecewise step (`plan_piecewise_step`) plans eagerly only the members in its mode's gaps. No
   `hasattr` guard: the protocol makes every hook abstract, so a member always has it, and the
   protocol's definition-time check guarantees it accepts the arguments forwarded here
   (docs/DESIGN.md failures 3 and 4; the compiler's hook lint checks this class).
3. Ops are not dispatched here: each graph node is bound to its instance's method by the binder,
   so nothing at run time looks an op up by name or device. The set runs no op itself.

It does not decide which backend runs a node (routing did, in routing.json) and holds no state
of its own.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

from compiler.splitops import Mode
from runtime.backends.protocol import LINEAR_STATE_OPS, BackendHooks, ProtocolError, check_backend, plan_eager_step
from runtime.step.context import ExecContext

__all__ = ["BackendSet"]


class BackendSet(BackendHooks):
    name = "backend_set"
    supported_ops = frozenset()  # ops are bound per node to the members, never through the set

    def __init__(self, members: Mapping[str, BackendHooks], captured: Mapping[Mode, tuple[str, ...]],
                 gaps: Mapping[Mode, tuple[str, ...]] | None = None):
        """gaps: per mode, the members with a node in an eager gap; a mode it does not name (or
        None: a set made by hand) plans every member before a piecewise step."""
        if not members:
            raise ProtocolError("BackendSet: a program with no op node has no backend to forward hooks to")
        for member in members.values():
            check_backend(member)
        gaps = gaps or {}
        for what, by_mode in (("captured", captured), ("gap", gaps)):
            unknown = sorted({k for keys in by_mode.values() for k in keys} - set(members))
            if unknown:
                raise ProtocolError(f"BackendSet: {what} members {unknown} are not members {sorted(members)}")
        self.members: dict[str, BackendHooks] = dict(members)
        self.children: tuple[BackendHooks, ...] = tuple(self.members.values())
        # init_replay_state's receivers per mode, fixed by split.json's captured pieces
        self._replayed = {mode: tuple(self.members[k] for k in captured.get(mode, ())) for mode in Mode}
        # the members planned eagerly before a piecewise step of each mode (split.json's eager gaps)
        self._gaps = {mode: tuple(self.members[k] for k in gaps[mode]) if mode in gaps else self.children
                      for mode in Mode}
        # A whole-step graph of a mode holds every member's nodes (a small extend bucket's graph holds
        # the plan's gaps too: SplitPlan.whole_up_to), so every member is replayed in it; per mode:
        # (hooks run on the host before a whole-step replay, hooks the graph records). A member's
        # answer is fixed when it is built, so a replay asks nobody.
        self._whole_step = {mode: (tuple(m for m in self.children if not m.replay_state_in_graph(mode)),
                                   tuple(m for m in self.children if m.replay_state_in_graph(mode)))
                            for mode in Mode}
        self._first_piece: dict[tuple[Mode, Mode], tuple[BackendHooks, ...]] = {}  # _in_first_piece's answers
        self.name = f"backends({', '.join(self.members)})"

    def replayed_in(self, mode: Mode) -> tuple[BackendHooks, ...]:
        return self._replayed[Mode(mode)]

    def planned_in_gaps(self, mode: Mode) -> tuple[BackendHooks, ...]:
        """The members planned eagerly before a piecewise step of `mode`."""
        return self._gaps[Mode(mode)]

    # -- hooks: forwarded explicitly ------------------------------------------------------------

    def init_capture_state(self, max_tokens: int, max_seqs: int) -> None:
        """Every member allocates its static buffers."""
        for member in self.children:
            member.init_capture_state(max_tokens, max_seqs)

    def init_replay_state(self, ctx: ExecContext, bucket: int) -> None:
        """The members with a node inside a captured piece of this step's mode copy its metadata
        into their buffers (in a whole-step graph, every member that owns a node)."""
        for member in self._replayed[Mode(ctx.mode)]:
            member.init_replay_state(ctx, bucket)

    def plan_piecewise_step(self, ctx: ExecContext, bucket: int, chunk_size: int,
                            plan_mode: Mode | None = None, first_piece_stages: bool = False,
                            defer_gaps: Callable[[BackendHooks, Callable[[], None]], None] | None = None) -> None:
        """The gaps' members plan the step (`plan_gap_step`; a member on both sides an eager step,
        which its init_replay_state keeps), then the captured members stage it for the pieces; both
        as the split plan of `plan_mode` (default: the step's mode) places them. With
        `first_piece_stages`, the members `stage_in_first_piece` reaches are left to the piece.
        With `defer_gaps`, the plans of the members that own nodes in the gaps alone go to it, each
        with its member: no piece reads them, so each may wait for its member's first op (a member
        on both sides plans now)."""
        mode = Mode(plan_mode or ctx.mode)
        for member in self._gaps[mode]:
            if member in self._replayed[mode]:  # nodes on both sides: its init_replay_state keeps this plan
                plan_eager_step(member, ctx, chunk_size)
            elif defer_gaps is not None:
                defer_gaps(member, functools.partial(member.plan_gap_step, ctx, bucket, chunk_size))
            else:
                member.plan_gap_step(ctx, bucket, chunk_size)
        in_piece = self._in_first_piece(Mode(ctx.mode), mode) if first_piece_stages else ()
        for member in self._replayed[mode]:
            if member not in in_piece:
                member.init_replay_state(ctx, bucket)

    def stage_in_first_piece(self, ctx: ExecContext, bucket: int, plan_mode: Mode) -> None:
        """Inside the first captured piece's capture: the members captured alone in `plan_mode`'s
        plan (no node in its gaps) whose replay state a graph may hold, for this step's mode."""
        for member in self._in_first_piece(Mode(ctx.mode), Mode(plan_mode)):
            member.init_replay_state(ctx, bucket)

    def _in_first_piece(self, mode: Mode, plan_mode: Mode) -> tuple[BackendHooks, ...]:
        """Who a piecewise `mode` step's first captured piece stages: the members whose replay
        state a graph may hold in `mode` (replay_state_in_graph: device work from the staged
        buffers); a member in a gap of the plan stays on the host, since the gap's op reads the plan
        its init_replay_state keeps."""
        found = self._first_piece.get((mode, plan_mode))
        if found is None:  # a member's answer is fixed when it is built: asked once per pair of modes
            gaps = self._gaps[plan_mode]
            found = tuple(m for m in self._replayed[plan_mode] if m not in gaps and m.replay_state_in_graph(mode))
            self._first_piece[(mode, plan_mode)] = found
        return found

    def replay_state_in_graph(self, mode: Mode) -> bool:
        """Whether every member records its init_replay_state in a whole-step graph of `mode`."""
        return not self._whole_step[Mode(mode)][0]

    def replay_state_on_host(self, ctx: ExecContext, bucket: int) -> None:
        """Before a whole-step replay: each member whose hook the graph does not hold."""
        for member in self._whole_step[ctx.mode][0]:
            member.init_replay_state(ctx, bucket)

    def replay_state_captured(self, ctx: ExecContext, bucket: int) -> None:
        """Inside a whole-step capture: each member whose hook the graph holds."""
        for member in self._whole_step[ctx.mode][1]:
            member.init_replay_state(ctx, bucket)

    def writes_step_snapshots(self, snapshots) -> bool:
        """The program's steps write in-step snapshots only if every member that may run a linear
        layer's state op does: a layer left out would keep a stale state in the snapshot."""
        return all(member.writes_step_snapshots(snapshots) for member in self.children
                   if member.supported_ops & LINEAR_STATE_OPS)

    def kernel_variant_tokens(self, max_tokens: int) -> tuple[int, ...]:
        """Every member's counts, each once: one step of a count serves every member that names it."""
        return tuple(sorted({t for member in self.children for t in member.kernel_variant_tokens(max_tokens)}))

    def init_step_metadata(self, ctx: ExecContext) -> None:
        """Every member plans the step."""
        for member in self.children:
            member.init_step_metadata(ctx)

    def init_chunk_metadata(self, ctx: ExecContext, chunk_size: int) -> None:
        """Every member plans chunks (the hook docs/DESIGN.md failure 3 lost behind a hasattr guard)."""
        for member in self.children:
            member.init_chunk_metadata(ctx, chunk_size)
