"""What the benchmark scripts share: the keys of `DecodeSettings` the decoding ones take
(device, dtype, threads, or dtypes), the saved choices of a checkpoint that its drafters are
built with, rounds of measurements taking turns, a child process's JSON line, and the printing
of a table of rows and of the machine."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtp import cli
from mtp.cli import AUTO
from mtp.decode.drafters.base import DrafterContext
from mtp.decode.drafters.registry import AUTOREGRESSIVE
from mtp.generate.saved import saved_choices
from mtp.generate.settings import DecodeSettings

KEYS = """
How it decodes (the keys of python -m mtp.generate):
  device           cpu (default), cuda, ...
  dtype            null: the checkpoint's own (bfloat16 on a GPU); float32, bfloat16, float16;
                   auto: on a CPU with bf16 arithmetic, whichever runs a step faster (measured)
  threads          auto (default: measured on a few decode steps, cached) or a count;
                   OMP_NUM_THREADS also fixes it
"""
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # a row's dtype tag


@dataclass(frozen=True, kw_only=True)
class Decoding:
    """The keys of `DecodeSettings` a decoding script takes, checked as it checks them."""

    device: str = "cpu"
    dtype: str | None = None
    threads: int | str | None = AUTO

    def __post_init__(self) -> None:
        self.settings()

    def settings(self, drafter: str = AUTOREGRESSIVE, **how: Any) -> DecodeSettings:
        """These keys as `DecodeSettings`, with the drafter and whatever else `how` sets."""
        return DecodeSettings(drafter=drafter, device=self.device, dtype=self.dtype,
                              threads=self.threads, **how)


@dataclass(frozen=True, kw_only=True)
class Dtypes:
    """The keys of a script that decodes in each of `dtypes` (the model opens in the first)."""

    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    device: str = "cpu"
    threads: int | str | None = AUTO

    def __post_init__(self) -> None:
        for name in self.dtypes or [None]:
            try:
                if cli.parse_dtype(name) is None:
                    raise ValueError("name one or more of float32, bfloat16, float16")
            except ValueError as error:
                raise ValueError(f"dtypes={self.dtypes}: {error}") from None
        self.settings()

    def settings(self) -> DecodeSettings:
        return DecodeSettings(drafter=AUTOREGRESSIVE, device=self.device, dtype=self.dtypes[0],
                              threads=self.threads)


def saved_context(checkpoint: str | Path | None) -> DrafterContext:
    """The choices saved for `checkpoint` that drafters read, as `open_decoder` finds them."""
    return DrafterContext(saved=saved_choices(checkpoint))


def machine_line(info: dict[str, Any]) -> str:
    """`mtp.bench.machine.machine`'s threads, load and CPU flags, as a table's header says them."""
    return (f"threads {info['threads']}  load {' '.join(map(str, info['load']))}  "
            f"flags {' '.join(info['cpu_flags'])}")


def take_turns(calls: dict[Any, Callable[[], float]], rounds: int) -> dict[Any, list[float]]:
    """Each call's figures over `rounds` rounds, the calls taking turns in each round, so a
    change in the machine's load hits them all alike."""
    figures: dict[Any, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            figures[key].append(call())
    return figures


def child_json(command: list[str], what: str, **run: Any) -> dict:
    """The JSON object a command (a fresh process, `subprocess.run`'s `run` keywords) prints
    last; a RuntimeError naming `what`, with the end of its stderr, if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, **run)
    if done.returncode != 0:
        raise RuntimeError(f"{what}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(rows: dict[str, dict], columns: list[tuple[str, str, int, str | None]]) -> None:
    """`rows` under their names ("method"), then a column per (header, key, width, format): the
    row's value formatted, blank when None (format None: the value as `str` writes it)."""
    width = max(map(len, rows))
    print(f"{'method':<{width}}" + "".join(f" {head:>{w}}" for head, _, w, _ in columns))
    for name, row in rows.items():
        line = f"{name:<{width}}"
        for _, key, w, spec in columns:
            value = row[key]
            cell = str(value) if spec is None else "" if value is None else spec.format(value)
            line += f" {cell:>{w}}"
        print(line)
