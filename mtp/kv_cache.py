"""Key/value cache for every block of an `MTPModel` (trunk and heads), with cheap roll-back.

Each sequence in the batch has its own length, so ragged prompts and speculative steps that
accept a different number of tokens per sequence share one cache. New keys are written at
each sequence's own positions; a roll-back only lowers `lengths`, because anything past a
sequence's length is either overwritten by the next step or hidden by the causal mask.

Tree steps (Medusa, SpecInfer) and other custom layouts: `masked_step(offsets, visible)`
plans the next forward over m new tokens whose positions are each sequence's length plus
`offsets[i]` and which see the cached prefix plus the new tokens `visible[i]` allows. Their
keys and values still go to the m slots after each sequence's length, in order. Afterwards
`compact(kept)` keeps the chosen new tokens of each sequence (e.g. an accepted root-to-leaf
path), moved to the slots right after its prefix, and drops the rest. A kept path whose
node at depth d has offset d lands at slot length + d, its own position: the cache is then
exactly what running the path alone would have left.
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
    positions: Tensor  # (B, new) absolute positions (rotary), slots + offsets of a masked step
    slots: Tensor  # (B, new) where the keys and values are written: each length + 0..new-1
    mask: Tensor | None  # (B, 1, new, end), or None where nothing must be hidden
    start: int | None  # the shared length when every sequence has the same one
    end: int  # cached positions after this step, in the longest sequence
    planned: bool = False  # set by masked_step: positions() must be asked for exactly `new`


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
        self._last_new = 0  # tokens of the last committed step, which compact() may reorder

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def positions(self, new: int) -> Tensor:
        """Absolute positions (B, new) of the next `new` tokens; prepares this step's writes."""
        if self._step is not None and self._step.new == new:
            return self._step.positions  # the trunk and every head share one step
        if self._step is not None and self._step.planned:
            raise ValueError(f"masked_step() planned {self._step.new} new tokens, but the "
                             f"forward pass has {new}")
        end, slots, uniform = self._slots(new)
        mask = None  # one new token after equal histories sees every cached key
        if new > 1 or not uniform:
            # Attend to every cached key at or before the query's own position; keys past a
            # sequence's length are stale (rolled back, or another sequence's padding).
            key_pos = torch.arange(end, device=slots.device)
            mask = (key_pos <= slots[:, :, None])[:, None]  # (B, 1, new, end)
        self._step = _Step(new, slots, slots, mask, self.lengths[0] if uniform else None, end)
        return slots

    def masked_step(self, offsets: Tensor, visible: Tensor) -> None:
        """Plan the next forward over m new tokens laid out as a tree (or any custom pattern).

        New token i sits at position length + offsets[i] (its depth, in a tree) and attends
        to the whole cached prefix and to new token j where visible[i, j] (in a tree: its
        ancestors and itself). Both are shared by the batch; each sequence keeps its own
        length. The keys and values are written to slots length + 0..m-1, so offsets may
        repeat (siblings share a position). The next forward must have exactly m tokens.

        Args:
            offsets: (m,) integers in [0, m).
            visible: (m, m) booleans; every token must see itself.
        """
        if offsets.dim() != 1 or offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
            raise ValueError(f"offsets must be a 1-d integer tensor, got {offsets.dtype} "
                             f"of shape {tuple(offsets.shape)}")
        new = offsets.shape[0]
        if visible.shape != (new, new) or visible.dtype != torch.bool:
            raise ValueError(f"visible must be a ({new}, {new}) bool tensor for {new} offsets, "
                             f"got {visible.dtype} of shape {tuple(visible.shape)}")
        if new == 0 or offsets.min() < 0 or offsets.max() >= new:
            raise ValueError(f"offsets must lie in [0, {new}), got {offsets.tolist()}")
        if not visible.diagonal().all():
            raise ValueError("every new token must see itself: visible.diagonal() has False")
        end, slots, uniform = self._slots(new)
        device = slots.device
        offsets, visible = offsets.to(device), visible.to(device)
        relative = torch.arange(end, device=device) - slots[:, :1]  # (B, end): key - length
        among_new = visible[:, relative.clamp(0, new - 1)].transpose(0, 1)  # (B, new, end)
        among_new &= ((relative >= 0) & (relative < new))[:, None]
        mask = (relative < 0)[:, None] | among_new  # prefix, or an allowed new token
        self._step = _Step(new, slots[:, :1] + offsets, slots, mask[:, None],
                           self.lengths[0] if uniform else None, end, planned=True)

    def _slots(self, new: int) -> tuple[int, Tensor, bool]:
        """The end of a step of `new` tokens, their slots (B, new), and whether lengths agree."""
        end = max(self.lengths) + new
        if end > self.max_len:
            raise ValueError(f"{new} new tokens after {max(self.lengths)} cached ones exceed "
                             f"the cache's max_len={self.max_len}")
        device = self.keys.device
        uniform = len(set(self.lengths)) == 1
        if uniform:  # the common case (batch 1): one op, no copy from the host
            start = self.lengths[0]
            slots = torch.arange(start, start + new, device=device)
            return end, slots.expand(self.batch_size, new), True  # (B, new)
        starts = torch.tensor(self.lengths, device=device)
        return end, starts[:, None] + torch.arange(new, device=device), False  # (B, new)

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
            index = step.slots[:, None, :, None].expand_as(keys)  # broadcasts over blocks
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
        self._last_new = new

    def rollback(self, lengths: Sequence[int]) -> None:
        """Forget everything after `lengths[b]` tokens of each sequence b."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"rollback needs {self.batch_size} lengths, got {len(lengths)}")
        for b, (old, new) in enumerate(zip(self.lengths, lengths)):
            if not 0 <= new <= old:
                raise ValueError(f"sequence {b}: cannot roll back from {old} to {new} tokens")
        self.lengths = list(lengths)
        self._step = None
        self._last_new = 0

    def compact(self, kept: Sequence[Sequence[int]]) -> None:
        """Keep, of the last step's m new tokens, `kept[b]` for each sequence b; drop the rest.

        `kept[b]` lists new-token indices in [0, m) (a tree's accepted path, root first); their
        keys and values move to the slots right after the sequence's prefix, in that order,
        and its length becomes prefix + len(kept[b]). The kept tokens' offsets should be
        0, 1, 2, ... (a path through a tree), so that each one's position is its slot.
        """
        new = self._last_new
        if len(kept) != self.batch_size:
            raise ValueError(f"compact needs {self.batch_size} lists of kept tokens, "
                             f"got {len(kept)}")
        for b, nodes in enumerate(kept):
            if any(not 0 <= node < new for node in nodes) or len(set(nodes)) < len(nodes):
                raise ValueError(f"sequence {b}: kept tokens must be distinct indices of the "
                                 f"last step's {new} new tokens, got {list(nodes)}")
        prefix = [length - new for length in self.lengths]
        moved = [row for row, nodes in enumerate(kept) if list(nodes) != list(range(len(nodes)))]
        if moved:  # a kept prefix of the new tokens is in place already: a roll-back suffices
            width = max(len(kept[row]) for row in moved)
            rows = torch.tensor(moved, device=self.keys.device)
            base = torch.tensor([prefix[row] for row in moved], device=self.keys.device)
            # Rows shorter than `width` repeat their last kept token; the copies land past the
            # row's new length, where they are stale and never seen.
            source = torch.tensor([list(kept[row]) + [kept[row][-1]] * (width - len(kept[row]))
                                   for row in moved], device=self.keys.device)
            source = base[:, None] + source  # (R, width) slots to read
            target = base[:, None] + torch.arange(width, device=self.keys.device)
            for store in (self.keys, self.values):  # (n_blocks, B, K, max_len, hd)
                # Rows and slots are advanced indices split by a slice: (R, width) lead.
                store[:, rows[:, None], :, target] = store[:, rows[:, None], :, source]
        self.lengths = [start + len(nodes) for start, nodes in zip(prefix, kept)]
        self._step = None
        self._last_new = 0

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
        self._last_new = 0

    def _require_step(self) -> _Step:
        if self._step is None:
            raise RuntimeError("call positions() before update(): the model's forward does")
        return self._step
