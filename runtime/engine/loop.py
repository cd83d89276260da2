"""EngineLoop: an Engine stepped on a background thread, and the handles callers read their tokens from.

The server (runtime/server/app.py) submits requests from its event loop and worker threads; the
loop owns the only thread that steps the engine. Lifecycle and the lock's hand-over: `EngineLoop`.
The scheduling policy itself is the engine's (runtime/engine/engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from typing import Hashable

from runtime.engine.engine import Engine, RequestResult, SamplingParams, StepOutput

__all__ = ["EngineLoop", "RequestHandle", "EngineLoopError"]


class EngineLoopError(RuntimeError):
    """The engine loop's step raised; every open request handle gets this, with the cause chained."""


class RequestHandle:
    """One request submitted to an EngineLoop: its tokens as they come, then its result.

    Without an asyncio loop: iterate (`for token in handle`, blocking) or `handle.result()`.
    Submitted with `loop=`: `async for token in handle`. Either way `result()` blocks until done.
    `handle.outputs()` (and `async for out in handle.aoutputs()`) give the whole StepOutputs instead,
    log-probabilities included, and the one without a token that ends a max_new_tokens=0 request.
    """

    def __init__(self, request_id: Hashable, owner: "EngineLoop", loop: asyncio.AbstractEventLoop | None):
        self.request_id = request_id
        self._owner = owner
        self._loop = loop
        self._sync_queue: queue.SimpleQueue | None = queue.SimpleQueue() if loop is None else None
        self._async_queue: asyncio.Queue | None = asyncio.Queue() if loop is not None else None
        self._done = threading.Event()
        self._result: RequestResult | None = None
        self._error: BaseException | None = None
        # Prompt tokens the prefix cache gave the request: set by the loop before the first token is
        # handed over, so a consumer that has a token can read it (usage before the result is in).
        self.cached_tokens: int | None = None

    # Called by the EngineLoop, under its lock; puts never block.
    def _put(self, item: tuple[str, object]) -> None:
        if self._loop is None:
            self._sync_queue.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's event loop is closed: nobody is listening any more

    def _output(self, out: StepOutput) -> None:
        self._put(("output", out))

    def _finish(self, result: RequestResult) -> None:
        self._result = result
        self._done.set()
        self._put(("done", result))

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._done.set()
        self._put(("error", error))

    @staticmethod
    def _unpack(kind: str, value):
        if kind == "error":
            raise EngineLoopError(f"the engine loop failed: {value!r}") from value
        return value

    def outputs(self):
        if self._sync_queue is None:
            raise TypeError("this request was submitted with an asyncio loop: use `async for`")
        while True:
            kind, value = self._sync_queue.get()
            value = self._unpack(kind, value)
            if kind == "done":
                return
            yield value

    async def aoutputs(self):
        if self._async_queue is None:
            raise TypeError("this request was submitted without an asyncio loop: pass loop= to submit, or iterate")
        while True:
            kind, value = await self._async_queue.get()
            value = self._unpack(kind, value)
            if kind == "done":
                return
            yield value

    async def aoutput_batches(self):
        """The outputs as lists: each list holds every output queued when it is taken (at least one).
        A consumer that fell behind the engine (a busy server loop) takes the steps it missed at
        once, so it frames one response chunk for them instead of one per token."""
        if self._async_queue is None:
            raise TypeError("this request was submitted without an asyncio loop: pass loop= to submit, or iterate")
        queue = self._async_queue
        while True:
            batch, items = [], [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            for kind, value in items:
                if kind == "output":
                    batch.append(value)
                    continue
                if batch:  # what came before the end (or the failure) is yielded first
                    yield batch
                self._unpack(kind, value)  # raises on a failure
                return
            yield batch

    def __iter__(self):
        return (out.token for out in self.outputs() if out.token is not None)

    async def _atokens(self):
        async for out in self.aoutputs():
            if out.token is not None:
                yield out.token

    def __aiter__(self):
        if self._async_queue is None:
            raise TypeError("this request was submitted without an asyncio loop: pass loop= to submit, or iterate")
        return self._atokens()

    def result(self, timeout: float | None = None) -> RequestResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
        if self._error is not None:
            raise EngineLoopError(f"the engine loop failed: {self._error!r}") from self._error
        return self._result

    def cancel(self) -> bool:
        return self._owner.cancel(self.request_id)


class EngineLoop:
    """Runs an Engine's steps on a background thread; any thread may submit, cancel or read stats.

    1. `start()` starts the thread; it sleeps until a request is submitted.
    2. `submit(...)` queues a request under the lock and returns its RequestHandle.
    3. The thread steps while there is work (`Engine.has_work`, a step still on the device
       included); after each step it hands the tokens the step read and results to the handles
       (non-blocking puts, under the lock, so a cancel never overtakes a token).
    4. `stop()` ends the thread after its current step, cancels what is left and settles the
       engine (a step the overlapped schedule left on the device is read, its outputs dropped).

    One lock guards the engine, and it is handed over fairly: a caller that wants it announces
    itself (`_locked()`), and before each step the thread lets in every caller announced by then,
    so a submit, cancel or stats call waits at most one step, and callers arriving all the time
    cannot hold the steps back either. A plain lock would not do: the thread releases it and takes
    it again at once, and with steps that hold the interpreter a waiting caller was seen to wait
    for hundreds of steps (benchmarks/host/engine_lock_bench.py; a shutdown's cancels then missed their
    bound). If a step raises, the loop stops and every open handle gets an EngineLoopError.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cond = threading.Condition()
        # Callers that have asked for the lock, and of those how many have had it (or gave up).
        self._announced = self._admitted = 0
        self._count_lock = threading.Lock()
        self._handles: dict[Hashable, RequestHandle] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None

    def start(self) -> "EngineLoop":
        if self._thread is not None:
            raise RuntimeError("EngineLoop.start: already started")
        self._thread = threading.Thread(target=self._run, name="hgc-engine-loop", daemon=True)
        self._thread.start()
        return self

    @contextlib.contextmanager
    def _locked(self):
        """The engine lock, for a caller other than the loop thread: announced, so it waits one step at most."""
        with self._count_lock:
            self._announced += 1
        try:
            self._cond.acquire()
        finally:  # admitted, or gave up (interrupted): either way the thread need not wait for it
            with self._count_lock:
                self._admitted += 1
        try:
            yield
        finally:
            self._cond.notify_all()  # the thread may be waiting for the callers to be through
            self._cond.release()

    def stop(self, timeout: float | None = None) -> None:
        with self._locked():
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._locked():
            for request_id in list(self._handles):
                if self.engine.cancel(request_id):
                    self._handles.pop(request_id)._finish(self.engine.pop_result(request_id))
            if self.error is None:  # the step still on the device ends: what it holds goes back to the pools
                self.engine.settle()

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, prompt_ids, params: SamplingParams | None = None, request_id: Hashable = None,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        return self.submit_group(prompt_ids, [params], [request_id], loop)[0]

    def submit_group(self, prompt_ids, params: list[SamplingParams | None], request_ids: list[Hashable],
                     loop: asyncio.AbstractEventLoop | None = None) -> list[RequestHandle]:
        """Requests of one prompt, added in one hold of the lock: the first prefills it and the
        others share that prefill (Engine.add_request's prefill_from). If one is refused, none stays."""
        with self._locked():
            if self._stopping or self.error is not None:
                raise RuntimeError(f"EngineLoop.submit: the loop is stopped (error: {self.error!r})")
            added = []
            try:
                for p, request_id in zip(params, request_ids, strict=True):
                    added.append(self.engine.add_request(prompt_ids, p, request_id, added[0] if added else None))
            except BaseException:
                for request_id in reversed(added):
                    self.engine.cancel(request_id)
                    self.engine.pop_result(request_id)
                raise
            handles = [RequestHandle(request_id, self, loop) for request_id in added]
            for handle in handles:
                self._handles[handle.request_id] = handle
            self._cond.notify_all()
        return handles

    def asubmit_group(self, prompt_ids, params: list[SamplingParams | None], request_ids: list[Hashable],
                      loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """submit_group for a caller on an asyncio loop: a future of the handles. The lock may wait a
        step, so the submit runs on the loop's default executor, off the caller's loop."""
        return loop.run_in_executor(None, functools.partial(self.submit_group, prompt_ids, params, request_ids, loop))

    def cancel(self, request_id: Hashable) -> bool:
        with self._locked():
            if not self.engine.cancel(request_id):
                return False
            handle = self._handles.pop(request_id, None)
            result = self.engine.pop_result(request_id)
            if handle is not None:
                handle._finish(result)
            return True

    def stats(self) -> dict:
        with self._locked():
            return self.engine.stats()

    def _run(self) -> None:
        while True:
            with self._cond:
                due = self._announced  # callers that asked before this point go before the next step
                while not self._stopping and (self._admitted < due or not self.engine.has_work()):
                    # For work, or for those callers to be through (each notifies as it leaves).
                    self._cond.wait(0.05 if self._admitted < due else None)
                if self._stopping:
                    return
                try:
                    outputs = self.engine.step()
                except BaseException as error:  # noqa: B902 - every handle must hear about it
                    self.error = error
                    for handle in self._handles.values():
                        handle._fail(error)
                    self._handles.clear()
                    return
                for out in outputs:
                    handle = self._handles.get(out.request_id)
                    if handle is None:
                        continue  # added on the engine directly, not through this loop
                    if handle.cached_tokens is None:
                        handle.cached_tokens = self.engine.cached_tokens(out.request_id)
                    handle._output(out)
                    if out.finished:
                        del self._handles[out.request_id]
                        handle._finish(self.engine.pop_result(out.request_id))
