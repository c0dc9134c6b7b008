r"""What exact mode costs: each drafter decoding with `exact=true` against its plain step, per
dtype, and whether its ids are the exact reference's.

    python scripts/bench_exact.py checkpoint=runs/smollm2_heads/export \
        'methods=["heads k=4","heads tree=tree16",prompt_lookup,"heads+prompt_lookup k=4"]' \
        dtypes=[float32,bfloat16] threads=2

In every dtype: autoregressive decoding at width 1 (the plain step; float32's is every
speed-up's baseline) and in exact mode at each width W (the reference); then each method plain
and in exact mode at its widest step W, alternating `repeats` times (best kept). Per row:
tokens/s `plain` and `exact`, `cost` (plain over exact: 1.05 is exact mode 5% slower),
`speedup` (exact over the baseline), `identical` (exact ids equal the exact reference's),
`plain_identical` (plain ids equal width-1 autoregressive decoding's), `tokens_per_forward`,
`width`, `repeated` (the share of tokens inside an earlier `repeated_ngram`-gram).
Prompts: HumanEval's `humaneval_select` (held out), or a `prompt_file`'s, each decoded alone
(batch 1), greedy. Prints a table, then one JSON line: {"rows": {"<method> <dtype>": {...}},
"baseline": <float32 width-1 tokens/s>, ...}.

Arguments are key=value (`mtp.cli`'s grammar); the drafters' options (num_draft=8,
draft_model=..., skip=...) size every method they belong to, as on generate's command line.
  checkpoint       anything mtp.load reads (required)
  methods          ["heads k=4",prompt_lookup]: drafters by name, options quoted with them
  dtypes           [float32,bfloat16]
  humaneval_select [0,1,2,3,4,5,40,41,42,43,44,45]: HumanEval prompts by index
  max_new_tokens   80
  repeats          2 alternating runs of plain and exact mode (best kept)
  repeated_ngram   16
  device, threads  cpu; auto (measured) or a count, as python -m mtp.generate takes them
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from mtp import cli
from mtp.bench.decoding import SHORT, Dtypes, machine_line, print_table, saved_context
from mtp.bench.machine import machine
from mtp.bench.prompts import HELD_OUT, file_or_selected
from mtp.decode.drafters import Drafter, DrafterContext, DrafterSpec
from mtp.decode.drafters.registry import (AUTOREGRESSIVE, entry_spec, option_owners,
                                          options_help)
from mtp.decode.output import repetition
from mtp.generate.measure import Timed, step_width, time_generate
from mtp.generate.session import open_decoder
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


@dataclass(frozen=True, kw_only=True)
class ExactArgs(Dtypes):
    checkpoint: str = MISSING
    methods: list[str] = field(default_factory=lambda: ["heads k=4", "prompt_lookup"])
    options: dict[str, Any] = field(default_factory=dict)
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    humaneval_select: list[int] = field(default_factory=lambda: list(HELD_OUT))
    prompt_file: Path | None = None
    max_new_tokens: int = 80
    repeats: int = 2
    repeated_ngram: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.check_positives(self, "max_new_tokens", "repeats", "repeated_ngram")
        if not (self.methods and self.humaneval_select):
            raise ValueError(f"methods={self.methods} and humaneval_select="
                             f"{self.humaneval_select} each need an entry")
        for entry in self.methods:
            self.spec(entry)  # each names a drafter, with options that size it

    def spec(self, entry: str) -> DrafterSpec:
        return entry_spec(entry, self.options, "methods")


def parse_args(argv: list[str]) -> ExactArgs:
    return cli.parse(argv, ExactArgs, extra=option_owners(), extra_field="options")


@dataclass
class Bench:
    """Times plain and exact decoding of the prompts in one dtype at a time."""

    args: ExactArgs
    model: MTPModel
    tokenizer: Tokenizer
    prompts: list[str]
    context: DrafterContext
    rows: dict[str, dict] = field(default_factory=dict)
    baseline: float = 0.0  # float32 (the first dtype) width-1 autoregressive tokens/s

    def run(self, drafter: Drafter | None, **how: Any) -> Timed:
        return time_generate(self.model, self.tokenizer, self.prompts,
                             max_new_tokens=self.args.max_new_tokens, drafter=drafter,
                             warmup_tokens=8, **how)

    def pair(self, drafter: Drafter | None, width: int) -> tuple[Timed, Timed]:
        """The best of `repeats` alternating plain and exact runs."""
        runs = [(self.run(drafter), self.run(drafter, exact=True, width=width))
                for _ in range(self.args.repeats)]
        return tuple(max(timed, key=lambda t: t.tokens_per_second) for timed in zip(*runs))

    def dtype(self, dtype: str) -> None:
        self.model.to(cli.parse_dtype(dtype))
        tag = SHORT[dtype]
        references: dict[int, Timed] = {}
        plain_reference = None
        for entry in ["autoregressive", *self.args.methods]:
            drafter = None if entry == AUTOREGRESSIVE else \
                self.args.spec(entry).build(self.model, self.context)
            width = step_width(drafter)
            if width not in references:  # the exact reference at this width, and width 1
                plain, references[width] = self.pair(None, width)
                plain_reference = plain_reference or plain
                self.baseline = self.baseline or plain.tokens_per_second
                self.add(f"autoregressive width {width} {tag}", plain, references[width],
                         plain_reference, references[width], width)
            if drafter is not None:
                plain, exact = self.pair(drafter, width)
                self.add(f"{entry} {tag}", plain, exact, plain_reference, references[width],
                         width)

    def add(self, name: str, plain: Timed, exact: Timed, width1: Timed, reference: Timed,
            width: int) -> None:
        self.rows[name] = {
            "plain": round(plain.tokens_per_second, 2),
            "exact": round(exact.tokens_per_second, 2),
            "cost": round(plain.tokens_per_second / exact.tokens_per_second, 3),
            "speedup": round(exact.tokens_per_second / self.baseline, 3),
            "identical": exact.token_ids == reference.token_ids,
            "plain_identical": plain.token_ids == width1.token_ids,
            "tokens_per_forward": round(exact.stats.tokens_per_forward, 3), "width": width,
            "repeated": round(repetition(exact.token_ids, self.args.repeated_ngram), 3)}
        print(f"  measured {name}: plain {plain.tokens_per_second:.1f}, exact "
              f"{exact.tokens_per_second:.1f} tokens/s", file=sys.stderr)


COLUMNS = [("plain", "plain", 7, "{:.1f}"), ("exact", "exact", 7, "{:.1f}"),
           ("cost", "cost", 6, "{:.3f}"), ("speedup", "speedup", 8, "{:.2f}x"),
           ("tok/fwd", "tokens_per_forward", 7, "{:.2f}"), ("identical", "identical", 9, None),
           ("plain_id", "plain_identical", 8, None), ("repeated", "repeated", 8, "{:.2f}")]


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    decoder = open_decoder(args.checkpoint, args.settings(), max_new_tokens=args.max_new_tokens)
    prompts = file_or_selected(args.prompt_file, args.humaneval_select)
    source = "HumanEval" if args.prompt_file is None else args.prompt_file.name
    bench = Bench(args, decoder.model, decoder.tokenizer, prompts,
                  saved_context(args.checkpoint))
    for dtype in args.dtypes:
        bench.dtype(dtype)
    info = machine(args.device)
    print(f"checkpoint {args.checkpoint}  device {args.device}  {machine_line(info)}")
    print(f"prompts: {len(prompts)} {source} x {args.max_new_tokens} new tokens, batch 1, "
          f"greedy; float32 width-1 autoregressive {bench.baseline:.1f} tokens/s")
    print_table(bench.rows, COLUMNS)
    print(json.dumps({"rows": bench.rows, "baseline": round(bench.baseline, 2),
                      "checkpoint": str(args.checkpoint), "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, **info}))


if __name__ == "__main__":
    cli.main(main, __doc__ + "\nThe drafters and their options:\n" + options_help())
