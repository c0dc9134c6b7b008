"""The one command-line grammar of mtp: `python -m mtp.X [COMMAND] key=value ...`.

Arguments are Hydra overrides (prompt='def f(x):', lists as [a,b], null), parsed onto a
typed dataclass (`parse`); a bad key or value is a one-line error naming the key, before
anything loads. `auto` is the one spelling of "measured" (drafter=auto, threads=auto, ...).
The `check_*` functions are every setting's value checks, each returning the value or raising
a one-line `key=value must be ...`. This module imports nothing of mtp (and Hydra only when
it parses), so the model may import it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Collection
from typing import Any, TypeVar

import torch

AUTO = "auto"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Schema = TypeVar("Schema")
Choice = TypeVar("Choice")


def overrides(argv: list[str]) -> dict[str, Any]:
    """key=value arguments (Hydra's grammar) as a mapping of keys to Python values."""
    # Hydra and OmegaConf load here, not at the top: the model imports the checks below
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    try:
        parsed = OverridesParser.create().parse_overrides(list(argv))
    except HydraException as error:
        raise ValueError(f"bad arguments {argv}: {_one_line(error)}") from error
    values: dict[str, Any] = {}
    for override in parsed:
        if override.is_delete() or override.is_add() or override.is_force_add():
            raise ValueError(f"{override.input_line!r}: write key=value (no +, ++ or ~ here)")
        values[override.key_or_group] = override.value()
    return values


def parse(argv: list[str], schema: type[Schema], *, extra: Collection[str] = (),
          extra_field: str | None = None) -> Schema:
    """The dataclass `schema` with its defaults overridden by `argv` (key=value), checked.
    Keys in `extra` (a drafter's options) go into the mapping field `extra_field`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException
    values = overrides(argv)
    collected = {key: values.pop(key) for key in list(values) if key in extra}
    if extra_field is not None:
        values[extra_field] = collected
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), values)
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as error:
        missing = getattr(error, "full_key", None) or "a value"
        raise ValueError(f"{missing}=... is required") from None
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or ""
        if "Key '" in str(error) and "not in" in str(error):
            known = sorted({*_fields(schema), *extra} - {extra_field})
            raise ValueError(f"unknown key {key or _one_line(error)!s}; known: "
                             f"{', '.join(known)}") from None
        shown = f"{key}={values.get(key)!r}: " if key in values else ""
        raise ValueError(f"{shown}{_one_line(error)}") from None


def _fields(schema: type) -> list[str]:
    return [name for name in getattr(schema, "__dataclass_fields__", {})
            if not name.startswith("_")]


def _one_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def check_positive(key: str, value: object, least: int = 1, need: str = "") -> int:
    """`value` if it is an integer >= `least` (a bool is not); `need`: what it must be."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        need = need or ("a positive integer" if least == 1 else f"an integer >= {least}")
        raise ValueError(f"{key}={value!r} must be {need}")
    return value


def check_positives(owner: object, *keys: str, least: int = 1, optional: bool = False) -> None:
    """`check_positive` on each of `owner`'s attributes `keys` (`optional`: None passes)."""
    for key in keys:
        value = getattr(owner, key)
        if not (optional and value is None):
            check_positive(key, value, least)


def check_flag(key: str, value: object) -> bool:
    """`value` if it is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be true or false")
    return value


def check_number(key: str, value: object, ok: Callable[[float], bool] = lambda _: True,
                 need: str = "a finite number") -> float:
    """`value` as a float if it is a finite number (not a bool) and `ok`, else a ValueError."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if number is None or not math.isfinite(number) or not ok(number):
        raise ValueError(f"{key}={number if number is not None else repr(value)} must be {need}")
    return number


def check_numbers(key: str, values: object, ok: Callable[[float], bool], need: str,
                  length: int | None = None) -> tuple[float, ...]:
    """`values` as a tuple of floats: a list (of `length`) of `check_number`s that are `ok`."""
    if isinstance(values, (list, tuple)) and (length is None or len(values) == length):
        try:
            return tuple(check_number(key, value, ok) for value in values)
        except ValueError:
            pass
    shown = list(values) if isinstance(values, (list, tuple)) else repr(values)
    raise ValueError(f"{key}={shown} must be {need}")


def check_choice(key: str, value: Choice, choices: Collection[Any], also: str = "") -> Choice:
    """`value` if it is one of `choices` (`also`: what else the setting takes)."""
    if value not in choices:
        raise ValueError(f"{key}={value!r} is not one of {_spelled(choices)}"
                         + (f" ({also})" if also else ""))
    return value


def check_choices(key: str, values: Collection[Choice], choices: Collection[Any]
                  ) -> Collection[Choice]:
    """`values` if each is one of `choices` (a list setting: recipes=[...], levels=[...])."""
    for value in values:
        if value not in choices:
            raise ValueError(f"{key}: {value!r} is not one of {_spelled(choices)}")
    return values


def _spelled(choices: Collection[Any]) -> str:
    """The choices as a command line spells them: a, b, true, null."""
    words = {True: "true", False: "false", None: "null"}
    return ", ".join(words[c] if c is None or isinstance(c, bool) else str(c) for c in choices)


def parse_dtype(name: object, *, auto: bool = False) -> torch.dtype | str | None:
    """A dtype name's torch dtype; None (the checkpoint's own) and, if `auto`, "auto" kept."""
    if name is None or (auto and name == AUTO):
        return name
    if name not in DTYPES:
        allowed = sorted(DTYPES) + ([AUTO] if auto else []) + ["null"]
        raise ValueError(f"dtype={name!r} is not one of {', '.join(allowed)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name DTYPES gives `dtype` (float32, bfloat16, ...)."""
    return str(dtype).removeprefix("torch.")


def main(run: Callable[[list[str]], Any], doc: str | None = None,
         errors: tuple[type[Exception], ...] = (ValueError, FileNotFoundError)) -> None:
    """Run a command on sys.argv[1:]: `--help` prints `doc`; `errors` end it in one line."""
    argv = sys.argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        print((doc or "").strip())
        return
    try:
        run(argv)
    except errors as error:
        sys.exit(f"error: {_one_line(error) if isinstance(error, OSError) else error}")
