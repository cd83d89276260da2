"""benchmarks/kernels/gdn_folds_bench.py --dry-run on the CPU (Triton's interpreter, tiny dims): both
ways of each of a fused GDN layer's folds (the q / k norm and gates in the conv's launch, the gated
norm in the chunk output kernel; at decode, the layer with its conv's and recurrence's folds) checked
against the CPU reference before either is timed, and an unknown fold refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "gdn_folds_bench.py"


def run(tmp_path, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--replays", "1",
                           "--calls", "1", *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_dry_run_checks_both_ways_of_each_fold_then_times_each_shape(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gdn_folds_bench.json").read_text())
    assert set(doc["folds"]) == {"qk", "norm", "decode"}
    qk, norm, decode = (doc["folds"][f]["check"] for f in ("qk", "norm", "decode"))
    assert qk["ok"] and max(qk["folded"].values()) < 1e-2 and max(qk["apart"].values()) < 1e-2
    assert set(qk["folded"]) == {"q", "k", "g", "beta"} and qk["folded_vs_apart"] < 1e-2
    assert norm["ok"] and norm["folded"] < 2e-2 and norm["apart"] < 2e-2 and norm["folded_vs_apart"] < 1e-2
    assert decode["ok"] and decode["folded"] < 4e-2 and decode["apart"] < 4e-2 and decode["folded_vs_apart"] < 1e-2
    for name in ("qk", "norm"):
        rows = doc["folds"][name]["rows"]
        assert set(rows) == {"1x64", "4x16"}
        for row in rows.values():
            assert row["apart"]["us"] > 0 and row["folded"]["us"] > 0 and row["folded_over_apart"] > 0
    decode_rows = doc["folds"]["decode"]["rows"]
    assert set(decode_rows) == {"8"} and all(decode_rows["8"][w]["wall_us"] > 0 for w in ("apart", "folded"))


def test_an_unknown_fold_is_refused(tmp_path):
    proc = run(tmp_path, "--folds", "qk,conv")
    assert proc.returncode == 2 and "--folds: unknown ['conv']" in proc.stderr
