"""A stream's tokens that reach the server together go out as one delta (runtime/server/generation.py).

The server's event loop can fall behind the engine (many streams, SSE framing): the outputs of
the steps it missed are then queued on a request's handle at once, and `Generation.deltas()`
frames them as one delta instead of one per token. Text, token ids, offsets and stop strings come
out as they do one token at a time.
"""

from __future__ import annotations

import asyncio

from runtime.engine.loop import RequestHandle
from runtime.engine.request import RequestResult, StepOutput
from runtime.server.generation import Generation
from tests.runtime.engine.test_grammar import metaspace_tokenizer

TOKENIZER = metaspace_tokenizer()
WORDS = [TOKENIZER.encode(w, add_special_tokens=False)[0] for w in ("▁a", "▁b", "▁c", "▁d", "▁e")]


def run_stream(batches: list[list[int]], stop_strings=()) -> tuple[list, Generation, list]:
    """Feed the token batches to a handle, each batch queued before the consumer runs again; the
    deltas the generation yields, the generation, and the ids cancelled."""
    cancelled = []

    async def main():
        handle = RequestHandle("r", owner=None, loop=asyncio.get_running_loop())
        gen = Generation("r", handle, [WORDS[0]], TOKENIZER, list(stop_strings), frozenset(), cancelled.append,
                         lambda g: None)
        deltas = []

        async def consume():
            async for delta in gen.deltas():
                deltas.append(delta)
                await asyncio.sleep(0)

        task = asyncio.ensure_future(consume())
        sent = [t for batch in batches for t in batch]
        for batch in batches:
            for token in batch:
                handle._output(StepOutput("r", token, False))
            for _ in range(3):  # the puts land, then the consumer takes all of them at once
                await asyncio.sleep(0)
        handle._finish(RequestResult("r", (WORDS[0],), tuple(sent), "length", 0.0, 0.0, 0))
        await asyncio.wait_for(task, 5)
        return deltas, gen

    deltas, gen = asyncio.run(main())
    return deltas, gen, cancelled


def test_tokens_queued_together_make_one_delta_with_the_same_text():
    one_by_one, alone, _ = run_stream([[t] for t in WORDS[1:]])
    together, batched, _ = run_stream([WORDS[1:3], WORDS[3:]])
    assert [len(d.token_ids) for d in one_by_one] == [1, 1, 1, 1]
    assert [d.token_ids for d in together] == [WORDS[1:3], WORDS[3:]]
    assert "".join(d.text for d in together) == "".join(d.text for d in one_by_one) == alone.text == batched.text
    assert [o for d in together for o in d.offsets] == [o for d in one_by_one for o in d.offsets] == alone.offsets
    assert alone.text and batched.finish_reason == alone.finish_reason == "length"


def test_a_stop_string_inside_a_batch_ends_the_stream_at_it():
    deltas, gen, cancelled = run_stream([WORDS[1:]], stop_strings=["c"])
    assert gen.finish_reason == "stop" and cancelled == ["r"]
    assert len(deltas) == 1 and deltas[0].token_ids == WORDS[1:3]  # the tokens after the stop are not shown
    assert "c" not in gen.text and deltas[0].text == gen.text and max(deltas[0].offsets) <= len(gen.text)
