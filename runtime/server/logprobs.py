"""Log-probabilities in the two shapes of the OpenAI API, with the text of each token.

1. A `ChoiceLogprobs` per choice that asked for them, made with the tokenizer (or None) and the
   tokens that come before what it will format: none when the prompt is echoed (its tokens are
   formatted too), else the prompt.
2. `prompt(entries, offsets)` (completions with echo) and `outputs(entries, offsets)` format the
   next tokens, in order: a stream formats each chunk's tokens as they come, a whole response
   all of them at once. Each returns the fields of its tokens; `join` puts parts together.

Shapes:
- completions (legacy): {"tokens": [str], "token_logprobs": [float | None], "top_logprobs":
  [{str: float} | None], "text_offset": [int]}. The echoed prompt's first token has no
  log-probability (None, and None for its alternatives). Each top_logprobs entry holds the k
  most likely tokens and the chosen one, so up to k + 1 entries, as OpenAI documents.
- chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}, top_logprobs holding the k most likely.

A token's text is the text it adds after the tokens before it (decoded with a few tokens of
context, as the streaming decoder does, so a word-start piece keeps its space), special tokens
written out. Without a tokenizer a token is written "token_id:<id>" (vLLM's spelling).

It does not compute log-probabilities (runtime/engine/logprobs.py) or place the text (generation.py
gives each token's offset in the choice's text).
"""

from __future__ import annotations

from runtime.engine.logprobs import TokenLogprob
from runtime.artifact.tokenizer import TextTokenizer

__all__ = ["ChoiceLogprobs", "join"]

CONTEXT = 4  # tokens decoded before the one being written (runtime/artifact/tokenizer.IncrementalDecoder's window)


class ChoiceLogprobs:
    def __init__(self, tokenizer: TextTokenizer | None, before: list[int], chat: bool):
        self.tokenizer = tokenizer
        self.context = list(before[-CONTEXT:])
        self.chat = chat

    def _texts(self, ids: list[int]) -> list[str]:
        """The text each of `ids` adds after the context (alternatives of one position)."""
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in ids]
        decode = self.tokenizer.decode
        before = decode(self.context, skip_special_tokens=False)
        texts = []
        for t in ids:
            text = decode(self.context + [t], skip_special_tokens=False)
            texts.append(text[len(before):] if text.startswith(before) else decode([t], skip_special_tokens=False))
        return texts

    def _format(self, entries: list[TokenLogprob | None], tokens: list[int], offsets: list[int]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
        content = []
        for token, entry in zip(tokens, entries):
            alternatives = [t for t, _ in entry.top] if entry is not None else []
            text, *alt_texts = self._texts([token] + alternatives)
            self.context = (self.context + [token])[-CONTEXT:]
            if self.chat:
                content.append({"token": text, "logprob": entry.logprob, "bytes": list(text.encode()),
                                "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())}
                                                 for a, (_, v) in zip(alt_texts, entry.top)]})
                continue
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            if entry is None:
                out["top_logprobs"].append(None)
                continue
            top = {a: v for a, (_, v) in zip(alt_texts, entry.top)}
            top.setdefault(text, entry.logprob)  # the chosen token, when it is not among the k
            out["top_logprobs"].append(top)
        return {"content": content} if self.chat else out

    def prompt(self, prompt_ids: list[int], entries: tuple[TokenLogprob, ...], offsets: list[int]) -> dict:
        """An echoed prompt: its first token has no entry, each later token one."""
        assert len(entries) == len(prompt_ids) - 1 and not self.chat
        return self._format([None, *entries], prompt_ids, offsets)

    def outputs(self, entries: list[TokenLogprob], offsets: list[int]) -> dict:
        return self._format(entries, [e.token for e in entries], offsets)


def join(parts: list[dict]) -> dict:
    """Parts of one choice's log-probabilities, in order, as one."""
    out = {key: [] for key in parts[0]}
    for part in parts:
        for key, values in part.items():
            out[key] += values
    return out
