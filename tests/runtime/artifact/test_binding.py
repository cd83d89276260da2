"""The routing table is the binding: what the runtime refuses at start-up, naming the layer.

routing.json is edited and the artifact re-hashed, so the hash check passes and only the binding
can catch the edit (docs/DESIGN.md: "a decision recorded and then ignored"): a backend this runtime
does not have, one that runs on another device, one that does not implement the node's op, kernel
options it does not offer, an entry without its node. The start-up check after binding compares
every bound node with its entry. `hgc run` is the start-up path these go through.
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest

from hgc import main
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.artifact.binding import check_binding
from runtime.step.bound_ops import BoundOps
from runtime.engine.generate import make_pools
from runtime.artifact.loader import LoadError, load_artifact
from testkit.helpers import edit_routing, shared_artifact

pytestmark = pytest.mark.usefixtures("one_thread", "shared_loads")  # one artifact loaded per test


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The test run's tiny bailing_linear (testkit/helpers.shared_artifact): the tests edit copies of it."""
    return shared_artifact(tmp_path_factory, "bailing_linear")[1]


def _layer1_core(edit):
    """Damage: `edit` applied to layer 1's lightning_core entry, the artifact re-hashed."""
    return lambda art: edit_routing(art, lambda e: edit(e) if (e["layer_id"], e["op"]) == (1, "lightning_core") else e)


def _drop_layer1_core(art):
    import json
    from compiler.splitops.artifact import ROUTING, dump_json
    from testkit.helpers import rehash
    doc = json.loads((art / ROUTING).read_text())
    doc["programs"]["main"] = [e for e in doc["programs"]["main"] if (e["layer_id"], e["op"]) != (1, "lightning_core")]
    (art / ROUTING).write_bytes(dump_json(doc))
    rehash(art)


LAYER1 = r"layer 1 \(main program, node lightning_core_\d+, hgc.lightning_core\)"


@pytest.mark.parametrize("damage, message", [
    (_layer1_core(lambda e: {**e, "backend": "gone_backend"}),
     rf"routing.json routes {LAYER1} to backend 'gone_backend', which this runtime does not have \(backends: "
     rf"cpu_reference, .*\); install the package that provides it"),
    (_layer1_core(lambda e: {**e, "backend": "triton_mla"}),
     rf"binds {LAYER1} to triton_mla, which this runtime cannot bind: triton_mla runs on cuda, this run is on cpu"),
    (_layer1_core(lambda e: {**e, "options": {"impl": "fast"}}),
     rf"binds {LAYER1} to cpu_reference, which this runtime cannot bind: backend 'cpu_reference' has no option 'impl'"),
    (_drop_layer1_core, r"routing.json has no entry for node lightning_core_\d+ \(layer 1, hgc.lightning_core\)"),
    (_layer1_core(lambda e: {**e, "layer_id": 2}),
     r"routing.json says node lightning_core_\d+ is hgc.lightning_core of layer 2; the main graph has "
     r"hgc.lightning_core of layer 1"),
])
def test_a_routing_json_the_runtime_cannot_bind_is_refused_at_start_up(artifact, tmp_path, capsys, damage, message):
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    damage(art)
    load_artifact(art)  # hashes and documents check out: only the binding can see the edit
    assert main(["run", str(art), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hgc run: ") and len(err.strip().splitlines()) == 2 and "  hint: " in err, err
    assert re.search(message, err), err


def test_start_up_refuses_a_node_bound_elsewhere_than_routing_json(artifact):
    """check_binding after binding: every op node's instance and op against its entry, by layer."""

    class Elsewhere(CPUReferenceBackend):
        name = "elsewhere"
        capability = dataclasses.replace(CPUReferenceBackend.capability, name="elsewhere")

    art = load_artifact(artifact)
    kv, st = make_pools(art.registry, 32, 2)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = art.runner(ops)  # binds and checks: the intact binding passes
    node = next(n for n in runner._bound.graph.nodes if n.name.startswith("lightning_core") and
                getattr(n.target, "hgc_op", None) == "lightning_core" and n.args[5] == 1)  # layer 1 (schema: out, layer_id)
    node.target = ops.call_of(Elsewhere(kv, st), "lightning_core")
    with pytest.raises(LoadError, match=rf"start-up: {LAYER1} is bound to elsewhere.lightning_core, routing.json "
                                        rf"names cpu_reference.lightning_core; refusing to serve"):
        check_binding(runner._bound, "main", art.docs, ops)
    node.target = ops.call_of(ops.backend.members["cpu_reference"], "short_conv")
    with pytest.raises(LoadError, match=rf"{LAYER1} is bound to cpu_reference.short_conv"):
        check_binding(runner._bound, "main", art.docs, ops)
    node.target = ops.call_of(CPUReferenceBackend(kv, st), "lightning_core")
    with pytest.raises(LoadError, match=r"bound to cpu_reference.lightning_core \(an instance the binding did not build\)"):
        check_binding(runner._bound, "main", art.docs, ops)


def test_a_cuda_artifact_is_run_on_cuda_only(tmp_path, capsys):
    from testkit.helpers import tiny_checkpoint
    tiny_checkpoint("kimi_linear", tmp_path / "c")
    assert main(["compile", str(tmp_path / "c"), "-o", str(tmp_path / "a"), "--target", "cuda", "--no-dumps", "--no-inductor"]) == 0
    capsys.readouterr()
    assert main(["run", str(tmp_path / "a"), "--device", "cpu", "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "compiled for target 'cuda'" in err and "pass --device cuda" in err
