r"""Training throughput, step time and MFU of a model shape: n heads per loss mode vs n=1.

A step is what `MTPLitModule.training_step` runs: the loss with its backward, gradient
clipping and an AdamW step. Variants: n heads (`--n-future`, default 8: the byte8 recipe) in
each loss mode (headwise, chunked, naive: the same gradients), n=1 on the same trunk (the
cost of the extra heads), and n=1 compute-matched (the same blocks per token: what byte1
trains against byte8). The step-time ratios compare n headwise (the default) with each n=1
variant. `--vocab-size` sets the vocabulary (default the byte tokenizer's 262; a BPE model's
32000 is the paper's shape, where the heads' unembeddings cost the most), with random token
ids. MFU is model FLOPs (`mtp.flops`) per second over the peak: `--peak-flops` (a number or
a preset such as h100-bf16), by default this device's measured matrix-product peak in the
run's precision. Prints a table, then one JSON line.

    python scripts/bench_train.py                  # the byte8 shape, seq 256, batch 16
    python scripts/bench_train.py --precision bf16-mixed --compile
    python scripts/bench_train.py --steps 10 --threads 2 model=tiny
    python scripts/bench_train.py --device cuda --precision bf16-mixed --peak-flops h100-bf16 \
        --compile --batch 8 --seq-len 2048 --vocab-size 32000 --n-future 4 model=1b
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from mtp.flops import flops_per_token, measure_peak_flops, mfu, resolve_peak_flops
from mtp.lit import compile_blocks
from mtp.loss import autograd_backward, mtp_loss
from mtp.model import MTPConfig, MTPModel
from mtp.optim import build_optimizer
from mtp.tokenizers import ByteTokenizer
from mtp.train import compose, model_config

PRECISIONS = ("32-true", "bf16-mixed")  # Lightning's names for what the trainer runs


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds_per_step(config: MTPConfig, mode: str, *, batch: int, seq_len: int, steps: int,
                     warmup: int, precision: str, compile: bool, device: str) -> float:
    """Median wall time of one optimizer step after `warmup` steps (compilation included)."""
    torch.manual_seed(0)
    model = MTPModel(config).to(device)
    if compile:
        compile_blocks(model)
    optimizer = build_optimizer(model, lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + config.n_future),
                           device=device)
    autocast = (torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16-mixed"
                else contextlib.nullcontext())
    times = []
    for step in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        with autocast:  # as Lightning's bf16-mixed: forward and backward under autocast
            mtp_loss(model, tokens, mode=mode, backward=autograd_backward)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true")
    parser.add_argument("--compile", action="store_true", help="torch.compile every block")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--n-future", type=int, default=8, help="heads of the n > 1 model")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary (default: the byte tokenizer's, 262)")
    parser.add_argument("--peak-flops", default=None,
                        help="FLOPs/s per device or a preset (h100-bf16, a100-bf16, ...); "
                             "default: measured here (large matrix products, run's dtype)")
    args = parser.parse_args(argv)
    if args.n_future < 2:
        raise ValueError(f"--n-future {args.n_future}: the comparison needs n >= 2 heads")
    if args.vocab_size is not None and args.vocab_size < 1:
        raise ValueError(f"--vocab-size {args.vocab_size} must be a positive integer")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"need --steps >= 1 and --warmup >= 0, got {args.steps}, "
                         f"{args.warmup}")
    dtype = torch.bfloat16 if args.precision == "bf16-mixed" else torch.float32
    if args.peak_flops is None:
        peak, peak_source = measure_peak_flops(
            dtype, device=args.device, size=4096 if args.device == "cuda" else 2048,
            seconds=2.0), "measured"
    else:
        value = args.peak_flops
        peak = resolve_peak_flops(float(value) if value[0].isdigit() else value,
                                  args.precision)
        peak_source = value

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
    print(f"shape: dim {multi.dim}, trunk {multi.n_layers}, heads {multi.n_future}, vocab "
          f"{multi.vocab_size}; batch {args.batch} x seq {args.seq_len}; {args.device}, "
          f"{args.precision}"
          f"{', compiled' if args.compile else ''}; {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; peak {peak / 1e9:,.1f} GFLOP/s ({peak_source})")
    print(f"{'variant':<22} {'blocks':>6} {'tokens/s':>9} {'step ms':>8} {'MFU':>7}")
    results, step_times, mfus = {}, {}, {}
    for name, config, mode in variants:
        seconds = seconds_per_step(config, mode, batch=args.batch, seq_len=args.seq_len,
                                   steps=args.steps, warmup=args.warmup,
                                   precision=args.precision, compile=args.compile,
                                   device=args.device)
        rate = args.batch * args.seq_len / seconds
        results[name], step_times[name] = round(rate, 1), seconds
        mfus[name] = mfu(rate, flops_per_token(config, args.seq_len), peak)
        print(f"{name:<22} {config.n_blocks:>6} {rate:>9.0f} {seconds * 1e3:>8.1f} "
              f"{mfus[name]:>7.2%}", flush=True)
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
    main()
