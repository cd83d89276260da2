"""Structured output (OpenAI response_format through xgrammar) on `hgc serve`, with and without
speculative decoding, streamed and not.

Two servers over one tiny qwen3_next artifact and its real tokenizer (Metaspace BPE): one plain,
one with --speculative-tokens 3. Thirty JSON schemas (nested objects, arrays, enums, numbers and
integers with bounds, required and optional fields, patterns, anyOf) each go to both servers,
streamed to one and whole to the other (alternating which), half greedy and half sampled: every
response ends with finish_reason "stop" and its text parses and validates against its schema
(`jsonschema`). A random-weight model reaches a valid end because the grammar's bitmask allows
only valid tokens and, once the JSON is complete, only the end-of-sequence token; the schemas
bound every string, array and number (maxLength, maxItems, enums, ranges), so a short max_tokens
suffices. What "length" means for structured output: a response cut by max_tokens before its
JSON closed ends with finish_reason "length" and a text that is a valid prefix but not a JSON
document (tested below); a client must check finish_reason, as with OpenAI.

Greedy responses are the same with and without speculation (the draft changes speed, never
tokens), and the streamed text equals the whole one (each greedy schema is streamed by one server,
whole by the other). A schema xgrammar cannot compile is a 400 naming why; no request crashes the
server, and afterwards every slot and page is free.

The same two servers show speculative decoding through `hgc serve` for qwen3_next (D = 3):
tests/runtime/engine/test_speculative.py's eight mixed-length prompts, unconstrained, get the plain server's
greedy tokens.
"""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from testkit.helpers import ServerProcess, shared_artifact  # noqa: E402
from tests.server.test_server import metrics, post, wait_all_free  # noqa: E402

pytestmark = pytest.mark.slow  # two servers (the test run's shared compile), 76 requests: about 40 s on 2 cores

MODEL = "tiny"
MAX_TOKENS = 120

_int = lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}  # noqa: E731
_str = lambda n: {"type": "string", "maxLength": n}  # noqa: E731
_num = lambda lo, hi: {"type": "number", "minimum": lo, "maximum": hi}  # noqa: E731


