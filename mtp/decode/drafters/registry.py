"""Drafters by name: each drafter module registers its class (`@register`), whose class
attributes tell the rest of mtp everything about it (`Drafter`); every module of this package
is imported when the registry is first read (`drafter_types`).

`DrafterSpec` names a drafter with options, as the command lines do (`drafter=heads k=4`).
Options are one flat namespace, each key belonging to the drafters whose `Options` has it
(`num_draft` sizes prompt lookup, the draft model and layer skipping alike), checked against
the drafter named before anything loads. "auto", as the drafter or an option's value
(k=auto), means "measured" (`mtp.generate.auto`).

    DrafterSpec()                                         the model's heads, every one
    DrafterSpec("heads", k=4, tree="tree16")              heads 1..3 draft a 16-node tree
    DrafterSpec("auto")                                   measured
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Iterable, Mapping
from typing import Any

from mtp.cli import overrides
from mtp.decode.drafters.base import Autoregressive, Drafter, DrafterContext
from mtp.model import MTPModel

AUTO = "auto"
AUTOREGRESSIVE = "autoregressive"

_TYPES: dict[str, type[Drafter]] = {}
_loaded = False


def register(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make `cls` (with its `name` and `Options`) a named drafter."""
    name = cls.name
    if not name or name == AUTO or not dataclasses.is_dataclass(cls.Options):
        raise ValueError(f"a registered drafter needs a name (not {AUTO!r}) and an Options "
                         f"dataclass, got {cls.__name__} with name={name!r}")
    if name in _TYPES and _TYPES[name] is not cls:
        raise ValueError(f"two drafters are named {name!r}: {_TYPES[name].__name__} and "
                         f"{cls.__name__}")
    _TYPES[name] = cls
    return cls


def drafter_types() -> dict[str, type[Drafter]]:
    """Every registered drafter by name, each after the drafters its `after` names (the
    order in which `auto` measures them)."""
    global _loaded
    if not _loaded:  # registration happens on import: import every module of the package
        package = importlib.import_module("mtp.decode.drafters")
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"mtp.decode.drafters.{module.name}")
        _loaded = True
    ordered: dict[str, type[Drafter]] = {}

    def visit(name: str) -> None:
        if name not in ordered:
            for first in _TYPES[name].after:
                visit(first)
            ordered[name] = _TYPES[name]

    for name in _TYPES:
        visit(name)
    return ordered


def option_fields(cls: type[Drafter]) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls.Options)}


def option_owners() -> dict[str, list[str]]:
    """Each option's key -> the drafters whose Options have it."""
    owners: dict[str, list[str]] = {}
    for name, cls in drafter_types().items():
        for option in option_fields(cls):
            owners.setdefault(option, []).append(name)
    return owners


