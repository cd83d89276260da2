"""The engine core: the Engine stepped in a process of its own, and the API server's client of it.

`hgc serve` runs two processes: the API server (FastAPI, tokenizer, detokenizer, SSE framing) and
the engine core (the artifact, the engine, its steps), so HTTP and text work never take the
interpreter from the engine's steps. They talk over ZeroMQ with msgpack messages of plain data
(messages.py); the core's loop is process.py, the server's side client.py. docs/DESIGN.md, "Two
processes", describes the protocol.
"""
