"""AdamW with weight decay on matrices only, and a linear warm-up then cosine learning rate
that ends at the step budget or the time budget, whichever comes first.

Parameters fall into the heads (1..n-1) and the base model (`MTPModel.is_base_parameter`),
each split into decayed matrices and undecayed vectors. The base groups' rate is
`trunk_lr_mult` times the heads' and may wait `heads_only_steps` (Medusa-2); frozen
parameters get no group, so no optimizer state.
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
    """AdamW groups of the trainable parameters, each with its `name` and `lr_mult`; empty
    groups are left out."""
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


def build_optimizer(model: nn.Module, optim: OptimSettings) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)` with `optim`'s settings."""
    groups = param_groups(model, optim.weight_decay, trunk_lr_mult=optim.base_lr_mult)
    if not groups:
        raise ValueError("no trainable parameters: every parameter is frozen")
    for group in groups:
        group["lr"] = optim.lr * group["lr_mult"]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps)


def lr_factor(step: int, elapsed: float = 0.0, *, warmup_steps: int, total_steps: int,
              time_budget: float | None = None, min_lr_ratio: float = 0.1) -> float:
    """Learning-rate multiplier at optimizer step `step`, `elapsed` seconds into training:
    linear warm-up, then a half cosine down to `min_lr_ratio` at the end of the budget. By
    max(step / total_steps, elapsed / time_budget), a machine too slow for the steps still
    decays fully by the deadline; one fast enough follows the step schedule exactly."""
    progress = run_progress(step, total_steps, elapsed, time_budget)
    start = warmup_steps / total_steps  # the cosine starts where the warm-up ends
    decay = min(1.0, max(0.0, (progress - start) / max(1e-12, 1.0 - start)))
    cosine = min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * decay))
    if step < warmup_steps:  # a deadline reached mid warm-up caps the ramp
        return min((step + 1) / warmup_steps, cosine)
    return cosine


@dataclass
class LRSchedule:
    """`lr_factor` as a `LambdaLR` multiplier with the clock the trainer sets; an object, not
    a closure, so that `LambdaLR.state_dict()` saves its fields."""

    warmup_steps: int
    total_steps: int
    min_lr_ratio: float = 0.1
    delay_steps: int = 0  # steps at 0 before the warm-up (Medusa-2's heads-only start)
    time_budget: float | None = None  # seconds; None: steps only
    elapsed: float = 0.0  # seconds of training so far

    def __post_init__(self) -> None:  # the steps and ratio: checked as settings (`OptimSettings`)
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
    """A `LambdaLR` with an `LRSchedule` per group; the base groups stay at 0 for
    `heads_only_steps`, then warm up and decay over the rest."""
    heads = LRSchedule(warmup_steps=warmup_steps, total_steps=total_steps,
                       min_lr_ratio=min_lr_ratio, time_budget=time_budget)
    base = replace(heads, delay_steps=heads_only_steps)
    factors = [base if group.get("name", "base").startswith("base") else heads
               for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


def schedules(scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[LRSchedule]:
    """The distinct `LRSchedule`s of a `build_scheduler` scheduler (for their clock)."""
    return list({id(f): f for f in scheduler.lr_lambdas if isinstance(f, LRSchedule)}.values())
