"""lm-evaluation-harness as the client: its `local-completions` model against `hgc serve` equals its `hf` model.

The harness runs in a process of its own (testkit/lm_eval_runs.py: `simple_evaluate`, what
`lm_eval run` calls, with its defaults), offline, on the two tasks defined in tests/lm_eval_tasks/
with their local data: a log-likelihood task (multiple choice: `echo`, `logprobs`, a list of
prompts per request) and a generate_until task (greedy text up to stop strings). `local-completions`
talks to a real `hgc serve` subprocess over HTTP, once sending token ids (tokenized_requests=True)
and once text; `hf` runs transformers' model of the same checkpoint in float32. The three runs
share the process and its task index. Every per-sample log-likelihood agrees within 1e-4 and
every generated text is identical.

The checkpoint's tokenizer adds no bos token, as Qwen's does not: lm-eval's `hf` model encodes
with the tokenizer's default and its API models without special tokens, so with a bos-adding
tokenizer the two would score different token sequences whatever the server did.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from testkit.helpers import ServerProcess, shared_artifact  # noqa: E402

pytestmark = pytest.mark.slow  # a server and three harness runs in one process: about 40 s on 2 cores

ROOT = Path(__file__).resolve().parents[2]
TASKS = ("hgc_tiny_choice", "hgc_tiny_until")
MODEL = "tiny"
TOL = 1e-4


def qwen_style_tokenizer(ckpt: Path) -> None:
    """Make the checkpoint's tokenizer add no bos on encode (the post-processor and the flag)."""
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (ckpt / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["add_bos_token"] = False
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint, URL of `hgc serve`): the test run's shared tiny qwen3_next artifact, served with
    --tokenizer from a copy of its checkpoint whose tokenizer adds no bos (the weights are the copy's)."""
    shared_ckpt, artifact = shared_artifact(tmp_path_factory, "qwen3_next")
    ckpt = tmp_path_factory.mktemp("lm_eval") / "ckpt"
    shutil.copytree(shared_ckpt, ckpt)
    qwen_style_tokenizer(ckpt)
    server = ServerProcess([str(artifact), "--served-model-name", MODEL, "--tokenizer", str(ckpt), "--max-model-len",
                            "512", "--slots", "8"]).wait_ready()
    try:
        yield ckpt, server.url
    finally:
        assert server.stop() == 0, server.log()


def run_harness(runs: dict[str, tuple[str, str]], out: Path) -> dict[str, dict[str, list[dict]]]:
    """lm-eval's runs {name: (model, model_args)} in one process from the repo root, offline;
    {name: {task: its logged samples, by doc_id}}."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(out / "datasets"), HF_HOME=str(out / "hf_home"), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    spec = {"tasks": TASKS, "include_path": "tests/lm_eval_tasks", "batch_size": 2, "runs": runs}
    (out / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "testkit.lm_eval_runs", str(out / "spec.json"), str(out / "samples.json")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    samples = json.loads((out / "samples.json").read_text())
    for name in runs:
        for task in TASKS:
            assert samples[name][task], f"no samples for {name} on {task}: {proc.stderr[-3000:]}"
    return samples


@pytest.fixture(scope="module")
def harness_samples(served, tmp_path_factory):
    """{"hf", "token-ids", "text": {task: samples}}: transformers' model of the checkpoint, and
    local-completions against the server sending token ids, then text."""
    ckpt, url = served
    runs = {"hf": ("hf", f"pretrained={ckpt},dtype=float32")}
    for name, tokenized in (("token-ids", True), ("text", False)):
        runs[name] = ("local-completions",
                      f"model={MODEL},base_url={url}/v1/completions,tokenizer={ckpt},tokenizer_backend=huggingface,"
                      f"tokenized_requests={tokenized},max_length=512,num_concurrent=1,max_retries=1")
    return run_harness(runs, tmp_path_factory.mktemp("lm_eval_runs"))


def loglikelihoods(rows: list[dict]) -> list[list[float]]:
    """Each doc's log-likelihood per choice (filtered_resps: [loglikelihood, is_greedy] per choice)."""
    return [[float(resp[0]) for resp in row["filtered_resps"]] for row in rows]


@pytest.mark.parametrize("requests", ["token-ids", "text"])
def test_local_completions_against_hgc_serve_equals_hf(harness_samples, requests):
    hf_samples, got = harness_samples["hf"], harness_samples[requests]

    choice_hf, choice_api = loglikelihoods(hf_samples["hgc_tiny_choice"]), loglikelihoods(got["hgc_tiny_choice"])
    assert len(choice_api) == len(choice_hf) == 6
    for doc, (want, have) in enumerate(zip(choice_hf, choice_api)):
        assert len(have) == len(want) and max(abs(a - b) for a, b in zip(have, want)) < TOL, (doc, want, have)
    # the same choices win, so the same accuracy
    assert [r["acc"] for r in got["hgc_tiny_choice"]] == [r["acc"] for r in hf_samples["hgc_tiny_choice"]]

    texts_hf = [row["filtered_resps"][0] for row in hf_samples["hgc_tiny_until"]]
    texts_api = [row["filtered_resps"][0] for row in got["hgc_tiny_until"]]
    assert texts_api == texts_hf
    assert any(texts_hf) and len(set(texts_hf)) == len(texts_hf), texts_hf  # real, distinct generations
