"""runtime/engine/grammar.py without a model: xgrammar sees the vocabulary as our tokenizer decodes it.

A grammar is only as right as xgrammar's idea of each token's text. For a Metaspace tokenizer
(the `hgc init-model` one: "▁" for a space) and a byte-level BPE one (GPT-2 / Qwen style: "Ġ"
for a space byte), random walks that choose only tokens the bitmask allows, ended by the stop
token, decode (with the tokenizer, as the server does) to JSON that validates against the
schema. The byte-level walk keeps to tokens of ASCII text: xgrammar 0.2 admits the UTF-8 bytes
of lone surrogates (U+D800-DFFF) in strings, which a walk over random bytes finds and a
tokenizer decodes to replacement characters; a trained model does not write them. Also:
rollback after drafts, the verify masks' walk, and errors that name xgrammar's reason.
"""

from __future__ import annotations

import json

import pytest
import torch

xgrammar = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from runtime.engine.grammar import GrammarError, StructuredOutput, apply_bitmask, new_bitmask, verify_masks, vocab_type  # noqa: E402
from runtime.artifact.tokenizer import TextTokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": -5, "maximum": 5000},
    "tags": {"type": "array", "items": {"enum": ["a b", "c"]}, "maxItems": 3}}, "required": ["name", "n", "tags"]}


def metaspace_tokenizer() -> TextTokenizer:
    from models.tokenizer import build_tokenizer_files

    files = build_tokenizer_files(256, bos_token_id=0, eos_token_id=1)
    return TextTokenizer(files["tokenizer.json"], json.loads(files["tokenizer_config.json"]))


def byte_level_tokenizer() -> TextTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"name": "a b", "tags": ["c"]} the quick brown fox éàü 0123456789'] * 20, trainer)
    return TextTokenizer(tok.to_str(), {"eos_token": "<|end|>"})


@pytest.mark.parametrize("make", [metaspace_tokenizer, byte_level_tokenizer], ids=["metaspace", "byte_level"])
def test_masked_random_walks_decode_to_valid_json(make):
    tok = make()
    V = tok.max_token_id + 1
    structured = StructuredOutput(tok, V, [tok.eos_token_id])
    grammar = structured.compile({"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    texts = structured.tokenizer_info.decoded_vocab
    non_ascii = torch.tensor([any(b >= 0x80 for b in text) for text in texts])
    assert non_ascii.any() == (make is byte_level_tokenizer)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        m = grammar.matcher()
        out = []
        while not m.terminated:
            assert len(out) < 400, tok.decode(out)
            bitmask = new_bitmask(1, V)
            m.fill(bitmask, 0)
            logits = torch.randn(1, V, generator=g) * 3
            logits[0, non_ascii] = -1e4  # see the module docstring
            apply_bitmask(logits, bitmask)
            token = int(torch.multinomial(torch.softmax(logits, -1)[0], 1, generator=g))
            assert m.accept(token)
            out.append(token)
        assert out[-1] == tok.eos_token_id
        jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)


def test_vocab_types_from_the_decoder():
    assert vocab_type({"decoder": {"type": "ByteLevel"}}) == ("BYTE_LEVEL", False)
    assert vocab_type({"decoder": {"type": "Metaspace", "prepend_scheme": "never"}}) == ("BYTE_FALLBACK", False)
    assert vocab_type({"decoder": {"type": "Metaspace", "prepend_scheme": "first"}}) == ("BYTE_FALLBACK", True)
    sentencepiece = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
        {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    assert vocab_type({"decoder": sentencepiece}) == ("BYTE_FALLBACK", True)
    assert vocab_type({"decoder": None}) == ("RAW", False)


def test_verify_masks_walk_the_drafts_and_give_them_back():
    tok = metaspace_tokenizer()
    V = tok.max_token_id + 1
    grammar = StructuredOutput(tok, V, [tok.eos_token_id]).compile(
        {"type": "json_schema", "json_schema": {"name": "t", "schema": {"enum": ["ab", "ac"]}}})
    quote, a, b = (tok.encode(t, add_special_tokens=False)[0] for t in ('"', "a", "b"))
    m = grammar.matcher()
    bitmask = new_bitmask(4, V)
    verify_masks(m, [quote, a, b], bitmask, 0)
    allowed = lambda row: {t for t in range(V) if (int(bitmask[row, t // 32]) >> (t % 32)) & 1}  # noqa: E731
    assert allowed(0) == {quote} and a in allowed(1) and b not in allowed(1)
    assert b in allowed(2) and a not in allowed(2) and quote in allowed(3) and a not in allowed(3)
    assert m.accept(quote), "the walk gave its drafts back: the matcher is where it started"
    m2 = grammar.matcher()
    bitmask = new_bitmask(4, V)
    verify_masks(m2, [quote, b, a], bitmask, 0)  # "b" cannot follow the quote: rows after it allow everything
    assert a in allowed(1) and b not in allowed(1) and len(allowed(2)) == len(allowed(3)) == V
    assert m2.accept(quote)


def test_a_schema_xgrammar_refuses_names_its_reason():
    tok = metaspace_tokenizer()
    out = StructuredOutput(tok, tok.max_token_id + 1, [tok.eos_token_id])
    with pytest.raises(GrammarError, match=r"response_format.json_schema.schema: xgrammar cannot compile it: "
                                           r"Unsupported type \"strin\""):
        out.compile({"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}})
    with pytest.raises(GrammarError, match="must be a JSON schema object"):
        out.compile({"type": "json_schema", "json_schema": {"schema": "nope"}})
