"""`hgc serve`: a real uvicorn server over a compiled tiny artifact, driven over loopback HTTP.

One server process (python -m runtime.server) serves the module's tests; the SIGTERM test starts
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
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
prom_parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.slow  # a compile and two server processes: about 45 s on 2 cores

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
MAX_MODEL_LEN = 256
LIMIT = 200  # --max-tokens-limit
SIGTERM_BOUND = 6.0  # --shutdown-timeout of the SIGTERM test's server: cancel at 3 s, 3 s to flush


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> tuple[Path, Path]:
    """(artifact folder, checkpoint folder): a seeded tiny qwen3_next compiled with `hgc compile`."""
    from compiler.cli import main as hgc
    from models.loader import init_checkpoint

    work = tmp_path_factory.mktemp("serve")
    ckpt = init_checkpoint("qwen3_next", "tiny", 0, work / "ckpt", log=io.StringIO())
    art = work / MODEL
    assert hgc(["compile", str(ckpt), "-o", str(art), "--no-dumps"]) == 0
    return art, ckpt


def tokenizer_flag(art: Path, ckpt: Path) -> list[str]:
    # The artifact carries the checkpoint's tokenizer once the writer copies it; until then, point at it.
    return [] if (art / "tokenizer.json").is_file() else ["--tokenizer", str(ckpt)]


class ServerProcess:
    """`python -m runtime.server ARTIFACT --port 0 ...` in a subprocess; `wait_ready()` gives its URL."""

    def __init__(self, args: list[str]):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "runtime.server", *args, "--host", "127.0.0.1",
                                      "--port", "0", "--threads", "1", "--log-level", "warning"],
                                     cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.url = None

        def drain():  # keep the pipe empty, and catch the "listening" line
            for line in self.proc.stderr:
                self.lines.append(line)
                if "listening on http://" in line and self.url is None:
                    self.url = line.split("listening on ")[1].split()[0]
                    self._listening.set()
            self._listening.set()

        threading.Thread(target=drain, daemon=True).start()

    def wait_ready(self, timeout: float = 90.0) -> "ServerProcess":
        if not self._listening.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        return self

    def log(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


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
              "prefill_s": 0.5, "decode_s": 0.25, "tokens_generated": 40, "prefill_tokens": 80, "preemptions": 0,
              "recent_steps": [{"sampled": 4, "seconds": 0.5}, {"sampled": 2, "seconds": 0.25}]}
    server = {"open_requests": 2, "requests": {"chat": 1}, "finished": {"stop": 3}, "errors": {400: 2},
              "prompt_tokens": 12, "ttft_sum": 0.1, "ttft_count": 1, "duration_sum": 0.5, "duration_count": 1,
              "healthy": True, "draining": False}
    families = {f.name: f for f in prom_parser.text_string_to_metric_families(render_metrics(engine, server))}
    steps = {s.labels["execution"]: s.value for s in families["hgc_engine_steps"].samples}
    assert steps == {"graph_replay": 5, "piecewise": 2, "eager": 3}
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
    ("two prompts", "/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", None),
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
    ("n above one", "/v1/completions", {"model": MODEL, "prompt": [1], "n": 2}, 400, "n", None),
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

    from runtime.server.model import EngineOptions, load_served_model

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
    from runtime.loader import read_artifact
    from runtime.server.model import EngineOptions, ServedModel, build_engine

    registry = read_artifact(artifact[0]).registry

    def bind(ops):
        def forward(input_ids, positions, logits_index):
            raise RuntimeError("kernel exploded")
        return forward

    engine = build_engine(registry, bind, EngineOptions(slots=2, max_model_len=32), 32)
    served = ServedModel(MODEL, engine, vocab_size=256, max_model_len=engine.max_seq_len)
    with server_in_thread(served) as url:
        body = {"model": MODEL, "prompt": [3, 4], "max_tokens": 4}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 500 and "kernel exploded" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert metrics(url)["hgc_engine_healthy"] == 0


def test_cli_errors_exit_2_with_one_line(artifact, tmp_path, capsys):
    from runtime.server.cli import main

    assert main([str(tmp_path / "missing")]) == 2
    assert "not an artifact folder" in capsys.readouterr().err
    assert main([str(artifact[0]), "--slots", "0"]) == 2
    assert "--slots must be at least 1" in capsys.readouterr().err
    assert main([str(artifact[0]), "--tokenizer", str(tmp_path)]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_memory_budget_sizes_the_kv_pool_with_the_planner(artifact):
    from runtime.loader import read_artifact
    from runtime.memory_planner import MemoryPlanError, plan_memory
    from runtime.server.model import EngineOptions, build_engine

    registry = read_artifact(artifact[0]).registry
    options = EngineOptions(slots=4, memory_budget_bytes=8 << 20, max_model_len=128)
    engine = build_engine(registry, lambda ops: None, options, 128, weight_bytes=1 << 20)
    plan = plan_memory(registry, budget_bytes=8 << 20, weight_bytes=1 << 20, max_seq_len=128, page_size=16,
                       num_slots=4, snapshot_share=options.snapshot_share)
    assert engine.kv_pool.num_pages == plan.num_pages and engine.state_pool.num_slots == 4
    assert engine.prefix_cache.snapshots.num_snapshots == plan.num_snapshots > 0
    assert engine.prefix_cache.snapshots.nbytes() == plan.snapshot_bytes
    uncached = build_engine(registry, lambda ops: None, dataclasses.replace(options, prefix_cache=False), 128,
                            weight_bytes=1 << 20)
    assert uncached.prefix_cache is None and uncached.kv_pool.num_pages > engine.kv_pool.num_pages
    with pytest.raises(MemoryPlanError):
        build_engine(registry, lambda ops: None, EngineOptions(slots=4, memory_budget_bytes=1 << 20), 128,
                     weight_bytes=1 << 20)


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
