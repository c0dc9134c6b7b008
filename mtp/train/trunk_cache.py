"""Medusa-1's frozen trunk, run once: its output for each training block, kept for every epoch.

With the base model frozen (`optim.freeze_trunk`), a block's trunk output never changes, and
on a CPU it is most of a step: SmolLM2-135M's 30 blocks against three heads' resblocks and
their share of the unembedding. `TrunkCache` computes the output of the blocks a batch brings
that it has not seen (one batched forward, no graph) and reads the others from memory, so
from the second epoch on a step runs the heads alone. The loss is the same: `mtp_loss` takes
the cached output as `trunk_out` and goes on from there, and the heads' gradients are those
of a step through the trunk (tests/train/test_trunk_cache.py).

A block is known by its index in the training set (`PackedBlocks` hands it out as
batch["index"]); a streamed corpus has none and is refused. The cache holds a (seq_len, dim)
tensor per block in the trunk's output dtype (float32 under bf16-mixed too: the residual
stream stays float32): 0.23 GB per 100,000 tokens at SmolLM2's width 576.

What is kept per block is the trunk's output unless `compute` says otherwise: an EAGLE
drafter trained on a frozen target keeps three layers' features and the target's own next
tokens (`mtp.train.eagle`), a tuple of tensors per block, read back as a tuple.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from mtp.model import MTPModel

Outputs = Tensor | tuple[Tensor, ...]  # what is kept of a batch: (B, ...) each


def trunk_output(model: MTPModel, inputs: Tensor) -> Tensor:
    """The trunk's output (B, T, D): what the cache keeps by default."""
    return model.trunk(inputs)


class TrunkCache:
    """The frozen trunk's outputs by training-block index: `compute(model, inputs)`'s, a
    tensor or a tuple of tensors (B, ...) (default: the trunk's output)."""

    def __init__(self, compute: Callable[[MTPModel, Tensor], Outputs] = trunk_output) -> None:
        self._compute = compute
        self._outputs: dict[int, tuple[Tensor, ...]] = {}
        self._tuple = False  # whether `compute` returns a tuple

    def __len__(self) -> int:
        return len(self._outputs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self._outputs.values()
                   for t in parts)

    @torch.no_grad()
    def trunk_out(self, model: MTPModel, inputs: Tensor, indices: Tensor) -> Outputs:
        """The trunk's output (B, T, D) for `inputs` (B, T), the blocks `indices` (B,): the
        ones not seen before run through the trunk together, the others come from memory.
        With a `compute` of its own, what it returns for them (a tuple stays a tuple)."""
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


__all__ = ["TrunkCache"]
