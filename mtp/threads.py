"""Intra-op threads chosen by measurement, not by assumption.

torch starts one thread per core. Whether that is fastest depends on the model, the step
and the machine's load: a small model's decode step at batch 1 gains little from a second
thread even on an idle machine, SmolLM2-135M's does; and when another process holds a core,
every parallel region of a step waits for a thread that is not running. So the count is
measured: `choose_threads` runs a step at each count from 1 to the cores available, the
counts taking turns (about a second in all for decoding; the training loop measures its own
first steps, `mtp.train.pace`), keeps the fastest (the fewest threads within 5% of it: noise, and
cores left to others), sets it, prints it in one line and caches it in `<cache_dir>/threads.json` (`mtp.paths.cache_dir`)
keyed by what it depends on: the model's shape, dtype and device, the step's width and batch,
the machine (CPU, cores, OpenMP wait policy) and its load (the load average rounded to whole
cores, so a choice made on an idle machine is not reused under load).

An explicit setting wins and nothing is measured: `threads=N` (the command lines' option),
`OMP_NUM_THREADS`, or `torch.set_num_threads` called before (torch's count differs from the
one it starts with and from the last one this module set).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtp.paths import cache_dir

CACHE_FILE = "threads.json"
NEAR_BEST = 0.95  # fewer threads win unless more are this much slower
ROUNDS = 3  # the counts take turns this many times
EXPLICIT = ("threads=", "OMP_NUM_THREADS=", "torch.set_num_threads")  # how a user sets it

_ours: int | None = None  # the count this module set last (not an explicit user setting)


def cores() -> int:
    """The cores this process may run on (its CPU affinity), as torch counts its default."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); elsewhere bf16 is
    emulated and slower than float32. False where /proc/cpuinfo cannot be read."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def set_threads(count: int) -> None:
    """torch.set_num_threads, remembered as this module's (not the user's) setting."""
    global _ours
    torch.set_num_threads(count)
    _ours = count


def explicit_threads() -> tuple[int, str] | None:
    """The user's thread count and where it comes from, or None when nothing was set."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']!r} must be a "
                             f"positive integer")
        return int(env), f"OMP_NUM_THREADS={env}"
    now = torch.get_num_threads()
    if now not in (cores(), _ours):
        return now, "torch.set_num_threads before"
    return None


@dataclass
class ThreadChoice:
    """The thread count in use and how it was chosen."""

    threads: int
    how: str  # "measured", "cached", or the explicit setting ("threads=2", "OMP_NUM_THREADS=1")
    rates: dict[int, float] = field(default_factory=dict)  # steps/s per count, when measured
    unit: str = "steps/s"

    def describe(self) -> str:
        """One line: the count, of how many cores, and why."""
        line = f"threads: {self.threads} of {cores()} cores"
        if self.how == "measured":
            shown = ", ".join(f"{n}: {rate:.3g}" for n, rate in self.rates.items())
            return f"{line}, the fastest measured ({self.unit} by threads: {shown})"
        if self.how == "cached":
            return f"{line}, measured before on this machine ({cache_dir() / CACHE_FILE})"
        if self.how.startswith(EXPLICIT):
            return f"{line}, as set ({self.how})"
        return f"{line} ({self.how})"


def machine() -> str:
    """What a choice depends on besides the model: the CPU, its cores, the OpenMP policy."""
    name = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    policy = os.environ.get("OMP_WAIT_POLICY", "default").lower()
    return f"{name}|cores={cores()}|wait={policy}|torch={torch.__version__}"


def load_bucket() -> int:
    """The 1-minute load average in whole cores, at most the core count."""
    try:
        return min(cores(), round(os.getloadavg()[0]))
    except OSError:
        return 0


def step_key(kind: str, model_config: dict[str, Any], *, width: int, batch: int,
             dtype: torch.dtype | str, device: str) -> str:
    """The cache key of a step: `kind` (decode, train), the model's shape, the step's width
    (tokens per row) and batch, dtype, device, the machine and its load."""
    shape = hashlib.sha1(json.dumps(model_config, sort_keys=True).encode()).hexdigest()[:12]
    return "|".join([kind, shape, f"width={width}", f"batch={batch}",
                     str(dtype).removeprefix("torch."), str(device), machine(),
                     f"load={load_bucket()}"])


def read_cached(key: str) -> int | None:
    """The cached count for `key`, if any and still possible on this machine."""
    path = cache_dir() / CACHE_FILE
    try:
        entry = json.loads(path.read_text()).get(key) if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None  # an unreadable cache is remeasured, and rewritten
    threads = entry.get("threads") if isinstance(entry, dict) else None
    return threads if isinstance(threads, int) and 1 <= threads <= cores() else None


def write_cached(key: str, threads: int, rates: dict[int, float]) -> None:
    """Remember `threads` (and the rates that chose it) for `key`."""
    path = cache_dir() / CACHE_FILE
    try:
        table = json.loads(path.read_text()) if path.is_file() else {}
        table = table if isinstance(table, dict) else {}
    except (OSError, ValueError):
        table = {}
    table[key] = {"threads": threads, "rates": {str(n): round(r, 3) for n, r in rates.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")


def fastest(rates: dict[int, float]) -> int:
    """The fewest threads within NEAR_BEST of the best rate."""
    best = max(rates.values())
    return min(n for n, rate in rates.items() if rate >= NEAR_BEST * best)


def measure(step: Callable[[], object], counts: list[int], budget: float,
            rounds: int = ROUNDS) -> dict[int, float]:
    """Steps per second at each thread count, after one untimed warm-up: `rounds` rounds
    that each run `step` at every count in turn for budget / (rounds * len(counts)) seconds
    (at least once), so that a change in the machine's load falls on every count alike."""
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


def resolve(requested: int | None, key: str) -> ThreadChoice | None:
    """The choice that needs no measurement: requested, explicit or cached (then set); None
    when the count must be measured."""
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"threads={requested!r} must be a positive integer (or null: "
                             f"measured)")
        set_threads(requested)
        return ThreadChoice(requested, f"threads={requested}")
    explicit = explicit_threads()
    if explicit is not None:
        return ThreadChoice(*explicit)
    if cores() == 1:
        return ThreadChoice(1, "one core")
    cached = read_cached(key)
    if cached is not None:
        set_threads(cached)
        return ThreadChoice(cached, "cached")
    return None


def choose_threads(step: Callable[[], object], key: str, *, requested: int | None = None,
                   budget: float = 1.0, unit: str = "steps/s", quiet: bool = False) -> ThreadChoice:
    """Set the intra-op thread count for `step` (see the module docstring) and return it."""
    choice = resolve(requested, key)
    if choice is None:
        rates = measure(step, list(range(1, cores() + 1)), budget)
        choice = ThreadChoice(fastest(rates), "measured", rates, unit)
        set_threads(choice.threads)
        write_cached(key, choice.threads, rates)
    if not quiet:
        print(choice.describe(), file=sys.stderr, flush=True)
    return choice
