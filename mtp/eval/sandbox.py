"""Run untrusted generated programs, each in its own process, with limits.

What it does, for each program:
- a fresh temporary working directory (also HOME and TMPDIR), removed afterwards;
- a new session, so the whole process group can be killed at the end; a disposable launcher
  process between the evaluator and the program, so `os.kill(os.getppid(), ...)` hits the
  launcher, not the evaluation run. The launcher is a child subreaper: descendants orphaned
  by the program (even those that called `setsid`) come back to it and are killed with it;
- resource limits (setrlimit): CPU seconds, address space (memory), size of written files,
  number of processes, no core dumps; and a wall-clock timeout;
- stdout and stderr captured together and bounded: a program that writes more than
  `max_output_bytes` is stopped and fails;
- a pass needs exit status 0 *and* a random sentinel printed after the tests, so a program
  that exits early (`sys.exit(0)`, `os._exit(0)`) before its tests ran fails.

What it does NOT protect against (run evaluations in a throwaway container or VM, as an
unprivileged user, if that matters):
- network access: programs can open sockets;
- reading, writing or deleting any file the evaluating user may touch: there is no
  filesystem isolation beyond the working directory;
- privileges: nothing is dropped. As root, `RLIMIT_NPROC` is not enforced (fork bombs are
  only ended by the timeout and the kills) and a program can signal any process, e.g.
  `os.kill(-1, SIGKILL)`, which takes down the evaluator too;
- a program that kills its launcher and detaches (`setsid`) at the same time may outlive the
  run;
- programs that game their tests (redefining `AssertionError`, patching builtins).
"""

from __future__ import annotations

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
from typing import Any, Literal

Status = Literal["passed", "failed", "timed out"]

# Runs as `python -I -S -c LAUNCHER LIMITS_JSON` in the sandbox's working directory: sets the
# limits, becomes a subreaper, runs `program.py` in a fresh interpreter and relays its exit
# status or the signal that killed it.
LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
limits = json.loads(sys.argv[1])
# RLIMIT_NPROC counts every task (thread) of the user, not just ours: allow `processes` more.
for p in os.listdir("/proc"):
    try:
        if p.isdigit() and os.stat(f"/proc/{p}").st_uid == os.getuid():
            limits["RLIMIT_NPROC"] += len(os.listdir(f"/proc/{p}/task"))
    except OSError:
        pass  # gone already
for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), (value, value))
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
pid = os.fork()
if pid == 0:
    os.execv(sys.executable, [sys.executable, "-I", "program.py"])
_, status = os.waitpid(pid, 0)
me = str(os.getpid())

def orphans():
    found = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[1] == me:
                    found.append(int(p))
        except (OSError, IndexError):
            pass  # not a process, or it is already gone
    return found

# Kill what the program left behind; the children of those we kill come back to us in turn.
while True:
    found = orphans()
    for child in found:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for _ in found:
        os.waitpid(-1, 0)
    if not found:
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
if os.WIFSIGNALED(status):  # die of the same signal, so the evaluator sees what happened
    signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
"""


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Per-program limits. The defaults suit HumanEval and MBPP tests."""

    timeout: float = 10.0  # wall-clock seconds; a few MBPP references need ~4 s on a slow CPU
    cpu_seconds: int = 10
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    processes: int = 16  # beyond those the user already runs; not enforced for root
    max_output_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {value!r}")

    def rlimits(self) -> dict[str, int]:
        return {
            "RLIMIT_CPU": self.cpu_seconds,
            "RLIMIT_AS": self.memory_bytes,
            "RLIMIT_FSIZE": self.file_bytes,
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_CORE": 0,
        }


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one program: `status`, a one-line `reason` when it did not pass, its output."""

    status: Status
    reason: str
    output: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def describe(self) -> str:
        """`passed`, `timed out` or `failed: <reason>`, as recorded in results files."""
        return f"failed: {self.reason}" if self.status == "failed" else self.status


def run_program(program: str, limits: Limits = Limits()) -> ExecResult:
    """Run `program` in a fresh process and directory under `limits`; never raises for its faults."""
    sentinel = f"__mtp_sandbox_done_{secrets.token_hex(8)}__"
    workdir = tempfile.mkdtemp(prefix="mtp-sandbox-")
    start = time.perf_counter()
    try:
        with open(os.path.join(workdir, "program.py"), "w", encoding="utf-8") as f:
            f.write(f"{program}\n\nprint({sentinel!r}, flush=True)\n")
        env = {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0",
               "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(limits.rlimits())],
            cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            output, overflow, timed_out = _collect(proc, limits)
        finally:
            _kill_group(proc)
        seconds = time.perf_counter() - start
        text = output.decode("utf-8", errors="replace")
        if timed_out:
            return ExecResult("timed out", "", text, seconds)
        if overflow:
            return ExecResult("failed", f"output exceeded {limits.max_output_bytes} bytes", text, seconds)
        if proc.returncode == 0 and sentinel in text:
            return ExecResult("passed", "", text.replace(sentinel, "").rstrip("\n"), seconds)
        return ExecResult("failed", _failure_reason(text, proc.returncode), text, seconds)
    finally:
        shutil.rmtree(workdir, onerror=_make_writable_and_retry)


class Sandbox:
    """Runs programs in parallel worker threads (one process each); results come as they finish.

    ```
    with Sandbox(Limits(timeout=3)) as sandbox:
        sandbox.submit("a", "assert 1 + 1 == 2")
        for key, result in sandbox.finished(wait=True):
            ...
    ```
    """

    def __init__(self, limits: Limits = Limits(), workers: int | None = None):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.limits = limits
        self._pool = ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1)
        self._pending: dict[Future, Any] = {}

    def submit(self, key: Any, program: str) -> None:
        """Queue `program`; its result comes back from `finished` under `key`."""
        self._pending[self._pool.submit(run_program, program, self.limits)] = key

    def finished(self, wait: bool = False) -> Iterator[tuple[Any, ExecResult]]:
        """Yield `(key, result)` of finished programs; with `wait`, of all submitted ones."""
        futures = as_completed(list(self._pending)) if wait else [f for f in list(self._pending) if f.done()]
        for future in futures:
            yield self._pending.pop(future), future.result()

    def __len__(self) -> int:
        """Programs submitted and not yet yielded by `finished`."""
        return len(self._pending)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _collect(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, bool, bool]:
    """Read output until the launcher exits, the output overflows or the deadline passes.

    Returns (output, overflowed, timed_out). Ends when the launcher exits rather than at end
    of file: an orphaned grandchild may hold the pipe open forever.
    """
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
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
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
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)
    except OSError:
        pass
