"""EngineCoreClient's receiving thread (runtime/core/client.py): a message it cannot take fails every
open request and the server (on_death) at once, instead of ending the thread and leaving callers
waiting forever. The core here is a real process on the real sockets that says "ready" and then
sends a step it cannot have sent."""

from __future__ import annotations

import sys
import textwrap
import threading

import pytest

pytest.importorskip("zmq")

from runtime.core.client import EngineCoreClient  # noqa: E402
from runtime.engine.loop import EngineLoopError, RequestHandle  # noqa: E402

BAD_CORE = textwrap.dedent("""
    import sys, time, zmq
    from runtime.core.messages import pack
    from runtime.core.process import endpoints
    to_core, from_core = endpoints(sys.argv[1])
    context = zmq.Context()
    out = context.socket(zmq.PUSH)
    out.connect(from_core)
    out.send(pack(["ready", {"model": "bad"}]))
    time.sleep(0.5)
    out.send(pack(["step", [["not", "an", "output"]]]))
    time.sleep(60)
""")


def test_a_message_the_client_cannot_take_fails_every_request_and_the_server(tmp_path):
    client = EngineCoreClient.launch([sys.executable, "-c", BAD_CORE], tmp_path, timeout=60)
    died = threading.Event()
    client.on_death = died.set
    handle = RequestHandle("r0", client, None)
    client._handles["r0"] = handle  # as a submit's reply registers it (the bad core answers no submit)
    try:
        client.start()
        assert died.wait(10), "the receiving thread ended without failing the client"
        assert "engine core client" in str(client.error) and client.process.poll() is not None
        with pytest.raises(EngineLoopError):
            handle.result(timeout=1)
    finally:
        if client.process.poll() is None:
            client.process.kill()
        client.process.wait()
        client.stop(timeout=10)  # sockets and context closed here, not by the garbage collector
