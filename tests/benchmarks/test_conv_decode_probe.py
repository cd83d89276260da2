"""benchmarks/probes/conv_decode_probe.py on the CPU (interpreted, small): every variant of the decode conv
checked against the float64 step before it is timed, and the check catches a wrong history."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "conv_decode_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("conv_decode_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_checks_every_variant_then_times_it(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = json.loads((tmp_path / "conv_decode_probe.json").read_text())["batches"]["3"]
    variants = ("rows", "rows_last", "flat", "channels_last")
    timed = {k for k in row if k.startswith(tuple(f"{v}_" for v in variants))}
    assert timed == {f"{v}_{t}" for v in variants for t in ("32x1", "64x2")}, row
    for label in timed:
        assert row[label]["rel_err"] < 1e-2 and row[label]["us"] > 0, row


@pytest.mark.parametrize("variant", ["flat", "channels_last", "rows_last"])
def test_the_check_rejects_a_history_rolled_wrong(variant):
    probe = _probe()
    run, channels_last = probe.VARIANTS[variant]

    def unrolled(x, w, out, hist, slots, bc, warps):  # the outputs right, the history left as it was
        kept = hist.clone()
        run(x, w, out, hist, slots, bc, warps)
        hist.copy_(kept)

    with pytest.raises(SystemExit, match="rel err"):
        probe.check("broken", unrolled, channels_last, (32, 1), 3, probe.DRY_C, torch.device("cpu"),
                    torch.Generator().manual_seed(1))
