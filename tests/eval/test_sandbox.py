"""Adversarial tests: each hostile program is contained and the sandbox keeps working.

The tests of isolation="namespaces" skip where the kernel does not allow namespaces. Those
whose program would harm this machine without isolation (kill(-1), killpg, a fork bomb) run
only after a harmless probe showed that programs run in a PID namespace of their own, as a
non-root user.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import mtp.eval.sandbox as sandbox_module
from mtp.eval.sandbox import Limits, Sandbox, resolve_isolation, run_program

FAST = Limits(timeout=1.5, cpu_seconds=2, memory_bytes=256 << 20)  # for programs that time out
SAFE = Limits(timeout=30, cpu_seconds=10, memory_bytes=256 << 20)  # ample on a loaded machine
REPO = Path(__file__).resolve().parents[2]
MISSING = sandbox_module._namespaces_missing()
needs_namespaces = pytest.mark.skipif(MISSING is not None, reason=f"no namespaces here: {MISSING}")
LEVELS = ["none", pytest.param("namespaces", marks=needs_namespaces)]


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for a non-reaping init counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def processes_of(uid: int) -> list[int]:
    """Host PIDs of the live processes whose real uid is `uid`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            uid_line = next(line for line in (entry / "status").read_text().splitlines()
                            if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue  # not a process, or gone
        if int(uid_line.split()[1]) == uid and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def printed_ints(output: str) -> list[int]:
    return [int(word) for word in output.split() if word.isdigit()]


@pytest.fixture(scope="module")
def pid_namespace() -> None:
    """Skip unless a harmless probe shows programs run as PID 2 of their own namespace (under
    its init), cannot see this test's process, and are not root."""
    if MISSING is not None:
        pytest.skip(f"no namespaces here: {MISSING}")
    probe = run_program(f"import os\nprint(os.getpid(), os.getppid(), os.getuid(), "
                        f"int(os.path.exists('/proc/{os.getpid()}')))", SAFE, "namespaces")
    pid, parent, uid, sees_us = printed_ints(probe.output) if probe.passed else (0, 0, 0, 1)
    if (pid, parent, sees_us) != (2, 1, 0) or uid == 0:
        pytest.skip(f"programs do not run in a PID namespace of their own: {probe}")


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
    result = run_program("chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))", SAFE)
    assert result.status == "failed" and "MemoryError" in result.reason


def test_output_flood_is_cut_and_fails() -> None:
    limits = Limits(timeout=5, max_output_bytes=10_000)
    result = run_program("while True:\n    print('x' * 1000)", limits)
    assert result.reason == "output exceeded 10000 bytes"
    assert len(result.output) <= 10_000


def test_writing_a_huge_file_fails() -> None:
    result = run_program("open('big', 'wb').write(bytes(2 << 20))", Limits(file_bytes=1 << 20))
    assert result.status == "failed" and "File too large" in result.reason


def assert_nothing_left(result, isolation: str) -> None:
    """The processes a program printed (its uid first, then PIDs) are all gone."""
    assert printed_ints(result.output), f"the program printed nothing: {result}"
    uid, *pids = printed_ints(result.output)
    assert isolation == "none" or uid != 0  # in namespaces, the sandbox's uid is its own

    def left() -> list[int]:  # PIDs are the host's only without namespaces
        return [pid for pid in pids if alive(pid)] if isolation == "none" else processes_of(uid)

    # Killed processes take a moment to exit, longer on a loaded machine: poll, bounded.
    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == []


@pytest.mark.parametrize("isolation", LEVELS)
@pytest.mark.parametrize("detach", ["", "os.setsid()"])
def test_forked_children_are_all_killed(detach: str, isolation: str) -> None:
    program = (
        "import os, time\n"
        "print(os.getuid(), flush=True)\n"
        "for _ in range(10):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        f"        {detach or 'pass'}\n"
        "        time.sleep(600)\n"
        "    print(pid, flush=True)\n"
    )
    result = run_program(program, SAFE, isolation)
    assert result.passed and len(printed_ints(result.output)) == 11
    assert_nothing_left(result, isolation)


@pytest.mark.parametrize("isolation", LEVELS)
def test_setsid_and_double_fork_do_not_escape(isolation: str) -> None:
    program = (
        "import os, time\n"
        "print(os.getuid(), flush=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"  # the grandchild, in its own session, orphaned at once
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "time.sleep(0.1)\n"
        "print(*[p for p in os.listdir('/proc') if p.isdigit()], flush=True)\n"
    )
    result = run_program(program, SAFE, isolation)
    assert result.passed
    if isolation == "namespaces":  # the escapee, the program and the init: nothing else
        assert len(printed_ints(result.output)) == 1 + 3
        assert_nothing_left(result, isolation)


def test_endless_forking_is_stopped_by_the_timeout() -> None:
    program = (
        "import os, time\n"
        "print(os.getuid(), flush=True)\n"
        "while True:\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(600)\n"
        "    time.sleep(0.005)\n"  # bounded rate: the test must not take the machine down
        "    print(os.getpid(), flush=True)\n"
    )
    result = run_program(program, Limits(timeout=3, max_output_bytes=1 << 20), "none")
    assert result.status == "timed out"
    assert_nothing_left(result, "none")


def test_fork_bomb_is_bounded_by_the_process_limit(pid_namespace: None) -> None:
    limits = Limits(timeout=30, processes=8)
    counting = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(600)\n"
        "        children += 1\n"
        "except BlockingIOError:\n"
        "    print(children)\n"
    )
    result = run_program(counting, limits, "namespaces")
    assert result.passed and printed_ints(result.output) == [limits.processes - 1]  # + itself
    bomb = "import os\nprint(os.getuid(), flush=True)\nwhile True:\n    try:\n        os.fork()\n" \
           "    except OSError:\n        pass\n"
    result = run_program(bomb, Limits(timeout=3, cpu_seconds=3, processes=8), "namespaces")
    assert result.status == "timed out"
    assert_nothing_left(result, "namespaces")


