"""benchmarks/probes/grouped_mm_probe.py --dry-run on the CPU (Triton's interpreter, tiny dims): the fused
MoE's expert GEMMs, the grouped-GEMM path and the split down (`down=split`: the routed experts' grouped GEMM on
w2 as it is, the shared expert's dense GEMM, a combine through the sort's inverse map) on the same sorted
layout, each checked against the float32 reference, then timed piece by piece."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "grouped_mm_probe.py"


def test_dry_run_checks_both_paths_then_times_every_piece(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--tokens", "16"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads((tmp_path / "grouped_mm_probe.json").read_text())["rows"]
    checks = row["checks"]
    assert checks["ok"] and checks["grouped_vs_ours"] < 3e-2 and checks["split_vs_ours"] < 3e-2, checks
    assert row["sorted_rows"] % row["BLOCK_M"] == 0 and row["sorted_rows"] >= row["pairs"]
    # ours at the runtime's tiles: no tuned table for the CPU, so default_config's, as fused_moe takes them
    assert row["config_source"] == "default" and row["config"]["gate_up"]["BLOCK_M"] == row["BLOCK_M"]
    assert set(row["us"]) == {"ours_gate_up", "ours_down", "gather", "grouped_gate_up", "act", "grouped_down",
                              "scatter", "ours_all", "grouped_all", "ours_down_combine", "split_gate_up", "split_down",
                              "split_combine", "split_down_combine", "split_all"}
    assert all(v > 0 for v in row["us"].values()), row["us"]
