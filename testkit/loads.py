"""One deserialization per program archive in a test module: `shared_loads()` hands every load a copy.

Loading an artifact's program (runtime/artifact/pt2_check.load_program) reads the .pt2 archive,
checks its hash and its entries, then deserializes it with torch.export.load: about half a second
for a tiny model's main program, most of a tiny artifact's load. A module that loads one artifact
again and again (a load per test, the intact copy before each damaged one) deserialized the same
bytes each time: about 75 of the 117 s of loads in the eleven modules that load most. Inside
`shared_loads()` every load reads and checks its archive as before, and torch.export.load runs
once for each archive's bytes (by their SHA-256); each load gets its own deep copy of that program.

A copy shares with the program as loaded only the load's fake values (the FakeTensors and symbolic
sizes in node meta), which belong to the load's fake mode and shape environment and which nothing
edits. Every graph module, graph, node and node meta dict is the copy's own, and its graph's name
table holds the names the load's does, so a node the runtime adds is named as in a fresh load
(tests/testkit/test_loads.py checks a run of copies against a run of fresh loads, and that the
program as loaded is left as it was). Archives that differ (a damaged copy) are loaded apart, and
a load that fails is not kept.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io

from testkit.traces import _fake_values, own_graph_copy, quiet_spec_copies

__all__ = ["copy_loaded", "shared_loads"]


def copy_loaded(ep):
    """A deep copy of a loaded ExportedProgram that shares its fake values (and only those) with it."""
    fake: dict = {}  # id -> value: deepcopy's memo, so the fake values stay the load's
    for node in ep.graph.nodes:  # first: the program's other parts may hold them too
        _fake_values(node.meta, fake)
    with quiet_spec_copies():
        fresh = copy.deepcopy(ep, dict(fake))
        own_graph_copy(ep.graph, fresh.graph, fake)
    return fresh


@contextlib.contextmanager
def shared_loads():
    """Inside it, torch.export.load of an archive in memory (what load_program hands it) runs once
    per archive's bytes and returns a copy each time; the loads are dropped when it ends."""
    import torch.export

    real = torch.export.load
    if getattr(real, "shared", False):  # already inside one
        yield
        return
    loaded: dict[str, object] = {}

    def load(f, *args, **kwargs):
        if not isinstance(f, io.BytesIO) or args or kwargs:
            return real(f, *args, **kwargs)
        key = hashlib.sha256(f.getbuffer()).hexdigest()
        if key not in loaded:
            loaded[key] = real(f)
        return copy_loaded(loaded[key])

    load.shared = True
    torch.export.load = load
    try:
        yield
    finally:
        torch.export.load = real
