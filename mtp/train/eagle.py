"""`python -m mtp.train.eagle checkpoint=<target> 'data=[a.jsonl,b.jsonl]'`: train an EAGLE-3
drafter (`mtp.decode.drafters.eagle`) on a frozen target, and save it where `drafter=eagle`
finds it.

The recipe (EAGLE-3, Li et al. 2025, as SafeAILab's `traineagle3` trains it):
- The target is frozen and runs once per training block: its residual stream after the
  drafter's three trunk layers and its own next token (head 0's argmax) are kept in memory
  (`TrunkCache`, `target_outputs`), so from the second epoch on a step runs the drafter alone.
- The draft vocabulary is the `draft_vocab` most frequent tokens of the training data; a
  position whose target token is outside it is left out of the loss (EAGLE-3's mask). The
  drafter's unembedding and final norm start as the target's own rows of them.
- Training-time test (`unrolled`): the drafter is unrolled `unroll` steps over the block, as
  it runs when drafting; step j >= 1 reads its own output of step j - 1 and the data's token
  x_{t+1+j}, not its own draft: a draft that differs from the target's token is rejected, so
  only the target's own path (the data, `scripts/distill_data.py`) counts. The steps'
  losses are summed with weights `decay` ** j.
- AdamW, linear warm-up then cosine decay ending at `max_steps` or `minutes`, whichever
  comes first (`mtp.train.optim.lr_factor`), gradients clipped; bfloat16 autocast where the
  CPU multiplies bf16 natively (`precision=auto`).

Writes `out/eagle.json` and `out/eagle.safetensors` and saves the drafter as the checkpoint's
choice (`mtp.generate.saved.save_choice`), so `python -m mtp.generate checkpoint=<target>
drafter=eagle` uses it; `eagle=out` names it explicitly. Prints the validation loss and
accuracy per unrolled step.

Arguments are key=value (`mtp.cli`'s grammar):
  checkpoint     the target: anything mtp.load reads (required)
  data           JSON lines or text files, as data=local reads them (required)
  out            runs/eagle: the drafter's directory
  draft_vocab    8192 draft tokens; layers: three trunk layers (null: vLLM's and SGLang's
                 default for the target)
  unroll         4 training-time-test steps; decay 0.8, the weight of step j is decay ** j
  seq_len        256;  batch_size 8;  val_fraction 0.02 (the data pipeline's split)
  max_steps      1200;  minutes 50 (a time budget: training stops, its schedule ended, by
                 then; null: none)
  lr             1e-3;  warmup_steps 50;  grad_clip 0.5
  precision      auto (bfloat16 where the CPU has it), bfloat16 or float32
  threads        null (torch's default);  seed 0;  log_every 50;  val_batches 16
  output         also write the saved choice's eagle.json there (a file, or a directory: the
                 checkpoint's, to ship the drafter with it)
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import MISSING
from torch import Tensor

from mtp import cli
from mtp.checkpoint import load
from mtp.data import LocalSource, MTPDataModule
from mtp.decode.drafters.eagle_model import WEIGHTS_FILE, Eagle, EagleConfig, check_layers
from mtp.generate.saved import save_choice
from mtp.model import Attention, MTPModel, apply_rope, project
from mtp.train.optim import lr_factor
from mtp.train.trunk_cache import TrunkCache
from mtp.tune import Measurement, cpu_has_bf16, set_threads

PRECISIONS = ("auto", "bfloat16", "float32")


@dataclass(frozen=True, kw_only=True)
class EagleArgs:
    checkpoint: str = MISSING
    data: list[str] = MISSING
    out: str = "runs/eagle"
    draft_vocab: int = 8192
    layers: list[int] | None = None
    unroll: int = 4
    decay: float = 0.8
    seq_len: int = 256
    batch_size: int = 8
    val_fraction: float = 0.02
    max_steps: int = 1200
    minutes: float | None = 50.0
    lr: float = 1e-3
    warmup_steps: int = 50
    grad_clip: float = 0.5
    precision: str = "auto"
    threads: int | None = None
    seed: int = 0
    log_every: int = 50
    val_batches: int = 16
    output: str | None = None

    def __post_init__(self) -> None:
        cli.check_positives(self, "draft_vocab", "unroll", "seq_len", "batch_size", "max_steps",
                            "log_every", "val_batches")
        cli.check_positive("warmup_steps", self.warmup_steps, least=0)
        cli.check_positives(self, "threads", optional=True)
        if not self.data:
            raise ValueError("data=[...] must name at least one file")
        cli.check_choice("precision", self.precision, PRECISIONS)
        for name in ("lr", "decay", "grad_clip"):
            cli.check_number(name, getattr(self, name), lambda v: v > 0, "> 0")
        if self.minutes is not None:
            cli.check_number("minutes", self.minutes, lambda v: v > 0, "> 0 (null: no budget)")
        if self.layers is not None:
            check_layers(self.layers, n_layers=1 << 30)  # three, in order; range: the model's

    @property
    def bfloat16(self) -> bool:
        """Whether the target and the drafter run under bfloat16 autocast."""
        return self.precision == "bfloat16" or (self.precision == "auto" and cpu_has_bf16())


def draft_vocabulary(counts: Tensor, size: int) -> Tensor:
    """The draft vocabulary's map (N,): the target ids of the `size` most frequent tokens
    (ties to the lower id) among those that occur in `counts` (V,), in id order."""
    order = torch.sort(-counts.long(), stable=True).indices[:size]  # ties: the lower id
    chosen = order[counts[order] > 0]
    if not len(chosen):
        raise ValueError("the training data has no tokens: no draft vocabulary")
    return chosen.sort().values


def inverse_map(d2t: Tensor, vocab_size: int) -> Tensor:
    """t2d (V,): each target token's draft id, -1 outside the draft vocabulary."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=d2t.device)
    t2d[d2t] = torch.arange(len(d2t), device=d2t.device)
    return t2d


