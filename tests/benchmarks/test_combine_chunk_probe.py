"""benchmarks/probes/combine_chunk_probe.py --dry-run on the CPU (interpreted, small steps): the split-KV
combine at every chunk of partials, each checked against the float64 merge, then timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "combine_chunk_probe.py"


def test_dry_run_checks_every_chunk_then_times_it(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "combine_chunk_probe.json").read_text())
    assert set(doc["steps"]) == {"decode_1", "extend_8"}
    assert doc["steps"]["decode_1"]["in_use"] == 32 and doc["steps"]["extend_8"]["in_use"] == 4
    for row in doc["steps"].values():
        for chunk in (4, 8, 16, 32):
            assert row[f"chunk_{chunk}"]["rel_err"] < 1e-2 and row[f"chunk_{chunk}"]["us"] > 0, row


def test_launches_dry_run_checks_every_launch_then_times_it(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--launches", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "combine_chunk_probe.json").read_text())
    for row in doc["steps"].values():
        timed = {k: v for k, v in row.items() if k.startswith("heads_")}
        assert set(timed) == {"heads_1_warps_4", "heads_4_warps_1"}, row
        for cell in timed.values():
            assert cell["rel_err"] < 1e-2 and cell["us"] > 0, row
