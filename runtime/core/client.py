"""The API server's side of the engine core: `EngineCoreClient`, with the surface the app uses of an EngineLoop.

1. `EngineCoreClient.launch(command, folder)` binds the two sockets in `folder`, starts the core
   process (`command`, which gets the folder) and waits for its "ready" message: the served
   model's facts and its tokenizer as data. A core that refuses (a bad artifact, a budget too
   small) or dies first raises `CoreStartError` with the core's one-line error and exit code.
2. `start()` starts the one receiving thread; it hands each step's outputs to the requests'
   RequestHandles (runtime/engine/loop.py, the same handles an EngineLoop gives; `_hand_over`:
   one wake-up of each asyncio loop a step, not one a token), replies to the callers waiting for
   them, and looks at the core process every `DEATH_POLL_S`.
3. `submit_group`, `asubmit_group`, `cancel`, `stats`: as EngineLoop's. A submit's handles come
   with the core's reply (its refusal is raised: ValueError, GrammarError, GrammarUnavailable);
   `asubmit_group`, the server's, is a future the receiving thread settles, so no thread waits on
   a reply and every add that arrives during a step reaches the core before the next. A cancel
   is sent and the core's "done" finishes the handle. `grammar(response_format)` is the GrammarSpec the core
   compiles.
4. A core that fails a step, or exits while serving, sets `error`: every open handle and waiting
   caller gets an EngineLoopError, and `on_death` (the server's exit) is called once. So does a
   message the receiving thread cannot take (the core is killed then).
5. `stop()` asks the core to cancel what is left and exit, waits for it, and closes the sockets.

It does not format HTTP or text (runtime/server/ does).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import threading
from typing import Callable, Hashable

import zmq

from runtime.core.messages import (GrammarSpec, output_from_wire, pack, params_to_wire, result_from_wire, unpack)
from runtime.core.process import endpoints
from runtime.engine.grammar import GrammarError, GrammarUnavailable
from runtime.engine.loop import EngineLoopError, RequestHandle
from runtime.engine.request import RequestResult, StepOutput
from runtime.engine.sampling import SamplingParams

__all__ = ["EngineCoreClient", "CoreStartError", "EngineCoreDied", "EngineCoreFault", "DEATH_POLL_S"]

DEATH_POLL_S = 0.1  # how often the receiving thread looks at the core process: a death is seen within this


class CoreStartError(RuntimeError):
    """The core refused to start (its one-line error and exit code) or died before it was ready."""

    def __init__(self, message: str, exit_code: int, hint: str | None = None):
        super().__init__(message)
        self.exit_code, self.hint = exit_code, hint


class EngineCoreDied(RuntimeError):
    """The engine core process exited while serving (killed, crashed, or after a failed step)."""


class EngineCoreFault(Exception):
    """The core could not add a request for a reason that is not the request's (a bug): the server's 500."""


# The core's refusal kinds (runtime/core/process.py) as the exceptions an EngineLoop's submit raises.
_REFUSALS = {"value": ValueError, "grammar": GrammarError, "grammar_unavailable": GrammarUnavailable,
             "internal": EngineCoreFault}


class _Call:
    """A caller waiting for the core's reply to its message: a thread on `done`, or, where the call
    came from an asyncio loop (`asubmit_group`), that loop on `future`."""

    def __init__(self, handles: list[RequestHandle] = (), future: asyncio.Future | None = None):
        self.done = threading.Event()
        self.handles = list(handles)
        self.value = None
        self.error: BaseException | None = None
        self.future = future

    def settle(self) -> None:
        """The reply (value or error) is in: wake whoever waits for it."""
        if self.future is None:
            self.done.set()
            return
        try:
            self.future.get_loop().call_soon_threadsafe(_settle_future, self.future, self.value, self.error)
        except RuntimeError:
            pass  # that event loop is closed: nobody is waiting any more


def _settle_future(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _hand_over(outputs: list[tuple[RequestHandle, StepOutput, int | None, RequestResult | None]]) -> None:
    """A step's outputs to their handles: (handle, output, cached tokens, result of a finished request).

    A handle read on an asyncio loop gets its items through that loop; waking a loop
    (call_soon_threadsafe) costs a write to its self-pipe, so a step's items for one loop go over
    in one call, in order, and that call puts them on the handles' queues there."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for handle, out, cached, result in outputs:
        if handle.cached_tokens is None:
            handle.cached_tokens = cached  # before its first token can be read
        if handle._loop is None:  # a blocking reader: its queue takes puts from any thread
            handle._output(out)
            if result is not None:
                handle._finish(result)
        else:
            if result is not None:
                handle._result = result  # as _finish: the result is in before "done" can be read
                handle._done.set()
            by_loop.setdefault(handle._loop, []).append((handle, out, result))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_on_loop, items)
        except RuntimeError:
            pass  # that event loop is closed: nobody is listening any more


