"""`hgc serve`: a real uvicorn server over a compiled tiny artifact, driven over loopback HTTP.

One server process (python -m hgc serve) serves the module's tests; the SIGTERM test starts
its own, and the no-tokenizer test runs one in a thread of this process. Every request goes to
127.0.0.1 and every loop is bounded.

- 200 concurrent requests (plain, streamed, seeded sampling, chat) each equal the same request
  sent alone, and afterwards every state slot and KV page is free (read from /metrics).
- 50 clients that leave mid-stream (and some that leave before a whole response) are cancelled:
  their slots and pages come back, and /metrics counts them as cancelled.
- Each bad request gets its 4xx with the OpenAI error body, and the next good request succeeds.
- /metrics parses with prometheus_client's parser.
- SIGTERM with requests in flight: the process exits 0 within its bound; streams end with
  finish_reason "abort" and [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prom_parser = pytest.importorskip("prometheus_client.parser")

from testkit.helpers import ServerProcess, shared_artifact  # noqa: E402

pytestmark = pytest.mark.slow  # two server processes (the test run's shared compile): about 45 s on 2 cores

MODEL = "tiny"
MAX_MODEL_LEN = 256
LIMIT = 200  # --max-tokens-limit
SIGTERM_BOUND = 6.0  # --shutdown-timeout of the SIGTERM test's server: cancel at 3 s, 3 s to flush


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> tuple[Path, Path]:
    """(artifact folder, checkpoint folder): a seeded tiny qwen3_next compiled with `hgc compile`,
    the test run's (testkit/helpers.shared_artifact: the servers only read it)."""
    ckpt, art = shared_artifact(tmp_path_factory, "qwen3_next")
    return art, ckpt


def tokenizer_flag(art: Path, ckpt: Path) -> list[str]:
    # The artifact carries the checkpoint's tokenizer once the writer copies it; until then, point at it.
    return [] if (art / "tokenizer.json").is_file() else ["--tokenizer", str(ckpt)]


@pytest.fixture(scope="module")
def servers(artifact):
    """(the shared server, one for the SIGTERM test): started together, so their start-ups overlap."""
    art, ckpt = artifact
    shared = ServerProcess([str(art), "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
                            "--max-tokens-limit", str(LIMIT), "--slots", "64", "--token-budget", "512",
                            *tokenizer_flag(art, ckpt)])
    # Long requests (4096 tokens of context) and a short bound: only the shutdown can end them in time.
    doomed = ServerProcess([str(art), "--served-model-name", MODEL, "--max-model-len", "4096", "--slots", "8",
                            "--shutdown-timeout", str(SIGTERM_BOUND), *tokenizer_flag(art, ckpt)])
    try:
        yield shared.wait_ready(), doomed.wait_ready()
    finally:
        doomed.kill()
        assert shared.stop() == 0, shared.log()


@pytest.fixture
def server(servers):
    return servers[0]


def metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client: {'name{label="v"}': value}."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in prom_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_all_free(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until nothing is open, queued or running and every slot and page is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        free = (m["hgc_open_requests"] == 0 and m["hgc_queue_depth"] == 0 and m["hgc_running_requests"] == 0
                and m["hgc_state_slots_free"] == m["hgc_state_slots"] and m["hgc_kv_pages_free"] == m["hgc_kv_pages"])
        if free or time.monotonic() > deadline:
            assert free, {k: v for k, v in m.items() if "slots" in k or "pages" in k or "requests" in k or "queue" in k}
            return m


