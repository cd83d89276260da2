"""benchmarks/probes/spec_text_probe.py --dry-run on the CPU: its seven runs (plain twice on one engine and once
on a fresh one, D = 3 with the real draft, D = 1 and 3 forced to the plain text, D = 3 with no draft
program proposing the plain text and the plain text plus one) on a tiny model with
the reference backend and testkit/graph_cases.RerunGraphs for CUDA graphs. In float32 on the reference
every run gives plain decoding's tokens, plain decoding its bits run to run, the forced runs keep
every draft, and D = 3 forced with the draft program gives the bits of the same drafts without it;
with --trace-ops, the eager runs traced op by op (testkit/position_trace.py) part from plain decoding at
the same place with and without the draft program."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # five engine start-ups over the test run's shared compile


def test_dry_run_compares_every_run_with_plain_decoding(tmp_path, tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    from spec_text_probe import main

    from testkit.helpers import shared_artifact

    work = shared_artifact(tmp_path_factory, "qwen3_next")[1].parent  # its own names (bench_common.compiled_artifact)
    assert main(["--dry-run", "--out", str(tmp_path), "--work", str(work), "--prompt-len", "8",
                 "--new-tokens", "12", "--trace-ops"]) == 0
    runs = json.loads((tmp_path / "spec_text_probe.json").read_text())["runs"]
    assert list(runs) == ["plain, again on the same engine", "plain, a fresh engine", "D = 3, the real draft",
                          "D = 1, drafts forced to the plain text", "D = 3, drafts forced to the plain text",
                          "D = 3, no draft program, the plain text proposed",
                          "D = 3, no draft program, the plain text plus one"]
    assert all(r["mismatched"] == 0 and r["first_diff"] is None for r in runs.values()), runs
    # plain decoding is the same bits run to run; a verify row on the reference is the decode step's to
    # float32 rounding, which the log-probabilities show (a token's, before any text parts)
    assert [r["first_logprob_diff"] for r in runs.values()][:2] == [None, None]
    assert [r["acceptance_rate"] for r in runs.values()][3:] == [1.0, 1.0, 1.0, 0.0]
    # the draft program's steps between the verify steps leave the main program's numbers alone: forced
    # drafts with the program and the same drafts without it keep the same rows, with the same bits
    pairs = json.loads((tmp_path / "spec_text_probe.json").read_text())["pairs"]
    forced = pairs["D = 3, drafts forced to the plain text | D = 3, no draft program, the plain text proposed"]
    assert forced == {"first_diff": None, "first_logprob_diff": None}, pairs
    # --trace-ops, every step eager: plain decoding has the bits of its graph runs; D = 3 leaves them at a
    # verify row (on the CPU its glue rounds 4 rows otherwise than 1), at the same op with the draft
    # program and without it
    traced = json.loads((tmp_path / "spec_text_probe.json").read_text())["traced"]
    assert traced["plain, eager, against plain with graphs"] == {"first_diff": None, "first_logprob_diff": None}
    with_program = traced["D = 3, drafts forced to the plain text"]
    without = traced["D = 3, no draft program, the plain text proposed"]
    assert with_program == without and with_program["first_diff"] is None, traced
    assert with_program["first_parting"] is None or with_program["first_parting"]["position"] >= 8, traced
