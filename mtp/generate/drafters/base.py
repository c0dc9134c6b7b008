"""The drafter seam of speculative decoding: who proposes tokens, apart from who verifies them.

A drafter proposes draft tokens for every sequence of the batch, with the distributions q it
drew them from (or none: a deterministic drafter's q is one-hot on its draft, for which the
acceptance rule is still exact). The decode step verifies them with the target model and
accepts a path (`acceptance.accept`); then it tells the drafter what happened, so that the
drafter can update its own state (a draft model's cache, prompt lookup's n-gram index, the
heads' hidden states). Verification and acceptance never know who drafted, as in vLLM's
proposer/scorer split and transformers' `CandidateGenerator`.

Every drafter has a fixed shape, its `tree` (a chain of `max_drafts` drafts, or a tree of
`max_drafts` nodes under the last accepted token), and proposes exactly `max_drafts` drafts
per row at every step; a row with fewer real drafts pads, and `Drafts.lengths` says how
many are real. So the verify forward has the same shape at every step (`engine.py`).

The decode loop, in the drafter's words:

    drafter.start(model, prompts, ...)           once, before the target's prefill
    loop:
        drafter.update(verified)                 what the last forward verified and accepted
        drafter.keep(rows)                       now and then: finished sequences leave
        drafts = drafter.propose()               max_drafts drafts per row
        (verify [last token, drafts]; accept a path)

The drafters are this package's other modules (see its `__init__`); `mtp.generate.spec`
builds them from names and options.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mtp.generate.sampling import SamplingConfig
from mtp.generate.tree import Tree
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


@dataclass(frozen=True)
class Drafts:
    """Draft tokens (B, n): the nodes 1..n of the drafter's tree, for every row.

    probs: the proposal distributions q (B, n, V), or None for a deterministic drafter (q is
        then one-hot on each draft). For siblings of a tree: q given the earlier siblings.
    lengths: how many leading drafts of each row are real (B,), or None when all n are. A
        row's drafts past its length are padding: never accepted, and with no q (the
        correction there is drawn from the target alone).
    """

    tokens: Tensor
    probs: Tensor | None = None
    lengths: Tensor | None = None

    @property
    def count(self) -> int:
        """Draft positions per row (n)."""
        return self.tokens.shape[1]

    def real(self) -> Tensor:
        """Real drafts of each row (B,), on the device."""
        if self.lengths is not None:
            return self.lengths
        return torch.full((self.tokens.shape[0],), self.count, device=self.tokens.device)

    def proposal(self, vocab_size: int) -> Tensor:
        """q (B, n, V) with padding rows zero: one-hot where the drafter gave none."""
        if self.probs is not None:
            probs = self.probs
        else:
            probs = torch.zeros(*self.tokens.shape, vocab_size, device=self.tokens.device)
            probs.scatter_(-1, self.tokens[..., None], 1.0)
        if self.lengths is not None:
            real = torch.arange(self.count, device=probs.device) < self.lengths[:, None]
            probs = probs * real[..., None]
        return probs


@dataclass(frozen=True)
class Verified:
    """What one forward pass of the target verified and accepted, for every row.

    pending: the verified tokens (B, m): the last accepted token (the tree's root), then the
        drafts.
    node: (B,) the pending index of the last kept node (0: none kept); n_accepted (B,) its
        depth, the drafts kept.
    tokens: (B, depth + 1): the kept drafts, then at index n_accepted the correction (or
        bonus) token, which is the next step's root.
    hidden: (B, n_heads, D): the target's heads' hidden states at `node`, which predict the
        tokens after the new root (heads 0..n_heads-1 as the drafter asked, `verify_heads`).
    predicted: each row's head-0 argmax after every pending token, on the host (None after
        the prefill); lookahead's Jacobi update.
    new_ids: each row's new tokens on the host (the kept drafts and the new root); [] for a
        row that had finished before this step.
    path_hidden: (B, P, n_heads, D): the heads' hidden states at every token this forward
        added to the cache, in order: the kept path (the root, then the kept drafts); after
        the prefill, the whole prompt. Row b's first path_lengths[b] entries are real (the
        rest repeat or pad). What a drafter with modules of its own (EAGLE-style) feeds them.
    The prefill counts as verifying the prompt's last token: m = 1, no drafts.
    """

    pending: Tensor
    node: Tensor
    n_accepted: Tensor
    tokens: Tensor
    hidden: Tensor
    new_ids: list[list[int]]
    predicted: list[list[int]] | None = None
    path_hidden: Tensor | None = None
    path_lengths: Tensor | None = None

    def last_two(self) -> Tensor:
        """The last two accepted tokens of each row (B, 2): the one before the newest, and it."""
        return torch.cat([self.pending.gather(1, self.node[:, None]),
                          self.tokens.gather(1, self.n_accepted[:, None])], dim=1)


class Drafter(ABC):
    """Proposes drafts for one `generate` call at a time; `start` resets its state."""

    #: Name in `python -m mtp.generate drafter=...`.
    name: str = ""

    @property
    @abstractmethod
    def tree(self) -> Tree:
        """The fixed shape of every proposal: `Tree.chain(n)` for a chain of n drafts."""

    @property
    def max_drafts(self) -> int:
        """Drafts per step (the verify forward has one more token)."""
        return self.tree.n_nodes - 1

    @property
    def max_depth(self) -> int:
        """The most drafts one step can accept: the tree's depth. Sizes the per-depth
        acceptance statistics."""
        return self.tree.depth

    def verify_heads(self, model: MTPModel) -> int:
        """How many of the target's heads the verify forward runs (their hidden states at the
        kept node reach `update`); only head 0 unless the drafter reads the others."""
        return 1

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:  # noqa: B027 (optional)
        """Raise ValueError before any decoding if the drafter cannot serve this model."""

    @abstractmethod
    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], max_len: int,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Begin a call: prompts as token ids (each starting with its document token), before
        any update. `max_len` bounds the tokens of any row, drafts included."""

    @abstractmethod
    def update(self, step: Verified) -> None:
        """Learn what the target accepted in its last forward pass (every row of the batch)."""

    @abstractmethod
    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences at batch `rows`, in that order."""

    @abstractmethod
    def propose(self) -> Drafts:
        """Drafts for the next forward pass: exactly `max_drafts` per row (padded)."""

    def __repr__(self) -> str:
        return self.name


def check_positive(name: str, value: object, least: int = 1) -> int:
    """`value` as an int >= `least`, or a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value