def target_outputs(layers: tuple[int, ...], seq_len: int
                   ) -> Callable[[MTPModel, Tensor], tuple[Tensor, Tensor]]:
    """What the cache keeps of a block (B, seq_len + unroll): the target's features after
    `layers` (B, seq_len, 3, D) and its own next token after every input, head 0's argmax."""

    def compute(model: MTPModel, inputs: Tensor) -> tuple[Tensor, Tensor]:
        trunk, features = model.trunk_states(inputs, keep=layers)
        head = model.head(trunk, 0)
        # One row at a time: a batch's logits over a large vocabulary are gigabytes.
        after = torch.stack([model.unembed(row).argmax(-1) for row in head])
        return features[:, :seq_len], after

    return compute


def unrolled(module: Eagle, model: MTPModel, features: Tensor, tokens: Tensor,
             steps: int) -> list[Tensor]:
    """Training-time test (module docstring): the draft logits (B, T, N) of each of `steps`
    unrolled steps; features (B, T, 3, D) the target's, tokens (B, >= T + steps) the block's."""
    T = features.shape[1]
    if T + steps > model.config.max_seq_len:
        raise ValueError(f"seq_len + unroll = {T + steps} exceeds the target's max_seq_len="
                         f"{model.config.max_seq_len}")
    hidden = module.fuse(features)  # (B, T, D)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    logits = []
    for j in range(steps):
        positions = torch.arange(j, T + j, device=features.device)
        cos, sin = model.rope_cos[positions], model.rope_sin[positions]
        # Step j sees step 0's entries at positions <= t, and its own of steps 1..j at t.
        mask = torch.cat([torch.ones(T, T, dtype=torch.bool, device=features.device).tril(),
                          *[torch.eye(T, dtype=torch.bool, device=features.device)] * j],
                         dim=1)  # (T, T * (j + 1))
        attend = partial(_attend, module.attention, cos, sin, mask, keys, values)
        embedded = model.tok_embeddings(tokens[:, 1 + j:1 + j + T])
        hidden = module(hidden, embedded, cos, sin, attend=attend)
        logits.append(module.logits(hidden))
    return logits


