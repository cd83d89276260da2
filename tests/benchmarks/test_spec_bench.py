"""benchmarks/serving/spec_bench.py --dry-run on the CPU: every stage of the GPU run (verify against decode
step cost, verify rows against decode steps, full acceptance against plain decoding, greedy tokens
with the real draft and how close a call each difference was), on a tiny model with the reference
backend and testkit/graph_cases.RerunGraphs for CUDA graphs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # five graph start-ups (the test run's shared compile): about 10 s on 2 cores


def test_dry_run_measures_every_stage(tmp_path, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from spec_bench import main

    from testkit.helpers import shared_artifact

    # init_compile finds the test run's tiny qwen3_next there (its own names), compiled once for every module
    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent
    rec = main(["--dry-run", "--out", str(tmp_path), "--work", str(work)])
    assert json.loads((tmp_path / "spec_bench.json").read_text())["targets"] == rec["targets"]
    assert {name: s["status"] for name, s in rec["stages"].items()} == dict.fromkeys(
        ("init_compile", "step_cost", "verify_vs_decode", "full_acceptance", "greedy_equal"), "ok")
    assert set(rec["step_cost"]) == {"1", "2", "4"}
    assert rec["step_cost"]["1"]["verify_key"] == "target_verify[tokens=4, seqs=1, rows=4]"
    assert "target_verify" in rec["step_cost_runner"]["full_modes"]
    versus = rec["verify_vs_decode"]["2"]  # float32 on the reference: rows equal to rounding, the same argmax
    assert versus["keys"] == ["target_verify[tokens=8, seqs=2, rows=8]"] + ["decode[tokens=2, seqs=2]"] * 4
    assert versus["rows"] == 8 and versus["max_rel_err"] < 1e-5 and versus["argmax_flips"] == 0
    traced = versus["eager_traced"]  # the same twins eager, op by op: where each row's bits part (or "none")
    assert len(traced["per_row"]) == 8 and sum(traced["first_partings"].values()) == 8 and traced["max_rel_err"] < 1e-5
    full = rec["full_acceptance"]
    assert full["same_tokens"] and full["speculative"]["acceptance_rate"] == 1.0
    assert full["speculative"]["tokens_per_verify"] == 4.0 and full["spec"]["steps"] < full["plain"]["steps"]
    assert set(full["step_profiles"]) == {"plain", "spec"}  # one profiled engine step each (host only here)
    assert all(p["host_issue_ms"] > 0 for p in full["step_profiles"].values())
    equal = rec["greedy_equal"]
    assert equal["equal"] and equal["tokens"] == 4 * 8
    ties = equal["ties"]  # no difference to explain; the same token's log-prob in both runs to rounding
    assert ties["first_diffs"] == [] and ties["matched_logprob_delta"]["max"] < 1e-4 and ties["median_plain_margin"] > 0
    assert set(rec["targets"]) == {"verify_over_decode_b1", "verify_matches_decode", "full_acceptance_speedup",
                                   "greedy_equal"}
    assert rec["targets"]["verify_matches_decode"]["met"]


def test_tie_report_says_where_runs_part_and_how_close_a_call_it_was():
    """Each prompt's first difference, the plain run's top-2 margin there and its rank among all the
    plain run's margins; the log-prob distance of the same token before it (tie_report of spec_bench)."""
    import types

    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from spec_bench import tie_report

    from runtime.engine.logprobs import TokenLogprob

    def result(tokens, margins, logprob=-1.0):
        entries = [TokenLogprob(t, logprob, ((t, logprob), (t + 1, logprob - m))) for t, m in zip(tokens, margins)]
        return types.SimpleNamespace(output_ids=tokens, logprobs=tuple(entries))

    plain = [result([5, 6, 7, 8], [0.5, 0.9, 0.001, 0.7]), result([1, 2], [0.3, 0.4])]
    spec = [result([5, 6, 9, 9], [0.5, 0.9, 0.002, 0.1], logprob=-1.01), result([1, 2], [0.3, 0.4])]
    report = tie_report(plain, spec)
    assert report["first_diffs"] == [{"prompt": 0, "position": 2, "plain_margin": pytest.approx(0.001),
                                      "spec_margin": pytest.approx(0.002), "plain_margin_rank": 0.0}]
    assert report["worst_first_diff_rank"] == 0.0 and report["median_plain_margin"] == pytest.approx(0.5)
    delta = report["matched_logprob_delta"]  # positions 0, 1 of prompt 0 (0.01 apart) and both of prompt 1 (equal)
    assert delta["max"] == pytest.approx(0.01) and delta["median"] == pytest.approx(0.01)


