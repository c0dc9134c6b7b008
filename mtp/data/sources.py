"""Where documents come from: the embedded stdlib corpus, local files, or the Hub.

Every source is a small frozen dataclass (Hydra instantiates it from ``conf/data/*.yaml``)
whose ``load()`` returns a ``Corpus``: a ``datasets`` dataset with a ``text`` column,
a ``key`` naming its caches, and the files it skipped and why.

Skipping rule, the same for every tokenizer so byte and BPE models see the same
documents: a file with a NUL byte is ``binary``, one that is not valid UTF-8 is
``not UTF-8``, an empty or whitespace-only one is ``empty``; each is skipped and counted.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import datasets
from huggingface_hub import constants as hub_constants

TEXT_SUFFIXES_STRUCTURED = (".jsonl", ".json", ".parquet")


def data_dir() -> Path:
    """Default home of prepared corpora and caches: ``$MTP_DATA_DIR``, else ``./data``."""
    return Path(os.environ.get("MTP_DATA_DIR", "data")).expanduser()


@dataclass(frozen=True)
class Corpus:
    """Documents of one source (column ``text``) and what was skipped on the way."""

    documents: datasets.Dataset | datasets.IterableDataset
    key: str  # names the caches; changes whenever the documents change
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> files

    @property
    def streaming(self) -> bool:
        return isinstance(self.documents, datasets.IterableDataset)


@dataclass(frozen=True)
class StdlibSource:
    """The running interpreter's standard-library ``.py`` files (no download, ~30 MB).

    ``site-packages`` is excluded (third-party code that varies by machine); the ``test``
    packages stay: they are real, idiomatic Python.
    """

    def load(self) -> Corpus:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(
            p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts
        )
        if not files:
            raise FileNotFoundError(f"no .py files under the standard library at {root}")
        version = f"py{sys.version_info.major}{sys.version_info.minor}"
        return _corpus_from_files(files, root, prefix=f"stdlib-{version}")


@dataclass(frozen=True)
class LocalSource:
    """Local files: text files (one document each), JSON lines or Parquet (one per record).

    ``paths`` holds files, folders (read recursively, hidden entries skipped) or globs.
    """

    paths: list[str] | str
    text_field: str = "text"

    def load(self) -> Corpus:
        paths = [self.paths] if isinstance(self.paths, str) else list(self.paths)
        if not paths:
            raise ValueError("LocalSource.paths is empty: name at least one file, folder or glob")
        files = sorted(set(_expand(paths)))
        if not files:
            raise FileNotFoundError(f"no files found; searched {paths} (cwd {Path.cwd()})")
        plain = [f for f in files if f.suffix not in TEXT_SUFFIXES_STRUCTURED]
        structured = [f for f in files if f.suffix in TEXT_SUFFIXES_STRUCTURED]
        ids, texts, skipped = _read_text_files(plain, Path.cwd())
        for f in structured:
            for i, text in enumerate(_read_records(f, self.text_field)):
                if text.strip():
                    ids.append(f"{f}:{i}")
                    texts.append(text)
                else:
                    skipped["empty"] += 1
        return _corpus(ids, texts, skipped, prefix="local", searched=paths)


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face Hub dataset by ``name``, ``config``, ``split`` and ``text_field``.

    ``streaming=True`` reads without downloading the whole corpus (the DataModule shards
    the stream across ranks and dataloader workers). Without network this fails at once
    with a message that suggests a local path, instead of retrying HTTP requests.
    """

    name: str
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    revision: str | None = None

    def load(self) -> Corpus:
        _check_hub_reachable(self.name)
        try:
            ds = datasets.load_dataset(
                self.name, self.config, split=self.split, streaming=self.streaming,
                revision=self.revision,
            )
        except (ConnectionError, OSError) as e:
            raise ConnectionError(_offline_message(self.name, reason=str(e))) from e
        columns = ds.column_names
        if columns is not None and self.text_field not in columns:
            raise ValueError(
                f"dataset {self.name!r} has no column {self.text_field!r}; columns: {columns}"
            )
        ds = ds.select_columns([self.text_field])
        if self.text_field != "text":
            ds = ds.rename_column(self.text_field, "text")
        slug = self.name.replace("/", "--")
        key = f"hub-{slug}-{self.config or 'default'}-{self.split}-{self.revision or 'main'}"
        if self.streaming:
            return Corpus(ds, key)
        before = len(ds)
        ds = ds.filter(_nonempty, batched=True, input_columns="text")
        return Corpus(ds, key, {"empty": before - len(ds)} if before > len(ds) else {})


