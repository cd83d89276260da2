"""The engine's OpenAI sampling surface: log-probabilities, prompt scoring, shared prefill (n), penalties.

- Sampled-token and prompt log-probabilities equal log_softmax of transformers' logits (the
  reference model, float32) at the same positions; prompt scores equal those of one eager
  prefill whatever the chunking or preemption; the alternatives are the true top k.
- n = 4 with a seed: 4 choices sharing one prefill, each equal to a request sent alone with its
  derived seed (seed + i); with no room to fork, the same tokens from prefills of their own.
- Penalties and logit_bias follow their definitions, on a tiny vocabulary by hand, and through
  the engine against a plain-Python restatement of them over eager logits.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from runtime.engine.engine import SamplingParams
from runtime.engine.penalties import apply_penalties
from testkit.engine_toy import build_model, make_engine, prompts
from testkit.helpers import eager_logits

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4  # float32 log-probabilities against transformers'


def vocab_of(model) -> int:
    return model.lm_head.weight.shape[0]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(ours, transformers') qwen3_next tiny from one checkpoint written by `hgc init-model`'s code."""
    pytest.importorskip("transformers")
    from models.loader import init_checkpoint
    from tests.models.test_qwen3_next import load_both

    ckpt = init_checkpoint("qwen3_next", "tiny", 0, tmp_path_factory.mktemp("qwen") / "ckpt", log=io.StringIO())
    ours, theirs, _ = load_both(ckpt)
    return ours.float().eval(), theirs


