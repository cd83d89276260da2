"""benchmarks/kernels/gdn_norm_fold_bench.py --dry-run on the CPU (Triton's interpreter, tiny dims): both
ways of a fused GDN layer's gated norm (in the chunk output kernel, and its own launch after the
core) checked against the reference before either is timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "gdn_norm_fold_bench.py"


def test_dry_run_checks_both_ways_then_times_each_shape(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--replays", "1",
                           "--calls", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gdn_norm_fold_bench.json").read_text())
    check = doc["check"]
    assert check["ok"] and check["folded"] < 2e-2 and check["apart"] < 2e-2 and check["folded_vs_apart"] < 1e-2
    assert set(doc["rows"]) == {"1x64", "4x16"}
    for row in doc["rows"].values():
        assert row["apart"]["us"] > 0 and row["folded"]["us"] > 0 and row["folded_over_apart"] > 0
