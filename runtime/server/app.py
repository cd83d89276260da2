"""The HTTP server: a FastAPI app over one engine (its core process or an EngineLoop), speaking OpenAI's API.

Routes: POST /v1/completions, POST /v1/chat/completions (both with "stream": true as server-sent
events), GET /v1/models, GET /health, GET /metrics (Prometheus text).

Lifecycle:

1. `create_app(served, options, engine)` makes the app and its one `ServerState` (`app.state.hgc`):
   the engine it submits to, the open requests, the counters. Nothing global. The engine is the
   engine core's client (runtime/core/client.py: the Engine steps in a process of its own, `hgc
   serve`'s default) or, without one, an EngineLoop over the served model's Engine in this
   process; both give the same handles.
2. Lifespan start: the engine's receiving or stepping thread starts. The app never steps the engine itself.
3. A request: its body is read up to `max_body_bytes` (413 past it, from Content-Length before
   a byte is read, or while it streams in), then parsed and validated (protocol.py; a 4xx with
   the OpenAI error body on any fault), each prompt resolved to token ids and checked against
   the model, its response_format compiled into a grammar (runtime/engine/grammar.py; a schema
   xgrammar refuses is a 400 naming why): all of that CPU work (JSON, validation, tokenization,
   chat templates, grammars, echo text) runs on the state's request thread, never on the event
   loop, so /health and streams stay responsive while a large request is prepared. Each
   prompt's n requests are submitted to the EngineLoop together (they share its prefill), then
   the choices' tokens are streamed or collected (choices.py, generation.py). Engine calls that
   take the engine lock (submit, cancel, stats) run on the state's engine thread pool, so the
   event loop never waits for a step.
4. A client that disconnects, mid-stream or while waiting for a whole response, has its engine
   request cancelled at once: its state slot and KV pages go back to the pools.
5. Shutdown (`request_shutdown(exit_server)`, called from the SIGTERM handler): the server keeps
   listening while it drains, so new requests get 503 with Retry-After (not a refused
   connection) and /health turns 503; in-flight requests run on until `shutdown_timeout` minus a
   grace period, then are cancelled and finish with finish_reason "abort". Once none is left (or
   `shutdown_timeout` has passed) `exit_server()` tells uvicorn to stop listening and finish;
   lifespan end stops the EngineLoop.

GET /openapi.json describes every route and both request bodies (runtime/server/openapi.py).

It does not parse command lines or bind sockets (cli.py does), nor load models (model.py does).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import time
import uuid
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from runtime.engine.engine import SamplingParams
from runtime.engine.loop import EngineLoop, EngineLoopError
from runtime.engine.grammar import GrammarError, GrammarUnavailable, Grammars
from runtime.server.choices import Choice, close_all, merged
from runtime.server.generation import Generation
from runtime.server.logprobs import join
from runtime.server.metrics import CONTENT_TYPE, render_metrics
from runtime.assembly import ServedModel
from runtime.server.openapi import body_spec, install
from runtime.server.protocol import (ChatCompletionRequest, CompletionRequest, RequestError, chat_body, chat_choice,
                                     chat_chunk, completion_body, completion_choice, completion_chunk, error_body,
                                     models_body, now, parse_body, usage_body, usage_chunk)
from runtime.server.sse import SSE_DONE, EventStreamResponse, sse_event
from runtime.artifact.tokenizer import TokenizerError

__all__ = ["ServerOptions", "ServerState", "create_app"]

log = logging.getLogger("hgc.server")

FINISH_REASONS = ("stop", "length", "cancelled", "abort", "error")
ENDPOINTS = ("completions", "chat")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Request limits and the shutdown bound (the `hgc serve` flags that are not engine sizing)."""

    max_tokens_limit: int | None = None  # the largest max_tokens a request may ask (None: the model's context)
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    shutdown_timeout: float = 10.0  # seconds in-flight requests get after SIGTERM
    workers: int = 4  # threads for engine calls that take the engine lock
    max_body_bytes: int = 8_000_000  # a larger request body gets 413 (--max-body-mb)

    def __post_init__(self):
        if self.default_max_tokens < 1:
            raise ValueError(f"--default-max-tokens must be at least 1 (got {self.default_max_tokens})")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"--max-tokens-limit must be at least 1 (got {self.max_tokens_limit})")
        if self.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 (got {self.shutdown_timeout})")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-mb must be above 0 (got {self.max_body_bytes} bytes)")

    @property
    def abort_after(self) -> float:
        """Seconds after SIGTERM at which in-flight requests are cancelled: before uvicorn's own bound,
        so each one still gets a proper last chunk. The grace (up to 3 s, half the bound at most)
        covers the engine finishing its current step and every stream flushing its abort chunk
        and [DONE] on a loaded machine; 1 s was seen to cut a stream short."""
        return max(0.0, self.shutdown_timeout - min(3.0, self.shutdown_timeout / 2))

    @property
    def retry_after(self) -> str:
        """Retry-After of a 503 while draining: by then this process is gone (or a new one is up)."""
        return str(max(1, math.ceil(self.shutdown_timeout)))


