"""AdamW with weight decay on matrices only, and a linear warm-up then cosine learning rate.

Parameters fall into the heads (heads 1..n-1) and the base model (`MTPModel.is_base_parameter`:
the embedding, trunk, head 0, shared norm and unembedding), each split into decayed matrices
and undecayed vectors. The base groups' learning rate is `trunk_lr_mult` times the heads'
(Medusa-2 trains the base model at a lower rate) and can wait `heads_only_steps` before it
starts its own warm-up (Medusa-2's heads-only warm-up). Frozen parameters get no group, so no
optimizer state.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mtp.model import MTPModel


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


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                    fused: bool | None = None, trunk_lr_mult: float = 1.0) -> torch.optim.AdamW:
    """AdamW over `param_groups(model)`; `fused` as torch decides when None."""
    if not lr > 0:
        raise ValueError(f"optim.lr must be > 0, got {lr!r}")
    if weight_decay < 0:
        raise ValueError(f"optim.weight_decay must be >= 0, got {weight_decay!r}")
    if not trunk_lr_mult >= 0:
        raise ValueError(f"optim.trunk_lr_mult must be >= 0, got {trunk_lr_mult!r}")
    groups = param_groups(model, weight_decay, trunk_lr_mult=trunk_lr_mult)
    if not groups:
        raise ValueError("no trainable parameters: every parameter is frozen")
    for group in groups:
        group["lr"] = lr * group["lr_mult"]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)


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
                    min_lr_ratio: float = 0.1, heads_only_steps: int = 0
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` applying `lr_factor`; step it once per optimizer step.

    The base groups (see `param_groups`) stay at 0 for `heads_only_steps`, then warm up and
    decay over the remaining steps.
    """
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got "
                         f"warmup_steps={warmup_steps}, total_steps={total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio!r}")
    if not 0 <= heads_only_steps < total_steps:
        raise ValueError(f"optim.heads_only_steps={heads_only_steps} must be in "
                         f"[0, total_steps={total_steps})")

    def heads(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps,
                         min_lr_ratio=min_lr_ratio)

    def base(step: int) -> float:
        if step < heads_only_steps:
            return 0.0
        return lr_factor(step - heads_only_steps, warmup_steps=warmup_steps,
                         total_steps=total_steps - heads_only_steps, min_lr_ratio=min_lr_ratio)

    factors = [base if group.get("name", "base").startswith("base") else heads
               for group in optimizer.param_groups]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factors)
