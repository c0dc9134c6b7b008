"""AdamW with weight decay on matrices only, and a linear warm-up then cosine learning rate
that ends at the step budget or the time budget, whichever comes first."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (decayed) and vectors such as norm gains and biases (not)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)`; `fused` as torch decides when None."""
    if not lr > 0:
        raise ValueError(f"optim.lr must be > 0, got {lr!r}")
    if weight_decay < 0:
        raise ValueError(f"optim.weight_decay must be >= 0, got {weight_decay!r}")
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=tuple(betas),
                             eps=eps, fused=fused)


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
    progress = step / total_steps
    if time_budget is not None:
        progress = max(progress, elapsed / time_budget)
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
    time_budget: float | None = None  # seconds; None: steps only
    elapsed: float = 0.0  # seconds of training so far

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got "
                             f"warmup_steps={self.warmup_steps}, total_steps={self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"time_budget must be > 0 seconds, got {self.time_budget!r}")

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.elapsed, warmup_steps=self.warmup_steps,
                         total_steps=self.total_steps, time_budget=self.time_budget,
                         min_lr_ratio=self.min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.1, time_budget: float | None = None
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` applying an `LRSchedule`; step it once per optimizer step.

    The schedule is `scheduler.lr_lambdas[0]`: update its `elapsed` before each step when
    `time_budget` is set.
    """
    schedule = LRSchedule(warmup_steps=warmup_steps, total_steps=total_steps,
                          min_lr_ratio=min_lr_ratio, time_budget=time_budget)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
