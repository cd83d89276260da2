"""benchmarks/kernels/gdn_extend_folds_bench.py --dry-run on the CPU (Triton's interpreter, tiny dims): both
ways of each of a fused GDN layer's extend folds (the q / k norm and gates in the conv's launch, the gated
norm in the chunk output kernel) checked against the CPU reference before either is timed, and an
unknown fold refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "gdn_extend_folds_bench.py"


def run(tmp_path, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--replays", "1",
                           "--calls", "1", *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_dry_run_checks_both_ways_of_each_fold_then_times_each_shape(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gdn_extend_folds_bench.json").read_text())
    assert set(doc["folds"]) == {"qk", "norm"}
    qk, norm = doc["folds"]["qk"]["check"], doc["folds"]["norm"]["check"]
    assert qk["ok"] and max(qk["folded"].values()) < 1e-2 and max(qk["apart"].values()) < 1e-2
    assert set(qk["folded"]) == {"q", "k", "g", "beta"} and qk["folded_vs_apart"] < 1e-2
    assert norm["ok"] and norm["folded"] < 2e-2 and norm["apart"] < 2e-2 and norm["folded_vs_apart"] < 1e-2
    for fold in doc["folds"].values():
        assert set(fold["rows"]) == {"1x64", "4x16"}
        for row in fold["rows"].values():
            assert row["apart"]["us"] > 0 and row["folded"]["us"] > 0 and row["folded_over_apart"] > 0


def test_an_unknown_fold_is_refused(tmp_path):
    proc = run(tmp_path, "--folds", "qk,conv")
    assert proc.returncode == 2 and "--folds: unknown ['conv']" in proc.stderr
