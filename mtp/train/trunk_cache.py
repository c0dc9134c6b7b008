"""Medusa-1's frozen trunk, run once: its output for each training block, kept for every epoch.

With the base model frozen (`optim.freeze_trunk`), a block's trunk output never changes, and
on a CPU it is most of a step (SmolLM2-135M's 30 blocks against three heads). `TrunkCache`
runs the trunk on the blocks a batch brings that it has not seen and reads the others from
memory, so from the second epoch on a step runs the heads alone, with the same loss and
gradients (`mtp_loss`'s `trunk_out`; tests/train/test_trunk_cache.py).

Blocks are known by their index in the training set (batch["index"]); a streamed corpus has
none and is refused. A block's output stays float32 under bf16-mixed too (the residual
stream): 0.23 GB per 100,000 tokens at SmolLM2's width 576. `compute` may keep something else
per block: `mtp.train.eagle` keeps a tuple (the target's features and next tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mtp.model import MTPModel

Outputs = Tensor | tuple[Tensor, ...]  # what is kept of a batch: (B, ...) each


class TrunkCache:
    """The frozen trunk's outputs by training-block index: `compute(model, inputs)`'s (by
    default the trunk's), a tensor or a tuple of tensors (B, ...)."""

    def __init__(self, compute: Callable[[MTPModel, Tensor], Outputs] | None = None) -> None:
        self._compute = compute or (lambda model, inputs: model.trunk(inputs))  # (B, T, D)
        self._outputs: dict[int, tuple[Tensor, ...]] = {}
        self._tuple = False  # whether `compute` returns a tuple

    def __len__(self) -> int:
        return len(self._outputs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self._outputs.values()
                   for t in parts)

    @torch.no_grad()
    def trunk_out(self, model: MTPModel, inputs: Tensor, indices: Tensor) -> Outputs:
        """`compute`'s output for `inputs` (B, T), the blocks `indices` (B,): the ones not seen
        before run together, the others come from memory."""
        if indices.shape != inputs.shape[:1]:
            raise ValueError(f"one index per block: indices of shape {tuple(indices.shape)} "
                             f"for inputs of shape {tuple(inputs.shape)}")
        keys = indices.tolist()
        new = [row for row, key in enumerate(keys) if key not in self._outputs]
        if new:
            outputs = self._compute(model, inputs[new])
            self._tuple = isinstance(outputs, tuple)
            parts = outputs if self._tuple else (outputs,)
            for i, row in enumerate(new):  # clones: not views of the batch's tensors
                self._outputs[keys[row]] = tuple(part[i].clone() for part in parts)
        stacked = tuple(torch.stack(part).to(inputs.device)
                        for part in zip(*(self._outputs[key] for key in keys)))
        return stacked if self._tuple else stacked[0]

