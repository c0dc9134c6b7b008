"""The paper's small-model "better" experiments in one command: induction and polynomial
arithmetic, n in {1, 2, 4} heads at equal compute, over a size ladder and several seeds.

Gloeckle et al. 2024 (arXiv 2404.19737) section 4.1 (induction, Fig. 7) and 4.2 (arithmetic
in F7[X]/(X^5), Fig. 8). Every run is `mtp.train` on `data=induction` or `data=polynomial`,
byte tokenizer, `model=tiny`'s compute-matched shape (`model.depth` blocks per token whatever
n), checkpointed every `eval_every` steps; each checkpoint is scored on the task's fixed test
set (`mtp.eval.synthetic`) for the learning curves, the final model on a larger one. Runs are
separate processes (one torch thread each, `jobs` at a time); a finished run in `out` is reused.

    python scripts/paper_small.py budget=cpu out=runs/paper_small      # ~1 h on 2 cores
    python scripts/paper_small.py budget=gpu out=runs/paper_small_gpu  # the paper's sizes

Writes OUT/paper_small.json and, in `figures`, paper_small_induction.png (Fig. 7),
paper_small_polynomial.png (Fig. 8) and paper_small_curves.png (accuracy against step).
Prints a table, then one JSON line: {"benchmark", "budget", "machine", "ladder", "runs", ...}.

Arguments are key=value (`mtp.cli`'s grammar):
  budget           cpu (default), paper_cpu (the paper's 1M and 3M induction models, 5
                   seeds), gpu or smoke (seconds: the tests'): the ladder
  sizes            null: every size of the ladder; [1M]: those of its sizes
  out              runs/paper_small of the checkout
  figures          where the figures go (null: out)
  tasks            null: the ladder's tasks; [induction]: those of them
  jobs             runs at a time (null: 2 on a CPU, 1 on a GPU; 0: one at a time in this
                   process, no start-up per run)
  device           null: cuda for budget=gpu, else cpu
  run              (internal) the spec file of the one run a child process trains
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtp import cli
from mtp.bench import study, tables
from mtp.bench.study import spread
from mtp.paths import REPO_ROOT, write_json

# (name, width, blocks per token, attention heads); the paper's sizes are in the gpu ladder.
LADDERS: dict[str, dict[str, Any]] = {
    "cpu": {
        "seeds": [0, 1, 2],
        "induction": {"sizes": [("60k", 32, 4, 4), ("250k", 64, 4, 4)],
                      "n": [1, 2], "steps": 1500, "batch": 16, "seq_len": 256, "lr": 1e-2,
                      "warmup": 60, "eval_every": 150, "curve_size": 100, "final_size": 500,
                      "documents": 100_000, "max_time": "00:00:12:00"},
        "polynomial": {"sizes": [("80k", 32, 5, 4), ("300k", 64, 5, 4)],
                       "n": [1, 2, 4], "steps": 450, "batch": 32, "seq_len": 128, "lr": 1e-2,
                       "warmup": 40, "eval_every": 75, "curve_size": 20, "final_size": 200,
                       "documents": 200_000, "max_time": "00:00:04:00"},
    },
    # The paper's two smallest induction models (1M, 3M) in about a CPU hour for one size:
    # 5 seeds, n = 2 both compute-matched (the paper's design) and with its head on top.
    "paper_cpu": {
        "seeds": [0, 1, 2, 3, 4],
        "induction": {"sizes": [("1M", 128, 5, 4), ("3M", 256, 4, 8)],
                      "n": [1, 2], "added": [2], "steps": 800, "batch": 16, "seq_len": 256,
                      "lr": 5e-3, "warmup": 60, "eval_every": 100, "curve_size": 100,
                      "final_size": 500, "documents": 100_000, "max_time": "00:00:14:00"},
    },
    "gpu": {  # the paper's shapes (appendix J, K): width, layers, attention heads
        "seeds": [0, 1, 2],
        "induction": {"sizes": [("1M", 128, 5, 4), ("3M", 256, 4, 8), ("10M", 384, 6, 8),
                                ("30M", 512, 10, 8)],
                      "n": [1, 2], "steps": 20_000, "batch": 64, "seq_len": 512, "lr": 1e-3,
                      "warmup": 500, "eval_every": 1000, "curve_size": 500, "final_size": 1000,
                      "documents": 2_000_000},
        "polynomial": {"sizes": [("30M", 512, 10, 8), ("100M", 768, 14, 12)],
                       "n": [1, 2, 4], "steps": 20_000, "batch": 128, "seq_len": 256,
                       "lr": 1e-3, "warmup": 500, "eval_every": 1000, "curve_size": 200,
                       "final_size": 2000, "documents": 5_000_000},
    },
    "smoke": {  # seconds: the tests' sweep
        "seeds": [0],
        "induction": {"sizes": [("a", 16, 2, 2), ("b", 32, 2, 4)], "n": [1, 2], "added": [2],
                      "steps": 4, "batch": 2, "seq_len": 64, "lr": 3e-3, "warmup": 1,
                      "eval_every": 2, "curve_size": 4, "final_size": 4, "documents": 200},
        "polynomial": {"sizes": [("a", 16, 5, 2), ("b", 32, 5, 4)], "n": [1, 4], "steps": 4,
                       "batch": 2, "seq_len": 64, "lr": 3e-3, "warmup": 1, "eval_every": 2,
                       "curve_size": 2, "final_size": 2, "documents": 200},
    },
}
TASKS = ("induction", "polynomial")
HEADLINE = {"induction": "accuracy_repeated", "polynomial": "accuracy"}
MS = tuple(range(1, 11))


@dataclass(frozen=True, kw_only=True)
class PaperArgs:
    budget: str = "cpu"
    out: Path = REPO_ROOT / "runs" / "paper_small"
    figures: Path | None = None
    tasks: list[str] | None = None
    sizes: list[str] | None = None
    jobs: int | None = None
    device: str | None = None
    run: Path | None = None

    def __post_init__(self) -> None:
        cli.check_choice("budget", self.budget, LADDERS)
        unknown = [t for t in self.tasks or [] if t not in TASKS]
        if unknown:
            raise ValueError(f"tasks: unknown task {unknown[0]!r}; expected one of {TASKS}")
        ladder = LADDERS[self.budget]
        known = {s[0] for task in TASKS for s in ladder.get(task, {}).get("sizes", [])}
        if self.sizes is not None and (not self.sizes or not set(self.sizes) <= known):
            wrong = next((s for s in self.sizes if s not in known), "none")
            raise ValueError(f"sizes: {wrong!r} is not a size of budget={self.budget} "
                             f"({', '.join(sorted(known))})")
        cli.check_positives(self, "jobs", least=0, optional=True)
        cli.check_choice("device", self.device, (None, "cpu", "cuda"))


def parse_args(argv: list[str]) -> PaperArgs:
    return cli.parse(argv, PaperArgs)


def variant(n: int, added: bool = False) -> str:
    """A run's heads: "n=2" compute-matched (its heads' blocks come off the trunk), "n=2 added"
    (head 0 keeps the full depth, the other heads come on top)."""
    return f"n={n}" + (" added" if added else "")


def overrides(task: str, ladder: dict[str, Any], size: tuple, n: int, seed: int,
              run_dir: Path, device: str, added: bool = False) -> list[str]:
    """The `python -m mtp.train` overrides of one run."""
    name, dim, depth, heads = size
    return [
        f"data={task}", "tokenizer=byte", "model=tiny", f"model.dim={dim}",
        f"model.depth={depth}", f"model.n_heads={heads}", f"model.n_future={n}",
        f"model.heads={'added' if added else 'matched'}",
        f"seq_len={ladder['seq_len']}", f"data.batch_size={ladder['batch']}",
        f"data.source.documents={ladder['documents']}", f"seed={seed}",
        f"trainer.max_steps={ladder['steps']}",
        f"trainer.max_time={ladder.get('max_time') or 'null'}",  # a guard: the ladder's budget
        f"trainer.val_check_interval={ladder['steps']}", "trainer.limit_val_batches=4",
        "trainer.enable_progress_bar=false", "trainer.peak_flops=null", "logger=none",
        f"optim.lr={ladder['lr']}", f"optim.warmup_steps={ladder['warmup']}",
        "decode.enabled=false", f"checkpoint.every_n_steps={ladder['eval_every']}",
        "checkpoint.keep=-1", f"run_dir={run_dir}",
        *(["trainer=gpu", "data.num_workers=2"] if device == "cuda" else ["threads=1"]),
    ]


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one run and score its checkpoints (inside the run's own process)."""
    import torch

    from mtp.checkpoint import load
    from mtp.eval.synthetic import score
    from mtp.train.run import compose, train

    run_dir = Path(spec["run_dir"])
    began = time.perf_counter()
    export = train(compose(spec["overrides"]))
    trained = time.perf_counter() - began
    kwargs = {"ms": MS} if spec["task"] == "polynomial" else {}

    def scored(path: Path, size: int) -> dict[str, Any]:
        model, tokenizer = load(path, device=spec["device"])
        return score(spec["task"], model, tokenizer, size=size, batch_size=64, **kwargs)[0]

    curve = [{"step": int(path.stem[4:]), **scored(path, spec["curve_size"])}
             for path in sorted((run_dir / "checkpoints").glob("step*.ckpt"))]
    final = scored(export, spec["final_size"])
    summary = json.loads((run_dir / "summary.json").read_text())
    for path in (run_dir / "checkpoints").glob("*.ckpt"):
        path.unlink()  # optimizer state of every checkpoint: the scores are what is kept
    result = {**{k: spec[k] for k in ("task", "size", "n", "added", "seed", "dim", "depth",
                                       "heads")},
              "parameters": summary["parameters"], "steps": summary["steps"],
              "stopped_early": summary["stopped_early"],
              "tokens": summary["steps"] * spec["tokens_per_step"],
              "train_seconds": round(trained, 1),
              "eval_seconds": round(time.perf_counter() - began - trained, 1),
              "threads": torch.get_num_threads(), "final": final, "curve": curve}
    write_json(run_dir / "result.json", result)
    return result


