"""`hgc compile --state-dtype bfloat16`: the registry, the manifest, `hgc inspect` and the runtime's
state pool keep linear layers' recurrent states in bfloat16, and a model's logits stay within
bfloat16 rounding of a float32 state's (the CPU reference rounds the state after every step, as
the GPU kernels do: tests/runtime/backends/test_triton_linear.py checks them against it)."""

from __future__ import annotations

import json

import pytest
import torch

from hgc import main
from testkit.graph_cases import greedy
from testkit.helpers import shared_artifact

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12]]
STEPS = 6


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """(float32-state artifact, bfloat16-state artifact) of the test run's tiny qwen3_next."""
    ckpt, plain = shared_artifact(tmp_path_factory, "qwen3_next")
    halved = tmp_path_factory.mktemp("state-bf16") / "art"
    assert main(["compile", str(ckpt), "-o", str(halved), "--no-dumps", "-q", "--state-dtype", "bfloat16"]) == 0
    return plain, halved


def test_the_registry_and_manifest_keep_recurrent_states_in_bfloat16(artifacts, capsys):
    plain, halved = artifacts
    manifests = [json.loads((art / "manifest.json").read_text()) for art in (plain, halved)]
    assert "state_dtype" not in manifests[0]["compile"] and manifests[1]["compile"]["state_dtype"] == "bfloat16"
    for before, after in zip(manifests[0]["registry"], manifests[1]["registry"]):
        if not before["state"]:
            assert after == before
            continue
        assert before["state"]["recurrent"]["dtype"] == "float32"
        assert after["state"]["recurrent"] == {**before["state"]["recurrent"], "dtype": "bfloat16"}
        assert after["state"]["conv"] == before["state"]["conv"], "convolution windows keep the model dtype"
    assert main(["inspect", str(halved)]) == 0
    assert "recurrent states: bfloat16 (hgc compile --state-dtype)" in capsys.readouterr().out


def _greedy_logits(art) -> tuple[list, list, torch.dtype]:
    from runtime.assembly import EngineOptions, engine_for_artifact
    from runtime.artifact.loader import load_artifact

    engine = engine_for_artifact(load_artifact(art), EngineOptions(slots=len(PROMPTS), page_size=16), 64,
                                 graphs=False)
    runner = engine.runner

    class Steps:  # greedy's runner: build, then run a step eagerly
        kv_pool, build = runner.kv_pool, runner.build

        @staticmethod
        def run(step, key):
            return runner.run_outputs(step)[0]

    logits = []
    tokens, _ = greedy(Steps, engine.state_pool, PROMPTS, STEPS, logits=logits)
    recurrent = {t.dtype for layer in engine.state_pool.buffers.values() for name, t in layer.items()
                 if name == "recurrent"}
    assert len(recurrent) == 1
    return tokens, logits, recurrent.pop()


def test_logits_stay_within_bfloat16_rounding_of_a_float32_state(artifacts):
    (tokens, ref, ref_dtype), (got_tokens, got, dtype) = (_greedy_logits(art) for art in artifacts)
    assert (ref_dtype, dtype) == (torch.float32, torch.bfloat16)
    # The first step reads zero states; each later one reads states rounded to bfloat16.
    assert torch.equal(got[0], ref[0])
    errs = [float((g - r).norm() / r.norm()) for g, r in zip(got[1:], ref[1:])]
    assert max(errs) < 2e-2, errs
    assert max(errs) > 0, "the bfloat16 states changed nothing: the pool did not keep them"
    assert got_tokens[0][:2] == tokens[0][:2]
