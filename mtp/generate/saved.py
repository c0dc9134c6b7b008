"""Choices saved for a checkpoint: what a tuning step of minutes chose for a model rather than
a machine (`calibrate.py`'s trees, `skip_search.py`'s layers, `mtp.train.eagle`'s drafter).

`save_choice` keeps the step's `mtp.tune.Measurement` in the tuner's cache under the
checkpoint's identity, its `value` the JSON the drafter reads; `output=` also writes that
value as the drafter's file (`Drafter.saved_file`) to ship with the checkpoint, read where the
cache has no record. `saved_choices` reads them back (`DrafterContext.saved`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtp.decode.drafters.registry import drafter_types
from mtp.paths import read_json, write_json
from mtp.tune import Measurement, TuneCache, fingerprint, tune_key


def saved_files() -> dict[str, str]:
    """The file that holds each saved tuning step's choice, by step (the drafters' own)."""
    return {cls.saved: cls.saved_file for cls in drafter_types().values()
            if cls.saved is not None and cls.saved_file is not None}


def checkpoint_id(path: str | Path) -> str:
    """A checkpoint's identity for the tuner's cache: its resolved path and its files' sizes
    and modification times (not the choices saved beside it)."""
    path = Path(path).resolve()
    saved = set(saved_files().values())
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name not in saved) \
        if path.is_dir() else [path]
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()]
    return fingerprint([str(path), stats], length=16)


def saved_key(step: str, model_id: str) -> str:
    """The tuner's key of a tuning step's choice for a checkpoint (machine-independent)."""
    return tune_key(step, timed=False, model=model_id)


def saved_file(checkpoint: str | Path, name: str) -> Path:
    """A saved choice's file beside a checkpoint: in its directory, or beside a single file
    (a .ckpt, a GGUF) as FILE.<name>."""
    checkpoint = Path(checkpoint)
    return checkpoint / name if checkpoint.is_dir() else checkpoint.with_name(
        f"{checkpoint.name}.{name}")


def save_choice(checkpoint: str | Path, record: Measurement, output: str | Path | None = None,
                cache: TuneCache | None = None) -> list[str]:
    """Keep a tuning step's choice (`record.value`) for `checkpoint`, and write it in `output`
    (a directory: as the file its drafter reads) or at `output` when given; where it went."""
    files = saved_files()
    if record.step not in files:
        raise ValueError(f"step={record.step!r} is not a saved choice: no drafter reads it "
                         f"(saved steps: {sorted(files)})")
    cache = cache or TuneCache()
    cache.put(saved_key(record.step, checkpoint_id(checkpoint)), record)
    where = [f"{record.describe()}, in {cache.path}"]
    if output is not None:
        path = Path(output) / files[record.step] if Path(output).is_dir() else Path(output)
        where.append(str(write_json(path, record.value)))
    return where


def saved_choices(checkpoint: str | Path | None, model_id: str | None = None,
                  cache: TuneCache | None = None) -> dict[str, Any]:
    """The saved choice of every tuning step a drafter reads, by step: the cache's record for
    `checkpoint` (`model_id`: its `checkpoint_id`, when known), else the file beside it."""
    if checkpoint is None:
        return {}
    model_id = model_id or checkpoint_id(checkpoint)
    cache = cache or TuneCache()
    found: dict[str, Any] = {}
    for step, name in saved_files().items():
        record, path = cache.get(saved_key(step, model_id)), saved_file(checkpoint, name)
        if record is not None:
            found[step] = record.value
        elif path.is_file():
            found[step] = read_json(path, f"a saved {step} choice (delete it, or save the "
                                          f"choice again)")
    return found
