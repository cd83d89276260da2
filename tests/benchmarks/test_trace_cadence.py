"""benchmarks/kernels/trace_cadence.py on a committed trace (the FlashInfer route's 2048-token step on
an H100): the nine GDN layers' conv launches in order, each with the host's and device's pace."""

from __future__ import annotations

import sys

from testkit.helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))
import trace_cadence  # noqa: E402

TRACE = str(ROOT / "benchmarks/results/timeline_extend_2048_flashinfer_gap_tables_h100_2026-12-06.json.gz")


def test_the_conv_launches_pace_the_layers():
    events, start, end = trace_cadence.load(TRACE, 1)
    rows = trace_cadence.cadence(events, start, end, "_short_conv_extend")
    assert len(rows) == 9 and rows[0]["host_step_us"] is None
    assert all(r["device_us"] >= r["host_us"] and r["lag_us"] >= 0 for r in rows)
    assert sorted(r["host_us"] for r in rows) == [r["host_us"] for r in rows]
    # the first GQA layer's crossing (its attention plan) is the longest on the host
    assert max(rows[1:], key=lambda r: r["host_step_us"]) is rows[3]


def test_the_host_window_lists_each_launch_with_its_kernel(capsys):
    assert trace_cadence.main([TRACE, "--host-from", "4960", "--host-to", "5640"]) == 0
    out = capsys.readouterr().out
    assert out.index("_short_conv_extend_rows_kernel") < out.index("_qk_gates_kernel") < out.index("_gated_rmsnorm")
