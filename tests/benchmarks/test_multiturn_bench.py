"""benchmarks/serving/multiturn_bench.py --dry-run on the CPU: every stage of the GPU run, on a tiny model
with the reference backend and testkit/graph_cases.RerunGraphs for CUDA graphs, and what its JSON says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a graph start-up and a few short chats on the test run's shared compile


def test_dry_run_measures_every_turn_with_the_cache_on_and_off(tmp_path, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from multiturn_bench import main

    from testkit.helpers import shared_artifact

    # init_compile finds the test run's tiny qwen3_next there (its own names), compiled once for every module
    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent
    rec = main(["--dry-run", "--out", str(tmp_path), "--work", str(work)])
    assert json.loads((tmp_path / "multiturn_bench.json").read_text())["cache_on"] == rec["cache_on"]
    assert {name: s["status"] for name, s in rec["stages"].items()} == dict.fromkeys(
        ("init_compile", "engine", "warm_up", "short_prompt", "cache_off", "cache_on"), "ok")
    turns = rec["config"]["turns"]
    off, on = rec["cache_off"]["turns"], rec["cache_on"]["turns"]
    assert [t["turn"] for t in on] == [t["turn"] for t in off] == list(range(1, turns + 1))
    assert [t["prompt_tokens"] for t in on] == [t["prompt_tokens"] for t in off], "the same chats in both runs"
    assert all(t["cached_tokens"] == 0 and t["snapshot_bytes_in_use"] == 0 for t in off)
    assert on[0]["cached_tokens"] == 0 and on[-1]["cached_tokens"] > 0, "later turns reuse the conversation so far"
    assert all(0 <= t["hit_rate"] <= 1 and t["ttft_ms_p90"] >= t["ttft_ms_median"] > 0 for t in on + off)
    passes = rec["config"]["passes"]
    assert passes > 1 and rec["cache_on"]["passes"] == passes
    assert all(len(t["pass_medians_ms"]) == passes and min(t["pass_medians_ms"]) > 0 for t in on + off), \
        "each pass's median beside the pooled one"
    assert all(min(t["pass_medians_ms"]) <= t["ttft_ms_p90"] for t in on + off)
    assert on[-1]["snapshot_bytes_in_use"] > 0
    assert rec["same_outputs"] == 1.0, "float32 on the CPU: the cache changes no token"
    short = rec["short_prompt"]
    assert short["ttft_ms_median"] > 0 and short["decode_step_ms_median"] > 0
    assert any(k.startswith("extend[tokens=16") for k in rec["engine"]["keys"]), "the short prompt's bucket"
    assert set(rec["targets"]) == {"flat_ttft", "short_prompt"}
