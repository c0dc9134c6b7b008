"""What a training run does not print: third-party advertisements and warnings about code
that is not the user's, each silenced by its own message so anything else still shows:
Lightning's `litlogger` tip, its model summary's remark on bf16-mixed sizes and its warning
that manual optimisation checkpoints hold the post-step state (what resuming wants); torch's
`LeafSpec` deprecation (Lightning's call); wandb's console lines (`WANDB_SILENT` unless set)
and its `anonymous` warning (`quiet_logger`).
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
    """Silence the lines of the module docstring (idempotent)."""
    for message, category in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    # The logger Lightning's rank_zero_info writes to (its modules share lightning_utilities').
    log = rank_zero.log
    if not any(isinstance(f, _DropLines) for f in log.filters):
        log.addFilter(_DropLines())
    os.environ.setdefault("WANDB_SILENT", "true")


def quiet_logger(logger: Any) -> None:
    """Drop the `anonymous=None` Lightning's `WandbLogger` passes to `wandb.init` (wandb
    warns of it before it reads `WANDB_SILENT`); a value the user set stays."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and "anonymous" in init and init["anonymous"] is None:
        del init["anonymous"]
