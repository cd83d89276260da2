"""benchmarks/kernels/chunk_kernel_sweep.py --dry-run on the CPU (Triton's interpreter, tiny dims): each config
is checked against the recurrence before it is timed, unknown config names are refused, and --quick narrows the
run to GDN. The dry runs in a fresh process: the script sets TRITON_INTERPRET before triton is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "chunk_kernel_sweep.py"

pytest.importorskip("triton", reason="triton is not importable here (it ships Linux wheels only)")


DRY_CONFIGS = {"default", "f32-dots", "tiles 16", "solve scratch"}


def sweep(tmp_path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_dry_run_checks_then_times_each_config(tmp_path):
    proc = sweep(tmp_path, "--families", "gdn,lightning", "--shapes", "32x2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "chunk_kernel_sweep.json").read_text())
    for family in ("gdn", "lightning"):
        fam = doc["families"][family]
        assert set(fam["checks"]) == DRY_CONFIGS
        assert all(c["ok"] and c["out_rel_err"] < 1e-2 for c in fam["checks"].values()), fam["checks"]
        (row,) = fam["timings"]
        assert (row["tokens"], row["requests"]) == (32, 2) and set(row["ours"]) == DRY_CONFIGS
        assert all(t["wall_ms"] > 0 for t in row["ours"].values())
        assert row["ours"]["tiles 16"]["config"]["block_v"] == 16
        assert row["summary"]["best"] in DRY_CONFIGS and row["summary"]["default_ms"] > 0


def test_unknown_config_names_are_refused(tmp_path, monkeypatch, capsys):
    # refused before any kernel runs: the script's main in this process (its interpreter already chosen)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "kernels"))
    import chunk_kernel_sweep

    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--configs", "default,fastest"])
    with pytest.raises(SystemExit) as exit_:
        chunk_kernel_sweep.main()
    assert exit_.value.code == 2 and "--configs: unknown ['fastest']" in capsys.readouterr().err


def test_quick_dry_run_takes_gdn_at_every_dry_shape(tmp_path):
    # one config: the families and shapes --quick takes are the point (the test above checks every config)
    proc = sweep(tmp_path, "--quick", "--configs", "default")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "chunk_kernel_sweep.json").read_text())
    assert set(doc["families"]) == {"gdn"}
    assert [(r["tokens"], r["requests"]) for r in doc["families"]["gdn"]["timings"]] == [(64, 1), (64, 4)]


def test_the_gpu_run_names_its_quick_configs_and_the_target_shapes():
    """Checked in a fresh process without running anything: the module imports triton compiled."""
    code = ("import sys; sys.argv = ['x']; sys.path.insert(0, 'benchmarks/kernels'); import chunk_kernel_sweep as s; "
            "assert set(s.QUICK_CONFIGS) <= set(s.configs(False)), s.QUICK_CONFIGS; "
            "assert s.SHAPES == [(512, 1), (2048, 1), (4096, 1), (4096, 4), (4096, 16)], s.SHAPES")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_short_dry_run_times_the_buckets_steps_and_the_conv(tmp_path):
    """--short: each candidate checked at every shape's chunk length, then timed as the bucket's graph
    runs the step (its chunk length by default: 16 rows for the 16-row bucket, 32 for 32); then the
    extend conv's tiles in both layouts, each checked against the float32 conv before it is timed,
    beside a plain copy of the same bytes."""
    proc = sweep(tmp_path, "--short", "--families", "gdn", "--configs", "default,chunk 64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "chunk_kernel_sweep.json").read_text())
    fam = doc["families"]["gdn"]
    assert all(c["ok"] for c in fam["checks"].values()), fam["checks"]
    rows = {(r["tokens"], r["requests"]): r["ours"] for r in fam["timings"]}
    assert set(rows) == {(16, 1), (32, 2)}
    assert rows[(16, 1)]["default"]["block_t"] == 16 and rows[(32, 2)]["default"]["block_t"] == 32
    assert rows[(32, 2)]["chunk 64"]["block_t"] == 64 and rows[(32, 2)]["default"]["bucket_seqs"] == 32
    assert rows[(16, 1)]["default"]["config"]["solve_col_tiles"] >= 1
    assert set(doc["conv"]) == {"16x1", "32x2"}
    assert all(c["ok"] and c["wall_ms"] > 0 for row in doc["conv"].values() for c in row.values()), doc["conv"]
    for shape, row in doc["conv"].items():
        assert {"default", "rows default", "rows c256 w1", "copy (copy-rate reference)"} <= set(row)
        assert row["rows default"]["config"] == {"block_c": 32, "num_warps": 1, "rows": True}  # 24 channels
        # a bucket of 16 or 32 request rows fills one block of its table's 18 or 34: the backend takes rows
        assert row["default"]["config"] == row["rows default"]["config"] and row["rows default"]["rel_err"] < 1e-2
        assert not row["one request"]["config"]["rows"]
        tokens = int(shape.split("x")[0])
        assert row["copy (copy-rate reference)"]["bytes"] == 2 * tokens * 24 * 2  # bf16 x read, out written


def test_short_dry_run_checks_and_times_the_walking_grids_over_padded_tables(tmp_path):
    """--short's PER_SM candidates: each checked over a padded table of the bucket's request rows (with
    no floor on the programs an SM the kernels walk it; "a program a row" launches one a row), then
    timed over the bucket's own table, the count it ran at kept with its timing."""
    proc = sweep(tmp_path, "--short", "--families", "gdn", "--configs", "default,a program a row,walk 0 an SM",
                 "--shapes", "16x1", "--bucket-seqs", "16")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "chunk_kernel_sweep.json").read_text())
    fam = doc["families"]["gdn"]
    assert set(fam["checks"]) == {"default", "a program a row", "walk 0 an SM"}
    assert all(c["ok"] for c in fam["checks"].values()), fam["checks"]
    (row,) = fam["timings"]
    assert row["ours"]["walk 0 an SM"]["programs_an_sm"] == 0 and row["ours"]["walk 0 an SM"]["bucket_seqs"] == 16
    assert row["ours"]["a program a row"]["programs_an_sm"] == 10 ** 9
