"""benchmarks/probes/kernel_resources_probe.py on the CPU: a step's launches recorded under Triton's
interpreter and compiled for sm90 (no GPU), each with its resources and waves; two steps narrowed to
a few kernels, so that the test compiles five. In a fresh process: the script sets TRITON_INTERPRET
before triton is imported."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "probes" / "kernel_resources_probe.py"

pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")


def probe(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_steps_kernels_compile_for_sm90_with_their_resources_and_waves(tmp_path):
    proc = probe(tmp_path, "--steps", "decode1,extend512", "--kernels", "_gemv_kernel,_gate_up_sorted_kernel")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "kernel_resources.json").read_text())
    gemvs, (gate_up,) = doc["steps"]["decode1"], doc["steps"]["extend512"]
    # the projections' GEMVs at one row: the GDN input projection, GQA's q|k|v, the output projection, the head
    assert [g["programs"] for g in gemvs] == [12352, 9216, 1024, 151936], gemvs
    for row in gemvs + [gate_up]:
        assert row["registers"] > 0 and row["local_bytes"] == 0 and 1 <= row["programs_per_sm"] <= 32, row
        assert row["waves"] == round(row["programs"] / (row["programs_per_sm"] * doc["sms"]), 2), row
    for g in gemvs:  # element-wise float32 products: no tensor cores, no pipelined loads
        assert g["sass"]["HGMMA"] == 0 and g["sass"]["LDGSTS"] == 0 and g["sass"]["LDG"] > 0, g
    # the MoE's sorted gate|up GEMM at 512 tokens (the H200 table's 128 x 128 x 64 tile, 4 stages): on
    # Hopper's warpgroup tensor cores, its operand tiles pipelined through cp.async in shared memory
    assert gate_up["stages"] >= 2 and gate_up["sass"]["HGMMA"] > 0 and gate_up["sass"]["LDGSTS"] > 0, gate_up
    assert gate_up["constants"]["BLOCK_M"] == 128 and gate_up["shared_bytes"] >= 2 * 128 * 64 * 2, gate_up
    assert gate_up["programs"] == math.prod(gate_up["grid"])
    assert "_gate_up_sorted_kernel" in proc.stdout and "HGMMA" in proc.stdout


def test_an_unknown_step_is_refused(tmp_path):
    proc = probe(tmp_path, "--steps", "decode1,prefill")
    assert proc.returncode == 2 and "--steps: unknown ['prefill']" in proc.stderr, proc.stderr
    assert not (tmp_path / "kernel_resources.json").exists()


def test_the_output_gate_is_one_variant_at_every_step(tmp_path):
    """The gate kernel (`hgc build --sigmoid-gate`) compiles to the same constants at one decode row
    and at 512 prompt tokens (its tile is fixed), without spills, its loads 16-byte vectors."""
    proc = probe(tmp_path, "--steps", "decode1,extend512", "--kernels", "_sigmoid_gate_kernel")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "kernel_resources.json").read_text())
    (one,), (many,) = doc["steps"]["decode1"], doc["steps"]["extend512"]
    assert one["constants"] == many["constants"] and one["local_bytes"] == many["local_bytes"] == 0
    # [16 tokens, 256 channels] of two bf16 inputs on 128 threads: 32 elements, four 16-byte loads each
    assert one["sass"]["LDG"] == 8 and one["sass"]["STG"] == 4, one["sass"]
