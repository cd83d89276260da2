"""benchmarks/serving/offline_bench.py --dry-run on the CPU: every run of the GPU benchmark on a tiny
model, issue 53's hgc serve against hgc run measure, and whether the report's counts add up."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks.serving.serve_bench import DRY
from benchmarks.serving.offline_bench import SERVE_VS_RUN, busy_seconds, main

pytestmark = pytest.mark.slow  # the engine, a server and an hgc run on the test run's shared compile: about 15 s


def test_dry_run_reports_every_run_and_its_counts_add_up(tmp_path, tmp_path_factory):
    pytest.importorskip("openai")
    from testkit.helpers import shared_artifact

    # the artifact stage finds the test run's tiny qwen3_next there (its own names), compiled once for every module
    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent
    rec = main(["--dry-run", "--out", str(tmp_path), "--work", str(work)])
    assert json.loads((tmp_path / "offline_bench.json").read_text())["runs"] == rec["runs"]
    closed = [f"closed_loop_c{c}" for c in DRY["concurrency"]]
    assert {name: s["status"] for name, s in rec["stages"].items()} == dict.fromkeys(
        ("artifact", "engine", "warm_up", "all_at_once", *closed, "serve_vs_run"), "ok")
    assert rec["engine"]["slots"] == max(DRY["concurrency"]) and not rec["engine"]["graphs"] and rec["engine"]["overlap"]
    mix = DRY["mix"]
    for name, c in [("all_at_once", max(DRY["concurrency"])), *zip(closed, DRY["concurrency"])]:
        run = rec["runs"][name]
        count = DRY["requests_per_worker"] * c
        assert run["requests"] == run["finished"] == run["engine_requests_finished"] == count, name
        # greedy, no stop ids: every request generates exactly its max_tokens
        expected = sum(mix[i % len(mix)][1] for i in range(count))
        assert run["expected_output_tokens"] == run["output_tokens"] == run["step_tokens"] == expected, name
        assert run["engine_tokens_generated"] == expected and run["engine_steps"] > 0, name
        # a greedy load overlaps its steps; the calls also read the last step in flight
        assert run["overlapped_steps"] + run["synchronous_steps"] == run["engine_steps"], name
        assert run["overlapped_steps"] > 0 and run["steps"] >= run["engine_steps"], name
        assert run["in_flight"] == (None if name == "all_at_once" else c)
        assert run["output_tokens_per_s"] > 0 and run["steps_per_s"] > 0
        # the CPU has no device apart from the host: neither is invented
        assert run["gpu_busy"] is None and run["host_ms_per_step"] is None and run["profiled_window"]["steps"] == 0
    measure = rec["serve_vs_run"]
    tokens = SERVE_VS_RUN["requests"] * SERVE_VS_RUN["new_tokens"]
    assert measure["served"]["requests"] == measure["run"]["requests"] == SERVE_VS_RUN["requests"]
    assert measure["served"]["output_tokens"] == measure["run"]["output_tokens"] == tokens
    assert measure["ratio"] == pytest.approx(measure["served"]["output_tokens_per_s"]
                                             / measure["run"]["output_tokens_per_s"])
    assert set(rec["targets"]) == {"serve_over_run"}  # reported, not a gate: the ratio itself is noise here


class Span:
    def __init__(self, start, end):
        self.time_range = type("Range", (), {"start": start, "end": end})


def test_busy_time_counts_overlapping_kernels_once():
    """Kernels of two streams at once count once; a gap counts nothing (microseconds in, seconds out)."""
    spans = [Span(0, 10), Span(5, 12), Span(6, 8), Span(20, 25)]
    assert busy_seconds(spans) == pytest.approx(17e-6)
    assert busy_seconds([]) == 0.0


def test_serve_bench_puts_served_over_offline_beside_each_level():
    """serve_bench --offline: each level's served tok/s over the closed-loop run with as many in
    flight; a level whose offline run is missing shows none rather than a made-up ratio."""
    from benchmarks.serving.serve_bench import add_offline, table

    levels = [{"concurrency": c, "requests": 4, "errors": 0, "ttft_median_s": 0.01, "ttft_p99_s": 0.02,
               "itl_median_s": 0.001, "itl_p99_s": 0.002, "output_tokens_per_s": tps, "requests_per_s": 1.0}
              for c, tps in ((1, 50.0), (8, 300.0))]
    add_offline(levels, {"runs": {"closed_loop_c1": {"output_tokens_per_s": 100.0}}})
    assert (levels[0]["offline_output_tokens_per_s"], levels[0]["served_over_offline"]) == (100.0, 0.5)
    assert (levels[1]["offline_output_tokens_per_s"], levels[1]["served_over_offline"]) == (None, None)
    rows = table(levels).splitlines()
    assert rows[0].endswith("| offline tok/s | served/offline |") and rows[2].endswith("| 100.0 | 0.50 |")
    assert rows[3].endswith("| - | - |")


@pytest.mark.parametrize("text", ["128", "128:0", "a:b", "128:64,"])
def test_a_bad_mix_is_a_one_line_usage_error(text):
    from benchmarks.serving.serve_bench import parse_mix

    with pytest.raises(argparse.ArgumentTypeError, match="prompt:output pairs"):
        parse_mix(text)
