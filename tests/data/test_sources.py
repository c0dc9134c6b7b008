"""Sources: local files (skipped and counted), content keys, clear errors, the Hub offline."""

import json
import time
import urllib.error
import urllib.request

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mtp.data import HubSource, LocalSource

from corpus_files import write_corpus  # tests/ is on the path


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


@pytest.mark.parametrize("offline, name, match, seconds", [
    (False, "someone/some-code-corpus", "local source", 2),  # no network: fails fast
    (True, "someone/not-cached", "someone/not-cached", 10),  # offline mode, not in the cache
])
def test_hub_unreachable_fails_clearly(monkeypatch, tmp_path, offline, name, match, seconds):
    def unreachable(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    # HF_HUB_OFFLINE=1 is read at import; set the flags it sets
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    start = time.perf_counter()
    with pytest.raises(ConnectionError, match=match):
        HubSource(name=name).load()
    assert time.perf_counter() - start < seconds
