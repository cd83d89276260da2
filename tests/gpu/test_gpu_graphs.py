"""GraphRunner on a CUDA GPU: capture, start-up parity and graph-vs-eager tokens on a tiny qwen3_next.

Runs only on the GPU machine (`pytest -m gpu`); benchmarks/serving/gpu_graphs.py drives the bigger
checkpoints and the timings. The backends are the ones the artifact's routing.json names
(runtime/artifact/binding.py), so these tests also cover building FlashInfer from the per-layer scales and
head counts of the artifact's graph. Two routings beyond the default: one GDN layer bound to a
second linear-attention implementation (torch_reference: eager in every mode, so its nodes are
gaps even in decode) must still pass start-up parity, run that layer and only that layer on it,
and give the tokens of eager; the default's extend buckets whole-step graphs up to FlashInfer's
whole_extend_tokens and pieces above it; and float32 Kimi-Linear, whose MLA routing sends to the Triton MLA
kernel (FlashInfer has no float32), must run.
"""

from __future__ import annotations

import pytest
import torch

from hgc import main
from compiler.splitops import Mode
from runtime.step.bound_ops import BoundOps
from runtime.engine.generate import make_pools
from runtime.graphs.runner import CaptureError, GraphRunner
from runtime.graphs.startup_parity import check_parity
from runtime.artifact.loader import load_artifact
from testkit.graph_cases import greedy, write_tiny_qwen3_next_hd64


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("gg")
    write_tiny_qwen3_next_hd64(root / "c")
    assert main(["compile", str(root / "c"), "-o", str(root / "a"), "--target", "cuda", "--no-inductor", "--dtype", "bfloat16",
                 "--no-dumps", "--no-inductor"]) == 0
    return load_artifact(root / "a", "cuda")


def make_runner(art, decode_graphs="full", extend_buckets=(64,), max_pages=8):
    kv, st = make_pools(art.registry, 128, 8, page_size=16, device="cuda", kv_dtype=torch.bfloat16)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cuda", decode_buckets=(1, 2, 4), extend_buckets=extend_buckets,
                         max_pages_per_seq=max_pages, extend_max_seqs=4, debug=True, decode_graphs=decode_graphs)
    return runner, kv, st




def test_capture_parity_and_tokens_match_eager(artifact):
    runner, kv, st = make_runner(artifact)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    eager, keys = greedy(runner, st, prompts, 6)
    assert all(k is None for k in keys)
    runner.capture()
    # decode buckets 1, 2, 4; the 64-token extend bucket for 4 requests and for one (SOLO_EXTEND_TOKENS)
    assert runner.sealed and sorted((k.mode.value, k.tokens, k.seqs) for k in runner.keys) == \
        [("decode", 1, 1), ("decode", 2, 2), ("decode", 4, 4), ("extend", 64, 1), ("extend", 64, 4)]
    report = check_parity(runner, vocab_size=256)
    assert set(report) == {str(k) for k in runner.keys} and max(report.values()) < 2e-2
    graph, keys = greedy(runner, st, prompts, 6)
    assert keys[0] is not None and keys[0].mode == Mode.EXTEND and keys[1].mode == Mode.DECODE
    # the 64-token extend bucket is one whole-step graph too: FlashInfer's GQA extends of up to
    # whole_extend_tokens (512 by default) run the Triton varlen kernel, captured in it
    assert runner.counters["graph_replays"] >= 6 and runner.counters["piecewise_steps"] == 0
    assert graph[0][:2] == eager[0][:2] and all(g[0] == e[0] for g, e in zip(graph, eager))
    with pytest.raises(CaptureError, match="capture after start-up"):
        runner.capture()


