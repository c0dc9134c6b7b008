"""`python scripts/better_study.py`: which multi-token recipe is at least as good as next-token
training and drafts well, measured on the default corpus at bytes, in one command.

Every recipe of RECIPES (docs/better.md) trains for each seed under each regime, as
`python -m mtp.train` processes (`jobs` at a time, each with the machine's cores):
- `time`: equal wall-clock: the same `trainer.max_time` and a step ceiling never reached, so the
  schedules end by the clock; a heads-only finish (+experiment=heads_finish) takes its share.
- `flops`: equal FLOPs: byte1's FLOPs per token (`mtp.train.flops`) times its steps is every
  recipe's budget, over the recipe's own FLOPs per token (a finish's steps counted as such).
A schedule's steps (`loss.schedule_steps`) keep their share of the run. Each run's summary.json
gives head 0's validation loss and accuracy, every head's accuracy and the greedy decoding of
held-out HumanEval prompts; its step time is the median of its logged `train/tokens_per_sec`.
A run whose summary.json exists in `out` is reused.

  recipes   which of RECIPES (default all): byte1 byte8 added light light4 stepped anneal
            ramp ahead
  seeds     [0,1,2]
  regimes   [time,flops]
  size      cpu: the CPU recipe (model=small, 16 x 256 bytes, 14 minutes or byte1's 400 steps
            a run, 16 prompts); short: 5 minutes or 150 steps, 8 prompts; tiny: model=tiny,
            seconds a run (the smoke test)
  out       runs/better_study: runs, better_study.json
  figures   where better_study.png goes (default: out)
  jobs      1: runs at a time; 0: in this process (no start-up per run: tests)
  threads   torch threads per run (null: the cores this process may use)
  corpus    null: the default corpus (data=stdlib); a path or glob: data=local on it
  extra     more overrides for every run, e.g. extra=['trainer.precision=32-true']

Prints a table (mean +- standard deviation over seeds per regime and recipe, and whether the
recipe meets the targets of docs/better.md against byte1 and byte8 of the same regime) and
ends with one JSON line, the report that better_study.json holds.

    python scripts/better_study.py                                  # ~13 h on 2 cores
    python scripts/better_study.py size=short regimes=[time]        # ~3 h
    python scripts/better_study.py size=tiny seeds=[0] recipes=[byte1,byte8,anneal]  # ~1 min
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mtp import cli
from mtp.bench import study, tables
from mtp.bench.machine import commit
from mtp.paths import REPO_ROOT

REGIMES = ("time", "flops")
KS = (2, 4, 8)  # the chain lengths reported


@dataclass(frozen=True)
class Recipe:
    """An experiment preset, overrides on it, and whether a heads-only finish follows."""

    experiment: str
    overrides: tuple[str, ...] = ()
    finish: bool = False
    about: str = ""


RECIPES: dict[str, Recipe] = {
    "byte1": Recipe("byte1", about="next-byte prediction, 12 blocks"),
    "byte8": Recipe("byte8", about="today's default: 8 block heads off a 12-block depth"),
    "added": Recipe("byte8_added", about="8 block heads on top of byte1's 12 blocks"),
    "light": Recipe("byte8_light", about="7 resblock heads on top, DeepSeek's 0.3 / 7 each"),
    "light4": Recipe("byte8_light", ("model.n_future=4",),
                     about="3 resblock heads on top, 0.3 / 3 each"),
    "stepped": Recipe("byte8_stepped", about="light, 0.3 then 0.1 from 68% (DeepSeek-V3)"),
    "anneal": Recipe("byte8_anneal", finish=True,
                     about="resblock heads 1 -> 0, farthest first; heads-only finish"),
    "ramp": Recipe("byte8_ramp", about="resblock heads 0 -> 1, nearest first"),
    "ahead": Recipe("byte1_ahead", finish=True,
                    about="head 0 on t+1..t+3 annealed to t+1 (modded-nanogpt); finish adds heads"),
}


@dataclass(frozen=True)
class Size:
    """A study's scale: the run shape, each regime's budget, the finish's and the decoding's."""

    overrides: tuple[str, ...]
    seconds: int  # the time regime's budget per recipe (a finish's share included)
    flops_steps: int  # the flops regime: byte1's steps
    finish_steps: int
    finish_seconds: int  # of `seconds`, in the time regime
    ceiling: int  # the time regime's trainer.max_steps


SIZES: dict[str, Size] = {
    # No periodic checkpoints: a study reuses finished runs only, and writing them would
    # spend the runs' time budget.
    "cpu": Size(("decode.prompts=16", "checkpoint.every_n_steps=100000"), seconds=840,
                flops_steps=400, finish_steps=100, finish_seconds=120, ceiling=100_000),
    "short": Size(("decode.prompts=8", "checkpoint.every_n_steps=100000"), seconds=300,
                  flops_steps=150, finish_steps=40, finish_seconds=45, ceiling=100_000),
    "tiny": Size(("model=tiny", "seq_len=32", "data.batch_size=2", "data.val_fraction=0.3",
                  "trainer.limit_val_batches=2", "trainer.val_check_interval=4",
                  "optim.warmup_steps=1", "trainer.log_every_n_steps=1", "decode.prompts=1",
                  "decode.max_new_tokens=8", "decode.trees=[tree8]",
                  "checkpoint.every_n_steps=1000"),
                 seconds=600, flops_steps=4, finish_steps=2, finish_seconds=300, ceiling=4),
}


@dataclass(frozen=True, kw_only=True)
class StudyArgs:
    """The command line (module docstring)."""

    recipes: list[str] = field(default_factory=lambda: list(RECIPES))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    regimes: list[str] = field(default_factory=lambda: list(REGIMES))
    size: str = "cpu"
    out: str = "runs/better_study"
    figures: str | None = None
    jobs: int = 1
    threads: int | None = None
    corpus: str | None = None
    extra: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key, values, known in (("recipes", self.recipes, RECIPES),
                                   ("regimes", self.regimes, REGIMES)):
            if not values:
                raise ValueError(f"{key}=[] names none of {', '.join(known)}")
            cli.check_choices(key, values, known)
        cli.check_choice("size", self.size, SIZES)
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={self.seeds} must be distinct, at least one")
        cli.check_positives(self, "jobs", least=0)
        cli.check_positives(self, "threads", optional=True)


# -- planning ----------------------------------------------------------------------------------

def _compose(overrides: list[str]) -> Any:
    from mtp.train.run import compose

    return compose([*overrides, "run_dir=/unused"])


def _model(cfg: Any) -> Any:
    from mtp.tokenizers import ByteTokenizer
    from mtp.train.run import model_config

    with study.one_line():
        return model_config(cfg, ByteTokenizer())


def _rescaled(cfg: Any, max_steps: int) -> list[str]:
    """The preset's schedule steps at the same share of a run of `max_steps`."""
    steps = cfg.loss.schedule_steps
    if steps is None or cfg.loss.schedule == "constant":
        return []
    scaled = [round(s * max_steps / cfg.trainer.max_steps) for s in steps]
    return [f"loss.schedule_steps=[{','.join(map(str, scaled))}]"]


