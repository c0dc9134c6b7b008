"""Run untrusted generated programs, each in its own process, with limits and isolation
(docs/evaluation.md).

Each program gets a fresh working directory (also HOME and TMPDIR), a new session (its whole
process group is killed at the end), a disposable launcher process between it and the evaluator
(`launcher.py`), resource limits, a wall-clock timeout and bounded output. A pass needs exit
status 0 *and* a random sentinel printed after the tests, so a program that exits early fails.

Isolation: "namespaces" runs each program in new network, PID, mount, IPC and UTS namespaces,
on a read-only file system but for a private tmpfs /tmp, as a uid of its own with no
capabilities; "none" has only the limits (the launcher still kills what the program left
behind); "auto" is "namespaces" where they work, else "none" with a warning. Not prevented:
programs that game their tests, and reading world-readable files.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args

Status = Literal["passed", "failed", "timed out"]

Isolation = Literal["auto", "namespaces", "none"]
ISOLATION_LEVELS = get_args(Isolation)
LAUNCHER = str(Path(__file__).with_name("launcher.py"))
# Each isolated program runs as a uid and gid of its own, drawn from these (owned by no one),
# so RLIMIT_NPROC counts its processes alone, not those of programs running beside it.
SANDBOX_IDS = range(1 << 30, (1 << 30) + (1 << 24))


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-program limits. The defaults suit HumanEval and MBPP tests."""

    timeout: float = 10.0  # wall-clock seconds; a few MBPP references need ~4 s on a slow CPU
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    processes: int = 16  # "none": beyond the user's; enforced only for non-root users
    max_output_bytes: int = 64 << 10
    tmp_bytes: int = 64 << 20  # "namespaces": size of the private /tmp, working directory included

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {value!r}")

    def rlimits(self) -> dict[str, int]:
        return {"RLIMIT_CPU": self.cpu_seconds, "RLIMIT_AS": self.memory_bytes,
                "RLIMIT_FSIZE": self.file_bytes, "RLIMIT_NPROC": self.processes,
                "RLIMIT_CORE": 0}


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program: `status`, a one-line `reason` when it did not pass, its output."""

    status: Status
    reason: str
    output: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def describe(self) -> str:
        """`passed`, `timed out` or `failed: <reason>`, as recorded in results files."""
        return f"failed: {self.reason}" if self.status == "failed" else self.status


def run_program(program: str, limits: Limits = Limits(),
                isolation: Isolation = "auto") -> ExecResult:
    """Run `program` in a fresh process and directory under `limits`; never raises for its
    faults ("namespaces" where they do not work fails the program with the reason)."""
    if isolation != "namespaces":  # resolving "namespaces" runs this very function
        isolation = resolve_isolation(isolation)
    sentinel = f"__mtp_sandbox_done_{secrets.token_hex(8)}__"
    workdir = tempfile.mkdtemp(prefix="mtp-sandbox-")
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(f"{program}\n\nprint({sentinel!r}, flush=True)\n")
        env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0",
               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        sandbox_id = SANDBOX_IDS[secrets.randbelow(len(SANDBOX_IDS))]
        config = {"rlimits": limits.rlimits(), "isolation": isolation,
                  "tmp_bytes": limits.tmp_bytes, "uid": sandbox_id, "gid": sandbox_id}
        proc = subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER, json.dumps(config)],
                                cwd=workdir, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            output, overflow, timed_out = _collect(proc, limits)
        finally:
            _kill_group(proc)
        text = output.decode("utf-8", errors="replace")
        if timed_out:
            return ExecResult("timed out", "", text)
        if overflow:
            return ExecResult("failed", f"output exceeded {limits.max_output_bytes} bytes", text)
        if proc.returncode == 0 and sentinel in text:
            return ExecResult("passed", "", text.replace(sentinel, "").rstrip("\n"))
        return ExecResult("failed", _failure_reason(text, proc.returncode), text)
    finally:
        shutil.rmtree(workdir, onerror=_make_writable_and_retry)


def resolve_isolation(isolation: Isolation) -> Literal["namespaces", "none"]:
    """The level to run at: "auto" becomes "namespaces" where they work, else "none" (with a
    one-line warning on stderr, once per process); "namespaces" where they do not work raises."""
    if isolation not in ISOLATION_LEVELS:
        raise ValueError(f"isolation={isolation!r}: expected one of {ISOLATION_LEVELS}")
    if isolation == "none":
        return "none"
    missing = _namespaces_missing()
    if missing is None:
        return "namespaces"
    if isolation == "namespaces":
        raise RuntimeError(f"isolation=namespaces is unavailable here: {missing}")
    _warn_of_fallback(missing)
    return "none"


@cache
def _warn_of_fallback(missing: str) -> None:
    print(f"warning: sandbox isolation=auto fell back to none (no namespaces: {missing}); "
          "programs can reach the network and every file this user can", file=sys.stderr)


@cache
def _namespaces_missing() -> str | None:
    """Why namespaces cannot isolate programs here, or None when they can (tried once)."""
    if not sys.platform.startswith("linux"):
        return f"they need Linux, this is {sys.platform}"
    probe = run_program("pass", Limits(timeout=30), "namespaces")
    if probe.passed:
        return None
    return probe.reason.removeprefix("sandbox setup failed: ") or probe.status


class Sandbox:
    """Runs programs in parallel worker threads (one process each), every one at
    `self.isolation` ("namespaces" or "none"): `submit(key, program)` them, and `finished()`
    yields `(key, result)` as they finish. A context manager."""

    def __init__(self, limits: Limits = Limits(), workers: int | None = None,
                 isolation: Isolation = "auto"):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.limits = limits
        self.isolation = resolve_isolation(isolation)
        self._pool = ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1)
        self._pending: dict[Future, Any] = {}

    def submit(self, key: Any, program: str) -> None:
        """Queue `program`; its result comes back from `finished` under `key`."""
        self._pending[self._pool.submit(run_program, program, self.limits, self.isolation)] = key

    def finished(self, wait: bool = False) -> Iterator[tuple[Any, ExecResult]]:
        """Yield `(key, result)` of finished programs; with `wait`, of all submitted ones."""
        pending = list(self._pending)
        futures = as_completed(pending) if wait else [f for f in pending if f.done()]
        for future in futures:
            yield self._pending.pop(future), future.result()

    def __len__(self) -> int:
        """Programs submitted and not yet yielded by `finished`."""
        return len(self._pending)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *_: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _collect(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, bool, bool]:
    """(output, overflowed, timed_out): read until the launcher exits (not end of file: an
    orphaned grandchild may hold the pipe open), the output overflows or the deadline passes."""
    deadline = time.monotonic() + limits.timeout
    chunks: list[bytes] = []
    size = 0
    fd = proc.stdout.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            exited = proc.poll() is not None
            if not selector.select(timeout=0 if exited else min(remaining, 0.05)):
                if exited:  # and the pipe is drained
                    return b"".join(chunks), False, False
                continue
            chunk = os.read(fd, 65536)
            if not chunk:  # end of file: every writer is gone or closed its output
                try:
                    proc.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    break
                return b"".join(chunks), False, False
            chunks.append(chunk)
            size += len(chunk)
            if size > limits.max_output_bytes:
                return b"".join(chunks)[: limits.max_output_bytes], True, False
    return b"".join(chunks), False, True


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the launcher's whole process group (the program and anything it forked)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


def _failure_reason(output: str, returncode: int) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    if returncode == 0:
        return "exited before the tests finished"
    return lines[-1][:200] if lines else f"exit status {returncode}"


def _make_writable_and_retry(function, path, _exc_info) -> None:
    """`shutil.rmtree` error handler: a program may have removed permissions from its files."""
    with contextlib.suppress(OSError):
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)
