"""Time the sandbox on the reference solutions: HumanEval's 164 canonical solutions (and MBPP's
500 test-split references with mbpp_file=) at each isolation level, all of which must pass.

Each round runs the whole set through one `Sandbox` (one worker per core, as `python -m
mtp.eval` does) at each level in turn, so a change in the machine's load hits every level
alike; the table reports each level's median over the rounds and the per-program cost.

    python scripts/bench_sandbox.py                                   # 3 rounds, ~1 min
    python scripts/bench_sandbox.py mbpp_file=$MTP_MBPP_FILE rounds=1

Arguments are key=value (`mtp.cli`'s grammar):
  rounds           3
  workers          null: one per CPU core
  levels           [none,namespaces]: the isolation levels timed
  mbpp_file        also time MBPP's references (its full mbpp.jsonl); null: HumanEval only
  problems         only each task's first N (null: all)
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from functools import partial

from mtp import cli
from mtp.bench.decoding import take_turns
from mtp.data.benchmarks import load_task
from mtp.eval.sandbox import Limits, Sandbox, resolve_isolation

LEVELS = ("none", "namespaces")


@dataclass(frozen=True, kw_only=True)
class SandboxArgs:
    rounds: int = 3
    workers: int | None = None
    levels: list[str] = field(default_factory=lambda: list(LEVELS))
    mbpp_file: str | None = None
    problems: int | None = None

    def __post_init__(self) -> None:
        cli.check_positive("rounds", self.rounds)
        cli.check_positives(self, "workers", "problems", optional=True)
        cli.check_choices("levels", self.levels, LEVELS)


parse_args = partial(cli.parse, schema=SandboxArgs)


def time_references(task, isolation: str, workers: int | None) -> float:
    """Seconds to run every reference solution of `task`; raises if one does not pass."""
    start = time.perf_counter()
    with Sandbox(Limits(), workers, isolation) as sandbox:
        for key, problem in task.problems.items():
            sandbox.submit(key, problem.program(problem.reference))
        failed = {key: r.describe() for key, r in sandbox.finished(wait=True) if not r.passed}
    if failed:
        raise RuntimeError(f"{task.name} references failed at isolation={isolation}: {failed}")
    return time.perf_counter() - start


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    for level in args.levels:
        resolve_isolation(level)  # fail now, not mid-way, where namespaces are unavailable
    tasks = [load_task("humaneval")]
    if args.mbpp_file:
        tasks.append(load_task("mbpp", args.mbpp_file))
    if args.problems is not None:
        tasks = [replace(t, problems=dict(list(t.problems.items())[:args.problems]))
                 for t in tasks]
    seconds = take_turns({(task.name, level): partial(time_references, task, level,
                                                      args.workers)
                          for task in tasks for level in args.levels}, args.rounds)
    rows = []
    print(f"{'task':<10} {'programs':>8} {'isolation':<10} {'seconds':>8} {'ms/program':>10}  "
          f"rounds")
    for (name, level), times in seconds.items():
        programs = len(next(t for t in tasks if t.name == name).problems)
        median = statistics.median(times)
        rows.append({"task": name, "programs": programs, "isolation": level,
                     "seconds": round(median, 2),
                     "ms_per_program": round(1000 * median / programs, 1),
                     "rounds": [round(t, 2) for t in times]})
        print(f"{name:<10} {programs:>8} {level:<10} {median:>8.2f} "
              f"{1000 * median / programs:>10.1f}  " + " ".join(f"{t:.2f}" for t in times))
    print(json.dumps({"benchmark": "sandbox_references", "workers": args.workers or os.cpu_count(),
                      "load_average": os.getloadavg()[0], "results": rows}))


if __name__ == "__main__":
    cli.main(main, __doc__, errors=(ValueError, FileNotFoundError, RuntimeError))
