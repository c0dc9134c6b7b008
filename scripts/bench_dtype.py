"""float32 against bfloat16 for decode steps of each width on a CPU: the measurement that
`dtype=auto` makes for one width (`mtp.generate.measure.choose_decode_dtype`), over many.

    python scripts/bench_dtype.py --checkpoint model.gguf --widths 1 2 4 8 16 --threads 2

A decode step is a cached forward of `width` new tokens per row after `--context` cached ones
(the trunk, head 0 and the unembedding: what a verify pass computes,
`plain_forward_seconds`), timed as the median of `--repeats` in each dtype; the bf16 copy is
the float32 weights rounded. On a CPU with bf16 arithmetic (AVX512-BF16, AMX) the wide steps
of speculative decoding gain more from bf16 than the one-token steps of autoregressive
decoding, which read half the bytes but multiply no faster. Rounds alternate the dtypes so a
change of load hits both. Prints a table, then one JSON line: {"widths": {"<w>": {"float32",
"bfloat16", "speedup"}}, "threads", "load", "cpu_flags", ...}.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch

from mtp.bench.machine import machine
from mtp.checkpoint import load
from mtp.generate.measure import plain_forward_seconds


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="anything mtp.load reads")
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=128, help="cached tokens before a step")
    parser.add_argument("--repeats", type=int, default=15, help="timed forwards per round")
    parser.add_argument("--rounds", type=int, default=3, help="the dtypes take turns")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.widths) < 1:
        raise SystemExit(f"error: --widths must be >= 1, got {args.widths}")
    fp32, _ = load(args.checkpoint, dtype=torch.float32)
    models = {"float32": fp32, "bfloat16": copy.deepcopy(fp32).to(torch.bfloat16)}
    seconds: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for width in args.widths:
                for name, model in models.items():
                    seconds.setdefault((width, name), []).append(plain_forward_seconds(
                        model, width, args.batch, args.context, args.repeats))
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
    return result


if __name__ == "__main__":
    main()
