"""benchmarks/host/step_host_bench.py --dry-run on the CPU, small: every case measured, the profile
names the engine's step, the message path counts every token, and a baseline ref runs beside it."""

from __future__ import annotations

import json

from benchmarks.host.step_host_bench import _drop_flag, main


def test_dry_run_measures_every_case_and_a_baseline(tmp_path, tmp_path_factory):
    from testkit.helpers import shared_artifact

    # the artifact stage (and the baseline's) finds the test run's tiny qwen3_next there (its own names)
    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent
    rec = main(["--dry-run", "--out", str(tmp_path), "--work", str(work), "--batches", "1,8", "--context", "40",
                "--steps", "12", "--profile-steps", "3", "--mixed-in-flight", "8", "--mixed-prompt", "96",
                "--mixed-output", "6", "--token-budget", "64", "--baseline-ref", "HEAD"])
    assert json.loads((tmp_path / "step_host_bench.json").read_text())["decode"] == rec["decode"]
    assert {name: s["status"] for name, s in rec["stages"].items()} == dict.fromkeys(
        ("artifact", "decode_b1", "decode_b8", "mixed", "messages", "baseline"), "ok")
    for batch in ("1", "8"):
        case = rec["decode"][batch]
        assert case["steps"] == 12 and 0 < case["host_ms_best"] <= case["host_ms_median"] < 1e3 and 0 < case["host_cpu_ms_best"] < 1e3 and case["batch"] == int(batch)
        assert any(row["function"].endswith(":step") and row["calls_per_call"] == 1
                   for row in case["profile"]["top_cum"])
        assert len(case["profile"]["top_own"]) == 25
    mixed = rec["mixed"]
    # 8 requests of 96 prompt tokens, 6 new each, 64 tokens a step: prompt chunks share steps with decodes
    assert mixed["steps"] > 0 and mixed["mean_prompt_tokens"] > 0 and mixed["mean_decodes"] >= 1
    msg = rec["messages"]
    assert msg["tokens"] == 8 * msg["steps"]  # the last decode case's 8 requests, one token a step
    assert all(msg[k] > 0 for k in ("core_pack_us_per_token", "client_hand_over_us_per_token",
                                     "server_text_sse_us_per_token", "bytes_per_token"))
    base = rec["baseline"]
    assert base["code"].endswith("baseline-src") and set(base["decode"]) == {"1", "8"}
    assert base["config"]["baseline_ref"] is None  # the baseline does not start another


def test_drop_flag_takes_both_spellings():
    argv = ["--out", "a", "--dry-run", "--baseline-ref=main", "--steps", "3"]
    assert _drop_flag(_drop_flag(argv, "--out"), "--baseline-ref") == ["--dry-run", "--steps", "3"]