def test_kernel_difference_counts_a_kernel_one_step_lacks_as_zero_there():
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from spec_bench import kernel_difference

    decode = [{"name": "a", "ms": 0.5}, {"name": "decode_only", "ms": 0.1}]
    verify = [{"name": "a", "ms": 0.7}, {"name": "verify_only", "ms": 0.3}]
    rows = {r["name"]: r for r in kernel_difference(decode, verify)}
    assert rows["a"]["extra_ms"] == 0.2 and rows["verify_only"]["extra_ms"] == 0.3
    assert rows["decode_only"]["extra_ms"] == -0.1 and [r["name"] for r in kernel_difference(decode, verify)][0] == "verify_only"


def test_a_published_config_runs_at_its_shape_with_random_weights(tmp_path):
    """--config: a release's config.json alone (here a tiny dense Qwen3.5 in the published layout,
    text_config and all), compiled with --no-weights and loaded with random weights; the family
    follows its model_type. Full acceptance then keeps every draft with the plain run's tokens."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from spec_bench import main

    from models.families import get_family

    config = tmp_path / "release.json"
    config.write_text(json.dumps(get_family("qwen3_5").make_config("tiny", "dense", vl=True)))
    rec = main(["--dry-run", "--out", str(tmp_path / "out"), "--config", str(config),
                "--skip", "step_cost,verify_vs_decode,greedy_equal"])
    assert rec["config"]["family"] == "qwen3_5" and rec["stages"]["full_acceptance"]["status"] == "ok"
    manifest = json.loads(next((tmp_path / "out" / "work").glob("config-release-art*/manifest.json")).read_text())
    assert manifest["weights"]["mode"] == "none"
    full = rec["full_acceptance"]
    assert full["same_tokens"] and full["speculative"]["acceptance_rate"] == 1.0


def test_an_unknown_config_names_the_published_ones():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_common import release_config

    with pytest.raises(SystemExit, match=r"--config qwen9: no such file .*qwen3_6_27b"):
        release_config("qwen9")
    assert release_config("qwen3_6_27b").name == "qwen3_6_27b.json"


def test_the_speedup_target_takes_the_run_whose_every_draft_was_kept():
    """Forced to plain decoding's text, a near tie decided otherwise by the verify steps ends the
    agreement; the rerun forced to the speculative run's own text then counts, if it kept every draft."""
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from spec_bench import targets

    def full(same, own=None):
        return {"full_acceptance": {"speedup": 0.8, "same_tokens": same, **({"own_text": own} if own else {})}}

    rec = full(True)
    targets(rec, 3)
    assert rec["targets"]["full_acceptance_speedup"]["value"] == 0.8
    rec = full(False, {"speedup": 2.7, "same_tokens_as_first": True, "acceptance_rate": 1.0})
    targets(rec, 3)
    assert rec["targets"]["full_acceptance_speedup"] == {"value": 2.7, "goal": ">= 2.5x (D = 3)", "met": True,
                                                         "forced_to": "its own greedy text"}
    rec = full(False, {"speedup": 2.7, "same_tokens_as_first": True, "acceptance_rate": 0.9})
    targets(rec, 3)
    assert not rec["targets"]["full_acceptance_speedup"]["met"]
