"""benchmarks/kernels/norm_gemv_bench.py --dry-run on the CPU (Triton's interpreter, tiny shapes): every
case's fused and unfused calls are checked against the CPU reference before either is timed, both
folds (the input norm's prologue, the post-attention norm's epilogue) at every M, and the table is
printed. In a fresh process: the script sets TRITON_INTERPRET before triton is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "norm_gemv_bench.py"

pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")


def test_dry_run_checks_then_times_both_folds(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--rows", "1,3", "--sweep"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "norm_gemv_bench.json").read_text())
    assert doc["env"]["dry_run"] and doc["rows"] == [1, 3]
    assert [(r["case"].split(":")[0], r["M"]) for r in doc["results"]] == [
        ("input norm", 1), ("input norm", 3), ("post-attention norm", 1), ("post-attention norm", 3)]
    for r in doc["results"]:
        for name in ("fused", "unfused"):
            check = r["check"][name]
            assert check["ok"] and check["out"] <= doc["tolerance"] and check["summed"] <= doc["tolerance"], r
            assert r[name]["us"] > 0 and r[name]["kernels"] is None  # no profiler off the GPU
        assert r["ratio"] > 0
    assert "post-attention norm: o_proj" in proc.stdout and "ratio" in proc.stdout
    for r in doc["results"]:
        runs = r["sweep"]["runs"]
        assert len(runs) == 2 and all(run["check"]["ok"] and run["us"] > 0 for run in runs), runs
        # one step of FMA at 1 row, DOT tiles from 4 rows (3 rows' bucket)
        assert all(("DOT=True" in run["config"]) == (r["M"] > 2) for run in runs), runs
        assert r["sweep"]["best"] in runs and r["sweep"]["ratio"] > 0
    assert "unfused/best" in proc.stdout
