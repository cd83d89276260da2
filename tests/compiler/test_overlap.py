"""The overlap pass (`hgc compile --overlap`) on the CPU: the branches it finds, the dependency rule on
the networkx graph, split.json, the dumps and `hgc inspect`, and the same outputs with and without it.

One tiny Qwen3-Next checkpoint is compiled with the pass (size rule 4 KiB: a tiny model's shared
expert moves about 27 KB at one token, its norms and gates under 2 KB); the compile without it is
the test run's (testkit/helpers.shared_artifact), as for Bailing and Kimi-Linear.
Real per-layer dimensions (published configs cut to four layers, traced on the meta device)
check the default size rule. On the CPU the side branches run in graph order; with
testkit/graph_cases.RecordingSideStream the loader rewrites the pieces as on a GPU, and both give
the outputs of the compile without the pass bit for bit. tests/gpu/test_gpu_overlap.py (gpu) runs them
on a second CUDA stream.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import networkx as nx
import pytest
import torch

from hgc import main
from hgc.wiring import toolchain
from compiler.passes.context import CompileConfig
from compiler.passes.overlap import MIN_BRANCH_BYTES, check_branch, piece_graph
from compiler.pipeline import compile_checkpoint, plan
from compiler.splitops import MODES, Mode, call_arguments, op_name_of, op_nodes
from compiler.splitops.artifact import (FORMAT_NAME, FORMAT_VERSION, SPLIT, ArtifactFormatError, dump_json, parse_split_doc,
                                        split_doc)
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.cache.batch import SeqState
from runtime.step.bound_ops import BoundOps
from runtime.engine.generate import make_pools, run_step
from runtime.graphs.runner import GraphRunner
from runtime.artifact.loader import LoadError, ProgramRunner, load_artifact
from testkit.graph_cases import RecordingSideStream, RerunGraphs, greedy
from testkit.helpers import shared_artifact

pytestmark = pytest.mark.usefixtures("one_thread", "shared_traces", "shared_loads")  # tiny models: threads only contend

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY_RULE = "4096"  # bytes: above a tiny model's norms and gates, below its shared expert


def compiled_with_the_pass(ckpt: Path, folder: Path, dumps: bool = False):
    """compile_checkpoint of ckpt with the pass into folder/on: (the compile's context, the loaded artifact)."""
    config = CompileConfig(overlap=True, overlap_min_bytes=int(TINY_RULE))
    result, _ = compile_checkpoint(ckpt, folder / "on", config, toolchain(), dumps=dumps)
    return result.ctx, load_artifact(folder / "on")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen3-Next compiled with the pass (with dumps) and without: (folder, the context of the
    compile with the pass, both artifacts loaded). The folder holds the checkpoint ("c") and both
    artifacts ("on"; "off", a copy of the test run's compile), as `hgc run` and the benchmark read them."""
    ckpt, off = shared_artifact(tmp_path_factory, "qwen3_next")
    root = tmp_path_factory.mktemp("overlap")
    shutil.copytree(ckpt, root / "c")
    shutil.copytree(off, root / "off")
    ctx, on = compiled_with_the_pass(root / "c", root, dumps=True)
    return root, ctx, on, load_artifact(root / "off")


def _moe_nodes(gm) -> list:
    return [n for n in op_nodes(gm) if op_name_of(n.target) == "moe"]


def check_shared_expert_branches(gm, plans) -> int:
    """Every captured piece holding a moe node has exactly the branch of its shared expert: its nodes
    (the shared-expert pass's), forked after the op's input, joined before the sum that reads it,
    and no other branch; the dependency rule holds on the networkx graph. Returns the moe count."""
    by_name = {n.name: n for n in gm.graph.nodes}
    moes = _moe_nodes(gm)
    assert moes
    for mode in MODES:
        pieces = plans[mode].pieces
        branches = [(p, b) for p in pieces for b in p.branches]
        assert sorted(b.anchor for _, b in branches) == sorted(m.name for m in moes), mode
        for piece, branch in branches:
            moe = by_name[branch.anchor]
            assert set(branch.nodes) == _shared_expert(gm, moe), (mode, moe.name)
            assert call_arguments(moe)["shared_w13"] is None  # the op keeps router and routed experts
            assert branch.fork_after == call_arguments(moe)["x"].name
            assert by_name[branch.join_before].meta.get("hgc.shared_expert") == moe.name
            nodes = [by_name[n] for n in piece.nodes]
            graph, position = piece_graph(nodes), {n: i for i, n in enumerate(nodes)}
            side = {by_name[n] for n in branch.nodes}
            fork, join = position[by_name[branch.fork_after]], position[by_name[branch.join_before]]
            assert fork < position[moe] < join
            for node in side:  # the rule, stated here on the networkx graph, not through the pass's checker
                assert all(position[a] <= fork for a in nx.ancestors(graph, node) - side)
                assert all(position[d] >= join for d in nx.descendants(graph, node) - side)
            assert check_branch(nodes, graph, branch) is None
    return len(moes)


def _shared_expert(gm, moe) -> set[str]:
    """The nodes the shared-expert pass made for `moe` that do not read the op's out (the sum does)."""
    after = {call_arguments(moe)["out"]}
    side = set()
    for node in gm.graph.nodes:
        if node.meta.get("hgc.shared_expert") != moe.name:
            continue
        if any(a in after for a in node.all_input_nodes):
            after.add(node)
        else:
            side.add(node.name)
    return side


# -- the pass ------------------------------------------------------------------------------------------


def test_the_shared_expert_of_every_moe_layer_is_a_side_branch(qwen):
    """Tiny Qwen3-Next: layers 0, 2, 3 are MoE (layer 1 dense), and the MTP layer; the loaded
    artifact holds what the passes decided."""
    _, ctx, on, _ = qwen
    assert check_shared_expert_branches(ctx.programs["main"], ctx.split_plans["main"]) == 3
    assert check_shared_expert_branches(ctx.programs["draft"], ctx.split_plans["draft"]) == 1
    assert on.split_plans == ctx.split_plans


def test_bailing_linear_the_same_branches_and_the_same_logits(tmp_path_factory, tmp_path):
    """Tiny Bailing (layer 0 dense): the same branches; every step's logits (CPU: the branches in
    graph order, through the rewritten pieces) equal those of the compile without the pass."""
    ckpt, art = shared_artifact(tmp_path_factory, "bailing_linear")
    ctx, on = compiled_with_the_pass(ckpt, tmp_path)
    assert check_shared_expert_branches(ctx.programs["main"], ctx.split_plans["main"]) == 3
    assert check_shared_expert_branches(ctx.programs["draft"], ctx.split_plans["draft"]) == 1
    off = load_artifact(art)
    for a, b in zip(_logits(on, [[3, 4, 5, 6], [7, 8]], 2, RecordingSideStream()), _logits(off, [[3, 4, 5, 6], [7, 8]], 2)):
        assert torch.equal(a, b)


def _published(name: str, folder: Path, layers: int = 4) -> Path:
    """A published config.json with its first `layers` layers: the real per-layer dimensions."""
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    text = config.get("text_config", config)
    text["num_hidden_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_default_size_rule_on_real_dimensions(tmp_path):
    """Qwen3-Next-80B's layers (bf16): each shared expert (6 MB) beside its MoE op and nothing else;
    Qwen3.6-27B, dense: nothing (its norms, gates and projections beside its ops are far below 1 MiB
    or are not independent of them)."""
    config = CompileConfig(dtype="bfloat16", overlap=True)
    moe = plan(_published("qwen3_next_80b_a3b", tmp_path / "moe"), config, toolchain()).ctx
    assert check_shared_expert_branches(moe.programs["main"], moe.split_plans["main"]) == 4
    sizes = {b.side_bytes for p in moe.split_plans["main"].values() for _, b in p.side_branches()}
    assert min(sizes) >= MIN_BRANCH_BYTES and len(sizes) == 1
    dense = plan(_published("qwen3_6_27b", tmp_path / "dense"), config, toolchain()).ctx
    assert not _moe_nodes(dense.programs["main"])
    assert [b for plans in dense.split_plans.values() for p in plans.values() for b in p.side_branches()] == []


def test_the_checker_names_a_branch_that_breaks_the_rule(qwen):
    """The fork moved before the side branch's input: a side node would read a main node made after it."""
    import dataclasses

    _, _, art, _ = qwen
    gm = art.programs["main"].graph_module
    piece = next(p for p in art.split_plans["main"][Mode.EXTEND].pieces if p.branches)
    nodes = [n for name in piece.nodes for n in gm.graph.nodes if n.name == name]
    branch = piece.branches[0]
    early = dataclasses.replace(branch, fork_after=piece.nodes[0])
    assert "depends on main node" in check_branch(nodes, piece_graph(nodes), early)
    late = dataclasses.replace(branch, join_before=piece.nodes[-1])
    assert "before the join depends on side node" in check_branch(nodes, piece_graph(nodes), late)


# -- the artifact ------------------------------------------------------------------------------------


def test_split_json_round_trips_and_a_compile_without_the_pass_has_none(qwen):
    qwen = qwen[0]
    doc = json.loads((qwen / "on" / SPLIT).read_text())
    plans = parse_split_doc(doc)
    buckets = json.loads((qwen / "on" / "manifest.json").read_text())["buckets"]["extend_token_counts"]
    assert json.loads(dump_json(split_doc(plans, buckets))) == doc
    assert all(p.side_branches() for by_mode in plans.values() for p in by_mode.values())
    assert "side_branches" not in (qwen / "off" / SPLIT).read_text()
    assert not any(p.side_branches() for by_mode in parse_split_doc(json.loads((qwen / "off" / SPLIT).read_text())).values()
                   for p in by_mode.values())
    manifests = {k: json.loads((qwen / k / "manifest.json").read_text()) for k in ("on", "off")}
    assert manifests["on"]["compile"]["overlap"] is True and manifests["on"]["compile"]["overlap_min_bytes"] == 4096
    assert manifests["off"]["compile"]["overlap"] is False
    passes = {k: [p["name"] for p in m["passes"]] for k, m in manifests.items()}
    assert passes["on"] == ["annotate", "lint_registry", "fusion", "shared_expert", "routing", "split", "overlap",
                            "lint_capture"]
    assert passes["off"] == ["annotate", "lint_registry", "fusion", "routing", "split", "lint_capture"]


def test_split_json_refuses_a_branch_it_cannot_run():
    nodes = ["a", "b", "c", "d"]
    good = {"nodes": ["b"], "fork_after": "a", "join_before": "d", "anchor": "c", "side_bytes": 1, "main_bytes": 1}

    def parse(kind="captured", **branch):
        doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "programs": {"main": {
            m.value: {"mode": m.value, "pieces": [{"index": 0, "kind": kind, "nodes": nodes,
                                                   "side_branches": [{**good, **branch}]}]} for m in MODES}}}
        return parse_split_doc(doc)

    assert parse()["main"][Mode.DECODE].pieces[0].stream_of() == {"a": 0, "b": 1, "c": 0, "d": 0}
    for bad, message in ((dict(nodes=["x"]), "not in the piece"), (dict(fork_after="d", join_before="a"), "fork must"),
                         (dict(anchor="b"), "not a main-stream node"), (dict(nodes=[]), "no nodes")):
        with pytest.raises(ArtifactFormatError, match=message):
            parse(**bad)
    with pytest.raises(ArtifactFormatError, match="eager piece has side branches"):
        parse(kind="eager")


def test_the_dump_and_inspect_show_the_side_streams(qwen, capsys):
    qwen = qwen[0]
    text = (qwen / "on" / "dumps" / "07_overlap.txt").read_text()
    assert "side branches)" in text.splitlines()[1]
    fork = text.index("# fork 0: the side stream waits on the main stream here")
    join = text.index("# join 0: the main stream waits on the side stream here")
    marked = [line for line in text[fork:join].splitlines() if line.endswith("# stream 1 (branch 0)")]
    assert marked and "aten.linear.default(" in marked[0] and "hgc.moe(" in text[fork:join]
    assert "stream 1" not in (qwen / "on" / "dumps" / "05_routing.txt").read_text()

    assert main(["inspect", str(qwen / "on")]) == 0
    out = capsys.readouterr().out
    assert "overlap: on (4 side-stream branch(es); size rule 4096 bytes at one token)" in out and "fork after" in out
    assert main(["inspect", str(qwen / "off")]) == 0
    assert "overlap: off" in capsys.readouterr().out
    assert main(["inspect", str(qwen / "on"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["compile"]["overlap"] is True and len(doc["side_branches"]) == 4
    assert {r["beside"] for r in doc["side_branches"]} == {"moe", "moe_1", "moe_2"}


def test_what_the_pass_does_not_combine_with_is_refused(qwen, capsys):
    qwen = qwen[0]
    for argv, message in ((["--overlap", "--tp", "2"], "--overlap with --tp 2"),
                          (["--overlap-min-bytes", "10"], "needs --overlap"),
                          (["--overlap", "--inductor"], "--inductor: --overlap")):
        assert main(["compile", str(qwen / "c"), "-o", str(qwen / "x"), *argv]) == 2
        assert message in capsys.readouterr().err
    assert not (qwen / "x").exists()
    assert main(["build", str(qwen / "on"), "--device", "cpu"]) == 2  # compiled pieces: one call per glue run
    assert "compiled with --overlap; compiled pieces cannot be split across its two streams" in capsys.readouterr().err
    assert not (qwen / "on" / "targets").exists()


# -- the same outputs ---------------------------------------------------------------------------------


def test_hgc_run_gives_the_same_tokens_with_and_without_the_pass(qwen, capsys):
    outs = {}
    for name in ("on", "off"):
        assert main(["run", str(qwen[0] / name), "--prompt-ids", "1,2,3,4,5,6,7;9,8", "--max-new-tokens", "6",
                     "--json", "-q"]) == 0
        outs[name] = [o["output_ids"] for o in json.loads(capsys.readouterr().out)["outputs"]]
    assert outs["on"] == outs["off"] and len(outs["on"][0]) == 6


def _logits(art, prompts, steps, streams=None, mode_of=None) -> list[torch.Tensor]:
    """Every step's logits of a greedy run (prefill, then `steps` decodes) on fresh pools."""
    kv, st = make_pools(art.registry, 64, len(prompts), page_size=8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    runner = art.runner(ops, streams=streams)
    logits_at = runner.outputs.index("logits")  # a model with a draft program also returns its hidden states

    def forward(*inputs):
        outputs = runner(ops.ctx.mode, *inputs)
        return outputs[logits_at] if len(runner.outputs) > 1 else outputs

    seqs = [SeqState(st.alloc()) for _ in prompts]
    pending, out = [list(p) for p in prompts], []
    for _ in range(steps + 1):
        logits = run_step(forward, ops, list(zip(seqs, pending)), kv)
        out.append(logits)
        pending = [[t] for t in logits.argmax(-1).tolist()]
    return out


def test_the_pieces_rewritten_for_a_side_stream_give_the_same_logits(qwen):
    """The loader rewrites each piece as on a GPU (RecordingSideStream for the stream): every branch
    forks, leaves and joins once per step in order, keeping its main-stream inputs alive to the
    join, and every logit equals the in-order run of the same artifact and the compile without the
    pass, bit for bit."""
    _, _, on, off = qwen
    streams = RecordingSideStream()
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    forked = _logits(on, prompts, 3, streams)
    assert streams.calls == ["fork", "leave", "join"] * 3 * 4  # 3 MoE layers, 4 steps
    assert min(streams.kept) >= 1
    for a, b, c in zip(forked, _logits(on, prompts, 3), _logits(off, prompts, 3)):
        assert torch.equal(a, b) and torch.equal(a, c)
    split = on.runner(BoundOps(CPUReferenceBackend(*make_pools(on.registry, 8, 1))), streams=streams).module_for(
        Mode.DECODE)
    lines = [line.strip() for line in split.submod_0.code.splitlines()]
    fork = next(i for i, line in enumerate(lines) if "self.side_fork_0()" in line)
    assert lines[fork + 1].startswith("linear_default = ") and "shared_w13" in lines[fork + 1]


def test_graph_runner_captures_and_replays_pieces_with_side_branches(qwen):
    """Capture (RerunGraphs), start-up parity and replayed steps with the pieces rewritten."""
    _, _, art, _ = qwen
    kv, st = make_pools(art.registry, 128, 8, page_size=8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    streams = RecordingSideStream()
    runner = GraphRunner(art.runner(ops, streams=streams), ops, kv, st, "cpu", decode_buckets=(1, 2), extend_buckets=(32,),
                         max_pages_per_seq=16, extend_max_seqs=4, debug=True, graphs=RerunGraphs())
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    eager, _ = greedy(runner, st, prompts, 4)
    runner.start(vocab_size=art.manifest["model"]["vocab_size"])
    forks = streams.calls.count("fork")
    graph, keys = greedy(runner, st, prompts, 4)
    assert graph == eager and all(k is not None for k in keys)
    assert forks > 0 and streams.calls.count("fork") > forks


def test_a_recorded_branch_that_would_race_is_refused_at_load(qwen):
    """A plan (as split.json could say after an edit) whose branch forks before the value its side
    nodes read: the loader refuses it when it rewrites the piece, naming the piece and the node."""
    import dataclasses

    _, _, art, _ = qwen
    plans = dict(art.split_plans["main"])
    extend = plans[Mode.EXTEND]
    piece = next(p for p in extend.pieces if p.branches)
    early = dataclasses.replace(piece.branches[0], fork_after=piece.nodes[0])
    plans[Mode.EXTEND] = dataclasses.replace(extend, pieces=tuple(
        dataclasses.replace(p, branches=(early,)) if p is piece else p for p in extend.pieces))
    ops = BoundOps(CPUReferenceBackend(*make_pools(art.registry, 8, 1)))
    runner = ProgramRunner("main", art.programs["main"], plans, art.runner(ops).weights, ops, art.device, art.docs,
                           streams=RecordingSideStream())
    with pytest.raises(LoadError, match=rf"main extend piece {piece.index} side branch 0: side node "
                                        rf"{early.nodes[0]} reads \w+, which the main stream makes after the fork"):
        runner.module_for(Mode.EXTEND)


def test_kimi_linear_gives_the_same_logits_with_and_without_the_pass(tmp_path_factory, tmp_path):
    """`hgc compile --overlap` (the command line, this time) of a tiny Kimi-Linear, against the compile without."""
    ckpt, art = shared_artifact(tmp_path_factory, "kimi_linear")
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "on"), "--overlap", "--overlap-min-bytes",
                 TINY_RULE, "--no-dumps", "-q"]) == 0
    on = load_artifact(tmp_path / "on")
    off = load_artifact(art)
    assert sum(len(p.side_branches()) for p in on.split_plans["main"].values()) > 0
    streams = RecordingSideStream()
    for a, b in zip(_logits(on, [[3, 4, 5, 6], [7, 8]], 2, streams), _logits(off, [[3, 4, 5, 6], [7, 8]], 2)):
        assert torch.equal(a, b)
    assert "fork" in streams.calls


def test_the_overlap_benchmark_runs_every_stage_dry(qwen, tmp_path):
    """benchmarks/serving/overlap_bench.py --dry-run on the module's two artifacts: the MoE layer's three
    variants agree bit for bit (float32, CPU), each stage ends ok, the JSON and the table say so."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "serving"))
    from overlap_bench import main as bench

    root = qwen[0]
    rec = bench(["--dry-run", "--out", str(tmp_path), "--artifacts", str(root / "on"), str(root / "off"),
                 "--batches", "1,2", "--prompts", "2", "--new-tokens", "2", "--iters", "1"])
    assert {name: s["status"] for name, s in rec["stages"].items()} == dict.fromkeys(
        ("moe_layer", "compile", "decode", "parity"), "ok")
    assert json.loads((tmp_path / "overlap_bench.json").read_text())["parity"] == rec["parity"]
    assert rec["parity"]["mismatched"] == 0 and rec["side_branches"]["decode"] == 3
    assert rec["parity_streams"]["mismatched"] == 0 and rec["first_step"]["argmax_flips"] == 0
    assert rec["first_step"]["logits_rel_err"] == 0.0 and rec["first_step"]["prompts"] == 2
    assert all(err == 0.0 for row in rec["moe_layer_ms"].values() for err in row["rel_err_vs_fused"].values())
    assert set(rec["decode_step_ms"]["2"]) == {"off", "on", "on, one stream", "gain"}
