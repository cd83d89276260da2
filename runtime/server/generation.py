"""One request's life in the server, between its RequestHandle and the HTTP response.

1. The app submits the request to the EngineLoop and wraps the handle in a `Generation`.
2. `async for delta in generation.deltas()` yields one `Delta(text, token_ids, logprobs,
   offsets)` per batch of engine tokens that reached the server together (one token while the
   server keeps up; the steps it missed at once when its loop is busy, so a stream's chunks cost
   the server and the client per batch, not per token): the text they add (incremental decoding;
   empty without a tokenizer, or while the text might be the start of a stop string and is held
   back), their log-probability entries when the request asked for them, and where each token's
   text starts in `generation.text`. The prompt's scores, when asked for, are `prompt_logprobs`
   once the first delta comes (or the deltas end: a request that generates nothing).
3. A stop string found in the text ends the request at once: the text is cut before it, the
   engine request is cancelled. A stop token (eos or a client's stop_token_ids) is kept in
   `token_ids` but its text is not shown.
4. When the deltas end, `finish_reason` is "stop", "length", "abort" (the server cancelled it:
   shutdown), "cancelled" (the client left) or "error" (the engine loop failed; the deltas raise
   EngineLoopError); `on_end(generation)` runs exactly once.
5. `close()` cancels the engine request if it is still live, so its slot and pages return to the
   pools. It is idempotent and every exit path of a response calls it (a client that leaves
   mid-stream included).

It does not touch HTTP (app.py and sse.py do) nor hold the engine lock (the `cancel` callable it
is given runs EngineLoop.cancel off the event loop).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable

from runtime.engine.engine import RequestResult
from runtime.engine.loop import EngineLoopError, RequestHandle
from runtime.engine.logprobs import TokenLogprob
from runtime.artifact.tokenizer import IncrementalDecoder, TextTokenizer

__all__ = ["Delta", "Generation"]


@dataclasses.dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # for token_ids, when asked for
    offsets: list[int] = dataclasses.field(default_factory=list)  # where each token's text starts in the text


class Generation:
    def __init__(self, request_id: Hashable, handle: RequestHandle, prompt_ids: list[int],
                 tokenizer: TextTokenizer | None, stop_strings: list[str], hidden_token_ids: frozenset[int],
                 cancel: Callable[[Hashable], None], on_end: Callable[["Generation"], None]):
        self.request_id = request_id
        self.handle = handle
        self.prompt_ids = prompt_ids
        self.stop_strings = list(stop_strings)
        self.hidden_token_ids = hidden_token_ids
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids) if tokenizer is not None else None
        self._cancel = cancel
        self._on_end = on_end
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.offsets: list[int] = []
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        self.finish_reason: str | None = None
        self.result: RequestResult | None = None
        self.aborted = False  # set by the server before it cancels (shutdown)
        self._closed = False
        self.submitted_s = time.perf_counter()
        self.first_token_s: float | None = None  # seconds from submit to the first token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine's prefix cache served (known once the first token is in; 0 before)."""
        return self.handle.cached_tokens or 0

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string: not shown yet."""
        longest = max(map(len, self.stop_strings), default=1) - 1
        for k in range(min(longest, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return k
        return 0

    def _find_stop(self, searched_to: int) -> int | None:
        """Index of the earliest stop string that ends after `searched_to` (new text), or None."""
        longest = max(map(len, self.stop_strings))
        start = max(0, searched_to - longest + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        return min(hits) if hits else None

    async def deltas(self):
        shown = 0  # characters of self.text already yielded
        try:
            async for outs in self.handle.aoutput_batches():
                delta = Delta("", [])
                for out in outs:
                    if out.prompt_logprobs is not None:
                        self.prompt_logprobs = out.prompt_logprobs
                    token = out.token
                    if token is None:
                        continue  # the end of a request that only scored its prompt
                    if self.first_token_s is None:
                        self.first_token_s = time.perf_counter() - self.submitted_s
                    self.token_ids.append(token)
                    logprobs = [out.logprob] if out.logprob is not None else []
                    self.logprobs += logprobs
                    before = len(self.text)
                    self.offsets.append(before)
                    delta.token_ids.append(token)
                    delta.logprobs += logprobs
                    delta.offsets.append(before)
                    if self._decoder is not None and token not in self.hidden_token_ids:
                        self.text += self._decoder.push(token)
                    if self.stop_strings:
                        cut = self._find_stop(before)
                        if cut is not None:  # the tokens after this one in the batch are never shown
                            self.text = self.text[:cut]
                            self.offsets = [min(o, cut) for o in self.offsets]
                            self._closed = True
                            self._cancel(self.request_id)  # the engine would go on to max_tokens otherwise
                            self._end("stop")
                            delta.text, delta.offsets = self.text[shown:], [min(o, cut) for o in delta.offsets]
                            yield delta
                            return
                if not delta.token_ids:
                    continue
                upto = len(self.text) - (self._held_back() if self.stop_strings else 0)
                delta.text = self.text[shown:upto]
                yield delta
                shown = max(shown, upto)
        except EngineLoopError:
            self._closed = True  # the loop is gone, and every request with it
            self._end("error")
            raise
        except BaseException:
            self.close()  # a cancelled response: the engine request must not live on
            raise
        self.result = self.handle.result()  # the handle said "done": this does not wait
        reason = self.result.finish_reason
        if reason == "cancelled":
            reason = "abort" if self.aborted else "cancelled"
        if shown < len(self.text):
            yield Delta(self.text[shown:], [])  # held-back text that never became a stop string
        self._end(reason)

    def _end(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self._on_end(self)

    def close(self) -> None:
        """Cancel the engine request unless it has ended (idempotent, never blocks)."""
        if self._closed or self.finish_reason is not None:
            return
        self._closed = True
        self._cancel(self.request_id)  # a no-op in the engine if it finished meanwhile
        self._end("abort" if self.aborted else "cancelled")