def _hms(seconds: int) -> str:
    return f"00:{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _base(args: StudyArgs, seed: int) -> list[str]:
    """Overrides of every run of the study: the size, the corpus, quiet, the seed."""
    corpus = ["data=local", f"data.source.paths=[{args.corpus}]"] if args.corpus else []
    threads = args.threads or len(os.sched_getaffinity(0))
    return [*SIZES[args.size].overrides, *corpus, "logger=none",
            "trainer.enable_progress_bar=false", f"threads={threads}", f"seed={seed}",
            *args.extra]


def plan(args: StudyArgs, out: Path) -> list[dict[str, Any]]:
    """Every (regime, recipe, seed): its runs' overrides (a finish's after its first run's),
    each checked as `python -m mtp.train` would check it, before any training."""
    from mtp.train.flops import flops_per_token
    from mtp.train.run import check_settings

    size, specs = SIZES[args.size], []
    for regime, name, seed in itertools.product(args.regimes, args.recipes, args.seeds):
        recipe = RECIPES[name]
        base = [*_base(args, seed), *recipe.overrides]
        first = [f"+experiment={recipe.experiment}", *base]
        cfg = _compose(first)
        config = _model(cfg)
        fpt = flops_per_token(config, cfg.seq_len)
        run_dir = out / regime / name / f"seed{seed}"
        finish, finish_fpt = None, 0.0
        if recipe.finish:  # the first run's model, its heads as the finish grows them
            finish = ["+experiment=heads_finish", *base, f"init_from={run_dir / 'export'}"]
            grown = _compose(finish[:-1]).model
            finish_fpt = flops_per_token(replace(
                config, n_future=grown.n_future, head_type=grown.head_type),
                cfg.seq_len, trains_base=False)
            first.append("decode.enabled=false")  # the finish's export decodes
        if regime == "time":
            steps = size.ceiling
            limit = _hms(size.seconds - (size.finish_seconds if finish else 0))
            finish_limits = [f"trainer.max_steps={size.ceiling}",
                             f"trainer.max_time={_hms(size.finish_seconds)}"]
        else:  # byte1's FLOPs, less the finish's (finish_fpt is 0 without one)
            byte1 = _model(_compose(["+experiment=byte1", *_base(args, seed)]))
            budget = (size.flops_steps * flops_per_token(byte1, cfg.seq_len)
                      - size.finish_steps * finish_fpt)
            steps, limit = max(1, math.floor(budget / fpt)), "null"
            finish_limits = [f"trainer.max_steps={size.finish_steps}", "trainer.max_time=null"]
        first += [f"trainer.max_steps={steps}", f"trainer.max_time={limit}",
                  *_rescaled(cfg, steps)]
        check_settings(_compose(first))
        if finish:
            finish += finish_limits
            check_settings(_compose(finish))
        specs.append({"regime": regime, "recipe": name, "seed": seed, "run_dir": str(run_dir),
                      "key": f"{regime}/{name}/seed{seed}",
                      "overrides": first, "finish": finish,
                      "tokens_per_step": cfg.data.batch_size * cfg.seq_len,
                      "flops_per_token": fpt, "finish_flops_per_token": finish_fpt})
    return specs


