"""Where documents come from: the standard library, all installed Python, local files or the
Hub, each a frozen dataclass (Hydra builds it from `conf/data/*.yaml`) whose ``load()`` returns
a ``Corpus``. Every source skips, and counts, the same files whatever the tokenizer:
``binary`` (a NUL byte), ``not UTF-8`` and ``empty`` (whitespace only).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from mtp.cli import check_choices
from mtp.data.decontaminate import BENCHMARKS, NGRAM, load_references
from mtp.data.hub import check_hub_reachable, offline_message

TEXT_SUFFIXES_STRUCTURED = (".jsonl", ".json", ".parquet")
_PYTHON = f"py{sys.version_info.major}{sys.version_info.minor}"


def data_dir() -> Path:
    """Default home of prepared corpora and caches: ``$MTP_DATA_DIR``, else ``./data``."""
    return Path(os.environ.get("MTP_DATA_DIR", "data")).expanduser()


@dataclass(frozen=True)
class Corpus:
    """Documents of one source (column ``text``) and what was skipped on the way."""

    documents: datasets.Dataset | datasets.IterableDataset
    key: str  # names the caches; changes whenever the documents change
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> files
    contaminated: dict[str, list[str]] = field(default_factory=dict)  # file -> benchmark problems

    @property
    def streaming(self) -> bool:
        return isinstance(self.documents, datasets.IterableDataset)


@dataclass(frozen=True)
class StdlibSource:
    """The running interpreter's standard-library ``.py`` files (no download, ~30 MB), less
    ``site-packages`` (it varies by machine); the ``test`` packages stay."""

    def load(self) -> Corpus:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py")
                       if "site-packages" not in p.relative_to(root).parts)
        if not files:
            raise FileNotFoundError(f"no .py files under the standard library at {root}")
        ids, texts, skipped = _read_text_files(files, root)
        return _corpus(ids, texts, skipped, prefix=f"stdlib-{_PYTHON}", searched=[str(root)])


@dataclass(frozen=True)
class LocalSource:
    """Local files: text files (one document each), JSON lines or Parquet (one per record).
    ``paths``: files, folders (recursively, hidden entries skipped) or globs, each of which must
    match a file when the source is made, so that a typo fails before any work."""

    paths: list[str] | str
    text_field: str = "text"

    def __post_init__(self) -> None:
        paths = _listed(self.paths)
        if not paths:
            raise ValueError("LocalSource.paths is empty: name at least one file, folder or glob")
        missing = [path for path in paths if not _expand([path])]
        if missing:
            raise FileNotFoundError(f"data.source.paths: {', '.join(map(str, missing))} "
                                    f"match{'es' if len(missing) == 1 else ''} no file "
                                    f"(cwd {Path.cwd()})")

    def load(self) -> Corpus:
        paths = _listed(self.paths)
        files = sorted(set(_expand(paths)))
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
    """A Hugging Face Hub dataset by ``name``, ``config``, ``split`` and ``text_field``;
    ``streaming=True`` reads it without downloading it all. Offline, it fails at once."""

    name: str
    config: str | None = None
    split: str = "train"
    text_field: str = "text"
    streaming: bool = False
    revision: str | None = None

    def load(self) -> Corpus:
        check_hub_reachable(self.name)
        try:
            ds = datasets.load_dataset(self.name, self.config, split=self.split,
                                       streaming=self.streaming, revision=self.revision)
        except (ConnectionError, OSError) as e:
            raise ConnectionError(offline_message(self.name, reason=str(e))) from e
        columns = ds.column_names
        if columns is not None and self.text_field not in columns:
            raise ValueError(f"dataset {self.name!r} has no column {self.text_field!r}; "
                             f"columns: {columns}")
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


@dataclass(frozen=True)
class InstalledSource:
    """All Python source installed for this interpreter, deduplicated and decontaminated.

    ``paths``: the folders to read (None: ``sys.path``'s, less the script's folder and the
    working directory). A ``.py`` file reached twice, or with the bytes of one read before, is
    skipped as ``duplicate``; one sharing an n-gram of ``ngram`` words with a benchmark in
    ``decontaminate`` (``mtp.data.decontaminate``) as ``contaminated``, listed in
    ``Corpus.contaminated``. ``humaneval_file`` and ``mbpp_file`` replace the packaged and Hub
    copies. Verdicts are cached by file content under ``cache_dir`` (default: ``data_dir()``).
    """

    paths: tuple[str, ...] | None = None
    decontaminate: tuple[str, ...] = ("humaneval", "mbpp")
    humaneval_file: str | None = None
    mbpp_file: str | None = None
    ngram: int = NGRAM
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        # Hydra passes lists; tuples keep the source hashable (load() is memoised by it).
        if self.paths is not None:
            object.__setattr__(self, "paths", tuple(map(str, _listed(self.paths))))
        object.__setattr__(self, "decontaminate", tuple(_listed(self.decontaminate or ())))
        check_choices("data.source.decontaminate", self.decontaminate, BENCHMARKS)

    def roots(self) -> list[Path]:
        """The folders read, in order: ``paths``, or ``sys.path``'s (see the class docstring)."""
        if self.paths is not None:
            if not self.paths:
                raise ValueError("InstalledSource.paths is empty: name a folder, or null for "
                                 "sys.path's")
            missing = [p for p in self.paths if not Path(p).expanduser().is_dir()]
            if missing:
                raise ValueError(f"InstalledSource.paths: {missing} are not folders")
            return [Path(p).expanduser() for p in self.paths]
        # sys.path[0] is the running script's folder (or the working directory): not installed.
        here = Path.cwd().resolve()
        return [Path(p) for p in sys.path[1:]
                if p and Path(p).is_dir() and Path(p).resolve() != here]

    def load(self) -> Corpus:
        return _load_installed(self)