class DrafterSpec:
    """A drafter by name ("auto": measured), with the options that size it, checked here;
    what needs the model (k within its heads) is checked when the drafter is built."""

    def __init__(self, drafter: str = "heads", **options: Any) -> None:
        options = {key: value for key, value in options.items() if value is not None}
        types = drafter_types()  # an option given as None (null) is its default
        if drafter != AUTO and drafter not in types:
            raise ValueError(f"unknown drafter {drafter!r}: choose one of "
                             f"{', '.join([AUTO, *types])}")
        owners = option_owners()
        for key, value in options.items():
            if key not in owners:
                raise ValueError(f"unknown drafter option {key}={value!r}; the drafters' "
                                 f"options: {', '.join(sorted(owners))}")
            if drafter != AUTO and drafter not in owners[key]:
                raise ValueError(f"{key}={value!r} sizes {' or '.join(owners[key])}, not "
                                 f"drafter={drafter!r}")
        self.drafter = drafter
        self.options: Mapping[str, Any] = dict(options)
        measured = self.measured
        for name in self.measured_drafters if measured else [self.chosen]:  # values checked
            self.options_of(name, named=not measured)

    def options_of(self, name: str, *, named: bool = False) -> Any:
        """Drafter `name`'s `Options` from this spec's options (those it has)."""
        cls = drafter_types()[name]
        fields = option_fields(cls)
        options = cls.Options(**{k: v for k, v in self.options.items() if k in fields})
        if named:
            cls.check_named(options)
        return options

    @property
    def chosen(self) -> str:
        """The drafter this spec builds: the one named, or for drafter=auto the one an option
        selects (k=4 alone asks for the heads); "auto" when it is measured."""
        if any(value == AUTO for value in self.options.values()):
            return AUTO
        if self.drafter != AUTO:
            return self.drafter
        return next((name for name, cls in drafter_types().items()
                     if any(key in self.options for key in cls.selects)), AUTO)

    @property
    def measured(self) -> bool:
        """Whether the drafter is chosen by measurement (`mtp.generate.auto`)."""
        return self.chosen == AUTO

    @property
    def measured_drafters(self) -> list[str]:
        """The drafters a measured spec measures, in order: the one named, else those an option
        set to auto (k=auto) selects, else every drafter."""
        if self.drafter != AUTO:
            return [self.drafter]
        automatic = [key for key, value in self.options.items() if value == AUTO]
        return [name for name, cls in drafter_types().items()
                if not automatic or any(key in cls.selects for key in automatic)]

    def build(self, model: MTPModel, context: DrafterContext = DrafterContext()
              ) -> Drafter | None:
        """The drafter for `model` (None: autoregressive decoding)."""
        if self.measured:
            raise ValueError(f"{self} is chosen by measurement: use mtp.generate.auto "
                             f"(the command lines and mtp.generate.open_decoder do)")
        cls = drafter_types()[self.chosen]
        return cls.from_options(model, self.options_of(self.chosen), context)

    def candidates(self, model: MTPModel, context: DrafterContext,
                   measured: Mapping[str, float], name: str) -> Iterable[Drafter]:
        """Drafter `name`'s candidates for a measurement, sized by this spec's options."""
        cls = drafter_types()[name]
        return cls.candidates(model, self.options_of(name), context, measured)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DrafterSpec) and (self.drafter, dict(self.options)) == (
            other.drafter, dict(other.options))

    def __hash__(self) -> int:
        return hash((self.drafter, tuple(sorted(map(str, self.options.items())))))

    def __repr__(self) -> str:
        given = "".join(f" {key}={value!r}" for key, value in self.options.items())
        return f"drafter={self.drafter}{given}"


def make_drafter(model: MTPModel, drafter: Drafter | DrafterSpec | str | None,
                 context: DrafterContext = DrafterContext()) -> Drafter | None:
    """What `generate` decodes with, from a `Drafter`, a `DrafterSpec`, a registered name
    (default options) or None: a drafter, or None for autoregressive decoding."""
    if drafter is None or isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, str):
        drafter = DrafterSpec(drafter)
    if not isinstance(drafter, DrafterSpec):
        raise ValueError(f"drafter must be a Drafter, a DrafterSpec, a name or None, got "
                         f"{drafter!r:.80}")
    return drafter.build(model, context)


def options_help() -> str:
    """One line per registered drafter: its name, options and their defaults."""
    lines = []
    for name, cls in drafter_types().items():
        shown = " ".join(f"{f.name}={'null' if f.default is None else f.default}"
                         for f in option_fields(cls).values())
        summary = cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ""
        lines.append(f"  {name:<20} {shown or '(no options)'}\n  {'':<20} {summary}")
    return "\n".join(lines)


register(Autoregressive)  # defined with the seam, which cannot import this module


def entry_spec(entry: str, options: Mapping[str, Any], key: str) -> DrafterSpec:
    """One entry of a benchmark's list of drafters ("heads k=4") as a spec, with the shared
    `options` that belong to it; `key` names the list in the error for a measured entry."""
    name, *own = entry.split()
    owners = option_owners()
    given = {option: value for option, value in options.items()
             if name in owners.get(option, ())}
    spec = DrafterSpec(name, **given, **overrides(own))
    if spec.measured:
        raise ValueError(f"{key}: {entry!r} is chosen by measurement; name one drafter")
    return spec
