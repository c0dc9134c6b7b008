"""The run's metric history (any logger, resumable) and its per-head plots."""

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader

from mtp.model import MTPConfig
from mtp.train.lit import MTPLitModule
from mtp.train.plots import MetricsHistory, read_metrics_csv, write_metrics_csv, write_plots
from mtp.train.settings import OptimSettings, RunSettings, TrainSettings


def _fit_without_logger(config: MTPConfig, steps: int) -> MetricsHistory:
    stream = torch.randint(0, 262, (2000,))
    blocks = [{"tokens": stream[i:i + 20]} for i in range(0, 1900, 16)]
    history = MetricsHistory()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, callbacks=[history],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=2,
                        val_check_interval=3, limit_val_batches=2)
    lit = MTPLitModule(config, TrainSettings(run=RunSettings(seq_len=16, max_steps=steps),
                                             optim=OptimSettings(warmup_steps=1)))
    trainer.fit(lit, DataLoader(blocks, batch_size=4), DataLoader(blocks, batch_size=4))
    return history


def test_history_records_every_head_without_a_logger(tiny_config: MTPConfig,
                                                     tmp_path: Path) -> None:
    history = _fit_without_logger(tiny_config, 6).history
    for i in range(tiny_config.n_future):
        assert [s for s, _ in history[f"train/loss_head{i}"]] == [2, 4, 6]
        assert [s for s, _ in history[f"train/acc_head{i}"]] == [2, 4, 6]
        assert [s for s, _ in history[f"val/loss_head{i}"]] == [3, 6]
        assert [s for s, _ in history[f"val/acc_head{i}"]] == [3, 6]
    restored = MetricsHistory()
    restored.load_state_dict(torch.load(_saved(history, tmp_path), weights_only=False))
    assert restored.history == history  # resumed runs plot their whole history

    written = write_plots(history, tmp_path / "plots")
    assert [p.name for p in written] == ["metrics.csv", "loss.png", "accuracy.png", "lr.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    assert read_metrics_csv(tmp_path / "plots" / "metrics.csv") == history


def _saved(history: dict, tmp_path: Path) -> Path:
    callback = MetricsHistory()
    callback.history = history
    torch.save(callback.state_dict(), tmp_path / "state.pt")
    return tmp_path / "state.pt"


def test_reads_lightnings_csv_logger_layout(tmp_path: Path) -> None:
    # CSVLogger: one column per metric, training and validation rows apart, empty cells unset.
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,train/loss_head0,train/lr,val/acc_head0,val/loss_head0\n"
                    "0,9,3.5,0.001,,\n0,19,3.0,0.002,,\n0,19,,,0.25,2.9\n")
    history = read_metrics_csv(path)
    assert history == {"train/loss_head0": [(9, 3.5), (19, 3.0)],
                       "train/lr": [(9, 0.001), (19, 0.002)],
                       "val/acc_head0": [(19, 0.25)], "val/loss_head0": [(19, 2.9)]}
    assert read_metrics_csv(write_metrics_csv(history, tmp_path / "ours.csv")) == history
    # Metrics a run did not log (here training accuracy) leave a titled, empty panel.
    assert len(write_plots(history, tmp_path / "plots")) == 4
