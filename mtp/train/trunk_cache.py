"""Medusa-1's frozen trunk, run once: its output for each training block, kept for every epoch.

With the base model frozen (`optim.freeze_trunk`), a block's trunk output never changes, and
on a CPU it is most of a step: SmolLM2-135M's 30 blocks against three heads' resblocks and
their share of the unembedding. `TrunkCache` computes the output of the blocks a batch brings
that it has not seen (one batched forward, no graph) and reads the others from memory, so
from the second epoch on a step runs the heads alone. The loss is the same: `mtp_loss` takes
the cached output as `trunk_out` and goes on from there, and the heads' gradients are those
of a step through the trunk (tests/test_trunk_cache.py).

A block is known by its index in the training set (`PackedBlocks` hands it out as
batch["index"]); a streamed corpus has none and is refused. The cache holds a (seq_len, dim)
tensor per block in the trunk's output dtype (float32 under bf16-mixed too: the residual
stream stays float32): 0.23 GB per 100,000 tokens at SmolLM2's width 576.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtp.model import MTPModel


class TrunkCache:
    """The frozen trunk's outputs by training-block index."""

    def __init__(self) -> None:
        self._outputs: dict[int, Tensor] = {}

    def __len__(self) -> int:
        return len(self._outputs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._outputs.values())

    @torch.no_grad()
    def trunk_out(self, model: MTPModel, inputs: Tensor, indices: Tensor) -> Tensor:
        """The trunk's output (B, T, D) for `inputs` (B, T), the blocks `indices` (B,): the
        ones not seen before run through the trunk together, the others come from memory."""
        if indices.shape != inputs.shape[:1]:
            raise ValueError(f"one index per block: indices of shape {tuple(indices.shape)} "
                             f"for inputs of shape {tuple(inputs.shape)}")
        keys = indices.tolist()
        new = [row for row, key in enumerate(keys) if key not in self._outputs]
        if new:
            outputs = model.trunk(inputs[new])
            for row, output in zip(new, outputs):
                self._outputs[keys[row]] = output.clone()  # not a view of the batch's tensor
        return torch.stack([self._outputs[key] for key in keys]).to(inputs.device)


__all__ = ["TrunkCache"]
