"""Prepare a corpus (tokenise, split, write token streams) and print its statistics.

    python scripts/prepare_data.py                                   # stdlib, byte tokenizer
    python scripts/prepare_data.py tokenizer=bpe vocab_size=32000
    python scripts/prepare_data.py source=local 'paths=[corpus/**/*.py]'
    python scripts/prepare_data.py source=installed mbpp_file=mbpp.jsonl     # data=installed

Arguments are key=value (`mtp.cli`'s grammar); they mirror ``conf/data/*.yaml`` and
``conf/tokenizer/*.yaml``. The last line printed is one JSON object with every figure.

  tokenizer        byte (default) or bpe
  vocab_size       bpe: the vocabulary to train (32000)
  tokenizer_path   bpe: load this tokenizer.json instead of training one
  seq_len          2048 tokens per block; n_future (4) more carried by each block
  val_fraction     0.01 of the documents; seed 0 chooses them
  cache_dir        null: $MTP_DATA_DIR or ./data
  num_proc         processes for tokenisation (null: one)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from mtp import cli
from mtp.data import build_tokenizer, prepare
from mtp.data.source_options import KEYS, SourceOptions


@dataclass(frozen=True, kw_only=True)
class PrepareArgs(SourceOptions):
    tokenizer: str = "byte"
    vocab_size: int = 32_000
    tokenizer_path: str | None = None
    seq_len: int = 2048
    n_future: int = 4
    val_fraction: float = 0.01
    seed: int = 0
    cache_dir: str | None = None
    num_proc: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.check_choice("tokenizer", self.tokenizer, ("byte", "bpe"))
        cli.check_positives(self, "vocab_size", "seq_len", "n_future")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction={self.val_fraction!r} must be in [0, 1)")


def parse_args(argv: list[str]) -> PrepareArgs:
    return cli.parse(argv, PrepareArgs)


def table(stats: dict) -> str:
    rows = [("", "train", "val")]
    for key in ("documents", "bytes", "tokens", "bytes_per_token", "blocks", "remainder_tokens"):
        rows.append((key, *(f"{stats[split][key]:,}" for split in ("train", "val"))))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(r, width))) for r in rows]
    skipped = ", ".join(f"{n} {why}" for why, n in stats["skipped"].items()) or "none"
    contaminated = [f"  {path}: {', '.join(problems)}"
                    for path, problems in stats.get("contaminated", {}).items()]
    return "\n".join([*lines, f"files skipped: {skipped}", *contaminated])


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    start = time.perf_counter()
    source = args.make_source(args.cache_dir)
    corpus = source.load()
    load_seconds = time.perf_counter() - start
    split = {"val_fraction": args.val_fraction, "seed": args.seed, "cache_dir": args.cache_dir}
    tokenizer = build_tokenizer(args.tokenizer, vocab_size=args.vocab_size,
                                path=args.tokenizer_path, source=source, **split)
    tokenizer_seconds = time.perf_counter() - start - load_seconds
    prepared = prepare(corpus, tokenizer, num_proc=args.num_proc, **split)
    stats = prepared.stats(args.seq_len, args.n_future)
    stats.update(vocab_size=tokenizer.vocab_size, directory=str(prepared.directory),
                 contaminated=corpus.contaminated, load_seconds=round(load_seconds, 2),
                 tokenizer_seconds=round(tokenizer_seconds, 2),
                 seconds=round(time.perf_counter() - start, 2))
    print(f"{stats['source']}  tokenizer {tokenizer.name} (vocab {tokenizer.vocab_size})  "
          f"blocks of {args.seq_len} + {args.n_future}  ->  {prepared.directory}")
    print(table(stats))
    print(f"prepared in {stats['seconds']:.1f} s (reading the source {load_seconds:.1f} s, "
          f"tokenizer {stats['tokenizer_seconds']:.1f} s)")
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS)
