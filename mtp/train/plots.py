"""A run's metric history (`MetricsHistory`, whatever the logger, kept in checkpoints) and its
end-of-run plots (`write_plots`). From a metrics CSV (a run's, or a CSVLogger's):
`python -m mtp.train.plots METRICS_CSV OUT_DIR`.
"""

from __future__ import annotations

import argparse
import csv
from itertools import accumulate
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

History = dict[str, list[tuple[int, float]]]  # metric name -> (optimizer step, value) points


class MetricsHistory(Callback):
    """Records `train/*` metrics every `trainer.log_every_n_steps` optimizer steps and
    `val/*` metrics after every validation, from `trainer.callback_metrics`."""

    def __init__(self) -> None:
        self.history: History = {}

    def _record(self, trainer: L.Trainer, prefix: str) -> None:
        step = trainer.global_step
        for name, value in trainer.callback_metrics.items():
            if not name.startswith(prefix) or value.numel() != 1:
                continue
            points = self.history.setdefault(name, [])
            if points and points[-1][0] == step:  # validated twice at one step: keep the last
                points.pop()
            points.append((step, float(value)))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        recorded = self.history.get("train/loss", [(-1, 0.0)])[-1][0]
        # With gradient accumulation the step only advances on a window's last micro-batch.
        if step != recorded and step % max(1, trainer.log_every_n_steps) == 0:
            self._record(trainer, "train/")

    def on_validation_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, "val/")

    def state_dict(self) -> dict[str, Any]:
        return {"history": {name: list(points) for name, points in self.history.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {name: [tuple(p) for p in points]
                        for name, points in state_dict["history"].items()}


def write_metrics_csv(history: History, path: Path) -> Path:
    """The history as a CSV, one row per step and one column per metric (Lightning's layout)."""
    names = sorted(history)
    rows: dict[int, dict[str, float]] = {}
    for name in names:
        for step, value in history[name]:
            rows.setdefault(step, {})[name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", *names])
        writer.writeheader()
        for step in sorted(rows):
            writer.writerow({"step": step, **rows[step]})
    return path


def read_metrics_csv(path: Path) -> History:
    """A history from a metrics CSV: `write_metrics_csv`'s or Lightning's CSVLogger's."""
    history: History = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or "step" not in reader.fieldnames:
            raise ValueError(f"{path} has no 'step' column: not a metrics CSV")
        for row in reader:
            step = int(float(row["step"]))
            for name, cell in row.items():
                if name not in ("step", "epoch") and cell not in ("", None):
                    history.setdefault(name, []).append((step, float(cell)))
    return history


def _numbered(history: History, prefix: str) -> dict[int, list[tuple[int, float]]]:
    """The logged curves named `prefix` and a number (`train/loss_head3`), by that number."""
    found = {int(name[len(prefix):]): points for name, points in history.items()
             if name.startswith(prefix) and name[len(prefix):].isdigit() and points}
    return dict(sorted(found.items()))


def _smooth(points: list[tuple[int, float]], weight: float) -> list[tuple[int, float]]:
    """Exponential moving average (TensorBoard's smoothing): one batch's metrics are noisy."""
    steps, values = zip(*points)
    means = accumulate(values, lambda mean, value: weight * mean + (1 - weight) * value,
                       initial=values[0])
    return list(zip(steps, list(means)[1:]))


def _draw(ax: Any, curves: dict[str, list[tuple[int, float]]], title: str, legend: bool,
          **style: Any) -> None:
    """Each curve in its own viridis colour, on axes titled, labelled and gridded alike."""
    for index, (label, points) in enumerate(curves.items()):
        colour = colormaps["viridis"](index / max(1, len(curves) - 1) * 0.9)
        ax.plot(*zip(*points), color=colour, label=label, **style)
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize="small", ncol=2)


def _plot_pair(history: History, kind: str, label: str, path: Path) -> Path:
    figure = Figure(figsize=(11, 4), layout="constrained")
    for ax, split in zip(figure.subplots(1, 2), ("train", "val")):
        curves = {f"head {head} (t+{head + 1})": points
                  for head, points in _numbered(history, f"{split}/{kind}_head").items()}
        if split == "train":
            curves = {name: _smooth(points, 0.6) for name, points in curves.items()}
        title = ("training (EMA-smoothed, weight 0.6)" if split == "train" else "validation")
        _draw(ax, curves, f"{label}, {title}" if curves else f"{label}, {split}: not logged",
              legend=bool(curves), marker="o" if split == "val" else None, markersize=3)
        ax.set_ylabel(label)
    figure.savefig(path, dpi=110)
    return path


def _plot_over_steps(curves: dict[str, list[tuple[int, float]]], title: str,
                     path: Path) -> Path:
    figure = Figure(figsize=(5.5, 3.5), layout="constrained")
    _draw(figure.subplots(), curves, title, legend=len(curves) > 1)
    figure.savefig(path, dpi=110)
    return path


def _weight_curves(history: History) -> dict[str, list[tuple[int, float]]]:
    """The scheduled loss weights' curves: heads 1..n-1, then head 0's look-ahead terms."""
    heads = _numbered(history, "train/loss_weight_head")
    ahead = _numbered(history, "train/loss_weight_ahead")
    return ({f"head {i} (t+{i + 1})": points for i, points in heads.items()}
            | {f"head 0 on t+{d + 1}": points for d, points in ahead.items()})


def write_plots(history: History, out_dir: Path) -> list[Path]:
    """Write `metrics.csv`, `loss.png`, `accuracy.png` and (when logged) `lr.png` and
    `weights.png` (a `loss.schedule`'s) to `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [write_metrics_csv(history, out_dir / "metrics.csv"),
               _plot_pair(history, "loss", "cross-entropy", out_dir / "loss.png"),
               _plot_pair(history, "acc", "top-1 accuracy", out_dir / "accuracy.png")]
    if history.get("train/lr"):
        written.append(_plot_over_steps({"lr": history["train/lr"]}, "learning rate",
                                        out_dir / "lr.png"))
    weights = _weight_curves(history)
    if weights:
        written.append(_plot_over_steps(weights, "loss weights (loss.schedule)",
                                        out_dir / "weights.png"))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description="Plot a run's per-head curves from a metrics "
                                                 "CSV (<run>/plots/metrics.csv or a CSVLogger's)")
    parser.add_argument("metrics", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    for path in write_plots(read_metrics_csv(args.metrics), args.out_dir):
        print(path)


if __name__ == "__main__":
    main()
