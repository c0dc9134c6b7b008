"""Layer skipping (Draft & Verify) on one checkpoint: acceptance and speed against the share of
trunk layers skipped, beside autoregressive decoding.

    python -m mtp.generate.skip_search checkpoint=CKPT       # writes the skip choice
    python scripts/bench_layer_skip.py --checkpoint CKPT --skipped 1 2 4 8 --num-draft 3

The skipped sets are the search's nested ones (`layer_skip.json`'s `order`, least harmful
first): for each count m of --skipped, the first m layers of that order, plus the search's
own choice. Prompts: HumanEval's (--humaneval, by index; held out from the search's MBPP
calibration prompts), each decoded alone (batch 1), greedily, for --max-new-tokens tokens.
Each row: tokens/s, speed-up, tokens per forward, the first draft's acceptance, the draft's
share of a token's weights, identical greedy ids and the repeated share of the text. Prints
a table and ends with one JSON line: {"rows": {"<name>": {"skipped", "tokens_per_second",
"speedup", "tokens_per_forward", "acceptance", "draft_share", "identical", "repeated"}},
...}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mtp.bench.machine import machine
from mtp.bench.prompts import humaneval_prompts
from mtp.checkpoint import load
from mtp.generate import LayerSkip
from mtp.decode.drafters.layer_skip import SkipChoice, default_skip_file
from mtp.generate.measure import time_generate
from mtp.decode.output import repetition
from mtp.generate.skip_search import draft_share

DEFAULT_PROMPTS = [0, 1, 2, 3, 4, 5, 40, 41, 42, 43, 44, 45]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--choice", type=Path, help="layer_skip.json (default: the "
                        "checkpoint's, from python -m mtp.generate.skip_search)")
    parser.add_argument("--skipped", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="layers skipped, the search's least harmful first")
    parser.add_argument("--num-draft", type=int, default=3)
    parser.add_argument("--threshold", type=float, default=0.0, help="the draft-exit")
    parser.add_argument("--humaneval", type=int, nargs="+", default=DEFAULT_PROMPTS,
                        help="HumanEval prompt indices")
    parser.add_argument("--prompt", action="append", help="a prompt instead of HumanEval's")
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--ngram", type=int, default=16, help="n-gram size of `repeated`")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load(args.checkpoint)
    n_layers = model.config.n_layers
    choice = SkipChoice.load(args.choice or default_skip_file(args.checkpoint),
                             n_layers=n_layers, vocab_size=model.config.vocab_size)
    order = choice.details.get("order")
    if order is None:
        raise SystemExit("error: the choice has no search order: search again with "
                         "python -m mtp.generate.skip_search")
    if args.prompt:
        prompts = args.prompt
    else:
        pool = humaneval_prompts(max(args.humaneval) + 1)
        prompts = [pool[i] for i in args.humaneval]
    sets = {f"skip {m} of {n_layers}": tuple(sorted(order[:m]))
            for m in args.skipped if 0 < m < n_layers}
    sets[f"search's choice ({len(choice.skip)}), k={choice.num_draft}"] = choice.skip
    methods: dict[str, tuple[tuple[int, ...], LayerSkip | None]] = {"autoregressive": ((), None)}
    for name, skip in sets.items():
        k = choice.num_draft if skip == choice.skip and "choice" in name else args.num_draft
        methods[name] = (skip, LayerSkip(list(skip), k, threshold=args.threshold))

    rows: dict[str, dict] = {}
    reference: list[list[int]] = []
    base = 0.0
    for name, (skip, drafter) in methods.items():
        timed = time_generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                              drafter=drafter, warmup_tokens=8)
        stats, ids = timed.stats, timed.token_ids
        if drafter is None:
            reference, base = ids, timed.tokens_per_second
        rows[name] = {
            "skipped": list(skip), "tokens_per_second": round(timed.tokens_per_second, 1),
            "speedup": round(timed.tokens_per_second / base, 3),
            "tokens_per_forward": round(stats.tokens_per_forward, 3),
            "acceptance": round(stats.head_acceptance[1], 3) if drafter else None,
            "draft_share": round(draft_share(model, skip), 3) if drafter else None,
            "identical": ids == reference, "repeated": round(repetition(ids, args.ngram), 3)}

    info = machine("cpu")
    print(f"checkpoint {args.checkpoint}  threads {info['threads']}  load "
          f"{' '.join(map(str, info['load']))}  flags {' '.join(info['cpu_flags'])}")
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, batch 1, greedy; "
          f"num_draft {args.num_draft}, threshold {args.threshold}")
    width = max(map(len, rows))
    print(f"{'method':<{width}} {'tokens/s':>9} {'speedup':>8} {'tok/fwd':>8} {'accept':>7} "
          f"{'share':>6} {'identical':>9} {'repeated':>8}")
    for name, row in rows.items():
        accept = "" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        share = "" if row["draft_share"] is None else f"{row['draft_share']:.2f}"
        print(f"{name:<{width}} {row['tokens_per_second']:>9.1f} {row['speedup']:>7.2f}x "
              f"{row['tokens_per_forward']:>8.2f} {accept:>7} {share:>6} "
              f"{str(row['identical']):>9} {row['repeated']:>8.2f}")
    print(json.dumps({"rows": rows, "checkpoint": str(args.checkpoint), "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "num_draft": args.num_draft,
                      "threshold": args.threshold, **info}))


if __name__ == "__main__":
    main()
