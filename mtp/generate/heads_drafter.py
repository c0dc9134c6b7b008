"""The model's own heads as the drafter: blockwise self-speculative decoding.

Heads 1..k-1 at the last accepted position propose the k - 1 tokens after the next one; the
verify forward runs heads 0..k-1 as one batched block (`StackedHeads`), so every pending
position also yields the hidden states for the next drafts, at no extra forward pass. The
worked example in `speculative.py` follows one step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mtp.generate.drafter import Drafter, Drafts, Verified, check_positive
from mtp.generate.sampling import SamplingConfig, probabilities, sample
from mtp.generate.stacked_heads import StackedHeads, stacked_heads
from mtp.model import MTPModel


def draft(head_logits: Tensor, config: SamplingConfig,
          generator: torch.Generator | None = None) -> Drafts:
    """Drafts from the logits (B, k - 1, V) of heads 1..k-1 at the last accepted position."""
    probs = probabilities(head_logits, config)  # (B, k - 1, V)
    return Drafts(sample(probs, generator), probs)


class HeadsDrafter(Drafter):
    """Heads 1..k-1 draft: k tokens per forward pass at most (2 <= k <= n_future)."""

    name = "heads"

    def __init__(self, k: int) -> None:
        self.k = check_positive("k", k, least=2)
        self._last: Tensor | None = None  # (B, k - 1, D): heads 1..k-1 at the last position

    @property
    def max_drafts(self) -> int:
        return self.k - 1

    def verify_heads(self, model: MTPModel) -> StackedHeads:
        return stacked_heads(model, self.k)  # heads 0..k-1, one batched block per layer

    def check(self, model: MTPModel, tokenizer) -> None:
        n_future = model.config.n_future
        if self.k > n_future:
            raise ValueError(f"the heads drafter needs k from 2 to n_future={n_future}, got "
                             f"k={self.k}" + (" (the model has one head: use another drafter)"
                                              if n_future == 1 else ""))

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], max_len: int,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self._model, self._sampling, self._generator = model, sampling, generator
        self._last = None

    def update(self, step: Verified) -> None:
        rows = torch.arange(step.hidden.shape[0], device=step.hidden.device)
        self._last = step.hidden[rows, step.n_accepted, 1:]  # (B, k - 1, D)

    def keep(self, rows: list[int]) -> None:
        self._last = self._last[torch.tensor(rows, device=self._last.device)]

    def propose(self, limit: int) -> Drafts:
        logits = self._model.unembed(self._last[:, :limit])  # (B, limit, V)
        return draft(logits, self._sampling, self._generator)

    def __repr__(self) -> str:
        return f"heads(k={self.k})"
