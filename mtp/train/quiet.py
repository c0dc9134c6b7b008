"""What a training run does not print: third-party advertisements and warnings about code
that is not the user's.

`python -m mtp.train +experiment=byte8` prints its own lines (the model, the thread choice,
progress, the summary). These others are silenced where they come from, each by its own
message, so that anything else a library says still shows:

- Lightning's tip to install `litlogger` (a log record at every `Trainer`'s start);
- Lightning's model summary saying that it cannot size bf16-mixed weights (it then counts
  them as float32: a remark on its own estimate, nothing to act on);
- Lightning's warning that manual optimisation checkpoints hold the post-step state: that is
  what resuming wants, since `global_step` counts the step as done;
- torch's deprecation of `isinstance(treespec, LeafSpec)`, which Lightning's own code calls;
- wandb's console lines (its version, the offline run's folder, the `wandb leet` and
  `wandb sync` hints): `WANDB_SILENT`, unless the user set it. The run's files stay under
  `<run_dir>/wandb`;
- wandb's warning that the `anonymous` setting has no effect, which it prints before it
  reads `WANDB_SILENT`: Lightning's `WandbLogger` passes `anonymous=None` whether or not it
  was asked for, and `quiet_logger` takes it back out.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from lightning_utilities.core import rank_zero

_WARNINGS: tuple[tuple[str, type[Warning]], ...] = (
    (r"Precision \S+ is not supported by the model summary", UserWarning),
    ("Using ModelCheckpoint with manual optimization", UserWarning),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
)
_LOG_LINES = ("💡 Tip: For seamless cloud logging",)


class _DropLines(logging.Filter):
    """Drops the log records whose message starts with one of `_LOG_LINES`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_LOG_LINES)


def quiet_third_party() -> None:
    """Silence the lines of the module docstring (idempotent: a process may train twice)."""
    for message, category in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    # The logger Lightning's rank_zero_info writes to (its modules share lightning_utilities').
    log = rank_zero.log
    if not any(isinstance(f, _DropLines) for f in log.filters):
        log.addFilter(_DropLines())
    os.environ.setdefault("WANDB_SILENT", "true")


def quiet_logger(logger: Any) -> None:
    """Drop the `anonymous=None` that Lightning's `WandbLogger` adds to `wandb.init`'s
    arguments (module docstring); a value the user set stays, as does any other logger."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]
