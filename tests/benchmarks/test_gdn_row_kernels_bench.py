"""benchmarks/kernels/gdn_row_kernels_bench.py --dry-run on the CPU (Triton's interpreter, tiny dims): the
fused GDN op's two row kernels at each block size checked against the mixer's torch ops before they are
timed, and a bad block size refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "gdn_row_kernels_bench.py"


def run(tmp_path, *extra):
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--replays", "1",
                           "--calls", "1", *extra], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_dry_run_checks_every_block_size_then_times_it(tmp_path):
    proc = run(tmp_path, "--tokens", "19", "--block-rows", "1,8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gdn_row_kernels_bench.json").read_text())
    row = doc["rows"]["19"]
    assert row["check_ok"] and set(row["check"]) == {"1", "8"}
    for errs in row["check"].values():
        assert set(errs) == {"q", "k", "g", "beta", "norm"} and max(errs.values()) < 1e-2, errs
    for name in ("qk_gates", "gated_rmsnorm"):
        assert set(row[name]) == {"1", "8"} and all(cell["us"] > 0 for cell in row[name].values())


def test_a_block_size_that_is_no_power_of_two_is_refused(tmp_path, monkeypatch, capsys):
    # refused before any kernel runs: the script's main in this process (its interpreter already chosen)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gdn_row_kernels_bench import main

    with pytest.raises(SystemExit) as exit_:
        main(["--dry-run", "--out", str(tmp_path), "--replays", "1", "--calls", "1", "--block-rows", "1,12"])
    assert exit_.value.code == 2 and "--block-rows: [12] are not powers of two" in capsys.readouterr().err
