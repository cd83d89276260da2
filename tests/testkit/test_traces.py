"""testkit/traces.py: compiles inside `shared_traces()` trace each config once, are the compiles of
their own traces byte for byte, and never see one another's edits.

Kimi-Linear on two ranks (config.json alone): the sharding pass adds nodes to the traced graph,
whose names come from the graph's name table (a copy that started an empty one named them
otherwise). A copy shares with the trace the family and the export's fake values, nothing else a
pass could edit; after compiles of copies for the CPU and for CUDA (other routes, other edits)
every object reachable from the trace, fake values and their shape environment included, holds
what it held. A failed trace is not kept, and a family swapped in by a test is traced again.
"""

from __future__ import annotations

import dataclasses
import enum
import filecmp
import gc
import json
import logging
import types

import pytest
import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import testkit.traces as traces
from compiler.passes.context import CompileConfig
from compiler.pipeline import compile_checkpoint
from hgc.wiring import toolchain
from models.families import get_family
from testkit.traces import shared_traces

# Not walked: code and types, and what every trace in the process shares (enum members, torch's op
# overloads and their dispatch caches, loggers, sympy's interned expressions and their caches).
NOT_WALKED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.CodeType, enum.Enum, torch._ops.OpOverload, torch._ops.OpOverloadPacket, logging.Logger,
              sympy.Basic)
# A shape environment's memo of fake-tensor ops, and the id of the last size it evaluated (for its
# log messages): they change whenever fake tensors are used and decide no answer.
SHAPE_ENV_MEMO = frozenset({"fake_tensor_cache", "_expr_sym_node_id"})
FAKE_VALUES = (FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)
IMMUTABLE = (str, bytes, int, float, complex, bool, type(None), tuple, frozenset, range, torch.dtype, torch.device,
             torch.layout, torch.memory_format)


def same_tree(a, b) -> list[str]:
    """Relative paths that differ between two folders (missing on one side, or other bytes)."""
    files = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {p.relative_to(b) for p in b.rglob("*")
                                                                         if p.is_file()}
    return sorted(str(f) for f in files if not ((a / f).is_file() and (b / f).is_file()
                                                and filecmp.cmp(a / f, b / f, shallow=False)))


def kimi_config(tmp_path):
    config = tmp_path / "kimi"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(get_family("kimi_linear").make_config("tiny")))
    return config


def referents(obj) -> list:
    """What obj refers to; for a shape environment its attributes, its memo left out."""
    if isinstance(obj, ShapeEnv):
        return [value for name, value in sorted(vars(obj).items()) if name not in SHAPE_ENV_MEMO]
    return gc.get_referents(obj)


def reachable(root, leaves=()) -> dict[int, object]:
    """id -> object for everything reachable from root (a TracedModel, or a program: also
    tests/testkit/test_loads.py's) but a TracedModel's family, not walking into NOT_WALKED nor
    into instances of `leaves`."""
    family = getattr(root, "family", None)
    found, todo = {id(family): family}, [root]
    while todo:
        obj = todo.pop()
        if id(obj) in found or isinstance(obj, NOT_WALKED):
            continue
        found[id(obj)] = obj
        if not isinstance(obj, leaves):
            todo.extend(referents(obj))
    del found[id(family)]
    return found


def state(root) -> dict[int, tuple]:
    """id -> what the object holds, for everything reachable from root (`reachable`): the ids of
    what it refers to and, for a tensor, its geometry and any values."""
    held = {}
    for key, obj in reachable(root).items():
        facts = (type(obj), tuple(map(id, referents(obj))))
        if isinstance(obj, torch.Tensor):
            facts += (tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), obj.dtype)
            if obj.device.type != "meta" and not isinstance(obj, FakeTensor):
                facts += (obj.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes(),)
        held[key] = facts
    return held


def test_compiles_of_a_shared_trace_are_those_of_their_own_traces_and_leave_it_as_traced(tmp_path, monkeypatch):
    import compiler.pipeline as pipeline

    config, tools = kimi_config(tmp_path), toolchain()
    cpu, cuda = CompileConfig(tp=2), CompileConfig(tp=2, target="cuda")
    compile_checkpoint(config, tmp_path / "own", cpu, tools, dumps=False, weights=False)

    traced = []
    real = pipeline.trace_checkpoint
    monkeypatch.setattr(pipeline, "trace_checkpoint", lambda *a, **k: traced.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(traces, "_TRACES", {})  # none of this process's other modules' traces
    with shared_traces():
        first_copy = pipeline.trace_checkpoint(config, cpu.dtype, tools.read_model, tp=cpu.tp)
        ((_, _, kept),) = traces._TRACES.values()
        before = state(kept)
        for name, options in (("first", cpu), ("cuda", cuda), ("second", cpu), ("cuda-again", cuda), ("third", cpu)):
            compile_checkpoint(config, tmp_path / name, options, tools, dumps=False, weights=False)
        after = state(kept)
    assert len(traced) == 1, "one trace for the six"
    for name in ("first", "second", "third"):
        assert same_tree(tmp_path / "own", tmp_path / name) == [], name
    assert pipeline.trace_checkpoint.__name__ == "<lambda>", "the trace as it was before, after"
    changed = [type(kept_obj).__qualname__ for key, kept_obj in reachable(kept).items()
               if before.get(key) != after[key]]
    assert after.keys() == before.keys() and changed == [], f"the compiles changed the trace: {changed[:20]}"

    # what the trace and a copy of it share: the fake values, and values no one can edit
    in_trace, in_copy = reachable(kept, FAKE_VALUES), reachable(first_copy, FAKE_VALUES)
    shared = [in_trace[key] for key in in_trace.keys() & in_copy.keys()]
    editable = sorted({type(obj).__qualname__ for obj in shared if not isinstance(obj, IMMUTABLE + FAKE_VALUES)})
    assert editable == [], f"a copy shares these with its trace: {editable}"
    assert any(isinstance(obj, FakeTensor) for obj in shared)  # what the walk stops at is in the check
    nodes = [node for program in first_copy.programs.values() for node in program.graph.nodes]
    kept_nodes = [node for program in kept.programs.values() for node in program.graph.nodes]
    assert [n.name for n in nodes] == [n.name for n in kept_nodes]
    assert not any(a is b or a.meta is b.meta for a, b in zip(nodes, kept_nodes))


def test_a_failed_trace_is_not_kept_and_a_swapped_family_traces_again(tmp_path, monkeypatch):
    import compiler.pipeline as pipeline
    import models.kimi_linear as family_module

    config, tools = kimi_config(tmp_path), toolchain()
    traced = []
    real = pipeline.trace_checkpoint
    monkeypatch.setattr(pipeline, "trace_checkpoint", lambda *a, **k: traced.append(a[0]) or real(*a, **k))
    monkeypatch.setattr(traces, "_TRACES", {})

    def fails(cfg, tp=1):
        raise RuntimeError("no model today")

    with shared_traces():
        with monkeypatch.context() as m:
            m.setattr(family_module, "FAMILY", dataclasses.replace(family_module.FAMILY, build=fails))
            for _ in range(2):
                with pytest.raises(RuntimeError, match="no model today"):
                    pipeline.plan(config, CompileConfig(tp=3), tools)
        assert len(traced) == 2, "each failing plan traced"
        pipeline.plan(config, CompileConfig(), tools)  # the family as it is: traced, not the failure's
        assert len(traced) == 3