def test_small_extend_buckets_are_whole_step_graphs_and_large_ones_pieces(artifact):
    """The default cuda artifact (FlashInfer's whole_extend_tokens=512): extend buckets of up to 512
    tokens are whole-step graphs with GQA on the Triton varlen kernel inside them, the 1024-token one
    pieces with FlashInfer's prefill in the eager gaps; start-up parity passes for both kinds, short
    prompts (one, and three at once) replay whole graphs, a 600-token prompt runs pieces, and every
    first token is eager's (bf16: padded shapes may part later, never at once)."""
    runner, kv, st = make_runner(artifact, extend_buckets=(16, 64, 512, 1024), max_pages=48)
    assert sorted({k.tokens for k in runner.whole_keys if k.mode == Mode.EXTEND}) == [16, 64, 512]
    batches = [[[(7 * j) % 200 + 3 for j in range(12)]], [[(5 * j) % 150 + 2 for j in range(300)]],
               [list(range(2, 12)), list(range(40, 47)), [9] * 13], [[(3 * j) % 190 + 4 for j in range(600)]]]
    eager = [greedy(runner, st, prompts, 4)[0] for prompts in batches]
    runner.capture()
    report = check_parity(runner, vocab_size=256)
    assert max(report.values()) < 2e-2, report
    for prompts, want in zip(batches, eager):
        before = dict(runner.counters)
        got, keys = greedy(runner, st, prompts, 4)
        whole = keys[0].tokens <= 512
        assert keys[0].mode == Mode.EXTEND and (keys[0].tokens == 1024) == (not whole), keys
        assert runner.counters["piecewise_steps"] - before["piecewise_steps"] == (0 if whole else 1), keys
        assert all(g[0] == e[0] for g, e in zip(got, want)), (len(prompts[0]), got, want)


def test_piecewise_decode_matches_eager(artifact):
    runner, kv, st = make_runner(artifact, decode_graphs="piecewise")
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    eager, _ = greedy(runner, st, prompts, 5)
    runner.capture()
    check_parity(runner, vocab_size=256)
    graph, keys = greedy(runner, st, prompts, 5)
    assert keys[1] == runner.key_for(Mode.DECODE, 2, 2) and runner.counters["graph_replays"] == 0
    assert all(g[0] == e[0] for g, e in zip(graph, eager))


def test_hgc_run_on_cuda_with_graphs_gives_the_eager_tokens(artifact, capsys):
    """The engine on a started GraphRunner (`hgc run --device cuda`) against the same engine with
    every step eager (`--no-graphs`): bf16 kernels on padded shapes may part late, never at once."""
    import json
    path = str(artifact.docs.path)
    ids = "1,2,3,4,5,6,7;9,8;20,21,22,23"
    outs = {}
    for flags in ((), ("--no-graphs",)):
        assert main(["run", path, "--device", "cuda", "--prompt-ids", ids, "--max-new-tokens", "8", "--json",
                     *flags]) == 0
        outs[flags] = json.loads(capsys.readouterr().out)
    with_graphs, eager = outs[()], outs[("--no-graphs",)]
    assert with_graphs["steps"]["graph_replays"] > 0
    got = [o["output_ids"] for o in with_graphs["outputs"]]
    want = [o["output_ids"] for o in eager["outputs"]]
    assert [g[0] for g in got] == [w[0] for w in want]
    differ = sum(a != b for g, w in zip(got, want) for a, b in zip(g, w))
    assert differ <= len(got) * 8 // 4, f"{differ} of {len(got) * 8} tokens differ"


def test_start_up_parity_refuses_a_padding_leak_on_the_gpu(artifact):
    """The GPU backends with a linear-attention backend that adds its padding rows' values to the first
    request's state (a padded step only: the rows with slot -1; capture-safe device ops) is refused
    at start-up, naming the state and the layer; the unchanged backend starts (the test above)."""
    from runtime.backends import discover
    from runtime.backends.triton_linear import TritonLinearBackend
    from runtime.graphs.runner import ParityError

    class LeaksPadding(TritonLinearBackend):
        # the recurrent core of gdn_core and of the fused mixer (gdn_fused, the cuda route) alike
        def _gdn_core(self, ctx, q, k, v, g, beta, out, layer_id, scale, zero_padding=True):
            super()._gdn_core(ctx, q, k, v, g, beta, out, layer_id, scale, zero_padding)
            padding = (ctx.slot_mapping < 0).to(v.dtype)[:, None, None]  # [T, 1, 1]
            states = self.state_pool.layer(layer_id)["recurrent"]
            leak = (v * padding).float().sum() + padding.sum()  # nonzero whenever the step has padding rows
            states.index_add_(0, ctx.state_slots[:1], leak.expand(1, *states.shape[1:]).contiguous())

    kv, st = make_pools(artifact.registry, 128, 8, page_size=16, device="cuda", kv_dtype=torch.bfloat16)
    registry = discover().replacing(LeaksPadding, source="tests/gpu/test_gpu_graphs.py")  # the linear layers' backend
    ops = BoundOps(artifact.backends(kv, st, registry).for_program("main"))
    assert any(isinstance(m, LeaksPadding) for m in ops.backend.members.values())
    runner = GraphRunner(artifact.runner(ops), ops, kv, st, "cuda", decode_buckets=(4,), extend_buckets=(64,),
                         max_pages_per_seq=8, extend_max_seqs=4)
    with pytest.raises(ParityError, match=r"written for a real request: layer \d+'s recurrent state in slot \d+"):
        runner.start(vocab_size=256)


