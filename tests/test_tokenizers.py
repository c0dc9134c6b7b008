import json

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import models, pre_tokenizers

from mtp.tokenizers import BPETokenizer, ByteTokenizer, load_tokenizer

MIXED = "a é € 😀 ok"  # 1-, 2-, 3- and 4-byte UTF-8 characters
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)  # squares\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
] * 20


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train(CORPUS, vocab_size=400)


def stream(decoder, chunks) -> tuple[str, list[str]]:
    pieces = [decoder.push(chunk) for chunk in chunks]
    return "".join(pieces) + decoder.flush(), pieces


# --- byte tokenizer ---------------------------------------------------------------

def test_byte_layout():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (262, 256, 257, 258)
    assert tok.encode("aé") == [97, 0xC3, 0xA9]


@settings(max_examples=200, deadline=None)
@given(st.binary())
def test_byte_round_trip_any_bytes(data):
    tok = ByteTokenizer()
    assert tok.decode_bytes(tok.encode(data)) == data


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_round_trip_any_text(text):
    tok = ByteTokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_byte_decode_skips_specials_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([tok.bos_id, 104, 105, tok.eos_id, tok.pad_id]) == "hi"
    assert tok.decode(list(b"a\xffb")) == "a\ufffdb"
    with pytest.raises(ValueError, match="token id 262"):
        tok.decode([262])


def test_byte_incremental_decoder_every_split_point():
    tok = ByteTokenizer()
    ids = tok.encode(MIXED)
    for cut in range(len(ids) + 1):
        text, pieces = stream(tok.incremental_decoder(), [ids[:cut], ids[cut:]])
        assert text == MIXED
        assert "\ufffd" not in "".join(pieces)  # a cut character is held back, never mangled


def test_byte_incremental_decoder_one_byte_at_a_time():
    tok = ByteTokenizer()
    ids = tok.encode("😀")
    decoder = tok.incremental_decoder()
    assert [decoder.push([i]) for i in ids] == ["", "", "", "😀"]
    assert decoder.flush() == ""


def test_byte_incremental_decoder_flushes_a_dangling_partial_character():
    decoder = ByteTokenizer().incremental_decoder()
    assert decoder.push([0xE2, 0x82]) == ""
    assert decoder.flush() == "\ufffd"


def test_byte_save_load(tmp_path):
    ByteTokenizer().save(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


# --- BPE ----------------------------------------------------------------------------

def test_bpe_trains_with_specials_and_round_trips(bpe):
    assert 259 < bpe.vocab_size <= 400  # a tiny corpus may run out of merges first
    assert (bpe.pad_id, bpe.bos_id, bpe.eos_id) == (0, 1, 2)
    for text in [*CORPUS[:4], MIXED, "unseen ∑ text\twith\ttabs"]:
        ids = bpe.encode(text)
        assert bpe.special_ids.isdisjoint(ids)
        assert bpe.decode(ids) == text
    assert len(bpe.encode(CORPUS[0])) < len(CORPUS[0].encode())  # merges were learnt


def test_bpe_never_makes_specials_from_text(bpe):
    ids = bpe.encode("x<|eos|>y")
    assert bpe.eos_id not in ids
    assert bpe.decode(ids) == "x<|eos|>y"


def test_bpe_save_reload_encodes_identically(bpe, tmp_path):
    bpe.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert isinstance(again, BPETokenizer)
    assert again.fingerprint == bpe.fingerprint
    assert (again.bos_id, again.eos_id, again.pad_id) == (bpe.bos_id, bpe.eos_id, bpe.pad_id)
    for text in CORPUS[:4] + [MIXED]:
        assert again.encode(text) == bpe.encode(text)
    assert again.encode_batch(CORPUS[:4]) == bpe.encode_batch(CORPUS[:4])


def test_bpe_incremental_decoder_every_split_point(bpe):
    ids = bpe.encode(MIXED)
    for cut in range(len(ids) + 1):
        text, pieces = stream(bpe.incremental_decoder(), [ids[:cut], ids[cut:]])
        assert text == MIXED
        assert "\ufffd" not in "".join(pieces)
    text, _ = stream(bpe.incremental_decoder(), [[i] for i in ids])
    assert text == MIXED


def test_bpe_rejects_invalid_utf8_bytes(bpe):
    with pytest.raises(ValueError, match="UTF-8"):
        bpe.encode(b"\xff")


def test_load_existing_llama_style_tokenizer_json(tmp_path):
    """A foreign tokenizer.json (<s>, </s>, no pad) loads; specials are found by name."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "h": 3, "i": 4, "hi": 5}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("h", "i")], unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 2, 2)  # pad falls back to EOS
    assert loaded.encode("hi") == [5]
    assert loaded.decode([1, 5, 2]) == "hi"


def test_hf_tokenizer_config_names_the_specials(tmp_path):
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[PAD]": 3, "a": 4}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    tok.add_special_tokens(["[CLS]", "[SEP]", "[PAD]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "[CLS]"}, "eos_token": "[SEP]", "pad_token": "[PAD]"}))
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id) == (1, 2, 3)


def test_unknown_specials_fail_clearly(tmp_path):
    tok = tokenizers.Tokenizer(models.BPE(vocab={"[UNK]": 0, "a": 1}, merges=[], unk_token="[UNK]"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="bos token: tried"):
        load_tokenizer(tmp_path)


def test_missing_tokenizer_names_what_was_searched(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_bpe_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size=100"):
        BPETokenizer.train(CORPUS, vocab_size=100)