# -- running -----------------------------------------------------------------------------------

def train_run(overrides: list[str], run_dir: Path, in_process: bool) -> float:
    """One `python -m mtp.train` run into `run_dir` (reused when its summary exists); the
    seconds it took (0 when reused)."""
    if (run_dir / "summary.json").is_file():  # a study stopped after this run: go on
        return 0.0
    began = time.perf_counter()
    if in_process:
        from mtp.train.run import compose, train

        train(compose([*overrides, f"run_dir={run_dir}"]))
    else:
        study.python(["-m", "mtp.train", *overrides, f"hydra.run.dir={run_dir}"], run_dir)
    return time.perf_counter() - began


def step_seconds(run_dir: Path, tokens_per_step: int) -> float | None:
    """The median step time of a run, from its logged train/tokens_per_sec (the first logged
    steps, which pay for allocation and the thread choice, left out)."""
    from mtp.train.plots import read_metrics_csv

    path = run_dir / "plots" / "metrics.csv"
    rates = [rate for _, rate in read_metrics_csv(path).get("train/tokens_per_sec", [])]
    rates = rates[2:] or rates
    return tokens_per_step / statistics.median(rates) if rates else None


def launch(spec: dict[str, Any], in_process: bool) -> dict[str, Any]:
    """Train a spec's runs, the first, then its finish; its result."""
    run_dir = Path(spec["run_dir"])
    seconds = train_run(spec["overrides"], run_dir, in_process)
    first = json.loads((run_dir / "summary.json").read_text())
    final, finish_steps = first, None
    if spec["finish"]:
        seconds += train_run(spec["finish"], run_dir / "finish", in_process)
        final = json.loads((run_dir / "finish" / "summary.json").read_text())
        finish_steps = final["steps"]
    for summary, where in ((first, run_dir), (final, run_dir / "finish")):
        if summary["val"] is None:
            raise ValueError(f"{where} has no validation figures: its corpus is too small "
                             f"for data.val_fraction (extra=['data.val_fraction=0.3'])")
    decode = final["decode"] or {}
    per_k = decode.get("tokens_per_forward", {"1": 1.0})
    # no drafts (one head): a token per forward; a chain longer than the heads: none
    undrafted = 1.0 if len(final["val"]["acc_head"]) == 1 else None
    return {
        "regime": spec["regime"], "recipe": spec["recipe"], "seed": spec["seed"],
        "steps": first["steps"], "max_steps": first["max_steps"], "finish_steps": finish_steps,
        "stopped_early": first["stopped_early"], "parameters": final["parameters"],
        "flops_per_token": spec["flops_per_token"],
        "flops": spec["tokens_per_step"] * (first["steps"] * spec["flops_per_token"] + (
            finish_steps or 0) * spec["finish_flops_per_token"]),
        "val_loss_head0": first["val"]["loss_head"][0],
        "val_acc_head0": first["val"]["acc_head"][0],
        "acc_head": final["val"]["acc_head"],
        "tokens_per_forward": {str(k): per_k.get(str(k), undrafted) for k in KS},
        "tree": decode.get("tree"),
        "tree_tokens_per_forward": decode.get("tree_tokens_per_forward") or undrafted,
        "decode_prompts": decode.get("prompts"),
        # the share of decoded text that repeats an earlier 8-gram: drafts of repeated text
        # are easy, so tokens per forward is read beside it
        "repeated": decode.get("repeated"),
        "step_seconds": step_seconds(run_dir, spec["tokens_per_step"]),
        "seconds": round(seconds, 1),
    }


