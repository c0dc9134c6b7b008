"""Online heads against the same heads frozen, over a stream of held-out prompts.

    python scripts/bench_online.py checkpoint=runs/smollm2_medusa1/export humaneval=100 \
        max_new_tokens=48 k=4 threads=2

Each prompt is decoded alone (batch 1, greedy), one `generate` call after another as a server
meets them: by the checkpoint's heads (k), and by `OnlineHeads(k)` (`drafter=heads
online=true`), which takes `steps` optimizer steps on heads 1..k-1 after each call. Both
start from the same weights; their greedy output must be identical (checked). Prints a table
(tokens per forward over the stream and its first and last `window` prompts, tokens/s with
and without the learning), then one JSON line: {"frozen": {...}, "online": {...}, ...}.

Arguments are key=value (`mtp.cli`'s grammar); how it decodes (device, dtype, threads) is
below.
  checkpoint       anything mtp.load reads (required)
  humaneval        100 HumanEval prompts, the stream, after the first `offset` (0)
  prompts          a prompt file instead of HumanEval's (null)
  max_new_tokens   48
  k                tokens per forward at most (null: every head)
  lr               1e-4: the online heads' AdamW learning rate
  steps            1 optimizer step after each call
  window           20 prompts at each end of the stream
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from mtp import cli
from mtp.bench.decoding import KEYS, Decoding
from mtp.bench.machine import machine
from mtp.bench.prompts import humaneval_prompts
from mtp.decode.drafters import Drafter, OnlineHeads
from mtp.decode.output import Generation, repetition
from mtp.generate import generate
from mtp.generate.measure import time_calls
from mtp.generate.prompts import read_prompts
from mtp.generate.session import open_decoder
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


@dataclass(frozen=True, kw_only=True)
class OnlineArgs(Decoding):
    checkpoint: str = MISSING
    humaneval: int = 100
    prompts: Path | None = None
    offset: int = 0
    max_new_tokens: int = 48
    k: int | None = None
    lr: float = 1e-4
    steps: int = 1
    window: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.check_positives(self, "max_new_tokens", "steps", "window")
        cli.check_positives(self, "humaneval", "offset", least=0)
        if self.k is not None:
            cli.check_positive("k", self.k, least=2)
        cli.check_number("lr", self.lr, lambda v: v > 0, "> 0")


def parse_args(argv: list[str]) -> OnlineArgs:
    return cli.parse(argv, OnlineArgs)


def stream(model: MTPModel, tokenizer: Tokenizer, prompts: list[str], drafter: Drafter,
           max_new_tokens: int, window: int) -> tuple[dict, list[list[int]]]:
    """Decode `prompts` one call each (`time_calls`): the figures and every output's ids."""
    def decode(_: int, batch: list[str]) -> list[Generation]:
        return generate(model, tokenizer, batch, max_new_tokens=max_new_tokens, drafter=drafter)

    seconds, done = time_calls(decode, prompts, 1, cuda=next(model.parameters()).is_cuda)
    passes = [g.stats.forward_passes for g in done]
    tokens = [g.stats.new_tokens for g in done]
    online = isinstance(drafter, OnlineHeads)
    learning, learnt = (drafter.seconds, drafter.learnt) if online else (0.0, 0)

    def per_forward(part: slice) -> float:
        return round(sum(tokens[part]) / max(sum(passes[part]), 1), 3)

    return {"tokens_per_forward": per_forward(slice(None)),
            "first_window": per_forward(slice(0, window)),
            "last_window": per_forward(slice(-window, None)),
            "tokens_per_second": round(sum(tokens) / seconds, 2),
            "tokens_per_second_decoding": round(sum(tokens) / (seconds - learning), 2),
            "learning_seconds": round(learning, 1), "optimizer_steps": learnt}, \
        [g.token_ids for g in done]


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    prompts = read_prompts(args.prompts) if args.prompts else \
        humaneval_prompts(args.offset + args.humaneval)[args.offset:]
    decoder = open_decoder(args.checkpoint, args.settings("heads", options={"k": args.k}),
                           prompts=prompts[:1], max_new_tokens=args.max_new_tokens)
    frozen_model, tokenizer, frozen_heads = decoder.model, decoder.tokenizer, decoder.drafter
    if frozen_heads is None:
        raise ValueError(f"{args.checkpoint} has one head: there are no heads to compare")
    learning_model = copy.deepcopy(frozen_model)  # the online heads change their model's heads
    k = frozen_heads.k
    context = frozen_model.config.max_seq_len - args.max_new_tokens
    prompts = [p for p in prompts if len(tokenizer.encode_prompt(p)) < context]
    window = min(args.window, max(len(prompts) // 2, 1))
    generate(frozen_model, tokenizer, prompts[:1], max_new_tokens=8, drafter=frozen_heads)
    frozen, frozen_ids = stream(frozen_model, tokenizer, prompts, frozen_heads,
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
    print(json.dumps({"frozen": frozen, "online": online, "identical": frozen_ids == online_ids,
                      "prompts": len(prompts), "prompt_source": str(source),
                      "offset": args.offset, "k": k, "lr": args.lr, "steps": args.steps,
                      "window": window, "max_new_tokens": args.max_new_tokens,
                      "repeated": round(repeated, 3), "checkpoint": str(args.checkpoint),
                      **info}))


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS)
