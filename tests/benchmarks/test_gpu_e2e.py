"""benchmarks/serving/gpu_e2e.py --dry-run on the CPU: every stage of the GPU run's bookkeeping, then plot_e2e.py.

The dry run uses the CPU reference backend and testkit/graph_cases.RerunGraphs for CUDA graphs, at
qwen3_next tiny with two decode batches, one extend size over 1, 3 (an uneven split, so
transformers' batch is padded) and 16 requests, and mixed steps of that size with 1 and 2 decodes.
torch.compile and transformers' static-cache generate compile with inductor's C++ backend on a CPU
(tens of seconds each), so they are skipped here; a dry run by hand runs them (see the script's docstring).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = {"torch_compile", "hf_static"}

pytestmark = pytest.mark.slow


def test_logit_drift_tells_a_fault_from_a_near_tie():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from bench_common import logit_drift

    e = [torch.tensor([[0.0, 1.0, 0.99]]), torch.tensor([[2.0, 0.0, 1.999]])]
    near = [e[0] * (1 + 1e-3), torch.tensor([[1.999, 0.0, 2.0]])]  # rounding flips a near-tie at step 1
    drift = logit_drift(e, near, [[1, 0]], [[1, 2]])
    assert drift["logits_rel_err_per_step"][0] < 2e-3 and len(drift["logits_rel_err_per_step"]) == 2
    assert drift["eager_top2_gap_at_first_diff"] == pytest.approx(1e-3, rel=1e-2)
    wrong = [torch.tensor([[5.0, 0.0, 0.0]])]  # a fault: far off at once
    drift = logit_drift(e[:1], wrong, [[1]], [[0]])
    assert drift["logits_rel_err_per_step"][0] > 1


def test_step_names_and_token_splits():
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    sys.path.insert(0, str(ROOT / "benchmarks" / "plots"))
    from gpu_e2e import split_tokens
    from plot_e2e import parse_step, step_label, step_name

    for kind, n, m in (("decode", 8, 1), ("extend", 512, 1), ("extend", 2048, 16), ("mixed", 2048, 32)):
        assert parse_step(step_name(kind, n, m)) == (kind, n, m)
    assert step_name("extend", 512, 1) == "extend_t512"  # the key of the runs before the request count
    assert step_label("extend_t512_r4") == "extend 512 (4 requests)"
    assert split_tokens(32, 3) == [12, 10, 10] and split_tokens(2048, 16) == [128] * 16


def test_dry_run_then_plot(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e2e"
    cmd = [sys.executable, "benchmarks/serving/gpu_e2e.py", "--dry-run", "--out", str(out), "--families", "qwen3_next",
           "--batches", "1,2", "--extends", "32", "--extend-requests", "1,3,16", "--mixed-batches", "1,2",
           "--iters", "1", "--new-tokens", "2", "--hf-new-tokens", "3",
           "--skip", ",".join(sorted(SKIPPED))]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((out / "gpu_e2e.json").read_text())
    assert {"date", "torch", "device", "command", "copy", "families"} <= set(doc)
    assert doc["stages"]["copy_bandwidth"]["status"] == "ok"
    rec = doc["families"]["qwen3_next"]
    status = {name: s["status"] for name, s in rec["stages"].items()}
    assert {n for n, s in status.items() if s != "ok"} == SKIPPED, status
    assert len(status) == 15, status

    timings = rec["timings_ms"]
    extends, mixed = {"extend_t32", "extend_t32_r3", "extend_t32_r16"}, {"mixed_t32_b1", "mixed_t32_b2"}
    assert set(timings) == {"decode_b1", "decode_b2"} | extends | mixed
    for step in ("decode_b1", "decode_b2"):
        assert {"eager", "full_graph", "full_graph_loop", "piecewise", "floor", "hf_eager"} <= set(timings[step])
    for step in extends:
        assert {"eager", "piecewise", "hf_eager"} <= set(timings[step])
        gaps = rec["extend_eager_gaps"][step[len("extend_t"):]]
        seqs = 1 if step == "extend_t32" else 16  # one request replays the bucket's one-row key
        assert 0 < gaps["fraction"] < 1 and gaps["key"] == f"extend[tokens=32, seqs={seqs}]"
    assert rec["transformers"]["prefill_batches"]["extend_t32_r3"] == {"rows": 3, "row_tokens": 12, "padding_tokens": 4}
    assert rec["transformers"]["prefill_batches"]["extend_t32_r16"]["padding_tokens"] == 0
    for step in mixed:
        m, B = rec["mixed"][step], int(step[len("mixed_t32_b"):])
        assert {"eager", "piecewise"} <= set(timings[step]) and 0 < m["fraction"] < 1
        # the engine's budget: B decodes and a chunk of 32 - B tokens fill the 32-token extend bucket
        assert m["chunk_tokens"] == 32 - B and m["key"] == "extend[tokens=32, seqs=16]"
        assert m["decode_alone"]["key"] == f"decode[tokens={B}, seqs={B}]" and m["alone_ms"] > 0
    assert rec["floor"]["2"]["bytes"] > rec["floor"]["1"]["bytes"] > 0
    assert rec["load_capture_s"] >= rec["load_s"] > 0
    tokens = rec["tokens_graph_vs_eager"]
    assert tokens["mismatched"] == 0 and tokens["eager_top2_gap_at_first_diff"] is None
    assert len(tokens["logits_rel_err_per_step"]) == 2 and max(tokens["logits_rel_err_per_step"]) < 1e-5
    profile = rec["profile"]
    assert set(profile) == {"decode_b1_full_graph", "decode_b1_eager", "extend_t32_piecewise"}
    assert all(p["host_issue_ms"] > 0 and p["top_host_ops"] for p in profile.values())
    assert rec["transformers"]["loading_info"]["missing_keys"] == []
    targets = {t["target"]: t for t in rec["targets"]}
    assert [t["target"] for t in rec["targets"]][:2] == ["decode B=1: eager / full graph",
                                                          "decode B=1: full graph / floor"]
    for name in ("extend 32: eager gaps / step", "extend 32 (16 requests): eager gaps / step",
                 "extend 32 (3 requests): transformers prefill / ours piecewise"):
        assert targets[name]["value"] is not None, targets[name]

    png = out / "e2e.png"
    plot = [sys.executable, "benchmarks/plots/plot_e2e.py", str(out / "gpu_e2e.json"), "--md", str(out / "e2e.md")]
    if importlib.util.find_spec("matplotlib") is not None:  # CI installs the test extra only
        plot += ["--png", str(png)]
    run = subprocess.run(plot, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (out / "e2e.md").read_text()
    assert "| decode B=1 |" in text and "| extend 32 |" in text and "load+capture" in text
    for row in ("| extend 32 (16 requests) |", "| mixed 32 (1 decode), chunk 31 |",
                "| mixed 32 (2 decodes), chunk 30 |"):
        assert row in text, row
    assert png.exists() == ("--png" in plot)
