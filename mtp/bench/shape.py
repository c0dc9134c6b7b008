"""The model shape the step benchmarks share (scripts/bench_memory.py,
scripts/bench_fsdp_comms.py): a random model fed random token ids. A script's schema extends
`Shape`; `KEYS` lists the keys for its --help."""

from __future__ import annotations

from dataclasses import dataclass, fields

from mtp.cli import check_positive

KEYS = """
The model's shape:
  vocab_size       32000
  dim              the width
  n_layers         4 trunk layers
  n_heads          8 attention heads
  n_future         4 heads
  batch, seq_len   the batch of random token ids
"""


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A random model's shape and the batch it is fed."""

    vocab_size: int = 32_000
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_future: int = 4
    batch: int = 1
    seq_len: int = 128

    def __post_init__(self) -> None:
        for field in fields(Shape):
            check_positive(field.name, getattr(self, field.name))

    def arguments(self) -> list[str]:
        """The shape as key=value arguments (a child process's command line)."""
        return [f"{field.name}={getattr(self, field.name)}" for field in fields(Shape)]
