"""Run a suite's parts, each a subprocess with its own timeout, into one results.json."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtp import kernels
from mtp.bench.machine import commit, cpu_flags, device_name, load_average, machine
from mtp.bench.suites import Part
from mtp.paths import MBPP_ENV, SMOLLM2_INSTALL, mbpp_file, smollm2_gguf, write_json

RESULTS_FILE = "results.json"
TAIL = 2000  # characters of a failed part's output kept in results.json


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def last_json(stdout: str) -> dict[str, Any] | None:
    """The last stdout line as a JSON object, or None if it is not one."""
    try:
        value = json.loads((stdout.strip().splitlines() or [""])[-1])
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


# Inputs a command may name, each found on this machine or refused with how to get it.
INPUTS = {"{mbpp}": (lambda: mbpp_file(), f"MBPP's mbpp.jsonl: set ${MBPP_ENV} to it"),
          "{smollm2}": (lambda: smollm2_gguf(), f"SmolLM2's GGUF: {SMOLLM2_INSTALL}")}


def fill(argument: str, out: Path) -> str:
    """A command's argument with {python}, {out} and the INPUTS filled in."""
    argument = argument.replace("{python}", sys.executable).replace("{out}", str(out))
    for name, (find, _) in INPUTS.items():
        if name in argument:
            argument = argument.replace(name, str(find()))
    return argument


def check_inputs(parts: Sequence[Part]) -> None:
    """Refuse, before anything runs, parts whose commands need a file this machine lacks."""
    for name, (find, how) in INPUTS.items():
        needing = [p.name for p in parts if any(name in argument for argument in p.command)]
        if needing and find() is None:
            raise ValueError(f"part {', '.join(needing)} needs {how}")


def written(part: Part, out: Path, repo: Path) -> str:
    """The part's command as a reader would type it: `python`, `out` relative to the checkout,
    the INPUTS as the variables a reader sets ($MTP_MBPP_FILE, $GGUF)."""
    shown = str(out.relative_to(repo)) if out.is_relative_to(repo) else str(out)
    # an argument with a space or a quote in it is quoted, so that the line runs as typed
    text = " ".join(shlex.quote(a) if re.search(r"[\s'\"]", a) else a for a in part.command)
    text = text.replace("{python}", "python").replace("{out}", shown)
    return text.replace("{mbpp}", f"${MBPP_ENV}").replace("{smollm2}", "$GGUF")


def run_part(part: Part, out: Path, repo: Path, revision: str | None,
             timeout: float | None = None) -> dict[str, Any]:
    """Run one part (within `timeout` seconds, at most the part's own); its record: the
    command, the conditions it ran in and its figures (`result`, None when it failed)."""
    timeout = part.timeout if timeout is None else min(part.timeout, timeout)
    command = [fill(a, out) for a in part.command]
    record: dict[str, Any] = {
        "command": written(part, out, repo), "commit": revision, "device": part.device,
        "device_name": device_name(part.device), "cpu_flags": cpu_flags(),
        "repeats": part.repeats, "started": now(), "load_before": load_average()}
    print(f"[mtp.bench] {part.name}: {record['command']} (timeout {timeout:.0f} s, load "
          f"{record['load_before']})", flush=True)
    log = out / "logs" / f"{part.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=timeout)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as error:
        code = "timeout"
        stdout, stderr = (s.decode(errors="replace") if isinstance(s, bytes) else (s or "")
                          for s in (error.stdout, error.stderr))
    record |= {"seconds": round(time.perf_counter() - began, 1), "load_after": load_average(),
               "returncode": code}
    log.write_text(f"$ {record['command']}\n{stdout}\n--- stderr ---\n{stderr}")
    result = None
    if part.text and code != "timeout":
        result = {"last_line": (stdout.strip().splitlines() or [""])[-1], "returncode": code}
    elif code == 0:
        if part.result_file:
            path = out / part.result_file
            result = json.loads(path.read_text()) if path.is_file() else None
        else:
            result = last_json(stdout)
        if result is None and part.renderer == "none":
            result = {"returncode": 0}  # a step with no table (a search): its exit is its result
    record["result"] = result
    if result is None:
        record["output_tail"] = (stdout + stderr)[-TAIL:]
    status = "ok" if result is not None else f"FAILED ({code})"
    print(f"[mtp.bench] {part.name}: {status} in {record['seconds']} s, load after "
          f"{record['load_after']}", flush=True)
    return record


MIN_PART_SECONDS = 30  # a part is not started with less of the budget left


def run_suite(name: str, parts: Sequence[Part], out: Path, repo: Path,
              only: Sequence[str] = (), budget: float | None = None,
              min_part_seconds: float = MIN_PART_SECONDS) -> dict[str, Any]:
    """Run `parts` (those in `only`, if any, keeping the others' records of an earlier
    results.json) into `out/results.json` and return it. `budget` (seconds): each part's
    timeout is cut to what is left, a part with under `min_part_seconds` left skipped."""
    unknown = sorted(set(only) - {p.name for p in parts})
    if unknown:
        raise ValueError(f"suite {name} has no part {unknown}; its parts: "
                         f"{', '.join(p.name for p in parts)}")
    chosen = [p for p in parts if not only or p.name in only]
    check_inputs(chosen)
    path = out / RESULTS_FILE
    previous = json.loads(path.read_text()) if only and path.is_file() else {}
    revision = commit(repo)
    results: dict[str, Any] = {
        "suite": name, "commit": revision, "started": now(), "machine": machine(),
        "load_before": load_average(), "parts": dict(previous.get("parts", {}))}
    if any(p.device == "cpu" for p in chosen):
        # Built here, untimed: a cold build under load takes minutes, and a part's timeout
        # would count it against the part (and kill it half-built).
        start = time.perf_counter()
        print(f"[mtp.bench] {kernels.status().reason} ({time.perf_counter() - start:.0f} s)",
              flush=True)
    began = time.perf_counter()
    for part in chosen:
        left = None if budget is None else budget - (time.perf_counter() - began)
        failed = [n for n in part.needs if (results["parts"].get(n) or {}).get("result") is None]
        skipped = None
        if left is not None and left < min_part_seconds:
            skipped = f"the budget of {budget:.0f} s was spent"
            print(f"[mtp.bench] {part.name}: skipped, {left:.0f} s of the budget left",
                  flush=True)
        elif failed:
            skipped = f"needs {', '.join(failed)}, which failed"
        results["parts"][part.name] = run_part(part, out, repo, revision, left) if not skipped \
            else {"command": written(part, out, repo), "skipped": skipped, "result": None}
        write_json(path, results)  # a killed run keeps its parts
    seconds = round(time.perf_counter() - began, 1)
    results |= {"finished": now(), "load_after": load_average()}
    if not only:  # the whole suite's wall time; a rerun of some parts has none
        results["seconds"] = seconds
    print(f"[mtp.bench] {name}: ran {len(only) or len(parts)} parts in {seconds / 60:.1f} "
          f"minutes", flush=True)
    write_json(path, results)
    return results
