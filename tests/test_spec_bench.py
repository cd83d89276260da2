"""benchmarks/spec_bench.py --dry-run on the CPU: every stage of the GPU run (verify against decode
step cost, full acceptance against plain decoding, greedy tokens with the real draft), on a tiny
model with the reference backend and tests/graph_cases.RerunGraphs for CUDA graphs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # five graph start-ups (the session's shared compile): about 10 s on 2 cores


def test_dry_run_measures_every_stage(tmp_path, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from spec_bench import main

    from tests.helpers import shared_artifact

    # init_compile finds the session's tiny qwen3_next there (its own names), compiled once for every module
    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent
    rec = main(["--dry-run", "--out", str(tmp_path), "--work", str(work)])
    assert json.loads((tmp_path / "spec_bench.json").read_text())["targets"] == rec["targets"]
    assert {name: s["status"] for name, s in rec["stages"].items()} == dict.fromkeys(
        ("init_compile", "step_cost", "full_acceptance", "greedy_equal"), "ok")
    assert set(rec["step_cost"]) == {"1", "2", "4"}
    assert rec["step_cost"]["1"]["verify_key"] == "target_verify[tokens=4, seqs=1, rows=4]"
    assert "target_verify" in rec["step_cost_runner"]["full_modes"]
    full = rec["full_acceptance"]
    assert full["same_tokens"] and full["speculative"]["acceptance_rate"] == 1.0
    assert full["speculative"]["tokens_per_verify"] == 4.0 and full["spec"]["steps"] < full["plain"]["steps"]
    assert rec["greedy_equal"]["equal"] and rec["greedy_equal"]["tokens"] == 4 * 8
    assert set(rec["targets"]) == {"verify_over_decode_b1", "full_acceptance_speedup", "greedy_equal"}