class ServerState:
    """Everything the routes share: the served model, its EngineLoop, open requests and counters."""

    def __init__(self, served: ServedModel, options: ServerOptions, engine=None):
        self.served = served
        self.options = options
        if engine is None:  # the engine in this process: stepped by an EngineLoop, grammars compiled here
            self.engine_loop = EngineLoop(served.engine)
            self._grammar = Grammars(served.tokenizer, served.vocab_size, [served.eos_token_id]).compile
        else:  # the engine core's client (runtime/core/client.py): the core compiles them
            self.engine_loop = engine
            self._grammar = engine.grammar
        self.executor = concurrent.futures.ThreadPoolExecutor(options.workers, thread_name_prefix="hgc-server")
        # Request preparation (JSON, validation, tokenization) apart from the engine calls: a large
        # prompt being tokenized never holds up a submit, a cancel or /metrics.
        self.prepare_executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="hgc-request")
        self.generations: dict[str, Generation] = {}
        self.requests = collections.Counter({e: 0 for e in ENDPOINTS})
        self.finished = collections.Counter({r: 0 for r in FINISH_REASONS})
        self.errors: collections.Counter = collections.Counter()
        self.prompt_tokens = 0
        self.ttft = [0.0, 0]  # sum, count
        self.duration = [0.0, 0]
        self.created = now()
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def limit(self) -> int:
        """The largest max_tokens a request may ask for."""
        return min(self.options.max_tokens_limit or self.served.max_model_len, self.served.max_model_len)

    @property
    def healthy(self) -> bool:
        return self.engine_loop.error is None

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.engine_loop.start()

    def request_shutdown(self, exit_server: Callable[[], None] = lambda: None) -> None:
        """From any thread (the signal handler): stop taking requests, bound the in-flight ones, and
        call `exit_server()` once none is left (or `shutdown_timeout` has passed)."""
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._begin_shutdown, exit_server)
        else:
            exit_server()

    def _begin_shutdown(self, exit_server: Callable[[], None]) -> None:
        if self.draining:
            exit_server()  # asked twice: stop waiting
            return
        self.draining = True
        log.info("hgc serve: shutting down: %d request(s) in flight get %.1f s", len(self.generations),
                 self.options.abort_after)
        self.loop.call_later(self.options.abort_after, self.abort_all)
        self._drain_task = self.loop.create_task(self._exit_when_drained(exit_server))

    async def _exit_when_drained(self, exit_server: Callable[[], None]) -> None:
        deadline = self.loop.time() + self.options.shutdown_timeout
        while self.generations and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        exit_server()

    def abort_all(self) -> None:
        if self.generations:
            log.info("hgc serve: cancelling %d request(s) still in flight", len(self.generations))
        for generation in list(self.generations.values()):
            generation.aborted = True
            generation.close()

    async def stop(self) -> None:
        self.draining = True
        self.abort_all()
        await self.loop.run_in_executor(None, functools.partial(self.engine_loop.stop, 5.0))
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.prepare_executor.shutdown(wait=False, cancel_futures=True)
        log.info("hgc serve: engine stopped")

    # -- engine calls (off the event loop: each may wait for a step) --------------------------------

    def _cancel(self, request_id) -> None:
        try:
            self.executor.submit(self.engine_loop.cancel, request_id)
        except RuntimeError:  # the executor is shut down: EngineLoop.stop cancels what is left
            pass

    async def engine_stats(self) -> dict:
        stats = await self.loop.run_in_executor(self.executor, self.engine_loop.stats)
        if self.served.counters is not None:
            stats.update(self.served.counters())
        return stats

    async def submit(self, prompt_ids: list[int], params: list[SamplingParams], stop_strings: list[str],
                     endpoint: str) -> list[Generation]:
        """One prompt's requests (its n choices), added together: the first prefills, the others share it."""
        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        request_ids = [f"{prefix}-{uuid.uuid4().hex}" for _ in params]
        future = self.engine_loop.asubmit_group(prompt_ids, params, request_ids, self.loop)
        try:
            handles = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The response was cancelled while the submit ran: cancel the requests it makes.
            future.add_done_callback(lambda f: f.cancelled() or f.exception()
                                     or [self._cancel(request_id) for request_id in request_ids])
            raise
        except (GrammarError, GrammarUnavailable) as e:  # compiled by the engine core, which refused it
            raise _grammar_refusal(e) from None
        except ValueError as e:  # Engine.add_request's own checks (the app checks first; kept as a net)
            raise RequestError(str(e), param="prompt") from None
        except RuntimeError as e:
            raise RequestError(f"the engine is not running: {e}", status=503, type="service_unavailable") from None
        generations = []
        for handle, p in zip(handles, params):
            generation = Generation(handle.request_id, handle, prompt_ids, self.served.tokenizer, stop_strings,
                                    p.stop_token_ids, self._cancel, self._on_end)
            self.generations[handle.request_id] = generation
            generations.append(generation)
        self.prompt_tokens += len(prompt_ids)
        return generations

    def _on_end(self, generation: Generation) -> None:
        self.generations.pop(generation.request_id, None)
        self.finished[generation.finish_reason] += 1
        if generation.first_token_s is not None:
            self.ttft[0] += generation.first_token_s
            self.ttft[1] += 1
        self.duration[0] += time.perf_counter() - generation.submitted_s
        self.duration[1] += 1

    # -- request checks -----------------------------------------------------------------------------

    async def prepare(self, work: Callable, *args):
        """`work(*args)` on the request thread: CPU work of a request off the event loop."""
        return await self.loop.run_in_executor(self.prepare_executor, functools.partial(work, *args))

    def check_accepting(self) -> None:
        if self.draining:
            raise RequestError("the server is shutting down", status=503, type="service_unavailable",
                               headers={"Retry-After": self.options.retry_after})
        if not self.healthy:
            raise RequestError(f"the engine failed: {self.engine_loop.error!r}", status=503,
                               type="service_unavailable")

    def check_model(self, name: str) -> None:
        if name != self.served.name:
            raise RequestError(f"The model '{name}' does not exist; this server serves '{self.served.name}'",
                               status=404, param="model", code="model_not_found")

    def _tokenizer(self, param: str, what: str):
        if self.served.tokenizer is None:
            raise RequestError(f"{what} needs a tokenizer, and this server has none (the artifact carries no "
                               f"tokenizer.json and no --tokenizer was given): send the prompt as a list of token ids",
                               param=param, code="no_tokenizer")
        return self.served.tokenizer

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Each prompt of the request as token ids, checked against the vocabulary."""
        out = []
        for i, prompt in enumerate(req.prompt):
            param = "prompt" if len(req.prompt) == 1 else f"prompt.{i}"
            if isinstance(prompt, str):
                ids = self._tokenizer("prompt", "a text prompt").encode(prompt)
            else:
                ids = list(prompt)
                self._check_token_ids(ids, param, "prompt token id")
            if not ids:
                raise RequestError("the prompt is empty", param=param)
            out.append(ids)
        return out

    def _check_token_ids(self, ids, param: str, what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.served.vocab_size]
        if bad:
            raise RequestError(f"{what} {bad[0]} is outside the vocabulary (0 .. {self.served.vocab_size - 1})",
                               param=param, code="invalid_token_id")

    def prompt_text(self, req: CompletionRequest, index: int, ids: list[int]) -> str:
        """What echo shows: the prompt as sent, or its ids decoded (nothing without a tokenizer)."""
        prompt = req.prompt[index]
        if isinstance(prompt, str):
            return prompt
        return self.served.tokenizer.decode(ids) if self.served.tokenizer is not None else ""

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tokenizer = self._tokenizer("messages", "a chat request")
        if not tokenizer.has_chat_template:
            raise RequestError("this model's tokenizer has no chat template: use /v1/completions", param="messages",
                               code="no_chat_template")
        try:
            ids = tokenizer.encode_chat([m.template_dict() for m in req.messages], req.add_generation_prompt)
        except TokenizerError as e:
            raise RequestError(str(e), param="messages") from None
        if not ids:
            raise RequestError("the chat renders to an empty prompt", param="messages")
        return ids

    def grammar(self, req):
        """The request's response_format as a compiled grammar (None: unconstrained); on the request thread."""
        if req.response_format is None or not req.response_format.constrains():
            return None
        tokenizer = self._tokenizer("response_format", "structured output")
        if self.served.eos_token_id is None:
            raise RequestError("structured output needs an end-of-sequence token to end a complete JSON, and this "
                               "model's tokenizer names none", param="response_format")
        try:
            return self._grammar(req.response_format.to_json())
        except (GrammarError, GrammarUnavailable) as e:
            raise _grammar_refusal(e) from None

    def sampling(self, req, prompt_len: int, max_tokens: int | None, default: int | None, prompt_param: str,
                 logprobs: int | None = None, prompt_logprobs: int | None = None,
                 grammar=None) -> list[SamplingParams]:
        """The engine's SamplingParams of each of the request's n choices for one prompt, after the
        length checks (OpenAI's context_length_exceeded). Choice i draws with seed + i (vLLM's
        convention), so each is the request sent alone with n=1 and that seed."""
        context = self.served.max_model_len
        room = context - prompt_len
        if room < 1 and max_tokens != 0:
            raise RequestError(f"This model's maximum context length is {context} tokens; the prompt has "
                               f"{prompt_len} tokens, which leaves no room to generate", param=prompt_param,
                               code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default or self.limit, self.limit, room)
        elif max_tokens > self.limit:
            raise RequestError(f"max_tokens {max_tokens} is above this server's limit of {self.limit}",
                               param="max_tokens", code="max_tokens_too_large")
        elif prompt_len + max_tokens > context:
            raise RequestError(f"This model's maximum context length is {context} tokens; you asked for "
                               f"{prompt_len + max_tokens} ({prompt_len} in the prompt, {max_tokens} to generate)",
                               param="max_tokens", code="context_length_exceeded")
        if req.stop and self.served.tokenizer is None:
            self._tokenizer("stop", "a stop string")
        stop_ids = set(req.stop_token_ids or ())
        if self.served.eos_token_id is not None and not req.ignore_eos:
            stop_ids.add(self.served.eos_token_id)
        if req.logit_bias:
            self._check_token_ids(list(req.logit_bias), "logit_bias", "logit_bias token id")
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # echo without logprobs: the engine's prompt-only request scores, nobody reads
        return [SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_k=max(req.top_k, 0),
                               top_p=req.top_p, seed=None if req.seed is None else req.seed + i,
                               stop_token_ids=frozenset(stop_ids), presence_penalty=req.presence_penalty,
                               frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                               logit_bias=req.logit_bias or {}, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                               grammar=grammar)
                for i in range(req.n)]

    def metrics_snapshot(self) -> dict:
        return {"open_requests": len(self.generations), "requests": dict(self.requests),
                "finished": dict(self.finished), "errors": dict(self.errors), "prompt_tokens": self.prompt_tokens,
                "ttft_sum": self.ttft[0], "ttft_count": self.ttft[1], "duration_sum": self.duration[0],
                "duration_count": self.duration[1], "healthy": self.healthy, "draining": self.draining,
                "cpu_s": time.process_time()}