@torch.no_grad()
def reference_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the whole sequence: row p scores token p + 1."""
    return torch.log_softmax(hf(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


def alone(model, prompt, params: SamplingParams):
    return make_engine(model, num_slots=1, num_pages=64, page_size=4).generate(prompt, params)


# -- log-probabilities ---------------------------------------------------------------------------


def test_sampled_and_prompt_logprobs_equal_log_softmax_of_the_reference_model(qwen):
    ours, hf = qwen
    prompt = prompts(1, [19], vocab_of(ours), seed=5)[0]
    engine = make_engine(ours, num_slots=2, num_pages=64, page_size=4, max_tokens_per_step=7)  # chunked prompt
    for params in (SamplingParams(max_new_tokens=6, logprobs=5, prompt_logprobs=3),
                   SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, logprobs=2, prompt_logprobs=0)):
        result = engine.generate(prompt, params)
        tokens = list(result.prompt_ids + result.output_ids)
        ref = reference_logprobs(hf, tokens)  # [L + n, V]
        entries = result.prompt_logprobs + result.logprobs
        assert len(result.prompt_logprobs) == len(prompt) - 1 and len(result.logprobs) == 6
        for position, entry in enumerate(entries):  # entry for token position + 1
            assert entry.token == tokens[position + 1]
            assert abs(entry.logprob - float(ref[position, entry.token])) < TOL, (position, entry)
            k = params.prompt_logprobs if position < len(prompt) - 1 else params.logprobs
            values, ids = ref[position].topk(k)
            assert len(entry.top) == k
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=TOL)
            # ids agree wherever the reference has no near-tie at that rank
            for rank, (token, _) in enumerate(entry.top):
                gaps = (values - values[rank]).abs()
                if (gaps < 1e-3).sum() == 1:
                    assert token == int(ids[rank]), (position, rank)
        if params.greedy:  # the chosen token is the top alternative
            assert all(e.top[0][0] == e.token for e in result.logprobs)


def test_prompt_scores_equal_one_prefill_whatever_the_chunking_and_preemption():
    model = build_model("toy")
    ps = prompts(4, [23, 9, 31, 14], vocab_of(model), seed=6)
    want = []
    for prompt in ps:
        rows = torch.log_softmax(eager_logits(model, prompt, [])[:-1], dim=-1)  # one prefill, every row
        want.append([float(rows[p, prompt[p + 1]]) for p in range(len(prompt) - 1)])
    params = SamplingParams(max_new_tokens=12, logprobs=0, prompt_logprobs=2)
    # Budget 5: prompts in chunks, mixed with decodes; 9 pages of 4: some requests are preempted.
    engine = make_engine(model, num_slots=4, num_pages=14, page_size=4, max_tokens_per_step=5)
    ids = [engine.add_request(p, params) for p in ps]
    results = engine.run_until_done()
    assert engine.stats()["preemptions"] > 0
    for rid, prompt, expected in zip(ids, ps, want):
        got = results[rid].prompt_logprobs
        assert [e.token for e in got] == prompt[1:]
        assert [e.logprob for e in got] == pytest.approx(expected, abs=1e-5)
        assert results[rid].output_ids == alone(model, prompt, params).output_ids


def test_max_new_tokens_zero_scores_the_prompt_and_generates_nothing():
    model = build_model("toy")
    prompt = prompts(1, [11], vocab_of(model), seed=2)[0]
    engine = make_engine(model)
    scored = engine.generate(prompt, SamplingParams(max_new_tokens=0, prompt_logprobs=1))
    assert scored.output_ids == () and scored.finish_reason == "length" and len(scored.prompt_logprobs) == 10
    full = engine.generate(prompt, SamplingParams(max_new_tokens=3, prompt_logprobs=1))
    assert scored.prompt_logprobs == full.prompt_logprobs
    assert engine.stats()["free_slots"] == engine.stats()["total_slots"]
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)  # nothing sampled and nothing scored: a mistake


# -- n: shared prefill ---------------------------------------------------------------------------


def add_group(engine, prompt, params: list[SamplingParams]) -> list:
    first = engine.add_request(prompt, params[0])
    return [first] + [engine.add_request(prompt, p, prefill_from=first) for p in params[1:]]


def test_n_choices_share_one_prefill_and_each_equals_its_derived_seed_alone():
    model = build_model("toy")
    prompt = prompts(1, [21], vocab_of(model), seed=8)[0]
    seed = 40
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=seed + i, logprobs=1, prompt_logprobs=1)
              for i in range(4)]
    engine = make_engine(model, num_slots=8, num_pages=64, page_size=4, max_tokens_per_step=8)
    other = engine.add_request(prompts(1, [5], vocab_of(model), seed=9)[0], SamplingParams(max_new_tokens=4))
    ids = add_group(engine, prompt, params)
    results = engine.run_until_done()
    stats = engine.stats()
    assert stats["prefills_shared"] == 3
    assert stats["prefill_tokens"] == len(prompt) + 5  # the shared prompt was prefilled once
    outputs = [results[rid].output_ids for rid in ids]
    assert len(set(outputs)) == 4, "four seeds, four continuations"
    for rid, p in zip(ids, params):
        single = alone(model, prompt, p)
        assert results[rid].output_ids == single.output_ids
        assert [e.token for e in results[rid].logprobs] == [e.token for e in single.logprobs]
        # a batched step and a step alone round differently in float32 (same tokens, logprobs to 1e-5)
        assert [e.logprob for e in results[rid].logprobs] == pytest.approx([e.logprob for e in single.logprobs],
                                                                             abs=1e-5)
        assert results[rid].prompt_logprobs == results[ids[0]].prompt_logprobs
    assert results[other].finish_reason == "length"
    assert stats["free_slots"] == stats["total_slots"] and stats["free_pages"] == stats["total_pages"]


def test_n_choices_without_room_to_fork_prefill_alone_with_the_same_tokens():
    model = build_model("toy")
    prompt = prompts(1, [9], vocab_of(model), seed=10)[0]
    params = [SamplingParams(max_new_tokens=6, temperature=0.8, seed=7 + i) for i in range(3)]
    engine = make_engine(model, num_slots=1, num_pages=16, page_size=4)  # one slot: nobody can fork
    ids = add_group(engine, prompt, params)
    results = engine.run_until_done()
    assert engine.stats()["prefills_recomputed"] == 2 and engine.stats()["prefills_shared"] == 0
    for rid, p in zip(ids, params):
        assert results[rid].output_ids == alone(model, prompt, p).output_ids


def test_cancelling_the_first_choice_before_its_prefill_hands_the_others_to_the_queue():
    model = build_model("toy")
    prompt = prompts(1, [9], vocab_of(model), seed=11)[0]
    params = [SamplingParams(max_new_tokens=4, temperature=1.0, seed=i) for i in range(3)]
    engine = make_engine(model)
    ids = add_group(engine, prompt, params)
    assert engine.cancel(ids[0])
    results = engine.run_until_done()
    assert results[ids[0]].finish_reason == "cancelled"
    for rid, p in zip(ids[1:], params[1:]):
        assert results[rid].output_ids == alone(model, prompt, p).output_ids
    with pytest.raises(ValueError, match="cannot share its prefill"):
        engine.add_request([1, 2], SamplingParams(), prefill_from="nobody")


# -- penalties and logit_bias --------------------------------------------------------------------


def test_penalties_follow_their_definitions_on_a_tiny_vocabulary():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    counts = torch.tensor([[0, 2, 1, 0, 0, 3]], dtype=torch.int32)  # generated so far
    prompt = torch.tensor([[True, False, False, False, True, False]])
    bias = torch.tensor([[0.0, 0.0, 0.0, -1.0, 0.0, 0.5]])

    def run(presence=0.0, frequency=0.0, repetition=1.0, with_bias=False):
        return apply_penalties(logits, bias if with_bias else torch.zeros_like(bias), counts, prompt,
                               torch.tensor([presence]), torch.tensor([frequency]), torch.tensor([repetition]))[0]

    assert run().tolist() == logits[0].tolist()  # neutral values change nothing
    # OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence, on generated tokens only
    assert run(presence=0.5).tolist() == [2.0, -1.5, 0.0, 3.0, -2.0, 0.5]
    assert run(frequency=0.5).tolist() == [2.0, -2.0, 0.0, 3.0, -2.0, -0.5]
    assert run(presence=-1.0, frequency=0.25).tolist() == [2.0, -0.5, 1.25, 3.0, -2.0, 1.25]
    # repetition (CTRL): prompt or generated tokens, positive logits divided, the others multiplied
    assert run(repetition=2.0).tolist() == [1.0, -2.0, 0.25, 3.0, -4.0, 0.5]
    # logit_bias first, then the penalties (vLLM's order): token 5 is 1.0 + 0.5, then halved
    assert run(repetition=2.0, with_bias=True).tolist() == [1.0, -2.0, 0.25, 2.0, -4.0, 0.75]


def penalised(row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """The definitions restated element by element in plain Python: the test's own reading of them."""
    out = row.clone()
    bias = dict(p.logit_bias)
    for j in range(out.shape[0]):
        x = float(out[j]) + bias.get(j, 0.0)
        c = output.count(j)
        if j in prompt or c:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        out[j] = x - c * p.frequency_penalty - (c > 0) * p.presence_penalty
    return out


