"""hgc's HTTP serving layer: an OpenAI-compatible server over an EngineLoop. The engine it serves is assembled by runtime/assembly.py; the
`hgc serve` command that starts it is hgc/serve_command.py.

    app.py         the FastAPI app and its ServerState (routes, lifecycle, shutdown)
    protocol.py    request schemas and validation, response and chunk bodies, the error shape
    generation.py  one request between its engine handle and its response (text, stop strings)
    sse.py         server-sent events, and the streaming response that notices a client leave
    metrics.py     GET /metrics in the Prometheus text format

Nothing here is imported by the rest of the runtime; importing this package imports nothing.
"""
