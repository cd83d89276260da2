"""benchmarks/kernels/gqa_extend_sweep.py --dry-run on the CPU (Triton's interpreter, tiny dims): each split
count and key tile of the varlen GQA kernel, and both its grids, checked against the causal reference
before it is timed, alone and in a bucket laid out for more requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "kernels" / "gqa_extend_sweep.py"


def test_dry_run_checks_every_variant_then_times_it(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--replays", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gqa_extend_sweep.json").read_text())
    assert [(r["requests"], r["seqs"]) for r in doc["rows"]] == [([24], 1), ([8, 8], 2), ([24], 6)]
    for row in doc["rows"]:
        # every split and tile of a step alone; in a bucket of more request rows, the default's two grids
        names = {"splits=auto block_n=32", "flat splits=auto block_n=32"}
        assert len(row["variants"]) == (3 if row["seqs"] == len(row["requests"]) else 2) and names <= set(row["variants"])
        for name, cell in row["variants"].items():
            assert cell["ok"] and cell["rel_err"] < 1e-4 and cell["us"] > 0, (name, cell)


def test_tiles_dry_run_checks_every_program_tile_then_times_it(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--tiles", "--out", str(tmp_path),
                           "--replays", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "gqa_extend_sweep.json").read_text())
    assert [(r["requests"], r["seqs"]) for r in doc["rows"]] == [([24], 1), ([8, 8], 2)]  # steps alone only
    for row in doc["rows"]:
        tiled = [n for n in row["variants"] if "block_m=" in n]
        # two program tiles, each at the default's split count and four splits, beside the default's two grids
        assert sorted(tiled) == sorted(f"splits={s} block_n=32 block_m={m} warps={w} stages={st}"
                                       for m, w, st in ((16, 4, 2), (32, 2, 1)) for s in ("auto", 4)), tiled
        assert len(row["variants"]) == len(tiled) + 2
        for name, cell in row["variants"].items():
            assert cell["ok"] and cell["rel_err"] < 1e-4 and cell["us"] > 0, (name, cell)