def plan(budget: str, out: Path, device: str, tasks: tuple[str, ...],
         sizes: list[str] | None = None) -> list[dict[str, Any]]:
    """Every run of the ladder, largest first (so the last to finish are short), each seed's
    runs together (so a ladder stopped part-way has whole seeds)."""
    ladder, specs = LADDERS[budget], []
    for task in tasks:
        config = ladder.get(task)
        if config is None:
            raise ValueError(f"tasks: budget={budget} has no {task} ladder "
                             f"(it has {', '.join(t for t in TASKS if t in ladder)})")
        heads = [(n, False) for n in config["n"]] + [(n, True) for n in config.get("added", [])]
        chosen = [size for size in config["sizes"] if sizes is None or size[0] in sizes]
        for size, seed, (n, added) in itertools.product(chosen, ladder["seeds"], heads):
            run_dir = out / task / size[0] / (f"n{n}" + ("added" if added else "")) / f"seed{seed}"
            specs.append({
                "task": task, "size": size[0], "n": n, "added": added, "seed": seed,
                "key": f"{task}/{size[0]}/{variant(n, added)}/seed{seed}",
                "dim": size[1], "depth": size[2], "heads": size[3], "run_dir": str(run_dir),
                "device": device, "curve_size": config["curve_size"],
                "final_size": config["final_size"],
                "tokens_per_step": config["batch"] * config["seq_len"],
                "overrides": overrides(task, config, size, n, seed, run_dir, device, added)})
    return sorted(specs, key=lambda s: -s["dim"] ** 2 * s["depth"] * s["tokens_per_step"])


