"""The key/value cache of every block of an `MTPModel`, preallocated and written by index.

Decoding feeds the model's cached forward three explicit inputs, bundled as a `CacheStep`:
the rotary position of each new token, the cache slot its key and value go to, and the mask
of the cache slots each new token attends to. The cache itself is storage only: it keeps no
lengths and no step state, so one decode step has the same tensor shapes from the first
token to the last, and can be captured once (CUDA graphs) and replayed.

`cache_step(lengths, offsets, visible, key_len)` builds a step from per-row lengths that
live on the device: row b's new token i sits at position lengths[b] + offsets[i] (its depth,
in a tree), is written to slot lengths[b] + i, and sees the row's cached prefix (slots below
lengths[b]) and the new tokens `visible[i]` allows (itself, and in a tree its ancestors).
Attention runs over the first `key_len` slots, a fixed width: slots past a row's length are
either rolled-back drafts or unwritten, and the mask hides them.

After a tree step, `compact(lengths, path)` moves the accepted root-to-node path's keys and
values to the slots right after the prefix, by one gather and one scatter per store: the
cache is then exactly what running the path alone would have left.

An exact step (`window=W`, decoding's exact mode) also says, for each new token at position
p, where the W positions p - W + 1 .. p sit in the cache (`CacheStep.window`): before the
step's own tokens at their positions' slots, then along the token's path in the step's tree.
The model's attention then sees every token in the same order whatever step it is computed
in (`model.windowed_attention`): its keys before its window at their own slots, and its
window gathered in position order, so that a token's arithmetic depends only on the tokens
before it, never on the drafts around it or on where they sit.

Shapes in comments: B batch, T new tokens, L key width, K key/value heads, hd head width.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
from torch import Tensor


class CacheShape(Protocol):
    """What the cache needs of a model's config (`MTPConfig` has it): the model imports this
    module, not the other way round."""

    @property
    def n_blocks(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class Window(NamedTuple):
    """An exact step's view of each new token's last W positions (the module docstring), as
    the model's attention reads it; every field made once per step, for every layer."""

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
    """The step of T new tokens after each row's `lengths` (B,) cached ones.

    offsets (T,): new token i's position after the row's length (0, 1, 2, ... for a chain;
        the node's depth in a tree, so siblings share a position); (B, T) when each row has
        its own tree (a dynamic tree), as `visible` and `ancestors` then are too.
    visible (T, T) bool: new token i sees new token j; the diagonal must be True.
    key_len: the attention width L, at least max(lengths) + T and at most the cache's length.
    max_position: positions are clamped below it (the model's rotary table): only tokens
        past the end of the context reach it, and their output is never kept.
    window, ancestors: an exact step of window W (module docstring); ancestors (T, D + 1):
        the step's token on token i's path at each depth 0..D (`tree.TreeBuffers`); dtype:
        the model's, that of the attention biases.
    """
    new, batch = offsets.shape[-1], lengths.shape[0]
    device = lengths.device
    steps = torch.arange(new, device=device)
    slots = lengths[:, None] + steps  # (B, T)
    positions = lengths[:, None] + offsets  # (B, T)
    if window is not None:
        ancestors = ancestors.expand(batch, *ancestors.shape[-2:])  # (B, T, D + 1)
        return _exact_step(lengths, slots, positions, ancestors, key_len, window,
                           max_position, dtype)
    if max_position is not None:
        positions = positions.clamp(max=max_position - 1)
    relative = torch.arange(key_len, device=device) - lengths[:, None]  # (B, L): slot - length
    visible = visible.expand(batch, new, new)  # (B, T, T)
    among_new = visible.gather(2, relative.clamp(0, new - 1)[:, None].expand(-1, new, -1))
    among_new = among_new & ((relative >= 0) & (relative < new))[:, None]  # (B, T, L)
    mask = (relative < 0)[:, None] | among_new  # the prefix, or an allowed new token
    return CacheStep(positions, slots, mask[:, None])


def _exact_step(lengths: Tensor, slots: Tensor, positions: Tensor, ancestors: Tensor,
                key_len: int, window: int, max_position: int | None,
                dtype: torch.dtype) -> CacheStep:
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
    if max_position is not None:
        positions = positions.clamp(max=max_position - 1)
    return CacheStep(positions, slots, before[:, None],
                     Window(found, bias, prefix_bias, before.any(-1)[:, None]))


def causal(new: int, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """Offsets and visibility of T new tokens in a row (a chain): each sees those before it."""
    offsets = torch.arange(new, device=device)
    return offsets, torch.ones(new, new, dtype=torch.bool, device=device).tril()


class KVCache:
    """Keys and values of all blocks, (n_blocks, B, K, max_len, hd) each, written by index.

    Every write and move indexes the whole store with index tensors (block, row and slot; all
    key/value heads), never a view of it: `torch.compile` then updates the store in place,
    where a write into a view (`keys[block].scatter_`) is compiled as a copy of the block's
    whole store, and a move as a copy of the whole cache, at every step.

    `blocks`: the model's blocks the cache holds, when not all of them (a drafter that runs
    some heads alone keeps only theirs); `write` then takes the model's block index as ever.
    """

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

    def write(self, block: int | slice, step: CacheStep, keys: Tensor,
              values: Tensor) -> tuple[Tensor, Tensor]:
        """Write keys/values (B, K, T, hd) of `block` at the step's slots; return the block's
        first `step.key_len` slots, (B, K, L, hd) each.

        `block` may be a slice of n blocks, with keys and values (n, B, K, T, hd): the stacked
        heads write one layer of every head at once.
        """
        if isinstance(block, int):
            block -= self.first_block
            blocks = self._blocks[block:block + 1]  # (1,): a 0-d tensor would index as an int
        else:
            blocks = self._blocks[block][:, None, None]  # (n, 1, 1)
        index = (blocks, self._rows, slice(None), step.slots)  # -> ([n,] B, T, K, hd)
        self.keys[index] = keys.transpose(-3, -2)
        self.values[index] = values.transpose(-3, -2)
        width = step.key_len
        return self.keys[block][..., :width, :], self.values[block][..., :width, :]

    def compact(self, lengths: Tensor, path: Tensor) -> None:
        """Move each row's kept new tokens to the slots right after its prefix.

        lengths (B,): each row's prefix, before the step. path (B, P): indices of the last
        step's new tokens to keep, in order (a tree's root-to-node path); a row keeping fewer
        than P repeats its last one, whose copies land past its new length, where they are
        stale and hidden.
        """
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
