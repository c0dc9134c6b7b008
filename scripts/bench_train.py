"""Training throughput (tokens/s) of the byte8 model shape: n=8 per loss mode vs n=1.

A step is what `MTPLitModule.training_step` runs: the loss with its backward, gradient
clipping and an AdamW step. Variants: n=8 in each loss mode (headwise, chunked, naive: the
same gradients), n=1 on the same trunk (4 blocks + 1 head: the cost of the extra heads), and
n=1 compute-matched (11 blocks + 1 head: what byte1 trains). Prints a table, then one JSON line.

    python scripts/bench_train.py                  # the byte8 shape, seq 256, batch 16
    python scripts/bench_train.py --steps 10 --threads 2 model=tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtp.loss import autograd_backward, mtp_loss  # noqa: E402
from mtp.model import MTPConfig, MTPModel  # noqa: E402
from mtp.optim import build_optimizer  # noqa: E402
from mtp.tokenizers import ByteTokenizer  # noqa: E402
from mtp.train import compose, model_config  # noqa: E402


def tokens_per_second(config: MTPConfig, mode: str, *, batch: int, seq_len: int, steps: int,
                      warmup: int) -> float:
    torch.manual_seed(0)
    model = MTPModel(config)
    optimizer = build_optimizer(model, lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (batch, seq_len + config.n_future))
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        mtp_loss(model, tokens, mode=mode, backward=autograd_backward)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return batch * seq_len * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    def shape(*overrides: str) -> MTPConfig:
        cfg = compose(["+experiment=byte8", "run_dir=unused", *args.overrides, *overrides])
        return model_config(cfg, ByteTokenizer())

    byte8 = shape()
    variants = [(f"n={byte8.n_future} {mode}", byte8, mode)
                for mode in ("headwise", "chunked", "naive")]
    variants += [("n=1 same trunk", replace(byte8, n_future=1), "headwise"),
                 ("n=1 compute-matched", shape("model.n_future=1"), "headwise")]
    print(f"byte8 shape: dim {byte8.dim}, trunk {byte8.n_layers}, heads {byte8.n_future}; "
          f"batch {args.batch} x seq {args.seq_len}; {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    print(f"{'variant':<22} {'blocks':>6} {'tokens/s':>9}")
    results = {}
    for name, config, mode in variants:
        rate = tokens_per_second(config, mode, batch=args.batch, seq_len=args.seq_len,
                                 steps=args.steps, warmup=args.warmup)
        results[name] = round(rate, 1)
        print(f"{name:<22} {config.n_blocks:>6} {rate:>9.0f}", flush=True)
    print(json.dumps({"benchmark": "train_tokens_per_sec", "batch": args.batch,
                      "seq_len": args.seq_len, "threads": torch.get_num_threads(),
                      "results": results}))


if __name__ == "__main__":
    main()
