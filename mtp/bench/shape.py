"""The model-shape options the step benchmarks share (scripts/bench_memory.py,
scripts/bench_fsdp_comms.py): a random model of this shape, fed random token ids."""

from __future__ import annotations

import argparse


def add_shape_arguments(parser: argparse.ArgumentParser, *, dim: int, batch: int,
                        seq_len: int, batch_help: str | None = None) -> None:
    """--vocab-size, --dim, --n-layers (the trunk), --n-heads, --n-future, --batch, --seq-len."""
    parser.add_argument("--vocab-size", type=int, default=32_000)
    parser.add_argument("--dim", type=int, default=dim)
    parser.add_argument("--n-layers", type=int, default=4, help="trunk layers")
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--n-future", type=int, default=4)
    parser.add_argument("--batch", type=int, default=batch, help=batch_help)
    parser.add_argument("--seq-len", type=int, default=seq_len)
