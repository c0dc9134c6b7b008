"""A tiny random checkpoint and prompts that fit it: what smoke runs of the scripts decode.

    python -m mtp.bench.tiny out=DIR   # DIR/export (mtp.load reads it) and DIR/prompts.jsonl

  out        the folder to write (required)
  n_future   4 heads
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING

from mtp import cli
from mtp.checkpoint import export
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

PROMPTS = ("def f(x):", "import os", "for i in range(3):")


def tiny_checkpoint(directory: Path, *, n_future: int = 4) -> Path:
    """Export an untrained byte model (2 layers, width 32, `n_future` heads, the same weights
    every time) to `directory`; the export's directory."""
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=ByteTokenizer().vocab_size, dim=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, max_seq_len=128, n_future=n_future)
    return export(MTPModel(config), ByteTokenizer(), directory)


def tiny_prompts(path: Path) -> Path:
    """Write a few short prompts as a .jsonl prompt file (one {"prompt": ...} a line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@dataclass(frozen=True, kw_only=True)
class TinyArgs:
    out: Path = MISSING
    n_future: int = 4

    def __post_init__(self) -> None:
        if self.n_future < 1:
            raise ValueError(f"n_future={self.n_future} must be >= 1")


def parse_args(argv: list[str]) -> TinyArgs:
    return cli.parse(argv, TinyArgs)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    checkpoint = tiny_checkpoint(args.out / "export", n_future=args.n_future)
    prompts = tiny_prompts(args.out / "prompts.jsonl")
    print(json.dumps({"checkpoint": str(checkpoint), "prompts": str(prompts),
                      "n_future": args.n_future}))


if __name__ == "__main__":
    cli.main(main, __doc__)
