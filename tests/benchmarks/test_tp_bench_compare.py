"""benchmarks/tp_bench.compare: how a TP 2 run's greedy tokens are told apart from TP 1's, on
hand-made log-probabilities (the GPU run's verdict rests on it)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "serving"))

from tp_bench import compare  # noqa: E402


def run(tokens, tops):
    return {"tokens": tokens, "top_logprobs": tops}


def test_a_flip_at_a_near_tie_reports_its_gaps_drift_and_swing():
    # step 0: same choice, the shared tokens' log-probs 0.05 apart; step 1: the runs choose apart
    one = run([[5, 7]], [[{"5": -0.5, "9": -1.0}, {"7": -0.60, "8": -0.70}]])
    two = run([[5, 8]], [[{"5": -0.55, "9": -1.0}, {"8": -0.62, "7": -0.66}]])
    row = compare(one, two)["prompts"][0]
    assert compare(one, two)["status"] == "differ"
    assert row["first_difference"] == 1 and row["top2_gap"] == {"tp1": 0.1, "tp2": 0.04}
    assert abs(row["drift"] - 0.08) < 1e-9  # token 8 at step 1: -0.70 against -0.62
    assert row["swing"] == 0.14  # (-0.60 + 0.70) - (-0.66 + 0.62)


def test_equal_runs_have_no_first_difference_and_their_drift_over_every_step():
    tops = [[{"3": -0.1, "4": -2.0}, {"6": -0.3, "2": -1.5}]]
    shifted = [[{"3": -0.1, "4": -2.2}, {"6": -0.3, "2": -1.5}]]
    row = compare(run([[3, 6]], tops), run([[3, 6]], shifted))["prompts"][0]
    assert row["equal"] and row["first_difference"] is None and "swing" not in row
    assert abs(row["drift"] - 0.2) < 1e-9


def test_a_missing_run_is_not_compared():
    assert compare({}, run([[1]], [[{"1": 0.0}]]))["status"] == "not compared (a run is missing)"
