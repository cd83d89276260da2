"""benchmarks/probes/decode_walk_probe.py on the CPU: the walking GDN decode recurrence compiled for sm90
over float32 and bfloat16 states at 1, 2 and 3 stages; from 2 stages its state loads are cp.async
(Triton pipelined them), at 1 they are plain loads, and nothing spills."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "decode_walk_probe.py"

pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")


def test_the_walk_pipelines_its_state_loads_from_two_stages(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "decode_walk_probe.json").read_text())["rows"]
    assert {(r["state"], r["stages"]) for r in rows} == {(s, n) for s in ("*fp32", "*bf16") for n in (1, 2, 3)}
    for r in rows:
        assert r["spill_bytes"] == 0 and r["programs_per_sm"] >= 2, r
        assert (r["LDGSTS"] > 0) == (r["stages"] > 1), r