def _grammar_refusal(error: GrammarError | GrammarUnavailable) -> RequestError:
    if isinstance(error, GrammarUnavailable):  # this deployment's missing extra, not the client's mistake
        return RequestError(str(error), status=501, type="not_implemented_error", param="response_format",
                            code="structured_output_unavailable")
    return RequestError(str(error), param="response_format", code="invalid_response_format")


def _cached_tokens(choices: list[Choice]) -> int:
    """Prompt tokens the prefix cache served, once per prompt: a prompt's n choices share its
    prefill, and only the one that ran it reports the cached part."""
    per_prompt: dict[int, int] = {}
    for c in choices:
        per_prompt[id(c.prompt_ids)] = max(per_prompt.get(id(c.prompt_ids), 0), c.generation.cached_tokens)
    return sum(per_prompt.values())


async def _events(state, choices: list[Choice], chunk, usage, openings: list[dict] = ()):
    """The SSE events of a streamed request's choices, for either endpoint.

    The opening chunks (chat's role), one chunk per delta of any choice (`chunk(choice, text,
    logprobs, token_ids, finish)`), each choice's closing chunk (`chunk(choice, text, logprobs,
    [], finish_reason)`, with the echoed prompt when nothing came before it), the usage chunk
    when asked (`usage(completion_tokens, cached_tokens)`), then [DONE]. An engine failure ends the stream with
    an error event instead: the status line was sent long ago.
    """
    try:
        for opening in openings:
            yield sse_event(opening)
        async for kind, choice, delta in merged(choices):
            echo, echo_scores = choice.opening()
            text, scores = choice.delta(delta) if kind == "delta" else ("", None)
            if echo_scores is not None:
                scores = join([echo_scores, scores]) if scores is not None else echo_scores
            if kind == "delta":
                yield sse_event(chunk(choice, echo + text, scores, delta.token_ids, None))
            else:
                yield sse_event(chunk(choice, echo, scores, [], choice.generation.finish_reason))
        if usage is not None:
            yield sse_event(usage(sum(len(c.generation.token_ids) for c in choices), _cached_tokens(choices)))
    except EngineLoopError as e:
        state.errors[500] += 1
        yield sse_event(_engine_error_body(e))
    except Exception as e:  # a fault of ours after the status line: say so in the stream, not a cut connection
        state.errors[500] += 1
        log.exception("hgc serve: a stream failed after its first byte")
        yield sse_event(error_body(f"internal error: {e!r}", "server_error"))
    yield SSE_DONE


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, choices: list[Choice]) -> bool:
    """Run a non-streamed request's choices to their end; False if the client left first (their
    engine requests are cancelled)."""

    async def drain():
        async for _ in merged(choices):
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            work.result()
            return True
        return False
    finally:
        work.cancel()
        watch.cancel()
        close_all(choices)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it is larger than `limit` bytes: from Content-Length
    before a byte is read, else while it streams in (a chunked body), never after reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared):,} bytes (Content-Length)", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit:,} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> RequestError:
    return RequestError(f"the request body is {what}; this server takes at most {limit:,} bytes (hgc serve "
                        f"--max-body-mb)", status=413, code="request_too_large")


