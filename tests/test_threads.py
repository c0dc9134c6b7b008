"""Threads by measurement (`mtp.threads`) and the OpenMP wait policy (`mtp.openmp`)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mtp.threads as threads
from mtp.model import MTPModel
from mtp.paths import REPO_ROOT
from mtp.generate.measure import choose_decode_threads
from mtp.threads import choose_threads, cores, step_key
from mtp.tokenizers import ByteTokenizer


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """No explicit setting (torch at its default count), a fresh cache, 4 cores; afterwards
    the tests' one thread again."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 4)
    monkeypatch.setattr(threads, "load_bucket", lambda: 0)
    threads.set_threads(4)
    yield tmp_path / threads.CACHE_FILE
    torch.set_num_threads(1)
    threads._ours = None


def slower_with_more_threads(calls: list[int]):
    """A step that takes longer the more threads torch has: 1 is the fastest."""
    def step() -> None:
        calls.append(torch.get_num_threads())
        time.sleep(0.002 * torch.get_num_threads())
    return step


def test_measures_each_count_sets_the_fastest_caches_and_prints_it(unset: Path, capsys) -> None:
    calls: list[int] = []
    choice = choose_threads(slower_with_more_threads(calls), "k", budget=0.2)
    assert choice.threads == 1 == torch.get_num_threads() and choice.how == "measured"
    assert set(choice.rates) == {1, 2, 3, 4} and set(calls) == {1, 2, 3, 4}
    assert choice.rates[1] > choice.rates[4]
    line = capsys.readouterr().err
    assert line.startswith("threads: 1 of 4 cores, the fastest measured (steps/s by threads: 1: ")
    assert line.count("\n") == 1
    assert json.loads(unset.read_text())["k"]["threads"] == 1

    # Made once: the second call reuses the cached count without running the step.
    threads.set_threads(4)
    again: list[int] = []
    choice = choose_threads(slower_with_more_threads(again), "k", budget=0.2)
    assert (choice.threads, choice.how, again) == (1, "cached", [])
    assert torch.get_num_threads() == 1
    assert "measured before on this machine" in capsys.readouterr().err


def test_the_measurement_keeps_to_its_budget(unset: Path) -> None:
    began = time.perf_counter()
    choose_threads(lambda: time.sleep(0.01), "budget", budget=0.4, quiet=True)
    assert time.perf_counter() - began < 0.4 + 0.2  # the warm-up and each count's last step


def test_fewer_threads_win_a_near_tie() -> None:
    assert threads.fastest({1: 100.0, 2: 103.0}) == 1
    assert threads.fastest({1: 100.0, 2: 130.0, 3: 131.0}) == 2


def test_an_explicit_setting_wins_and_nothing_is_measured(unset: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    never = lambda: pytest.fail("measured despite an explicit setting")  # noqa: E731
    choice = choose_threads(never, "k", requested=3, quiet=True)
    assert (choice.threads, choice.how, torch.get_num_threads()) == (3, "threads=3", 3)

    torch.set_num_threads(2)  # the user's call, before mtp's
    choice = choose_threads(never, "k", quiet=True)
    assert (choice.threads, choice.how) == (2, "torch.set_num_threads before")

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    choice = choose_threads(never, "k", quiet=True)
    assert (choice.threads, choice.how) == (1, "OMP_NUM_THREADS=1")
    assert "as set (OMP_NUM_THREADS=1)" in choice.describe()
    with pytest.raises(ValueError, match="threads=0 must be a positive integer"):
        choose_threads(never, "k", requested=0)
    assert not unset.exists()


def test_the_key_holds_what_the_choice_depends_on(tiny_config, monkeypatch) -> None:
    config = tiny_config.to_dict()
    key = step_key("decode", config, width=1, batch=1, dtype=torch.float32, device="cpu")
    assert key != step_key("decode", config, width=8, batch=1, dtype=torch.float32, device="cpu")
    assert key != step_key("decode", config, width=1, batch=4, dtype=torch.float32, device="cpu")
    assert key != step_key("train", config, width=1, batch=1, dtype=torch.float32, device="cpu")
    assert key != step_key("decode", {**config, "dim": 64}, width=1, batch=1,
                           dtype=torch.float32, device="cpu")
    monkeypatch.setattr(threads, "load_bucket", lambda: 99)  # a busier machine: remeasured
    assert key != step_key("decode", config, width=1, batch=1, dtype=torch.float32, device="cpu")


def test_decoding_measures_generate_on_the_model(unset: Path, tiny_config, capsys) -> None:
    model = MTPModel(tiny_config).eval()
    choice = choose_decode_threads(model, ByteTokenizer(), "def f(x):", budget=0.2)
    assert choice.how == "measured" and set(choice.rates) == {1, 2, 3, 4}
    assert torch.get_num_threads() == choice.threads
    assert "calls/s by threads" in capsys.readouterr().err
    assert len(json.loads(unset.read_text())) == 1


def _fresh_python(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, "PYTHONPATH": str(REPO_ROOT), "OMP_DISPLAY_ENV": "true",
                               **env}, check=True)
    return done.stdout + done.stderr


def test_importing_mtp_makes_openmp_threads_wait_passively() -> None:
    # OMP_DISPLAY_ENV: libgomp prints the settings it started with, so this is the runtime's
    # own word that it read the policy (set after torch loaded, it would not).
    out = _fresh_python("import mtp, torch; print('threads', torch.get_num_threads())")
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in out
    # torch's default count is one per core of the process's affinity, as cores() assumes.
    assert f"threads {cores()}" in out
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in _fresh_python("import mtp, torch",
                                                         OMP_WAIT_POLICY="active")