# -- the summary -------------------------------------------------------------------------------

def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per regime and recipe: spreads over seeds, the step time against byte1's, and the
    targets (docs/better.md) against byte1 and byte8 of the same regime."""
    out: dict[str, Any] = {}
    for regime in REGIMES:
        table = {}
        for name in RECIPES:
            runs = sorted((r for r in results if r["regime"] == regime and r["recipe"] == name),
                          key=lambda r: r["seed"])
            if not runs:
                continue
            table[name] = {
                "steps": [r["steps"] for r in runs], "parameters": runs[0]["parameters"],
                "acc_head": [statistics.fmean(h) for h in zip(*[r["acc_head"] for r in runs])],
                **{key: study.spread([r.get(key) for r in runs]) for key in (
                    "val_acc_head0", "val_loss_head0", "tree_tokens_per_forward", "repeated",
                    "step_seconds")},
                **{f"tokens_per_forward_k{k}": study.spread(
                    [r["tokens_per_forward"][str(k)] for r in runs]) for k in KS}}
        byte1 = table.get("byte1")
        for cell in table.values():
            cell["step_ratio"] = _ratio(cell["step_seconds"], byte1 and byte1["step_seconds"])
            cell["targets"] = _targets(cell, byte1, table.get("byte8"))
        if table:
            out[regime] = table
    return out


def _mean(figure: dict[str, Any] | None) -> float | None:
    return None if figure is None else figure["mean"]


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    return None if a is None or b is None else a["mean"] / b["mean"]


def _targets(cell: dict[str, Any], byte1: dict[str, Any] | None,
             byte8: dict[str, Any] | None) -> dict[str, bool | None]:
    """docs/better.md's targets: next-byte accuracy within 0.005 of byte1's, 90% of byte8's
    tokens per forward at k = 4, a step at most 1.10x byte1's (None: not measured)."""
    acc, k4 = _mean(cell["val_acc_head0"]), _mean(cell["tokens_per_forward_k4"])
    acc1 = byte1 and _mean(byte1["val_acc_head0"])
    k4_8 = byte8 and _mean(byte8["tokens_per_forward_k4"])
    met = {"accuracy": None if acc is None or acc1 is None else acc >= acc1 - 0.005,
           "drafting": None if k4 is None or k4_8 is None else k4 >= 0.9 * k4_8,
           "step": None if cell["step_ratio"] is None else cell["step_ratio"] <= 1.10}
    met["all"] = all(met.values()) if None not in met.values() else None
    return met


