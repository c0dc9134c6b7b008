"""A training run that knows its pace (`mtp.train.pace`): the starved-run warning, the undertrained
summary, and the thread count measured on the first steps."""

import json
import time
from pathlib import Path

import pytest
import torch

import mtp.threads as threads
from mtp.data.packing import PackedBlocks
from mtp.paths import REPO_ROOT
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
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "load_bucket", lambda: 0)
    try:
        threads.set_threads(threads.cores())  # nothing explicit: torch's own default
        train(_cfg(corpus, tmp_path / "a", "trainer.max_steps=5", "trainer.val_check_interval=5"))
        first = capsys.readouterr().err
        assert f"of {threads.cores()} cores, the fastest measured (batches/s by threads: 1: " \
            in first, first
        cached = json.loads((tmp_path / "cache" / threads.CACHE_FILE).read_text())
        [(key, entry)] = cached.items()
        assert key.startswith("train|") and "width=32|batch=2" in key
        chosen = json.loads((tmp_path / "a" / "summary.json").read_text())["threads"]
        assert chosen == entry["threads"]

        threads.set_threads(threads.cores())
        train(_cfg(corpus, tmp_path / "b", "trainer.max_steps=5", "trainer.val_check_interval=5"))
        assert "measured before on this machine" in capsys.readouterr().err
        assert torch.get_num_threads() == chosen

        train(_cfg(corpus, tmp_path / "c", "trainer.max_steps=2", "trainer.val_check_interval=2",
                   "threads=1"))
        assert "threads: 1 of" in (err := capsys.readouterr().err) and "as set (threads=1)" in err
    finally:
        torch.set_num_threads(1)
        threads._ours = None
