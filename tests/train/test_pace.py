"""A training run that knows its pace (`mtp.train.pace`): the starved-run warning, the undertrained
summary, and the thread count measured on the first steps."""

import io
import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from tqdm import tqdm

import mtp.tune as tune
from mtp.data.packing import PackedBlocks
from mtp.paths import REPO_ROOT
from mtp.train.pace import say
from mtp.train.run import compose, train


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for path in sorted((REPO_ROOT / "mtp").glob("*.py"))[:8]:
        (root / path.name).write_text(path.read_text())
    return root


def _cfg(corpus: Path, run_dir: Path, *extra: str):
    return compose(["+experiment=byte8", "model=tiny", "data=local",
                    f"data.source.paths=[{corpus}]", f"data.cache_dir={corpus.parent / 'cache'}",
                    "data.val_fraction=0.2", "data.batch_size=2", "seq_len=32", "logger=none",
                    "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
                    "trainer.precision=32-true", "trainer.peak_flops=null",
                    "decode.enabled=false", f"run_dir={run_dir}", *extra])


def test_a_starved_run_says_so_at_once_and_its_summary_says_undertrained(
        corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    read = PackedBlocks.__getitem__

    def slow(self, j):  # a throttled data loader: each block takes 50 ms
        time.sleep(0.05)
        return read(self, j)

    monkeypatch.setattr(PackedBlocks, "__getitem__", slow)
    # 200 steps in a 3-second budget: at ~0.1 s per step the guard stops near step 30.
    train(_cfg(corpus, tmp_path, "trainer.max_steps=200", "trainer.max_time=00:00:00:03",
               "trainer.val_check_interval=1000"))
    out = capsys.readouterr()
    warnings = [line for line in out.err.splitlines() if line.startswith("warning: training")]
    assert len(warnings) == 1, out.err
    warning = warnings[0]
    assert "tokens/s" in warning and "trainer.max_steps=200" in warning
    assert "undertrained; likely cause: " in warning
    reached = int(warning.split("reaches about step ")[1].split()[0])
    assert reached < 200  # an estimate from the first steps (a loaded machine moves it): short of the plan
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] < 100 and summary["recipe_fraction"] < 0.5
    assert "the model is undertrained" in out.out
    assert f"of the recipe ran ({summary['steps']} of 200 steps)" in out.out


def test_a_run_within_its_budget_does_not_warn(corpus: Path, tmp_path: Path, capsys) -> None:
    train(_cfg(corpus, tmp_path, "trainer.max_steps=4", "trainer.val_check_interval=4"))
    out = capsys.readouterr()
    assert "warning: training" not in out.err and "undertrained" not in out.out
    assert json.loads((tmp_path / "summary.json").read_text())["recipe_fraction"] == 1.0


def test_training_measures_its_threads_once_then_reuses_them(
        corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The first run measures the count on its first batches: one `Measurement` (threads,
    batches/s) in the one tuning cache; the second reads it back; a setting wins."""
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(tune, "load_bucket", lambda: 0)
    cores = tune.cores()
    try:
        tune.set_threads(cores)  # nothing explicit: torch's own default
        train(_cfg(corpus, tmp_path / "a", "trainer.max_steps=5", "trainer.val_check_interval=5"))
        first = capsys.readouterr().err
        [line] = [line for line in first.splitlines() if line.startswith("threads: ")]
        assert f", of {cores} cores; batches/s: " in line and "(measured in " in line, first
        [(key, entry)] = json.loads((tmp_path / "cache" / tune.CACHE_FILE).read_text()).items()
        assert key.startswith("threads|kind=train|model=") and "|width=32|batch=2|" in key
        record = tune.Measurement.from_json(entry)
        assert (record.step, record.how, record.unit) == ("threads", "measured", "batches/s")
        assert set(record.figures) == {str(n) for n in range(1, cores + 1)}
        chosen = json.loads((tmp_path / "a" / "summary.json").read_text())["threads"]
        assert chosen == record.value and line == f"{record.describe()}"

        tune.set_threads(cores)
        train(_cfg(corpus, tmp_path / "b", "trainer.max_steps=5", "trainer.val_check_interval=5"))
        assert f"threads: {chosen} (cached, measured in " in capsys.readouterr().err
        assert torch.get_num_threads() == chosen

        train(_cfg(corpus, tmp_path / "c", "trainer.max_steps=2", "trainer.val_check_interval=2",
                   "threads=1"))
        assert "threads: 1 (set: threads=1)" in capsys.readouterr().err
    finally:
        torch.set_num_threads(1)
        tune._ours = None


def test_the_thread_line_is_not_glued_to_a_drawing_progress_bar(monkeypatch) -> None:
    """A terminal shows the bar's stream and stderr together: the line is written after the
    bar's own line is cleared, then the bar is drawn again below it (tqdm's writer)."""
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = tqdm(total=3, file=terminal, desc="Epoch 0", mininterval=0)
    bar.update(1)
    say("threads: 2 (measured: of 2 cores)")
    bar.update(1)
    bar.close()
    assert "threads: 2 (measured: of 2 cores)" in re.split(r"[\r\n]", terminal.getvalue())
