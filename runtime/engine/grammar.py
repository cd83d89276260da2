"""Structured output: JSON grammars compiled by xgrammar, matched token by token, as bitmasks on logits.

xgrammar is the grammar engine vLLM and SGLang use: it compiles a JSON schema (or "any JSON") for
one tokenizer's vocabulary into a grammar whose matcher, at any point of a generation, gives the
tokens allowed next as a bitmask (one bit per vocabulary entry), accepts the token chosen, and
rolls back tokens that speculative decoding did not keep.

1. `StructuredOutput(tokenizer, vocab_size, stop_token_ids)` describes the vocabulary to
   xgrammar once: every token's text as tokenizer.json decodes it (byte-level, Metaspace /
   byte-fallback or raw pieces: `vocab_type`), special tokens and tokens holding a control
   character as empty (never allowed: compact JSON has no raw control character), and the stop
   tokens, the only tokens allowed once the JSON is complete.
2. `compile(response_format)` takes the OpenAI field: {"type": "json_object"} (a JSON object)
   or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}. Grammars are
   compact: no whitespace between JSON tokens but the single spaces after ':' and ',' (a model
   could otherwise pad forever). A schema xgrammar cannot compile raises `GrammarError` naming
   xgrammar's reason. Compiled grammars are cached (xgrammar's own cache, by schema text).
3. `Grammar.matcher()` makes one request's `Matcher`: `fill(bitmask, row)` writes the tokens
   allowed next into a row of a bitmask (`new_bitmask`), `accept(token)` advances (False: the
   token is not allowed), `rollback(n)` undoes the last n accepted tokens, `terminated` says a
   stop token ended it.
4. `apply_bitmask(logits, bitmask)` sets the logits of disallowed tokens to -inf in place, on
   the logits' device (xgrammar's kernel: CPU, CUDA or Triton).

xgrammar is imported when the first `StructuredOutput` is made, not at import: it imports
transformers, which the runtime otherwise never loads. Without it, structured output is refused
with the package to install.

It does not choose tokens (the engine does) or decide what a request asked for (the server does).
"""

from __future__ import annotations

import json
import re
import threading

import torch

__all__ = ["GrammarError", "GrammarUnavailable", "StructuredOutput", "Grammars", "Grammar", "Matcher", "new_bitmask",
           "apply_bitmask", "verify_masks", "vocab_type"]


class GrammarError(ValueError):
    """A response_format that cannot become a grammar; the message names the field and xgrammar's reason."""


