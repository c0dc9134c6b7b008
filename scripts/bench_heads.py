"""Parallel heads against sequential modules: one trunk, one training budget, n = 4 and n = 8.

For each n of `n_future` and each head type (`block`: the paper's parallel heads on the trunk
output; `sequential`: DeepSeek-V3's chained modules) it trains the byte8 recipe's shape
(`+experiment=byte8`) for `steps` steps (one value, or one per n) with the repo's trainer, then
measures per run: the heads' last `val/acc_head{i}` (a sequential module is teacher-forced);
tokens per forward and `repeated` (the share inside an earlier 16-byte n-gram) on the first
`humaneval` HumanEval prompts with every head's chain and with `tree`, greedy and at T = 0.8
(a briefly trained model's greedy output loops); one training step's peak memory
(`scripts/bench_memory.py`'s measurement, in a fresh process) and its time (best of
`time_steps`), float32, on a fresh model (cost_only=true: those alone, no training).

Runs that exist in `out` are reused. Speed figures belong under the machine's lock, training
does not: train and measure first, then time alone under the lock:

    python scripts/bench_heads.py out=runs/heads time=false
    flock "$LOCK" nice -n -5 python scripts/bench_heads.py out=runs/heads cost_only=true

Prints a table, writes `plot`, and ends with one JSON line: {"runs": {"<type> n=<n>": {...}},
"tree", ...}.

Arguments are key=value (`mtp.cli`'s grammar), and the recipe's overrides (below), e.g.
model=tiny for a smaller shape:
  out              the runs and results.json (required)
  n_future         [4,8]
  steps            [150] training steps: one for every n, or one per n_future
  warmup           20 warm-up steps of the training
  humaneval        24 HumanEval prompts decoded, max_new_tokens (128) each; tree: tree16
  batch, seq_len   16 x 256: the step memory's and time's batch
  time_steps       3 timed optimizer steps; time=false: no step times
  cost_only        false: only the step memory and time with true (no training)
  threads          2
  plot             docs/bench_heads_byte.png of the checkout
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from omegaconf import MISSING

from mtp import cli
from mtp.bench.decoding import child_json
from mtp.bench.machine import machine
from mtp.bench.prompts import humaneval_prompts
from mtp.bench.recipe import KEYS, split_overrides
from mtp.bench.shape import Shape
from mtp.bench.study import panels, save
from mtp.checkpoint import load
from mtp.decode.output import repeated_share
from mtp.generate import DrafterSpec, SamplingConfig
from mtp.generate.measure import time_generate
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer
from mtp.train.loss import autograd_backward, mtp_loss
from mtp.train.optim import build_optimizer
from mtp.train.run import compose, model_config
from mtp.train.settings import OptimSettings

REPO = Path(__file__).resolve().parents[1]
HEAD_TYPES = ("block", "sequential")


@dataclass(frozen=True, kw_only=True)
class HeadsArgs:
    out: Path = MISSING
    batch: int = 16  # the byte8 recipe's batch and sequence length
    seq_len: int = 256
    n_future: list[int] = field(default_factory=lambda: [4, 8])
    steps: list[int] = field(default_factory=lambda: [150])
    warmup: int = 20
    humaneval: int = 24
    max_new_tokens: int = 128
    tree: str = "tree16"
    time_steps: int = 3
    threads: int = 2
    time: bool = True
    cost_only: bool = False
    plot: Path = REPO / "docs" / "bench_heads_byte.png"
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.steps) not in (1, len(self.n_future)):
            raise ValueError(f"steps={self.steps}: one value for every n, or one per n_future "
                             f"({len(self.n_future)})")
        if not self.n_future or min(self.n_future) < 2:
            raise ValueError(f"n_future={self.n_future}: each n must be >= 2")


def parse_args(argv: list[str]) -> HeadsArgs:
    """The script's keys, and the recipe's overrides (`mtp.bench.recipe`) in `overrides`."""
    own, recipe = split_overrides(argv)
    args = cli.parse(own, HeadsArgs)
    return replace(args, overrides=[*args.overrides, *recipe])


def run_name(head_type: str, n_future: int) -> str:
    return f"{head_type} n={n_future}"


def train(out: Path, head_type: str, n_future: int, steps: int, warmup: int,
          overrides: list[str]) -> Path:
    """Train one run with `python -m mtp.train` unless its export exists; its directory."""
    run = out / f"{head_type}{n_future}"
    if (run / "export" / "config.json").is_file():
        return run
    command = [sys.executable, "-m", "mtp.train", "+experiment=byte8",
               f"model.n_future={n_future}", f"model.head_type={head_type}",
               f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
               "trainer.max_time=null", f"optim.warmup_steps={warmup}", "logger=none",
               "trainer.enable_progress_bar=false", f"hydra.run.dir={run}", *overrides]
    print(f"training {run_name(head_type, n_future)}: {' '.join(command[1:])}", flush=True)
    began = time.perf_counter()
    subprocess.run(command, check=True, cwd=REPO)
    (run / "train_seconds.txt").write_text(f"{time.perf_counter() - began:.0f}\n")
    return run


def trained_figures(run: Path, n_future: int) -> dict:
    """From the run's metrics history: its last logged step (a reused run may predate
    `steps`) and each head's last validation accuracy."""
    with open(run / "plots" / "metrics.csv") as f:
        history = list(csv.DictReader(f))
    last = {i: float(row[f"val/acc_head{i}"]) for row in history for i in range(n_future)
            if row.get(f"val/acc_head{i}")}
    return {"steps": max(int(row["step"]) for row in history),
            "val_acc": [last[i] for i in range(n_future)]}


