"""A tiny random checkpoint and prompts that fit it: what smoke runs of the scripts decode.

    python -m mtp.bench.tiny DIR     # DIR/export (mtp.load reads it) and DIR/prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mtp.checkpoint import export
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

PROMPTS = ("def f(x):", "import os", "for i in range(3):")


def tiny_checkpoint(directory: Path, *, n_future: int = 4, max_seq_len: int = 128,
                    seed: int = 0) -> Path:
    """Export an untrained byte model (2 layers, width 32, `n_future` heads) to
    `directory`; the export's directory. The same weights for the same seed."""
    torch.manual_seed(seed)
    config = MTPConfig(vocab_size=ByteTokenizer().vocab_size, dim=32, n_layers=2, n_heads=4,
                       n_kv_heads=2, max_seq_len=max_seq_len, n_future=n_future)
    return export(MTPModel(config), ByteTokenizer(), directory)


def tiny_prompts(path: Path) -> Path:
    """Write a few short prompts as a .jsonl prompt file (one {"prompt": ...} a line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--n-future", type=int, default=4)
    args = parser.parse_args(argv)
    checkpoint = tiny_checkpoint(args.directory / "export", n_future=args.n_future)
    prompts = tiny_prompts(args.directory / "prompts.jsonl")
    print(json.dumps({"checkpoint": str(checkpoint), "prompts": str(prompts),
                      "n_future": args.n_future}))


if __name__ == "__main__":
    main()
