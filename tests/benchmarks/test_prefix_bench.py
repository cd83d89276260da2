"""benchmarks/serving/prefix_bench.py --dry-run on the CPU: every stage of the GPU run, on a tiny model with
the reference backend and testkit/graph_cases.RerunGraphs for CUDA graphs, and what its JSON says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a graph start-up on the test run's shared compile: a few seconds on 2 cores


def test_dry_run_measures_hit_and_miss(tmp_path, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from prefix_bench import main

    from testkit.helpers import shared_artifact

    # init_compile finds the test run's tiny qwen3_next there (its own names), compiled once for every module
    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent
    rec = main(["--dry-run", "--out", str(tmp_path), "--work", str(work), "--iters", "1"])
    assert json.loads((tmp_path / "prefix_bench.json").read_text())["hit"] == rec["hit"]
    assert {name: s["status"] for name, s in rec["stages"].items()} == dict.fromkeys(
        ("init_compile", "engine", "warm_up", "miss_no_cache", "miss_cache", "hit", "hit_timeline", "snapshot_copy"), "ok")
    assert rec["engine"]["graphs"] and rec["graph_counters"]["piecewise_steps"] > 0
    prefix, suffix = rec["config"]["prefix"], rec["config"]["suffix"]
    assert (rec["miss_no_cache"]["cached_tokens"], rec["miss_no_cache"]["prefilled_tokens"]) == (0, prefix + suffix)
    assert rec["miss_cache"]["prefilled_tokens"] == prefix + suffix
    assert (rec["hit"]["cached_tokens"], rec["hit"]["prefilled_tokens"], rec["hit"]["steps"]) == (prefix, suffix, 1)
    assert rec["hit"]["same_first_token"]
    assert rec["snapshot_copy"]["bytes"] > 0 and rec["snapshot_copy"]["ms"] > 0
    assert set(rec["targets"]) == {"hit_speedup", "snapshot_overhead"}
