"""The fused GDN mixer on a CUDA GPU: a cuda compile of a tiny qwen3_next (the default) makes every
GDN layer one hgc.gdn_fused node on triton_linear, its decode steps capture and pass start-up
parity, and its logits agree with an unfused compile's (`--route gdn_fused=unfused`) to bf16
rounding, first tokens equal. Runs only on the GPU machine (`pytest -m gpu`).
"""

from __future__ import annotations

import json

import pytest
import torch

from hgc import main
from runtime.artifact.loader import load_artifact
from runtime.engine.generate import make_pools
from runtime.graphs.runner import GraphRunner
from runtime.graphs.startup_parity import check_parity
from runtime.step.bound_ops import BoundOps
from testkit.graph_cases import greedy, write_tiny_qwen3_next_hd64

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(fused, unfused) bf16 cuda artifacts of one tiny qwen3_next (head_dim 64: FlashInfer builds no 32)."""
    root = tmp_path_factory.mktemp("gpu_fusion")
    write_tiny_qwen3_next_hd64(root / "c")
    flags = ["--target", "cuda", "--dtype", "bfloat16", "--no-dumps", "--no-inductor"]
    # triton_linear fuses by default; the route keeps the regions
    assert main(["compile", str(root / "c"), "-o", str(root / "fused"), *flags]) == 0
    assert main(["compile", str(root / "c"), "-o", str(root / "unfused"), *flags, "--route", "gdn_fused=unfused"]) == 0
    return root / "fused", root / "unfused"


def _runner(path):
    art = load_artifact(path, "cuda")
    kv, st = make_pools(art.registry, 128, 8, page_size=16, device="cuda", kv_dtype=torch.bfloat16)
    ops = BoundOps(art.backends(kv, st).for_program("main"))
    runner = GraphRunner(art.runner(ops), ops, kv, st, "cuda", decode_buckets=(1, 2, 4), extend_buckets=(64,),
                         max_pages_per_seq=8, extend_max_seqs=4, debug=True)
    return runner, st


def test_every_gdn_layer_is_one_fused_node_on_triton_linear(artifacts):
    routing = json.loads((artifacts[0] / "routing.json").read_text())
    entries = routing["programs"]["main"]
    fused = [e for e in entries if e["op"] == "gdn_fused"]
    assert [e["layer_id"] for e in fused] == [0, 1, 2]
    assert all(e["backend"] == "triton_linear" and e["fused"] == "gdn" for e in fused)
    assert not {"short_conv", "gdn_core"} & {e["op"] for e in entries}


def test_fused_decode_captures_and_matches_the_unfused_artifact(artifacts):
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12, 13, 14, 15]]
    results = []
    for path in artifacts:
        runner, st = _runner(path)
        runner.capture()
        report = check_parity(runner, vocab_size=256)
        assert max(report.values()) < 2e-2, report
        logits = []
        tokens, _ = greedy(runner, st, prompts, 6, logits=logits)
        results.append((tokens, logits))
    (fused_tokens, fused_logits), (tokens, logits) = results
    assert [t[0] for t in fused_tokens] == [t[0] for t in tokens]  # bf16: later tokens may part on near ties
    first = (fused_logits[0] - logits[0]).norm() / logits[0].norm()
    assert first < 2e-2, float(first)
