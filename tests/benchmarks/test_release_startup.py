"""benchmarks/serving/release_startup.py --dry-run on the CPU: a config-only folder compiled without weights
and run with random ones, in processes of their own, speculative decoding on where the artifact
has a draft program."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a compile and a run in subprocesses: about 25 s on 2 cores


def test_a_release_config_compiles_starts_and_runs(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks" / "serving"))
    from release_startup import main

    from models.families import get_family

    config = tmp_path / "release.json"  # a tiny dense Qwen3.5 in the published layout (text_config, MTP)
    config.write_text(json.dumps(get_family("qwen3_5").make_config("tiny", "dense", vl=True)))
    rec = main(["--dry-run", "--out", str(tmp_path / "out"), "--configs", str(config), "--new-tokens", "4"])
    assert json.loads((tmp_path / "out" / "release_startup.json").read_text())["releases"].keys() == {str(config)}
    release = rec["releases"][str(config)]
    assert release["compile"]["rc"] == 0 and release["run"]["rc"] == 0, release
    assert release["run"]["speculative_tokens"] == 3 and release["run"]["output_lengths"] == [4] * 4
    assert release["run"]["timing"]["speculative"]["verify_steps"] > 0
