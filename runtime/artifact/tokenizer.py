"""Text in and out for the server: tokenizer files, encoding, chat templates, streaming decode.

A checkpoint's tokenizer is data: tokenizer.json (read by the `tokenizers` library, no code) and
tokenizer_config.json (special tokens, and a Jinja chat template rendered in a sandbox). So it may
travel in an artifact without breaking the rule that the runtime executes no code from one.

1. `tokenizer_files(checkpoint_dir)` picks the tokenizer files of a checkpoint (a fixed list of
   names) for the artifact writer to copy into the artifact folder.
2. `TextTokenizer.from_dir(folder)` loads them (None when the folder has no tokenizer.json):
   `encode(text)` adds bos the way tokenizer.json's post-processor says, `render_chat(messages)`
   renders the chat template and `encode_chat(messages)` encodes that without adding bos again
   (the template writes it), `decode(ids)` drops special tokens.
3. `IncrementalDecoder` turns a request's tokens, one at a time, into text deltas for streaming:
   each delta is the text the new tokens add, decoded with a little context before them so a
   piece that starts a word keeps its space, and held back while it ends in a partial character.

It does not train tokenizers (models/tokenizer.py makes one for `hgc init-model` checkpoints) or
download them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["TOKENIZER_FILES", "TokenizerError", "tokenizer_files", "TextTokenizer", "IncrementalDecoder"]

# Names copied from a checkpoint into an artifact, and looked for in a tokenizer folder. Data only.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used, or a chat that its template refuses; names the cause."""


def tokenizer_files(checkpoint_dir: str | os.PathLike) -> dict[str, bytes]:
    """{file name: bytes} of the checkpoint's tokenizer files; {} when it has no tokenizer.json."""
    root = Path(checkpoint_dir)
    if not (root / "tokenizer.json").is_file():
        return {}
    return {name: (root / name).read_bytes() for name in TOKENIZER_FILES if (root / name).is_file()}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TextTokenizer:
    """A loaded tokenizer: encode, decode, chat template. Thread-safe for encode and decode."""

    def __init__(self, tokenizer_json: str, config: dict | None = None, chat_template: str | None = None,
                 source: str = "tokenizer"):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers raises its own Exception subclass for malformed JSON
            raise TokenizerError(f"{source}/tokenizer.json: not a tokenizers document: {e}") from None
        self.source = source
        self.tokenizer_json = tokenizer_json  # the document as read (structured output reads its decoder)
        self.config = dict(config or {})
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.max_token_id = max(vocab.values()) if vocab else -1
        template = chat_template if chat_template is not None else self.config.get("chat_template")
        if isinstance(template, list):  # the named-template form: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template = template if isinstance(template, str) else None
        self._template = self._compile(self.chat_template) if self.chat_template else None

    @classmethod
    def from_dir(cls, folder: str | os.PathLike) -> "TextTokenizer | None":
        root = Path(folder)
        if not (root / "tokenizer.json").is_file():
            return None
        config = {}
        if (root / "tokenizer_config.json").is_file():
            try:
                config = json.loads((root / "tokenizer_config.json").read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise TokenizerError(f"{root / 'tokenizer_config.json'}: not valid JSON: {e}") from None
        template = None
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        return cls((root / "tokenizer.json").read_text(), config, template, str(root))

    # -- encode / decode --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: tokenizers releases the GIL only in its batch calls, and a
        # 100k-token prompt takes 0.2 s, during which the server's event loop (/health, streams)
        # would otherwise stand still.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def vocab(self) -> dict[str, int]:
        """Every piece (added tokens included) and its id, as tokenizer.json spells the pieces."""
        return self._tok.get_vocab(with_added_tokens=True)

    # -- chat -------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def _compile(self, source: str):
        # The sandbox refuses attribute access to Python internals: a template is data, not code.
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        try:
            return env.from_string(source)
        except TemplateError as e:
            raise TokenizerError(f"{self.source}: the chat template does not parse: {e}") from None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        if self._template is None:
            raise TokenizerError(f"{self.source}: the tokenizer has no chat template")
        specials = {k: _token_text(self.config.get(k)) or "" for k in ("bos_token", "eos_token", "pad_token",
                                                                         "unk_token")}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)
        except TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template writes bos itself (Hugging Face convention): do not add it a second time.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


class IncrementalDecoder:
    """One request's output tokens -> text deltas, as they arrive.

    Keeps two offsets into the token list: text before `read` was already returned, and decoding
    starts at `prefix` (a few tokens earlier), because a piece decoded alone can differ from the
    same piece after its neighbour (a word-start marker becomes a space only after a word). The
    delta is decode(tokens[prefix:]) minus decode(tokens[prefix:read]). A delta ending in U+FFFD
    (an incomplete multi-byte character) waits for the next token.

    Example (Metaspace pieces): prompt "Hi", outputs "▁there", "!" -> deltas " there", "!".
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int], context: int = 4):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-context:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""  # nothing visible yet (a special token), or half a character
        delta = text[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return delta
