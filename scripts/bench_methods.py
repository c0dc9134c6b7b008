r"""Every drafting method on one checkpoint and one prompt set: tokens/s, speed-up, tokens per
forward, identical greedy output, and how repetitive the output is.

    python scripts/bench_methods.py checkpoint=runs/byte8/export \
        draft_model=runs/draft_small/export humaneval=24 max_new_tokens=128

Methods (after autoregressive decoding): drafters by their registered names, and `auto`. A
name alone measures what `drafter=auto` measures of that drafter (lookahead, which auto does
not measure, runs as named); a quoted name with options ("heads tree=tree16") measures that one
drafter. Drafter options given as keys (num_draft=8 draft_model=...) size every method they
belong to. `auto` keeps the fastest of its candidates (its time reported apart). Each prompt
is decoded alone (batch 1), greedily and at each `temperatures` value > 0 (seeded; rows
"<name> T=<t>", identical null); `dtypes` adds rows "<name> bf16".

`repeated`: the share of generated tokens inside an n-gram already generated in the same
output (a looping model makes every drafter look perfect; warned above 0.5). `forward_cost`:
a step's time in autoregressive steps of the same dtype. Prints a table, writes `plot`, and
ends with one JSON line: {"methods": {"<name>": {...}}, ...}.

Arguments are key=value (`mtp.cli`'s grammar); the drafters' options are below.
  checkpoint       anything mtp.load reads (required)
  methods          every drafter, and auto; e.g. 'methods=[heads,"heads tree=tree16",auto]'
  prompts          data/prompts/code.jsonl; code_prompts=false leaves it out
  humaneval        24 HumanEval prompts (0: none); humaneval_select: these indices instead
  max_new_tokens   128
  temperatures     [0.0,0.8]
  auto_prompts     4 prompts (evenly spaced) auto measures its candidates on
  budget           the most seconds auto measures (null: no limit)
  repeated_ngram   16: the n-gram size of `repeated`
  dtypes           [float32] (float32, bfloat16, float16): decode in each
  hf               false: true adds transformers' greedy generate and its prompt lookup, in the
                   first dtype; hf_early_exit=LAYER adds its assistant_early_exit
  plot             write a bar chart (.png) here (null: none)
  device, threads  cpu; auto (measured) or a count, as python -m mtp.generate takes them

The draft model of docs/benchmarks.md is a small byte model trained by the repo's own trainer
(a few minutes on a CPU):

    python -m mtp.train +experiment=byte1 model=tiny model.dim=128 model.depth=3 \
        model.max_seq_len=1024 trainer.max_steps=400 logger=csv hydra.run.dir=runs/draft_small
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import MISSING

from mtp import cli
from mtp.bench.decoding import SHORT, Dtypes, machine_line, print_table, saved_context
from mtp.bench.machine import machine
from mtp.bench.prompts import CODE_PROMPTS, humaneval_prompts, humaneval_selected, spread
from mtp.bench.study import panels, save
from mtp.decode.drafters import Drafter, DrafterContext, DrafterSpec, drafter_types
from mtp.decode.drafters.registry import AUTO, AUTOREGRESSIVE, option_owners, options_help
from mtp.decode.output import repetition
from mtp.decode.sampling import SamplingConfig
from mtp.generate.auto import Auto
from mtp.generate.measure import time_generate
from mtp.generate.prompts import read_prompts
from mtp.generate.session import open_decoder
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer

DRAFT_MODEL_COMMAND = " ".join(__doc__.rsplit("\n\n", 1)[1].replace("\\\n", "").split())
OPTIONS = re.compile(r"(?<!heads)\([^()]*\)")  # a drafter's options in its repr, the heads' kept


def default_methods() -> list[str]:
    return [name for name in drafter_types() if name != AUTOREGRESSIVE] + [AUTO]


@dataclass(frozen=True, kw_only=True)
class MethodsArgs(Dtypes):
    checkpoint: str = MISSING
    methods: list[str] = field(default_factory=default_methods)
    options: dict[str, Any] = field(default_factory=dict)
    prompts: Path = CODE_PROMPTS
    code_prompts: bool = True
    humaneval: int = 24
    humaneval_select: list[int] | None = None
    max_new_tokens: int = 128
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.8])
    auto_prompts: int = 4
    budget: float | None = None
    repeated_ngram: int = 16
    hf: bool = False
    hf_early_exit: int | None = None
    plot: Path | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.check_positives(self, "max_new_tokens", "auto_prompts", "repeated_ngram")
        cli.check_positive("humaneval", self.humaneval, least=0)
        if self.hf and 0.0 not in self.temperatures:
            raise ValueError(f"hf=true compares greedy decoding: temperatures="
                             f"{self.temperatures} must include 0")
        DrafterSpec(AUTO, **self.options)  # each option belongs to a drafter, checked
        for entry in self.methods:
            name, spec, _ = self.method(entry)
            if name == AUTO:
                Auto(spec=spec, budget=self.budget)  # it measures something

    def method(self, entry: str) -> tuple[str, DrafterSpec, bool]:
        """A `methods` entry: its name, its spec (the options that size it, the entry's own
        last), and whether it names one drafter: its own options, the options that select it
        (k=4: the heads) or a drafter auto does not measure (lookahead); else it stands for
        what `drafter=auto` measures of it."""
        name, *words = entry.split()
        owners, types = option_owners(), drafter_types()
        if name != AUTO and name not in types:
            raise ValueError(f"methods: unknown drafter {name!r}; choose from "
                             f"{', '.join(default_methods())}")
        own = cli.overrides(words)
        if name == AUTO:  # what auto measures: not the keys that name one drafter (k=4)
            selects = {key for cls in types.values() for key in cls.selects}
            given = {key: value for key, value in self.options.items() if key not in selects}
            return name, DrafterSpec(AUTO, **given, **own), False
        options = {**{key: value for key, value in self.options.items()
                      if name in owners[key]}, **own}
        cls = types[name]
        named = (bool(own) or any(key in options for key in cls.selects)
                 or cls.candidates.__func__ is Drafter.candidates.__func__)
        return name, DrafterSpec(name if named else AUTO, **options), named


def parse_args(argv: list[str]) -> MethodsArgs:
    return cli.parse(argv, MethodsArgs, extra=option_owners(), extra_field="options")


def label(drafter: Drafter | None) -> str:
    """A row's name: the drafter without its options (the heads' k or tree kept)."""
    if drafter is None:
        return AUTOREGRESSIVE
    return OPTIONS.sub("", repr(drafter)) + (" adaptive" if getattr(drafter, "adaptive", False)
                                             else "")


@dataclass
class Bench:
    """Measures the methods of `args` on one model and prompt set, row by row."""

    args: MethodsArgs
    model: MTPModel
    tokenizer: Tokenizer
    prompts: list[str]
    context: DrafterContext
    rows: dict[str, dict] = field(default_factory=dict)
    auto_seconds: dict[str, float] = field(default_factory=dict)
    baseline: dict[float, float] = field(default_factory=dict)  # the first dtype's AR tokens/s
    reference: list[list[int]] = field(default_factory=list)  # this dtype's greedy AR ids
    ar: float = 0.0  # this dtype's and temperature's autoregressive tokens/s

    def dtype(self, dtype: str) -> None:
        """Every method at every temperature in `dtype` (the model converted to it)."""
        self.model.to(cli.parse_dtype(dtype))  # the first dtype first: the others round it
        tag = "" if dtype == self.args.dtypes[0] else f" {SHORT[dtype]}"
        for temperature in self.args.temperatures:
            sampling = SamplingConfig(temperature=temperature)
            suffix = tag + ("" if sampling.greedy else f" T={temperature:g}")
            measured = {AUTOREGRESSIVE: self.measure(None, AUTOREGRESSIVE + suffix, sampling)}
            for entry in self.args.methods:
                name, spec, named = self.args.method(entry)
                if name == AUTO:
                    drafter = self.auto(spec, sampling, suffix.strip() or "greedy")
                    self.measure(drafter, f"auto ({label(drafter)}){suffix}", sampling)
                    continue
                found = [spec.build(self.model, self.context)] if named else \
                    spec.candidates(self.model, self.context, measured, name)
                for drafter in found:  # each once; a name another drafter took: its repr
                    shown = label(drafter) if label(drafter) + suffix not in self.rows else \
                        repr(drafter)
                    if drafter is not None and repr(drafter) not in measured:
                        measured[repr(drafter)] = self.measure(drafter, shown + suffix, sampling)

    def auto(self, spec: DrafterSpec, sampling: SamplingConfig, kind: str) -> Drafter | None:
        """auto's choice for these prompts (its measuring time kept apart)."""
        auto = Auto(spec=spec, context=self.context, budget=self.args.budget)
        began = time.perf_counter()
        drafter = auto.choose(self.model, self.tokenizer,
                              spread(self.prompts, self.args.auto_prompts), sampling=sampling,
                              max_new_tokens=self.args.max_new_tokens, batch_size=1)
        self.auto_seconds[kind] = time.perf_counter() - began
        return drafter

    def measure(self, drafter: Drafter | None, name: str, sampling: SamplingConfig) -> float:
        """Decode every prompt with `drafter`; its row under `name`, and its tokens/s."""
        timed = time_generate(self.model, self.tokenizer, self.prompts,
                              max_new_tokens=self.args.max_new_tokens, drafter=drafter,
                              sampling=sampling, seed=0, seed_per_batch=True, warmup_tokens=8)
        if drafter is None:
            self.ar = timed.tokens_per_second
            if sampling.greedy:
                self.reference = timed.token_ids
        self.add(name, timed.tokens_per_second, timed.token_ids, sampling,
                 timed.stats.tokens_per_forward)
        return timed.tokens_per_second

    def add(self, name: str, speed: float, ids: list[list[int]], sampling: SamplingConfig,
            tokens_per_forward: float | None = None) -> None:
        """A method's row: `speedup` against the first dtype's autoregressive tokens/s at this
        temperature, `forward_cost` a step's time in autoregressive steps of this dtype (tokens
        per forward over the speed-up against it; None without tokens per forward)."""
        base = self.baseline.setdefault(sampling.temperature, self.ar)
        known = tokens_per_forward is not None
        self.rows[name] = {
            "tokens_per_second": round(speed, 1), "speedup": round(speed / base, 3),
            "tokens_per_forward": round(tokens_per_forward, 3) if known else None,
            "forward_cost": round(tokens_per_forward * self.ar / speed, 3) if known else None,
            "identical": ids == self.reference if sampling.greedy else None,
            "repeated": round(repetition(ids, self.args.repeated_ngram), 3)}
        print(f"  measured {name}: {speed:.1f} tokens/s", file=sys.stderr)

    def transformers(self) -> None:
        """transformers' greedy `generate` on the model's weights (its dtype): plain, with
        prompt lookup (prompt lookup's num_draft), and with hf_early_exit."""
        from mtp.bench.hf import hf_model, time_hf

        hf = hf_model(self.model, self.tokenizer)
        _, spec, _ = self.args.method("prompt_lookup")
        lookup = spec.options_of("prompt_lookup").num_draft
        methods = {"transformers": {},
                   "transformers prompt_lookup": {"prompt_lookup_num_tokens": lookup}}
        if self.args.hf_early_exit is not None:
            methods[f"transformers early_exit({self.args.hf_early_exit})"] = {
                "assistant_early_exit": self.args.hf_early_exit}
        inputs = self.tokenizer.encode_prompts(self.prompts)
        with torch.inference_mode():
            for name, options in methods.items():
                time_hf(hf, inputs[:1], 8, self.tokenizer, **options)  # warm-up
                seconds, ids = time_hf(hf, inputs, self.args.max_new_tokens, self.tokenizer,
                                       **options)
                self.add(name, sum(map(len, ids)) / seconds, ids, SamplingConfig())


