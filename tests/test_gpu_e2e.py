"""benchmarks/gpu_e2e.py --dry-run on the CPU: every stage of the GPU run's bookkeeping, then plot_e2e.py.

The dry run uses the CPU reference backend and tests/graph_cases.RerunGraphs for CUDA graphs, at
qwen3_next tiny with two decode batches and one extend size. torch.compile and transformers'
static-cache generate compile with inductor's C++ backend on a CPU (tens of seconds each), so they
are skipped here; a dry run by hand runs them (see the script's docstring).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED = {"torch_compile", "hf_static"}

pytestmark = pytest.mark.slow


def test_logit_drift_tells_a_fault_from_a_near_tie():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from gpu_e2e import logit_drift

    e = [torch.tensor([[0.0, 1.0, 0.99]]), torch.tensor([[2.0, 0.0, 1.999]])]
    near = [e[0] * (1 + 1e-3), torch.tensor([[1.999, 0.0, 2.0]])]  # rounding flips a near-tie at step 1
    drift = logit_drift(e, near, [[1, 0]], [[1, 2]])
    assert drift["logits_rel_err_per_step"][0] < 2e-3 and len(drift["logits_rel_err_per_step"]) == 2
    assert drift["eager_top2_gap_at_first_diff"] == pytest.approx(1e-3, rel=1e-2)
    wrong = [torch.tensor([[5.0, 0.0, 0.0]])]  # a fault: far off at once
    drift = logit_drift(e[:1], wrong, [[1]], [[0]])
    assert drift["logits_rel_err_per_step"][0] > 1


def test_dry_run_then_plot(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "e2e"
    cmd = [sys.executable, "benchmarks/gpu_e2e.py", "--dry-run", "--out", str(out), "--families", "qwen3_next",
           "--batches", "1,2", "--extends", "32", "--iters", "1", "--new-tokens", "2", "--hf-new-tokens", "3",
           "--skip", ",".join(sorted(SKIPPED))]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((out / "gpu_e2e.json").read_text())
    assert {"date", "torch", "device", "command", "copy", "families"} <= set(doc)
    assert doc["stages"]["copy_bandwidth"]["status"] == "ok"
    rec = doc["families"]["qwen3_next"]
    status = {name: s["status"] for name, s in rec["stages"].items()}
    assert {n for n, s in status.items() if s != "ok"} == SKIPPED, status
    assert len(status) == 14, status

    timings = rec["timings_ms"]
    assert set(timings) == {"decode_b1", "decode_b2", "extend_t32"}
    for step in ("decode_b1", "decode_b2"):
        assert {"eager", "full_graph", "full_graph_loop", "piecewise", "floor", "hf_eager"} <= set(timings[step])
    assert {"eager", "piecewise", "hf_eager"} <= set(timings["extend_t32"])
    assert 0 < rec["extend_eager_gaps"]["32"]["fraction"] < 1
    assert rec["floor"]["2"]["bytes"] > rec["floor"]["1"]["bytes"] > 0
    assert rec["load_capture_s"] >= rec["load_s"] > 0
    tokens = rec["tokens_graph_vs_eager"]
    assert tokens["mismatched"] == 0 and tokens["eager_top2_gap_at_first_diff"] is None
    assert len(tokens["logits_rel_err_per_step"]) == 2 and max(tokens["logits_rel_err_per_step"]) < 1e-5
    profile = rec["profile"]
    assert set(profile) == {"decode_b1_full_graph", "decode_b1_eager", "extend_t32_piecewise"}
    assert all(p["host_issue_ms"] > 0 and p["top_host_ops"] for p in profile.values())
    assert rec["transformers"]["loading_info"]["missing_keys"] == []
    assert [t["target"] for t in rec["targets"]][:2] == ["decode B=1: eager / full graph",
                                                          "decode B=1: full graph / floor"]

    png = out / "e2e.png"
    plot = [sys.executable, "benchmarks/plot_e2e.py", str(out / "gpu_e2e.json"), "--md", str(out / "e2e.md")]
    if importlib.util.find_spec("matplotlib") is not None:  # CI installs the test extra only
        plot += ["--png", str(png)]
    run = subprocess.run(plot, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (out / "e2e.md").read_text()
    assert "| decode B=1 |" in text and "| extend 32 |" in text and "load+capture" in text
    assert png.exists() == ("--png" in plot)
