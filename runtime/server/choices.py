"""The choices of one HTTP request: a Generation for each (prompt, i < n), and what each shows.

1. The app submits each prompt's n requests together (they share the prompt's prefill) and
   wraps each Generation in a `Choice` with its index (prompt * n + i), its prompt, the echoed
   prompt text (completions with echo) and, when asked for, a log-probabilities formatter.
2. A stream: `merged(choices)` yields ("delta", choice, Delta) and ("end", choice, None) as the
   choices' generations produce them, interleaved, each choice's in order. `choice.opening()`
   gives the echoed prompt (text and scores) once, with the choice's first chunk, whichever that
   is (its first delta, or its closing chunk when it generates nothing); `choice.delta(d)` the
   text and scores of a delta.
3. A whole response: `choice.whole()` gives the choice's text (echo included) and scores.
4. `close_all(choices)` cancels every choice's engine request that is still live.

It does not build response bodies (protocol.py) or talk HTTP (app.py).
"""

from __future__ import annotations

import asyncio

from runtime.server.generation import Delta, Generation
from runtime.server.logprobs import ChoiceLogprobs, join
from runtime.artifact.tokenizer import IncrementalDecoder, TextTokenizer

__all__ = ["Choice", "merged", "close_all"]


class Choice:
    def __init__(self, index: int, generation: Generation, prompt_ids: list[int], tokenizer: TextTokenizer | None,
                 echo: str | None, logprobs: str | None):
        """echo: the prompt's text, shown before the completion (None: no echo).
        logprobs: None, "completion" (the legacy shape) or "chat"."""
        self.index = index
        self.generation = generation
        self.prompt_ids = prompt_ids
        self.tokenizer = tokenizer
        self.echo = echo
        self.formatter = None
        if logprobs is not None:
            self.formatter = ChoiceLogprobs(tokenizer, [] if echo is not None else prompt_ids, logprobs == "chat")
        self._opened = echo is None  # nothing to put before the first chunk

    @property
    def base(self) -> int:
        """Where the completion starts in the choice's text."""
        return len(self.echo or "")

    def _prompt_offsets(self) -> list[int]:
        if self.tokenizer is None:
            return [0] * len(self.prompt_ids)
        decoder, offsets, length = IncrementalDecoder(self.tokenizer, []), [], 0
        for token in self.prompt_ids:
            offsets.append(length)
            length += len(decoder.push(token))
        return offsets

    def opening(self) -> tuple[str, dict | None]:
        """(the echoed prompt, its scores) the first time; ("", None) after, or without echo."""
        if self._opened:
            return "", None
        self._opened = True
        scores = None
        # (no scores when the request ended before its prompt was scored: cancelled, or shut down)
        if self.formatter is not None and self.generation.prompt_logprobs is not None:
            scores = self.formatter.prompt(self.prompt_ids, self.generation.prompt_logprobs, self._prompt_offsets())
        return self.echo, scores

    def delta(self, delta: Delta) -> tuple[str, dict | None]:
        if self.formatter is None:
            return delta.text, None
        return delta.text, self.formatter.outputs(delta.logprobs, [self.base + o for o in delta.offsets])

    def whole(self) -> tuple[str, dict | None]:
        """The finished choice's text and scores."""
        text, scores = self.opening()
        if self.formatter is None:
            return text + self.generation.text, None
        generation = self.generation
        outputs = self.formatter.outputs(generation.logprobs, [self.base + o for o in generation.offsets])
        return text + generation.text, join([scores, outputs]) if scores is not None else outputs


async def merged(choices: list[Choice]):
    """("delta", choice, Delta) and ("end", choice, None) from every choice as they come; an
    engine failure in any of them is raised here."""
    if len(choices) == 1:  # the common case: no task and queue of its own per stream
        choice, deltas = choices[0], choices[0].generation.deltas()
        try:
            async for delta in deltas:
                yield "delta", choice, delta
            yield "end", choice, None
        finally:
            await deltas.aclose()  # a client that left: the request is cancelled now, not when collected
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        try:
            async for delta in choice.generation.deltas():
                queue.put_nowait(("delta", choice, delta))
            queue.put_nowait(("end", choice, None))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(("error", choice, error))

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        left = len(choices)
        while left:
            kind, choice, value = await queue.get()
            if kind == "error":
                raise value
            left -= kind == "end"
            yield kind, choice, value
    finally:
        for task in tasks:
            task.cancel()


def close_all(choices: list[Choice]) -> None:
    for choice in choices:
        choice.generation.close()