def choose_prompts(args: MethodsArgs, tokenizer: Tokenizer, room: int) -> tuple[list[str], int]:
    """The prompt set (those that fit `room` tokens), and how many are HumanEval's."""
    chosen = (humaneval_selected(args.humaneval_select) if args.humaneval_select
              else humaneval_prompts(args.humaneval))
    prompts = (read_prompts(args.prompts) if args.code_prompts else []) + chosen
    return [p for p in prompts if len(tokenizer.encode(p)) < room], len(chosen)


def plot(rows: dict[str, dict], path: Path, title: str) -> None:
    names = list(rows)
    fig, [ax] = panels(1, 8, 0.35 * len(names) + 1.2)
    speedups = [rows[n]["speedup"] for n in names]
    colors = ["#888" if n.startswith("autoregressive") else
              "#a70" if n.startswith("transformers") else
              "#c44" if rows[n]["repeated"] > 0.5 else "#37a" for n in names]
    ax.barh(names, speedups, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    for y, (value, name) in enumerate(zip(speedups, names)):
        per_forward = rows[name]["tokens_per_forward"]
        text = f" {value:.2f}x" + (f"  {per_forward:.2f} tok/fwd" if per_forward else "")
        ax.text(value, y, text, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up over autoregressive decoding (tokens/s)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(speedups) * 1.45)
    save(fig, path)


COLUMNS = [("tokens/s", "tokens_per_second", 9, "{:.1f}"), ("speedup", "speedup", 8, "{:.2f}x"),
           ("tok/fwd", "tokens_per_forward", 8, "{:.2f}"),
           ("fwd_cost", "forward_cost", 8, "{:.2f}"), ("identical", "identical", 9, None),
           ("repeated", "repeated", 8, "{:.2f}")]


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    draft_model = args.options.get("draft_model")
    if draft_model is not None and not Path(draft_model).exists():
        raise FileNotFoundError(f"no draft model at {draft_model}; train one with "
                                f"{DRAFT_MODEL_COMMAND}")
    decoder = open_decoder(args.checkpoint, args.settings(), max_new_tokens=args.max_new_tokens)
    model, tokenizer = decoder.model, decoder.tokenizer
    room = model.config.max_seq_len - args.max_new_tokens - 16
    prompts, humaneval = choose_prompts(args, tokenizer, room)
    bench = Bench(args, model, tokenizer, prompts, saved_context(args.checkpoint))
    for dtype in args.dtypes:
        bench.dtype(dtype)
        if args.hf and dtype == args.dtypes[0]:  # transformers' baseline, in the first dtype
            bench.transformers()
    rows, info = bench.rows, machine(args.device)
    print(f"checkpoint {args.checkpoint}  draft model {draft_model}  device {args.device}  "
          f"{machine_line(info)}")
    code = f"{args.prompts.name} + " if args.code_prompts else ""
    print(f"prompts: {len(prompts)} ({code}{humaneval} HumanEval) x {args.max_new_tokens} new "
          f"tokens, batch 1; auto calibration "
          + ", ".join(f"{k} {v:.1f} s" for k, v in bench.auto_seconds.items()))
    print_table(rows, COLUMNS)
    degenerate = [name for name, figures in rows.items() if figures["repeated"] > 0.5]
    if degenerate:
        print(f"warning: degenerate output (over half the tokens repeat an earlier "
              f"{args.repeated_ngram}-gram) in {', '.join(degenerate)}: its speed-ups mean "
              f"little", file=sys.stderr)
    if args.plot:
        plot(rows, args.plot, f"{Path(args.checkpoint).parent.name}: {len(prompts)} code "
             f"prompts, {args.max_new_tokens} tokens, batch 1, {info['threads']} threads")
    print(json.dumps({"methods": rows, "checkpoint": str(args.checkpoint),
                      "draft_model": draft_model, "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens,
                      "auto_calibration_seconds": {k: round(v, 2) for k, v in
                                                   bench.auto_seconds.items()},
                      "degenerate": degenerate, "device": args.device, **info}))


if __name__ == "__main__":
    cli.main(main, __doc__ + "\nThe drafters and their options:\n" + options_help())
