"""benchmarks/kernels/gdn_fused_bench.py --dry-run on the CPU (Triton's interpreter, tiny dims, eager glue):
every batch is checked (each fused variant against unfused) before it is timed, and the JSON holds every
variant and the ratios. In a fresh process: the script sets TRITON_INTERPRET before triton is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "gdn_fused_bench.py"

pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")


def test_dry_run_checks_then_times_every_variant(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--batches", "1,3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gdn_fused_bench.json").read_text())
    assert doc["env"]["dry_run"] and set(doc["batches"]) == {"1", "3"}
    for row in doc["batches"].values():
        assert row["check"]["ok"], row["check"]
        variants = row["check"]["variants"]
        assert set(variants) == {"fused", "fused_2", "fused_2v", "fused_1v", "fused_1v_early", "fused_4"}
        assert all(set(v["rel_err"]) == {"out", "conv", "recurrent"} for v in variants.values())
        assert all(row[name]["us"] > 0 for name in ("unfused", "fused", "fused_2", "fused_2v", "fused_1v",
                                                    "fused_1v_early", "fused_4"))
        assert all(row[f"ratio{n}"] > 0 for n in ("", "_2", "_2v", "_1v", "_1v_early", "_4"))
        # the dry run's Dv 64 in the default value blocks (the interpreter's stand-in SM count): two of 32 columns
        assert row["check"]["v_blocks"] == 2
        assert set(row["fused_by_warps"]) == {"8", "16"} and all(t > 0 for t in row["fused_by_warps"].values())
        assert row["fused"]["kernels"] is None  # no profiler off the GPU