class GrammarUnavailable(RuntimeError):
    """Structured output asked for, and xgrammar is not installed."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise GrammarUnavailable(f"structured output (response_format) needs xgrammar, which is not importable "
                                 f"({e}); install it: pip install 'hgc[structured]'") from e
    return xgrammar


def vocab_type(tokenizer_json: dict) -> tuple[str, bool]:
    """(xgrammar vocabulary type name, add_prefix_space) from tokenizer.json's decoder.

    BYTE_LEVEL: GPT-2 style pieces ("Ġ" for a space byte). BYTE_FALLBACK: sentencepiece style
    ("▁" for a space, "<0x0A>" byte pieces); a Metaspace decoder is this kind too, with a prefix
    space when it prepends one. RAW: pieces are the text itself."""
    decoder = tokenizer_json.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {step.get("type") for step in steps if isinstance(step, dict)}
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL", False
    if "Metaspace" in kinds:
        meta = next(step for step in steps if step.get("type") == "Metaspace")
        prepend = meta.get("prepend_scheme", "always" if meta.get("add_prefix_space", True) else "never")
        return "BYTE_FALLBACK", prepend in ("always", "first")
    if "ByteFallback" in kinds or any(step.get("type") == "Replace" and "\u2581" in json.dumps(step.get("pattern"))
                                      for step in steps if isinstance(step, dict)):
        prefix = any(step.get("type") == "Strip" and step.get("start") for step in steps if isinstance(step, dict))
        return "BYTE_FALLBACK", prefix
    return "RAW", False


_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # "[17:05:43] /project/cpp/x.cc:4950: "


def _reason(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(error).__name__


class StructuredOutput:
    """Grammars for one tokenizer and vocabulary (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        """tokenizer: a runtime.artifact.tokenizer.TextTokenizer; vocab_size: the model's (the logits' width)."""
        if not stop_token_ids:
            raise GrammarError("structured output needs a stop token (the tokenizer's eos) to end a finished JSON")
        self.xgr = _xgrammar()
        doc = json.loads(tokenizer.tokenizer_json)
        kind, prefix_space = vocab_type(doc)
        encoded = [""] * vocab_size
        for piece, token in tokenizer.vocab().items():
            if token < vocab_size and token not in tokenizer.special_ids:
                encoded[token] = piece
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))

        def info():
            return self.xgr.TokenizerInfo(encoded, getattr(self.xgr.VocabType, kind), vocab_size=vocab_size,
                                          stop_token_ids=self.stop_token_ids, add_prefix_space=prefix_space)

        # xgrammar 0.2 lets a length-bounded JSON string hold raw control characters (U+0000-U+001F
        # but CR and LF), which JSON forbids (mlc-ai/xgrammar issue 800). Compact JSON needs none
        # anywhere, so tokens whose text holds one are left out of the vocabulary it sees (empty:
        # never allowed). Their text is known only decoded: xgrammar decodes once, then again.
        control = [t for t, text in enumerate(info().decoded_vocab) if encoded[t] and any(b < 0x20 for b in text)]
        for token in control:
            encoded[token] = ""
        self.tokenizer_info = info()  # what xgrammar takes each token's text to be (decoded_vocab)
        self._compiler = self.xgr.GrammarCompiler(self.tokenizer_info, max_threads=1)

    def compile(self, response_format: dict) -> "Grammar":
        """OpenAI's response_format (already checked for shape by the server) -> a Grammar."""
        kind = response_format.get("type")
        if kind == "json_object":  # OpenAI's JSON mode: a JSON object (not any JSON value), any content
            return Grammar(self, self._compile(lambda: self._compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False), "response_format"), "json_object")
        if kind == "json_schema":
            spec = response_format.get("json_schema") or {}
            schema = spec.get("schema")
            if not isinstance(schema, dict):
                raise GrammarError("response_format.json_schema.schema: must be a JSON schema object")
            text = json.dumps(schema)  # property order is output order: keep it
            # strict_mode (xgrammar's default): no property the schema does not name, unless it says
            # additionalProperties; OpenAI's strict schemas mean the same.
            compiled = self._compile(lambda: self._compiler.compile_json_schema(text, any_whitespace=False),
                                     "response_format.json_schema.schema")
            return Grammar(self, compiled, f"json_schema {spec.get('name', '')}".strip())
        raise GrammarError(f"response_format.type: {kind!r} is not 'json_object' or 'json_schema' (or 'text')")

    @staticmethod
    def _compile(make, where: str):
        try:
            return make()
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{where}: xgrammar cannot compile it: {_reason(e)}") from None


class Grammars:
    """Grammars compiled where the sampling runs (the server's process, or the engine core's): the
    StructuredOutput is made at the first structured request (xgrammar is imported then), and the
    threads that compile share it and its cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._structured: StructuredOutput | None = None
        self._lock = threading.Lock()

    def compile(self, response_format: dict) -> "Grammar":
        with self._lock:
            if self._structured is None:
                self._structured = StructuredOutput(*self._args)
            return self._structured.compile(response_format)


class Grammar:
    """One compiled grammar; requests that share it each get their own Matcher."""

    def __init__(self, owner: StructuredOutput, compiled, name: str):
        self.owner, self.compiled, self.name = owner, compiled, name

    def matcher(self) -> "Matcher":
        return Matcher(self.owner.xgr.GrammarMatcher(self.compiled))

    def __repr__(self) -> str:
        return f"Grammar({self.name})"


class Matcher:
    """One request's position in its grammar (xgrammar's GrammarMatcher)."""

    def __init__(self, matcher):
        self._m = matcher

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the JSON is complete and the generation over."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` [N, words] int32 (host): the tokens allowed next. After the end:
        every token (the row is not used for a choice then)."""
        if self._m.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return (not self._m.is_terminated()) and self._m.accept_token(int(token))

    def rollback(self, count: int) -> None:
        if count:
            self._m.rollback(count)


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 on the host, every token allowed."""
    words = -(-vocab_size // 32)
    return torch.full((rows, words), -1, dtype=torch.int32)


def verify_masks(matcher: Matcher, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> None:
    """Rows first_row .. first_row + D of `bitmask` for a verify step of drafts d_1 .. d_D: row j
    allows what may follow d_1 .. d_j. The matcher takes the drafts one by one and gives them
    back after; a draft it refuses ends the walk (later rows allow everything: a refused draft
    has probability 0 at its row, so nothing after it is kept)."""
    taken = 0
    for j in range(len(drafts) + 1):
        matcher.fill(bitmask, first_row + j)
        if j == len(drafts):
            break
        if not matcher.accept(drafts[j]):
            bitmask[first_row + j + 1:first_row + len(drafts) + 1].fill_(-1)
            break
        taken += 1
    matcher.rollback(taken)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [N, V] float (any device), bitmask [N, words] int32 (host): disallowed tokens to -inf, in place."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                         vocab_size=logits.shape[1])
