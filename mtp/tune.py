"""Choices made by measurement: one record (`Measurement`), one cache (`TuneCache`,
`$MTP_CACHE/tune.json`), one key (`tune_key`).

What runs fastest (threads, dtype, drafter, trees, layer_skip) depends on the machine, its
load, the model and the step, so each tuning step measures its candidates (the user's
setting wins; else `tune`: the cache, else measure, and store). A timed step's key holds the
machine and its load in whole cores: a choice made idle is not reused under load.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mtp.cli import check_choice
from mtp.paths import cache_dir, write_json

CACHE_FILE = "tune.json"
HOW = ("measured", "cached", "set", "fixed")
NEAR_BEST = 0.95  # fewer threads win unless more are this much slower
ROUNDS = 3  # the counts take turns this many times

_ours: int | None = None  # the thread count this module set last (not the user's)


@dataclass(frozen=True)
class Measurement:
    """One tuning step's result, chosen how (`HOW`). figures: each candidate's, in `unit`;
    value: the choice as the step reads it back (JSON), when the label is not enough."""

    step: str
    choice: str
    how: str
    why: str = ""
    figures: dict[str, float] = field(default_factory=dict)
    unit: str = ""
    lower_is_better: bool = False
    seconds: float = 0.0
    budget: float | None = None
    left_out: tuple[str, ...] = ()
    machine: str = ""
    value: Any = None

    def __post_init__(self) -> None:
        check_choice("Measurement.how", self.how, HOW)
        if self.how == "measured" and not self.machine:  # a measured choice names its machine
            object.__setattr__(self, "machine", machine())

    def describe(self) -> str:
        """One line, e.g. `threads: 2 (measured in 1.0 s, of 2 cores; calls/s: 2 41.3, 1 30.2)`."""
        how = "cached, measured" if self.how == "cached" else self.how
        if self.seconds and self.figures:
            how += f" in {self.seconds:.1f} s"
            if self.budget is not None:
                how += f" of a {self.budget:.1f} s budget"
        if self.why:
            how += f", {self.why}" if self.figures else f": {self.why}"
        if self.figures:
            order = sorted(self.figures.items(), key=lambda item: item[1],
                           reverse=not self.lower_is_better)
            shown = ", ".join(f"{label} {_figure(value)}" for label, value in order)
            how += f"; {self.unit or 'figure'}: {shown}"
        if self.left_out:
            how += f"; {len(self.left_out)} left out by the budget"
        return f"{self.step}: {self.choice} ({how})"

    def cached(self) -> Measurement:
        """This record as read back from the cache."""
        return replace(self, how="cached")

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "left_out": list(self.left_out)}

    @classmethod
    def from_json(cls, values: Mapping[str, Any]) -> Measurement:
        return cls(**{**values, "left_out": tuple(values.get("left_out", ()))})


def _figure(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


class TuneCache:
    """The records of every tuning step, in one JSON file of key -> record."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else cache_dir() / CACHE_FILE

    def _table(self) -> dict[str, Any]:
        try:
            table = json.loads(self.path.read_text()) if self.path.is_file() else {}
        except (OSError, ValueError):
            return {}  # an unreadable cache is measured again, and rewritten
        return table if isinstance(table, dict) else {}

    def get(self, key: str) -> Measurement | None:
        try:
            return Measurement.from_json(self._table()[key])
        except (KeyError, TypeError, ValueError):  # none, or not a record
            return None

    def put(self, key: str, record: Measurement) -> None:
        write_json(self.path, {**self._table(), key: record.to_json()})


def fingerprint(value: Any, length: int = 12) -> str:
    """A short stable hash of a JSON-able value (a model config, a list of options)."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:length]


def tune_key(step: str, *, timed: bool = True, **what: Any) -> str:
    """The cache key of a step: the step, what it depends on, and if `timed` the machine."""
    parts = [step, *(f"{name}={value}" for name, value in what.items())]
    if timed:
        parts += [machine(), f"load={load_bucket()}"]
    return "|".join(parts)


def tune(step: str, key: str | None, measure: Callable[[], Measurement], *,
         cache: TuneCache | None = None,
         usable: Callable[[Measurement], bool] = lambda record: True) -> Measurement:
    """The record of `step`: the cached record for `key` (None: never cached) when `usable`;
    else `measure()`, stored under `key`. A user's own setting is its caller's to return."""
    cache = cache or TuneCache()
    if key is not None:
        found = cache.get(key)
        if found is not None and found.step == step and usable(found):
            return found.cached()
    began = time.perf_counter()
    record = measure()
    if not record.seconds and record.how == "measured":
        record = replace(record, seconds=time.perf_counter() - began)
    if key is not None and record.how == "measured":
        cache.put(key, record)
    return record


def report(record: Measurement) -> None:
    """Print a record's line where every command prints them: standard error."""
    print(record.describe(), file=sys.stderr, flush=True)