def _obj(required=None, **props):
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCHEMAS = [
    _obj(name=_str(8), age=_int(0, 120)),
    _obj(x=_num(-1.5, 2.5)),
    {"type": "array", "items": {"enum": ["red", "dark blue", "green"]}, "minItems": 1, "maxItems": 3},
    _obj(tags={"type": "array", "items": _str(4), "maxItems": 3}),
    _obj(point=_obj(x=_int(-10, 10), y=_int(-10, 10))),
    _obj(status={"enum": ["ok", "error", "pending"]}, code=_int(100, 599)),
    _obj(flag={"type": "boolean"}),
    _obj(items={"type": "array", "items": _obj(id=_int(0, 99), label=_str(5)), "maxItems": 2}),
    _obj(["name"], name=_str(6), nickname=_str(4)),
    _obj(a=_obj(b=_obj(c=_int(0, 9)))),
    {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 4},
    _obj(price=_num(0, 100), currency={"enum": ["USD", "EUR"]}),
    _obj(kind={"const": "circle"}, radius=_num(0, 10)),
    _obj(matrix={"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2, "items": _int(0, 9)}}),
    _obj(value={"anyOf": [_int(0, 9), _str(3)]}),
    _obj(date={"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}),
    {"enum": ["alpha", "beta", "gamma"]},
    _obj(count=_int(1, 3), names={"type": "array", "items": _str(3), "minItems": 1, "maxItems": 3}),
    _obj(temperature=_num(-50, 50), unit={"enum": ["C", "F"]}),
    _obj(["user"], user=_obj(["id"], id=_int(1, 1000), email=_str(12)),
         roles={"type": "array", "items": {"enum": ["admin", "user"]}, "maxItems": 2}),
    _obj(ok={"type": "boolean"}, errors={"type": "array", "items": _str(6), "maxItems": 2}),
    {"type": "array", "items": _obj(k=_str(3), v=_int(0, 9)), "minItems": 1, "maxItems": 2},
    _obj(ratio=_num(0, 1)),
    _obj(title={"type": "string", "minLength": 1, "maxLength": 10}, pages=_int(1, 500)),
    _obj(coords={"type": "array", "items": _num(-90, 90), "minItems": 2, "maxItems": 2}),
    _obj(maybe={"anyOf": [{"type": "null"}, _str(4)]}),
    _obj(level={"type": "integer", "enum": [1, 2, 3]}),
    _obj(meta=_obj(version=_int(1, 9), stable={"type": "boolean"}), name=_str(5)),
    _obj(letters={"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}),
    _obj(["score", "passed"], score=_int(-100, 100), passed={"type": "boolean"}, note=_str(8)),
]
assert len(SCHEMAS) == 30


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(plain server, speculative server) over one tiny qwen3_next artifact with its tokenizer."""
    artifact = shared_artifact(tmp_path_factory, "qwen3_next")[1]
    flags = [str(artifact), "--served-model-name", MODEL, "--max-model-len", "256", "--slots", "64"]
    plain = ServerProcess(flags)
    spec = ServerProcess(flags + ["--speculative-tokens", "3"])
    try:
        yield plain.wait_ready(), spec.wait_ready()
    finally:
        for server in (plain, spec):
            assert server.stop() == 0, server.log()


def streamed(i: int, server: str) -> bool:
    """Whether schema i goes to `server` ("plain" or "spec") streamed: to exactly one of the two,
    alternating over greedy (even i) and sampled (odd i) schemas alike."""
    return ((i // 2) % 2 == 1) == (server == "plain")


def body(i: int, schema: dict, stream: bool) -> dict:
    """Request i: completions or chat, greedy or seeded sampling, constrained to `schema`."""
    out = {"model": MODEL, "max_tokens": MAX_TOKENS, "stream": stream,
           "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}}
    out.update(temperature=0.0) if i % 2 == 0 else out.update(temperature=1.0, seed=100 + i)
    if i % 3 == 0:
        out["messages"] = [{"role": "user", "content": "Give me JSON."}]
    else:
        out["prompt"] = "The answer in JSON:"
    return out


def route(b: dict) -> str:
    return "/v1/chat/completions" if "messages" in b else "/v1/completions"


async def send_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(*(post(client, route(b), b) for b in bodies))


def test_every_schema_gives_valid_json_with_and_without_drafts_streamed_or_not(servers):
    plain, spec = servers
    results = {}
    for name, server in (("plain", plain), ("spec", spec)):
        bodies = [body(i, s, streamed(i, name)) for i, s in enumerate(SCHEMAS)]
        results[name] = asyncio.run(send_all(server.url, bodies))
    for name, got in results.items():
        for i, r in enumerate(got):
            where = f"{name} server, schema {i}, {'streamed' if streamed(i, name) else 'whole'}: {r['text']!r}"
            assert r["finish_reason"] == "stop", where
            try:
                jsonschema.validate(json.loads(r["text"]), SCHEMAS[i])
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                pytest.fail(f"{where}: {e}")
    greedy = range(0, len(SCHEMAS), 2)  # one server streamed each, the other sent it whole
    assert [results["plain"][i]["token_ids"] for i in greedy] == [results["spec"][i]["token_ids"] for i in greedy]
    assert [results["plain"][i]["text"] for i in greedy] == [results["spec"][i]["text"] for i in greedy]
    m = metrics(spec.url)
    assert m["hgc_spec_draft_tokens"] == 3 and m["hgc_spec_verify_steps_total"] > 0
    assert 0 < m["hgc_spec_acceptance_rate"] <= 1  # the grammar leaves the draft little to get wrong
    for server in servers:
        wait_all_free(server.url)


def test_unconstrained_greedy_tokens_with_drafts_are_plain_decodings(servers):
    """qwen3_next, D = 3, through `hgc serve`: the eight mixed-length prompts of
    tests/runtime/engine/test_speculative.py (lengths 1-17, 3-14 new tokens, every other one streamed)."""
    from tests.runtime.engine.test_speculative import served_tokens

    plain, spec = servers
    before = metrics(spec.url)["hgc_spec_verify_steps_total"]
    assert asyncio.run(served_tokens(spec.url, MODEL)) == asyncio.run(served_tokens(plain.url, MODEL))
    assert metrics(spec.url)["hgc_spec_verify_steps_total"] > before
    for server in servers:
        wait_all_free(server.url)


def test_a_schema_xgrammar_cannot_compile_is_a_400_naming_why(servers):
    plain, spec = servers
    for server in servers:
        for schema, why in (({"type": "strin"}, "Unsupported type"),
                            ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}, "nope")):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "x", "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": schema}}})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "response_format" and "xgrammar cannot compile it" in error["message"], error
            assert why in error["message"], error
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "no schema"}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format.json_schema.schema"
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "x", "ignore_eos": True, "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_a_response_cut_by_max_tokens_ends_with_length_and_is_not_json(servers):
    schema = _obj(first=_str(6), second=_str(6), third=_str(6))
    for server in servers:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "cut", "schema": schema}}})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and '{"first": '.startswith(choice["text"])
        with pytest.raises(json.JSONDecodeError):
            json.loads(choice["text"])


def test_json_object_gives_a_json_object_or_says_it_was_cut(servers):
    for server in servers:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 60,
            "temperature": 0, "response_format": {"type": "json_object"}})
        choice = r.json()["choices"][0]
        text = choice["message"]["content"]
        assert text.startswith("{") and choice["finish_reason"] in ("stop", "length"), choice
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
