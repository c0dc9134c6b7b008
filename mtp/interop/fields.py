"""Reading other libraries' files: typed JSON fields and weights, with errors that name the
file, field and value."""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mtp.paths import write_json as write_any_json

_REQUIRED = object()
_KINDS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
}


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; a ValueError naming the file if it is not one."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"corrupt {path}: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__} "
                         f"{value!r:.80}")
    return value


def peek_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None where there is none: for recognising a layout."""
    try:
        return read_json_object(path) if path.is_file() else None
    except ValueError:
        return None


def field(values: dict[str, Any], path: Path, name: str, kind: str,
          default: Any = _REQUIRED, choices: tuple | None = None) -> Any:
    """values[name], checked to be of `kind` (see _KINDS) and one of `choices` if given;
    `default` when absent or null."""
    value = values.get(name)
    if value is None:
        if default is _REQUIRED:
            problem = "is missing" if name not in values else "is null"
            raise ValueError(f"{path}: field {name!r} {problem}; it must be a {kind}")
        return default
    if not _KINDS[kind](value):
        raise ValueError(f"{path}: field {name!r} must be a {kind}, got {value!r}")
    if choices is not None and value not in choices:
        allowed = repr(choices[0]) if len(choices) == 1 else f"one of {list(choices)}"
        raise ValueError(f"{path}: field {name!r} must be {allowed}, got {value!r}")
    return value


def write_json(path: Path, value: Any) -> None:
    """A Hugging Face layout's JSON file, indented as transformers writes them."""
    write_any_json(path, value, indent=2)


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise FileNotFoundError(f"no {path.name} in {path.parent}")
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise ValueError(f"corrupt weights file {path}: {e}") from e


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` to `path` (its folder made if need be), as transformers saves them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})


def load_torch(path: Path, what: str, **options: Any) -> Any:
    """torch.load on the CPU, weights only; a ValueError saying `path` is not `what`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **options)
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        raise ValueError(f"cannot read {path} as {what}: {e}") from e


def check_keys(found: Iterable[str], expected: Iterable[str], what: str,
               allowed: Iterable[str] = ()) -> None:
    """A ValueError `what: unexpected keys [...], missing keys [...]` unless `found` is
    `expected` (give or take keys `allowed`)."""
    found, expected = set(found), set(expected)
    unknown, missing = sorted(found - expected - set(allowed)), sorted(expected - found)
    if unknown or missing:
        more = " (more left out)" if max(len(unknown), len(missing)) > 8 else ""
        raise ValueError(f"{what}: unexpected keys {unknown[:8]}, missing keys {missing[:8]}"
                         f"{more}")


def require(module: str, purpose: str, package: str | None = None) -> ModuleType:
    """Import an optional module, or fail naming its package and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = package or module
        raise ImportError(f"{purpose} needs the {package!r} package, which is not installed: "
                          f"pip install {package} (or pip install 'mtp[hf]')") from e
