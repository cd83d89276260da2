"""Side streams: a captured piece's side branches (split.json) run on a second CUDA stream.

The overlap pass (compiler/passes/overlap.py) records, per captured piece, branches of nodes that
may run beside the main stream: each with the main node after which it forks and the one before
which it joins. This module makes a piece's GraphModule do that:

1. `stream_piece(piece, branches, streams, where)` rewrites the piece's graph in place: for each
   branch, a fork point after `fork_after` (the piece's start for None), the branch's nodes moved
   right behind it, a leave point after them (back to the main stream), and a join point before
   `join_before` (the piece's end for None). The join takes every value the branch reads from the
   main stream as arguments, so none is freed (and its memory handed to a later main-stream
   kernel) before the main stream has waited for the side stream. Values the side stream makes
   are freed into its own pool and reused only by side work of a later fork, which waits for
   everything the main stream issued before it. The rewrite refuses a branch whose nodes read a
   main node after the fork, or that a main node before the join reads (the recorded plan would
   race): `StreamPlanError`, naming the piece, the branch and the node.
2. `CudaSideStream` is what the points call: fork records an event on the current stream (the
   main one, or the capture stream inside `torch.cuda.graph`), makes the side stream wait on it
   and switches to the side stream; leave switches back; join records an event on the side
   stream and makes the main stream wait on it.

Capture rule. A CUDA graph captures work of several streams when every side stream first waits
on an event recorded on the capturing stream (that wait joins it to the capture) and the
capturing stream waits on an event recorded on each side stream before the capture ends (a side
stream left unjoined makes `cudaStreamEndCapture` fail with cudaErrorStreamCaptureUnjoined).
Every fork here waits on the stream that is current when the piece runs, and every branch joins
back inside the same piece, so a piece captured alone (runtime/graphs/cuda_graphs.py CapturedPiece) or
a whole decode step captured at once both obey it; allocations of the joined side stream go to
the capture's pool. Replays then run both branches as one graph with the recorded dependencies.

On the CPU there are no streams: the loader does not rewrite pieces and runs the nodes in graph
order (the assignment stays recorded in split.json). Tests hand the loader a stand-in with the
same three methods (testkit/graph_cases.RecordingSideStream).

What it does not do: decide branches (the overlap pass), or move op cores (they stay on the main
stream, where their backends plan each step).
"""

from __future__ import annotations

import torch
import torch.fx

from compiler.splitops.artifact import SideBranch

__all__ = ["CudaSideStream", "StreamPlanError", "SidePoint", "stream_piece"]


class StreamPlanError(ValueError):
    """A side branch a piece cannot run as recorded (a stale or edited split.json)."""


class CudaSideStream:
    """One side stream of a device and the fork / leave / join a rewritten piece calls."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._main: list[torch.cuda.Stream] = []  # the stream each open fork left
        self.forks = 0  # how many forks ran (eagerly or while capturing): what a test can see

    def fork(self) -> None:
        main = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(main)
        self.stream.wait_event(ready)  # inside a capture: joins the side stream to it
        self._main.append(main)
        torch.cuda.set_stream(self.stream)
        self.forks += 1

    def leave(self) -> None:
        torch.cuda.set_stream(self._main[-1])

    def join(self, *keep) -> None:
        """`keep`: the main-stream values the branch read, alive until the main stream has waited."""
        main = self._main.pop()
        done = torch.cuda.Event()
        done.record(self.stream)
        main.wait_event(done)  # inside a capture: the side stream rejoins it before the capture ends


class SidePoint(torch.nn.Module):
    """A fork, leave or join point of a rewritten piece: a call_module node calling `streams.<what>`."""

    def __init__(self, streams, what: str):
        super().__init__()
        assert what in ("fork", "leave", "join")
        self.streams, self.what = streams, what

    def forward(self, *keep) -> None:
        getattr(self.streams, self.what)(*keep)


def _point(piece: torch.fx.GraphModule, streams, what: str, index: int, args: tuple = ()) -> torch.fx.Node:
    name = f"side_{what}_{index}"
    piece.add_submodule(name, SidePoint(streams, what))
    return piece.graph.call_module(name, args)


def stream_piece(piece: torch.fx.GraphModule, branches: tuple[SideBranch, ...], streams,
                 where: str) -> torch.fx.GraphModule:
    """Step 1 of the module docstring; `where` names the piece in errors ("main extend piece 4")."""
    graph = piece.graph
    by_name = {n.name: n for n in graph.nodes}
    output = next(n for n in graph.nodes if n.op == "output")
    for i, branch in enumerate(branches):
        missing = [n for n in (*branch.nodes, branch.fork_after, branch.join_before) if n is not None and n not in by_name]
        if missing:
            raise StreamPlanError(f"{where}: side branch {i} names {missing[0]!r}, which the piece does not hold")
        side = [by_name[n] for n in branch.nodes]
        inside = set(side)
        first = next(n for n in graph.nodes if n.op != "placeholder")
        with (graph.inserting_after(by_name[branch.fork_after]) if branch.fork_after is not None
              else graph.inserting_before(first)):
            fork = _point(piece, streams, "fork", i)
        cursor = fork
        for node in side:  # behind the fork, in graph order
            cursor.append(node)
            cursor = node
        with graph.inserting_after(cursor):
            leave = _point(piece, streams, "leave", i)
        keep = tuple(dict.fromkeys(a for n in side for a in n.all_input_nodes if a not in inside))
        with graph.inserting_before(by_name[branch.join_before] if branch.join_before is not None else output):
            join = _point(piece, streams, "join", i, keep)
        _check_order(graph, fork, leave, join, inside, f"{where} side branch {i}")
    graph.lint()
    piece.recompile()
    return piece


def _check_order(graph: torch.fx.Graph, fork, leave, join, side: set, where: str) -> None:
    """Side nodes read nothing made after the fork on the main stream; main nodes before the join read no side node."""
    seen: set = set()
    state = "before"
    for node in graph.nodes:
        if node is fork:
            state = "side"
        elif node is leave:
            state = "main"
        elif node is join:
            return
        elif state == "side":
            late = [a.name for a in node.all_input_nodes if a not in seen and a not in side]
            if late:
                raise StreamPlanError(f"{where}: side node {node.name} reads {late[0]}, which the main stream makes "
                                      f"after the fork: the recorded plan does not fit this graph; recompile")
        elif state == "main":
            early = [a.name for a in node.all_input_nodes if a in side]
            if early:
                raise StreamPlanError(f"{where}: main node {node.name} reads side node {early[0]} before the join: "
                                      f"the recorded plan does not fit this graph; recompile")
        seen.add(node)
