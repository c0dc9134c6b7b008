"""JSON-lines files read with the file and line number in every error (benchmarks, samples,
results, distillation data)."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from typing import Any


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The JSON objects of a (optionally gzipped) JSON-lines file; blank lines are skipped."""
    for _, record in numbered_jsonl(path):
        yield record


def numbered_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a (optionally gzipped) JSON-lines file."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield number, parse_jsonl_line(line, path, number)


def parse_jsonl_line(line: str, path: str | os.PathLike, number: int) -> dict[str, Any]:
    """One line's JSON object; a ValueError naming `path` and line `number` otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{number}: not valid JSON ({e.msg}): "
                         f"{line.strip()[:80]!r}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}:{number}: expected a JSON object, got {line.strip()[:80]!r}")
    return record
