"""The engine core's side: the Engine stepped in its own process, fed and read over ZeroMQ.

1. The API server binds two ZeroMQ sockets in a folder of its own (`endpoints(folder)`) and
   starts the core (`hgc serve ... --engine-core FOLDER`, hgc/serve_command.py), which connects
   (`CoreChannel`), loads the artifact and builds its engine (runtime/assembly.py, as `hgc serve`
   in one process does), then says `ready(facts)`, or `refused(...)` with the one-line error a
   failed load would print.
2. `serve_engine(channel, engine, ...)` runs the loop: take every message waiting (requests added
   as a group, which share their prefill; cancels; stats), step while there is work (a step the
   overlapped schedule left on the device included: `Engine.has_work`), send the outputs each
   step read (one message a step). It owns the engine: no lock, no other thread.
3. A step that raises is sent as "failed" and the loop returns 1 (the process exits with it); the
   server fails its open requests. The loop returns 0 after "stop" (every live request cancelled
   and its result sent first), and as soon as the server process is gone (its parent changed),
   so a killed server leaves no core behind.

It does not tokenize, detokenize or speak HTTP (the server does), nor decide exit codes or load
the artifact (hgc/serve_command.py does).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import zmq

from runtime.core.messages import output_to_wire, pack, params_from_wire, result_to_wire, unpack
from runtime.engine.grammar import GrammarError, GrammarUnavailable

__all__ = ["endpoints", "CoreChannel", "serve_engine", "IDLE_POLL_MS"]

IDLE_POLL_MS = 100  # how long an idle core waits for a message before it looks at its parent again


def endpoints(folder: str | os.PathLike) -> tuple[str, str]:
    """(server -> core, core -> server) addresses: IPC sockets in `folder`, which the server made for them."""
    return f"ipc://{Path(folder) / 'to_core'}", f"ipc://{Path(folder) / 'from_core'}"


class CoreChannel:
    """The core's two sockets: it reads the server's messages and pushes its own."""

    def __init__(self, folder: str | os.PathLike):
        to_core, from_core = endpoints(folder)
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.connect(to_core)
        self._outbox = self._context.socket(zmq.PUSH)
        # On close, up to 2 s to hand over what is queued: the last step's outputs, "failed", results.
        self._outbox.setsockopt(zmq.LINGER, 2000)
        self._outbox.connect(from_core)

    def send(self, message: list) -> None:
        self._outbox.send(pack(message))

    def receive(self, timeout_ms: int) -> list | None:
        """The next message, or None when none came within `timeout_ms`."""
        if not self._inbox.poll(timeout_ms):
            return None
        return unpack(self._inbox.recv())

    def ready(self, facts: dict) -> None:
        self.send(["ready", facts])

    def refused(self, code: int, message: str, hint: str | None) -> None:
        self.send(["refused", code, message, hint])

    def close(self) -> None:
        self._inbox.close(0)
        self._outbox.close()
        self._context.term()


def _error_kind(error: BaseException) -> str:
    """How the server raises an add the core refused (runtime/core/client.py has the other side)."""
    if isinstance(error, GrammarError):  # a ValueError too: first
        return "grammar"
    if isinstance(error, GrammarUnavailable):
        return "grammar_unavailable"
    if isinstance(error, ValueError):
        return "value"
    return "internal"


class _Core:
    """The loop's state: the engine and the ids it was given over the channel."""

    def __init__(self, channel: CoreChannel, engine, compile_grammar: Callable, counters: Callable | None):
        self.channel, self.engine, self.compile_grammar, self.counters = channel, engine, compile_grammar, counters
        self.stopping = False
        self.live: set = set()  # ids added and not yet finished or cancelled

    def handle(self, message: list) -> None:
        kind = message[0]
        if kind == "add":
            self.add(*message[1:])
        elif kind == "cancel":
            self.cancel(message[1])
        elif kind == "stats":
            stats = self.engine.stats()
            if self.counters is not None:
                stats.update(self.counters())
            stats["core_cpu_s"] = time.process_time()  # this process's: the server's /metrics shows it
            self.channel.send(["reply", message[1], stats])
        elif kind == "stop":
            self.stopping = True
        else:
            raise ValueError(f"engine core: unknown message {kind!r}")

    def add(self, call: int, prompt_ids: list[int], wire_params: list[dict], request_ids: list) -> None:
        """One prompt's requests, in one go: the first prefills, the others share it (EngineLoop.submit_group)."""
        added = []
        try:
            params = [params_from_wire(p, self.compile_grammar) for p in wire_params]
            for p, request_id in zip(params, request_ids, strict=True):
                added.append(self.engine.add_request(prompt_ids, p, request_id, added[0] if added else None))
        except Exception as error:  # noqa: BLE001 - the server raises it for the request that sent it
            for request_id in reversed(added):
                self.engine.cancel(request_id)
                self.engine.pop_result(request_id)
            self.channel.send(["error", call, _error_kind(error), str(error) or repr(error)])
            return
        self.live.update(added)
        self.channel.send(["reply", call, None])

    def cancel(self, request_id) -> None:
        if self.engine.cancel(request_id):
            self.live.discard(request_id)
            self.channel.send(["done", request_id, result_to_wire(self.engine.pop_result(request_id))])

    def step(self) -> None:
        engine = self.engine
        wire = []
        for out in engine.step():
            cached = engine.cached_tokens(out.request_id)
            result = None
            if out.finished:
                self.live.discard(out.request_id)
                result = engine.pop_result(out.request_id)
            wire.append(output_to_wire(out, cached, result))
        if wire:
            self.channel.send(["step", wire])


def serve_engine(channel: CoreChannel, engine, *, compile_grammar: Callable, counters: Callable | None = None,
                 parent_pid: int | None = None) -> int:
    """Step 2 and 3 of the module docstring; returns the core's exit status."""
    core = _Core(channel, engine, compile_grammar, counters)
    parent_pid = os.getppid() if parent_pid is None else parent_pid
    while not core.stopping:
        if os.getppid() != parent_pid:
            return 0  # the server is gone: nobody reads our outputs
        message = channel.receive(0 if engine.has_work() else IDLE_POLL_MS)
        while message is not None:
            core.handle(message)
            message = channel.receive(0)
        if core.stopping or not engine.has_work():
            continue
        try:
            core.step()
        except BaseException as error:  # noqa: B902 - the server must hear about it
            channel.send(["failed", f"{type(error).__name__}: {error}"])
            return 1
    for request_id in list(core.live):  # "stop": what is left ends as cancelled, its result sent
        core.cancel(request_id)
    channel.send(["stopped"])
    return 0
