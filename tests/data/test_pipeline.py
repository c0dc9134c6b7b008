"""The split and the cached pipeline: prepare accounts for every token, caches, trains BPE once."""

import numpy as np
import pytest

from mtp.data import LocalSource, build_tokenizer, is_validation, prepare
from mtp.tokenizers import ByteTokenizer

from corpus_files import write_corpus  # tests/ is on the path


class CountingByteTokenizer(ByteTokenizer):
    calls = 0

    def encode_batch(self, texts):
        CountingByteTokenizer.calls += 1
        return super().encode_batch(texts)


def test_split_is_deterministic_seeded_and_near_the_fraction():
    texts = [f"document {i}" for i in range(4000)]
    val = [is_validation(t, 0, 0.1) for t in texts]
    assert val == [is_validation(t, 0, 0.1) for t in texts]
    assert 300 < sum(val) < 500
    assert val != [is_validation(t, 1, 0.1) for t in texts]
    assert not any(is_validation(t, 0, 0.0) for t in texts)


def test_prepare_accounts_for_every_token(tmp_path):
    corpus = LocalSource(paths=[str(write_corpus(tmp_path / "src"))]).load()
    tok = ByteTokenizer()
    prepared = prepare(corpus, tok, val_fraction=0.2, seed=0, cache_dir=tmp_path / "cache")
    stats = prepared.stats(seq_len=16, n_future=4)
    texts = corpus.documents["text"]
    val_texts = [t for t in texts if is_validation(t, 0, 0.2)]
    assert 0 < len(val_texts) < len(texts)
    assert stats["val"]["documents"] == len(val_texts)
    assert stats["train"]["documents"] + stats["val"]["documents"] == len(texts)
    total_bytes = sum(len(t.encode()) for t in texts)
    assert stats["train"]["bytes"] + stats["val"]["bytes"] == total_bytes
    assert stats["train"]["tokens"] + stats["val"]["tokens"] == total_bytes + len(texts)  # + EOS each
    for split in ("train", "val"):
        s = stats[split]
        assert s["tokens"] == s["blocks"] * 16 + s["remainder_tokens"]
        assert len(prepared.stream(split)) == s["tokens"]
    # the val stream is exactly its documents, each followed by EOS, in corpus order
    expected = [t for text in val_texts for t in tok.encode(text) + [tok.eos_id]]
    assert prepared.stream("val").tolist() == expected
    assert stats["skipped"] == {"binary": 1, "not UTF-8": 1, "empty": 1}


def test_second_prepare_does_no_tokenisation(tmp_path):
    corpus = LocalSource(paths=[str(write_corpus(tmp_path / "src"))]).load()
    CountingByteTokenizer.calls = 0
    first = prepare(corpus, CountingByteTokenizer(), cache_dir=tmp_path / "cache")
    assert CountingByteTokenizer.calls > 0
    CountingByteTokenizer.calls = 0
    again = prepare(LocalSource(paths=[str(tmp_path / "src")]).load(), CountingByteTokenizer(),
                    cache_dir=tmp_path / "cache")
    assert CountingByteTokenizer.calls == 0
    assert (first.directory / "tokens.arrow").is_file()
    assert np.array_equal(first.stream("train"), again.stream("train"))


def test_bpe_is_trained_once_on_train_split_and_cached(tmp_path):
    source = LocalSource(paths=[str(write_corpus(tmp_path / "src"))])
    kwargs = dict(vocab_size=300, source=source, val_fraction=0.2, seed=0, cache_dir=tmp_path / "cache")
    tok = build_tokenizer("bpe", **kwargs)
    files = list((tmp_path / "cache").rglob("tokenizer.json"))
    assert len(files) == 1 and "bpe300-val0.2-seed0" in str(files[0])
    mtime = files[0].stat().st_mtime_ns
    again = build_tokenizer("bpe", **kwargs)
    assert files[0].stat().st_mtime_ns == mtime
    assert again.fingerprint == tok.fingerprint
    text = source.load().documents["text"][0]
    assert tok.decode(tok.encode(text)) == text
    prepared = prepare(source.load(), tok, val_fraction=0.2, cache_dir=tmp_path / "cache")
    assert tok.eos_id in prepared.stream("train").tolist()


def test_build_tokenizer_errors():
    with pytest.raises(ValueError, match="'word'"):
        build_tokenizer("word")
    with pytest.raises(ValueError, match="needs a source"):
        build_tokenizer("bpe")
    assert build_tokenizer("byte").vocab_size == 262
