"""A third-party backend, installed as a package beside hgc, that routing chooses and the runtime runs.

The package is written here and installed with pip into a folder put on sys.path: a real
distribution (dist-info, entry point in the group `hgc.backends`), found by
importlib.metadata as any installed plugin would be. It declares hgc.gdn_core on the cpu at a
priority above the reference backend and records every call it receives. What it must show
(the routing table is the binding, docs/DESIGN.md):

- `hgc backends` lists it, with the entry point and package it came from;
- `hgc compile` routes every GDN node of a tiny qwen3_next checkpoint to it; `hgc run --json`
  lists it under executed_backends for exactly the GDN layer ids; its methods were called for
  those layers; the tokens equal `hgc generate`'s;
- with `--route gdn_core=cpu_reference` it is not built and not called; with
  `--route gdn_core=cpu_reference --route layers=1:fast_gdn` it runs layer 1 and nothing else;
- it declares no CUDA-graph capture, so the split pass makes its nodes eager gaps in decode, and
  the graph runner (CPU stand-in for CUDA graphs) runs decode piecewise and passes start-up parity;
- an artifact compiled with it is refused at start-up, naming the layer, where it is not installed.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hgc import main
from compiler.splitops import Mode
from compiler.splitops.artifact import EAGER

pytestmark = pytest.mark.usefixtures("one_thread", "shared_traces")

PACKAGE = "hgc_fast_gdn"
BACKEND = "fast_gdn"
PROMPTS = "5,6,7,8,9,10,11;3,4;12,13,14,15"

PYPROJECT = f"""
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "hgc-fast-gdn"
version = "0.1.0"
description = "A gated-delta-rule backend for hgc on the CPU"

[project.entry-points."hgc.backends"]
{BACKEND} = "{PACKAGE}:FastGDNBackend"
"""

MODULE = '''
"""hgc-fast-gdn: hgc.gdn_core on the CPU, from a package installed beside hgc.

It runs the gated delta rule of hgc's op contract over the state pool, one request at a time,
every head at once per token (hgc's reference recurrence), and records each call in CALLS.
"""

from compiler.splitops import BackendCapability, LayerKind
from runtime.backends.cpu_reference import gated_recurrence
from runtime.backends.protocol import BackendHooks

CALLS = []  # (what, layer id or None), in call order


class FastGDNBackend(BackendHooks):
    name = "fast_gdn"
    capability = BackendCapability(
        name="fast_gdn", device="cpu", ops=frozenset({"gdn_core"}), kinds=frozenset({LayerKind.GDN}),
        priority=10, doc="gated delta rule on the CPU, from the hgc-fast-gdn package")

    def __init__(self, state_pool):
        self.state_pool = state_pool

    @classmethod
    def build(cls, setup):
        CALLS.append(("build", tuple(setup.layer_ids())))
        return cls(setup.state_pool)

    def init_capture_state(self, max_tokens, max_seqs):
        """Nothing to allocate: this backend is never captured."""
        CALLS.append(("init_capture_state", None))

    def init_replay_state(self, ctx, bucket):
        """Never captured, so never replayed: the split keeps its nodes eager."""
        CALLS.append(("init_replay_state", None))

    def init_step_metadata(self, ctx):
        """Nothing to plan: each call walks the step's requests."""
        CALLS.append(("init_step_metadata", None))

    def init_chunk_metadata(self, ctx, chunk_size):
        """Nothing to plan: the recurrence runs token by token."""
        CALLS.append(("init_chunk_metadata", None))

    def gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale):
        CALLS.append(("gdn_core", layer_id))
        states = self.state_pool.layer(layer_id)["recurrent"]
        group = v.shape[1] // q.shape[1]  # value head h reads key head h // group
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
        for b, start, n, _ in ctx.token_ranges():
            rows = slice(start, start + n)
            state = states[int(ctx.state_slots[b])]
            out[rows] = gated_recurrence(q[rows], k[rows], v[rows], g[rows].unsqueeze(-1), beta[rows], state,
                                         scale).to(out.dtype)
        out[ctx.num_real_tokens:].zero_()
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The package, pip-installed into a folder on sys.path; yields its module (for CALLS)."""
    root = tmp_path_factory.mktemp("plugin")
    src, site = root / "src", root / "site"
    (src / PACKAGE).mkdir(parents=True)
    (src / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (src / PACKAGE / "__init__.py").write_text(textwrap.dedent(MODULE))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(site), str(src)], check=True, capture_output=True)
    assert (site / "hgc_fast_gdn-0.1.0.dist-info" / "entry_points.txt").is_file()
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        yield importlib.import_module(PACKAGE)
    sys.modules.pop(PACKAGE, None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    assert main(["init-model", "--family", "qwen3_next", "--size", "tiny", "--seed", "6", "-o", str(root / "c")]) == 0
    return root / "c"


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _compile(checkpoint, out, capsys, *routes) -> dict:
    flags = [a for r in routes for a in ("--route", r)]
    assert main(["compile", str(checkpoint), "-o", str(out), "--no-dumps", "--force", *flags]) == 0
    capsys.readouterr()
    return json.loads((out / "routing.json").read_text())


def _run(art, capsys) -> dict:
    assert main(["run", str(art), "--prompt-ids", PROMPTS, "--max-new-tokens", "6", "--max-tokens-per-step", "8",
                 "--json"]) == 0
    return _json(capsys)


@pytest.fixture(scope="module")
def eager(checkpoint):
    """`hgc generate`'s outputs for PROMPTS: the eager baseline every run is compared with."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["generate", str(checkpoint), "--prompt-ids", PROMPTS, "--max-new-tokens", "6", "--json"]) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])["outputs"]


