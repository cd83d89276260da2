"""A small tokenizer for `hgc init-model` checkpoints, so the server's text path works offline.

Real checkpoints ship their own tokenizer.json; the seeded random ones `hgc init-model` writes do
not, and no hub can be reached. This module makes one that fits the model:

1. Train a BPE (`tokenizers` library) on the built-in `CORPUS` with every printable ASCII
   character in its alphabet, so any ASCII text encodes without unknown tokens. Spaces become "▁"
   (Metaspace), so decoding gives back the text exactly.
2. Lay out the ids: the special tokens take the ids the model config names (bos_token_id,
   eos_token_id, pad_token_id) where it names them, the other specials take the lowest free
   ids, and the trained pieces fill the rest in training order. Every id is below the model's
   vocab_size, so every token the tokenizer makes is one the model can read.
3. Write tokenizer.json (what `tokenizers.Tokenizer.from_str` and transformers'
   PreTrainedTokenizerFast read) and tokenizer_config.json (special tokens, whether encoding adds
   bos, and a Jinja chat template in the Hugging Face convention).

Chat format (the template's output, then encoded without adding bos again)::

    <|bos|><|system|>Be brief.<|eos|><|user|>Hi<|eos|><|assistant|>

A turn ends with the eos token, so a model that stops at eos stops at the end of its turn.

It does not make a tokenizer for a model whose vocab_size is below the alphabet plus specials
(about 100 tokens): it raises ValueError instead.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = ["CORPUS", "SPECIAL_TOKENS", "ROLES", "build_tokenizer_files", "tokenizer_files_for_config"]

BOS, EOS, PAD, UNK = "<|bos|>", "<|eos|>", "<|pad|>", "<|unk|>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (BOS, EOS, PAD, UNK) + tuple(f"<|{role}|>" for role in ROLES)
_SPACE = "\u2581"  # "▁": what Metaspace writes for a space

# Plain text, written for this file, to train the merges on. Its content does not matter much:
# it only decides which frequent pieces get their own ids.
CORPUS = """\
A small model reads the text one piece at a time and writes the next piece.
The server takes a request, turns the words into numbers, and sends the numbers to the engine.
The engine runs the model on many requests together, a little of each in every step.
When a request is done, its memory goes back to the pool for the next one.
Linear attention keeps one state for each request; full attention keeps every past key and value.
A hybrid model puts both kinds of layers in one stack, so it is fast and still remembers.
The weather is mild today. The river runs past the old mill, and the children play by the water.
She asked him what time it was, and he said that it was a quarter past nine in the morning.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42 and 100 are tokens too.
Questions end with a question mark? Lists use commas, colons: and semicolons; quotes use "marks".
Hello! How are you? I am fine, thank you. What can I do for you today?
Please write a short answer. Here is the answer you asked for.
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
"""


def _alphabet() -> list[str]:
    # Printable ASCII except the space (Metaspace replaces it), plus the space marker and newline.
    return [chr(c) for c in range(33, 127)] + [_SPACE, "\n", "\t"]


def _chat_template(add_bos: bool) -> str:
    bos = "{{ bos_token }}" if add_bos else ""
    return (
        bos
        + "{% for message in messages %}"
        "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown chat role: ' + message['role']) }}"
        "{% endif %}"
        "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


def _layout(vocab_size: int, pieces: list[str], fixed: dict[int, str]) -> dict[str, int]:
    """token -> id: specials at their fixed ids, other specials at the lowest free ids, then pieces."""
    taken = dict(fixed)  # id -> token
    free = (i for i in range(vocab_size) if i not in taken)
    for token in SPECIAL_TOKENS:
        if token not in taken.values():
            taken[next(free)] = token
    for piece in pieces:
        taken[next(free)] = piece
    return {token: i for i, token in sorted(taken.items())}


def build_tokenizer_files(vocab_size: int, *, bos_token_id: int | None = None, eos_token_id: int | None = None,
                          pad_token_id: int | None = None, model_max_length: int | None = None) -> dict[str, str]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...}: a tokenizer whose every id is < vocab_size.

    The special token ids follow the model config where it gives them; with no bos_token_id the
    tokenizer still has a bos token but does not add it to prompts.
    """
    minimum = len(_alphabet()) + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"build_tokenizer_files: vocab_size {vocab_size} is below {minimum} (the alphabet and the "
                         f"special tokens); this model needs a tokenizer of its own")
    fixed: dict[int, str] = {}
    for token, token_id in ((BOS, bos_token_id), (EOS, eos_token_id), (PAD, pad_token_id)):
        # A config may give two names one id (pad = eos); the first keeps it, the other takes a free id.
        if token_id is not None and 0 <= token_id < vocab_size and token_id not in fixed:
            fixed[token_id] = token

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="never")
    tokenizer.decoder = decoders.Metaspace(replacement=_SPACE, prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIAL_TOKENS) + 1, special_tokens=[UNK],
                                  initial_alphabet=_alphabet(), min_frequency=2, show_progress=False)
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    doc = json.loads(tokenizer.to_str())

    trained = doc["model"]["vocab"]  # piece -> id, training order; holds UNK, which the layout places
    pieces = [p for p, _ in sorted(trained.items(), key=lambda item: item[1]) if p != UNK]
    vocab = _layout(vocab_size, pieces, fixed)
    assert len(vocab) <= vocab_size and max(vocab.values()) < vocab_size, "tokenizer ids must fit the model"
    doc["model"]["vocab"] = vocab
    doc["added_tokens"] = [
        {"id": vocab[t], "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for t in sorted(SPECIAL_TOKENS, key=vocab.__getitem__)]
    add_bos = bos_token_id is not None
    if add_bos:
        doc["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [vocab[BOS]], "tokens": [BOS]}},
        }
    tokenizer_json = json.dumps(doc, ensure_ascii=False, indent=1) + "\n"
    Tokenizer.from_str(tokenizer_json)  # fail here, not in a server, if the document is malformed

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length or 4096,
        "chat_template": _chat_template(add_bos),
    }
    return {"tokenizer.json": tokenizer_json,
            "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}


def tokenizer_files_for_config(config: dict, text_config: dict) -> dict[str, str]:
    """The tokenizer files for a checkpoint's config.json (and its family's flat text config)."""

    def field(name: str):
        value = text_config.get(name, config.get(name))
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    return build_tokenizer_files(int(text_config["vocab_size"]), bos_token_id=field("bos_token_id"),
                                 eos_token_id=field("eos_token_id"), pad_token_id=field("pad_token_id"),
                                 model_max_length=field("max_position_embeddings"))
