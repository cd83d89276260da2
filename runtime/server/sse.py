"""Server-sent events: the `data: {...}` framing OpenAI streams use, and a response that notices a client leave.

`EventStreamResponse(events, on_close)` sends each bytes item of `events` as it comes and, at the
same time, listens for the client's disconnect. Whichever ends first wins:

1. the events end: the body is closed, then `on_close()` runs (a no-op for a finished request);
2. the client disconnects (or a send fails): the pump is cancelled and `on_close()` runs at once,
   which cancels the engine request, so its slot and pages are freed within a step rather than
   when the next token finds the socket closed, or when garbage collection closes a generator;
3. the response itself is cancelled (server shutdown past its bound): `on_close()` runs too.

It does not format chunks (protocol.py does) nor know about the engine.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["sse_event", "SSE_DONE", "EventStreamResponse"]

SSE_DONE = b"data: [DONE]\n\n"
# One encoder for every event: json.dumps with options builds a new JSONEncoder per call, which is
# most of the cost of a chunk, and a stream sends one chunk per token.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def sse_event(obj) -> bytes:
    return b"data: " + _ENCODER.encode(obj).encode() + b"\n\n"


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStreamResponse(StreamingResponse):
    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        # no-cache: proxies must not hold the stream; X-Accel-Buffering: nginx must not buffer it.
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self.stream_response(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done() and not pump.cancelled() and isinstance(pump.exception(), OSError):
                return  # a send to a closed socket: the client left
            if pump.done():
                pump.result()  # an error while streaming: the server logs it; the connection closes
        finally:
            pump.cancel()
            watch.cancel()
            self._on_close()
