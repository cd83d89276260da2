"""One trace per checkpoint config in a test process: `shared_traces()` hands every compile a copy.

Most of a tiny model's in-process compile is the frontend's trace (`compiler.frontend.trace_checkpoint`,
torch.export on the meta device: 1.5 to 3.5 s on 2 cores against well under a second for every pass
and the artifact together), and a module that compiles one checkpoint with several routes, targets
or flags traced it again each time. The trace reads config.json alone, so inside `shared_traces()`
`compiler.pipeline.plan` traces each (config.json bytes, dtype, tp, state dtype, read_model, family)
once per process and every compile gets its own deep copy of that TracedModel: the passes edit
their copy's graphs in place and never see another compile's edits. A copy shares with the trace
only the family and the export's fake values (FakeTensors and symbolic sizes in node meta), which
no pass edits, and a compile of a copy leaves the trace as it was traced. The copy carries each graph's
name table too, so a pass that adds nodes names them as it would on a fresh trace: an artifact
compiled from a copy is byte for byte the one compiled from its own trace (both checked by
tests/testkit/test_traces.py).

The family is part of the key (read_model gives it), so a test that swaps a family's FAMILY traces
again. A module that patches model code in any other way (a layer function, the op table) must not
use it: the copy would be of the unpatched model.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path

__all__ = ["copy_traced", "own_graph_copy", "quiet_spec_copies", "shared_traces"]

_TRACES: dict = {}  # key -> (read_model, family, the TracedModel as traced: only ever copied)


def copy_traced(traced):
    """A deep copy of a compiler.frontend.TracedModel for one compile. It shares two things with the
    trace: the family (a frozen dataclass) and the export's fake values, the FakeTensors and
    symbolic sizes in node meta ("val", "tensor_meta"), which belong to the export's fake mode and
    shape environment and which no pass edits. Every program, graph, node, node meta dict and what
    those hold is the copy's own (tests/testkit/test_traces.py checks both, and that compiles of
    copies leave the trace as it was traced)."""
    with quiet_spec_copies():
        fresh = copy.deepcopy(traced, {id(traced.family): traced.family})
        fake = {}  # id -> value: deepcopy's memo, so the fake values stay the trace's
        for name, program in traced.programs.items():
            own_graph_copy(program.graph, fresh.programs[name].graph, fake)
    return fresh


@contextlib.contextmanager
def quiet_spec_copies():
    """Deep copies of exported programs without the warning torch's pytree specs give of their own
    deprecated check when they are copied."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        yield


def own_graph_copy(original, graph, fake: dict) -> None:
    """Make `graph`, a deep copy of fx graph `original`, whole: its original's name table (a copy
    starts an empty one, so a node added to it would take a name the original had used and dropped:
    "sym_size_int" for "sym_size_int_4") and a meta of its own for each node (fx copies a node's
    meta dict but not what it holds: nn_module_stack, source_fn_stack...), sharing only the fake
    values, which go into `fake` (id -> value: the copies' memo)."""
    old, new = original._graph_namespace, graph._graph_namespace
    new._used_names = set(old._used_names)
    new._base_count = dict(old._base_count)
    for node in graph.nodes:
        _fake_values(node.meta, fake)
        node.meta = copy.deepcopy(node.meta, fake)


def _fake_values(value, found: dict) -> None:
    """found[id(v)] = v for every tensor and symbolic number inside value's dicts, lists and tuples."""
    import torch

    if isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)):
        found[id(value)] = value
    elif isinstance(value, dict):
        for item in value.values():
            _fake_values(item, found)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            _fake_values(item, found)


@contextlib.contextmanager
def shared_traces():
    """Inside it, `compiler.pipeline.plan` (every in-process `hgc compile`, compile_checkpoint, plan)
    traces each checkpoint config once and compiles copies. A trace that fails is not kept: the
    next compile of that config fails the same way."""
    import compiler.pipeline as pipeline

    real = pipeline.trace_checkpoint
    if getattr(real, "shared", False):  # already inside one
        yield
        return

    def trace(ckpt_dir, dtype, read_model, tp=1, state_dtype=None):
        try:
            family = read_model(ckpt_dir)[0]
            key = ((Path(ckpt_dir) / "config.json").read_bytes(), dtype, tp, state_dtype, id(read_model),
                   id(family))
        except Exception:  # an unreadable checkpoint: the real trace says why
            return real(ckpt_dir, dtype, read_model, tp=tp, state_dtype=state_dtype)
        if key not in _TRACES:  # the value holds read_model and the family: their ids stay theirs
            _TRACES[key] = (read_model, family, real(ckpt_dir, dtype, read_model, tp=tp, state_dtype=state_dtype))
        return copy_traced(_TRACES[key][2])

    trace.shared = True
    pipeline.trace_checkpoint = trace
    try:
        yield
    finally:
        pipeline.trace_checkpoint = real
