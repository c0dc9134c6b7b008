"""Layer skipping (Draft & Verify) on one checkpoint: acceptance and speed against the share of
trunk layers skipped, beside autoregressive decoding.

    python -m mtp.generate.skip_search checkpoint=CKPT       # keeps the skip choice
    python scripts/bench_layer_skip.py checkpoint=CKPT skipped=[1,2,4,8] num_draft=3

The skipped sets are the search's nested ones: for each count m of `skipped`, the first m
layers of the choice's `order` (least harmful first), plus the search's own choice. Prompts:
HumanEval's (by index; held out from the search's MBPP prompts), each decoded alone (batch
1), greedily. Each row: tokens/s, speed-up, tokens per forward, the first draft's acceptance,
the draft's share of a token's weights, identical greedy ids and the repeated share of the
text. Prints a table and ends with one JSON line: {"rows": {"<name>": {"skipped",
"tokens_per_second", "speedup", "tokens_per_forward", "acceptance", "draft_share",
"identical", "repeated"}}, ...}.

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
from mtp.bench.decoding import KEYS, Decoding, saved_context
from mtp.bench.machine import machine
from mtp.bench.prompts import humaneval_selected
from mtp.decode.drafters.layer_skip import LayerSkip, SkipChoice
from mtp.decode.drafters.registry import DrafterSpec
from mtp.decode.output import repetition
from mtp.generate.measure import time_generate
from mtp.generate.session import open_decoder
from mtp.generate.skip_search import draft_share
from mtp.model import MTPConfig

DEFAULT_PROMPTS = [0, 1, 2, 3, 4, 5, 40, 41, 42, 43, 44, 45]


@dataclass(frozen=True, kw_only=True)
class LayerSkipArgs(Decoding):
    checkpoint: str = MISSING
    choice: str | None = None
    skipped: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    num_draft: int = 3
    threshold: float = 0.0
    humaneval: list[int] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
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
    shape = {"n_layers": config.n_layers, "vocab_size": config.vocab_size}
    if args.choice is not None:
        return SkipChoice.load(args.choice, **shape)
    saved = saved_context(args.checkpoint).saved.get(LayerSkip.saved)
    if saved is None:
        raise ValueError(f"{args.checkpoint} has no layer-skip choice: python -m "
                         f"mtp.generate.skip_search checkpoint=... (or give choice=FILE)")
    return SkipChoice.load(saved, **shape)


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
    sets = {f"skip {m} of {n_layers}": tuple(sorted(order[:m]))
            for m in args.skipped if 0 < m < n_layers}
    sets[f"search's choice ({len(choice.skip)}), k={choice.num_draft}"] = choice.skip
    methods: dict[str, tuple[tuple[int, ...], LayerSkip | None]] = {"autoregressive": ((), None)}
    for name, skip in sets.items():
        k = choice.num_draft if skip == choice.skip and "choice" in name else args.num_draft
        methods[name] = (skip, DrafterSpec("layer_skip", skip=list(skip), num_draft=k,
                                           threshold=args.threshold).build(model))

    rows: dict[str, dict] = {}
    reference: list[list[int]] = []
    base = 0.0
    for name, (skip, drafter) in methods.items():
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
    cli.main(main, __doc__ + KEYS)