def check_plan(specs: list[dict[str, Any]]) -> dict[str, Any]:
    """Every run's config composes, its model and its data module build (the source's own
    checks, the tokenizer spells its task): one-line errors, before any training. Each task's
    data module (its specs share data), to tokenise once before runs in parallel race to."""
    from hydra.utils import instantiate

    from mtp.tokenizers import ByteTokenizer
    from mtp.train.run import check_settings, compose, model_config

    data = {}
    for spec in specs:
        cfg = compose(spec["overrides"])
        check_settings(cfg)
        with study.one_line():
            model_config(cfg, ByteTokenizer())  # the compute-matched shape exists (depth >= n)
            data[spec["task"]] = instantiate(cfg.data, tokenizer=ByteTokenizer(),
                                             seq_len=cfg.seq_len, n_future=1)
    return data


def launch(spec: dict[str, Any], in_process: bool) -> dict[str, Any]:
    """Train and score `spec` in this process or its own; its result."""
    if in_process:
        return run_one(spec)
    path = write_json(Path(spec["run_dir"]) / "spec.json", spec)
    study.python([__file__, f"run={path}"], path.parent)
    return json.loads((path.parent / "result.json").read_text())


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p > 0.5): bisection on its CDF, the density integrated by
    Simpson's rule (no scipy in the stack)."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, steps: int = 2000) -> float:
        h = x / steps
        f = [scale * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(steps + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    low, high = 0.0, 1000.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < p else (low, mid)
    return (low + high) / 2


def paired_gap(base: list[float], other: list[float], level: float = 0.9) -> dict[str, Any]:
    """other - base per seed (the same seed trains both on the same data): mean, spread and the
    t interval at `level` over seeds."""
    gaps = [b - a for a, b in zip(base, other)]
    cell = spread(gaps)
    if len(gaps) > 1:
        half = t_quantile((1 + level) / 2, len(gaps) - 1) * cell["std"] / math.sqrt(len(gaps))
        cell[f"interval{round(level * 100)}"] = [cell["mean"] - half, cell["mean"] + half]
    return cell


def _variant_of(result: dict[str, Any]) -> tuple[int, bool]:
    return result["n"], result.get("added", False)  # runs from before added heads: matched


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and spread over seeds per (task, size, heads); the induction gaps to n = 1 at the
    smallest size, per seed, with their 90% interval."""
    out: dict[str, Any] = {}
    for task in TASKS:
        mine = [r for r in results if r["task"] == task]
        if not mine:
            continue
        table: dict[str, Any] = {}
        sizes = dict.fromkeys(r["size"] for r in sorted(mine, key=lambda r: r["parameters"]))
        for size, heads in itertools.product(sizes, sorted({_variant_of(r) for r in mine})):
            runs = sorted((r for r in mine if r["size"] == size and _variant_of(r) == heads),
                          key=lambda r: r["seed"])
            if not runs:
                continue
            cell = {"parameters": runs[0]["parameters"], "steps": [r["steps"] for r in runs],
                    "val_loss_head0": spread([r["val"]["loss_head"][0] if r["val"]
                                              else math.nan for r in runs]),
                    HEADLINE[task]: spread([r["final"][HEADLINE[task]] for r in runs])}
            if task == "induction":
                cell["accuracy_first"] = spread([r["final"]["accuracy_first"] for r in runs])
            else:
                cell["accuracy_m"] = {m: spread([r["final"][f"accuracy_m{m}"] for r in runs])
                                      for m in MS}
            table.setdefault(size, {})[variant(*heads)] = cell
        out[task] = table
    if "induction" in out:
        smallest = next(iter(out["induction"]))
        cells = out["induction"][smallest]
        if "n=1" in cells and len(cells) > 1:
            base = cells["n=1"]["accuracy_repeated"]["seeds"]
            out["induction_gap_smallest"] = {"size": smallest, **{
                f"{key} - n=1": paired_gap(base, cell["accuracy_repeated"]["seeds"])
                for key, cell in cells.items() if key != "n=1"}}
    return out


COLOUR = {"n=1": "tab:blue", "n=2": "tab:orange", "n=4": "tab:green", "n=2 added": "tab:red"}


def plot_induction(summary: dict[str, Any], path: Path, title: str) -> Path:
    """Fig. 7: accuracy on repeated names' second token against parameters, n = 1 and 2."""
    fig, (ax,) = study.panels(1, 5.5, 4)
    table = summary.get("induction", {})
    for key in dict.fromkeys(k for cells in table.values() for k in cells):
        # x: n = 1's parameters, so the variants of a size share a column (added heads
        # have more parameters, not more depth for head 0)
        points = [(cells["n=1"]["parameters"] if "n=1" in cells else cells[key]["parameters"],
                   cells[key]) for cells in table.values() if key in cells]
        ax.plot([x for x, _ in points], [c["accuracy_repeated"]["mean"] for _, c in points],
                "o-", color=COLOUR.get(key), label=f"{key} (mean)")
        for x, c in points:
            seeds = c["accuracy_repeated"]["seeds"]
            ax.scatter([x] * len(seeds), seeds, color=COLOUR.get(key), alpha=0.35, s=14)
        ax.plot([x for x, _ in points], [c["accuracy_first"]["mean"] for _, c in points], "x--",
                color=COLOUR.get(key), alpha=0.6, label=f"{key}, first occurrences (control)")
    ax.set_xscale("log")
    study.label(ax, "parameters", "accuracy, 2nd token of repeated names", f"induction ({title})")
    return study.save(fig, path)


def plot_polynomial(summary: dict[str, Any], path: Path, title: str) -> Path:
    """Fig. 8: exact match against m for each n, at the two largest sizes, seeds as dots."""
    table = summary.get("polynomial", {})
    sizes = list(table)[-2:]
    fig, axes = study.panels(len(sizes), 5.5, 4)
    for ax, size in zip(axes, sizes):
        for i, (key, cell) in enumerate(table[size].items()):
            ax.plot(MS, [cell["accuracy_m"][m]["mean"] for m in MS], "o-", color=COLOUR.get(key),
                    label=f"{key} (mean)")
            for m in MS:
                seeds = cell["accuracy_m"][m]["seeds"]
                ax.scatter([m + (i - 1) * 0.08] * len(seeds), seeds, color=COLOUR.get(key),
                           alpha=0.35, s=12)
        ax.axvspan(5.5, 10.5, color="grey", alpha=0.08)
        ax.set_xticks(MS)
        study.label(ax, "operations m (shaded: out of domain)", "exact match",
                    f"F7[X]/(X^5), {size} ({title})")
    return study.save(fig, path)


def plot_curves(results: list[dict[str, Any]], path: Path) -> Path:
    """Each task's accuracy against step at its smallest size, every run."""
    present = [t for t in TASKS if any(r["task"] == t for r in results)]
    fig, axes = study.panels(len(present), 5.5, 4)
    for ax, task in zip(axes, present):
        mine = [r for r in results if r["task"] == task]
        size = min(mine, key=lambda r: r["parameters"])["size"]  # the smallest: n matters most
        first_seed = min(r["seed"] for r in mine)
        for r in (r for r in mine if r["size"] == size):
            key = variant(*_variant_of(r))
            ax.plot([p["step"] for p in r["curve"]], [p[HEADLINE[task]] for p in r["curve"]],
                    color=COLOUR.get(key), alpha=0.7,
                    label=key if r["seed"] == first_seed else None)
        study.label(ax, "optimizer step", HEADLINE[task],
                    f"{task}, {size}: learning curves, every seed")
    return study.save(fig, path)


def plot(results: list[dict[str, Any]], summary: dict[str, Any], figures: Path,
         title: str) -> list[Path]:
    """The paper's two figures, and the learning curves."""
    return [plot_induction(summary, figures / "paper_small_induction.png", title),
            plot_polynomial(summary, figures / "paper_small_polynomial.png", title),
            plot_curves(results, figures / "paper_small_curves.png")]


def main(argv: list[str]) -> dict[str, Any]:
    args = parse_args(argv)
    if args.run:
        return run_one(json.loads(args.run.read_text()))
    device = args.device or ("cuda" if args.budget == "gpu" else "cpu")
    jobs = (1 if device == "cuda" else 2) if args.jobs is None else args.jobs
    out = args.out.resolve()
    tasks = args.tasks or [t for t in TASKS if t in LADDERS[args.budget]]
    specs = plan(args.budget, out, device, tuple(tasks), args.sizes)
    data = check_plan(specs)  # a ValueError in one line, before any training
    os.environ.setdefault("MTP_DATA_DIR", str(out / "data"))
    runs, measured = study.run(specs, launch, jobs, out, [d.prepare_data for d in data.values()])
    for spec, result in zip(specs, runs.values()):  # the trainer's val figures, per head
        result["val"] = json.loads((Path(spec["run_dir"]) / "summary.json").read_text())["val"]
    results = list(runs.values())
    measured["machine"]["threads_per_run"] = 1 if device == "cpu" else None
    summary = summarize(results)
    title = f"budget={args.budget}, {len(LADDERS[args.budget]['seeds'])} seeds"
    figures = plot(results, summary, args.figures or out, title)
    report = {"benchmark": "paper_small", "budget": args.budget, "device": device,
              "jobs": jobs, **measured, "ladder": LADDERS[args.budget], "summary": summary,
              "figures": [str(p) for p in figures], "runs": runs}
    return tables.publish(report, tables.paper_small, out / "paper_small.json")


if __name__ == "__main__":
    cli.main(main, __doc__)
