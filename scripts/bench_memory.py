r"""Peak memory and time of one training step: next-token vs n-token (naive, headwise, chunked).

`sequential` is the headwise loss with sequential heads (DeepSeek-V3's modules,
`model.head_type=sequential`), whose chained backward keeps each module's activations until
its backward. With `activation_checkpointing=[none,trunk,all]` each variant also runs with
its trunk (or every) block recomputing activations in backward: rows `headwise+ac=trunk`,
JSON keys `headwise_ac_trunk_*` (the `none` rows keep the plain names).

Each variant runs in a fresh process, so no allocator state leaks into another's peak. The
peak is RSS (getrusage) on a CPU, `torch.cuda.max_memory_allocated` on a GPU; "step" is the
peak minus what the process held just before the step (interpreter, weights, batch): what
forward and backward need, which the loss modes change. The ratios use it.

    python scripts/bench_memory.py                      # vocabulary 32,000, n = 4, ~1 min
    python scripts/bench_memory.py n_future=8 batch=2 seq_len=1024 device=cuda
    python scripts/bench_memory.py variants=[headwise] activation_checkpointing=[none,trunk,all]
    python scripts/bench_memory.py variants=[ntp,headwise,sequential] \
        activation_checkpointing=[none,all]

Arguments are key=value (`mtp.cli`'s grammar); the shape's keys are below.
  variants         [ntp,naive,headwise,chunked,sequential] (default: every one)
  activation_checkpointing   [none] (default), trunk, all: each variant with each of these
  chunk_size       512 tokens per unembedding chunk for the chunked variant
  device           cpu (default) or cuda
  threads          2
  dim, batch, seq_len   512, 2, 512 here
  variant, ac      (internal) the one variant a child process measures, and its checkpointing
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass, field
from functools import partial

from mtp import cli
from mtp.bench.decoding import child_json
from mtp.bench.shape import KEYS, Shape

VARIANTS = ("ntp", "naive", "headwise", "chunked", "sequential")
MODES = {"ntp": "naive", "sequential": "headwise"}  # a variant's loss mode, if not its name
CHECKPOINTING = ("none", "trunk", "all")


@dataclass(frozen=True, kw_only=True)
class MemoryArgs(Shape):
    dim: int = 512
    batch: int = 2
    seq_len: int = 512
    chunk_size: int = 512
    device: str = "cpu"
    threads: int = 2
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    activation_checkpointing: list[str] = field(default_factory=lambda: ["none"])
    variant: str | None = None
    ac: str = "none"

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.check_positives(self, "chunk_size", "threads")
        cli.check_positive("n_future", self.n_future, 2, ">= 2 to compare with next-token")
        for key, allowed in (("variants", VARIANTS), ("activation_checkpointing", CHECKPOINTING),
                             ("variant", VARIANTS), ("ac", CHECKPOINTING)):
            given = getattr(self, key)
            cli.check_choices(key, [given] if isinstance(given, str) else given or [], allowed)


parse_args = partial(cli.parse, schema=MemoryArgs)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_variant(args: MemoryArgs) -> dict:
    """One forward + backward of `variant` in this process: its memory and time."""
    import torch

    from mtp.train.loss import autograd_backward, mtp_loss
    from mtp.model import MTPConfig, MTPModel
    from mtp.train.parallel import apply_activation_checkpointing

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    n_future = 1 if args.variant == "ntp" else args.n_future
    config = MTPConfig(vocab_size=args.vocab_size, dim=args.dim, n_layers=args.n_layers,
                       n_heads=args.n_heads, max_seq_len=args.seq_len, n_future=n_future,
                       head_type="sequential" if args.variant == "sequential" else "block")
    device = torch.device(args.device)
    model = MTPModel(config).to(device)
    apply_activation_checkpointing(model, args.ac)
    tokens = torch.randint(0, args.vocab_size, (args.batch, args.seq_len + n_future),
                           device=device)
    mode = MODES.get(args.variant, args.variant)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        sync()
        start = time.perf_counter()
        mtp_loss(model, tokens, mode=mode, backward=autograd_backward,
                 chunk_size=args.chunk_size)
        sync()
        return time.perf_counter() - start

    if device.type == "cuda":
        step()  # warm-up: kernels and allocator pools
        model.zero_grad(set_to_none=True)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        seconds = step()
        peak = torch.cuda.max_memory_allocated()
    else:
        # The first step is the measured one: afterwards the allocator keeps freed pages, and
        # a second step's RSS peak would hide in them.
        before = _rss_bytes()
        seconds = step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        seconds = min(seconds, step())
    return {"variant": args.variant, "activation_checkpointing": args.ac,
            "n_future": n_future, "peak_bytes": peak,
            "step_bytes": peak - before, "seconds": seconds}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return

    results = {}
    shape = [*args.arguments(), f"chunk_size={args.chunk_size}", f"device={args.device}",
             f"threads={args.threads}"]
    for variant in args.variants:
        for ac in args.activation_checkpointing:
            name = variant if ac == "none" else f"{variant}+ac={ac}"
            results[name] = child_json([sys.executable, __file__, *shape, f"variant={variant}",
                                        f"ac={ac}"], f"variant {name} failed")

    unit = "allocated" if args.device.startswith("cuda") else "RSS"
    print(f"one training step: vocab {args.vocab_size}, dim {args.dim}, trunk {args.n_layers} "
          f"layers, batch {args.batch} x seq {args.seq_len}, device {args.device}")
    print(f"{'variant':<18}{'n':>3}{'peak ' + unit + ' MiB':>18}{'step MiB':>11}"
          f"{'step/ntp':>10}{'time s':>9}{'time/ntp':>10}")
    ntp = results.get("ntp")
    summary: dict = {"n_future": args.n_future, "vocab_size": args.vocab_size,
                     "batch": args.batch, "seq_len": args.seq_len, "device": args.device}
    for name, r in results.items():
        mem_ratio = r["step_bytes"] / ntp["step_bytes"] if ntp else float("nan")
        time_ratio = r["seconds"] / ntp["seconds"] if ntp else float("nan")
        print(f"{name:<18}{r['n_future']:>3}{r['peak_bytes'] / 2**20:>18.0f}"
              f"{r['step_bytes'] / 2**20:>11.0f}{mem_ratio:>10.2f}{r['seconds']:>9.2f}"
              f"{time_ratio:>10.2f}")
        variant = name.replace("+ac=", "_ac_")
        summary[f"{variant}_peak_bytes"] = r["peak_bytes"]
        summary[f"{variant}_step_bytes"] = r["step_bytes"]
        summary[f"{variant}_seconds"] = round(r["seconds"], 4)
        if ntp:
            summary[f"{variant}_over_ntp"] = round(mem_ratio, 3)
            summary[f"{variant}_time_over_ntp"] = round(time_ratio, 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS, errors=(ValueError, FileNotFoundError, RuntimeError))
