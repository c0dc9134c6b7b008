"""AdamW with weight decay on matrices only, and a linear warm-up then cosine learning rate."""

from __future__ import annotations

import math

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


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step `step`: linear warm-up, cosine decay.

    Rises linearly from 1/warmup_steps to 1 over the first `warmup_steps` steps, then follows
    a half cosine down to `min_lr_ratio` at `total_steps`, and stays there.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int,
                    min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` applying `lr_factor`; step it once per optimizer step."""
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got "
                         f"warmup_steps={warmup_steps}, total_steps={total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps=warmup_steps,
                                          total_steps=total_steps, min_lr_ratio=min_lr_ratio))
