"""Heads for a trained model: start from a checkpoint, keep its trunk and heads, add heads
(Medusa; Gloeckle et al. 2024's finetuning).

A new head starts at random or, with `copy`: a block head copies head 0's blocks; a resblock
or linear head starts as the identity (as Medusa zero-initialises its ResBlock); a sequential
module copies the checkpoint's last module (as MiMo grows its MTP layer), else its blocks copy
head 0's and its input fusion starts as in pretraining.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from mtp.cli import check_choice
from mtp.model import MTPConfig, MTPModel

NEW_HEADS: tuple[str, ...] = ("copy", "random")


def grown_config(base: MTPConfig, *, n_future: int, head_type: str,
                 drop_heads: bool = False, new_heads: str | None = "copy") -> MTPConfig:
    """`base` with `n_future` heads of `head_type` (more need `new_heads`, fewer `drop_heads`)."""
    if n_future < base.n_future and not drop_heads:
        raise ValueError(f"model.n_future={n_future} is below the checkpoint's "
                         f"{base.n_future} heads: set init.drop_heads=true to keep only heads "
                         f"0..{n_future - 1}")
    if n_future > base.n_future and new_heads is None:
        raise ValueError(f"model.n_future={n_future} is above the checkpoint's {base.n_future} "
                         f"head(s): set init.new_heads to one of {NEW_HEADS} to add heads "
                         f"{base.n_future}..{n_future - 1}")
    kept_heads = min(n_future, base.n_future)
    if kept_heads > 1 and head_type != base.head_type:
        raise ValueError(f"model.head_type={head_type!r} differs from the type of the "
                         f"checkpoint's heads 1..{base.n_future - 1} ({base.head_type!r}): "
                         f"keep head_type={base.head_type!r}, or start from a next-token "
                         f"(one-head) checkpoint")
    return dataclasses.replace(base, n_future=n_future, head_type=head_type)


@torch.no_grad()
def grow_heads(base: MTPModel, config: MTPConfig, *, new_heads: str | None = "copy",
               ) -> dict[str, Tensor]:
    """Initial weights (a state dict) of `MTPModel(config)` grown from the `base` model."""
    if not (new_heads is None and config.n_future <= base.config.n_future):  # none to grow
        check_choice("init.new_heads", new_heads, NEW_HEADS)
    model = MTPModel(config)  # random weights for whatever the base does not provide
    state = model.state_dict()
    kept = min(config.n_future, base.config.n_future)
    for name, tensor in base.state_dict().items():
        if not name.startswith("heads.") or int(name.split(".")[1]) < kept:
            state[name] = tensor.to(state[name].dtype, copy=True)
    if new_heads == "copy":
        for head in range(kept, config.n_future):
            prefix = f"heads.{head}."
            for name in [n for n in state if n.startswith(prefix)]:
                state[name] = _copied(state, name, prefix, config.head_type, kept)
    return state


def _copied(state: dict[str, Tensor], name: str, prefix: str, head_type: str,
            kept: int) -> Tensor:
    """The `copy` initialisation of a new head's parameter `name`."""
    sub = name[len(prefix):]
    if head_type == "sequential" and kept > 1:
        return state[f"heads.{kept - 1}.{sub}"].clone()
    if head_type in ("block", "sequential"):
        source = "heads.0." + sub  # a block's parameter; a module's fusion stays as initialised
        return state[source].clone() if source in state else state[name]
    weight = state[name]
    if head_type in ("resblock", "medusa"):  # x + SiLU(x @ 0) = x
        return torch.zeros_like(weight)
    return torch.eye(weight.shape[0], dtype=weight.dtype)  # linear: x @ I = x