# -- the machine ------------------------------------------------------------------------------

def cores() -> int:
    """The cores this process may run on (its CPU affinity), as torch counts its default."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (elsewhere it is slower than float32)."""
    flags = _cpuinfo()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def machine() -> str:
    """What a timed choice depends on besides the model: CPU, cores, OpenMP wait, torch, GPU."""
    name = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                 if line.startswith("model name")), "unknown cpu")
    policy = os.environ.get("OMP_WAIT_POLICY", "default").lower()
    gpu = f"|gpu={torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{name}|cores={cores()}|wait={policy}|torch={torch.__version__}{gpu}"


def load_bucket() -> int:
    """The 1-minute load average in whole cores, at most the core count."""
    try:
        return min(cores(), round(os.getloadavg()[0]))
    except OSError:
        return 0


# -- threads ----------------------------------------------------------------------------------

def set_threads(count: int) -> None:
    """torch.set_num_threads, remembered as this module's (not the user's) setting."""
    global _ours
    torch.set_num_threads(count)
    _ours = count


def check_threads(threads: object) -> int | None:
    """A `threads=` setting: a positive integer, or None/"auto" (measured)."""
    if threads is None or threads == "auto":
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} must be a positive integer or auto (measured)")
    return threads


def given_threads(requested: int | None) -> Measurement | None:
    """The thread count that needs no measurement, set: `requested`, else OMP_NUM_THREADS,
    else the user's own torch.set_num_threads, else one on one core; None: measure it."""
    count, why = check_threads(requested), f"threads={requested}"
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if count is not None:
        set_threads(count)
    elif env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']!r} must be a "
                             f"positive integer")
        count, why = int(env), f"OMP_NUM_THREADS={env}"
    elif torch.get_num_threads() not in (cores(), _ours):
        count, why = torch.get_num_threads(), "torch.set_num_threads before"
    elif cores() == 1:
        return Measurement("threads", "1", "fixed", "one core", value=1)
    else:
        return None
    return Measurement("threads", str(count), "set", why, machine=machine(), value=count)


def thread_record(rates: dict[int, float], unit: str, seconds: float = 0.0) -> Measurement:
    """The record of measured `rates`: the fewest threads within NEAR_BEST of the best win."""
    best = max(rates.values())
    count = min(n for n, rate in rates.items() if rate >= NEAR_BEST * best)
    return Measurement("threads", str(count), "measured", f"of {cores()} cores",
                       figures={str(n): rate for n, rate in rates.items()}, unit=unit,
                       seconds=seconds, value=count)


def measure_rates(step: Callable[[], object], counts: list[int], budget: float,
                  rounds: int = ROUNDS) -> dict[int, float]:
    """Steps per second at each thread count, after a warm-up: every count in turn `rounds`
    times (at least one step each), so a change in the machine's load falls on all alike."""
    step()
    share = budget / (rounds * len(counts))
    runs, seconds = dict.fromkeys(counts, 0), dict.fromkeys(counts, 0.0)
    for _ in range(rounds):
        for count in counts:
            set_threads(count)
            began = time.perf_counter()
            while True:
                step()
                runs[count] += 1
                if time.perf_counter() - began >= share:
                    break
            seconds[count] += time.perf_counter() - began
    return {count: runs[count] / seconds[count] for count in counts}


def choose_threads(step: Callable[[], object], key: str, *, requested: int | None = None,
                   budget: float = 1.0, unit: str = "steps/s",
                   cache: TuneCache | None = None) -> Measurement:
    """Set the intra-op thread count for `step` (measured unless given); its record."""
    def measure() -> Measurement:  # `tune` times it
        return thread_record(measure_rates(step, list(range(1, cores() + 1)), budget), unit)

    record = given_threads(requested) or tune(
        "threads", key, measure, cache=cache,
        usable=lambda found: isinstance(found.value, int) and 1 <= found.value <= cores())
    if record.how in ("measured", "cached"):  # a setting is in force already
        set_threads(record.value)
    return record
