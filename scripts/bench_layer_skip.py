"""Layer skipping (Draft & Verify) on one checkpoint: acceptance and speed against the share of
trunk layers skipped, beside autoregressive decoding.

    python -m mtp.generate.skip_search checkpoint=CKPT       # keeps the skip choice
    python scripts/bench_layer_skip.py checkpoint=CKPT skipped=[1,2,4,8] num_draft=3

The skipped sets: for each count m of `skipped`, the first m layers of the choice's `order`
(least harmful first), plus the search's own choice. Prompts: HumanEval's by index (held
out), each decoded alone (batch 1), greedily. A row also gives the first draft's acceptance
and the draft's share of a token's weights. Prints a table and ends with one JSON line:
{"rows": {"<name>": {...}}, ...}.

Arguments are key=value (`mtp.cli`'s grammar); how it decodes (device, dtype, threads) is
below.
  checkpoint       anything mtp.load reads (required)
  choice           a layer_skip.json (null: the checkpoint's, kept by python -m
                   mtp.generate.skip_search)
  skipped          [1,2,4,8] layers skipped, the search's least harmful first
  num_draft        3 drafts per step; threshold: the draft-exit (0)
  humaneval        [0,1,2,3,4,5,40,41,42,43,44,45]: HumanEval prompt indices
  prompt           a list of prompts instead of HumanEval's, e.g. prompt='["def f(x):"]'
  max_new_tokens   80
  repeated_ngram   16: the n-gram size of `repeated`
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from omegaconf import MISSING

from mtp import cli
from mtp.bench.decoding import KEYS, Decoding, machine_line, print_table, saved_context
from mtp.bench.machine import machine
from mtp.bench.prompts import HELD_OUT, humaneval_selected
from mtp.decode.drafters.layer_skip import LayerSkip, SkipChoice
from mtp.decode.drafters.registry import DrafterSpec
from mtp.decode.output import repetition
from mtp.generate.measure import time_generate
from mtp.generate.session import open_decoder
from mtp.generate.skip_search import draft_share
from mtp.model import MTPConfig

COLUMNS = [("tokens/s", "tokens_per_second", 9, "{:.1f}"), ("speedup", "speedup", 8, "{:.2f}x"),
           ("tok/fwd", "tokens_per_forward", 8, "{:.2f}"), ("accept", "acceptance", 7, "{:.2f}"),
           ("share", "draft_share", 6, "{:.2f}"), ("identical", "identical", 9, None),
           ("repeated", "repeated", 8, "{:.2f}")]


@dataclass(frozen=True, kw_only=True)
class LayerSkipArgs(Decoding):
    checkpoint: str = MISSING
    choice: str | None = None
    skipped: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    num_draft: int = 3
    threshold: float = 0.0
    humaneval: list[int] = field(default_factory=lambda: list(HELD_OUT))
    prompt: list[str] | None = None
    max_new_tokens: int = 80
    repeated_ngram: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.check_positives(self, "num_draft", "max_new_tokens", "repeated_ngram")
        if not (self.prompt or self.humaneval) or min(self.humaneval or [0]) < 0:
            raise ValueError(f"humaneval={self.humaneval}: give prompt indices >= 0 (or "
                             f"prompt=[...])")
        DrafterSpec("layer_skip", threshold=self.threshold)  # checked as the drafter checks it


def parse_args(argv: list[str]) -> LayerSkipArgs:
    return cli.parse(argv, LayerSkipArgs)


def skip_choice(args: LayerSkipArgs, config: MTPConfig) -> SkipChoice:
    """The search's choice: `choice`'s file, or the checkpoint's kept one."""
    saved = args.choice or saved_context(args.checkpoint).saved.get(LayerSkip.saved)
    if saved is None:
        raise ValueError(f"{args.checkpoint} has no layer-skip choice: python -m "
                         f"mtp.generate.skip_search checkpoint=... (or give choice=FILE)")
    return SkipChoice.load(saved, n_layers=config.n_layers, vocab_size=config.vocab_size)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    prompts = list(args.prompt or ()) or humaneval_selected(args.humaneval)
    decoder = open_decoder(args.checkpoint, args.settings(), prompts=prompts[:1],
                           max_new_tokens=args.max_new_tokens)
    model, tokenizer = decoder.model, decoder.tokenizer
    n_layers = model.config.n_layers
    choice = skip_choice(args, model.config)
    order = choice.details.get("order")
    if order is None:
        raise ValueError("the choice has no search order: search again with "
                         "python -m mtp.generate.skip_search")
    sets = {"autoregressive": ((), 0)}  # (layers skipped, drafts per step)
    sets |= {f"skip {m} of {n_layers}": (tuple(sorted(order[:m])), args.num_draft)
             for m in args.skipped if 0 < m < n_layers}
    sets[f"search's choice ({len(choice.skip)}), k={choice.num_draft}"] = (choice.skip,
                                                                             choice.num_draft)
    rows: dict[str, dict] = {}
    reference: list[list[int]] = []
    base = 0.0
    for name, (skip, k) in sets.items():
        drafter = None if k == 0 else DrafterSpec("layer_skip", skip=list(skip), num_draft=k,
                                                  threshold=args.threshold).build(model)
        timed = time_generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                              drafter=drafter, warmup_tokens=8)
        stats, ids = timed.stats, timed.token_ids
        if drafter is None:  # autoregressive decoding comes first
            reference, base = ids, timed.tokens_per_second
        rows[name] = {
            "skipped": list(skip), "tokens_per_second": round(timed.tokens_per_second, 1),
            "speedup": round(timed.tokens_per_second / base, 3),
            "tokens_per_forward": round(stats.tokens_per_forward, 3),
            "acceptance": round(stats.head_acceptance[1], 3) if drafter else None,
            "draft_share": round(draft_share(model, skip), 3) if drafter else None,
            "identical": ids == reference,
            "repeated": round(repetition(ids, args.repeated_ngram), 3)}

    info = machine("cpu")
    print(f"checkpoint {args.checkpoint}  {machine_line(info)}")
    print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, batch 1, greedy; "
          f"num_draft {args.num_draft}, threshold {args.threshold}")
    print_table(rows, COLUMNS)
    print(json.dumps({"rows": rows, "checkpoint": str(args.checkpoint), "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "num_draft": args.num_draft,
                      "threshold": args.threshold, **info}))


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS)
