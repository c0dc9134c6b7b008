"""The key/value cache of every block of an `MTPModel`, preallocated and written by index.

The cache is storage only; a `CacheStep` gives the cached forward each new token's position,
cache slot and attention mask, so a decode step keeps its shapes from the first token to the
last (and can be captured once as a CUDA graph). After a tree step, `compact` moves the
accepted path right after the prefix. An exact step (`window=W`) also says where each new
token's last W positions sit, so `model.windowed_attention` sees every token's keys in the
same order whatever step computes it.

Shapes: B batch, T new tokens, L key width, K key/value heads, hd head width.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
from torch import Tensor


class CacheShape(Protocol):
    """What the cache needs of a model's config (`MTPConfig`), without importing the model."""

    @property
    def n_blocks(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class Window(NamedTuple):
    """An exact step's view of each new token's last W positions, made once per step."""

    slots: Tensor  # (B, T, W) the cache slots of the positions, in order (0 before position 0)
    bias: Tensor  # (B, T, W) 0, or -inf for a position before 0
    prefix_bias: Tensor  # (B, 1, T, L) 0 for the slots before the window, -inf for the rest
    seen: Tensor  # (B, 1, T) bool: whether any slot comes before the window


class CacheStep(NamedTuple):
    """Where a cached forward's T new tokens go and what they see (the model's inputs)."""

    positions: Tensor  # (B, T) rotary positions
    slots: Tensor  # (B, T) cache slots their keys and values are written to
    mask: Tensor  # (B, 1, T, L) bool: the cache slots each new token attends to
    window: Window | None = None  # an exact step's: each token's last W positions

    @property
    def key_len(self) -> int:
        return self.mask.shape[-1]


def cache_step(lengths: Tensor, offsets: Tensor, visible: Tensor, key_len: int,
               max_position: int | None = None, *, window: int | None = None,
               ancestors: Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> CacheStep:
    """The step of T new tokens after each row's `lengths` (B,) cached ones: row b's token i
    sits at position lengths[b] + offsets[i] and slot lengths[b] + i, and sees the prefix and
    the new tokens j where visible[i, j]. offsets (T,), or (B, T) with `visible` and
    `ancestors` per row too. key_len: the attention width L. max_position: positions are
    clamped below it. window, ancestors (T, D + 1): an exact step, and the token on token i's
    path at each depth (`tree.TreeBuffers`); dtype: that of the attention biases."""
    new, batch, device = offsets.shape[-1], lengths.shape[0], lengths.device
    slots = lengths[:, None] + torch.arange(new, device=device)  # (B, T)
    positions = lengths[:, None] + offsets  # (B, T)
    clamped = positions if max_position is None else positions.clamp(max=max_position - 1)
    if window is not None:
        ancestors = ancestors.expand(batch, *ancestors.shape[-2:])  # (B, T, D + 1)
        return _exact_step(lengths, slots, positions, clamped, ancestors, key_len, window, dtype)
    relative = torch.arange(key_len, device=device) - lengths[:, None]  # (B, L): slot - length
    visible = visible.expand(batch, new, new)  # (B, T, T)
    among_new = visible.gather(2, relative.clamp(0, new - 1)[:, None].expand(-1, new, -1))
    among_new = among_new & ((relative >= 0) & (relative < new))[:, None]  # (B, T, L)
    mask = (relative < 0)[:, None] | among_new  # the prefix, or an allowed new token
    return CacheStep(clamped, slots, mask[:, None])


def _exact_step(lengths: Tensor, slots: Tensor, positions: Tensor, clamped: Tensor,
                ancestors: Tensor, key_len: int, window: int, dtype: torch.dtype) -> CacheStep:
    """`cache_step` of an exact step: each token's window and the prefix before it."""
    device = lengths.device
    start = positions - (window - 1)  # (B, T): the window's first position
    before = torch.arange(key_len, device=device) < start[..., None]  # (B, T, L)
    seen = start[..., None] + torch.arange(window, device=device)  # (B, T, W) its positions
    depth = (seen - lengths[:, None, None]).clamp(0, ancestors.shape[-1] - 1)  # in the step
    node = ancestors.gather(2, depth)  # (B, T, W): the path's token at that depth
    inside = lengths[:, None, None] + node  # the slot of the path's token at that depth
    found = torch.where(seen < lengths[:, None, None], seen, inside).clamp(0, key_len - 1)
    zero = torch.zeros((), dtype=dtype, device=device)
    bias = torch.where(seen >= 0, zero, -math.inf)
    prefix_bias = torch.where(before, zero, -math.inf)[:, None]  # (B, 1, T, L)
    return CacheStep(clamped, slots, before[:, None],
                     Window(found, bias, prefix_bias, before.any(-1)[:, None]))


def causal(new: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """Offsets and visibility of T new tokens in a row (a chain): each sees those before it."""
    offsets = torch.arange(new, device=device)
    return offsets, torch.ones(new, new, dtype=torch.bool, device=device).tril()


class KVCache:
    """Keys and values of all blocks, (n_blocks, B, K, max_len, hd) each, written by index
    tensors, never a view: `torch.compile` then updates the store in place (a write into a
    view compiles to a copy of the whole store). `blocks`: the
    model's blocks held, when not all; `write` still takes the model's index."""

    def __init__(self, config: CacheShape, batch_size: int, max_len: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 blocks: range | None = None) -> None:
        self.first_block = 0 if blocks is None else blocks.start
        n_blocks = config.n_blocks if blocks is None else len(blocks)
        shape = (n_blocks, batch_size, config.n_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self._blocks = torch.arange(n_blocks, device=device)
        self._rows = torch.arange(batch_size, device=device)[:, None]  # (B, 1)

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def max_len(self) -> int:
        return self.keys.shape[3]

    def store(self, block: int) -> tuple[Tensor, Tensor]:
        """Block `block`'s whole stores, (B, K, max_len, hd) views, for `kernels.rope_write`."""
        block -= self.first_block
        return self.keys[block], self.values[block]

    def write(self, block: int | slice, step: CacheStep, keys: Tensor,
              values: Tensor) -> tuple[Tensor, Tensor]:
        """Write keys/values (B, K, T, hd) of `block` at the step's slots; return the block's
        first `step.key_len` slots, (B, K, L, hd) each. A slice of n blocks takes (n, B, K, T,
        hd): the stacked heads write one layer of every head at once."""
        if isinstance(block, int):
            block -= self.first_block
            blocks = self._blocks[block:block + 1]  # (1,): a 0-d tensor would index as an int
        else:
            blocks = self._blocks[block][:, None, None]  # (n, 1, 1)
        index = (blocks, self._rows, slice(None), step.slots)  # -> ([n,] B, T, K, hd)
        self.keys[index] = keys.transpose(-3, -2)
        self.values[index] = values.transpose(-3, -2)
        return self.keys[block][..., :step.key_len, :], self.values[block][..., :step.key_len, :]

    def compact(self, lengths: Tensor, path: Tensor) -> None:
        """Move each row's kept new tokens, path (B, P) in order, right after its prefix
        (lengths (B,)); a row keeping fewer repeats its last one (copies past its length)."""
        blocks = self._blocks[:, None, None]  # (n_blocks, 1, 1)
        source = lengths[:, None] + path  # (B, P)
        target = lengths[:, None] + torch.arange(path.shape[1], device=path.device)  # (B, P)
        for store in (self.keys, self.values):  # (n_blocks, B, K, max_len, hd)
            # Every kept slot is read before any is written: targets overlap sources.
            store[blocks, self._rows, :, target] = store[blocks, self._rows, :, source]

    def keep(self, rows: Tensor) -> None:
        """Keep only the sequences at batch `rows` (a 1-d index tensor), in that order."""
        self.keys = self.keys.index_select(1, rows)
        self.values = self.values.index_select(1, rows)
        self._rows = torch.arange(rows.shape[0], device=rows.device)[:, None]