def test_kill_minus_one_reaches_only_the_sandbox(pid_namespace: None) -> None:
    program = (
        "import os, signal, time\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(600)\n"
        "os.kill(-1, signal.SIGKILL)\n"  # every process it may signal but itself and the init
        "print(os.waitpid(child, 0)[1], flush=True)\n"
        "assert False, 'the tests fail'\n"
    )
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        result = run_program(program, SAFE, "namespaces")
        assert printed_ints(result.output) == [signal.SIGKILL]  # its child's wait status
        assert result.status == "failed" and result.reason == "AssertionError: the tests fail"
        assert bystander.poll() is None and run_program("pass", SAFE, "namespaces").passed
    finally:
        bystander.kill()
        bystander.wait()


def test_killpg_of_the_evaluators_group_finds_nothing(pid_namespace: None) -> None:
    result = run_program(f"import os, signal\nos.killpg({os.getpgrp()}, signal.SIGKILL)", SAFE, "namespaces")
    assert result.status == "failed" and result.reason.startswith("ProcessLookupError")


@pytest.mark.parametrize("isolation", LEVELS)
def test_killing_its_parent_hits_the_launcher_or_the_init(isolation: str) -> None:
    program = ("import os, signal, time\nprint(os.getppid(), flush=True)\n"
               "os.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(0.5)")
    result = run_program(program, SAFE, isolation)
    assert printed_ints(result.output) != [os.getpid()]
    if isolation == "none":  # the launcher dies, and the program with it
        assert result.status == "failed" and result.reason == "killed by SIGKILL"
    else:  # the namespace's init ignores signals from inside
        assert result.passed and printed_ints(result.output) == [1]


@needs_namespaces
def test_no_connection_even_to_the_hosts_loopback() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=1)"
        result = run_program(program, SAFE, "namespaces")
        assert result.status == "failed" and "Error" in result.reason
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing came through
        assert run_program(program, SAFE, "none").passed  # what the namespace prevents


