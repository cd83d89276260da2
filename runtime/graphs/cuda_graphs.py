"""CUDA graphs: how one shape is captured and replayed, piece by piece.

1. `CudaGraphs` is the one place that touches torch.cuda's graph API (a pool, a capture, a
   replay); tests on the CPU hand the runner a stand-in with the same methods
   (testkit/graph_cases.RerunGraphs).
2. `CaptureState` says which key the pieces are capturing or replaying now; the graph runner sets
   it around each step.
3. `CapturedPiece` wraps one captured piece of a split program: at capture it runs a warm-up
   outside the graph, records a graph per key and replays it once (the step needs its results);
   afterwards it replays the key's graph, checking in debug mode that every input sits at the
   address it was captured with.

A piece with side-stream branches (split.json, `hgc compile --overlap`) arrives here rewritten by
the loader (runtime/graphs/side_stream.py): its capture records both streams. That works because every
branch's side stream first waits on an event recorded on the capturing stream (joining the
capture) and the capturing stream waits on the side stream before the piece returns, so before
`capture` ends: a side stream left unjoined would fail the capture.

Piecewise graphs need no copies between pieces: every op is "with output", so the `out` an eager
gap writes was allocated by the captured piece before it, inside the graph pool, at an address the
next piece was captured with. Which keys exist is runtime/graphs/buckets.py's business; what a step puts
in the static buffers, runtime/graphs/staging.py's.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional

import torch

from runtime.graphs.buckets import CaptureKey

__all__ = ["CaptureError", "CudaGraphs", "CaptureState", "CapturedPiece"]


class CaptureError(RuntimeError):
    pass



class CudaGraphs:
    """Capture and replay through torch.cuda: the one place the runner touches the CUDA graph API."""

    # A replay runs recorded kernels and no Python: the op outputs of a replayed step are read from
    # the tensors recorded at capture (a CPU stand-in that reruns the ops says True instead).
    replays_call_ops = False

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise CaptureError(f"CUDA graphs need a CUDA device; this runner is on {device}")

    def new_pool(self):
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], object], pool) -> tuple[object, object]:
        """Record fn's kernels into a new graph in `pool`; returns (graph, fn's output tensors).

        The garbage collector is held off during the capture: a collection there can free an
        unreachable earlier runner's graphs (an engine built and dropped before this one, in a
        reference cycle), and destroying a graph while a stream captures invalidates the capture
        ("operation not permitted when stream is capturing"). torch.cuda.graph collects nothing
        on entry by default, so the old graphs wait for the next collection after it."""
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=pool):
                out = fn()
        finally:
            if collecting:
                gc.enable()
        return graph, out

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


class CaptureState:
    """Which key the pieces are capturing or replaying now: shared by the runner and its pieces."""

    def __init__(self, graphs):
        self.graphs = graphs
        self.key: Optional[CaptureKey] = None
        self.capturing = False
        self.silent = False  # ops run now are not the graph's (warm-up, the first replay of a rerun stand-in)
        self.pool = None
        # Device work the first captured piece of the step being captured records ahead of its ops
        # (the backends' replay state that its graph may hold: GraphRunner._plan); None: nothing.
        self.prologue: Optional[Callable[[], None]] = None


class CapturedPiece(torch.nn.Module):
    """One captured piece of a split program: a CUDA graph per key, replayed with the inputs it was captured with."""

    def __init__(self, piece: torch.nn.Module, index: int, state: CaptureState, debug: bool = False,
                 first: bool = False):
        """first: the plan's first piece, which records the step's prologue (CaptureState.prologue)."""
        super().__init__()
        self.piece, self.index, self.state, self.debug, self.first = piece, index, state, debug, first
        self.graphs: dict[CaptureKey, tuple[object, object, list[int]]] = {}

    def forward(self, *args):
        key = self.state.key
        if key is None:  # an eager step: no graph at all
            return self.piece(*args)
        if self.state.capturing and key not in self.graphs:
            prologue = self.state.prologue if self.first else None

            def body():
                if prologue is not None:
                    prologue()
                return self.piece(*args)

            self.state.silent = True
            try:
                body()  # warm-up outside the graph: lazy init, Triton compiles, autotuning
            finally:
                self.state.silent = False
            graph, out = self.state.graphs.capture(body, self.state.pool)
            self.graphs[key] = (graph, out, [a.data_ptr() for a in args if isinstance(a, torch.Tensor)])
            self.state.silent = True
            try:
                graph.replay()  # the capture did not run the kernels; the step needs their results
            finally:
                self.state.silent = False
            return out
        if key not in self.graphs:
            raise CaptureError(f"piece {self.index}: no graph for {key}; captures happen at start-up only")
        graph, out, addresses = self.graphs[key]
        if self.debug:
            now = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
            if now != addresses:
                bad = next(i for i, (a, b) in enumerate(zip(now, addresses)) if a != b)
                raise CaptureError(f"piece {self.index} {key}: input {bad} moved: captured at {addresses[bad]:#x}, "
                                   f"got {now[bad]:#x}; every input must be a static buffer")
        graph.replay()
        return out