Source = StdlibSource | LocalSource | HubSource


def _nonempty(texts: list[str]) -> list[bool]:
    return [bool(t and t.strip()) for t in texts]


def _expand(paths: list[str]) -> list[Path]:
    out = []
    for pattern in paths:
        matches = glob.glob(os.path.expanduser(pattern), recursive=True) or [pattern]
        for match in map(Path, matches):
            if match.is_dir():
                out += [
                    p for p in match.rglob("*")
                    if p.is_file() and not any(s.startswith(".") for s in p.relative_to(match).parts)
                ]
            elif match.is_file():
                out.append(match)
    return out


def _read_text_files(files: list[Path], root: Path) -> tuple[list[str], list[str], Counter]:
    ids, texts, skipped = [], [], Counter()
    for path in files:
        data = path.read_bytes()
        if b"\0" in data:
            skipped["binary"] += 1
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not UTF-8"] += 1
            continue
        if not text.strip():
            skipped["empty"] += 1
            continue
        ids.append(str(path.relative_to(root)) if path.is_relative_to(root) else str(path))
        texts.append(text)
    return ids, texts, skipped


def _read_records(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if text_field not in table.column_names:
            raise ValueError(f"{path} has no column {text_field!r}; columns: {table.column_names}")
        return [t or "" for t in table.column(text_field).to_pylist()]
    content = path.read_text(encoding="utf-8")
    if content.lstrip().startswith("["):  # a .json array rather than JSON lines
        records = json.loads(content)
    else:
        records = [json.loads(line) for line in content.splitlines() if line.strip()]
    texts = []
    for n, record in enumerate(records):
        if text_field not in record:
            raise ValueError(
                f"{path} record {n} has no field {text_field!r}; fields: {sorted(record)} "
                "(set text_field)"
            )
        texts.append(record[text_field] or "")
    return texts


def _corpus_from_files(files: list[Path], root: Path, prefix: str) -> Corpus:
    ids, texts, skipped = _read_text_files(files, root)
    return _corpus(ids, texts, skipped, prefix=prefix, searched=[str(root)])


def _corpus(ids: list[str], texts: list[str], skipped: Counter, prefix: str, searched: list[str]) -> Corpus:
    if not texts:
        raise ValueError(
            f"empty corpus: no usable documents in {searched} (skipped: {dict(skipped) or 'none'})"
        )
    # Content hash: editing, adding or removing any document gives new caches.
    digest = hashlib.blake2b(digest_size=6)
    for doc_id, text in zip(ids, texts):
        digest.update(doc_id.encode() + b"\0" + text.encode() + b"\0")
    documents = datasets.Dataset.from_dict({"id": ids, "text": texts})
    return Corpus(documents, f"{prefix}-{digest.hexdigest()}", dict(skipped))


def _check_hub_reachable(name: str, timeout: float = 3.0) -> None:
    """Fail fast when the Hub cannot be reached (offline mode still reads the local cache)."""
    if hub_constants.HF_HUB_OFFLINE or datasets.config.HF_HUB_OFFLINE:
        return  # offline mode: datasets reads its cache and fails at once if the data is not there
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(endpoint, timeout=timeout)
    except urllib.error.HTTPError:
        pass  # an HTTP answer, even an error status, means the Hub is reachable
    except (urllib.error.URLError, OSError) as e:
        raise ConnectionError(_offline_message(name, reason=f"{endpoint} unreachable: {e}")) from e


def _offline_message(name: str, reason: str) -> str:
    return (
        f"cannot load Hub dataset {name!r} ({reason}). Without network, download it "
        "elsewhere and use a local source instead, e.g. `data=local data.source.paths=[/path/to/files]`; "
        "if it is already in your Hugging Face cache, set HF_HUB_OFFLINE=1."
    )