def test_penalised_greedy_tokens_follow_the_definitions_through_the_engine():
    model = build_model("toy")
    vocab = vocab_of(model)
    ps = prompts(3, [6, 10, 4], vocab, seed=13)
    cases = [SamplingParams(max_new_tokens=14, frequency_penalty=1.5, presence_penalty=0.5),
             SamplingParams(max_new_tokens=14, repetition_penalty=1.8),
             SamplingParams(max_new_tokens=14, presence_penalty=-0.5, logit_bias={5: 2.0, 7: -3.0})]
    # Together with unpenalised requests, in tiny pools (preemptions: rows reload in new slots).
    engine = make_engine(model, num_slots=3, num_pages=12, page_size=4, max_tokens_per_step=6)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(ps, cases)]
    plain = [engine.add_request(prompt, SamplingParams(max_new_tokens=14)) for prompt in ps]
    results = engine.run_until_done()
    assert engine.stats()["preemptions"] > 0
    for rid, prompt, p in zip(ids, ps, cases):
        out = list(results[rid].output_ids)
        rows = eager_logits(model, prompt, out)[len(prompt) - 1:]
        for i, token in enumerate(out):
            assert int(penalised(rows[i], prompt, out[:i], p).argmax()) == token, (p, i)
    unpenalised = [list(results[rid].output_ids) for rid in plain]
    assert [list(results[rid].output_ids) for rid in ids] != unpenalised, "the penalties changed nothing"
    for rid, prompt in zip(plain, ps):
        assert results[rid].output_ids == alone(model, prompt, SamplingParams(max_new_tokens=14)).output_ids


def test_logit_bias_forces_and_bans_tokens_and_seeded_penalties_are_batch_invariant():
    model = build_model("toy")
    prompt = prompts(1, [8], vocab_of(model), seed=14)[0]
    greedy = alone(model, prompt, SamplingParams(max_new_tokens=8)).output_ids
    forced = alone(model, prompt, SamplingParams(max_new_tokens=8, logit_bias={17: 100.0})).output_ids
    assert forced == (17,) * 8
    banned = alone(model, prompt, SamplingParams(max_new_tokens=8, logit_bias={greedy[0]: -100.0})).output_ids
    assert greedy[0] not in banned
    seeded = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=s, frequency_penalty=0.7, repetition_penalty=1.3)
              for s in range(4)]
    engine = make_engine(model, num_slots=4, num_pages=64, page_size=4, max_tokens_per_step=9)
    ids = [engine.add_request(prompt, p) for p in seeded]
    results = engine.run_until_done()
    for rid, p in zip(ids, seeded):
        assert results[rid].output_ids == alone(model, prompt, p).output_ids
    assert not math.isnan(sum(e for r in results.values() for e in r.output_ids))
