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
from runtime.batch import SeqState, commit_step
from runtime.bound_ops import BoundOps
from runtime.generate import make_pools
from runtime.graph_runner import CaptureError, GraphRunner
from runtime.loader import load_artifact


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


def make_runner(art):
    from runtime.gpu_backends import build_gpu_backend
    kv, st = make_pools(art.registry, 128, 8, page_size=16, device="cuda", kv_dtype=torch.bfloat16)
    ops = BoundOps(build_gpu_backend(art, kv, st))
    runner = GraphRunner(art.runner(ops), ops, kv, "cuda", decode_buckets=(1, 2, 4), extend_buckets=(64,),
                         max_pages_per_seq=8, extend_max_seqs=4, debug=True)
    return runner, kv, st


def greedy(runner, kv, st, prompts, n):
    seqs = [SeqState(st.alloc()) for _ in prompts]
    pending, outs, keys = [list(p) for p in prompts], [[] for _ in prompts], []
    with torch.no_grad():
        for _ in range(n):
            items = list(zip(seqs, pending))
            step, key = runner.build(items)
            nxt = runner.run(step, key).argmax(-1).tolist()
            keys.append(key)
            commit_step(items)
            for o, t in zip(outs, nxt):
                o.append(t)
            pending = [[t] for t in nxt]
    for s in seqs:
        kv.free(s.pages)
        st.free(s.slot)
    return outs, keys


def test_capture_parity_and_tokens_match_eager(artifact):
    runner, kv, st = make_runner(artifact)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    eager, keys = greedy(runner, kv, st, prompts, 6)
    assert all(k is None for k in keys)
    runner.capture()
    assert runner.sealed and len(runner.keys) == 4
    held = []

    def make_items(key):
        for s in held:
            kv.free(s.pages)
            st.free(s.slot)
        held.clear()
        if key.mode == Mode.DECODE:
            held.extend(SeqState(st.alloc(), num_cached=3 + b) for b in range(key.seqs))
            return [(s, [5 + i]) for i, s in enumerate(held)]
        held.extend(SeqState(st.alloc()) for _ in range(2))
        return [(held[0], list(range(1, 20))), (held[1], list(range(3, 11)))]

    report = runner.check_parity(make_items)
    assert set(report) == {str(k) for k in runner.keys}
    graph, keys = greedy(runner, kv, st, prompts, 6)
    assert keys[0] is not None and keys[0].mode == Mode.EXTEND and keys[1].mode == Mode.DECODE
    assert runner.counters["graph_replays"] >= 5 and runner.counters["piecewise_steps"] >= 1
    assert graph[0][:2] == eager[0][:2] and all(g[0] == e[0] for g, e in zip(graph, eager))
    with pytest.raises(CaptureError, match="capture after start-up"):
        runner.capture()
