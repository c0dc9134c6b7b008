"""What a training run does not print: third-party advertisements and warnings about code
that is not the user's, each silenced by its own message so anything else still shows
(`_WARNINGS`, `_LOG_LINES`; the manual-optimisation checkpoint warning describes what resuming
wants); wandb's console lines (`WANDB_SILENT` unless set) and `anonymous` warning.
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
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_LOG_LINES)


def quiet_third_party() -> None:
    """Silence the module docstring's lines (idempotent)."""
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