@pytest.fixture(scope="module")
def layer1_apart(artifact, tmp_path_factory):
    """The same checkpoint with GDN layer 1 bound to torch_reference, its neighbours to triton_linear."""
    root = tmp_path_factory.mktemp("gg_layer1")
    assert main(["compile", str(artifact.docs.path.parent / "c"), "-o", str(root / "a"), "--target", "cuda", "--no-inductor",
                 "--dtype", "bfloat16", "--no-dumps", "--no-inductor", "--route", "layers=1:torch_reference"]) == 0
    return load_artifact(root / "a", "cuda")


def test_one_gdn_layer_on_a_second_linear_variant_passes_parity_and_runs_only_there(artifact, layer1_apart):
    entries = layer1_apart.docs.routing.entries("main")
    assert {e.backend for e in entries if e.layer_id == 1} == {"torch_reference"}
    assert {e.backend for e in entries if e.layer_id in (0, 2) and e.op == "gdn_fused"} == {"triton_linear"}
    runner, kv, st = make_runner(layer1_apart)
    assert not runner.full_decode, "layer 1's nodes are eager gaps in decode (torch_reference captures nothing)"
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    eager, _ = greedy(runner, st, prompts, 6)
    runner.capture()
    report = check_parity(runner, vocab_size=256)
    assert set(report) == {str(k) for k in runner.keys} and max(report.values()) < 2e-2
    graph, keys = greedy(runner, st, prompts, 6)
    assert keys[1].mode == Mode.DECODE and runner.counters["piecewise_steps"] >= 5
    assert all(g[0] == e[0] for g, e in zip(graph, eager))
    executed = runner.ops.executed_backends()
    assert executed["1"] == ["torch_reference"]
    assert [layer for layer, names in executed.items() if "torch_reference" in names] == ["1"]
    # the default routing of the same checkpoint gives the same first tokens
    default_runner, _, default_st = make_runner(artifact)
    default, _ = greedy(default_runner, default_st, prompts, 6)
    assert [d[0] for d in default] == [e[0] for e in eager]


def test_float32_kimi_runs_its_mla_on_the_triton_kernel(tmp_path, capsys):
    import json
    from testkit.helpers import tiny_checkpoint

    tiny_checkpoint("kimi_linear", tmp_path / "c")
    assert main(["compile", str(tmp_path / "c"), "-o", str(tmp_path / "a"), "--target", "cuda", "--no-inductor", "--dtype", "float32",
                 "--no-dumps", "--no-inductor"]) == 0
    routing = json.loads((tmp_path / "a" / "routing.json").read_text())
    assert {e["backend"] for e in routing["programs"]["main"] if e["op"] == "mla_attention"} == {"triton_mla"}
    capsys.readouterr()
    ids = "1,2,3,4,5,6,7;9,8;20,21,22,23"
    outs = {}
    for flags in ((), ("--no-graphs",)):
        assert main(["run", str(tmp_path / "a"), "--prompt-ids", ids, "--max-new-tokens", "8", "--json", *flags]) == 0
        outs[flags] = json.loads(capsys.readouterr().out)
    assert [o["output_ids"][0] for o in outs[()]["outputs"]] == [o["output_ids"][0] for o in outs[("--no-graphs",)]["outputs"]]
    mla_layers = {str(e["layer_id"]) for e in routing["programs"]["main"] if e["op"] == "mla_attention"}
    assert all("triton_mla" in outs[()]["executed_backends"][layer] for layer in mla_layers)
