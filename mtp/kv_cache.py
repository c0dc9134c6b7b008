"""Key/value cache for every block of an `MTPModel` (trunk and heads), with cheap roll-back.

Each sequence in the batch has its own length, so ragged prompts and speculative steps that
accept a different number of tokens per sequence share one cache. New keys are written at
each sequence's own positions; a roll-back only lowers `lengths`, because anything past a
sequence's length is either overwritten by the next step or hidden by the causal mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from mtp.model import MTPConfig


class _Step(NamedTuple):
    """One forward pass over `new` tokens, worked out once for the trunk and every head."""

    new: int
    positions: Tensor  # (B, new) absolute positions
    mask: Tensor | None  # (B, 1, new, end), or None where nothing must be hidden
    start: int | None  # the shared length when every sequence has the same one
    end: int  # cached positions after this step, in the longest sequence


class KVCache:
    """Keys and values of all blocks, (n_blocks, B, K, max_len, hd) each."""

    def __init__(self, config: MTPConfig, batch_size: int, max_len: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if max_len > config.max_seq_len:
            raise ValueError(f"cache max_len={max_len} exceeds the model's "
                             f"max_seq_len={config.max_seq_len}")
        shape = (config.n_blocks, batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        # Lengths live on the host: the decode loop decides them there, and reading them never
        # forces a device synchronisation.
        self.lengths: list[int] = [0] * batch_size
        self._step: _Step | None = None

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def positions(self, new: int) -> Tensor:
        """Absolute positions (B, new) of the next `new` tokens; prepares this step's writes."""
        if self._step is not None and self._step.new == new:
            return self._step.positions  # the trunk and every head share one step
        end = max(self.lengths) + new
        if end > self.max_len:
            raise ValueError(f"{new} new tokens after {max(self.lengths)} cached ones exceed "
                             f"the cache's max_len={self.max_len}")
        device = self.keys.device
        uniform = len(set(self.lengths)) == 1
        if uniform:  # the common case (batch 1): one op, no copy from the host
            start = self.lengths[0]
            positions = torch.arange(start, start + new, device=device)
            positions = positions.expand(self.batch_size, new)  # (B, new)
        else:
            starts = torch.tensor(self.lengths, device=device)
            positions = starts[:, None] + torch.arange(new, device=device)  # (B, new)
        mask = None  # one new token after equal histories sees every cached key
        if new > 1 or not uniform:
            # Attend to every cached key at or before the query's own position; keys past a
            # sequence's length are stale (rolled back, or another sequence's padding).
            key_pos = torch.arange(end, device=device)
            mask = (key_pos <= positions[:, :, None])[:, None]  # (B, 1, new, end)
        self._step = _Step(new, positions, mask, self.lengths[0] if uniform else None, end)
        return positions

    def update(self, block: int | slice, keys: Tensor,
               values: Tensor) -> tuple[Tensor, Tensor]:
        """Write this step's keys/values (B, K, new, hd) for `block`; return all up to the end.

        `block` may also be a slice of n blocks (a view of the cache), with keys and values
        (n, B, K, new, hd): the stacked heads write all their blocks of one layer at once.
        """
        step = self._require_step()
        if step.start is not None:  # equal lengths: a slice, no index tensor
            self.keys[block, :, :, step.start:step.end] = keys
            self.values[block, :, :, step.start:step.end] = values
        else:
            index = step.positions[:, None, :, None].expand_as(keys)  # broadcasts over blocks
            self.keys[block].scatter_(-2, index, keys)
            self.values[block].scatter_(-2, index, values)
        return self.keys[block, :, :, :step.end], self.values[block, :, :, :step.end]

    def attention_mask(self) -> Tensor | None:
        """Boolean mask (B, 1, new, end) for this step, or None where nothing must be hidden."""
        return self._require_step().mask

    def advance(self, new: int) -> None:
        """Commit a step of `new` tokens to every sequence (called by the model's forward)."""
        if self._step is None or self._step.new != new:
            raise RuntimeError("advance() must follow a forward over the same number of tokens")
        self.lengths = [length + new for length in self.lengths]
        self._step = None

    def rollback(self, lengths: Sequence[int]) -> None:
        """Forget everything after `lengths[b]` tokens of each sequence b."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"rollback needs {self.batch_size} lengths, got {len(lengths)}")
        for b, (old, new) in enumerate(zip(self.lengths, lengths)):
            if not 0 <= new <= old:
                raise ValueError(f"sequence {b}: cannot roll back from {old} to {new} tokens")
        self.lengths = list(lengths)
        self._step = None

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only the sequences at batch `rows`, in that order (drop finished ones)."""
        if not rows or any(not 0 <= row < self.batch_size for row in rows):
            raise ValueError(f"rows must be a non-empty list of batch indices in "
                             f"[0, {self.batch_size}), got {list(rows)}")
        index = torch.tensor(rows, device=self.keys.device)
        self.keys = self.keys.index_select(1, index)
        self.values = self.values.index_select(1, index)
        self.lengths = [self.lengths[row] for row in rows]
        self._step = None

    def _require_step(self) -> _Step:
        if self._step is None:
            raise RuntimeError("call positions() before update(): the model's forward does")
        return self._step
