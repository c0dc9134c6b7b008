r"""SpecInfer's and SpecTr's acceptance on the same drafts when sampling: tokens per forward
and tokens/s of the heads' tree under each rule.

    python scripts/bench_acceptance.py checkpoint=runs/smollm2_heads/export tree=tree16 \
        temperature=0.8

Rows (all lossless): `specinfer distinct` (siblings drawn without replacement, SpecInfer's
recursive rejection: the default), `specinfer iid` (siblings drawn independently) and
`spectr iid` (the same drafts, SpecTr's k-sequential selection). Every prompt is decoded
alone with the same seeds. Prompts: HumanEval's `humaneval_select` (held out), or a
`prompt_file`'s. Prints a table, then one JSON line: {"rules": {"<row>": {...}}, ...}.

Arguments are key=value (`mtp.cli`'s grammar):
  checkpoint       anything mtp.load reads (required)
  tree             tree16: the heads' tree (`drafter=heads tree=...`; dynamic:N too)
  temperature      0.8;  top_k null, top_p 1.0
  humaneval_select [0,1,2,3,4,5,40,41,42,43,44,45]; prompt_file: a .jsonl instead
  max_new_tokens   80
  device, dtype, threads   as python -m mtp.generate takes them
The heads' other options (k) are taken as generate takes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from mtp import cli
from mtp.bench.decoding import Decoding, saved_context
from mtp.bench.machine import machine
from mtp.bench.prompts import HELD_OUT, file_or_selected
from mtp.decode.drafters import DrafterSpec
from mtp.decode.drafters.registry import option_owners
from mtp.decode.sampling import SamplingConfig
from mtp.generate.measure import time_generate
from mtp.generate.session import open_decoder

ROWS = {"specinfer distinct": ("exact", "distinct"), "specinfer iid": ("exact", "iid"),
        "spectr iid": ("spectr", "iid")}


@dataclass(frozen=True, kw_only=True)
class AcceptanceArgs(Decoding):
    checkpoint: str = MISSING
    options: dict[str, Any] = field(default_factory=dict)  # the heads' (tree, k)
    temperature: float = 0.8
    top_k: int | None = None
    top_p: float = 1.0
    humaneval_select: list[int] = field(default_factory=lambda: list(HELD_OUT))
    prompt_file: Path | None = None
    max_new_tokens: int = 80

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.check_positive("max_new_tokens", self.max_new_tokens)
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0: the rules differ "
                             f"only when sampling")
        self.sampling()
        for _, siblings in ROWS.values():
            self.spec(siblings)

    def spec(self, siblings: str) -> DrafterSpec:
        if "siblings" in self.options:
            raise ValueError("siblings= is what the rows vary: leave it out")
        return DrafterSpec("heads", **{"tree": "tree16", **self.options}, siblings=siblings)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


def parse_args(argv: list[str]) -> AcceptanceArgs:
    return cli.parse(argv, AcceptanceArgs, extra=option_owners(), extra_field="options")


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    decoder = open_decoder(args.checkpoint, args.settings(), max_new_tokens=args.max_new_tokens)
    model, tokenizer = decoder.model, decoder.tokenizer
    prompts = file_or_selected(args.prompt_file, args.humaneval_select)
    context = saved_context(args.checkpoint)
    rules = {}
    for name, (rule, siblings) in ROWS.items():
        drafter = args.spec(siblings).build(model, context)
        timed = time_generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                              drafter=drafter, sampling=args.sampling(), acceptance=rule,
                              seed=0, seed_per_batch=True, warmup_tokens=8)
        rules[name] = {"tokens_per_forward": round(timed.stats.tokens_per_forward, 3),
                       "tokens_per_second": round(timed.tokens_per_second, 2),
                       "accepted_per_depth": [round(a, 3) for a in timed.stats.head_acceptance]}
    info = machine(args.device)
    tree = args.spec("iid").options["tree"]
    print(f"{args.checkpoint}: heads tree={tree}, T={args.temperature}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens, batch 1, {info['threads']} "
          f"threads, load {' '.join(map(str, info['load']))}")
    print(f"{'rule':<20} {'tok/fwd':>8} {'tokens/s':>9}")
    for name, row in rules.items():
        print(f"{name:<20} {row['tokens_per_forward']:>8.3f} {row['tokens_per_second']:>9.1f}")
    print(json.dumps({"rules": rules, "tree": tree, "temperature": args.temperature,
                      "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "checkpoint": str(args.checkpoint), **info}))


if __name__ == "__main__":
    cli.main(main, __doc__)
