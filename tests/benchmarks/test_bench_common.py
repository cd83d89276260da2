"""benchmarks/bench_common.py's target verdicts: a dry run never calls a GPU goal missed."""

from benchmarks.bench_common import target_rows, verdict


def test_a_dry_run_judges_only_the_targets_set_for_the_cpu():
    targets = {"hit_speedup": {"value": 1.2, "goal": ">= 10x", "met": False},
               "serve_over_run": {"value": 0.7, "goal": ">= 0.8", "met": False, "on_cpu": True}}
    dry = target_rows({"config": {"dry_run": True}, "targets": targets})
    assert dry == ["hit_speedup: 1.2 (goal >= 10x): not judged (a GPU goal; this is a dry run)",
                   "serve_over_run: 0.7 (goal >= 0.8): MISSED"]
    gpu = target_rows({"config": {"dry_run": False}, "targets": targets})
    assert gpu == ["hit_speedup: 1.2 (goal >= 10x): MISSED", "serve_over_run: 0.7 (goal >= 0.8): MISSED"]
    assert verdict(True, dry_run=False) == "met" and verdict(None, dry_run=False) == "not measured"
