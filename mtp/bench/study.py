"""The harness of the training studies (scripts/better_study.py, scripts/paper_small.py): their
runs' one-line checks, the runs themselves (reused once done), spreads over seeds, figures."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mtp.bench.machine import machine
from mtp.paths import REPO_ROOT, write_json

Record = dict[str, Any]


@contextmanager
def one_line() -> Iterator[None]:
    """A config object's own error, which Hydra wraps, as a one-line ValueError."""
    from hydra.errors import InstantiationException

    try:
        yield
    except InstantiationException as error:
        raise ValueError(str(error.__cause__ or error).splitlines()[-1]) from None


def python(args: list[str], run_dir: Path) -> None:
    """`python *args` from the checkout, its output in `run_dir`/run.log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "run.log", "w") as log:
        subprocess.run([sys.executable, *args], check=True, cwd=REPO_ROOT, stdout=log,
                       stderr=subprocess.STDOUT)


def run(specs: list[Record], launch: Callable[[Record, bool], Record], jobs: int, out: Path,
        prepare: Iterable[Callable[[], None]] = ()) -> tuple[dict[str, Record], Record]:
    """Each spec's result by its "key": its `run_dir`/result.json if there (a study stopped
    after the run goes on), else `launch(spec, in_process)`'s, kept there; `jobs` at a time,
    each in processes of its own, or (jobs=0) in this one. With them, the study's seconds
    (the `prepare` steps first) and the machine before and after."""
    out.mkdir(parents=True, exist_ok=True)
    began, before = time.perf_counter(), machine()
    for step in prepare:
        step()

    def one(spec: Record) -> Record:
        done = Path(spec["run_dir"]) / "result.json"
        if done.is_file():
            return json.loads(done.read_text())
        started = time.perf_counter()
        result = launch(spec, jobs == 0)
        write_json(done, result)
        with open(out / "progress.log", "a") as log:
            log.write(f"{time.strftime('%H:%M:%S')} done {spec['key']} "
                      f"({time.perf_counter() - started:.0f} s)\n")
        return result

    if jobs == 0:
        results = [one(spec) for spec in specs]
    else:
        with ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(one, specs))
    return ({spec["key"]: result for spec, result in zip(specs, results)},
            {"seconds": round(time.perf_counter() - began),
             "machine": {"before": before, "after": machine()}})


def spread(values: list[float | None]) -> Record | None:
    """Mean, standard deviation, min and max over seeds (None where a value is missing)."""
    if not values or any(v is None for v in values):
        return None
    return {"mean": statistics.fmean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "seeds": values}


def panels(count: int, width: float, height: float) -> tuple[Any, list[Any]]:
    """A figure of `count` panels (at least one) side by side, and their axes."""
    from matplotlib.figure import Figure  # not pyplot: no display, and safe beside threads

    fig = Figure(figsize=(width * max(1, count), height))
    return fig, list(fig.subplots(1, max(1, count), squeeze=False)[0])


def label(ax: Any, xlabel: str, ylabel: str, title: str, **legend: Any) -> None:
    """A panel's axis labels, title, grid and legend."""
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(**legend)


def save(fig: Any, path: Path) -> Path:
    """`fig` written to `path`, its folder made (figures= may name a new one)."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
