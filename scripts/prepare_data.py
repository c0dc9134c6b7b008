"""Prepare a corpus (tokenise, split, write token streams) and print its statistics.

    python scripts/prepare_data.py                                   # stdlib, byte tokenizer
    python scripts/prepare_data.py --tokenizer bpe --vocab-size 32000
    python scripts/prepare_data.py --source local --paths 'corpus/**/*.py'
    python scripts/prepare_data.py --source installed --mbpp-file mbpp.jsonl   # data=installed

Options mirror ``conf/data/*.yaml`` and ``conf/tokenizer/*.yaml``. The last line printed
is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import time

from mtp.data import build_tokenizer, prepare
from mtp.data.source_options import add_source_arguments, make_source


def table(stats: dict) -> str:
    rows = [("", "train", "val")]
    for key in ("documents", "bytes", "tokens", "bytes_per_token", "blocks", "remainder_tokens"):
        rows.append((key, *(f"{stats[split][key]:,}" for split in ("train", "val"))))
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width)))
             for r in rows]
    skipped = ", ".join(f"{n} {why}" for why, n in stats["skipped"].items()) or "none"
    contaminated = [f"  {path}: {', '.join(problems)}"
                    for path, problems in stats.get("contaminated", {}).items()]
    return "\n".join([*lines, f"files skipped: {skipped}", *contaminated])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_source_arguments(parser)
    parser.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    parser.add_argument("--vocab-size", type=int, default=32_000, help="bpe: vocabulary to train")
    parser.add_argument("--tokenizer-path", help="bpe: load this tokenizer.json instead of training")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--n-future", type=int, default=4)
    parser.add_argument("--val-fraction", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", help="default: $MTP_DATA_DIR or ./data")
    parser.add_argument("--num-proc", type=int, help="processes for tokenisation")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    source = make_source(args)
    corpus = source.load()
    load_seconds = time.perf_counter() - start
    split = {"val_fraction": args.val_fraction, "seed": args.seed, "cache_dir": args.cache_dir}
    tokenizer = build_tokenizer(args.tokenizer, vocab_size=args.vocab_size, path=args.tokenizer_path,
                                source=source, **split)
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
    main()
