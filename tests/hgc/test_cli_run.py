"""`hgc run` drives the engine: per-phase timing in --json, seeded sampling reproducible run to run."""

from __future__ import annotations

import json

import pytest

from hgc import main
from testkit.helpers import shared_artifact


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """(checkpoint, artifact): the test run's tiny kimi_linear (testkit/helpers.shared_artifact), only read here."""
    return shared_artifact(tmp_path_factory, "kimi_linear")


def run_json(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_run_reports_phase_timing_and_matches_generate(artifact, capsys):
    prompts = "1,2,3,4,5,6,7,8,9;10,11"
    ran = run_json(capsys, "run", str(artifact[1]), "--prompt-ids", prompts, "--max-new-tokens", "5",
                   "--max-tokens-per-step", "4", "--json")  # chunked prefill: 11 prompt tokens, 4 per step
    eager = run_json(capsys, "generate", str(artifact[0]), "--prompt-ids", prompts, "--max-new-tokens", "5", "--json")
    assert ran["outputs"] == eager["outputs"]
    timing = ran["timing"]
    assert timing["prefill_steps"] >= 3 and timing["prefill_s"] > 0 and timing["decode_s_per_token"] > 0


def test_seeded_sampling_is_reproducible_and_the_seed_matters(artifact, capsys):
    args = ["run", str(artifact[1]), "--prompt-ids", "1,2,3;4,5", "--max-new-tokens", "6", "--temperature", "1.5",
            "--top-k", "50", "--json"]
    a = run_json(capsys, *args, "--seed", "7")["outputs"]
    b = run_json(capsys, *args, "--seed", "7")["outputs"]
    c = run_json(capsys, *args, "--seed", "8")["outputs"]
    assert a == b and a != c


def test_bad_sampling_setting_is_one_line(artifact, capsys):
    assert main(["run", str(artifact[1]), "--prompt-ids", "1,2", "--top-p", "0"]) == 2
    err = capsys.readouterr().err
    assert "argument --top-p: must be in (0, 1]" in err and "Traceback" not in err


def test_run_reuses_a_prefix_unless_told_not_to(artifact, capsys):
    # Two identical 40-token prompts and 16 tokens a step: the first is prefilled in chunks of 16,
    # 16 (its last page boundary before the end: a snapshot) and 8; the second is admitted beside
    # that last chunk and reuses the 32 tokens. Without the cache it prefills all 40.
    prompt = ",".join(str(t) for t in range(3, 43))
    args = ["run", str(artifact[1]), "--prompt-ids", f"{prompt};{prompt}", "--max-new-tokens", "4",
            "--max-tokens-per-step", "16", "--json"]
    cached = run_json(capsys, *args)
    plain = run_json(capsys, *args, "--no-prefix-cache")
    assert cached["outputs"] == plain["outputs"]
    assert cached["cached_tokens"] == [0, 32] and plain["cached_tokens"] == [0, 0]
    assert (cached["timing"]["prefill_tokens"], plain["timing"]["prefill_tokens"]) == (48, 80)
    assert main(["run", str(artifact[1]), "--prompt-ids", prompt, "--snapshot-interval", "0"]) == 2
    assert "argument --snapshot-interval: must be at least 1" in capsys.readouterr().err


def test_run_without_the_overlapped_schedule_gives_the_same_tokens(artifact, capsys):
    args = ["run", str(artifact[1]), "--prompt-ids", "1,2,3,4,5,6,7,8,9;10,11;12", "--max-new-tokens", "7",
            "--max-tokens-per-step", "4", "--json"]
    overlapped, synchronous = run_json(capsys, *args), run_json(capsys, *args, "--no-overlap-schedule")
    assert overlapped["outputs"] == synchronous["outputs"]
    assert overlapped["timing"]["overlapped_steps"] > 0 and synchronous["timing"]["overlapped_steps"] == 0
    # the default is on (runtime/assembly.EngineOptions.overlap); the flag asks for it outright
    assert run_json(capsys, *args, "--overlap-schedule")["timing"]["overlapped_steps"] > 0
