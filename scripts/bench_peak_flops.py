"""This machine's matrix-product peak in float32 and bfloat16: the denominator of CPU MFU.

Times square `torch.mm` products (best of repeats over a few seconds per size, after a
warm-up) with torch's threads, as `mtp.train.flops.measure_peak_flops` does when a run sets
`trainer.peak_flops=cpu`. Prints a table, then one JSON line with the best figure per dtype.

    python scripts/bench_peak_flops.py
    python scripts/bench_peak_flops.py --sizes 1024 2048 4096 --seconds 3 --threads 2
"""

from __future__ import annotations

import argparse
import json

import torch

from mtp.train.flops import measure_peak_flops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--seconds", type=float, default=3.0, help="per dtype and size")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{args.device}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'dtype':<9} {'size':>5} {'GFLOP/s':>9}")
    best = {}
    for name, dtype in DTYPES.items():
        for size in args.sizes:
            flops = measure_peak_flops(dtype, device=args.device, size=size,
                                       seconds=args.seconds)
            best[name] = max(best.get(name, 0.0), flops)
            print(f"{name:<9} {size:>5} {flops / 1e9:>9.1f}", flush=True)
    print(json.dumps({"benchmark": "peak_flops", "device": args.device,
                      "threads": torch.get_num_threads(),
                      "peak_flops": {k: round(v) for k, v in best.items()}}))


if __name__ == "__main__":
    main()