def ok_request(url: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2,
                                                   "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) >= 1


# -- async client helpers ------------------------------------------------------------------------


async def post(client, path: str, body: dict) -> dict:
    """One request, streamed or not; returns {"token_ids", "text", "finish_reason"}."""
    if not body.get("stream"):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {"token_ids": choice["token_ids"], "text": text, "finish_reason": choice["finish_reason"]}
    ids, text, reason, done = [], "", None, False
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                ids += choice["token_ids"]
                text += choice.get("text", "") if "text" in choice else (choice["delta"].get("content") or "")
                reason = choice["finish_reason"] or reason
    assert done, "the stream must end with data: [DONE]"
    return {"token_ids": ids, "text": text, "finish_reason": reason}


def path_of(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


WORDS = "the model reads a small text and the engine runs many requests in one step hello world".split()


def make_requests(count: int, seed: int = 7) -> list[dict]:
    """Greedy and seeded-sampling requests, by token ids, text and chat (not streamed)."""
    g = random.Random(seed)
    out = []
    for i in range(count):
        body = {"model": MODEL, "max_tokens": g.randint(1, 12), "temperature": 0.0, "ignore_eos": True}
        kind = i % 5
        if kind in (0, 1, 2):
            body["prompt"] = [g.randrange(2, 256) for _ in range(g.randint(1, 30))]
        elif kind == 3:
            body["prompt"] = " ".join(g.choice(WORDS) for _ in range(g.randint(1, 12)))
        else:
            body["messages"] = [{"role": "user", "content": " ".join(g.choice(WORDS) for _ in range(g.randint(1, 8)))}]
        if kind == 2:
            body.update(temperature=0.9, top_p=0.95, top_k=40, seed=1000 + i)  # seeded: batch-invariant too
        out.append(body)
    return out


# -- tests ---------------------------------------------------------------------------------------


def test_health_models_and_metrics_parse(server):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN and models["data"][0]["tokenizer"] is True
    ok_request(server.url)
    r = httpx.get(f"{server.url}/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in prom_parser.text_string_to_metric_families(r.text)}
    for name in ("hgc_queue_depth", "hgc_running_requests", "hgc_state_slots_free", "hgc_kv_pages_free",
                 "hgc_generation_tokens_per_second", "hgc_engine_steps", "hgc_generation_tokens",
                 "hgc_requests_finished", "hgc_time_to_first_token_seconds"):
        assert name in families, sorted(families)
    assert families["hgc_engine_steps"].type == "counter"
    steps = {s.labels["execution"]: s.value for s in families["hgc_engine_steps"].samples}
    assert steps["graph_replay"] == steps["piecewise"] == 0 and steps["eager"] >= 1  # no CUDA graphs on the CPU
    assert metrics(server.url)["hgc_generation_tokens_total"] >= 1


def test_metrics_text_takes_graph_runner_counters_and_escapes_labels():
    from runtime.server.metrics import MetricsText, render_metrics

    engine = {"queue_depth": 1, "running": 2, "free_slots": 3, "total_slots": 5, "free_pages": 7, "total_pages": 9,
              "steps": 10, "graph_replays": 5, "piecewise_steps": 2, "prefill_steps": 4, "decode_steps": 6,
              "overlapped_steps": 7, "synchronous_steps": 3,
              "prefill_s": 0.5, "decode_s": 0.25, "tokens_generated": 40, "prefill_tokens": 80, "preemptions": 0,
              "recent_steps": [{"sampled": 4, "seconds": 0.5}, {"sampled": 2, "seconds": 0.25}]}
    server = {"open_requests": 2, "requests": {"chat": 1}, "finished": {"stop": 3}, "errors": {400: 2},
              "prompt_tokens": 12, "ttft_sum": 0.1, "ttft_count": 1, "duration_sum": 0.5, "duration_count": 1,
              "healthy": True, "draining": False}
    families = {f.name: f for f in prom_parser.text_string_to_metric_families(render_metrics(engine, server))}
    steps = {s.labels["execution"]: s.value for s in families["hgc_engine_steps"].samples}
    assert steps == {"graph_replay": 5, "piecewise": 2, "eager": 3}
    schedule = {s.labels["schedule"]: s.value for s in families["hgc_engine_schedule_steps"].samples}
    assert schedule == {"overlapped": 7, "synchronous": 3}
    assert families["hgc_generation_tokens_per_second"].samples[0].value == 8.0
    assert families["hgc_request_errors"].samples[0].labels == {"status": "400"}
    m = MetricsText()
    m.add("odd_total", "counter", "Labels with quotes.", [({"why": 'a "b"\\c\nd'}, 1)])
    sample = next(prom_parser.text_string_to_metric_families(m.text())).samples[0]
    assert sample.labels == {"why": 'a "b"\\c\nd'}


def test_text_chat_stream_and_stop_strings(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            for body in ({"model": MODEL, "prompt": "Hello, how are you today?", "max_tokens": 12},
                         {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": "Hi there"}], "max_tokens": 12}):
                body.update(temperature=0, ignore_eos=True)
                whole = await post(client, path_of(body), body)
                streamed = await post(client, path_of(body), {**body, "stream": True})
                assert streamed == whole and len(whole["token_ids"]) == 12 and whole["finish_reason"] == "length"
            # A stop string cuts the text before it and ends the request.
            body = {"model": MODEL, "prompt": "The engine runs", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            whole = await post(client, "/v1/completions", body)
            text = whole["text"]
            visible = [i for i in range(4, len(text) - 2) if not text[i].isspace()]
            assert visible, f"40 greedy tokens gave almost no text: {text!r}"
            cut = visible[len(visible) // 2]
            stop = text[cut:cut + 2]
            for stream in (False, True):
                got = await post(client, "/v1/completions", {**body, "stop": [stop], "stream": stream})
                assert got["finish_reason"] == "stop" and got["text"] == text[:text.index(stop)], (got, stop)
                assert len(got["token_ids"]) < 40
            # The eos token ends a request by default; its text is not shown.
            got = await post(client, "/v1/completions", {**body, "ignore_eos": False, "stop_token_ids": [whole["token_ids"][3]]})
            assert got["finish_reason"] == "stop" and got["token_ids"][-1] in (1, whole["token_ids"][3])

    asyncio.run(run())


def test_a_repeated_prompt_reports_cached_tokens_in_usage_and_metrics(server):
    """The prefix cache is on by default: the second of two identical prompts reports the cached
    prompt tokens (usage.prompt_tokens_details.cached_tokens), streamed or not, gives the same
    tokens, and /metrics counts the hit."""
    g = random.Random(16)
    prompt = [g.randrange(2, 256) for _ in range(45)]  # 2 whole pages of 16 before its last token
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    before = metrics(server.url)
    first = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    second = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert second["usage"]["prompt_tokens"] == 45
    assert second["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    usage = None
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[len("data: "):]).get("usage") or usage
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(g.choice(WORDS) for _ in range(40))}],
            "max_tokens": 3, "temperature": 0}
    # The third at the latest hits (the second does when the prompt does not end on a page boundary).
    chats = [httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json() for _ in range(3)]
    assert chats[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert chats[2]["choices"][0]["token_ids"] == chats[0]["choices"][0]["token_ids"]
    after = wait_all_free(server.url)
    assert after["hgc_prefix_cache_enabled"] == 1 and after["hgc_prefix_cache_snapshot_bytes"] > 0
    assert after["hgc_prefix_cache_hits_total"] - before["hgc_prefix_cache_hits_total"] >= 2 * 32 + 16
    assert after["hgc_prefix_cache_requests_total{outcome=\"hit\"}"] >= 3
    assert 0 < after["hgc_prefix_cache_hit_rate"] < 1


def test_200_concurrent_requests_match_alone_and_free_everything(server):
    # 100 distinct requests, each sent twice at once: streamed and not. Each of the 200 must equal
    # the same request sent alone (and so the streamed and the whole response agree under load).
    distinct = make_requests(100)
    requests = [{**b, "stream": stream} for b in distinct for stream in (False, True)]

    async def run():
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            alone = [await post(client, path_of(b), b) for b in distinct]
            together = await asyncio.gather(*(post(client, path_of(b), b) for b in requests))
        return alone, together

    alone, together = asyncio.run(run())
    assert len(together) == 200
    for i, got in enumerate(together):
        want = alone[i // 2]
        assert got["token_ids"] == want["token_ids"], f"request {i}: {requests[i]}"
        assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"] == "length"
        assert len(got["token_ids"]) == requests[i]["max_tokens"]
    m = wait_all_free(server.url)
    assert m['hgc_requests_total{endpoint="chat"}'] >= 60


async def open_request(url: str, body: dict):
    """Raw HTTP/1.1 over a socket (so leaving is a real disconnect): send the request, return the streams."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    return reader, writer


async def leave_mid_stream(url: str, body: dict, events_before_leaving: int) -> int:
    """Send a streamed request, read some SSE events, close the socket. Returns the events read."""
    reader, writer = await open_request(url, body)
    seen = 0
    try:
        while seen < events_before_leaving:
            line = await asyncio.wait_for(reader.readline(), 60)
            if not line:
                break
            seen += line.startswith(b"data: ")
    finally:
        writer.close()
    return seen


def test_clients_leaving_mid_stream_free_their_slots_and_pages(server):
    before = metrics(server.url)

    async def run():
        g = random.Random(3)
        seen = await asyncio.gather(*(
            leave_mid_stream(server.url, {"model": MODEL, "prompt": [g.randrange(2, 256) for _ in range(8)],
                                          "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True, "stream": True},
                                 events_before_leaving=1 + i % 3)
            for i in range(50)))
        # Non-streamed requests whose clients leave while the engine runs them: cancelled too.
        body = {"model": MODEL, "prompt": [7, 8, 9], "max_tokens": LIMIT, "temperature": 0, "ignore_eos": True}
        wait_all_free(server.url)  # the streams' cancels are done: the open count is the five below
        opened = [await open_request(server.url, body) for _ in range(5)]
        deadline = time.monotonic() + 30
        while metrics(server.url)["hgc_open_requests"] < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # submitted and running: leaving now cancels a live request
        for _, writer in opened:
            writer.close()
        return seen

    seen = asyncio.run(run())
    assert all(s >= 1 for s in seen)
    after = wait_all_free(server.url)
    cancelled = after['hgc_requests_finished_total{reason="cancelled"}'] - \
        before['hgc_requests_finished_total{reason="cancelled"}']
    # Every stream that left was cancelled. The five non-streamed requests are cancelled when the
    # server notices the closed socket; on a loaded machine one may reach max_tokens first, which
    # is also a clean end. Either way nothing stays held (wait_all_free above).
    assert 50 <= cancelled <= 55, cancelled
    ok_request(server.url)


BAD_REQUESTS = [
    # (name, path, raw body or dict, status, param, code)
    ("invalid json", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None, "invalid_json"),
    ("not an object", "/v1/completions", b"[1, 2, 3]", 400, None, "invalid_json"),
    ("missing prompt", "/v1/completions", {"model": MODEL}, 400, "prompt", "missing"),
    ("missing model", "/v1/completions", {"prompt": [1, 2]}, 400, "model", "missing"),
    ("prompt wrong type", "/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", None),
    ("prompts mixing text and ids", "/v1/completions", {"model": MODEL, "prompt": ["a", [1, 2]]}, 400, "prompt",
     None),
    ("an empty prompt among several", "/v1/completions", {"model": MODEL, "prompt": [[1], []]}, 400, "prompt", None),
    ("a token id outside vocab in the second prompt", "/v1/completions",
     {"model": MODEL, "prompt": [[1], [2, 10 ** 6]]}, 400, "prompt.1", "invalid_token_id"),
    ("empty prompt", "/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("max_tokens as string", "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": "16"}, 400,
     "max_tokens", "int_type"),
    ("max_tokens zero", "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": 0}, 400, "max_tokens", None),
    ("max_tokens negative", "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": -3}, 400,
     "max_tokens", None),
    ("max_tokens over limit", "/v1/completions", {"model": MODEL, "prompt": [1], "max_tokens": LIMIT + 1}, 400,
     "max_tokens", "max_tokens_too_large"),
    ("temperature as string", "/v1/completions", {"model": MODEL, "prompt": [1], "temperature": "hot"}, 400,
     "temperature", None),
    ("temperature too high", "/v1/completions", {"model": MODEL, "prompt": [1], "temperature": 3}, 400,
     "temperature", None),
    ("top_p zero", "/v1/completions", {"model": MODEL, "prompt": [1], "top_p": 0}, 400, "top_p", None),
    ("negative seed", "/v1/completions", {"model": MODEL, "prompt": [1], "seed": -1}, 400, "seed", None),
    ("stream not bool", "/v1/completions", {"model": MODEL, "prompt": [1], "stream": "yes"}, 400, "stream", None),
    ("five stop strings", "/v1/completions", {"model": MODEL, "prompt": [1], "stop": list("abcde")}, 400, "stop",
     None),
    ("token id outside vocab", "/v1/completions", {"model": MODEL, "prompt": [1, 10 ** 6]}, 400, "prompt",
     "invalid_token_id"),
    ("prompt longer than context", "/v1/completions", {"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN + 4)}, 400,
     "prompt", "context_length_exceeded"),
    ("prompt plus max_tokens over context", "/v1/completions",
     {"model": MODEL, "prompt": [5] * 200, "max_tokens": 100}, 400, "max_tokens", "context_length_exceeded"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": [1]}, 404, "model", "model_not_found"),
    ("n zero", "/v1/completions", {"model": MODEL, "prompt": [1], "n": 0}, 400, "n", None),
    ("n above 128", "/v1/completions", {"model": MODEL, "prompt": [1], "n": 129}, 400, "n", None),
    ("best_of above n", "/v1/completions", {"model": MODEL, "prompt": [1], "best_of": 3}, 400, "best_of", None),
    ("logprobs above 20", "/v1/completions", {"model": MODEL, "prompt": [1], "logprobs": 21}, 400, "logprobs", None),
    ("logprobs true on completions", "/v1/completions", {"model": MODEL, "prompt": [1], "logprobs": True}, 400,
     "logprobs", None),
    ("chat top_logprobs without logprobs", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs", None),
    ("chat logprobs as a number", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400, "logprobs", None),
    ("presence_penalty above 2", "/v1/completions", {"model": MODEL, "prompt": [1], "presence_penalty": 2.5}, 400,
     "presence_penalty", None),
    ("repetition_penalty zero", "/v1/completions", {"model": MODEL, "prompt": [1], "repetition_penalty": 0}, 400,
     "repetition_penalty", None),
    ("logit_bias key not a token id", "/v1/completions", {"model": MODEL, "prompt": [1], "logit_bias": {"x": 1}},
     400, "logit_bias", None),
    ("logit_bias above 100", "/v1/completions", {"model": MODEL, "prompt": [1], "logit_bias": {"5": 101}}, 400,
     "logit_bias", None),
    ("logit_bias token outside vocab", "/v1/completions",
     {"model": MODEL, "prompt": [1], "logit_bias": {"1000000": 1}}, 400, "logit_bias", "invalid_token_id"),
    ("echo with max_tokens over context", "/v1/completions",
     {"model": MODEL, "prompt": [5] * 250, "echo": True, "max_tokens": 10}, 400, "max_tokens",
     "context_length_exceeded"),
    ("chat without messages", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", None),
    ("chat unknown role", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     400, "messages.0.role", None),
    ("chat messages wrong type", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("chat image part", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content", None),
    ("chat unknown model", "/v1/chat/completions",
     {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "model_not_found"),
    ("unknown route", "/v1/nothing", {"model": MODEL}, 404, None, None),
]


@pytest.mark.parametrize("name,path,body,status,param,code", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_4xx_and_the_server_keeps_serving(server, name, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    ok_request(server.url)


def test_wrong_method_gets_405(server):
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    ok_request(server.url)


@contextlib.contextmanager
def server_in_thread(served, options=None):
    """The same app under uvicorn in a thread of this process (no signals there)."""
    import uvicorn

    from runtime.server.app import create_app

    app = create_app(served, options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(30)
        sock.close()


def test_without_a_tokenizer_token_ids_work_and_text_is_refused(artifact):
    import torch

    from runtime.assembly import EngineOptions, load_served_model

    art, _ = artifact
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        served = load_served_model(art, name=MODEL, options=EngineOptions(slots=4, max_model_len=64))
        served.tokenizer = None  # whatever the artifact carries: this server has none
        with server_in_thread(served) as url:
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 4,
                                                          "temperature": 0}, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == ""
            assert len(r.json()["choices"][0]["token_ids"]) == 4
            for path, body, param in (("/v1/completions", {"prompt": "hello"}, "prompt"),
                                      ("/v1/completions", {"prompt": [3], "stop": ["x"]}, "stop"),
                                      ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                                       "messages")):
                r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=30)
                assert r.status_code == 400 and r.json()["error"]["code"] == "no_tokenizer", r.text
                assert r.json()["error"]["param"] == param
            assert httpx.get(f"{url}/health").status_code == 200
    finally:
        torch.set_num_threads(threads)


def test_an_engine_failure_fails_open_requests_and_turns_health_503(artifact):
    from runtime.artifact.loader import read_artifact
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.assembly import EngineOptions, ServedModel, build_engine

    registry = read_artifact(artifact[0]).registry

    def bind(ops):
        def forward(input_ids, positions, logits_index):
            raise RuntimeError("kernel exploded")
        return forward

    engine = build_engine(registry, bind, EngineOptions(slots=2, max_model_len=32), 32,
                          backend_factory=CPUReferenceBackend)
    served = ServedModel(MODEL, engine, vocab_size=256, max_model_len=engine.max_seq_len)
    with server_in_thread(served) as url:
        body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "kernel exploded" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert metrics(url)["hgc_engine_healthy"] == 0


def test_memory_budget_sizes_the_kv_pool_with_the_planner(artifact):
    from runtime.artifact.loader import read_artifact
    from runtime.cache.memory_planner import MemoryPlanError, plan_memory
    from runtime.backends.cpu_reference import CPUReferenceBackend
    from runtime.assembly import EngineOptions, build_engine

    registry = read_artifact(artifact[0]).registry
    options = EngineOptions(slots=4, memory_budget_bytes=8 << 20, max_model_len=128)
    engine = build_engine(registry, lambda ops: None, options, 128, weight_bytes=1 << 20,
                          backend_factory=CPUReferenceBackend)
    plan = plan_memory(registry, budget_bytes=8 << 20, weight_bytes=1 << 20, max_seq_len=128, page_size=16,
                       num_slots=4, snapshot_share=options.snapshot_share)
    assert engine.kv_pool.num_pages == plan.num_pages and engine.state_pool.num_slots == 4
    assert engine.prefix_cache.snapshots.num_snapshots == plan.num_snapshots > 0
    assert engine.prefix_cache.snapshots.nbytes() == plan.snapshot_bytes
    uncached = build_engine(registry, lambda ops: None, dataclasses.replace(options, prefix_cache=False), 128,
                            weight_bytes=1 << 20, backend_factory=CPUReferenceBackend)
    assert uncached.prefix_cache is None and uncached.kv_pool.num_pages > engine.kv_pool.num_pages
    with pytest.raises(MemoryPlanError):
        build_engine(registry, lambda ops: None, EngineOptions(slots=4, memory_budget_bytes=1 << 20), 128,
                     weight_bytes=1 << 20, backend_factory=CPUReferenceBackend)


def test_sigterm_with_requests_in_flight_exits_zero_within_the_bound(servers):
    proc, bound = servers[1], SIGTERM_BOUND
    # 4000 tokens each: many seconds of work, so only the shutdown can end these requests in time.
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 4000, "temperature": 0, "ignore_eos": True}

    async def run():
        started = asyncio.Event()
        first_chunks = 0

        async def stream(client):
            nonlocal first_chunks
            reason, done = None, False
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        if first_chunks < 4:
                            first_chunks += 1
                            if first_chunks == 4:
                                started.set()
                        reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
            return reason, done

        async with httpx.AsyncClient(base_url=proc.url, timeout=60) as client:
            tasks = [asyncio.ensure_future(stream(client)) for _ in range(4)]
            whole = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await asyncio.wait_for(started.wait(), 60)
            sent = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            response = await whole
            return sent, results, response

    sent, results, response = asyncio.run(run())
    try:
        rc = proc.proc.wait(bound + 10)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the server outlived its shutdown bound:\n" + proc.log())
    elapsed = time.monotonic() - sent
    assert rc == 0, proc.log()
    print(f"exit {elapsed:.2f} s after SIGTERM (bound {bound} s)")
    assert elapsed < bound + 5.0, elapsed  # the bound, plus process teardown on a loaded 2-core machine
    assert results == [("abort", True)] * 4  # each stream got its last chunk and [DONE]
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "abort"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{proc.url}/health", timeout=5)  # gone


# -- the OpenAI surface evaluation harnesses and chat clients use ---------------------------------


async def post_all(client, path: str, body: dict) -> dict:
    """A whole response, or a stream folded into the same shape: {"choices": [...by index], "usage"}."""
    if not body.get("stream"):
        r = await client.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()
    choices, usage = {}, None
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for part in chunk["choices"]:
                c = choices.setdefault(part["index"], {"index": part["index"], "text": "", "token_ids": [],
                                                       "finish_reason": None, "logprobs": None})
                c["text"] += part["text"] if "text" in part else (part["delta"].get("content") or "")
                c["token_ids"] += part["token_ids"]
                c["finish_reason"] = part["finish_reason"] or c["finish_reason"]
                if part["logprobs"] is not None:
                    if c["logprobs"] is None:
                        c["logprobs"] = {k: [] for k in part["logprobs"]}
                    for k, v in part["logprobs"].items():
                        c["logprobs"][k] += v
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


@pytest.fixture(scope="module")
def reference(artifact):
    """transformers' model of the served checkpoint, float32: log_softmax over a whole sequence."""
    transformers = pytest.importorskip("transformers")
    import torch

    hf = transformers.AutoModelForCausalLM.from_pretrained(artifact[1], dtype=torch.float32).eval()

    def logprobs(tokens: list[int]):
        with torch.no_grad():
            return torch.log_softmax(hf(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    return logprobs


def test_echo_logprobs_equal_the_reference_model_and_stream_like_the_whole(server, reference):
    prompt = [17, 60, 33, 91, 40, 120, 77, 8, 52]  # no special token (ids 0 .. 6)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": True,
            "logprobs": 3}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            plain = await post_all(client, "/v1/completions", {**body, "echo": False, "logprobs": None})
            whole = await post_all(client, "/v1/completions", body)
            streamed = await post_all(client, "/v1/completions", {**body, "stream": True})
            scored = await post_all(client, "/v1/completions", {**body, "max_tokens": 0})
            return plain, whole, streamed, scored

    plain, whole, streamed, scored = asyncio.run(run())
    choice = whole["choices"][0]
    assert choice["token_ids"] == plain["choices"][0]["token_ids"]  # asking for scores changes no token
    assert choice["text"] == streamed["choices"][0]["text"] and choice["text"].endswith(plain["choices"][0]["text"])
    lp = choice["logprobs"]
    tokens = prompt + choice["token_ids"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) \
        == len(tokens)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token
    ref = reference(tokens)
    for i in range(1, len(tokens)):
        assert abs(lp["token_logprobs"][i] - float(ref[i - 1, tokens[i]])) < 1e-4, i
        top = lp["top_logprobs"][i]
        assert 3 <= len(top) <= 4 and top[lp["tokens"][i]] == lp["token_logprobs"][i]
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx(ref[i - 1].topk(3).values.tolist(), abs=1e-4)
    # Offsets place each token's text in the choice's text; a special token (ids 0 .. 6) is written
    # out in "tokens" but adds nothing to the text.
    offsets = lp["text_offset"] + [len(choice["text"])]
    pieces = [choice["text"][offsets[i]:offsets[i + 1]] for i in range(len(tokens))]
    assert pieces == [text if token > 6 else "" for token, text in zip(tokens, lp["tokens"])], (pieces, lp["tokens"])
    assert streamed["choices"][0]["logprobs"] == lp
    # max_tokens 0: the prompt's scores alone, nothing generated.
    only = scored["choices"][0]
    assert only["token_ids"] == [] and only["finish_reason"] == "length" and scored["usage"]["completion_tokens"] == 0
    assert only["text"] == choice["text"][:offsets[len(prompt)]]
    assert only["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(prompt)]


def test_several_prompts_with_n_give_every_choice_as_if_sent_alone(server):
    prompts = [[40, 41, 42, 43, 44, 45], [9, 30, 12]]  # ids here; the client test sends a list of texts
    body = {"model": MODEL, "prompt": prompts, "n": 3, "max_tokens": 8, "temperature": 0.9, "seed": 21,
            "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            whole = await post_all(client, "/v1/completions", body)
            streamed = await post_all(client, "/v1/completions", {**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}})
            alone = [await post_all(client, "/v1/completions", {**body, "prompt": p, "n": 1, "seed": 21 + i})
                     for p in prompts for i in range(3)]
            return whole, streamed, alone

    whole, streamed, alone = asyncio.run(run())
    assert [c["index"] for c in whole["choices"]] == list(range(6))
    for got, single in zip(whole["choices"], alone):
        assert got["token_ids"] == single["choices"][0]["token_ids"] and got["text"] == single["choices"][0]["text"]
    assert [c["token_ids"] for c in streamed["choices"]] == [c["token_ids"] for c in whole["choices"]]
    assert [c["text"] for c in streamed["choices"]] == [c["text"] for c in whole["choices"]]
    assert len({tuple(c["token_ids"]) for c in whole["choices"]}) == 6
    prompt_tokens = sum(single["usage"]["prompt_tokens"] for single in alone[::3])
    # prompts shorter than a page: nothing for the prefix cache to serve
    assert whole["usage"] == streamed["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 48,
                                                   "total_tokens": prompt_tokens + 48,
                                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_chat_logprobs_penalties_and_bias(server, reference):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello, how are you today?"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            out = {"plain": await post_all(client, "/v1/chat/completions", chat),
                   "scored": await post_all(client, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 2}),
                   "streamed": await post_all(client, "/v1/chat/completions",
                                              {**chat, "logprobs": True, "top_logprobs": 2, "stream": True}),
                   # A bias makes token 77 the greedy choice every time; a frequency penalty then
                   # costs each repeat until another token wins.
                   "biased": await post_all(client, "/v1/chat/completions", {**chat, "logit_bias": {"77": 3}}),
                   "penalised": await post_all(client, "/v1/chat/completions",
                                               {**chat, "logit_bias": {"77": 3}, "frequency_penalty": 1.0}),
                   "penalised_stream": await post_all(client, "/v1/chat/completions",
                                                      {**chat, "logit_bias": {"77": 3}, "frequency_penalty": 1.0,
                                                       "stream": True}),
                   "repeated": await post_all(client, "/v1/chat/completions",
                                              {**chat, "repetition_penalty": 2.0, "n": 2})}
            return out

    out = asyncio.run(run())
    plain = out["plain"]["choices"][0]
    scored = out["scored"]["choices"][0]
    assert scored["token_ids"] == plain["token_ids"] and scored["message"]["content"] == plain["message"]["content"]
    content = scored["logprobs"]["content"]
    assert len(content) == 10 and "".join(e["token"] for e in content) == plain["message"]["content"]
    for e in content:
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] == e["logprob"]  # greedy: the top
        assert e["bytes"] == list(e["token"].encode())
    assert out["streamed"]["choices"][0]["logprobs"]["content"] == content
    assert out["biased"]["choices"][0]["token_ids"] == [77] * 10
    penalised = out["penalised"]["choices"][0]["token_ids"]
    assert penalised[0] == 77 and penalised.count(77) < 10, penalised
    assert out["penalised_stream"]["choices"][0]["token_ids"] == penalised
    repeated = [c["token_ids"] for c in out["repeated"]["choices"]]
    assert repeated[0] == repeated[1] != plain["token_ids"]  # greedy: the n choices agree; the prompt's tokens cost


def test_stop_strings_never_leak_with_several_choices(server):
    body = {"model": MODEL, "prompt": "The engine runs", "max_tokens": 40, "temperature": 0.8, "seed": 5,
            "ignore_eos": True, "n": 4}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            free = await post_all(client, "/v1/completions", body)
            texts = [c["text"] for c in free["choices"]]
            stop = next(t[len(t) // 2:len(t) // 2 + 2] for t in texts if len(t.strip()) > 8)
            cut = [await post_all(client, "/v1/completions", {**body, "stop": [stop], "stream": s}) for s in (False, True)]
            return texts, stop, cut

    texts, stop, cut = asyncio.run(run())
    for got in cut:
        for text, choice in zip(texts, got["choices"]):
            assert stop not in choice["text"]
            if stop in text:
                assert choice["finish_reason"] == "stop" and choice["text"] == text[:text.index(stop)]
            else:
                assert choice["finish_reason"] == "length" and choice["text"] == text
    assert [(c["text"], c["finish_reason"]) for c in cut[0]["choices"]] == \
        [(c["text"], c["finish_reason"]) for c in cut[1]["choices"]]


def test_the_openai_client_reads_logprobs_echo_and_n(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=60, max_retries=0)
    completion = client.completions.create(model=MODEL, prompt=["Hello", "The river"], n=2, max_tokens=4,
                                           temperature=0, echo=True, logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    first = completion.choices[0]
    assert first.text.startswith("Hello") and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == len(first.logprobs.text_offset) == len(first.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=3, n=2,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and len(chat.choices[1].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)
    stream = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0, stream=True,
                                       logprobs=1, extra_body={"ignore_eos": True})
    tokens = [t for chunk in stream for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    assert len(tokens) == 3
    wait_all_free(server.url)


def test_serve_bench_dry_run_reports_every_level(artifact, tmp_path):
    """benchmarks/serving/serve_bench.py starts `hgc serve` on the artifact and drives it at two
    concurrencies over HTTP (the CPU size of the GPU run's command)."""
    pytest.importorskip("httpx")
    from benchmarks.serving.serve_bench import DRY, main as serve_bench

    assert serve_bench(["--dry-run", "--artifact", str(artifact[0]), "--serve-args", " ".join(tokenizer_flag(*artifact)),
                        "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serve_bench.json").read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == list(DRY["concurrency"])
    for lv in result["levels"]:
        assert lv["errors"] == 0 and lv["requests"] == DRY["requests_per_worker"] * lv["concurrency"]
        for record in lv["records"]:
            assert record["output_tokens"] == record["usage_completion_tokens"] == record["max_tokens"]
            assert len(record["itl_s"]) == record["max_tokens"] - 1 and record["ttft_s"] > 0
        # (a server behind the engine sends several tokens in a chunk: ITL gaps of 0 s, TPOT still > 0)
        assert 0 < lv["ttft_median_s"] <= lv["ttft_p99_s"] and 0 <= lv["itl_median_s"] <= lv["itl_p99_s"]
        assert 0 < lv["tpot_median_s"] <= lv["tpot_p99_s"] and lv["tokens_per_chunk"] >= 1
        steps = {k: v for k, v in lv["server_counters"].items() if k.startswith("hgc_engine_phase_steps_total")}
        assert sum(steps.values()) > 0 and lv["server_counters"]["hgc_prefill_tokens_total"] >= sum(
            r["prompt_tokens"] for r in lv["records"]) - 16 * len(lv["records"]), lv["server_counters"]
        assert lv["output_tokens"] == sum(r["max_tokens"] for r in lv["records"]) and lv["requests_per_s"] > 0
