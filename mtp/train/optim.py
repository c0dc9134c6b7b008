"""AdamW with weight decay on matrices only, and a linear warm-up then cosine learning rate
that ends at the step budget or the time budget, whichever comes first.

Parameters fall into the heads (heads 1..n-1) and the base model (`MTPModel.is_base_parameter`:
the embedding, trunk, head 0, shared norm and unembedding), each split into decayed matrices
and undecayed vectors. The base groups' learning rate is `trunk_lr_mult` times the heads'
(Medusa-2 trains the base model at a lower rate) and can wait `heads_only_steps` before it
starts its own warm-up (Medusa-2's heads-only warm-up). Frozen parameters get no group, so no
optimizer state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from mtp.model import MTPModel
from mtp.train.schedule import run_progress
from mtp.train.settings import OptimSettings


def param_groups(model: nn.Module, weight_decay: float, *,
                 trunk_lr_mult: float = 1.0) -> list[dict]:
    """AdamW groups of the trainable parameters: heads then base, each decayed or not.

    Each group carries its `name` ("heads", "heads_no_decay", "base", "base_no_decay") and
    its `lr_mult`; empty groups are left out.
    """
    groups: dict[str, list] = {"heads": [], "heads_no_decay": [], "base": [],
                               "base_no_decay": []}
    for name, param in model.named_parameters():
        if param.requires_grad:
            part = "base" if MTPModel.is_base_parameter(name) else "heads"
            groups[part if param.ndim >= 2 else f"{part}_no_decay"].append(param)
    return [{"name": name, "params": params,
             "weight_decay": 0.0 if name.endswith("no_decay") else weight_decay,
             "lr_mult": trunk_lr_mult if name.startswith("base") else 1.0}
            for name, params in groups.items() if params]


def build_optimizer(model: nn.Module, optim: OptimSettings, *,
                    fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)` with `optim`'s settings (lr, weight_decay, betas, eps,
    the base model's `trunk_lr_mult`); `fused` as torch decides when None."""
    groups = param_groups(model, optim.weight_decay, trunk_lr_mult=optim.base_lr_mult)
    if not groups:
        raise ValueError("no trainable parameters: every parameter is frozen")
    for group in groups:
        group["lr"] = optim.lr * group["lr_mult"]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, fused=fused)


def lr_factor(step: int, elapsed: float = 0.0, *, warmup_steps: int, total_steps: int,
              time_budget: float | None = None, min_lr_ratio: float = 0.1) -> float:
    """Learning-rate multiplier at optimizer step `step`, `elapsed` seconds into training.

    Linear warm-up from 1/warmup_steps to 1 over the first `warmup_steps` steps, then a half
    cosine down to `min_lr_ratio` at the end of the budget, and flat there. The budget is
    `total_steps` steps or `time_budget` seconds, whichever runs out first: progress is
    max(step / total_steps, elapsed / time_budget). A machine too slow to finish the steps
    in time thus still decays fully by the deadline, while one that finishes the steps in
    time follows the step schedule exactly (elapsed / time_budget then stays below
    step / total_steps, and the time term never counts). Worked example, warmup 50,
    400 steps, 840 s: a fast machine at step 225 after 420 s is at progress
    max(0.5625, 0.5) = 0.5625, halfway down the cosine; a slow one at step 120 after 840 s
    is at max(0.3, 1.0) = 1, the floor.
    """
    progress = run_progress(step, total_steps, elapsed, time_budget)
    start = warmup_steps / total_steps  # the cosine starts where the warm-up ends
    decay = min(1.0, max(0.0, (progress - start) / max(1e-12, 1.0 - start)))
    cosine = min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * decay))
    if step < warmup_steps:  # a deadline reached mid warm-up caps the ramp
        return min((step + 1) / warmup_steps, cosine)
    return cosine


@dataclass
class LRSchedule:
    """`lr_factor` as a `LambdaLR` multiplier, with the clock the trainer updates.

    A callable object rather than a closure so that `LambdaLR.state_dict()` saves its fields
    with the checkpoint. Set `elapsed` (and `time_budget`) before each `scheduler.step()`;
    per-group learning rates compose with it, since `LambdaLR` scales each group's own
    initial lr by the same factor.
    """

    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1
    delay_steps: int = 0  # steps at 0 before the warm-up (Medusa-2's heads-only start)
    time_budget: float | None = None  # seconds; None: steps only
    elapsed: float = 0.0  # seconds of training so far

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got "
                             f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps}")
        if not 0 <= self.delay_steps < self.total_steps:
            raise ValueError(f"optim.heads_only_steps={self.delay_steps} must be in "
                             f"[0, total_steps={self.total_steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"time_budget must be > 0 seconds, got {self.time_budget!r}")

    def __call__(self, step: int) -> float:
        if step < self.delay_steps:
            return 0.0
        return lr_factor(step - self.delay_steps, self.elapsed, warmup_steps=self.warmup_steps,
                         total_steps=self.total_steps - self.delay_steps,
                         time_budget=self.time_budget, min_lr_ratio=self.min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.1, heads_only_steps: int = 0,
                    time_budget: float | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` with an `LRSchedule` per group; step it once per optimizer step.

    The base groups (see `param_groups`) stay at 0 for `heads_only_steps`, then warm up and
    decay over the remaining steps. With a `time_budget`, set each schedule's `elapsed`
    (`schedules(scheduler)`) before every step.
    """
    heads = LRSchedule(warmup_steps=warmup_steps, total_steps=total_steps,
                       min_lr_ratio=min_lr_ratio, time_budget=time_budget)
    base = replace(heads, delay_steps=heads_only_steps)
    factors = [base if group.get("name", "base").startswith("base") else heads
               for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def schedules(scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[LRSchedule]:
    """The distinct `LRSchedule`s of a `build_scheduler` scheduler (for their clock)."""
    return list({id(f): f for f in scheduler.lr_lambdas if isinstance(f, LRSchedule)}.values())
