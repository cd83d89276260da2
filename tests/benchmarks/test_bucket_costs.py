"""benchmarks/serving/bucket_costs.py --dry-run on the CPU, then `hgc compile --bucket-costs` with what
it wrote: the kept buckets are the rule's, recorded in the manifest and shown by `hgc inspect`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from compiler.bucket_choice import choose_extend_buckets, read_bucket_costs
from hgc import main as hgc
from testkit.helpers import shared_artifact

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a graph start-up and a compile: about 40 s on 2 cores


def test_measured_costs_choose_the_buckets_a_compile_records(tmp_path, tmp_path_factory, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from bucket_costs import main

    ckpt, art = shared_artifact(tmp_path_factory, "qwen3_next")
    rec = main(["--dry-run", "--out", str(tmp_path), "--work", str(art.parent)])
    assert {name: s["status"] for name, s in rec["stages"].items()} == dict.fromkeys(
        ("init_compile", "engine", "extend", "decode", "mixed"), "ok")
    # the mixed steps: their decodes and a prompt filling each bucket from twice their count, against the parts
    assert [(m["decodes"], m["step_tokens"]) for m in rec["mixed"]] == [(4, 16), (4, 32)]
    assert all(m["mixed_ms"] > 0 and m["decodes_alone_ms"] > 0 and m["prompt_alone_ms"] > 0 for m in rec["mixed"])
    costs = read_bucket_costs(tmp_path / "bucket_costs.json")
    assert [t for t, _ in costs.extend_ms] == [16, 32] and [b for b, _ in costs.decode_ms] == [1]
    assert costs.device == "cpu" and rec["kept"] == list(choose_extend_buckets(costs))
    out = tmp_path / "art"
    assert hgc(["compile", str(ckpt), "-o", str(out), "--no-dumps", "-q", "--bucket-costs",
                str(tmp_path / "bucket_costs.json")]) == 0
    buckets = json.loads((out / "manifest.json").read_text())["buckets"]
    assert buckets["extend_token_counts"] == rec["kept"] and buckets["chosen_by"] == "measured"
    assert read_bucket_costs(tmp_path / "bucket_costs.json").to_json() == buckets["measured"]
    capsys.readouterr()
    assert hgc(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chosen from step costs measured on cpu" in text and "extend step ms by tokens: 16 " in text
