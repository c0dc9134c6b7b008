"""What a figure was measured on: CPU flags of note, load average, threads, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

NOTABLE_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def _cpuinfo(key: str) -> str | None:
    """The value of /proc/cpuinfo's first `key` line (None without one)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1] for line in lines if line.startswith(key)), None)


def cpu_flags() -> list[str]:
    """The CPU flags that change torch's speed (bf16 arithmetic, vector width), sorted."""
    return sorted(set((_cpuinfo("flags") or "").split()) & set(NOTABLE_FLAGS))


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages (`uptime`'s), rounded."""
    return [round(value, 2) for value in os.getloadavg()]


def commit(repo: Path) -> str | None:
    """The checkout's commit, "-dirty" when tracked files differ (None outside git); Markdown
    does not count, so a suite run is not marked dirty by an earlier run's tables."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!*.md")
        return head + ("-dirty" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def device_name(device: str = "cpu") -> str:
    """The accelerator's name, or the CPU's model name."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    name = _cpuinfo("model name")
    return name.strip() if name is not None else platform.processor() or "cpu"


def machine(device: str = "cpu") -> dict[str, object]:
    """The machine a figure comes from: CPU flags, load, threads, cores, torch, device."""
    return {"cpu_flags": cpu_flags(), "load": load_average(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "device": device, "device_name": device_name(device)}