Source = StdlibSource | InstalledSource | LocalSource | HubSource


def _listed(value: str | Iterable) -> list:
    return [value] if isinstance(value, str) else list(value)


def _nonempty(texts: list[str]) -> list[bool]:
    return [bool(t and t.strip()) for t in texts]


def _expand(paths: list[str]) -> list[Path]:
    out = []
    for pattern in paths:
        matches = glob.glob(os.path.expanduser(pattern), recursive=True) or [pattern]
        for match in map(Path, matches):
            if match.is_dir():
                out += [p for p in match.rglob("*") if p.is_file() and not any(
                    s.startswith(".") for s in p.relative_to(match).parts)]
            elif match.is_file():
                out.append(match)
    return out


def _read_text_files(files: list[Path], root: Path | None) -> tuple[list[str], list[str], Counter]:
    """Ids (paths relative to ``root``, else as given), texts, and the files skipped by reason."""
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
        relative = root is not None and path.is_relative_to(root)
        ids.append(str(path.relative_to(root)) if relative else str(path))
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
    records = (json.loads(content) if content.lstrip().startswith("[")  # a .json array
               else [json.loads(line) for line in content.splitlines() if line.strip()])
    for n, record in enumerate(records):
        if text_field not in record:
            raise ValueError(f"{path} record {n} has no field {text_field!r}; fields: "
                             f"{sorted(record)} (set text_field)")
    return [record[text_field] or "" for record in records]


@functools.lru_cache(maxsize=2)
def _load_installed(source: InstalledSource) -> Corpus:
    # The references first: one that cannot be read fails before 400 MB of files are read.
    references = load_references(source.decontaminate, {
        "humaneval": source.humaneval_file, "mbpp": source.mbpp_file}, source.ngram)
    roots = source.roots()
    found = [p.resolve() for root in roots for p in _python_files(root)]
    files = list(dict.fromkeys(found))  # a file under two roots, or linked, is read once
    if not files:
        raise ValueError(f"no .py files in {[str(r) for r in roots]} (data=installed)")
    ids, texts, skipped = _read_text_files(files, root=None)
    first: dict[str, int] = {}  # content hash -> the first file with that content
    for i, text in enumerate(texts):
        first.setdefault(hashlib.blake2b(text.encode("utf-8", "surrogatepass"),
                                         digest_size=16).hexdigest(), i)
    skipped["duplicate"] = len(found) - len(files) + len(texts) - len(first)
    contaminated = {}
    if source.decontaminate:
        # Verdicts (the problems a content matched) are cached by content hash, per references.
        root = Path(source.cache_dir) if source.cache_dir is not None else data_dir()
        path = root / "decontamination" / f"{references.key}-n{references.ngram}.json"
        known = json.loads(path.read_text()) if path.is_file() else {}
        new = {digest: sorted(references.matches(texts[i])) for digest, i in first.items()
               if digest not in known}
        known.update(new)
        contaminated = {ids[i]: known[digest] for digest, i in first.items() if known[digest]}
        if new:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, path)  # whole or absent, whichever process writes last
        skipped["contaminated"] = len(contaminated)
    kept = [i for i in first.values() if ids[i] not in contaminated]
    corpus = _corpus([ids[i] for i in kept], [texts[i] for i in kept], skipped,
                     prefix=f"installed-{_PYTHON}", searched=[str(r) for r in roots])
    return dataclasses.replace(corpus, contaminated=contaminated)


def _python_files(root: Path) -> list[Path]:
    """Sorted ``.py`` files under ``root``; hidden and symlinked folders, broken links skipped."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        found += [p for p in (Path(folder, n) for n in sorted(names) if n.endswith(".py"))
                  if p.is_file()]
    return found


def _corpus(ids: list[str], texts: list[str], skipped: Counter, prefix: str,
            searched: list[str]) -> Corpus:
    if not texts:
        raise ValueError(f"empty corpus: no usable documents in {searched} (skipped: "
                         f"{dict(skipped) or 'none'})")
    # Content hash: editing, adding or removing any document gives new caches.
    digest = hashlib.blake2b(digest_size=6)
    for doc_id, text in zip(ids, texts):
        digest.update(doc_id.encode() + b"\0" + text.encode() + b"\0")
    documents = datasets.Dataset.from_dict({"id": ids, "text": texts})
    return Corpus(documents, f"{prefix}-{digest.hexdigest()}", dict(skipped))