def _attend(attention: Attention, cos: Tensor, sin: Tensor, mask: Tensor, keys: list[Tensor],
            values: list[Tensor], x: Tensor) -> Tensor:
    """The drafter's attention at one unrolled step: its keys and values join the earlier
    steps' (`keys`, `values`); `mask` (T, all keys) says what each position sees."""
    q, k, v = (project(x, w).unflatten(-1, (-1, attention.head_dim))
               for w in (attention.wq, attention.wk, attention.wv))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
    keys.append(k)
    values.append(v)
    out = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                         attn_mask=mask,
                                         enable_gqa=attention.n_kv_heads != attention.n_heads)
    return project(out.transpose(1, 2).flatten(-2), attention.wo)


@dataclass(frozen=True)
class UnrolledLoss:
    """The weighted loss, and each step's loss and top-1 accuracy (over the positions whose
    target token is in the draft vocabulary)."""

    loss: Tensor
    step_losses: list[float]
    step_accuracy: list[float]


def unrolled_loss(module: Eagle, model: MTPModel, features: Tensor, tokens: Tensor,
                  targets: Tensor, t2d: Tensor, steps: int, decay: float = 0.8) -> UnrolledLoss:
    """Training-time test's loss: step j at t predicts `targets`[:, t + 1 + j] (the target's
    token after x_{t+1+j}) over the draft vocabulary (`t2d`, -1: left out), weighted decay ** j."""
    T = features.shape[1]
    total, losses, accuracy = features.new_zeros(()), [], []
    for j, logits in enumerate(unrolled(module, model, features, tokens, steps)):
        labels = t2d[targets[:, 1 + j:1 + j + T]]  # (B, T)
        wide = logits.float() if logits.element_size() < 4 else logits  # bf16: in float32
        loss = F.cross_entropy(wide.flatten(0, 1), labels.flatten(), ignore_index=-1)
        total = total + decay ** j * loss
        real = labels >= 0
        losses.append(float(loss.detach()))
        accuracy.append(float((logits.argmax(-1) == labels)[real].float().mean())
                        if real.any() else 0.0)
    return UnrolledLoss(total, losses, accuracy)


parse_args = partial(cli.parse, schema=EagleArgs)


def _batches(loader: torch.utils.data.DataLoader) -> Iterator[dict[str, Tensor]]:
    """The loader's batches, epoch after epoch (each reshuffled)."""
    for epoch in itertools.count():
        loader.sampler.set_epoch(epoch)
        yield from loader


