"""A lower bound on one training step's device memory: refuse what cannot fit, before training.

Per rank, in bytes (D width, V vocabulary, B x T tokens per micro-batch, P parameters):

    states        16 P / ranks   float32 parameters, gradients, AdamW's two moments (sharded
                                 by FSDP); 4 bytes for a frozen trunk's (Medusa-1) parameters
    activations   32 D B T per block whose activations wait for the backward: every trunk
                  block (none when frozen or checkpointed) and one head's blocks
    logits        4 B T V per head alive at once: one (headwise), every head (naive), none
                  (chunked)

32 bytes per token and width is a floor (an eager bf16 block saves about 57); fragmentation,
gathered FSDP units and the CUDA context are ignored: a run this lets through may still run
out of memory, one it refuses cannot fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtp.model import MTPConfig, MTPModel

STATE_BYTES = 16  # float32 parameter, gradient, AdamW exp_avg and exp_avg_sq
ACTIVATION_BYTES = 32  # per token, per unit of width, per block (a floor; see above)
LOGIT_BYTES = 4  # float32 logits for the cross-entropy
GIB = 2**30


@dataclass(frozen=True)
class StepMemory:
    """The lower bound's parts, in bytes per rank."""

    states: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.states + self.activations + self.logits


def count_parameters(config: MTPConfig) -> tuple[int, int]:
    """Parameters of a model of `config`, and of its base model (`is_base_parameter`)."""
    with torch.device("meta"):
        named = [(name, p.numel()) for name, p in MTPModel(config).named_parameters()]
    return sum(n for _, n in named), sum(n for name, n in named
                                         if MTPModel.is_base_parameter(name))


def step_memory(config: MTPConfig, *, batch: int, seq_len: int, loss_mode: str = "headwise",
                activation_checkpointing: str = "none", freeze_trunk: bool = False,
                ranks: int = 1) -> StepMemory:
    """The lower bound for one micro-batch of `batch` x `seq_len`."""
    tokens = batch * seq_len
    per_block = ACTIVATION_BYTES * config.dim * tokens
    frozen_trunk = freeze_trunk or activation_checkpointing in ("trunk", "all")
    trunk = 0 if frozen_trunk else config.n_layers
    # One head's blocks; a frozen head 0 keeps none, and resblock/linear heads keep vectors.
    blocks_trained = not freeze_trunk or config.head_type == "block"
    head = config.head_layers if blocks_trained and activation_checkpointing != "all" else 0
    heads_alive = {"naive": config.n_future, "headwise": 1, "chunked": 0}[loss_mode]
    parameters, base = count_parameters(config)
    frozen = base if freeze_trunk else 0
    return StepMemory(
        states=(STATE_BYTES * (parameters - frozen) + 4 * frozen) // max(ranks, 1),
        activations=(trunk + head) * per_block,
        logits=heads_alive * LOGIT_BYTES * tokens * config.vocab_size)


def check_fits(memory: StepMemory, *, capacity: int, device: str, what: str) -> None:
    """ValueError naming `what` (the model, batch and sequence) unless `memory` fits."""
    if memory.total > capacity:
        raise ValueError(
            f"{what} needs at least {memory.total / GIB:.1f} GiB per device (parameters, "
            f"gradients and AdamW state {memory.states / GIB:.1f} GiB, activations "
            f"{memory.activations / GIB:.1f} GiB, logits {memory.logits / GIB:.1f} GiB), more "
            f"than {device}'s {capacity / GIB:.1f} GiB: lower data.batch_size or seq_len, set "
            f"activation_checkpointing=trunk or loss.mode=chunked, choose a smaller model, or "
            f"shard it with trainer=fsdp over more GPUs")
