"""Graph runner on the CPU: the dispatcher's choice of key, padding into static buffers, and the
refusals. Capture itself needs CUDA: tests/test_gpu_graphs.py (marked gpu) covers it."""

from __future__ import annotations

import pytest
import torch

from compiler.cli import main
from compiler.splitops import Mode
from runtime.backends.cpu_reference import CPUReferenceBackend
from runtime.batch import SeqState, commit_step
from runtime.bound_ops import BoundOps
from runtime.generate import make_pools
from runtime.graph_runner import CaptureError, CaptureKey, GraphRunner
from runtime.loader import load_artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("gr")
    assert main(["init-model", "--family", "qwen3_next", "--size", "tiny", "--seed", "1", "-o", str(root / "c")]) == 0
    assert main(["compile", str(root / "c"), "-o", str(root / "a")]) == 0
    return load_artifact(root / "a")


def make_runner(art, decode=(1, 2, 4), extend=(32, 64)):
    kv, st = make_pools(art.registry, 128, 8, page_size=8)
    ops = BoundOps(CPUReferenceBackend(kv, st))
    runner = GraphRunner(art.runner(ops), ops, kv, "cpu", decode_buckets=decode, extend_buckets=extend,
                         max_pages_per_seq=16, extend_max_seqs=4)
    return runner, kv, st


def test_keys_pick_the_smallest_bucket_and_eager_above_the_largest(artifact):
    runner, _, _ = make_runner(artifact)
    assert runner.key_for(Mode.DECODE, 3, 3) is None, "nothing is captured before capture()"
    runner.sealed = True  # as after capture(): the dispatcher's table alone is under test here
    assert runner.key_for(Mode.DECODE, 3, 3) == CaptureKey(Mode.DECODE, 4, 4)
    assert runner.key_for(Mode.DECODE, 5, 5) is None
    assert runner.key_for(Mode.EXTEND, 40, 2) == CaptureKey(Mode.EXTEND, 64, 4)
    assert runner.key_for(Mode.MIXED, 20, 3) == CaptureKey(Mode.EXTEND, 32, 4)
    assert runner.key_for(Mode.EXTEND, 65, 1) is None
    assert runner.key_for(Mode.EXTEND, 20, 5) is None, "more requests than the extend graphs hold: eager"


def test_capture_needs_cuda_and_happens_once(artifact):
    runner, _, _ = make_runner(artifact)
    with pytest.raises(CaptureError, match="need a CUDA device"):
        runner.capture()
    runner.sealed = True
    with pytest.raises(CaptureError, match="capture after start-up"):
        runner.capture()


def test_padded_static_step_gives_the_unpadded_tokens(artifact):
    """Steps padded to a key's shape (reserved slot, no KV writes, dummy logits rows) and
    laid into the static buffers give the unpadded step's logits for the real requests."""
    runner, kv, st = make_runner(artifact)
    ref_runner, ref_kv, ref_st = make_runner(artifact)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    seqs = [SeqState(st.alloc()) for _ in prompts]
    ref_seqs = [SeqState(ref_st.alloc()) for _ in prompts]
    pending = [list(p) for p in prompts]
    for _ in range(4):
        items = list(zip(seqs, pending))
        step, _ = runner.build(items)
        key = CaptureKey(step.ctx.mode if step.ctx.mode == Mode.DECODE else Mode.EXTEND,
                         4 if step.ctx.mode == Mode.DECODE else 32, 4)
        from runtime.batch import build_step
        padded = build_step(items, kv, "cpu", mode=step.ctx.mode, pad_tokens_to=key.tokens, pad_seqs_to=key.seqs,
                            max_pages=16)
        got = runner.run(padded, None)  # eager through the static buffers, at the key's padded shape
        ref_items = list(zip(ref_seqs, pending))
        ref_step, _ = ref_runner.build(ref_items)
        want = ref_runner.run(ref_step, None)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        commit_step(items)
        commit_step(ref_items)
        pending = [[int(t)] for t in want.argmax(-1)]
    assert runner.counters["eager_steps"] + runner.counters["piecewise_steps"] == 4


def test_gpu_backend_facts_come_from_the_graph(tmp_path):
    """build_gpu_backend's inputs, on the CPU: per-layer q heads and scales read from a cuda-target
    artifact's graph, and FlashInfer's head-dim limit refused at construction, not at the first prefill."""
    from runtime.gpu_backends import _check_head_dims, full_layer_facts
    assert main(["init-model", "--family", "qwen3_next", "--size", "tiny", "-o", str(tmp_path / "c")]) == 0
    assert main(["compile", str(tmp_path / "c"), "-o", str(tmp_path / "a"), "--target", "cuda", "--dtype",
                 "bfloat16", "--no-dumps"]) == 0
    art = load_artifact(tmp_path / "a")
    facts = full_layer_facts(art)
    kv, _ = make_pools(art.registry, 64, 2, page_size=8)
    assert set(facts) == set(kv.buffers), "every pooled full layer (the draft's too) is found in a graph"
    for f in facts.values():
        assert f.op == "gqa_attention" and f.q_dtype == torch.bfloat16
        head_dim = kv.buffers[f.layer_id]["k"].shape[-1]
        assert f.q_heads % kv.buffers[f.layer_id]["k"].shape[2] == 0
        assert f.scale == pytest.approx(head_dim ** -0.5)
    with pytest.raises(ValueError, match="FlashInfer's prefill kernels take"):
        _check_head_dims(kv)  # tiny's head dim is 32