def _engine_error_body(error: BaseException) -> dict:
    return error_body(f"the engine failed: {error.__cause__ or error!r}", "server_error", None, "engine_error")


def create_app(served: ServedModel, options: ServerOptions | None = None, engine=None) -> FastAPI:
    """engine: the engine core's client (runtime/core/client.EngineCoreClient) when the engine runs in a
    process of its own; None: an EngineLoop over served.engine, in this process."""
    state = ServerState(served, options or ServerOptions(), engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="hgc", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install(app, (CompletionRequest, ChatCompletionRequest))
    app.state.hgc = state

    @app.exception_handler(RequestError)
    async def request_error(request: Request, error: RequestError):
        state.errors[error.status] += 1
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        # Unknown routes and methods: the same error shape as everything else.
        state.errors[error.status_code] += 1
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {error.detail}", kind),
                            status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, error: ClientDisconnect):
        # The client left before its body was read: nothing was submitted, nobody reads a reply.
        return Response(status_code=499)

    @app.exception_handler(EngineLoopError)
    async def engine_error(request: Request, error: EngineLoopError):
        # The loop has logged nothing: say once per request what failed. /health is 503 from now on.
        state.errors[500] += 1
        log.error("hgc serve: %s %s: the engine loop failed: %r", request.method, request.url.path, error.__cause__)
        return JSONResponse(_engine_error_body(error), status_code=500)

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception):
        # Only our own faults get here (a client's or a deployment's is a RequestError, 4xx or 501):
        # counted in /metrics; Starlette re-raises after sending this, so uvicorn logs the traceback.
        state.errors[500] += 1
        return JSONResponse(error_body(f"internal error: {error!r}", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if not state.healthy:
            return JSONResponse({"status": "engine_failed", "error": repr(state.engine_loop.error)}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": state.options.retry_after})
        return {"status": "ok", "model": served.name, "open_requests": len(state.generations)}

    @app.get("/v1/models")
    async def list_models():
        return models_body(served.name, state.created, served.max_model_len,
                           {**served.info, "vocab_size": served.vocab_size,
                            "tokenizer": served.tokenizer is not None,
                            "chat_template": bool(served.tokenizer and served.tokenizer.has_chat_template)})

    @app.get("/metrics")
    async def metrics():
        return Response(render_metrics(await state.engine_stats(), state.metrics_snapshot()), media_type=CONTENT_TYPE)

    async def submit_all(prompts: list[list[int]], params: list[list[SamplingParams]], req, endpoint: str,
                         make_choice) -> list[Choice]:
        """Every prompt's n requests; `make_choice(index, prompt index, generation)` wraps each."""
        choices = []
        try:
            for p, (prompt_ids, prompt_params) in enumerate(zip(prompts, params)):
                generations = await state.submit(prompt_ids, prompt_params, req.stop or [], endpoint)
                choices += [make_choice(p * req.n + i, p, g) for i, g in enumerate(generations)]
        except BaseException:
            close_all(choices)  # the prompts submitted before the one that failed
            raise
        state.requests[endpoint] += 1
        return choices

    def usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
        return usage_body(sum(map(len, prompts)), sum(len(c.generation.token_ids) for c in choices),
                          _cached_tokens(choices))

    def prepare_completion(body: bytes):
        """Everything of a completion request before the engine: on the request thread."""
        req = parse_body(body, CompletionRequest)
        req.refuse_unsupported()
        state.check_model(req.model)
        prompts = state.completion_prompts(req)
        prompt_logprobs = req.logprobs if req.echo else None
        grammar = state.grammar(req)
        params = [state.sampling(req, len(ids), req.max_tokens, state.options.default_max_tokens, "prompt",
                                 req.logprobs, prompt_logprobs, grammar) for ids in prompts]
        echoes = [state.prompt_text(req, p, ids) for p, ids in enumerate(prompts)] if req.echo else None
        return req, prompts, params, echoes

    @app.post("/v1/completions", openapi_extra=body_spec(CompletionRequest))
    async def completions(request: Request):
        state.check_accepting()
        body = await read_body(request, state.options.max_body_bytes)
        req, prompts, params, echoes = await state.prepare(prepare_completion, body)
        tokenizer = served.tokenizer

        def make_choice(index: int, p: int, generation: Generation) -> Choice:
            return Choice(index, generation, prompts[p], tokenizer, echoes[p] if echoes is not None else None,
                          "completion" if req.logprobs is not None else None)

        choices = await submit_all(prompts, params, req, "completions", make_choice)
        rid, created, model = choices[0].generation.request_id, now(), served.name
        if req.stream:
            def chunk(choice, text, scores, token_ids, finish):
                return completion_chunk(rid, model, created,
                                        completion_choice(choice.index, text, token_ids, finish, scores))

            usage_of = None  # or usage_of(completion_tokens) -> the usage chunk
            if req.stream_options and req.stream_options.include_usage:
                usage_of = functools.partial(usage_chunk, rid, model, created, "text_completion",
                                             sum(map(len, prompts)))
            return EventStreamResponse(_events(state, choices, chunk, usage_of), lambda: close_all(choices))
        if not await _collect(request, choices):
            return Response(status_code=499)  # nobody is listening; the status is for the access log
        bodies = []
        for c in choices:  # in index order
            text, scores = c.whole()
            bodies.append(completion_choice(c.index, text, c.generation.token_ids, c.generation.finish_reason, scores))
        return completion_body(rid, model, created, bodies, usage(prompts, choices))

    def prepare_chat(body: bytes):
        """Everything of a chat request before the engine (the template, tokenization): on the request thread."""
        req = parse_body(body, ChatCompletionRequest)
        req.refuse_unsupported()
        state.check_model(req.model)
        prompt_ids = state.chat_prompt(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        grammar = state.grammar(req)
        return req, prompt_ids, state.sampling(req, len(prompt_ids), req.token_limit, None, "messages", logprobs,
                                                grammar=grammar)

    @app.post("/v1/chat/completions", openapi_extra=body_spec(ChatCompletionRequest))
    async def chat_completions(request: Request):
        state.check_accepting()
        body = await read_body(request, state.options.max_body_bytes)
        req, prompt_ids, params = await state.prepare(prepare_chat, body)
        tokenizer = served.tokenizer

        def make_choice(index: int, p: int, generation: Generation) -> Choice:
            return Choice(index, generation, prompt_ids, tokenizer, None, "chat" if req.logprobs else None)

        choices = await submit_all([prompt_ids], [params], req, "chat", make_choice)
        rid, created, model = choices[0].generation.request_id, now(), served.name
        if req.stream:
            def chunk(choice, text, scores, token_ids, finish):  # finish: the closing chunk
                delta = {} if finish is not None else {"content": text}
                return chat_chunk(rid, model, created, choice.index, delta, token_ids, finish, scores)

            usage_of = None  # or usage_of(completion_tokens) -> the usage chunk
            if req.stream_options and req.stream_options.include_usage:
                usage_of = functools.partial(usage_chunk, rid, model, created, "chat.completion.chunk",
                                             len(prompt_ids))
            openings = [chat_chunk(rid, model, created, c.index, {"role": "assistant", "content": ""}, [], None)
                        for c in choices]
            return EventStreamResponse(_events(state, choices, chunk, usage_of, openings), lambda: close_all(choices))
        if not await _collect(request, choices):
            return Response(status_code=499)
        bodies = []
        for c in choices:
            text, scores = c.whole()
            bodies.append(chat_choice(c.index, text, c.generation.token_ids, c.generation.finish_reason, scores))
        return chat_body(rid, model, created, bodies, usage([prompt_ids], choices))

    return app