def _put_on_loop(items: list) -> None:
    """On a handle's own event loop: each item onto its handle's queue, as RequestHandle._put would."""
    for handle, out, result in items:
        handle._async_queue.put_nowait(("output", out))
        if result is not None:
            handle._async_queue.put_nowait(("done", result))


class EngineCoreClient:
    def __init__(self, process: subprocess.Popen, context: zmq.Context, to_core: zmq.Socket, from_core: zmq.Socket,
                 facts: dict):
        self.process = process
        self.facts = facts  # the "ready" message's: the served model's name, sizes, tokenizer, ...
        self._context, self._to_core, self._from_core = context, to_core, from_core
        self._send_lock = threading.Lock()  # a ZeroMQ socket is not thread-safe; callers send from many threads
        self._lock = threading.Lock()  # the handles and the calls
        self._handles: dict[Hashable, RequestHandle] = {}
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.on_death: Callable[[], None] = lambda: None

    @classmethod
    def launch(cls, command: list[str], folder: str | os.PathLike, timeout: float | None = None) -> "EngineCoreClient":
        """Step 1 of the module docstring; the core's stderr is this process's (it logs its load there)."""
        to_core_address, from_core_address = endpoints(folder)
        context = zmq.Context()
        to_core, from_core = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        to_core.setsockopt(zmq.LINGER, 0)
        to_core.bind(to_core_address)
        from_core.bind(from_core_address)
        process = subprocess.Popen([*command, str(folder)])
        try:
            facts = cls._wait_ready(process, from_core, timeout)
        except BaseException:
            if process.poll() is None:
                process.kill()
                process.wait()
            to_core.close(0)
            from_core.close(0)
            context.term()
            raise
        return cls(process, context, to_core, from_core, facts)

    @staticmethod
    def _wait_ready(process: subprocess.Popen, from_core: zmq.Socket, timeout: float | None) -> dict:
        waited = 0.0
        while not from_core.poll(int(DEATH_POLL_S * 1000)):
            waited += DEATH_POLL_S
            if process.poll() is not None:
                raise CoreStartError(f"the engine core process exited with status {process.returncode} while loading",
                                     1)
            if timeout is not None and waited > timeout:
                raise CoreStartError(f"the engine core was not ready within {timeout:.0f} s", 1)
        message = unpack(from_core.recv())
        if message[0] == "refused":
            process.wait()
            raise CoreStartError(message[2], message[1], message[3])
        assert message[0] == "ready", message[0]
        return message[1]

    # -- the EngineLoop surface -------------------------------------------------------------------

    def start(self) -> "EngineCoreClient":
        if self._thread is not None:
            raise RuntimeError("EngineCoreClient.start: already started")
        self._thread = threading.Thread(target=self._receive, name="hgc-engine-core-client", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        if self.error is None and self.process.poll() is None:
            self._stopping = True
            self._send(["stop"])
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        elif self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self._thread is not None:
            self._thread.join(timeout)
        self._to_core.close(0)
        self._from_core.close(0)
        self._context.term()

    def grammar(self, response_format: dict) -> GrammarSpec:
        return GrammarSpec(response_format)

    def submit(self, prompt_ids, params: SamplingParams | None = None, request_id: Hashable = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        return self.submit_group(prompt_ids, [params or SamplingParams()], [request_id], loop)[0]

    def submit_group(self, prompt_ids, params: list[SamplingParams], request_ids: list[Hashable],
                     loop: asyncio.AbstractEventLoop | None = None) -> list[RequestHandle]:
        """One prompt's requests, added by the core together (they share the prefill); raises its refusal."""
        handles = [RequestHandle(request_id, self, loop) for request_id in request_ids]
        wire = [params_to_wire(p) for p in params]
        self._call(["add", None, list(prompt_ids), wire, list(request_ids)], handles)
        return handles

    def asubmit_group(self, prompt_ids, params: list[SamplingParams], request_ids: list[Hashable],
                      loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """submit_group for a caller on an asyncio loop: a future of the handles, settled by the receiving
        thread when the core's reply comes. No thread waits for it: a server's adds are sent as they
        arrive and the core takes all that came during a step before the next (a pool of threads each
        blocked on its own reply would let in only as many adds a step as it has threads)."""
        handles = [RequestHandle(request_id, self, loop) for request_id in request_ids]
        future = loop.create_future()
        wire = [params_to_wire(p) for p in params]
        try:
            self._start_call(["add", None, list(prompt_ids), wire, list(request_ids)], _Call(handles, future))
        except RuntimeError as error:  # not running: the caller hears it where it awaits, as from submit_group
            future.set_exception(error)
        return future

    def cancel(self, request_id: Hashable) -> bool:
        with self._lock:
            live = request_id in self._handles
        if live and self.error is None:
            self._send(["cancel", request_id])  # the core's "done" finishes the handle
        return live

    def stats(self) -> dict:
        return self._call(["stats", None])

    # -- the channel --------------------------------------------------------------------------------

    def _send(self, message: list) -> None:
        with self._send_lock:
            self._to_core.send(pack(message))

    def _call(self, message: list, handles: list[RequestHandle] = ()):
        call = _Call(handles)
        self._start_call(message, call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.value

    def _start_call(self, message: list, call: _Call) -> None:
        """Registers the call under a new id (message[1]) and sends the message."""
        with self._lock:
            if self._stopping or self.error is not None:
                raise RuntimeError(f"the engine core is not running (error: {self.error!r})")
            call_id = next(self._call_ids)
            self._calls[call_id] = call
        message[1] = call_id
        self._send(message)

    def _receive(self) -> None:
        """The receiving thread. A message it cannot take (a fault here or in the core) fails the
        client like a dead core: a thread that ended quietly would leave every caller waiting."""
        try:
            self._take_messages()
        except BaseException as error:  # noqa: B902 - every open request and the server must hear of it
            if self.process.poll() is None:
                self.process.kill()  # a core whose messages nobody reads serves nobody
                self.process.wait(5)
            self._fail(EngineCoreDied(f"engine core client: a message from the core could not be taken: {error!r}"))

    def _take_messages(self) -> None:
        while True:
            if self._from_core.poll(int(DEATH_POLL_S * 1000)):
                message = unpack(self._from_core.recv())
                if message[0] == "stopped":
                    return
                self._dispatch(message)
                continue
            status = self.process.poll()
            if status is not None:
                while self._from_core.poll(0):  # what it sent before it went: outputs, "failed", "stopped"
                    message = unpack(self._from_core.recv())
                    if message[0] == "stopped":
                        return
                    self._dispatch(message)
                if not self._stopping:
                    self._fail(EngineCoreDied(f"the engine core process exited with status {status}"))
                return

    def _dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "step":
            outputs = [output_from_wire(wire) for wire in message[1]]
            with self._lock:  # once a step, not once a token
                handles = [self._handles.get(out.request_id) for out, _, _ in outputs]
                for (out, _, _), handle in zip(outputs, handles):
                    if handle is not None and out.finished:
                        del self._handles[out.request_id]
            _hand_over([(handle, *output) for handle, output in zip(handles, outputs) if handle is not None])
        elif kind == "done":
            with self._lock:
                handle = self._handles.pop(message[1], None)
            if handle is not None:
                handle._finish(result_from_wire(message[2]))
        elif kind in ("reply", "error"):
            with self._lock:
                call = self._calls.pop(message[1])
                if kind == "reply":
                    for handle in call.handles:  # before any output of theirs is read
                        self._handles[handle.request_id] = handle
            if kind == "reply":
                call.value = call.handles or message[2]  # an add's value: its handles
            else:
                call.error = _REFUSALS[message[2]](message[3])
            call.settle()
        elif kind == "failed":
            self._fail(EngineCoreDied(f"the engine core failed: {message[1]}"))
        else:
            raise ValueError(f"engine core client: unknown message {kind!r}")

    def _fail(self, error: BaseException) -> None:
        """Step 4 of the module docstring."""
        if self.error is not None:
            return
        with self._lock:
            self.error = error
            handles, self._handles = list(self._handles.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for handle in handles:
            handle._fail(error)
        for call in calls:
            call.error = RuntimeError(f"the engine core is not running (error: {error!r})")
            call.settle()
        if not self._stopping:
            self.on_death()
