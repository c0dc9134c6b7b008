"""The per-sample results file, and the samples files a run scores.

Results are appended and flushed one line per executed sample; reopening the file resumes:
its records are kept, a torn last line is cut off, and their samples are skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from mtp.paths import numbered_jsonl, parse_jsonl_line

# A resumed run must be the same run: these record fields must match the existing file's.
RUN_KEYS = ("task", "checkpoint", "decoding", "temperature", "top_p", "few_shot", "samples_file")


def read_samples(path: str | os.PathLike) -> list[tuple[str, str]]:
    """The `(task_id, completion)` pairs of a samples file, in order; task ids as strings."""
    samples = []
    for number, record in numbered_jsonl(path):
        if "task_id" not in record or not isinstance(record.get("completion"), str):
            raise ValueError(f"{path}:{number}: needs a 'task_id' and a string 'completion'")
        samples.append((str(record["task_id"]), record["completion"]))
    if not samples:
        raise ValueError(f"{path}: no samples (the file is empty)")
    return samples


class ResultsFile:
    """The per-sample results of a run at `path`, resumable. Use as a context manager."""

    def __init__(self, path: str | os.PathLike, run: dict[str, Any]):
        self.path = Path(path)
        self.run = run
        self.records = self._load()
        self._file: TextIO | None = None

    def done(self) -> set[tuple[str, int]]:
        """The `(task_id, sample)` pairs already recorded."""
        return {(str(r["task_id"]), r["sample"]) for r in self.records}

    def append(self, record: dict[str, Any]) -> None:
        """Write one sample's record (with the run's fields) and flush it to disk."""
        record = {**record, **self.run}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        self.records.append(record)

    def __enter__(self) -> ResultsFile:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def __exit__(self, *_: object) -> None:
        self._file.close()

    def _load(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        text = self.path.read_text(encoding="utf-8")
        lines = text.split("\n")
        if lines[-1]:  # interrupted mid-line: drop the torn record, it will be redone
            text = text[: len(text) - len(lines[-1])]
            self.path.write_text(text, encoding="utf-8")
        records = [parse_jsonl_line(line, self.path, i)
                   for i, line in enumerate(lines[:-1], 1) if line.strip()]
        for record in records:
            for key in RUN_KEYS:
                if record.get(key) != self.run.get(key):
                    raise ValueError(
                        f"{self.path} holds results of another run ({key}={record.get(key)!r}, "
                        f"this run has {self.run.get(key)!r}): choose another output= to start "
                        f"afresh")
        return records