def tokens_per_forward(run: Path, prompts: list[str], tree: str,
                       max_new_tokens: int) -> dict[str, float]:
    """Tokens per forward with the chain of every head and with `tree`, greedy and sampled
    (T = 0.8, seeded), and how repetitive each decoding's output is."""
    model, tokenizer = load(run / "export")
    room = model.config.max_seq_len - max_new_tokens - 1
    prompts = [p for p in prompts if len(tokenizer.encode(p)) < room]
    result = {"prompts": len(prompts)}
    for suffix, sampling in (("", SamplingConfig()), ("_t08", SamplingConfig(temperature=0.8))):
        for name, spec in (("chain", DrafterSpec(drafter="heads")),
                           ("tree", DrafterSpec(drafter="heads", tree=tree))):
            timed = time_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                  batch_size=len(prompts), drafter=spec.build(model),
                                  sampling=sampling, seed=0)
            result[f"tokens_per_forward_{name}{suffix}"] = timed.stats.tokens_per_forward
            result[f"repeated_{name}{suffix}"] = sum(
                repeated_share(ids, 16) for ids in timed.token_ids) / len(timed.token_ids)
    return result


def recipe_config(head_type: str, n_future: int, overrides: list[str]) -> MTPConfig:
    """The model `python -m mtp.train +experiment=byte8` trains at this n and head type."""
    cfg = compose(["+experiment=byte8", f"model.n_future={n_future}",
                   f"model.head_type={head_type}", *overrides])
    return model_config(cfg, ByteTokenizer())


def step_bytes(c: MTPConfig, batch: int, seq_len: int) -> int:
    """One training step's memory (bench_memory.py's measurement, in a fresh process)."""
    variant = "sequential" if c.head_type == "sequential" else "headwise"
    shape = Shape(vocab_size=c.vocab_size, dim=c.dim, n_layers=c.n_layers, n_heads=c.n_heads,
                  n_future=c.n_future, batch=batch, seq_len=seq_len)
    return child_json([sys.executable, str(REPO / "scripts" / "bench_memory.py"),
                       *shape.arguments(), "threads=2", f"variant={variant}"],
                      f"bench_memory.py variant={variant}")["step_bytes"]


