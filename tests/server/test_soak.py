"""The short soak (about 40 s): `hgc serve` on the tiny CPU model under a mixed load, more
clients than slots, speculative decoding on (the tiny qwen3_next has a draft), then: every request
answered or refused with a 4xx/503 (no 500), slots, KV pages and snapshots back in their pools,
resident memory flat after warm-up, /health fast throughout (testkit/soak.py says what each means).
The long version with its numbers: benchmarks/serving/soak.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from testkit.helpers import ServerProcess, shared_artifact  # noqa: E402
from testkit.soak import run_soak  # noqa: E402

pytestmark = pytest.mark.slow

SECONDS = 25  # warm-up is its first 30%: long enough for the memory bound to mean something
SLOTS = 4
CLIENTS = 10  # bursts past the slot count: the rest queue


def test_a_mixed_load_leaves_every_pool_as_it_found_it(tmp_path_factory):
    artifact = shared_artifact(tmp_path_factory, "qwen3_next")[1]
    server = ServerProcess([str(artifact), "--served-model-name", "tiny", "--slots", str(SLOTS), "--max-model-len",
                            "512", "--speculative-tokens", "2"]).wait_ready()
    try:
        result = run_soak(server.url, server.proc.pid, SECONDS, CLIENTS, "tiny")
    finally:
        assert server.stop() == 0, server.log()
    summary = result.summary()
    print(summary)
    assert summary["requests"] >= 20 and result.statuses[200] >= 10, summary
    assert set(result.requests) == {"completion", "completion_stream", "text_stop", "n_logprobs", "chat",
                                    "chat_stream", "structured", "disconnect"}, summary
    assert result.problems() == [], summary
    assert "Traceback" not in server.log(), server.log()
