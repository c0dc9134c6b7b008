"""What the decoding scripts share: the keys of `DecodeSettings` they take (device, dtype,
threads) and the saved choices of a checkpoint that its drafters are built with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp.cli import AUTO
from mtp.decode.drafters.base import DrafterContext
from mtp.decode.drafters.registry import AUTOREGRESSIVE
from mtp.generate.saved import saved_choices
from mtp.generate.settings import DecodeSettings

KEYS = """
How it decodes (the keys of python -m mtp.generate):
  device           cpu (default), cuda, ...
  dtype            null: the checkpoint's own (bfloat16 on a GPU); float32, bfloat16, float16;
                   auto: on a CPU with bf16 arithmetic, whichever runs a step faster (measured)
  threads          auto (default: measured on a few decode steps, cached) or a count;
                   OMP_NUM_THREADS also fixes it
"""


@dataclass(frozen=True, kw_only=True)
class Decoding:
    """The keys of `DecodeSettings` a decoding script takes, checked as it checks them."""

    device: str = "cpu"
    dtype: str | None = None
    threads: int | str | None = AUTO

    def __post_init__(self) -> None:
        self.settings()

    def settings(self, drafter: str = AUTOREGRESSIVE, **how: Any) -> DecodeSettings:
        """These keys as `DecodeSettings`, with the drafter and whatever else `how` sets."""
        return DecodeSettings(drafter=drafter, device=self.device, dtype=self.dtype,
                              threads=self.threads, **how)


def saved_context(checkpoint: str | Path | None) -> DrafterContext:
    """The choices saved for `checkpoint` that drafters read, as `open_decoder` finds them."""
    return DrafterContext(saved=saved_choices(checkpoint))