def step_seconds(config: MTPConfig, repeats: int, batch: int, seq_len: int) -> float:
    """One optimizer step of the model at the recipe's batch: best of `repeats`."""
    torch.manual_seed(0)
    model = MTPModel(config).train()
    optimizer = build_optimizer(model, OptimSettings(lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95),
                                                     eps=1e-8))
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len + model.config.n_future))

    def step() -> float:
        began = time.perf_counter()
        mtp_loss(model, tokens, backward=autograd_backward)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - began

    step()  # warm-up
    return min(step() for _ in range(repeats))


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    fig, (left, right) = panels(2, 5.5, 4)
    colors = {4: "#37a", 8: "#c63"}
    for r in runs.values():
        style = "-" if r["head_type"] == "block" else "--"
        left.plot(range(1, r["n_future"] + 1), r["val_acc"], style, marker="o",
                  color=colors.get(r["n_future"], "#555"),
                  label=f"{'parallel' if r['head_type'] == 'block' else 'sequential'}, "
                        f"n = {r['n_future']}")
    left.set_xlabel("bytes ahead (head i predicts byte t + i + 1; a sequential module reads "
                    "the true bytes up to t + i)", fontsize=8)
    left.xaxis.get_major_locator().set_params(integer=True)
    left.set_ylabel("validation accuracy (teacher-forced)")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    names = list(runs)
    bars = (("tokens_per_forward_chain_t08", "chain, T = 0.8", "#37a"),
            ("tokens_per_forward_tree_t08", "tree, T = 0.8", "#8a5"),
            ("tokens_per_forward_chain", "chain, greedy (loops)", "#bcd"),
            ("tokens_per_forward_tree", "tree, greedy (loops)", "#cdb"))
    width = 0.2
    for j, (key, label, color) in enumerate(bars):
        xs = [i + (j - 1.5) * width for i in range(len(names))]
        values = [runs[n][key] for n in names]
        right.bar(xs, values, width=width, label=label, color=color)
        for x, value in zip(xs, values):
            right.text(x, value, f"{value:.2f}", ha="center", va="bottom", fontsize=6)
    right.set_xticks(range(len(names)), [n.replace("block", "parallel") for n in names],
                     fontsize=8)
    right.set_ylabel("tokens per forward (HumanEval prompts)")
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    save(fig, path)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    steps = dict(zip(args.n_future, args.steps * len(args.n_future) if len(args.steps) == 1
                     else args.steps))
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    runs = results.setdefault("runs", {})
    prompts = humaneval_prompts(args.humaneval)
    for n in args.n_future:
        for head_type in HEAD_TYPES:
            name = run_name(head_type, n)
            row = runs.setdefault(name, {"head_type": head_type, "n_future": n})
            config = recipe_config(head_type, n, args.overrides)
            if not args.cost_only:
                run = train(args.out, head_type, n, steps[n], args.warmup, args.overrides)
                row.update(**trained_figures(run, n),
                           **tokens_per_forward(run, prompts, args.tree, args.max_new_tokens))
            row["step_bytes"] = step_bytes(config, args.batch, args.seq_len)
            if args.time:
                row["step_seconds"] = step_seconds(config, args.time_steps, args.batch,
                                                   args.seq_len)
            results_file.write_text(json.dumps(results, indent=1) + "\n")
    results.update(tree=args.tree, humaneval=args.humaneval,
                   max_new_tokens=args.max_new_tokens, batch=args.batch, seq_len=args.seq_len,
                   machine=machine())
    results_file.write_text(json.dumps(results, indent=1) + "\n")

    print(f"byte8 shape, parallel and sequential trained alike at each n; decoding "
          f"{args.humaneval} HumanEval prompts x {args.max_new_tokens} bytes; tokens per "
          f"forward (repeated share)")
    print(f"{'run':<16}{'steps':>6}  {'head accuracies (val)':<50}{'chain T=0.8':>14}"
          f"{'tree T=0.8':>14}{'chain greedy':>14}{'tree greedy':>14}{'step MiB':>10}{'step s':>8}")
    for name, r in runs.items():
        if "val_acc" in r:
            accs = " ".join(f"{a:.3f}" for a in r["val_acc"])
            cells = "".join(f"{r['tokens_per_forward_' + k]:>8.2f} ({r['repeated_' + k]:.2f})"
                            for k in ("chain_t08", "tree_t08", "chain", "tree"))
            trained = f"{r['steps']:>6}  {accs:<50}{cells}"
        else:  # cost_only=true
            trained = f"{'-':>6}  {'not trained':<50}{'':>56}"
        seconds = r.get("step_seconds")
        print(f"{name:<16}{trained}{r['step_bytes'] / 2**20:>10.0f}"
              f"{'' if seconds is None else f'{seconds:.2f}':>8}")
    trained = {name: r for name, r in runs.items() if "val_acc" in r}
    if trained:
        budgets = ", ".join(sorted({f"n = {r['n_future']}: {r['steps']} steps"
                                    for r in trained.values()}))
        plot(trained, args.plot, f"parallel heads vs sequential modules, byte8 shape, the same "
                                 f"trunk and budget at each n ({budgets}; {args.tree} for the "
                                 f"tree)")
    print(json.dumps(results))


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS)
