"""testkit/position_trace.py: where two runs of one request first compute a position differently.

1. `first_position_parting` on hand-made traces: the first position that differs, and there the
   first op handed another input or the first op with another output from the same inputs; None when they
   agree; the ops' place in the step counted from the step's first op.
2. A PositionTrace over a tiny model's eager engine (CPU): one entry per op input and output at
   every position of the request, prompt and generated tokens alike; a second run of the same
   engine agrees everywhere; a step of two requests is refused.
"""

from __future__ import annotations

import types

import pytest

from runtime.engine.engine import SamplingParams
from runtime.assembly import EngineOptions, engine_for_artifact
from testkit.helpers import shared_artifact
from testkit.position_trace import PositionTrace, first_position_parting


def trace(by_position: dict) -> PositionTrace:
    t = PositionTrace(types.SimpleNamespace(observer=None))
    t.by_position = by_position
    return t


def step(*digests: str) -> list[tuple[int, str, str, str]]:
    """Two ops: layer 0's short_conv (input x, output), layer 1's gqa_attention (input q, output)."""
    names = [(0, "short_conv", "input x"), (0, "short_conv", "output"), (1, "gqa_attention", "input q"),
             (1, "gqa_attention", "output")]
    return [(*n, d) for n, d in zip(names, digests)]


def test_the_first_position_and_op_that_differ_are_named():
    a = trace({3: step("a", "b", "c", "d"), 4: step("e", "f", "g", "h"), 5: step("1", "2", "3", "4")})
    b = trace({3: step("a", "b", "c", "d"), 4: step("e", "f", "g", "X"), 5: step("9", "2", "3", "4")})
    gqa = {"position": 4, "index": 1, "layer": 1, "op": "gqa_attention"}
    assert first_position_parting(a, b) == {**gqa, "at": "output"}
    c = trace({3: step("a", "b", "c", "d"), 4: step("e", "f", "Y", "X")})
    assert first_position_parting(a, c) == {**gqa, "at": "input q"}
    assert first_position_parting(a, a) is None
    other = trace({3: step("a", "b", "c", "d")[:2]})
    assert first_position_parting(a, other) == {"position": 3, "other_ops": True}


def test_a_trace_of_an_eager_engine_covers_every_position_and_repeats(tmp_path_factory):
    from runtime.artifact.loader import load_artifact

    art = load_artifact(shared_artifact(tmp_path_factory, "qwen3_next")[1])
    engine = engine_for_artifact(art, EngineOptions(slots=2, token_budget=16), 64)
    prompt, new = [5, 9, 13, 2, 7], 6

    def traced() -> PositionTrace:
        t = PositionTrace(engine.ops)
        try:
            engine.add_request(prompt, SamplingParams(max_new_tokens=new))
            engine.run_until_done()
        finally:
            t.detach()
        return t

    first, second = traced(), traced()
    assert sorted(first.by_position) == list(range(len(prompt) + new - 1))  # the last token is never fed back
    ops = [(layer, op) for layer, op, at, _ in first.by_position[0] if at == "output"]
    assert len(ops) >= len(art.registry.layers) and engine.ops.observer is None
    assert first_position_parting(first, second) is None
    t = PositionTrace(engine.ops)
    try:
        for p in ([1, 2, 3], [4, 5]):
            engine.add_request(p, SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="one request"):
            engine.run_until_done()
    finally:
        t.detach()
