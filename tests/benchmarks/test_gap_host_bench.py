"""benchmarks/host/gap_host_bench.py on the CPU, few calls, in a process of its own (it stubs every
Triton launch out for the rest of its process): both timings recorded, and a baseline ref's beside."""

from __future__ import annotations

import json
import subprocess
import sys

from testkit.helpers import ROOT


def test_the_layer_gap_and_a_launcher_hit_are_timed_with_a_baseline(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/host/gap_host_bench.py"), "--out", str(tmp_path),
                           "--iterations", "20", "--reps", "2", "--baseline-ref", "HEAD"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "gap_host_bench.json").read_text())
    for r in (rec, rec["baseline"]):
        assert 0 < r["layer_gap_us"]["min_us"] <= r["layer_gap_us"]["median_us"] < 1e5
        assert 0 < r["launcher_hit_us"]["median_us"] < 1e4
    assert rec["baseline"]["code"].endswith("baseline-src") and "baseline" not in rec["baseline"]
    assert "layer gap:" in proc.stdout