@pytest.fixture
def victim() -> Path:
    """A file outside the working directory that the sandbox's user could write and delete,
    were the file system not read-only."""
    # On the host's root file system, whatever the checkout's place: a checkout under /tmp
    # or under a home only root may enter is hidden from the program (a private /tmp, an
    # empty mount) rather than shown read-only, which would not test the read-only mounts.
    base = Path("/var/tmp") if os.access("/var/tmp", os.W_OK) else REPO
    folder = Path(tempfile.mkdtemp(dir=base))
    try:
        folder.chmod(0o777)
        (folder / "victim").write_text("intact")
        (folder / "victim").chmod(0o666)
        yield folder / "victim"
    finally:
        shutil.rmtree(folder)


@needs_namespaces
@pytest.mark.parametrize("action", ["open({path!r}, 'a').write('changed')",
                                    "open({new!r}, 'w').write('new')",
                                    "os.remove({path!r})"])
def test_files_outside_the_working_directory_are_read_only(victim: Path, action: str) -> None:
    program = "import os\n" + action.format(path=str(victim), new=str(victim.with_name("new")))
    result = run_program(program, SAFE, "namespaces")
    assert result.status == "failed" and "Read-only file system" in result.reason
    assert victim.read_text() == "intact" and sorted(victim.parent.iterdir()) == [victim]


@needs_namespaces
def test_etc_shadow_is_unreadable() -> None:
    if not Path("/etc/shadow").exists():
        pytest.skip("no /etc/shadow here")
    result = run_program("print(open('/etc/shadow').read())", SAFE, "namespaces")
    assert result.status == "failed" and result.reason.startswith("PermissionError")


@needs_namespaces
def test_filling_tmp_stops_at_its_size_and_stays_private() -> None:
    limits = Limits(timeout=30, tmp_bytes=8 << 20)
    program = (
        "import os, tempfile\n"
        "print(tempfile.gettempdir(), flush=True)\n"
        "for i in range(1000):\n"
        "    with open(f'/tmp/fill{i}', 'wb') as f:\n"
        "        f.write(bytes(1 << 20))\n"
    )
    result = run_program(program, limits, "namespaces")
    assert result.status == "failed" and "No space left on device" in result.reason
    assert not list(Path(tempfile.gettempdir()).glob("fill*"))
    assert run_program("import os\nassert not [f for f in os.listdir('/tmp') if f.startswith('fill')]",
                       SAFE, "namespaces").passed  # the next program's /tmp is fresh


@needs_namespaces
def test_isolated_program_has_no_privileges() -> None:
    program = "import os\nprint(os.getuid(), os.getgid(), len(os.getgroups()))\n" \
              "print(*[line for line in open('/proc/self/status') if line.startswith(('Cap', 'NoNew'))])"
    result = run_program(program, SAFE, "namespaces")
    assert result.passed, result.output
    uid, gid, groups, *_ = printed_ints(result.output)
    assert uid != 0 and gid != 0 and groups == 0
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert f"{field}:\t0000000000000000" in result.output
    assert "NoNewPrivs:\t1" in result.output


# Run by a root child in a private mount namespace where this Python is reachable by other
# users: it becomes nobody, and then the sandbox must isolate through a user namespace.
# Child programs load the sandbox's modules by path (argv[2]: their folder): importing the mtp
# package would import torch, which takes long on a busy machine.
LOAD = """
import importlib.util, os, sys
def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(sys.argv[2], name + ".py"))
    sys.modules[name] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
"""
EVAL_DIR = str(REPO / "mtp" / "eval")
AS_NOBODY = LOAD + """
launcher = load("launcher")
launcher.check(launcher.libc.unshare(launcher.CLONE_NEWNS), "unshare")
launcher.mount(None, "/", None, launcher.MS_REC | launcher.MS_PRIVATE)
launcher.expose({path: os.open(path, os.O_PATH) for path in launcher.python_dirs()})
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
if not os.access(launcher.__file__, os.R_OK):
    sys.exit("SKIP: the checkout is not readable by other users")
sandbox = load("sandbox")
result = sandbox.run_program(sys.argv[1], sandbox.Limits(timeout=30), "namespaces")
print(result.status, result.reason, result.output, sep="\\n")
"""


