"""Decoding speed: autoregressive vs self-speculative, every k, and candidate trees, in one process.

    python scripts/bench_decode.py                        # newest byte8 export in outputs/train
    python scripts/bench_decode.py checkpoint=outputs/train/.../export max_new_tokens=256
    python scripts/bench_decode.py random_model=true      # untrained: measures overhead only
    python scripts/bench_decode.py checkpoint=DIR ks=[5,8] trees=[tree16,tree32,auto:16] \
        humaneval=40 plot=docs/tree_decode.png            # the chain against trees
    python scripts/bench_decode.py device=cuda dtype=bfloat16 compile=true   # captured steps

Each prompt (data/prompts/code.jsonl, plus the first `humaneval` HumanEval prompts) is
decoded alone (batch 1, greedy). After a warm-up, every repeat runs autoregressive decoding
(k = 1), each k, then each tree; figures are medians over repeats. `compile=true` times the
compiled decode step after an untimed pass that compiles every shape; `compile=both`
alternates eager and compiled steps and adds the eager tokens/s and `compile_speedup`.
Prints a table, then one JSON line: the best k's figures, `per_k` and `per_tree` lists, the
best tree's (`tree_*`: most tokens per forward). `identical`: every greedy speculative output
equalled the autoregressive one of the same step. `forward_cost`: a speculative step's time
over an autoregressive step's (speedup = tok/fwd / cost); `plain_cost`: a plain cached forward
over as many tokens against one over a single token (the width's arithmetic alone, the rest
of `forward_cost` being the engine's overhead). `repeated`: the share of output tokens inside
an 8-gram the same output already produced.

Arguments are key=value (`mtp.cli`'s grammar); how it decodes (device, dtype, threads) is
below.
  checkpoint       an export dir or .ckpt (null: the newest byte8 export under
                   ./outputs/train); or random_model=true: an untrained byte8-shaped model
  prompts          data/prompts/code.jsonl; humaneval: also the first N HumanEval prompts (0)
  max_new_tokens   128
  ks               the heads' k (null: 2..n_future)
  trees            [] candidate trees for the heads: tree8 ... tree64, auto:N (needs the
                   checkpoint's calibration), .json files of rank paths
  plot             write a plot of the trees and chains here (null: none)
  repeats          3
  batch_size       1 prompt decoded at a time
  compile          false, true (the compiled step: CUDA graphs on a GPU) or both (alternating)
  unstacked_heads  false; true runs the heads one by one (engine.STACK_HEADS): what stacking buys
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtp import cli
from mtp.bench.decoding import KEYS, Decoding, saved_context
from mtp.bench.prompts import CODE_PROMPTS, humaneval_prompts
from mtp.bench.study import panels, save
from mtp.decode import engine
from mtp.decode.drafters.registry import DrafterSpec
from mtp.decode.output import repetition
from mtp.generate.measure import Timed, plain_forward_seconds, step_width, time_generate
from mtp.generate.prompts import read_prompts
from mtp.generate.session import open_decoder
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

MODES = {False: [False], True: [True], "both": [False, True]}  # compile=: the steps timed


@dataclass(frozen=True, kw_only=True)
class DecodeBenchArgs(Decoding):
    checkpoint: Path | None = None
    random_model: bool = False
    prompts: Path = CODE_PROMPTS
    humaneval: int = 0
    max_new_tokens: int = 128
    ks: list[int] | None = None
    trees: list[str] = field(default_factory=list)
    plot: Path | None = None
    repeats: int = 3
    batch_size: int = 1
    compile: bool | str = False
    unstacked_heads: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoint is not None and self.random_model:
            raise ValueError("give checkpoint=... or random_model=true, not both")
        cli.check_choice("compile", self.compile, MODES)
        cli.check_positives(self, "max_new_tokens", "repeats", "batch_size")
        cli.check_positive("humaneval", self.humaneval, least=0)
        if self.ks is not None and (not self.ks or min(self.ks) < 2):
            raise ValueError(f"ks={self.ks}: each k must be >= 2 (k=1 is autoregressive, "
                             f"always measured)")


def parse_args(argv: list[str]) -> DecodeBenchArgs:
    return cli.parse(argv, DecodeBenchArgs)


def newest_byte8_export(root: Path) -> Path:
    """The newest export of `python -m mtp.train +experiment=byte8` under `root`."""
    for config in sorted(root.glob("*/export/config.json"), key=lambda p: p.stat().st_mtime,
                         reverse=True):
        meta = json.loads(config.read_text())
        if meta["model"]["n_future"] == 8 and meta["tokenizer"]["name"] == "byte":
            return config.parent
    raise FileNotFoundError(f"no byte8 export under {root}: run `python -m mtp.train "
                            f"+experiment=byte8` first, or give checkpoint=... or "
                            f"random_model=true")


def random_model(device: str, dtype: torch.dtype | None) -> tuple[MTPModel, ByteTokenizer]:
    """The byte8 shape (conf/model/small.yaml, 8 heads), untrained; the same every run."""
    torch.manual_seed(0)
    config = MTPConfig.compute_matched(depth=12, n_future=8, vocab_size=262, dim=256,
                                       n_heads=8, max_seq_len=1024)
    return MTPModel(config).to(device=device, dtype=dtype).eval(), ByteTokenizer()


def plot(rows: list[dict], chain_rows: list[dict], path: Path, title: str) -> None:
    fig, axes = panels(2, 5, 4)
    series = {"chain (k nodes)": chain_rows}
    for row in rows:
        series.setdefault("auto:N trees" if row["tree"].startswith("auto:") else "fixed trees",
                          []).append(row)
    for name, points in series.items():
        points = sorted(points, key=lambda r: r["nodes"])
        for axis, key in zip(axes, ("tokens_per_forward", "speedup")):
            axis.plot([r["nodes"] for r in points], [r[key] for r in points], "o-", label=name)
    for axis, label in zip(axes, ("tokens per forward", "speed-up over autoregressive")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens verified per forward pass")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    save(fig, path)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    engine.STACK_HEADS = not args.unstacked_heads
    prompts = read_prompts(args.prompts) + humaneval_prompts(args.humaneval)
    settings = args.settings()
    loaded = random_model(args.device, settings.load_dtype) if args.random_model else None
    path = None if loaded else (args.checkpoint or newest_byte8_export(Path("outputs/train")))
    decoder = open_decoder(path, settings, loaded=loaded, prompts=prompts[:1],
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    checkpoint = path or "random"
    model, tokenizer = decoder.model, decoder.tokenizer
    ks = args.ks or list(range(2, model.config.n_future + 1))
    context = saved_context(path)
    specs = {k: DrafterSpec("heads", k=k) for k in ks}
    specs |= {tree: DrafterSpec("heads", tree=tree) for tree in args.trees}
    drafters = {1: None} | {name: spec.build(model, context) for name, spec in specs.items()}
    dtype_name = cli.dtype_name(next(model.parameters()).dtype)

    compiled = args.compile is not False  # the step the main figures come from
    modes = MODES[args.compile]

    def run(drafter, mode: bool, texts: list[str] = prompts,
            tokens: int = args.max_new_tokens) -> Timed:
        return time_generate(model, tokenizer, texts, max_new_tokens=tokens,
                             batch_size=args.batch_size, drafter=drafter, compile=mode)

    for drafter in drafters.values():  # warm-up: allocator, kernels, caches; compiled shapes
        for mode in modes:  # the compiled step meets every shape it will be timed on
            run(drafter, mode, prompts if mode else prompts[:1],
                args.max_new_tokens if mode else 16)
    speed = {(name, mode): [] for name in drafters for mode in modes}
    # Each step (eager, compiled) is checked against its own autoregressive output: in bfloat16
    # the compiled step's fused kernels round differently from the eager step's, and greedy
    # picks between near-tied logits follow the rounding, not the speculation.
    stats, identical, ar_ids = {}, {}, {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, drafter in drafters.items():
                for mode in modes:
                    timed = run(drafter, mode)
                    stats[name], ids = timed.stats, timed.token_ids
                    speed[name, mode].append(timed.tokens_per_second)
                    ar_ids.setdefault(mode, ids)  # autoregressive decoding runs first
                    identical[name] = identical.get(name, True) and ids == ar_ids[mode]

    def rate(name, mode: bool = compiled) -> float:  # the median over repeats
        return statistics.median(speed[name, mode])

    widths = {name: step_width(drafter) for name, drafter in drafters.items()}
    seconds = {width: plain_forward_seconds(model, width, args.batch_size)
               for width in sorted(set(widths.values()))}
    ar = rate(1)

    def row(name) -> dict:
        both = {} if len(modes) == 1 else {
            "eager_tokens_per_second": round(rate(name, False), 1),
            "compile_speedup": round(rate(name, True) / rate(name, False), 3)}
        tokens_per_forward = stats[name].tokens_per_forward
        return {"tokens_per_second": round(rate(name), 1),
                "speedup": round(rate(name) / ar, 3),
                "tokens_per_forward": round(tokens_per_forward, 3),
                # seconds per forward over autoregressive's
                "forward_cost": round(ar / stats[1].tokens_per_forward * tokens_per_forward
                                      / rate(name), 3),
                "plain_cost": round(seconds[widths[name]] / seconds[1], 3),
                "nodes_per_forward": round(stats[name].nodes_per_forward, 2),
                "head_acceptance": [round(a, 3) for a in stats[name].head_acceptance],
                "accepted_depths": stats[name].accepted_depths,
                "identical": identical[name]} | both

    rows = [{"k": k, "nodes": k} | row(k) for k in [1, *ks]]
    tree_rows = [{"tree": tree, "nodes": widths[tree], "depth": drafters[tree].tree.depth}
                 | row(tree) for tree in dict.fromkeys(args.trees)]
    repeated = round(repetition(ar_ids[compiled], 8), 3)
    print(f"checkpoint {checkpoint}  device {args.device} {dtype_name}  "
          f"{'compiled' if compiled else 'eager'}{' (and eager)' if len(modes) > 1 else ''}"
          f"{'' if engine.STACK_HEADS else ' (heads unstacked)'}  "
          f"threads {torch.get_num_threads()}  batch {args.batch_size}  prompts {len(prompts)} x "
          f"{args.max_new_tokens} new tokens  repeats {args.repeats}  "
          f"repeated (tokens inside an earlier 8-gram) {repeated:.1%}")
    eager = " eager tok/s compiled/eager" if len(modes) > 1 else ""
    print(f"{'decoding':>14} {'nodes':>5} {'tokens/s':>9} {'speedup':>8} {'tok/fwd':>8} "
          f"{'fwd cost':>8} {'plain':>6} {'identical':>9}{eager}  head acceptance")
    for r in rows + tree_rows:
        name = f"k={r['k']}" if "k" in r else r["tree"]
        heads = " ".join(f"{a:.2f}" for a in r["head_acceptance"])
        versus = (f" {r['eager_tokens_per_second']:>11.1f} {r['compile_speedup']:>13.2f}x"
                  if len(modes) > 1 else "")
        print(f"{name:>14} {r['nodes']:>5} {r['tokens_per_second']:>9.1f} {r['speedup']:>7.2f}x "
              f"{r['tokens_per_forward']:>8.2f} {r['forward_cost']:>7.2f}x "
              f"{r['plain_cost']:>5.2f}x {str(r['identical']):>9}{versus}  {heads}")
    best = max(rows[1:], key=lambda r: r["speedup"])
    summary = {
        "tokens_per_second_ar": round(ar, 1), "tokens_per_second_spec": best["tokens_per_second"],
        "speedup": best["speedup"], "k": best["k"], "tokens_per_forward":
        best["tokens_per_forward"], "identical": all(identical.values()),
        "chain_tokens_per_forward": rows[-1]["tokens_per_forward"],
        "repeated": repeated}
    if tree_rows:
        top = max(tree_rows, key=lambda r: r["tokens_per_forward"])
        fastest = max(tree_rows, key=lambda r: r["speedup"])
        summary |= {"tree_tokens_per_forward": top["tokens_per_forward"],
                    "tree_nodes": top["nodes"], "tree_speedup": top["speedup"],
                    "tree_identical": all(r["identical"] for r in tree_rows),
                    "tree": top["tree"], "fastest_tree": fastest["tree"],
                    "fastest_tree_speedup": fastest["speedup"]}
    if args.plot and tree_rows:
        name = Path(path).parent.name if path else checkpoint  # the run's
        plot(tree_rows, rows[1:], args.plot, f"{name}: {len(prompts)} prompts x "
             f"{args.max_new_tokens} bytes, greedy, batch 1, {args.device}, "
             f"{torch.get_num_threads()} threads")
    print(json.dumps(summary | {
        "checkpoint": str(checkpoint), "device": args.device, "dtype": dtype_name,
        "compiled": compiled, "stacked_heads": engine.STACK_HEADS,
        "device_name": torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda") else "cpu",
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
        "batch_size": args.batch_size, "per_k": rows,
        "per_tree": tree_rows}))


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS)
