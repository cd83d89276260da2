"""benchmarks/probes/rotary_glue_probe.py --dry-run on the CPU (C++ kernels and the interpreted Triton kernel,
tiny dims): a GQA layer's norms and rotary compiled with each form of the NeoX rotation, and through
qk_norm_rope, each checked against the float64 reference, then timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "rotary_glue_probe.py"


def test_dry_run_checks_every_form_then_times_it(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--replays", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads((tmp_path / "rotary_glue_probe.json").read_text())["rows"]
    for form in ("nested", "one_cat", "kernel"):
        assert row[form]["ok"] and row[form]["rel_err"] < 1e-2 and row[form]["us"] > 0, row
