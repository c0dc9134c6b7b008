r"""Training throughput, step time and MFU of a model shape: n heads per loss mode vs n=1.

A step is what `MTPLitModule.training_step` runs: the loss with its backward, gradient
clipping and an AdamW step. Variants: n heads (`n_future`, default 8: the byte8 recipe) in
each loss mode (headwise, chunked, naive: the same gradients), n=1 on the same trunk (the
extra heads' cost), and n=1 compute-matched (the same blocks per token: what byte1 trains
against byte8); the step-time ratios compare n headwise with each n=1 variant. `vocab_size`
sets the vocabulary (default the byte tokenizer's 262; 32000 is the paper's BPE shape, where
the heads' unembeddings cost most), with random token ids. MFU is model FLOPs
(`mtp.train.flops`) per second over `peak_flops` (a number or a preset such as h100-bf16), by
default this device's measured matrix-product peak in the run's precision (the better of one
measurement before and one after the steps). On a CPU every variant's model lives at once and
the timed steps go round them, so load changes hit all alike; on a GPU they run one after the
other. Prints a table, then one JSON line.

    python scripts/bench_train.py                  # the byte8 shape, seq 256, batch 16
    python scripts/bench_train.py precision=bf16-mixed compile=true
    python scripts/bench_train.py steps=10 threads=2 model=tiny
    python scripts/bench_train.py device=cuda precision=bf16-mixed peak_flops=h100-bf16 \
        compile=true batch=8 seq_len=2048 vocab_size=32000 n_future=4 model=1b

Arguments are key=value (`mtp.cli`'s grammar), and the recipe's overrides (below):
  batch, seq_len   16 x 256 tokens a step
  steps            5 timed steps, after warmup (2)
  threads          null: torch's
  precision        32-true (default) or bf16-mixed (Lightning's names)
  compile          false: torch.compile every block with true
  device           cpu (default) or cuda
  n_future         8 heads of the n > 1 model
  vocab_size       null: the byte tokenizer's 262
  peak_flops       FLOPs/s per device or a preset (h100-bf16, a100-bf16, ...); null: measured
                   here (large matrix products, the run's dtype)
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from mtp import cli
from mtp.bench.decoding import take_turns
from mtp.bench.recipe import KEYS, split_overrides
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer
from mtp.train.flops import flops_per_token, measure_peak_flops, mfu, resolve_peak_flops
from mtp.train.lit import compile_blocks
from mtp.train.loss import autograd_backward, mtp_loss
from mtp.train.optim import build_optimizer
from mtp.train.run import compose, model_config
from mtp.train.settings import OptimSettings

PRECISIONS = ("32-true", "bf16-mixed")  # Lightning's names for what the trainer runs


@dataclass(frozen=True, kw_only=True)
class TrainArgs:
    batch: int = 16
    seq_len: int = 256
    steps: int = 5
    warmup: int = 2
    threads: int | None = None
    precision: str = "32-true"
    compile: bool = False
    device: str = "cpu"
    n_future: int = 8
    vocab_size: int | None = None
    peak_flops: int | float | str | None = None
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        cli.check_positive("n_future", self.n_future, 2, "at least 2: the comparison needs "
                           "the heads")
        cli.check_positives(self, "vocab_size", optional=True)
        cli.check_positive("steps", self.steps)
        cli.check_positive("warmup", self.warmup, least=0)
        cli.check_choice("precision", self.precision, PRECISIONS)
        cli.check_choice("device", self.device, ("cpu", "cuda"))


def parse_args(argv: list[str]) -> TrainArgs:
    """The script's keys; the recipe's overrides (`mtp.bench.recipe`) go in `overrides`."""
    own, recipe = split_overrides(argv)
    args = cli.parse(own, TrainArgs)
    return replace(args, overrides=[*args.overrides, *recipe])


def stepper(config: MTPConfig, mode: str, *, batch: int, seq_len: int, precision: str,
            compile: bool, device: str) -> Callable[[], float]:
    """A fresh model and optimizer; each call times one optimizer step on a fixed batch."""
    torch.manual_seed(0)
    model = MTPModel(config).to(device)
    if compile:
        compile_blocks(model)
    optimizer = build_optimizer(model, OptimSettings(lr=1e-3))
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + config.n_future),
                           device=device)
    autocast = (torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16-mixed"
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step() -> float:
        sync()
        start = time.perf_counter()
        with autocast:  # as Lightning's bf16-mixed: forward and backward under autocast
            mtp_loss(model, tokens, mode=mode, backward=autograd_backward)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - start

    return step


def seconds_per_step(makers: dict[str, Callable[[], Callable[[], float]]], *, steps: int,
                     warmup: int, interleave: bool) -> dict[str, float]:
    """Each variant's median step time after `warmup` steps (compilation included there).
    `interleave` (a CPU) keeps every model at once and goes round them, so load changes hit
    all alike; otherwise one after the other (a GPU holds one 1B model's optimizer state,
    not five)."""
    times: dict[str, list[float]] = {}
    groups = [makers] if interleave else [{name: make} for name, make in makers.items()]
    for group in groups:
        steppers = {name: make() for name, make in group.items()}
        for step in steppers.values():
            for _ in range(warmup):
                step()
        times.update(take_turns(steppers, steps))
        del steppers, step  # the next group's models are built without these
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.precision == "bf16-mixed" else torch.float32

    def measured_peak() -> float:
        return measure_peak_flops(dtype, device=args.device,
                                  size=4096 if args.device == "cuda" else 2048, seconds=2.0)

    peak_source = "measured" if args.peak_flops is None else str(args.peak_flops)
    peak = measured_peak() if args.peak_flops is None else \
        resolve_peak_flops(args.peak_flops, args.precision)

    def shape(n_future: int) -> MTPConfig:
        cfg = compose(["+experiment=byte8", "run_dir=unused", *args.overrides,
                       f"model.n_future={n_future}"])
        config = model_config(cfg, ByteTokenizer())
        return replace(config, vocab_size=args.vocab_size or config.vocab_size)

    multi = shape(args.n_future)
    variants = [(f"n={multi.n_future} {mode}", multi, mode)
                for mode in ("headwise", "chunked", "naive")]
    variants += [("n=1 same trunk", replace(multi, n_future=1), "headwise"),
                 ("n=1 compute-matched", shape(1), "headwise")]
    makers = {name: partial(stepper, config, mode, batch=args.batch, seq_len=args.seq_len,
                            precision=args.precision, compile=args.compile, device=args.device)
              for name, config, mode in variants}
    step_times = seconds_per_step(makers, steps=args.steps, warmup=args.warmup,
                                  interleave=args.device == "cpu")
    if peak_source == "measured":  # before and after the steps: the best the machine showed
        peak = max(peak, measured_peak())
    print(f"shape: dim {multi.dim}, trunk {multi.n_layers}, heads {multi.n_future}, vocab "
          f"{multi.vocab_size}; batch {args.batch} x seq {args.seq_len}; {args.device}, "
          f"{args.precision}"
          f"{', compiled' if args.compile else ''}; {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; peak {peak / 1e9:,.1f} GFLOP/s ({peak_source})")
    print(f"{'variant':<22} {'blocks':>6} {'tokens/s':>9} {'step ms':>8} {'MFU':>7}")
    results, mfus = {}, {}
    for name, config, _mode in variants:
        seconds = step_times[name]
        rate = args.batch * args.seq_len / seconds
        results[name] = round(rate, 1)
        mfus[name] = mfu(rate, flops_per_token(config, args.seq_len), peak)
        print(f"{name:<22} {config.n_blocks:>6} {rate:>9.0f} {seconds * 1e3:>8.1f} "
              f"{mfus[name]:>7.2%}")
    default = f"n={multi.n_future} headwise"
    same = step_times[default] / step_times["n=1 same trunk"]
    matched = step_times[default] / step_times["n=1 compute-matched"]
    print(f"step time n={multi.n_future} / n=1: {same:.3f}x same trunk, {matched:.3f}x "
          f"compute-matched; MFU ({default}) {mfus[default]:.2%}")
    summary = {"benchmark": "train_tokens_per_sec", "batch": args.batch,
               "seq_len": args.seq_len, "threads": torch.get_num_threads(),
               "results": results, "device": args.device, "precision": args.precision,
               "compile": args.compile, "peak_flops": peak, "peak_source": peak_source,
               "mfu": round(mfus[default], 5),
               "mfu_per_variant": {k: round(v, 5) for k, v in mfus.items()},
               "time_ratio_same_trunk": round(same, 4),
               "time_ratio_compute_matched": round(matched, 4),
               "n_future": multi.n_future, "vocab_size": multi.vocab_size}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS)
