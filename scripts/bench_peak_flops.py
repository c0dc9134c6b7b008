"""This machine's matrix-product peak in float32 and bfloat16: the denominator of CPU MFU.

Times square `torch.mm` products (best of repeats over a few seconds per size, after a
warm-up) with torch's threads, as `mtp.train.flops.measure_peak_flops` does when a run sets
`trainer.peak_flops=cpu`. Prints a table, then one JSON line with the best figure per dtype.

    python scripts/bench_peak_flops.py
    python scripts/bench_peak_flops.py sizes=[1024,2048,4096] seconds=3 threads=2

Arguments are key=value (`mtp.cli`'s grammar):
  sizes            [1024,2048,4096]: the square products' sizes
  seconds          3 per dtype and size
  dtypes           [float32,bfloat16] (the one dtype grammar: float32, bfloat16, float16)
  threads          null: torch's
  device           cpu (default) or cuda
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial

import torch

from mtp import cli
from mtp.train.flops import measure_peak_flops


@dataclass(frozen=True, kw_only=True)
class PeakArgs:
    sizes: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    seconds: float = 3.0
    dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    threads: int | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"sizes={self.sizes} must be positive sizes")
        cli.check_number("seconds", self.seconds, lambda v: v > 0, "> 0")
        cli.check_choices("dtypes", self.dtypes, cli.DTYPES)
        cli.check_positives(self, "threads", optional=True)
        cli.check_choice("device", self.device, ("cpu", "cuda"))


parse_args = partial(cli.parse, schema=PeakArgs)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'dtype':<9} {'size':>5} {'GFLOP/s':>9}")
    best = {}
    for name in args.dtypes:
        for size in args.sizes:
            flops = measure_peak_flops(cli.parse_dtype(name), device=args.device, size=size,
                                       seconds=args.seconds)
            best[name] = max(best.get(name, 0.0), flops)
            print(f"{name:<9} {size:>5} {flops / 1e9:>9.1f}", flush=True)
    print(json.dumps({"benchmark": "peak_flops", "device": args.device,
                      "threads": torch.get_num_threads(),
                      "peak_flops": {k: round(v) for k, v in best.items()}}))


if __name__ == "__main__":
    cli.main(main, __doc__)