@needs_namespaces
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_an_unprivileged_user_gets_isolation_through_a_user_namespace() -> None:
    program = (
        "import os\n"
        "print(os.getuid(), os.getppid(), open('/proc/self/uid_map').read().split()[1])\n"
        "print(*[line for line in open('/proc/self/status') if line.startswith(('CapEff', 'CapBnd'))])\n"
        "open('/etc/mtp-sandbox-test', 'w')\n"
    )
    run = subprocess.run([sys.executable, "-c", AS_NOBODY, program, EVAL_DIR],
                         capture_output=True, text=True, timeout=60)
    if run.stderr.startswith("SKIP: "):
        pytest.skip(run.stderr.strip().removeprefix("SKIP: "))
    assert run.returncode == 0, run.stderr
    status, reason, output = run.stdout.split("\n", 2)
    assert status == "failed" and "Read-only file system" in reason, run.stdout
    uid, parent, outer_uid = printed_ints(output)[:3]
    assert uid != 0 and parent == 1 and outer_uid == 65534  # nobody, mapped; its own PID 1
    assert "CapEff:\t0000000000000000" in output and "CapBnd:\t0000000000000000" in output


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
        "kill": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(os.getpid(), signal.SIGKILL)",
        "flood": "while True:\n    print('y' * 4096)",
    }
    with Sandbox(Limits(timeout=8, cpu_seconds=8, memory_bytes=256 << 20), workers=2) as sandbox:
        for key, program in hostile.items():
            sandbox.submit(key, program)
        sandbox.submit("good", "assert sum(range(4)) == 6")
        results = dict(sandbox.finished(wait=True))
    assert len(sandbox) == 0
    assert {key: r.status for key, r in results.items()} == {
        "loop": "timed out", "exit": "failed", "kill": "failed", "flood": "failed", "good": "passed",
    }


def test_auto_falls_back_with_a_warning_naming_what_is_missing(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sandbox_module, "_namespaces_missing", lambda: "unshare: Operation not permitted")
    assert resolve_isolation("auto") == "none"
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "unshare: Operation not permitted" in warning
    with pytest.raises(RuntimeError, match="isolation=namespaces is unavailable here: unshare"):
        Sandbox(isolation="namespaces")
    assert resolve_isolation("none") == "none" and capsys.readouterr().err == ""


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_auto_falls_back_where_the_kernel_refuses_namespaces() -> None:
    code = LOAD + "sandbox = load('sandbox')\nprint(sandbox.resolve_isolation('auto'))\n" \
                  "print(sandbox.run_program('print(6 * 7)').output)\n"
    # Root without CAP_SYS_ADMIN, as in a default Docker container: unshare is refused.
    run = subprocess.run(["setpriv", "--bounding-set=-sys_admin", sys.executable, "-c", code, "_", EVAL_DIR],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["none", "42"]
    assert run.stderr.count("\n") == 1 and "fell back to none" in run.stderr
    assert "unshare(mount, PID, network, IPC, UTS): Operation not permitted" in run.stderr


@needs_namespaces
def test_auto_uses_namespaces_where_they_work() -> None:
    with Sandbox(SAFE, isolation="auto") as sandbox:
        assert sandbox.isolation == "namespaces"


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="Limits.timeout must be positive, got 0"):
        Limits(timeout=0)
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        Sandbox(workers=0)
    with pytest.raises(ValueError, match="isolation='docker': expected one of"):
        Sandbox(isolation="docker")
    with pytest.raises(ValueError, match="isolation='docker'"):
        run_program("pass", isolation="docker")
