"""benchmarks/kernels/gemv_bench.py --dry-run on the CPU (Triton's interpreter, tiny shapes): every
(shape, M) is checked before any is timed, the sweep keeps a best config per (shape, M) with torch's
time beside it, the meta model's projection shapes are listed, and the table entries and the markdown
are written. In a fresh process: the script sets TRITON_INTERPRET before triton is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "gemv_bench.py"

pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")


def test_dry_run_checks_then_sweeps_every_shape(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--rows", "1,3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gemv_bench.json").read_text())
    assert doc["env"]["dry_run"] and doc["rows"] == [1, 3]
    # the bench model's projections: GDN in/out, attention qkv/o, the MTP fc, and the lm head
    assert {(n, k) for _, n, k in doc["model_shapes"]} >= {(12352, 2048), (9216, 2048), (2048, 4096), (151936, 2048)}
    assert len(doc["check"]) == 2 * len(doc["shapes"]) and all(c["ok"] for c in doc["check"])
    assert [(r["N"], r["M"]) for r in doc["results"]] == [(48, 1), (70, 1), (48, 3), (70, 3)]
    for r in doc["results"]:
        assert not r["failed"] and not r["errors"] and len(r["tried"]) >= 3
        assert r["us"] > 0 and r["torch_us"] > 0 and r["ratio"] > 0 and r["pct_copy"] > 0
        assert r["torch_kernels"] is None  # no profiler off the GPU
    # a table entry per (shape, bucket) whose best config beat torch by the bench's margin, none other
    # (the interpreter's wall times lose to torch: the dry run's table is usually empty)
    wins = {(r["N"], r["K"], r["bucket"]) for r in doc["results"] if r["ratio"] >= doc["win"]}
    assert len(doc["table_entries"]) == len(wins)
    assert all(f"({n}, {k}, {b}): GemvConfig(" in "\n".join(doc["table_entries"]) for n, k, b in wins)
    assert "| best config |" in (tmp_path / "gemv_bench.md").read_text()
