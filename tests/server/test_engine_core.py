"""`hgc serve`'s engine core, a process of its own (runtime/core/): when it dies, every open request
ends with an error (a streamed one with an SSE error event, then [DONE]; a whole one with a 500),
/health says 503, and the server exits non-zero within a bound."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

from testkit.helpers import ServerProcess, shared_artifact  # noqa: E402

pytestmark = pytest.mark.slow  # one server process: about 15 s on 2 cores

MODEL = "tiny"
DEATH_BOUND_S = 5.0  # from the core's death to the server's exit (the client looks every 0.1 s)


def core_pid(server_pid: int) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    assert len(children) == 1, children  # the engine core, the server's only child
    return int(children[0])


def test_a_killed_engine_core_fails_every_open_request_and_ends_the_server(tmp_path_factory):
    _, art = shared_artifact(tmp_path_factory, "qwen3_next")
    server = ServerProcess([str(art), "--served-model-name", MODEL, "--max-model-len", "4096", "--slots", "8"])
    try:
        url = server.wait_ready().url
        body = {"model": MODEL, "prompt": [3, 4, 5], "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        streamed: list[list[dict]] = [[], []]
        started = [threading.Event() for _ in streamed]
        whole: list[httpx.Response] = []

        def stream(i: int) -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        streamed[i].append(json.loads(line[6:]))
                        started[i].set()
                    elif line == "data: [DONE]":
                        streamed[i].append({"done": True})

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(streamed))]
        threads.append(threading.Thread(target=lambda: whole.append(
            httpx.post(f"{url}/v1/completions", json=body, timeout=60))))
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started), server.log()
        time.sleep(0.2)  # the whole request is in too
        os.kill(core_pid(server.proc.pid), signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(30)
        for events in streamed:  # tokens, then the error event, then [DONE]
            assert events[-1] == {"done": True}, events[-3:]
            assert events[-2]["error"]["code"] == "engine_error", events[-2]
            assert "engine core process exited" in events[-2]["error"]["message"]
        assert whole[0].status_code == 500 and whole[0].json()["error"]["code"] == "engine_error", whole[0].text
        # Once the death is seen, /health is 503 until the server stops listening.
        while True:
            try:
                health = httpx.get(f"{url}/health", timeout=5)
            except httpx.TransportError:
                break
            assert health.status_code == 503 and health.json()["status"] == "engine_failed", health.text
        assert server.proc.wait(DEATH_BOUND_S) == 1, server.log()
        assert time.monotonic() - killed < DEATH_BOUND_S
        assert "the engine core process exited with status -9" in server.log()
    finally:
        server.kill()