@pytest.fixture(scope="module")
def by_priority(plugin, checkpoint, tmp_path_factory):
    """The checkpoint compiled with the plugin installed and no route: (artifact folder, routing.json)."""
    out = tmp_path_factory.mktemp("by_priority") / "a"
    assert main(["compile", str(checkpoint), "-o", str(out), "--no-dumps"]) == 0
    return out, json.loads((out / "routing.json").read_text())


def _gdn_layers(routing) -> list[int]:
    return sorted({e["layer_id"] for e in routing["programs"]["main"] if e["kind"] == "gdn"})


def test_hgc_backends_lists_the_installed_plugin(plugin, capsys):
    assert main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in _json(capsys)["backends"]}
    mine = rows[BACKEND]
    assert mine["device"] == "cpu" and mine["ops"] == ["gdn_core"] and mine["priority"] == 10
    assert mine["modes_capturable"] == [] and mine["kinds"] == ["gdn"]
    assert mine["source"] == f"entry point {BACKEND} = {PACKAGE}:FastGDNBackend (package hgc-fast-gdn 0.1.0)"
    assert rows["cpu_reference"]["source"].startswith("built-in runtime.backends.cpu_reference")
    assert main(["backends"]) == 0
    assert BACKEND in capsys.readouterr().out


def test_the_plugin_runs_every_gdn_layer_and_gives_the_eager_tokens(plugin, by_priority, eager, capsys):
    art, routing = by_priority
    gdn = _gdn_layers(routing)
    assert gdn == [0, 1, 2]
    for e in routing["programs"]["main"]:
        assert e["backend"] == (BACKEND if e["op"] == "gdn_core" else "cpu_reference"), e
    assert [b["name"] for b in routing["backends"]] == ["cpu_reference", BACKEND]
    assert routing["backends"][1]["source"].startswith(f"entry point {BACKEND}")
    plugin.CALLS.clear()
    ran = _run(art, capsys)
    assert ran["outputs"] == eager
    with_plugin = sorted(int(layer) for layer, names in ran["executed_backends"].items() if BACKEND in names)
    assert with_plugin == gdn
    assert plugin.CALLS[0] == ("build", tuple(gdn))
    assert sorted({layer for what, layer in plugin.CALLS if what == "gdn_core"}) == gdn
    hooks = {what for what, _ in plugin.CALLS}
    assert {"init_step_metadata", "init_chunk_metadata"} <= hooks  # per-step hooks reach it


def test_a_route_to_the_reference_leaves_the_plugin_unbuilt_and_uncalled(plugin, checkpoint, eager, tmp_path, capsys):
    routing = _compile(checkpoint, tmp_path / "a", capsys, "gdn_core=cpu_reference")
    assert {e["backend"] for e in routing["programs"]["main"]} == {"cpu_reference"}
    plugin.CALLS.clear()
    ran = _run(tmp_path / "a", capsys)
    assert plugin.CALLS == []
    assert all(names == ["cpu_reference"] for names in ran["executed_backends"].values())
    assert ran["outputs"] == eager


def test_one_layer_routed_to_the_plugin_runs_that_layer_only(plugin, checkpoint, eager, tmp_path, capsys):
    routing = _compile(checkpoint, tmp_path / "a", capsys, "gdn_core=cpu_reference", f"layers=1:{BACKEND}")
    assert [e["layer_id"] for e in routing["programs"]["main"] if e["backend"] == BACKEND] == [1]
    plugin.CALLS.clear()
    ran = _run(tmp_path / "a", capsys)
    assert {layer for what, layer in plugin.CALLS if what == "gdn_core"} == {1}
    assert [layer for layer, names in ran["executed_backends"].items() if BACKEND in names] == ["1"]
    assert ran["outputs"] == eager


