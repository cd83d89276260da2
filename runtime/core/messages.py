"""The engine core's messages: what crosses between the API server and the engine core, as msgpack.

Every message is a list whose first item names it; every value in it is plain data (ints,
floats, strings, lists, maps), packed with msgpack: compact, fast, and safe to unpack (unlike
pickle it cannot run code), and token ids travel as ints, never as text.

server -> core                                   core -> server
  ["add", call, prompt_ids, [params], [ids]]       ["ready", facts]  (once, after the load)
  ["cancel", request_id]                           ["refused", code, message, hint]  (the load failed)
  ["stats", call]                                  ["reply", call, value] / ["error", call, kind, message]
  ["stop"]                                         ["step", [output]]  (each step's outputs)
                                                   ["done", request_id, result]  (a cancelled request)
                                                   ["failed", message]  (a step raised; the core exits)
                                                   ["stopped"]  (after "stop": the core exits)

An output is [request_id, token, finished, logprob, prompt_logprobs, cached_tokens, result]: a
StepOutput, the prompt tokens the prefix cache gave the request, and the RequestResult of a
request that finished with this output (None otherwise). A structured-output request's grammar
crosses as its response_format (`GrammarSpec`); the core compiles it, where the sampling runs.

It does not send or receive (process.py and client.py do).
"""

from __future__ import annotations

import dataclasses

import msgpack

from runtime.artifact.tokenizer import TextTokenizer
from runtime.assembly import ServedModel
from runtime.engine.engine import RequestResult, StepOutput
from runtime.engine.logprobs import TokenLogprob
from runtime.engine.sampling import SamplingParams

__all__ = ["GrammarSpec", "pack", "unpack", "params_to_wire", "params_from_wire", "output_to_wire",
           "output_from_wire", "result_to_wire", "result_from_wire", "served_to_wire", "served_from_wire"]


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """A request's response_format on the server side: SamplingParams.grammar until the core compiles it."""

    response_format: dict


def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list:
    # strict_map_key=False: logit_bias maps int token ids
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.name != "grammar"]


def params_to_wire(params: SamplingParams) -> dict:
    if params.grammar is not None and not isinstance(params.grammar, GrammarSpec):
        raise TypeError(f"a compiled grammar ({params.grammar!r}) does not cross processes: send its GrammarSpec")
    wire = {name: getattr(params, name) for name in _PARAM_FIELDS}
    wire["stop_token_ids"] = sorted(params.stop_token_ids)
    wire["logit_bias"] = dict(params.logit_bias)
    wire["grammar"] = None if params.grammar is None else params.grammar.response_format
    return wire


def params_from_wire(wire: dict, compile_grammar=None) -> SamplingParams:
    """`compile_grammar(response_format) -> Grammar` in the core; without it the grammar stays a GrammarSpec."""
    fields = {name: wire[name] for name in _PARAM_FIELDS}
    grammar = wire["grammar"]
    if grammar is not None:
        grammar = compile_grammar(grammar) if compile_grammar is not None else GrammarSpec(grammar)
    return SamplingParams(**fields, grammar=grammar)


def _logprob_to_wire(lp: TokenLogprob | None):
    return None if lp is None else [lp.token, lp.logprob, [list(t) for t in lp.top]]


def _logprob_from_wire(wire) -> TokenLogprob | None:
    return None if wire is None else TokenLogprob(wire[0], wire[1], tuple(tuple(t) for t in wire[2]))


def _logprobs_to_wire(lps):
    return None if lps is None else [_logprob_to_wire(lp) for lp in lps]


def _logprobs_from_wire(wire):
    return None if wire is None else tuple(_logprob_from_wire(lp) for lp in wire)


def result_to_wire(result: RequestResult) -> list:
    return [result.request_id, list(result.prompt_ids), list(result.output_ids), result.finish_reason,
            result.first_token_s, result.total_s, result.preemptions, _logprobs_to_wire(result.logprobs),
            _logprobs_to_wire(result.prompt_logprobs), result.cached_tokens]


def result_from_wire(wire: list) -> RequestResult:
    (request_id, prompt_ids, output_ids, reason, first_token_s, total_s, preemptions, logprobs, prompt_logprobs,
     cached_tokens) = wire
    return RequestResult(request_id, tuple(prompt_ids), tuple(output_ids), reason, first_token_s, total_s,
                         preemptions, _logprobs_from_wire(logprobs), _logprobs_from_wire(prompt_logprobs),
                         cached_tokens)


def output_to_wire(out: StepOutput, cached_tokens: int | None, result: RequestResult | None) -> list:
    return [out.request_id, out.token, out.finished, _logprob_to_wire(out.logprob),
            _logprobs_to_wire(out.prompt_logprobs), cached_tokens, None if result is None else result_to_wire(result)]


def output_from_wire(wire: list) -> tuple[StepOutput, int | None, RequestResult | None]:
    request_id, token, finished, logprob, prompt_logprobs, cached_tokens, result = wire
    out = StepOutput(request_id, token, finished, _logprob_from_wire(logprob), _logprobs_from_wire(prompt_logprobs))
    return out, cached_tokens, None if result is None else result_from_wire(result)


def served_to_wire(served: ServedModel, summary: str) -> dict:
    """The "ready" message's facts: what the server needs of the served model, its tokenizer as data."""
    tokenizer = served.tokenizer
    return {"name": served.name, "vocab_size": served.vocab_size, "max_model_len": served.max_model_len,
            "eos_token_id": served.eos_token_id, "info": served.info, "summary": summary,
            "tokenizer": None if tokenizer is None else {
                "json": tokenizer.tokenizer_json, "config": tokenizer.config,
                "chat_template": tokenizer.chat_template, "source": tokenizer.source}}


def served_from_wire(facts: dict) -> tuple[ServedModel, str]:
    """(the served model without its engine, which stays in the core; the core's one-line summary)."""
    spec = facts["tokenizer"]
    tokenizer = None if spec is None else TextTokenizer(spec["json"], spec["config"], spec["chat_template"],
                                                        spec["source"])
    return ServedModel(name=facts["name"], engine=None, vocab_size=facts["vocab_size"],
                       max_model_len=facts["max_model_len"], tokenizer=tokenizer, eos_token_id=facts["eos_token_id"],
                       info=facts["info"]), facts["summary"]
