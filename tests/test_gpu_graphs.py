"""GraphRunner on a CUDA GPU: capture, start-up parity and graph-vs-eager tokens on a tiny qwen3_next.

Runs only on the GPU machine (`pytest -m gpu`); benchmarks/gpu_graphs.py drives the bigger
checkpoints and the timings. The backend comes from runtime/gpu_backends.build_gpu_backend, so
these tests also cover deriving per-layer scales and head counts from the artifact's graph.
"""

from __future__ import annotations

import pytest
import torch

from compiler.cli import main
from compiler.splitops import Mode
from runtime.bound_ops import BoundOps
from runtime.generate import make_pools
from runtime.graph_runner import CaptureError, GraphRunner
from runtime.loader import load_artifact
from tests.graph_cases import greedy


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from models.checkpoint import write_checkpoint
    from models.families import get_family
    from models.loader import config_dtype

    root = tmp_path_factory.mktemp("gg")
    # tiny with head_dim 64: FlashInfer 0.6.0 builds no prefill for tiny's head dim 32
    family = get_family("qwen3_next")
    config = family.make_config("tiny")
    config["head_dim"] = 64
    text = family.text_config(config)
    model = family.build(text)
    family.init_weights(model, 1)
    write_checkpoint(root / "c", config, model.to(config_dtype(text)).checkpoint_tensors())
    assert main(["compile", str(root / "c"), "-o", str(root / "a"), "--target", "cuda", "--dtype", "bfloat16",
                 "--no-dumps"]) == 0
    return load_artifact(root / "a", "cuda")


def make_runner(art, decode_graphs="full"):
    from runtime.gpu_backends import build_gpu_backend
    kv, st = make_pools(art.registry, 128, 8, page_size=16, device="cuda", kv_dtype=torch.bfloat16)
    ops = BoundOps(build_gpu_backend(art, kv, st))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cuda", decode_buckets=(1, 2, 4), extend_buckets=(64,),
                         max_pages_per_seq=8, extend_max_seqs=4, debug=True, decode_graphs=decode_graphs)
    return runner, kv, st




def test_capture_parity_and_tokens_match_eager(artifact):
    runner, kv, st = make_runner(artifact)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    eager, keys = greedy(runner, st, prompts, 6)
    assert all(k is None for k in keys)
    runner.capture()
    assert runner.sealed and len(runner.keys) == 4
    report = runner.check_parity(vocab_size=256)
    assert set(report) == {str(k) for k in runner.keys} and max(report.values()) < 2e-2
    graph, keys = greedy(runner, st, prompts, 6)
    assert keys[0] is not None and keys[0].mode == Mode.EXTEND and keys[1].mode == Mode.DECODE
    assert runner.counters["graph_replays"] >= 5 and runner.counters["piecewise_steps"] >= 1
    assert graph[0][:2] == eager[0][:2] and all(g[0] == e[0] for g, e in zip(graph, eager))
    with pytest.raises(CaptureError, match="capture after start-up"):
        runner.capture()


def test_piecewise_decode_matches_eager(artifact):
    runner, kv, st = make_runner(artifact, decode_graphs="piecewise")
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    eager, _ = greedy(runner, st, prompts, 5)
    runner.capture()
    runner.check_parity(vocab_size=256)
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
