"""`hgc compile --state-dtype bfloat16`: the registry, the manifest, `hgc inspect` and the runtime's
state pool keep linear layers' recurrent states in bfloat16, and a model's logits stay within
bfloat16 rounding of a float32 state's (the CPU reference rounds the state after every step, as
the GPU kernels do: tests/runtime/backends/test_triton_linear.py checks them against it). Without
the flag a checkpoint's `mamba_ssm_dtype` decides, and one hgc does not keep is refused."""

from __future__ import annotations

import json

import pytest
import torch

from hgc import main
from hgc.errors import EXIT_BAD_INPUT
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


@pytest.fixture(scope="module")
def qwen3_5_checkpoint(tmp_path_factory):
    """A tiny qwen3_5 checkpoint (its config names mamba_ssm_dtype, as the released ones do)."""
    ckpt = tmp_path_factory.mktemp("qwen3_5") / "ckpt"
    assert main(["init-model", "--family", "qwen3_5", "--size", "tiny", "--seed", "0", "-o", str(ckpt), "-q"]) == 0
    return ckpt


def _with_ssm_dtype(ckpt, name: str):
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config.get("text_config", config)["mamba_ssm_dtype"] = name  # a release nests it, init-model's tiny one not
    path.write_text(json.dumps(config))


def _recurrent_dtypes(art) -> set[str]:
    registry = json.loads((art / "manifest.json").read_text())["registry"]
    return {layer["state"]["recurrent"]["dtype"] for layer in registry if "recurrent" in layer["state"]}


def test_the_checkpoints_mamba_ssm_dtype_is_the_default_and_the_flag_overrides_it(qwen3_5_checkpoint, tmp_path,
                                                                                   capsys):
    ckpt = qwen3_5_checkpoint
    compile_args = ["--no-dumps", "--no-weights", "-q"]
    _with_ssm_dtype(ckpt, "float32")  # as Qwen3.5's released configs name it
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "named"), *compile_args]) == 0
    assert _recurrent_dtypes(tmp_path / "named") == {"float32"}
    _with_ssm_dtype(ckpt, "bfloat16")
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "bf16"), *compile_args]) == 0
    assert _recurrent_dtypes(tmp_path / "bf16") == {"bfloat16"}
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "bf16")]) == 0
    assert "recurrent states: bfloat16 (config.json's mamba_ssm_dtype)" in capsys.readouterr().out
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "asked"), "--state-dtype", "float32", *compile_args]) == 0
    assert _recurrent_dtypes(tmp_path / "asked") == {"float32"}
    _with_ssm_dtype(ckpt, "float16")  # no state dtype hgc keeps: refused, naming the field, nothing written
    capsys.readouterr()
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "refused"), *compile_args]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "mamba_ssm_dtype 'float16'" in err and "--state-dtype" in err and len(err.strip().splitlines()) <= 2, err
    assert not (tmp_path / "refused").exists()
    assert main(["compile", str(ckpt), "-o", str(tmp_path / "chosen"), "--state-dtype", "bfloat16", *compile_args]) == 0
    assert _recurrent_dtypes(tmp_path / "chosen") == {"bfloat16"}
