"""The sandbox's launcher: `python -I -S launcher.py CONFIG_JSON`, run in a fresh directory
holding `program.py`, starts that program under the limits and exits as it did.

A standalone script (the standard library only): `sandbox.py` starts it in a new session
between the evaluator and the program. CONFIG_JSON holds `rlimits` (name -> value),
`isolation` ("namespaces" or "none"), and for namespaces `uid`, `gid` and `tmp_bytes`.

"none": set the limits, become a child subreaper, run the program, then kill and reap
whatever it left behind. "namespaces": unshare mount, PID, network, IPC and UTS namespaces
(and a user namespace when not root), then fork the namespace's init, which makes every mount
private and the tree read-only and nosuid, mounts fresh tmpfs on /tmp and /dev/shm and a
/proc of the sandbox, drops to `uid`/`gid` with no capabilities and PR_SET_NO_NEW_PRIVS, sets
the limits, runs the program and reaps every orphan; when the program exits the kernel kills
everything left in the namespace.
"""

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
SYS_MOUNT_SETATTR = 442  # the same number on every architecture (added in Linux 5.12)
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
# mountinfo's per-mount options that a read-only remount must keep (the kernel refuses to clear
# locked ones inside a user namespace).
KEPT_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
SETUP_FAILED = 125  # exit status when the sandbox itself could not be set up

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of building the sandbox failed; the message names it."""


def check(result: int, what: str) -> int:
    """Raise SetupError naming `what` and the errno if a libc call returned -1."""
    if result == -1:
        errno = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(errno)} (errno {errno})")
    return result


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype)]
    check(libc.mount(*args, ctypes.c_ulong(flags), data and data.encode()),
          f"mount {fstype or 'flags ' + hex(flags)} on {target}")


def set_limits(rlimits: dict[str, int]) -> None:
    for name, value in rlimits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def relay(status: int) -> None:
    """Exit as a process with wait status `status` did: the same exit code or signal."""
    if os.WIFSIGNALED(status):  # die of the same signal, so the evaluator sees what happened
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


def run_unisolated(config: dict) -> None:
    rlimits = config["rlimits"]
    # RLIMIT_NPROC counts every task (thread) of the user, not just ours: allow `processes` more.
    rlimits["RLIMIT_NPROC"] += tasks_of(os.getuid())
    set_limits(rlimits)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    pid = os.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-I", "program.py"])
    _, status = os.waitpid(pid, 0)
    # Kill what the program left behind; the children of those we kill come back to us in turn.
    while True:
        found = children_of(os.getpid())
        for child in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        for _ in found:
            os.waitpid(-1, 0)
        if not found:
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
    relay(status)


def tasks_of(uid: int) -> int:
    count = 0
    for p in os.listdir("/proc"):
        with contextlib.suppress(OSError):  # gone already
            if p.isdigit() and os.stat(f"/proc/{p}").st_uid == uid:
                count += len(os.listdir(f"/proc/{p}/task"))
    return count


def children_of(parent: int) -> list[int]:
    found = []
    for p in os.listdir("/proc"):  # not a process, or one already gone: passed over
        with contextlib.suppress(OSError, IndexError), open(f"/proc/{p}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[1] == str(parent):
                found.append(int(p))
    return found


def run_isolated(config: dict) -> None:
    with open("program.py", "rb") as f:
        program = f.read()
    workdir = os.path.join("/tmp", os.path.basename(os.getcwd()))
    rlimits = config["rlimits"]
    rlimits["RLIMIT_NPROC"] += 1  # the namespace's init, which runs as the sandbox user too
    in_userns = os.getuid() != 0
    if in_userns:  # the namespace's uid/gid maps to ours, which other processes of ours share
        rlimits["RLIMIT_NPROC"] += tasks_of(os.getuid())
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    try:
        check(libc.unshare(flags | (CLONE_NEWUSER if in_userns else 0)),
              "unshare(mount, PID, network, IPC, UTS" + (", user)" if in_userns else ")"))
        if in_userns:
            map_ids(config["uid"], uid, config["gid"], gid)
    except SetupError as e:
        fail(e)
    status_read, status_write = os.pipe()
    init = os.fork()
    if init == 0:
        os.close(status_read)
        try:
            run_init(config, program, workdir, status_write, in_userns)
        except SetupError as e:
            fail(e)
        except BaseException as e:  # noqa: BLE001 (a bug here must not pass for the program's fault)
            fail(f"{type(e).__name__}: {e}")
    os.close(status_write)
    _, status = os.waitpid(init, 0)
    reported = os.read(status_read, 32)
    relay(int(reported) if reported else status)


def map_ids(inner_uid: int, outer_uid: int, inner_gid: int, outer_gid: int) -> None:
    for path, text in (("/proc/self/uid_map", f"{inner_uid} {outer_uid} 1"),
                       ("/proc/self/setgroups", "deny"),
                       ("/proc/self/gid_map", f"{inner_gid} {outer_gid} 1")):
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError as e:
            raise SetupError(f"writing {path}: {e.strerror}") from None


def run_init(config: dict, program: bytes, workdir: str, status_write: int,
             in_userns: bool) -> None:
    """PID 1 of the new namespace: build the file system, drop privileges, run and reap."""
    # Signals from inside reach an init only through a handler: Python's SIGINT one must go.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the launcher gone: the sandbox goes
    python = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in python_dirs()}
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates to the host
    set_read_only("/")
    tmpfs = f"size={config['tmp_bytes']},nr_inodes={max(64, config['tmp_bytes'] >> 12)},mode=1777"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    expose(python)
    os.mkdir(workdir, 0o700)
    with open(os.path.join(workdir, "program.py"), "wb") as f:
        f.write(program)
    for path in (workdir, os.path.join(workdir, "program.py")):
        os.chown(path, config["uid"], config["gid"])
    os.chdir(workdir)
    drop_privileges(config["uid"], config["gid"], in_userns)
    set_limits(config["rlimits"])
    env = dict(os.environ, HOME=workdir, TMPDIR=workdir)
    pid = os.fork()
    if pid == 0:
        os.close(status_write)
        os.execve(sys.executable, [sys.executable, "-I", "program.py"], env)
    while True:  # init reaps every orphan until the program itself is done
        done, status = os.wait()
        if done == pid:
            os.write(status_write, str(status).encode())
            os._exit(0)


def python_dirs() -> list[str]:
    """The directories this Python needs: its installation, and its virtual environment."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    dirs = {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.abspath(sys.executable))}
    if os.path.exists(os.path.join(venv, "pyvenv.cfg")):  # `-S` leaves sys.prefix at the base
        dirs.add(venv)
    return sorted({os.path.realpath(d) for d in dirs})  # parents before children