def test_its_nodes_are_eager_gaps_in_decode_and_the_runner_passes_parity(plugin, by_priority):
    """Capture follows the routed backend: the plugin declares no capture, so split.json makes every
    gdn_core an eager gap in decode too; the graph runner reads that and replays decode piecewise."""
    from runtime.step.bound_ops import BoundOps
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import CaptureKey, GraphRunner
    from runtime.artifact.loader import load_artifact
    from testkit.graph_cases import RerunGraphs, greedy

    path, routing = by_priority
    split = json.loads((path / "split.json").read_text())["programs"]["main"]
    gaps = [n for p in split["decode"]["pieces"] if p["kind"] == EAGER for n in p["nodes"]]
    assert gaps == [e["node"] for e in routing["programs"]["main"] if e["backend"] == BACKEND]
    art = load_artifact(path)
    kv, st = make_pools(art.registry, 128, 8, page_size=8)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(2,), extend_buckets=(16,),
                         max_pages_per_seq=16, extend_max_seqs=2, debug=True, graphs=RerunGraphs())
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    eager, _ = greedy(runner, st, prompts, 3)
    assert not runner.full_decode
    plugin.CALLS.clear()
    runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    assert ("init_replay_state", None) not in plugin.CALLS  # its nodes sit in no captured piece
    graph, keys = greedy(runner, st, prompts, 3)
    assert graph == eager and keys[1] == CaptureKey(Mode.DECODE, 2, 2) and runner.counters["piecewise_steps"] >= 2
    assert ops.executed_backends()["0"] == ["cpu_reference", BACKEND]


def test_the_first_piece_stages_the_members_captured_alone(plugin, by_priority, monkeypatch):
    """A member with no node in decode's eager gaps (the reference: every node but the plugin's GDN)
    whose staging a graph may hold (`replay_state_in_graph`, answered True here) is staged by the
    first captured piece's graph: at a replayed piecewise decode step the host does not call its
    init_replay_state, the graph does (the CPU stand-in reruns what it captured). Extend steps, whose
    staging holds host-built tables, stage on the host; the plugin, in the gaps, plans each step
    eagerly; the tokens are the eager ones."""
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.step.bound_ops import BoundOps
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner
    from runtime.artifact.loader import load_artifact
    from testkit.graph_cases import RerunGraphs, greedy

    graphs, staged = RerunGraphs(), []
    monkeypatch.setattr(CPUReferenceBackend, "replay_state_in_graph", lambda self, mode: True)
    monkeypatch.setattr(CPUReferenceBackend, "init_replay_state",
                        lambda self, ctx, bucket: staged.append((Mode(ctx.mode), graphs.inside)))
    art = load_artifact(by_priority[0])
    kv, st = make_pools(art.registry, 128, 8, page_size=8)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(2,), extend_buckets=(16,),
                         max_pages_per_seq=16, extend_max_seqs=2, debug=True, graphs=graphs)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    eager, _ = greedy(runner, st, prompts, 3)
    runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    assert not runner.full_decode and runner.program.plans[Mode.DECODE].pieces[0].kind == "captured"
    staged.clear()
    plugin.CALLS.clear()
    graph, keys = greedy(runner, st, prompts, 3)
    assert graph == eager and runner.counters["piecewise_steps"] >= 3
    decode = [inside for mode, inside in staged if mode == Mode.DECODE]
    extend = [inside for mode, inside in staged if mode != Mode.DECODE]
    assert len(decode) == 2 and all(decode), "staged in the first piece's graph, once per replayed decode step"
    assert extend and not any(extend), "an extend step is staged on the host"
    assert plugin.CALLS.count(("init_step_metadata", None)) == 3, "the gap's member plans every step eagerly"


def test_an_artifact_that_needs_the_plugin_is_refused_where_it_is_not_installed(plugin, by_priority, capsys):
    art, _ = by_priority
    site = next(p for p in sys.path if (Path(p) / PACKAGE).is_dir())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "path", [p for p in sys.path if p != site])
        assert main(["run", str(art), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"routes layer 0 (main program, node gdn_core, hgc.gdn_core) to backend '{BACKEND}', which this " \
           f"runtime does not have" in err and "install the package that provides it" in err


def test_modes_sharing_a_piecewise_module_capture_each_piece_once(plugin, by_priority):
    """The plugin captures in no mode, so decode's and target_verify's plans cut at the same nodes and
    share one split module (ProgramRunner.module_for). The runner wraps its captured pieces once:
    wrapped again for the second mode, a piece would capture inside its own capture, which CUDA
    refuses (and so does the CPU stand-in)."""
    from runtime.step.bound_ops import BoundOps
    from runtime.graphs.cuda_graphs import CapturedPiece
    from runtime.engine.generate import make_pools
    from runtime.graphs.runner import GraphRunner
    from runtime.artifact.loader import load_artifact
    from runtime.cache.state_pool import StatePool
    from testkit.graph_cases import RerunGraphs

    art = load_artifact(by_priority[0])
    kv, _ = make_pools(art.registry, 128, 8, page_size=8)
    st = StatePool(art.registry, 8, draft_tokens=1, verify_rows=2)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cpu", decode_buckets=(2,), extend_buckets=(16,),
                         max_pages_per_seq=16, extend_max_seqs=2, graphs=RerunGraphs(), verify_buckets=(2,),
                         verify_tokens=2)
    module = runner._module(Mode.DECODE)
    assert runner._module(Mode.TARGET_VERIFY) is module
    runner.capture()
    pieces = [m for m in module.children() if isinstance(m, CapturedPiece)]
    assert pieces and not any(isinstance(p.piece, CapturedPiece) for p in pieces)
    modes = {key.mode for p in pieces for key in p.graphs}
    assert {Mode.DECODE, Mode.TARGET_VERIFY} <= modes, modes
