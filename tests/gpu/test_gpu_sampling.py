"""Sampling after CUDA graphs on the GPU: penalties, logit_bias and logprobs, graph engine vs eager engine.

Runs only on the GPU machine (`pytest -m gpu`), on tests/gpu/test_gpu_graphs.py's tiny qwen3_next artifact.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.test_gpu_graphs import artifact  # noqa: F401 - the module's fixture

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_penalties_bias_and_logprobs_through_cuda_graphs_give_the_eager_tokens(artifact):
    """Per-request penalties and logit_bias live in device tables indexed by state slot, applied
    after the captured decode graph's logits: the graph engine and the eager engine (the same
    artifact, `graphs=False`) pick the same tokens with them on, and the decode steps replay graphs."""
    from runtime.engine.sampling import SamplingParams
    from runtime.assembly import EngineOptions, engine_for_artifact

    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [20, 21, 22, 23], [30, 31, 32]]
    params = [SamplingParams(max_new_tokens=8, frequency_penalty=1.0, presence_penalty=0.5, logprobs=2),
              SamplingParams(max_new_tokens=8, repetition_penalty=1.5),
              SamplingParams(max_new_tokens=8, logit_bias={40: 100.0}, frequency_penalty=2.0),
              SamplingParams(max_new_tokens=8, temperature=0.8, seed=3, presence_penalty=1.0, prompt_logprobs=1)]
    outs = {}
    for graphs in (True, False):
        engine = engine_for_artifact(artifact, EngineOptions(slots=8, max_model_len=128, token_budget=64), 128,
                                     device="cuda", graphs=graphs)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        results = engine.run_until_done()
        outs[graphs] = [results[i] for i in ids]
        if graphs:
            assert engine.stats()["graph_replays"] > 0
    got = [r.output_ids for r in outs[True]]
    want = [r.output_ids for r in outs[False]]
    assert [g[0] for g in got] == [w[0] for w in want]
    differ = sum(a != b for g, w in zip(got, want) for a, b in zip(g, w))
    assert differ <= len(got) * 8 // 4, f"{differ} of {len(got) * 8} tokens differ"
    assert got[2] == want[2] == (40,) * 8  # the bias outweighs the penalty, in both paths
    for a, b in zip(outs[True][3].prompt_logprobs, outs[False][3].prompt_logprobs):
        assert abs(a.logprob - b.logprob) < 0.05  # bf16: the echo rows run eagerly in both
