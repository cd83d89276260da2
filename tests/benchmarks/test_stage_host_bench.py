"""benchmarks/host/stage_host_bench.py on the CPU, few repetitions: every case measured on both
paths, each key the one the case names, and a baseline ref measured beside it."""

from __future__ import annotations

import json

from benchmarks.host.stage_host_bench import CASES, COLUMNS, main


def test_every_case_is_measured_with_a_baseline(tmp_path, tmp_path_factory):
    from testkit.helpers import shared_artifact

    art = shared_artifact(tmp_path_factory, "qwen3_next")[1]
    rec = main(["--out", str(tmp_path), "--artifact", str(art), "--device", "cpu", "--reps", "5",
                "--baseline-ref", "HEAD"])
    assert json.loads((tmp_path / "stage_host_bench.json").read_text())["cases"] == rec["cases"]
    assert list(rec["cases"]) == [name for name, *_ in CASES]
    for name, case in rec["cases"].items():
        assert all(0 < case[c] < 1e6 for c in COLUMNS), case
        assert case["key"].startswith(("decode[tokens=", "extend[tokens="))
    assert rec["cases"]["extend_t32"]["key"] == "extend[tokens=32, seqs=1]"
    assert rec["cases"]["decode_b128"]["key"] == "decode[tokens=128, seqs=128]"
    base = rec["baseline"]
    assert base["code"].endswith("baseline-src") and set(base["cases"]) == set(rec["cases"])
    assert base["baseline_ref"] is None  # the baseline does not start another