def train_eagle(args: EagleArgs, report: Callable[[str], None] = print) -> tuple[Eagle, dict]:
    """Train a drafter as `args` say; write it to `args.out` and save it for the checkpoint.
    Returns it and what its eagle.json records of its training (the curve in `history`)."""
    if args.threads:
        set_threads(args.threads)
    torch.manual_seed(args.seed)
    source = LocalSource(paths=list(args.data))  # its files exist: before anything loads
    model, tokenizer = load(args.checkpoint)
    model.eval().requires_grad_(False)
    data = MTPDataModule(source, tokenizer, args.seq_len,
                         n_future=args.unroll, batch_size=args.batch_size,
                         val_fraction=args.val_fraction, seed=args.seed)
    data.setup()
    stream = np.asarray(data.prepared.stream("train"))
    counts = torch.from_numpy(np.bincount(stream, minlength=model.config.vocab_size))
    d2t = draft_vocabulary(counts, args.draft_vocab)
    coverage = float(counts[d2t].sum() / counts.sum())
    config = EagleConfig.for_target(model.config, len(d2t), args.layers)
    module = Eagle(config, d2t)
    with torch.no_grad():  # the unembedding and final norm start as the target's own
        module.lm_head.weight.copy_(model.output.weight[d2t])
        module.norm.weight.copy_(model.norm.weight)
    t2d = inverse_map(d2t, model.config.vocab_size)
    report(f"target {args.checkpoint}: layers {list(config.layers)} fused; draft vocabulary "
           f"{len(d2t)} tokens, {coverage:.1%} of the training tokens; "
           f"{len(data.train_set)} training blocks of {args.seq_len} + {args.unroll}")

    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.bfloat16 else nullcontext()
    cache = TrunkCache(target_outputs(config.layers, args.seq_len))
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    budget = None if args.minutes is None else 60 * args.minutes
    started = time.perf_counter()
    batches = _batches(data.train_dataloader())
    module.train()
    step, window, history = 0, [], []  # history: (step, loss, accuracy per unrolled step)
    for step in range(1, args.max_steps + 1):
        elapsed = time.perf_counter() - started
        if budget is not None and elapsed >= budget:
            report(f"stopped at step {step - 1} of max_steps={args.max_steps}: the "
                   f"{args.minutes:g}-minute budget ran out")
            step -= 1
            break
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step - 1, elapsed, warmup_steps=args.warmup_steps,
                                              total_steps=args.max_steps, time_budget=budget)
        batch = next(batches)
        tokens = batch["tokens"]
        with autocast:
            features, targets = cache.trunk_out(model, tokens, batch["index"])
            out = unrolled_loss(module, model, features, tokens, targets, t2d, args.unroll,
                                args.decay)
        if not math.isfinite(float(out.loss.detach())):
            raise ValueError(f"non-finite loss at step {step}: lower lr (lr={args.lr})")
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window.append(out)
        if step % args.log_every == 0 or step == args.max_steps:
            losses, accuracy = _step_means(window)
            history.append((step, losses[0], accuracy))
            report(f"step {step}: loss {losses[0]:.3f}, accuracy per step "
                   + " ".join(f"{a:.3f}" for a in accuracy)
                   + f", {time.perf_counter() - started:.0f} s, "
                   f"{cache.nbytes() / 1e9:.2f} GB cached")
            window = []
    module.eval()
    val = validate(module, model, data, t2d, args, autocast)
    seconds = time.perf_counter() - started
    details = {"checkpoint": str(args.checkpoint), "data": list(args.data), "steps": step,
               "seconds": round(seconds, 1), "coverage": round(coverage, 4),
               "unroll": args.unroll, "val_loss": val[0], "val_accuracy": val[1],
               "history": history}
    report("unrolled step  " + "  ".join(f"{j:>6}" for j in range(args.unroll)))
    report("val loss       " + "  ".join(f"{v:6.3f}" for v in val[0]))
    report("val accuracy   " + "  ".join(f"{v:6.3f}" for v in val[1]))
    path = module.save(args.out, details)
    weights = str((path.parent / WEIGHTS_FILE).resolve())
    record = Measurement("eagle", str(Path(args.out).resolve()), "set",
                         f"trained by python -m mtp.train.eagle ({step} steps)",
                         seconds=seconds, value=module.describe(weights, details))
    report(f"saved: {path}")
    for where in save_choice(args.checkpoint, record, args.output):
        report(f"saved: {where}")
    return module, details


@torch.no_grad()
def validate(module: Eagle, model: MTPModel, data: MTPDataModule, t2d: Tensor,
             args: EagleArgs, autocast) -> tuple[list[float], list[float]]:
    """Each unrolled step's mean loss and accuracy on up to `val_batches` held-out batches
    (none held out: the training batches')."""
    loader = data.val_dataloader() or data.train_dataloader()
    compute = target_outputs(module.config.layers, args.seq_len)
    results = []
    for index, batch in enumerate(loader):
        if index == args.val_batches:
            break
        with autocast:
            features, targets = compute(model, batch["tokens"])
            results.append(unrolled_loss(module, model, features, batch["tokens"], targets,
                                         t2d, args.unroll, args.decay))
    return _step_means(results)


def _step_means(outputs: list[UnrolledLoss]) -> tuple[list[float], list[float]]:
    """Each unrolled step's mean loss and accuracy over `outputs` (batches), to 4 places."""
    def means(rows: list[list[float]]) -> list[float]:
        return [round(float(np.mean(column)), 4) for column in zip(*rows)]

    return means([o.step_losses for o in outputs]), means([o.step_accuracy for o in outputs])


def main(argv: list[str]) -> None:
    _, details = train_eagle(parse_args(argv))
    print(json.dumps(details))  # the last line: what mtp.bench reads


if __name__ == "__main__":
    cli.main(main, __doc__)
