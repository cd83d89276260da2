"""The engine core's messages (runtime/core/messages.py) carry every field across unchanged, as plain
msgpack data: sampling parameters (a grammar as its response_format), step outputs with their
log-probabilities, results, and the served model's facts with its tokenizer."""

from __future__ import annotations

import dataclasses

import pytest

from runtime.core.messages import (GrammarSpec, output_from_wire, output_to_wire, pack, params_from_wire,
                                   params_to_wire, result_from_wire, result_to_wire, served_from_wire,
                                   served_to_wire, unpack)
from runtime.engine.engine import RequestResult, StepOutput
from runtime.engine.logprobs import TokenLogprob
from runtime.engine.sampling import SamplingParams
from runtime.assembly import ServedModel


def wire(value):
    """Through msgpack, as the socket carries it."""
    return unpack(pack([value]))[0]


def test_sampling_params_round_trip_every_field():
    params = SamplingParams(max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9, seed=2 ** 62, stop_token_ids={3, 1},
                            presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3,
                            logit_bias={7: -100.0, 2: 2.5}, logprobs=3, prompt_logprobs=2,
                            grammar=GrammarSpec({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}))
    assert {f.name for f in dataclasses.fields(params)} == set(params_to_wire(params))
    defaults = SamplingParams()
    assert all(getattr(params, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(params))
    assert params_from_wire(wire(params_to_wire(params))) == params
    assert params_from_wire(wire(params_to_wire(defaults))) == defaults


def test_the_core_compiles_the_grammar_and_a_compiled_one_is_refused():
    spec = {"type": "json_object"}
    params = SamplingParams(grammar=GrammarSpec(spec))
    assert params_from_wire(wire(params_to_wire(params)), lambda rf: ("compiled", rf["type"])).grammar == \
        ("compiled", "json_object")
    with pytest.raises(TypeError, match="does not cross processes"):
        params_to_wire(SamplingParams(grammar=object()))


def test_outputs_and_results_round_trip_every_field():
    top = ((5, -0.5), (9, -1.25))
    out = StepOutput("cmpl-1", 5, True, TokenLogprob(5, -0.5, top), (TokenLogprob(2, -3.0, ()), TokenLogprob(4, -0.1, top)))
    result = RequestResult("cmpl-1", (1, 2, 4), (5,), "stop", 0.01, 0.5, 2, (TokenLogprob(5, -0.5, top),),
                           (TokenLogprob(2, -3.0, ()),), cached_tokens=16)
    assert {f.name for f in dataclasses.fields(result)} == {
        "request_id", "prompt_ids", "output_ids", "finish_reason", "first_token_s", "total_s", "preemptions",
        "logprobs", "prompt_logprobs", "cached_tokens"}  # a new field must be added to the codec
    assert output_from_wire(wire(output_to_wire(out, 16, result))) == (out, 16, result)
    bare = StepOutput("cmpl-2", None, True)
    assert output_from_wire(wire(output_to_wire(bare, None, None))) == (bare, None, None)
    assert result_from_wire(wire(result_to_wire(result))) == result


def test_the_served_facts_carry_the_tokenizer(tmp_path):
    from runtime.artifact.tokenizer import TextTokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = TextTokenizer(tok.to_str(), {"eos_token": "b"}, "{{ messages[0]['content'] }}", "somewhere")
    served = ServedModel("m", engine=object(), vocab_size=3, max_model_len=64, tokenizer=tokenizer, eos_token_id=1,
                         info={"family": "qwen3_next"})
    back, summary = served_from_wire(wire(served_to_wire(served, "4 slots")))
    assert summary == "4 slots" and back.engine is None
    assert (back.name, back.vocab_size, back.max_model_len, back.eos_token_id, back.info) == \
        ("m", 3, 64, 1, {"family": "qwen3_next"})
    assert back.tokenizer.encode("a b a") == [0, 1, 0] and back.tokenizer.has_chat_template
    assert back.tokenizer.source == "somewhere" and back.tokenizer.eos_token_id == 1
    no_tokenizer = dataclasses.replace(served, tokenizer=None)
    assert served_from_wire(wire(served_to_wire(no_tokenizer, "")))[0].tokenizer is None