def plot(results: list[dict[str, Any]], summary: dict[str, Any], path: Path,
         title: str) -> Path:
    """Next-byte accuracy against tokens per forward at k = 4, one point per recipe and
    seed, a regime per panel; the targets as lines."""
    from matplotlib import colormaps

    regimes = list(summary) or ["time"]
    fig, axes = study.panels(len(regimes), 6.5, 4.8)
    colours = colormaps["tab10"]
    for ax, regime in zip(axes, regimes):
        table = summary.get(regime, {})
        for index, name in enumerate(RECIPES):
            runs = [r for r in results if r["regime"] == regime and r["recipe"] == name
                    and r["tokens_per_forward"]["4"] is not None]
            if not runs:
                continue
            xs = [r["tokens_per_forward"]["4"] for r in runs]
            ys = [r["val_acc_head0"] for r in runs]
            ax.scatter(xs, ys, color=colours(index), alpha=0.45, s=18)
            ax.scatter([statistics.fmean(xs)], [statistics.fmean(ys)], color=colours(index),
                       marker="D", s=46, edgecolor="black", label=name)
        if "byte1" in table:
            ax.axhline(table["byte1"]["val_acc_head0"]["mean"] - 0.005, color="grey", ls="--",
                       lw=1, label="byte1's accuracy - 0.005")
        if "byte8" in table and table["byte8"]["tokens_per_forward_k4"]:
            ax.axvline(0.9 * table["byte8"]["tokens_per_forward_k4"]["mean"], color="grey",
                       ls=":", lw=1, label="90% of byte8's tokens per forward")
        study.label(ax, "tokens per forward, heads k = 4 (greedy, held-out HumanEval)",
                    "next-byte validation accuracy (head 0)",
                    f"equal {'wall-clock' if regime == 'time' else 'FLOPs'} ({title})",
                    fontsize="small", ncol=2)
    return study.save(fig, path)


# -- the command -------------------------------------------------------------------------------

def parse_args(argv: list[str]) -> StudyArgs:
    return cli.parse(argv, StudyArgs)


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    specs = plan(args, out)  # every run checked: one-line errors before any training
    runs, measured = study.run(specs, launch, args.jobs, out)
    results = list(runs.values())
    summary = summarize(results)
    size = SIZES[args.size]
    title = f"size={args.size}, {len(args.seeds)} seed(s)"
    figure = plot(results, summary, Path(args.figures or out) / "better_study.png", title)
    report = {"benchmark": "better_study", "size": args.size, "commit": commit(REPO_ROOT),
              "jobs": args.jobs, **measured,
              "budget": {"time_seconds": size.seconds, "flops_steps_of_byte1": size.flops_steps,
                         "finish_steps": size.finish_steps,
                         "finish_seconds": size.finish_seconds},
              "recipes": {name: asdict(RECIPES[name]) for name in args.recipes},
              "summary": summary, "figure": str(figure), "runs": runs}
    return tables.publish(report, tables.better_study, out / "better_study.json")


if __name__ == "__main__":
    cli.main(main, __doc__)
