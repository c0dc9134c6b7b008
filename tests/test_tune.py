"""The tuner (`mtp.tune`): one record, one cache, one key; thread counts by measurement; and
the OpenMP wait policy set when mtp is imported."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mtp.tune as tune
from mtp.generate.choices import choose_decode_threads
from mtp.model import MTPModel
from mtp.paths import REPO_ROOT
from mtp.tokenizers import ByteTokenizer
from mtp.tune import Measurement, TuneCache, choose_threads, cores, tune_key


@pytest.fixture
def unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """No explicit setting (torch at its default count), a fresh cache, 4 cores; afterwards
    the tests' one thread again."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(tune, "cores", lambda: 4)
    monkeypatch.setattr(tune, "load_bucket", lambda: 0)
    tune.set_threads(4)
    yield tmp_path / tune.CACHE_FILE
    torch.set_num_threads(1)
    tune._ours = None


def slower_with_more_threads(calls: list[int]):
    """A step that takes longer the more threads torch has: 1 is the fastest."""
    def step() -> None:
        calls.append(torch.get_num_threads())
        time.sleep(0.002 * torch.get_num_threads())
    return step


def test_a_record_round_trips_and_prints_in_one_line() -> None:
    record = Measurement("drafter", "heads(k=4)", "measured", figures={
        "autoregressive": 100.0, "heads(k=4)": 180.5}, unit="tokens/s", seconds=2.5,
        budget=3.0, left_out=("lookahead",), machine="m", value={"planned_tokens": 64})
    assert Measurement.from_json(json.loads(json.dumps(record.to_json()))) == record
    line = record.describe()
    assert line == ("drafter: heads(k=4) (measured in 2.5 s of a 3.0 s budget; tokens/s: "
                    "heads(k=4) 180, autoregressive 100; 1 left out by the budget)")
    assert record.cached().how == "cached" and record.cached().describe().startswith(
        "drafter: heads(k=4) (cached, measured in 2.5 s")
    dtype = Measurement("dtype", "bfloat16", "measured", "a forward of 8 tokens",
                        figures={"float32": 12.0, "bfloat16": 6.0}, unit="ms",
                        lower_is_better=True)
    assert dtype.describe() == ("dtype: bfloat16 (measured, a forward of 8 tokens; ms: "
                                "bfloat16 6, float32 12)")
    assert Measurement("dtype", "float32", "fixed", "as loaded").describe() == \
        "dtype: float32 (fixed: as loaded)"
    with pytest.raises(ValueError, match="how='guessed' is not one of"):
        Measurement("threads", "2", "guessed")


def test_tune_measures_once_then_reads_the_cache(tmp_path: Path) -> None:
    cache = TuneCache(tmp_path / "tune.json")
    calls = []

    def measure() -> Measurement:
        calls.append(1)
        return Measurement("dtype", "float32", "measured", value="float32")

    first = tune.tune("dtype", "key", measure, cache=cache)
    second = tune.tune("dtype", "key", measure, cache=cache)
    assert (first.how, second.how, len(calls)) == ("measured", "cached", 1)
    assert first.seconds >= 0 and json.loads(cache.path.read_text())["key"]["choice"] == "float32"
    # A record another step wrote, or one the caller cannot use, is measured again.
    assert tune.tune("threads", "key", lambda: Measurement("threads", "1", "measured", value=1),
                     cache=cache).how == "measured"
    assert tune.tune("dtype", "key", measure, cache=cache,
                     usable=lambda r: False).how == "measured"
    # An unreadable cache is measured again, and rewritten.
    cache.path.write_text("{not json")
    assert tune.tune("dtype", "key", measure, cache=cache).how == "measured"


def test_measures_each_count_sets_the_fastest_and_caches_it(unset: Path) -> None:
    calls: list[int] = []
    record = choose_threads(slower_with_more_threads(calls), "k", budget=0.2)
    assert record.value == 1 == torch.get_num_threads() and record.how == "measured"
    assert set(record.figures) == {"1", "2", "3", "4"} and set(calls) == {1, 2, 3, 4}
    assert record.figures["1"] > record.figures["4"]
    assert record.describe().startswith("threads: 1 (measured in ")
    assert ", of 4 cores; steps/s: 1 " in record.describe()
    assert json.loads(unset.read_text())["k"]["value"] == 1

    # Made once: the second call reuses the cached count without running the step.
    tune.set_threads(4)
    again: list[int] = []
    record = choose_threads(slower_with_more_threads(again), "k", budget=0.2)
    assert (record.value, record.how, again) == (1, "cached", [])
    assert torch.get_num_threads() == 1


def test_the_measurement_keeps_to_its_budget(unset: Path) -> None:
    began = time.perf_counter()
    choose_threads(lambda: time.sleep(0.01), "budget", budget=0.4)
    assert time.perf_counter() - began < 0.4 + 0.2  # the warm-up and each count's last step


def test_fewer_threads_win_a_near_tie() -> None:
    assert tune.thread_record({1: 100.0, 2: 103.0}, "steps/s").value == 1
    assert tune.thread_record({1: 100.0, 2: 130.0, 3: 131.0}, "steps/s").value == 2


def test_an_explicit_setting_wins_and_nothing_is_measured(unset: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    never = lambda: pytest.fail("measured despite an explicit setting")  # noqa: E731
    record = choose_threads(never, "k", requested=3)
    assert (record.value, record.how, record.why, torch.get_num_threads()) == (
        3, "set", "threads=3", 3)

    torch.set_num_threads(2)  # the user's call, before mtp's
    record = choose_threads(never, "k")
    assert (record.value, record.why) == (2, "torch.set_num_threads before")
    assert choose_threads(never, "k").value == 2  # still the user's on a second call

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    record = choose_threads(never, "k")
    assert (record.value, record.why) == (1, "OMP_NUM_THREADS=1")
    assert record.describe() == "threads: 1 (set: OMP_NUM_THREADS=1)"
    with pytest.raises(ValueError, match="threads=0 must be a positive integer or auto"):
        choose_threads(never, "k", requested=0)
    assert not unset.exists()


def test_the_key_holds_what_the_choice_depends_on(tiny_config, monkeypatch) -> None:
    config = tune.fingerprint(tiny_config.to_dict())
    key = tune_key("threads", kind="decode", model=config, width=1, batch=1)
    assert key != tune_key("threads", kind="decode", model=config, width=8, batch=1)
    assert key != tune_key("threads", kind="decode", model=config, width=1, batch=4)
    assert key != tune_key("threads", kind="train", model=config, width=1, batch=1)
    assert key != tune_key("threads", kind="decode", model=tune.fingerprint(
        {**tiny_config.to_dict(), "dim": 64}), width=1, batch=1)
    monkeypatch.setattr(tune, "load_bucket", lambda: 99)  # a busier machine: remeasured
    assert key != tune_key("threads", kind="decode", model=config, width=1, batch=1)
    untimed = tune_key("trees", timed=False, model="abc")
    assert untimed == "trees|model=abc"  # a deterministic choice: the same on any machine


def test_decoding_measures_generate_on_the_model(unset: Path, tiny_config) -> None:
    model = MTPModel(tiny_config).eval()
    record = choose_decode_threads(model, ByteTokenizer(), "def f(x):", budget=0.2)
    assert record.how == "measured" and set(record.figures) == {"1", "2", "3", "4"}
    assert torch.get_num_threads() == record.value and record.unit == "calls/s"
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
