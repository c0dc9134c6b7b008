"""Sources, split, packing and the cached pipeline (local data only)."""

import json
import time
import urllib.error
import urllib.request

import datasets
import huggingface_hub
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mtp.data import (
    HubSource, LocalSource, PackedBlocks, build_tokenizer, is_validation, num_blocks, pack_iter,
    prepare,
)
from mtp.data import sources
from mtp.tokenizers import ByteTokenizer


def write_corpus(root, n=30):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}  # é€😀\n" * (i % 5 + 1))
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    (root / "empty.py").write_text("  \n")
    (root / ".hidden").write_text("never read")
    return root


class CountingByteTokenizer(ByteTokenizer):
    calls = 0

    def encode_batch(self, texts):
        CountingByteTokenizer.calls += 1
        return super().encode_batch(texts)


# --- packing ------------------------------------------------------------------------

@pytest.mark.parametrize("n_tokens,seq_len,n_future", [(103, 8, 4), (12, 8, 4), (11, 8, 4), (64, 8, 1)])
def test_blocks_tile_the_stream_and_targets_are_real(n_tokens, seq_len, n_future):
    stream = np.arange(n_tokens, dtype=np.uint16) * 7 % 251
    blocks = PackedBlocks(stream, seq_len, n_future)
    assert len(blocks) == num_blocks(n_tokens, seq_len, n_future)
    tokens = torch.stack([blocks[j]["tokens"] for j in range(len(blocks))]) if len(blocks) else None
    covered = len(blocks) * seq_len
    remainder = n_tokens - covered
    assert remainder < seq_len + n_future  # only a partial block is left over
    if tokens is None:
        return
    assert tokens.shape == (len(blocks), seq_len + n_future)
    assert torch.equal(tokens[:, :seq_len].reshape(-1), torch.from_numpy(stream[:covered].astype(np.int64)))
    for j in range(len(blocks)):
        for t in range(seq_len):
            for i in range(n_future):  # head i at position t predicts stream[pos + i + 1]
                pos = j * seq_len + t
                assert tokens[j, t + i + 1] == stream[pos + i + 1]


def test_pack_iter_matches_packed_blocks():
    docs = [list(range(k, k + k % 7 + 1)) for k in range(40)]
    stream = np.array([t for d in docs for t in d])
    expected = PackedBlocks(stream, 5, 3)
    streamed = list(pack_iter(docs, 5, 3))
    assert len(streamed) == len(expected)
    assert all(torch.equal(a, expected[j]["tokens"]) for j, a in enumerate(streamed))


def test_block_args_are_validated():
    with pytest.raises(ValueError, match="seq_len"):
        PackedBlocks(np.zeros(10), 0, 1)
    with pytest.raises(ValueError, match="n_future"):
        PackedBlocks(np.zeros(10), 4, 0)


# --- split --------------------------------------------------------------------------

def test_split_is_deterministic_seeded_and_near_the_fraction():
    texts = [f"document {i}" for i in range(4000)]
    val = [is_validation(t, 0, 0.1) for t in texts]
    assert val == [is_validation(t, 0, 0.1) for t in texts]
    assert 300 < sum(val) < 500
    assert val != [is_validation(t, 1, 0.1) for t in texts]
    assert not any(is_validation(t, 0, 0.0) for t in texts)


# --- sources ------------------------------------------------------------------------

def test_local_source_skips_and_counts(tmp_path):
    corpus = LocalSource(paths=[str(write_corpus(tmp_path / "src"))]).load()
    assert len(corpus.documents) == 30
    assert corpus.skipped == {"binary": 1, "not UTF-8": 1, "empty": 1}


def test_local_source_globs_jsonl_and_parquet(tmp_path):
    write_corpus(tmp_path / "src", n=3)
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"content": f"doc {i}"}) for i in range(4)))
    pq.write_table(pa.table({"content": ["p1", "p2", ""]}), tmp_path / "docs.parquet")
    corpus = LocalSource(paths=[str(tmp_path / "src" / "*.py"), str(tmp_path / "docs.*")],
                         text_field="content").load()
    texts = corpus.documents["text"]
    assert len(texts) == 3 + 4 + 2
    assert {"doc 0", "p2"} <= set(texts)
    assert corpus.skipped == {"not UTF-8": 1, "empty": 2}


def test_key_changes_with_content(tmp_path):
    root = write_corpus(tmp_path / "src", n=3)
    key = LocalSource(paths=str(root)).load().key
    (root / "mod0.py").write_text("changed = True\n")
    assert LocalSource(paths=str(root)).load().key != key


def test_missing_path_names_what_was_searched(tmp_path):
    missing = str(tmp_path / "nope" / "*.py")
    with pytest.raises(FileNotFoundError, match="nope"):
        LocalSource(paths=[missing]).load()


def test_empty_corpus_is_a_clear_error(tmp_path):
    (tmp_path / "e.py").write_text("\n")
    with pytest.raises(ValueError, match=r"empty corpus.*'empty': 1"):
        LocalSource(paths=[str(tmp_path)]).load()


def test_missing_text_field(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="no field 'text'.*body"):
        LocalSource(paths=[str(tmp_path / "d.jsonl")]).load()


def test_hub_without_network_fails_fast(monkeypatch):
    def unreachable(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match="local source"):
        HubSource(name="someone/some-code-corpus").load()
    assert time.perf_counter() - start < 2


def test_hub_offline_mode_uncached_dataset_fails_clearly(monkeypatch, tmp_path):
    # HF_HUB_OFFLINE=1 is read at import; set the flags it sets
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match="someone/not-cached"):
        HubSource(name="someone/not-cached").load()
    assert time.perf_counter() - start < 10


# --- pipeline -----------------------------------------------------------------------

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
