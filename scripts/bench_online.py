"""Online heads against the same heads frozen, over a stream of held-out prompts.

    python scripts/bench_online.py --checkpoint runs/smollm2_medusa1/export --humaneval 100 \
        --max-new-tokens 48 --k 4 --threads 2

Each prompt is decoded alone (batch 1, greedy), one `generate` call after another, as a
server meets them: once by `HeadsDrafter(k)` with the checkpoint's heads as they are, once by
`OnlineHeads(k)` (`drafter=heads online=true`), which takes `--steps` optimizer steps on
heads 1..k-1 after each call, distilling from the target's distributions over what it
served (mtp/decode/drafters/online.py). Both start from the same weights; greedy output
must be identical between them (and is checked). Reported: tokens per forward over the
stream and over its first and last `--window` prompts, tokens/s with and without the
learning's time, and the share of the output repeating an earlier 16-gram. Prints a table,
then one JSON line: {"frozen": {...}, "online": {...}, "identical", "prompts", ...}.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from mtp.bench.machine import machine
from mtp.bench.prompts import humaneval_prompts
from mtp.checkpoint import load
from mtp.generate import HeadsDrafter, OnlineHeads, generate
from mtp.decode.output import repetition
from mtp.generate.prompts import read_prompts


def stream(model, tokenizer, prompts: list[str], drafter, max_new_tokens: int,
           window: int) -> tuple[dict, list[list[int]]]:
    """Decode `prompts` one call each with `drafter`; its figures and every output's ids."""
    passes, tokens, ids, seconds = [], [], [], 0.0
    learning, learnt = 0.0, 0
    for prompt in prompts:
        began = time.perf_counter()
        [g] = generate(model, tokenizer, [prompt], max_new_tokens=max_new_tokens,
                       drafter=drafter)
        seconds += time.perf_counter() - began
        passes.append(g.stats.forward_passes)
        tokens.append(g.stats.new_tokens)
        ids.append(g.token_ids)
    if isinstance(drafter, OnlineHeads):
        learning, learnt = drafter.seconds, drafter.learnt

    def per_forward(part: slice) -> float:
        return round(sum(tokens[part]) / max(sum(passes[part]), 1), 3)

    return {"tokens_per_forward": per_forward(slice(None)),
            "first_window": per_forward(slice(0, window)),
            "last_window": per_forward(slice(-window, None)),
            "tokens_per_second": round(sum(tokens) / seconds, 2),
            "tokens_per_second_decoding": round(sum(tokens) / (seconds - learning), 2),
            "learning_seconds": round(learning, 1), "optimizer_steps": learnt}, ids


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--humaneval", type=int, default=100, help="the stream's prompts")
    parser.add_argument("--prompts", type=Path, help="a prompt file instead of HumanEval's")
    parser.add_argument("--offset", type=int, default=0, help="skip this many HumanEval prompts")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, help="tokens per forward at most (default: every head)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps after each call")
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    frozen_model, tokenizer = load(args.checkpoint)
    learning_model = copy.deepcopy(frozen_model)  # the online heads change their model's heads
    k = args.k or frozen_model.config.n_future
    prompts = read_prompts(args.prompts) if args.prompts else \
        humaneval_prompts(args.offset + args.humaneval)[args.offset:]
    context = frozen_model.config.max_seq_len - args.max_new_tokens
    prompts = [p for p in prompts if len(tokenizer.encode_prompt(p)) < context]
    window = min(args.window, max(len(prompts) // 2, 1))
    generate(frozen_model, tokenizer, prompts[:1], max_new_tokens=8, drafter=HeadsDrafter(k))
    frozen, frozen_ids = stream(frozen_model, tokenizer, prompts, HeadsDrafter(k),
                                args.max_new_tokens, window)
    online, online_ids = stream(learning_model, tokenizer, prompts,
                                OnlineHeads(k, lr=args.lr, steps=args.steps),
                                args.max_new_tokens, window)
    info = machine("cpu")
    repeated = repetition(frozen_ids, 16)
    source = args.prompts or f"HumanEval prompts from {args.offset}"
    print(f"{args.checkpoint}: {len(prompts)} prompts ({source}), "
          f"{args.max_new_tokens} new tokens, batch 1, greedy, k = {k}; online lr {args.lr}, "
          f"{args.steps} step(s) per call; {info['threads']} threads, load "
          f"{' '.join(map(str, info['load']))}; {repeated:.0%} of the output repeats an "
          f"earlier 16-gram")
    print(f"{'heads':<7} {'tok/fwd':>8} {'first ' + str(window):>9} {'last ' + str(window):>8} "
          f"{'tokens/s':>9} {'decoding':>9} {'learning s':>11}")
    for name, row in (("frozen", frozen), ("online", online)):
        print(f"{name:<7} {row['tokens_per_forward']:>8.2f} {row['first_window']:>9.2f} "
              f"{row['last_window']:>8.2f} {row['tokens_per_second']:>9.1f} "
              f"{row['tokens_per_second_decoding']:>9.1f} {row['learning_seconds']:>11.1f}")
    result = {"frozen": frozen, "online": online, "identical": frozen_ids == online_ids,
              "prompts": len(prompts), "prompt_source": str(source), "offset": args.offset, "k": k, "lr": args.lr,
              "steps": args.steps, "window": window, "max_new_tokens": args.max_new_tokens,
              "repeated": round(repeated, 3), "checkpoint": str(args.checkpoint), **info}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
