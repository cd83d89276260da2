"""benchmarks/plots/plot_decode.py reads what startup_bench.py and gpu_e2e.py write (no matplotlib needed here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "plots"))
from plot_decode import main, series  # noqa: E402

RUN = {"size": "bench", "date": "2026-11-28", "device": "NVIDIA H200",
       "variants": {"compiled": {"decode": {"1": {"step_ms": 1.0, "piecewise_ms": 1.1},
                                            "8": {"step_ms": 1.4, "piecewise_ms": None}}}},
       "transformers": {"hf_static": {"per_batch": {"1": {"decode_ms": 2.6}, "8": {"decode_ms": None}}}}}
BEFORE = {"date": "2026-11-26 10:00", "size": "bench",
          "families": {"qwen3_next": {"timings_ms": {"decode_b1": {"full_graph": 2.77}, "extend_t512": {"eager": 9.0}}}}}


def test_each_line_takes_its_numbers_from_the_run_and_the_before_file():
    lines = series(RUN, BEFORE, "qwen3_next")
    assert lines == {"full graph (compiled pieces)": {1: 1.0, 8: 1.4}, "piecewise (compiled pieces)": {1: 1.1},
                     "transformers static-cache compiled": {1: 2.6},
                     "before: full graph, traced glue (2026-11-26, size bench)": {1: 2.77}}
    assert "transformers static-cache compiled" not in series({**RUN, "transformers": None}, None, "qwen3_next")


def test_bad_arguments_and_files_stop_with_one_line_naming_them(tmp_path):
    with pytest.raises(SystemExit, match="a run takes FAMILY=FILE, got 'qwen3_next'"):
        main(["qwen3_next", "--png", str(tmp_path / "p.png")])
    with pytest.raises(SystemExit, match=r"--before names \['kimi_linear'\], which no run names"):
        main([f"qwen3_next={tmp_path / 'a.json'}", "--before", f"kimi_linear={tmp_path / 'b.json'}",
              "--png", str(tmp_path / "p.png")])
    with pytest.raises(SystemExit, match="has no decode full-graph timings"):
        series(RUN, BEFORE, "kimi_linear")
