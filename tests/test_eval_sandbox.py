"""Adversarial tests: each hostile program is contained and the sandbox keeps working."""

import os
import time
from pathlib import Path

import pytest

from mtp.eval.sandbox import Limits, Sandbox, run_program

FAST = Limits(timeout=1.5, cpu_seconds=2, memory_bytes=256 << 20)


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for a non-reaping init counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def printed_ints(output: str) -> list[int]:
    return [int(word) for word in output.split() if word.isdigit()]


def test_passing_and_failing_programs() -> None:
    assert run_program("assert sorted([3, 1, 2]) == [1, 2, 3]").passed
    failed = run_program("assert 1 == 2, 'one is not two'")
    assert failed.status == "failed" and failed.describe() == "failed: AssertionError: one is not two"
    assert run_program("def f(:\n    pass").reason.startswith("SyntaxError")
    assert run_program("import sys\nsys.exit(3)").reason == "exit status 3"
    assert run_program("import sys\nsys.exit(250)").reason == "exit status 250"
    assert run_program("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)").reason == "killed by SIGTERM"


@pytest.mark.parametrize("exit_call", ["import sys; sys.exit(0)", "import os; os._exit(0)",
                                       "raise SystemExit"])
def test_exiting_before_the_tests_is_not_a_pass(exit_call: str) -> None:
    result = run_program(f"{exit_call}\nassert False")
    assert result.status == "failed" and result.reason == "exited before the tests finished"


@pytest.mark.parametrize("program", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_endless_programs_time_out(program: str) -> None:
    start = time.monotonic()
    assert run_program(program, FAST).status == "timed out"
    assert time.monotonic() - start < FAST.timeout + 2


def test_unbounded_allocation_fails() -> None:
    result = run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))", FAST)
    assert result.status == "failed" and "MemoryError" in result.reason


def test_output_flood_is_cut_and_fails() -> None:
    limits = Limits(timeout=5, max_output_bytes=10_000)
    result = run_program("while True:\n    print('x' * 1000)", limits)
    assert result.reason == "output exceeded 10000 bytes"
    assert len(result.output) <= 10_000


def test_writing_a_huge_file_fails() -> None:
    result = run_program("open('big', 'wb').write(bytes(2 << 20))", Limits(file_bytes=1 << 20))
    assert result.status == "failed" and "File too large" in result.reason


@pytest.mark.parametrize("detach", ["", "os.setsid()"])
def test_forked_children_are_all_killed(detach: str) -> None:
    program = (
        "import os, time\n"
        "for _ in range(20):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        f"        {detach or 'pass'}\n"
        "        time.sleep(600)\n"
        "    print(pid, flush=True)\n"
    )
    result = run_program(program, FAST)
    pids = printed_ints(result.output)
    assert result.passed and len(pids) == 20
    time.sleep(0.2)
    assert [pid for pid in pids if alive(pid)] == []


def test_endless_forking_is_stopped_by_the_timeout() -> None:
    program = (
        "import os, time\n"
        "while True:\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(600)\n"
        "    time.sleep(0.005)\n"  # bounded rate: the test must not take the machine down
        "    print(os.getpid(), flush=True)\n"
    )
    result = run_program(program, Limits(timeout=1, max_output_bytes=1 << 20))
    assert result.status == "timed out"
    time.sleep(0.2)
    assert not any(alive(pid) for pid in printed_ints(result.output))


def test_killing_its_parent_hits_the_launcher_not_the_evaluator() -> None:
    result = run_program("import os, signal\nprint(os.getppid(), flush=True)\n"
                         "os.kill(os.getppid(), signal.SIGKILL)\nimport time\ntime.sleep(5)", FAST)
    assert result.status == "failed" and result.reason == "killed by SIGKILL"
    assert printed_ints(result.output) != [os.getpid()]


def test_working_directory_is_fresh_and_removed_even_when_the_program_breaks_it() -> None:
    program = (
        "import os, shutil\n"
        "assert os.listdir('.') == ['program.py']\n"
        "assert os.environ['HOME'] == os.environ['TMPDIR'] == os.getcwd()\n"
        "print(os.getcwd(), flush=True)\n"
        "os.makedirs('locked/inner')\n"
        "os.chmod('locked', 0)\n"
    )
    result = run_program(program)
    assert result.passed, result.output
    assert not Path(result.output.strip()).exists()
    deleted = run_program("import os, shutil\nprint(os.getcwd())\nshutil.rmtree(os.getcwd())")
    assert deleted.passed and not Path(deleted.output.strip()).exists()


def test_the_run_goes_on_after_hostile_programs() -> None:
    hostile = {
        "loop": "while True:\n    pass",
        "exit": "import os\nos._exit(0)",
        "kill": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "flood": "while True:\n    print('y' * 4096)",
    }
    with Sandbox(FAST, workers=2) as sandbox:
        for key, program in hostile.items():
            sandbox.submit(key, program)
        sandbox.submit("good", "assert sum(range(4)) == 6")
        results = dict(sandbox.finished(wait=True))
    assert len(sandbox) == 0
    assert {key: r.status for key, r in results.items()} == {
        "loop": "timed out", "exit": "failed", "kill": "failed", "flood": "failed", "good": "passed",
    }


def test_bad_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="Limits.timeout must be positive, got 0"):
        Limits(timeout=0)
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        Sandbox(workers=0)
