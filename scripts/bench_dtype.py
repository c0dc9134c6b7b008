"""float32 against bfloat16 for decode steps of each width on a CPU: the measurement that
`dtype=auto` makes for one width (`mtp.generate.choices.DtypeVariants`), over many.

    python scripts/bench_dtype.py checkpoint=model.gguf widths=[1,2,4,8,16] threads=2

A decode step is a cached forward of `width` new tokens per row after `context` cached ones
(trunk, head 0, unembedding: a verify pass, `plain_forward_seconds`), the median of `repeats`
in each dtype; bf16 is the float32 weights rounded. With bf16 arithmetic (AVX512-BF16, AMX)
speculative decoding's wide steps gain more from bf16 than autoregressive one-token steps,
which read half the bytes but multiply no faster. Rounds alternate the dtypes. Prints a
table, then one JSON line.

Arguments are key=value (`mtp.cli`'s grammar):
  checkpoint       anything mtp.load reads (required)
  widths           [1,2,4,8,16] new tokens per row a step
  batch            1 row
  context          128 cached tokens before a step
  repeats          15 timed forwards per round
  rounds           3: the dtypes take turns
  threads          null: torch's
"""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import dataclass, field
from functools import partial

import torch
from omegaconf import MISSING

from mtp import cli
from mtp.bench.decoding import take_turns
from mtp.bench.machine import machine
from mtp.checkpoint import load
from mtp.generate.measure import plain_forward_seconds


@dataclass(frozen=True, kw_only=True)
class DtypeArgs:
    checkpoint: str = MISSING
    widths: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    batch: int = 1
    context: int = 128
    repeats: int = 15
    rounds: int = 3
    threads: int | None = None

    def __post_init__(self) -> None:
        if not self.widths or min(self.widths) < 1:
            raise ValueError(f"widths={self.widths} must be >= 1")
        cli.check_positives(self, "batch", "context", "repeats", "rounds")
        cli.check_positives(self, "threads", optional=True)


parse_args = partial(cli.parse, schema=DtypeArgs)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    fp32, _ = load(args.checkpoint, dtype=torch.float32)
    models = {"float32": fp32, "bfloat16": copy.deepcopy(fp32).to(torch.bfloat16)}
    with torch.inference_mode():
        seconds = take_turns({(width, name): partial(plain_forward_seconds, model, width,
                                                     args.batch, args.context, args.repeats)
                              for width in args.widths for name, model in models.items()},
                             args.rounds)
    widths = {}
    for width in args.widths:
        f32, bf16 = (statistics.median(seconds[width, name]) for name in models)
        widths[str(width)] = {"float32": round(f32 * 1e3, 3), "bfloat16": round(bf16 * 1e3, 3),
                              "speedup": round(f32 / bf16, 3)}
    info = machine("cpu")
    print(f"{args.checkpoint}  batch {args.batch}, {args.context} cached tokens, "
          f"{info['threads']} threads, load {' '.join(map(str, info['load']))}, flags "
          f"{' '.join(info['cpu_flags'])}")
    print(f"{'width':>5} {'float32 ms':>11} {'bfloat16 ms':>12} {'bf16 speed-up':>14} "
          f"{'fp32 ms/token':>14}")
    for width, row in widths.items():
        print(f"{width:>5} {row['float32']:>11.2f} {row['bfloat16']:>12.2f} "
              f"{row['speedup']:>13.2f}x {row['float32'] / int(width):>14.2f}")
    result = {"checkpoint": str(args.checkpoint), "batch": args.batch, "context": args.context,
              "widths": widths, **info}
    print(json.dumps(result))


if __name__ == "__main__":
    cli.main(main, __doc__)
