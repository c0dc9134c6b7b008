"""Build and load the compiled kernels once per (sources, torch, Python, CPU) in a cache folder.

The cache key hashes everything that makes a build unusable elsewhere, so a stale build or
one made on another CPU is never loaded: a new key builds anew. Only torch and the standard
library are imported here.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
# One file per group of paths: ninja compiles them in parallel (the ops file is the slowest).
SOURCES = ("kernels.cpp", "paths_portable.cpp", "paths_avx2.cpp", "paths_avx512.cpp")
# -ffp-contract=off: no a*b+c fused behind our back (and differently per instantiation), no
# -ffast-math: no reassociation. Together they keep every (row, output) on one sequence of ops.
CFLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-std=c++17"]
# torch's CPU wheels run at::parallel_for on OpenMP; linking libgomp (same soname as torch's
# copy, so one runtime) lets torch.set_num_threads govern our threads.
LDFLAGS = ["-fopenmp"]


def cache_root() -> Path:
    """$MTP_KERNELS_CACHE, else $XDG_CACHE_HOME/mtp/kernels, else ~/.cache/mtp/kernels."""
    if os.environ.get("MTP_KERNELS_CACHE"):
        return Path(os.environ["MTP_KERNELS_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "mtp" / "kernels"


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo), or '' where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return line.split(":", 1)[1].strip()
    return ""


def build_key() -> str:
    """A hash of what the build depends on: sources, flags, torch, Python, machine, CPU."""
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (CFLAGS, LDFLAGS, torch.__version__, sys.version, platform.machine(),
                 _cpu_flags()):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()[:16]


def compiler() -> str | None:
    """The C++ compiler torch's builder would use, or None where there is none."""
    return shutil.which(os.environ.get("CXX", "c++"))


def _find_ninja() -> None:
    """Put the ninja that pip installed with mtp on PATH: a virtual environment's python run
    without activating it has its bin folder off PATH, and torch's builder looks there."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # the PyPI package: its binary's folder
        except ImportError:
            return  # torch's builder then says ninja is missing: the status' reason
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def build_and_load() -> tuple[float, Path]:
    """Build (unless cached) and load the ops into torch.ops.mtp_kernels; seconds spent, folder.

    Raises on any failure; the caller turns that into an unavailable status.
    """
    from torch.utils import cpp_extension  # slow import: only when building or loading

    _find_ninja()
    folder = cache_root() / build_key()
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # One builder at a time per key (two pytest processes); the second one finds it built.
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Holding the flock, no other builder runs here: a `lock` file of torch's builder is
        # then a killed build's (a timeout, ^C), and torch would wait on it forever.
        (folder / "lock").unlink(missing_ok=True)
        try:
            cpp_extension.load(name=f"mtp_kernels_{folder.name}",
                               sources=[str(CSRC / s) for s in SOURCES],
                               # copies: torch appends its libraries to the list it gets
                               extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                               extra_include_paths=[str(CSRC)], build_directory=str(folder),
                               is_python_module=False, verbose=False)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return time.perf_counter() - start, folder
