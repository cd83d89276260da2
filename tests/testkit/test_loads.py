"""testkit/loads.py: loads inside `shared_loads()` deserialize each archive once, run as fresh loads
do, and never touch the program as loaded.

The test run's tiny qwen3_next (a main and a draft program): `hgc run` with drafts inside and
outside gives the same JSON; a copy's graph code, signature, node names and name table are a fresh
load's, and a node added to each is named alike. A copy shares with the program as loaded its fake
values and values no one can edit; after runs of copies every object reachable from the program as
loaded holds what it held. A damaged archive is loaded apart (and refused as outside), and the
loads go when the block ends.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from hgc import main
from runtime.artifact.loader import LoadError, load_artifact
from testkit.helpers import shared_artifact
from testkit.loads import shared_loads
from tests.testkit.test_traces import FAKE_VALUES, IMMUTABLE, reachable, state

PROMPTS = "1,2,3,4,5,6,7,8;9,10,11"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return shared_artifact(tmp_path_factory, "qwen3_next")[1]


def run_json(art, capsys) -> dict:
    capsys.readouterr()
    assert main(["run", str(art), "--prompt-ids", PROMPTS, "--max-new-tokens", "6", "--speculative-tokens", "2",
                 "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_runs_of_copies_are_runs_of_fresh_loads(artifact, capsys, monkeypatch):
    fresh = run_json(artifact, capsys)
    own = load_artifact(artifact)  # outside the block: a fresh load
    deserialized = []
    real = torch.export.load
    monkeypatch.setattr(torch.export, "load", lambda f, *a, **k: deserialized.append(1) or real(f, *a, **k))
    with shared_loads():
        first = load_artifact(artifact)
        runs = [run_json(artifact, capsys) for _ in range(2)]
        second = load_artifact(artifact)
    assert len(deserialized) == 2, "one deserialization for each of the two archives"
    assert torch.export.load.__name__ == "<lambda>", "the load as it was before, after the block"
    for run in runs:
        assert run == {**fresh, "timing": run["timing"]}
    for program in ("main", "draft"):
        a, b, plain = first.programs[program], second.programs[program], own.programs[program]
        assert a is not b and a.graph is not b.graph
        assert a.graph_module.code == b.graph_module.code == plain.graph_module.code
        assert str(a.graph_signature) == str(plain.graph_signature)
        assert [n.name for n in a.graph.nodes] == [n.name for n in plain.graph.nodes]
        assert not any(x is y or x.meta is y.meta for x, y in zip(a.graph.nodes, b.graph.nodes))
        assert a.graph._graph_namespace._used_names == plain.graph._graph_namespace._used_names
        added = [ep.graph.call_function(torch.ops.aten.add.Tensor, (next(iter(ep.graph.nodes)),) * 2).name
                 for ep in (a, plain)]
        assert added[0] == added[1], "a node added to a copy is named as in a fresh load"


def test_a_copy_shares_only_fake_values_and_leaves_the_load_as_loaded(artifact, capsys, monkeypatch):
    seen = []
    with shared_loads():
        import testkit.loads as loads

        real_copy = loads.copy_loaded
        monkeypatch.setattr(loads, "copy_loaded", lambda ep: seen.append(ep) or real_copy(ep))
        first = load_artifact(artifact).programs["main"]
        names = [n.name for n in first.graph.nodes]
        kept = next(ep for ep in seen if [n.name for n in ep.graph.nodes] == names)  # main, as loaded
        before = state(kept)
        run_json(artifact, capsys)
        load_artifact(artifact)
        after = state(kept)
    assert len(seen) == 6 and len({id(ep) for ep in seen}) == 2, "every copy is of one of the two loads"
    changed = [type(obj).__qualname__ for key, obj in reachable(kept).items() if before.get(key) != after[key]]
    assert after.keys() == before.keys() and changed == [], f"the runs changed the program as loaded: {changed[:20]}"
    in_load, in_copy = reachable(kept, FAKE_VALUES), reachable(first, FAKE_VALUES)
    shared = [in_load[key] for key in in_load.keys() & in_copy.keys()]
    editable = sorted({type(obj).__qualname__ for obj in shared if not isinstance(obj, IMMUTABLE + FAKE_VALUES)})
    assert editable == [], f"a copy shares these with the load: {editable}"
    assert any(isinstance(obj, FakeTensor) for obj in shared)


def test_a_damaged_archive_is_loaded_apart_and_refused_as_outside(artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    graph = art / "graph.pt2"
    graph.write_bytes(graph.read_bytes()[:-200])
    with pytest.raises(LoadError) as outside:
        load_artifact(art)
    with shared_loads():
        load_artifact(artifact)
        with pytest.raises(LoadError) as inside:
            load_artifact(art)
    assert str(inside.value) == str(outside.value)
