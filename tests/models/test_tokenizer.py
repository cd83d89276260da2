"""Tokenizers: the one `hgc init-model` writes (models/tokenizer.py) and the runtime's use of it (runtime/artifact/tokenizer.py).

- Every family's tiny config gets a tokenizer whose ids fit its vocab and whose bos / eos / pad
  ids are the config's; the same config gives the same bytes.
- ASCII text round-trips; init_checkpoint writes the files; `tokenizer_files` picks them up.
- transformers reads the same files and agrees on ids and on the chat template's text.
- The chat template runs in a sandbox and refuses unknown roles; IncrementalDecoder's deltas add
  up to the whole decode, also when a character spans two byte-level tokens.
"""

from __future__ import annotations

import io
import json

import pytest

from models.families import FAMILY_IDS, get_family
from models.tokenizer import SPECIAL_TOKENS, build_tokenizer_files, tokenizer_files_for_config
from runtime.artifact.tokenizer import TOKENIZER_FILES, IncrementalDecoder, TextTokenizer, TokenizerError, tokenizer_files

TEXTS = ["Hello, world! How are you today?", "The engine runs the model.\nA new line; tabs\tand ~odd {chars}.",
         "  two leading spaces and trailing  ", "x"]


def load(files: dict[str, str], tmp_path) -> TextTokenizer:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return TextTokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("family", FAMILY_IDS)
def test_family_tokenizer_fits_the_model_and_uses_its_special_ids(family, tmp_path):
    config = get_family(family).make_config("tiny")
    text = get_family(family).text_config(config)
    files = tokenizer_files_for_config(config, text)
    assert files == tokenizer_files_for_config(config, text), "the same config must give the same files"
    tok = load(files, tmp_path)
    assert tok.max_token_id < text["vocab_size"]
    vocab = json.loads(files["tokenizer.json"])["model"]["vocab"]
    assert len(set(vocab.values())) == len(vocab) and all(t in vocab for t in SPECIAL_TOKENS)
    for token, field in (("<|bos|>", "bos_token_id"), ("<|eos|>", "eos_token_id"), ("<|pad|>", "pad_token_id")):
        wanted = text.get(field, config.get(field))
        if wanted is not None and not (field == "pad_token_id" and wanted in (text.get("eos_token_id"),
                                                                             text.get("bos_token_id"))):
            assert vocab[token] == wanted, (token, field)
    for sample in TEXTS:
        ids = tok.encode(sample)
        assert all(0 <= i < text["vocab_size"] for i in ids)
        assert tok.decode(ids) == sample
    adds_bos = text.get("bos_token_id", config.get("bos_token_id")) is not None
    assert (tok.encode("hi")[0] == tok.bos_token_id) == adds_bos


def test_too_small_a_vocab_is_refused():
    with pytest.raises(ValueError, match="vocab_size 64"):
        build_tokenizer_files(64)


def test_init_checkpoint_writes_the_tokenizer_and_tokenizer_files_finds_it(tmp_path):
    from models.loader import init_checkpoint

    ckpt = init_checkpoint("qwen3_next", "tiny", 0, tmp_path / "ckpt", log=io.StringIO())
    files = tokenizer_files(ckpt)
    assert set(files) == {"tokenizer.json", "tokenizer_config.json"} and set(files) <= set(TOKENIZER_FILES)
    assert all(isinstance(data, bytes) for data in files.values())
    tok = TextTokenizer.from_dir(ckpt)
    assert tok.eos_token_id == json.loads((ckpt / "config.json").read_text())["eos_token_id"]
    assert tokenizer_files(tmp_path) == {} and TextTokenizer.from_dir(tmp_path) is None


def test_transformers_reads_the_same_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = load(build_tokenizer_files(256, bos_token_id=0, eos_token_id=1, pad_token_id=2), tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for sample in TEXTS:
        assert hf(sample)["input_ids"] == tok.encode(sample)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    rendered = tok.render_chat(chat)
    assert rendered == hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|bos|><|system|>Be brief.<|eos|><|user|>Hi there<|eos|><|assistant|>Hello.<|eos|>" \
                       "<|user|>Bye<|eos|><|assistant|>"
    ids = tok.encode_chat(chat)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the template's bos, not a second one


def test_chat_template_refuses_unknown_roles_and_runs_sandboxed(tmp_path):
    tok = load(build_tokenizer_files(256, bos_token_id=0, eos_token_id=1), tmp_path)
    with pytest.raises(TokenizerError, match="unknown chat role: tool"):
        tok.render_chat([{"role": "tool", "content": "x"}])
    # A template reaching for Python internals is stopped by the sandbox, as a TokenizerError.
    evil = TextTokenizer((tmp_path / "tokenizer.json").read_text(),
                         {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(TokenizerError, match="unsafe"):
        evil.render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(TokenizerError, match="does not parse"):
        TextTokenizer((tmp_path / "tokenizer.json").read_text(), {"chat_template": "{% for %}"})
    no_template = TextTokenizer((tmp_path / "tokenizer.json").read_text(), {})
    assert not no_template.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        no_template.render_chat([{"role": "user", "content": "x"}])


def test_incremental_decoder_deltas_add_up_to_the_whole_text(tmp_path):
    tok = load(build_tokenizer_files(256, bos_token_id=0, eos_token_id=1), tmp_path)
    for prompt, continuation in (("Hello,", " the engine runs many requests.\nDone!"), ("x", "y z"),
                                 ("The", " quick  brown\tfox")):
        ids = tok.encode(prompt + continuation)
        cut = len(tok.encode(prompt))
        decoder = IncrementalDecoder(tok, ids[:cut])
        deltas = [decoder.push(t) for t in ids[cut:]]
        assert "".join(deltas) == (prompt + continuation)[len(tok.decode(ids[:cut])):]
    # Special tokens (eos) add no text.
    decoder = IncrementalDecoder(tok, tok.encode("Hi"))
    assert decoder.push(tok.eos_token_id) == "" and decoder.push(tok.encode("Hi there", False)[-1]) != ""


def test_incremental_decoder_waits_for_a_whole_character():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # Byte-level pieces: "é" is two bytes, so two tokens; the first alone decodes to U+FFFD.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tok = TextTokenizer(tokenizer.to_str(), {})
    ids = tok.encode("café ok", add_special_tokens=False)
    decoder = IncrementalDecoder(tok, [])
    deltas = [decoder.push(t) for t in ids]
    assert "".join(deltas) == "café ok"
    assert "\ufffd" not in "".join(deltas) and "" in deltas  # the first byte of é waited