def expose(dirs: dict[str, int]) -> None:
    """Make each of `dirs` (path -> an O_PATH descriptor opened before /tmp was replaced)
    reachable, read-only, where it is not (under /tmp, or a directory others may not enter,
    which an empty tmpfs then covers, holding only bind mounts of `dirs`)."""
    new_mounts = []
    for path, fd in dirs.items():
        hidden = unreachable_part(path)
        if hidden is None:
            continue
        if os.path.isdir(hidden):  # a directory others may not enter
            mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=755")
            new_mounts.append(hidden)
        os.makedirs(path, 0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        new_mounts.append(path)
    for path in new_mounts:  # once all are in place: a read-only tmpfs takes no more folders
        set_read_only(path)


def unreachable_part(path: str) -> str | None:
    """The first prefix of `path` that is missing or that others may not enter, if any."""
    parts = path.split("/")
    for depth in range(2, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        try:
            if not os.stat(prefix).st_mode & 0o001:
                return prefix
        except FileNotFoundError:
            return prefix
    return None


def set_read_only(path: str) -> None:
    """Make the mount at `path` and all below it read-only and nosuid: one call on Linux >=
    5.12 (mount_setattr), else a remount of each."""

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    if libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), AT_RECURSIVE, ctypes.byref(attr),
                    ctypes.sizeof(attr)) == 0:
        return
    if ctypes.get_errno() != 38:  # ENOSYS: an older kernel; any other error is real
        check(-1, f"mount_setattr({path}, read-only)")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:  # mount point, then per-mount options
        target = fields[4].encode().decode("unicode_escape")  # spaces come as \040
        if target == path or target.startswith(path.rstrip("/") + "/"):
            kept = sum(KEPT_OPTIONS.get(option, 0) for option in fields[5].split(","))
            mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept)


def drop_privileges(uid: int, gid: int, in_userns: bool) -> None:
    """No capabilities (bounding set included), no groups, `uid`/`gid`, no new privileges."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if ctypes.get_errno() != 22:  # EINVAL marks the end of the kernel's capabilities
        check(-1, f"dropping capability {cap} from the bounding set")
    if not in_userns:  # a user namespace without a setgroups permission has none already
        os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)

    class CapHeader(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class CapData(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    # Leaving uid 0 clears them, but inside a user namespace we never were uid 0.
    check(libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), ctypes.byref((CapData * 2)())),
          "clearing capabilities")
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def fail(error: object) -> None:
    print(f"sandbox setup failed: {error}", file=sys.stderr, flush=True)
    os._exit(SETUP_FAILED)


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    if settings["isolation"] == "namespaces":
        run_isolated(settings)
    else:
        run_unisolated(settings)
