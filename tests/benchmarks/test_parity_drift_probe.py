"""benchmarks/probes/parity_drift_probe.py --dry-run on the CPU: the start-up check's unpadded-against-padded
comparison of one decode bucket, op by op, on the tiny qwen3_next (float32, the reference backend,
graphs rerun), read from the check's own record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_reports_every_ops_glue_and_output_error(tmp_path, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    from parity_drift_probe import main

    from testkit.helpers import shared_artifact

    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent  # the test run's tiny qwen3_next
    rec = main(["--dry-run", "--out", str(tmp_path), "--work", str(work), "--bucket", "4"])
    assert json.loads((tmp_path / "parity_drift_probe.json").read_text())["probe"] == rec["probe"]
    probe = rec["probe"]
    assert probe["key"] == "decode[tokens=4, seqs=4]" and probe["real_rows"] == 3 and probe["refused"] is None
    layers = {r["layer"] for r in probe["per_op"]}
    assert layers == set(range(4)) and {r["op"] for r in probe["per_op"]} >= {"gdn_fused", "gqa_attention"}
    # float32 on the reference: padding changes nothing a real row computes
    assert all(r["glue"] < 1e-6 and r["op_err"] < 1e-6 for r in probe["per_op"]) and probe["logits"] < 1e-6
