"""FSDP2 collectives per optimizer step under the headwise backward, with and without
`mtp.train.parallel.gradient_sync`.

Runs one optimizer step (after a warm-up step) on 2 gloo CPU ranks, or on every GPU of the
machine with NCCL (`device=cuda`), and counts the all-gathers and reduce-scatters FSDP
issues and the bytes they move. "fsdp default" is FSDP's own gradient accumulation
(`set_requires_gradient_sync` on the last micro-batch only), which is what `MTPLitModule`
did before `gradient_sync`.

    python scripts/bench_fsdp_comms.py                     # vocab 32,000, n = 4, 2 CPU ranks
    python scripts/bench_fsdp_comms.py accumulate=2 mode=chunked

Arguments are key=value (`mtp.cli`'s grammar); the shape's keys are below.
  accumulate       1 micro-batch per step
  mode             headwise (default) or chunked
  device           cpu (default: gloo ranks) or cuda (NCCL)
  ranks            null: 2 on a CPU, every GPU on cuda
  dim, batch, seq_len   256, 1 (per rank), 128 here
"""

from __future__ import annotations

import json
import os
import socket
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtp import cli
from mtp.bench.shape import KEYS, Shape
from mtp.model import MTPConfig, MTPModel
from mtp.train.loss import autograd_backward, mtp_loss
from mtp.train.parallel import end_spawned_rank, gradient_sync, parallelize

COLLECTIVES = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter"}


@dataclass(frozen=True, kw_only=True)
class CommsArgs(Shape):
    accumulate: int = 1
    mode: str = "headwise"
    device: str = "cpu"
    ranks: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        cli.check_positive("accumulate", self.accumulate, need=">= 1 micro-batch")
        cli.check_choice("mode", self.mode, ("headwise", "chunked"))
        cli.check_choice("device", self.device, ("cpu", "cuda"))
        if self.ranks is not None and self.ranks < 2:
            raise ValueError(f"ranks={self.ranks}: sharding needs at least 2 ranks")


parse_args = partial(cli.parse, schema=CommsArgs)


@contextmanager
def fsdp_default(model: MTPModel, *, sync: bool, headwise: bool):
    model.set_requires_gradient_sync(sync)
    yield


def _count(calls: Counter, nbytes: Counter) -> None:
    """Wrap the torch.distributed collectives FSDP2 calls, counting calls and bytes."""
    for name, short in COLLECTIVES.items():
        original = getattr(dist, name)

        def counted(*args, _fn=original, _short=short, **kwargs):
            # The unsharded side: an all-gather's output, a reduce-scatter's input.
            side = "input" if _short == "reduce_scatter" else "output"
            full = kwargs[side] if side in kwargs else args[0 if side == "output" else 1]
            calls[_short] += 1
            nbytes[_short] += full.numel() * full.element_size()
            return _fn(*args, **kwargs)
        setattr(dist, name, counted)


def _worker(rank: int, world: int, port: int, args: CommsArgs, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    calls, nbytes = Counter(), Counter()
    _count(calls, nbytes)
    config = MTPConfig(vocab_size=args.vocab_size, dim=args.dim, n_layers=args.n_layers,
                       n_heads=args.n_heads, n_future=args.n_future, max_seq_len=args.seq_len)
    for name, sync_context in (("fsdp default", fsdp_default), ("gradient_sync", gradient_sync)):
        torch.manual_seed(0)
        model = MTPModel(config).to(args.device)
        parallelize(model, init_device_mesh(args.device, (world,)))
        tokens = torch.randint(0, args.vocab_size, (args.batch, args.seq_len + args.n_future),
                               device=args.device)
        for _ in range(2):  # the first step builds FSDP's state; count the second
            calls.clear()
            nbytes.clear()
            for micro in range(args.accumulate):
                with sync_context(model, sync=micro == args.accumulate - 1, headwise=True):
                    mtp_loss(model, tokens, mode=args.mode, backward=autograd_backward)
            model.zero_grad(set_to_none=True)
        if rank == 0:
            results[name] = {"calls": dict(calls), "bytes": dict(nbytes)}
    end_spawned_rank()


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    world = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2:
        raise ValueError(f"need at least 2 ranks to shard, got {world} (device={args.device})")
    results = mp.Manager().dict()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, args, results), nprocs=world, join=True)

    units = args.n_layers + args.n_future + 2  # trunk blocks, heads, shared unembedding, root
    print(f"FSDP2 collectives per optimizer step: {world} {args.device} ranks, vocab "
          f"{args.vocab_size}, dim {args.dim}, trunk {args.n_layers}, n = {args.n_future}, "
          f"{args.mode}, accumulate {args.accumulate}; {units} FSDP units")
    print(f"{'':<15}{'all-gathers':>12}{'MiB':>9}{'reduce-scatters':>17}{'MiB':>9}")
    summary: dict = {"world_size": world, "n_future": args.n_future, "mode": args.mode,
                     "accumulate": args.accumulate, "fsdp_units": units}
    for name, r in results.items():
        calls, nbytes = r["calls"], r["bytes"]
        print(f"{name:<15}{calls.get('all_gather', 0):>12}"
              f"{nbytes.get('all_gather', 0) / 2**20:>9.1f}{calls.get('reduce_scatter', 0):>17}"
              f"{nbytes.get('reduce_scatter', 0) / 2**20:>9.1f}")
        key = name.replace(" ", "_")
        for short in COLLECTIVES.values():
            summary[f"{key}_{short}s"] = calls.get(short, 0)
            summary[f"{key}_{short}_bytes"] = nbytes.get(short, 0)
    print(json.dumps(summary))


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS)
