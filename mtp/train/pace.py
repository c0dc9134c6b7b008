"""A training run's pace: its thread count measured on its first steps, and a warning at once
when the time budget cannot carry the planned steps.

`ThreadSearch` times the first steps of training itself: one warm-up step at one thread, then
one at each count from 1 to the cores; the choice is cached (`mtp.tune.TuneCache`, keyed by
the model's shape, batch and machine) and printed in one line. `threads=N`, OMP_NUM_THREADS
or an earlier `torch.set_num_threads` win. `PaceCheck` then warns at once, with the likely
cause, when `trainer.max_time` reaches fewer than STARVED of `trainer.max_steps`.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from statistics import median
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.utilities import rank_zero_only
from tqdm import tqdm

from mtp.tune import Measurement, TuneCache, cores, given_threads, set_threads, thread_record

STARVED = 0.8  # warn when the budget reaches fewer than this share of the planned steps
PACE_BATCHES = 2  # batches timed after the warm-up when no thread search measured them
UNIT = "batches/s"


@rank_zero_only
def say(line: str) -> None:
    """One line to stderr, on a line of its own even under a progress bar (tqdm's writer)."""
    tqdm.write(line, file=sys.stderr)


class ThreadSearch(Callback):
    """Chooses training's intra-op thread count on its first batches."""

    def __init__(self, key: str, requested: int | None = None,
                 cache: TuneCache | None = None) -> None:
        self.key, self.requested = key, requested
        self.cache = cache or TuneCache()
        self.counts: list[int] = []  # counts still to time, in order
        self.rates: dict[int, float] = {}  # batches/s per count
        self.record: Measurement | None = None
        self._batch, self._began, self._started = 0, 0.0, 0.0

    @property
    def done(self) -> bool:
        return self.record is not None

    def on_train_start(self, *_: Any) -> None:
        self.record = given_threads(self.requested) or self._cached()
        if self.record is not None:
            say(self.record.describe())
            return
        self.counts = list(range(1, cores() + 1))
        set_threads(1)  # the warm-up batch: one thread is never far off, loaded or not
        self._started = time.perf_counter()

    def _cached(self) -> Measurement | None:
        """The cached choice, set; None when none can run (the cores may be fewer now)."""
        found = self.cache.get(self.key)
        if found is None or found.step != "threads" or not isinstance(found.value, int) \
                or not 1 <= found.value <= cores():
            return None
        set_threads(found.value)
        return found.cached()

    def on_train_batch_start(self, *_: Any) -> None:
        if self.done:
            return
        if self._batch >= 1:  # after the warm-up, one batch per count
            set_threads(self.counts[self._batch - 1])
        self._began = time.perf_counter()

    def on_train_batch_end(self, *_: Any) -> None:
        if self.done:
            return
        if self._batch >= 1:
            self.rates[self.counts[self._batch - 1]] = 1 / (time.perf_counter() - self._began)
        self._batch += 1
        if self._batch > len(self.counts):
            self._finish()

    def on_train_end(self, *_: Any) -> None:
        if not self.done and self.rates:  # a run shorter than the search: what it measured
            self._finish()

    def _finish(self) -> None:
        self.record = thread_record(self.rates, UNIT, time.perf_counter() - self._started)
        set_threads(self.record.value)
        self.cache.put(self.key, self.record)
        say(self.record.describe())

    def measured_rate(self) -> float | None:
        """Batches per second at the chosen count, when this run (not a cache) measured it."""
        record = self.record
        if record is None or record.how != "measured":
            return None
        return record.figures[record.choice]


class PaceCheck(Callback):
    """Warns, once and early, when `trainer.max_time` cannot carry `trainer.max_steps`."""

    def __init__(self, max_steps: int, seq_len: int, accumulate: int,
                 search: ThreadSearch) -> None:
        self.max_steps, self.seq_len, self.accumulate = max_steps, seq_len, accumulate
        self.search = search
        self.batch_seconds: list[float] = []
        self._checked, self._began = False, 0.0

    def on_train_batch_start(self, *_: Any) -> None:
        self._began = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, _module: Any, _outputs: Any,
                           batch: Any, *_: Any) -> None:
        seconds = time.perf_counter() - self._began
        if self._checked or not self.search.done:
            return
        rate = self.search.measured_rate()
        if rate is not None:  # the chosen count's batch, timed already
            per_batch = 1 / rate
        else:
            self.batch_seconds.append(seconds)
            if len(self.batch_seconds) <= PACE_BATCHES:
                return
            # The first batch of a run pays for allocation: not its pace.
            per_batch = median(self.batch_seconds[1:])
        self._checked = True
        self.check(trainer, per_batch, tokens=batch["tokens"].shape[0] * self.seq_len)

    def check(self, trainer: L.Trainer, per_batch: float, tokens: int) -> None:
        """Warn for a measured `per_batch` seconds (of `tokens` tokens), unless the budget
        carries STARVED of the planned steps, or there is none."""
        timer = max_time_timer(trainer)
        if timer is None:
            return
        remaining = timer.time_remaining()
        per_step = per_batch * self.accumulate
        reached = min(self.max_steps, trainer.global_step + int(remaining / per_step))
        if reached >= STARVED * self.max_steps:
            return
        budget = timer.time_elapsed() + remaining
        rate = tokens * trainer.world_size / per_batch
        say(f"warning: training runs at {rate:,.0f} tokens/s ({per_step:.2f} s per step): the "
            f"trainer.max_time budget of {timedelta(seconds=round(budget))} reaches about step "
            f"{reached} of trainer.max_steps={self.max_steps} ({reached / self.max_steps:.0%}), "
            f"and the model will be undertrained; likely cause: {likely_cause()}")


def max_time_timer(trainer: L.Trainer) -> Timer | None:
    """The trainer's `trainer.max_time` guard, when it has one."""
    return next((cb for cb in trainer.callbacks
                 if isinstance(cb, Timer) and cb.time_remaining() is not None), None)


def likely_cause() -> str:
    """Why a CPU run is slow, as far as this process can tell: other load, or its threads."""
    threads, n = torch.get_num_threads(), cores()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    others = load - min(threads, n)  # this run accounts for about its threads
    if others >= 0.5:
        return (f"a busy CPU (load average {load:.1f} on {n} cores, about {max(1, round(others))}"
                f" of it from other processes); free the CPU, or raise trainer.max_time")
    return (f"this CPU or its thread count ({threads} of {n} cores) is slower than the "
            f"recipe's reference machine; set threads=, lower trainer.max_steps, or raise "
            f"trainer.max_time")
