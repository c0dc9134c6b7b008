"""The model shape the step benchmarks share (scripts/bench_memory.py,
scripts/bench_fsdp_comms.py): a random model fed random token ids. A script's schema extends
`Shape`; `KEYS` lists the keys for its --help."""

from __future__ import annotations

from dataclasses import dataclass, fields

from mtp.cli import check_positive


@dataclass(frozen=True, kw_only=True)
class Shape:
    """A random model's shape and the batch of random token ids it is fed."""

    vocab_size: int = 32_000
    dim: int = 256  # the width
    n_layers: int = 4  # trunk layers
    n_heads: int = 8  # attention heads
    n_future: int = 4  # the MTP heads
    batch: int = 1
    seq_len: int = 128

    def __post_init__(self) -> None:
        for field in fields(Shape):
            check_positive(field.name, getattr(self, field.name))

    def arguments(self) -> list[str]:
        """The shape as key=value arguments (a child process's command line)."""
        return [f"{field.name}={getattr(self, field.name)}" for field in fields(Shape)]


KEYS = "\nThe model's shape (defaults, unless set above):\n" + "".join(
    f"  {field.name:<16} {field.default}\n" for field in fields(Shape))
