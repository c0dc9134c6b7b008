"""Decoding speed: autoregressive vs blockwise self-speculative, for every k, in one process.

    python scripts/bench_decode.py                        # newest byte8 export in outputs/train
    python scripts/bench_decode.py --checkpoint outputs/train/.../export --max-new-tokens 256
    python scripts/bench_decode.py --random-model         # untrained: measures overhead only

Each prompt of data/prompts/code.jsonl is decoded alone (batch 1, greedy), as in the paper's
latency measurements. After a warm-up, every repeat runs autoregressive decoding (k = 1) and
speculative decoding with each k, alternating, so slow drifts of the machine hit all alike;
figures are medians over repeats of tokens per second over all prompts. Prints a table, then
one JSON line: the best k's figures and a per-k list. `distinct_4grams` (distinct / total
4-grams of the autoregressive outputs, as in bench_hf.py) says how repetitive the text is:
looping text is easy to draft, so speed-ups on it are not representative. `identical` says
whether every greedy speculative output equalled the autoregressive one token for token. `forward_cost` is the time
of one speculative step (a verify forward with k heads, drafting and acceptance) over the time
of one autoregressive step: it is also the break-even tokens per forward, the acceptance a
model needs before speculative decoding beats autoregressive (speedup = tok/fwd / cost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_hf import distinct_4grams  # noqa: E402
from mtp.checkpoint import load  # noqa: E402
from mtp.generate import DecodeStats, generate  # noqa: E402
from mtp.generate.prompts import read_prompts  # noqa: E402
from mtp.model import MTPConfig, MTPModel  # noqa: E402
from mtp.tokenizers import ByteTokenizer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def newest_byte8_export(root: Path) -> Path:
    """The newest export of `python -m mtp.train +experiment=byte8` under `root`."""
    for config in sorted(root.glob("*/export/config.json"), key=lambda p: p.stat().st_mtime,
                         reverse=True):
        meta = json.loads(config.read_text())
        if meta["model"]["n_future"] == 8 and meta["tokenizer"]["name"] == "byte":
            return config.parent
    raise FileNotFoundError(f"no byte8 export under {root}: run `python -m mtp.train "
                            f"+experiment=byte8` first, or pass --checkpoint or --random-model")


def random_model(device: str, dtype: torch.dtype) -> tuple[MTPModel, ByteTokenizer]:
    """The byte8 shape (conf/model/small.yaml, 8 heads), untrained; the same every run."""
    torch.manual_seed(0)
    config = MTPConfig.compute_matched(depth=12, n_future=8, vocab_size=262, dim=256,
                                       n_heads=8, max_seq_len=1024)
    return MTPModel(config).to(device=device, dtype=dtype).eval(), ByteTokenizer()


def decode_all(model, tokenizer, prompts: list[str], k: int,
               max_new_tokens: int) -> tuple[float, DecodeStats, list[list[int]]]:
    """Decode each prompt alone; tokens per second over all of them, pooled stats, ids."""
    results, seconds = [], 0.0
    for prompt in prompts:
        began = time.perf_counter()
        results += generate(model, tokenizer, [prompt], max_new_tokens=max_new_tokens, k=k)
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - began
    stats = DecodeStats.pooled([r.stats for r in results])
    return stats.new_tokens / seconds, stats, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, help="export dir or .ckpt (default: newest "
                        "byte8 export under outputs/train)")
    source.add_argument("--random-model", action="store_true",
                        help="an untrained byte8-shaped model (tokens/forward ~1)")
    parser.add_argument("--prompts", type=Path, default=REPO / "data/prompts/code.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", help="default: 2..n_future")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = DTYPES[args.dtype]
    if args.random_model:
        checkpoint = "random"
        model, tokenizer = random_model(args.device, dtype)
    else:
        checkpoint = args.checkpoint or newest_byte8_export(REPO / "outputs/train")
        model, tokenizer = load(checkpoint, device=args.device, dtype=dtype)
    ks = args.ks or list(range(2, model.config.n_future + 1))
    prompts = read_prompts(args.prompts)

    for k in [1, *ks]:  # warm-up: allocator, kernels, caches
        generate(model, tokenizer, prompts[:1], max_new_tokens=16, k=k)
    speed = {k: [] for k in [1, *ks]}
    stats, identical = {}, {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for k in ks:
                ar_speed, stats[1], ar_ids = decode_all(model, tokenizer, prompts, 1,
                                                        args.max_new_tokens)
                spec_speed, stats[k], ids = decode_all(model, tokenizer, prompts, k,
                                                       args.max_new_tokens)
                speed[1].append(ar_speed)
                speed[k].append(spec_speed)
                identical[k] = identical.get(k, True) and ids == ar_ids

    ar = statistics.median(speed[1])
    # Seconds per forward pass relative to autoregressive decoding's (whose tok/fwd is 1).
    cost = {k: ar / stats[1].tokens_per_forward * stats[k].tokens_per_forward
            / statistics.median(speed[k]) for k in speed}
    rows = [{"k": k, "tokens_per_second": round(statistics.median(speed[k]), 1),
             "speedup": round(statistics.median(speed[k]) / ar, 3),
             "tokens_per_forward": round(stats[k].tokens_per_forward, 3),
             "forward_cost": round(cost[k], 3),
             "head_acceptance": [round(a, 3) for a in stats[k].head_acceptance],
             "identical": identical.get(k, True)} for k in [1, *ks]]
    distinct = round(distinct_4grams(ar_ids), 3)  # low: looping text, easy to draft
    print(f"checkpoint {checkpoint}  device {args.device} {args.dtype}  "
          f"threads {torch.get_num_threads()}  prompts {len(prompts)} x "
          f"{args.max_new_tokens} new tokens  repeats {args.repeats}  "
          f"distinct 4-grams {distinct}")
    print(f"{'k':>3} {'tokens/s':>9} {'speedup':>8} {'tok/fwd':>8} {'fwd cost':>8} "
          f"{'identical':>9}  head acceptance")
    for row in rows:
        heads = " ".join(f"{a:.2f}" for a in row["head_acceptance"])
        print(f"{row['k']:>3} {row['tokens_per_second']:>9.1f} {row['speedup']:>7.2f}x "
              f"{row['tokens_per_forward']:>8.2f} {row['forward_cost']:>7.2f}x "
              f"{str(row['identical']):>9}  {heads}")
    best = max(rows[1:], key=lambda row: row["speedup"])
    print(json.dumps({
        "tokens_per_second_ar": round(ar, 1), "tokens_per_second_spec": best["tokens_per_second"],
        "speedup": best["speedup"], "k": best["k"], "tokens_per_forward":
        best["tokens_per_forward"], "identical": all(identical.values()),
        "checkpoint": str(checkpoint), "device": args.device, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "max_new_tokens": args.max_new_tokens, "prompts": len(prompts),
        "distinct_4grams": distinct, "per_k": rows}))


if __name__ == "__main__":
    main()
