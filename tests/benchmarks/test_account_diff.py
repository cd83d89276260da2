"""benchmarks/kernels/account_diff.py: two step accounts kernel by kernel. On the committed raw
accounts of the H100 A/B (plain against --norm-rope with router=split, sort_ranks=counted) it gives
the rows DESIGN.md and BENCHMARKS.md quote; on hand-made accounts, a kernel one side lacks counts 0
there and a change under --min-us is left out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))

import account_diff  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _account(kernels, step_ms=1.0):
    return {"families": {"f": {"extend": {"8": {"step_ms": step_ms, "kernels": [
        {"name": n, "us": us, "label": ["0", op]} for n, us, op in kernels]}}}}}


def test_swapped_kernels_show_as_removed_and_added():
    a = _account([("k", 2.0, "moe"), ("k", 3.0, "moe"), ("same", 4.0, "glue"), ("old", 6.0, "glue")])
    b = _account([("k", 2.5, "moe"), ("same", 4.5, "glue"), ("new", 9.0, "glue")], step_ms=1.5)
    (step,) = account_diff.diff_steps(a, b, min_us=1.0)
    assert step["step"] == "f extend T=8" and (step["a_ms"], step["b_ms"]) == (1.0, 1.5)
    assert [(r[0], r[1], r[2], r[3]) for r in step["rows"]] == [
        ("old", (1, 6.0), (0, 0.0), -6.0), ("k", (2, 5.0), (1, 2.5), -2.5), ("new", (0, 0.0), (1, 9.0), 9.0)]


@pytest.mark.parametrize("T,removed,added", [("512", (100.5, 60.4), 110.6), ("4096", (108.9, 116.6), 174.9)])
def test_the_h100_ab_gives_the_quoted_router_rows(capsys, T, removed, added):
    steps = account_diff.main([str(RESULTS / "step_account_options_plain_h100_2026-12-06.json.gz"),
                               str(RESULTS / "step_account_options_opts_h100_2026-12-06.json.gz")])
    rows = {r[0]: r for s in steps if s["step"] == f"qwen3_next extend T={T}" for r in s["rows"]}
    assert (round(rows["_logits_kernel"][1][1], 1), round(rows["_route_kernel"][1][1], 1)) == removed
    assert round(rows["_split_router_kernel"][2][1], 1) == added and rows["_split_router_kernel"][2][0] == 12
    assert "qwen3_next decode B=1" in capsys.readouterr().out
