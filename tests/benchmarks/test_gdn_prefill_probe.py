"""benchmarks/probes/gdn_prefill_probe.py --dry-run on the CPU: our chunk kernels (Triton's interpreter, tiny
dims) and the stand-in for FlashInfer's GDN prefill, each checked against the reference recurrence from non-zero
states, the stand-in's state layout found among the two readings, the kept-workspace launch on strided values
giving the plain launch's bits, then each path timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "gdn_prefill_probe.py"


def test_dry_run_checks_both_kernels_finds_the_state_layout_then_times_them(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--cases", "2x24"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads((tmp_path / "gdn_prefill_probe.json").read_text())["rows"]
    checks = row["checks"]
    assert checks["ours_ok"] and checks["ours_out"] < 1e-4 and checks["ours_state"] < 1e-4, checks
    # the stand-in keeps FlashInfer's documented [Dv, Dk] states: the other reading must not pass
    assert checks["flashinfer_layout"] == "dv_dk", checks
    assert checks["flashinfer"]["dk_dv"]["state"] > 0.1, checks
    assert checks["lean_same_bits"], checks
    assert set(row["us"]) == {"ours", "flashinfer_kernel", "flashinfer_route", "flashinfer_lean"}
    assert all(v > 0 for v in row["us"].values())
    assert row["capture_failed"] == {} and row["route_over_ours"] > 0 and row["lean_over_ours"] > 0


def test_a_case_that_is_not_requests_by_tokens_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    # refused before any kernel runs: the script's main in this process (its interpreter already chosen)
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gdn_prefill_probe import main

    with pytest.raises(SystemExit) as exit_:
        main(["--dry-run", "--out", str(tmp_path), "--cases", "4096"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--cases: '4096' is not REQUESTSxTOKENS" in err, err


def test_the_build_command_takes_flashinfers_headers_from_the_package_python_finds(tmp_path):
    """--build-command prints nvcc over csrc/gdn_prefill_sm90.cu against the importable FlashInfer's
    data folder (a stand-in package here), sm90a, and the library path the probe loads."""
    import os

    (tmp_path / "flashinfer" / "data").mkdir(parents=True)
    (tmp_path / "flashinfer" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--build-command"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[0] == "nvcc" and "-gencode=arch=compute_90a,code=sm_90a" in words
    assert f"-I{tmp_path / 'flashinfer' / 'data' / 'csrc'}" in words
    assert words[-1].endswith("csrc/gdn_prefill_sm90.cu") and words[-2].endswith("libhgc_gdn_prefill_sm90.so")
