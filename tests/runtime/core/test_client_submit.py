"""EngineCoreClient.asubmit_group (runtime/core/client.py): a server's adds go to the core as they
arrive, none waits for another's reply, and each caller gets its handles or its refusal where it
awaits. The core here is a real process on the real sockets that answers no add until it holds
sixteen, as a core busy with a step answers only between steps: with adds each waiting for the
reply of the one before on a few threads, it would never hold sixteen."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import pytest

pytest.importorskip("zmq")

from runtime.core.client import EngineCoreClient  # noqa: E402
from runtime.engine.sampling import SamplingParams  # noqa: E402

ADDS = 16

GATHERING_CORE = textwrap.dedent(f"""
    import sys, time, zmq
    from runtime.core.messages import pack, unpack
    from runtime.core.process import endpoints
    to_core, from_core = endpoints(sys.argv[1])
    context = zmq.Context()
    inbox, out = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(to_core)
    out.connect(from_core)
    out.send(pack(["ready", {{"model": "gathering"}}]))
    adds = []
    while len(adds) < {ADDS}:
        message = unpack(inbox.recv())
        if message[0] == "add":
            adds.append(message)
    for message in adds:  # the last one is refused, as a core refuses a prompt it cannot take
        if message[4] == ["r{ADDS - 1}"]:
            out.send(pack(["error", message[1], "value", "prompt too long"]))
        else:
            out.send(pack(["reply", message[1], None]))
    time.sleep(60)
""")


def test_adds_reach_the_core_without_waiting_for_replies_and_each_caller_gets_its_answer(tmp_path):
    client = EngineCoreClient.launch([sys.executable, "-c", GATHERING_CORE], tmp_path, timeout=60)
    try:
        client.start()

        async def submit_all():
            loop = asyncio.get_running_loop()
            futures = [client.asubmit_group([1, 2, 3], [SamplingParams()], [f"r{i}"], loop) for i in range(ADDS)]
            return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 30)

        answers = asyncio.run(submit_all())
        assert [h.request_id for a in answers[:-1] for h in a] == [f"r{i}" for i in range(ADDS - 1)]
        assert isinstance(answers[-1], ValueError) and "prompt too long" in str(answers[-1])
        assert set(client._handles) == {f"r{i}" for i in range(ADDS - 1)}  # registered before any output
    finally:
        _close(client)


def _close(client: EngineCoreClient) -> None:
    """Kill the core, then close the client: its sockets and ZeroMQ context are closed here, not
    left to the garbage collector (a context collected with a socket open blocks in term)."""
    client.process.kill()
    client.process.wait()
    client.stop(timeout=10)


def test_an_add_to_a_client_that_is_not_running_fails_where_it_is_awaited(tmp_path):
    client = EngineCoreClient.launch([sys.executable, "-c", GATHERING_CORE], tmp_path, timeout=60)
    client.process.kill()
    client.process.wait()
    client.start()

    async def submit():
        for _ in range(100):  # the receiving thread sees the death within DEATH_POLL_S
            if client.error is not None:
                break
            await asyncio.sleep(0.05)
        return await client.asubmit_group([1], [SamplingParams()], ["r0"], asyncio.get_running_loop())

    try:
        with pytest.raises(RuntimeError, match="not running"):
            asyncio.run(submit())
    finally:
        _close(client)
