"""The drafter seam of speculative decoding: who proposes tokens, apart from who verifies them.

A drafter proposes draft tokens for every sequence of the batch, with the distributions q it
drew them from (or none: a deterministic drafter's q is one-hot on its draft, for which the
acceptance rule is still exact). The decode step verifies them with the target model and
accepts a path (`acceptance.accept`); then it hands the drafter what that forward pass
verified and kept (`Verified`), from which the drafter updates its own state (a draft
model's cache, prompt lookup's n-gram index, the heads' hidden states). Verification and
acceptance never know who drafted, as in vLLM's proposer/scorer split and transformers'
`CandidateGenerator`; and `Verified` holds only facts of verification (what ran, what each
head computed, what was kept), so a new drafter takes what it needs from it and adds no
field to it.

Every drafter has a fixed shape, its `tree` (a chain of `max_drafts` drafts, or a tree of
`max_drafts` nodes under the last accepted token), and proposes exactly `max_drafts` drafts
per row at every step; a row with fewer real drafts pads, and `Drafts.lengths` says how
many are real. So a compiled verify forward has the same shape at every step, and an eager
one verifies a chain only up to the batch's longest real proposal (`engine.py`).

The decode loop (`decode.py`), in the drafter's words:

    drafter.start(model, prompts, ...)           once, before the target's prefill
    drafter.update(verified)                     the prefill: the prompts, the first token
    loop:
        drafts = drafter.propose()               draft: max_drafts drafts per row
        (verify [last token, drafts]; accept a path)
        drafter.update(verified)                 commit: what the forward verified and kept
        drafter.keep(rows)                       now and then: finished sequences leave

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
    """What one forward pass of the target verified and kept, for every row (B rows).

    pending (B, m): the tokens the forward ran on: the last accepted token (the tree's root),
        then the drafts; after the prefill, the prompts (right-padded).
    hidden (B, m, n, D): heads 0..n-1's hidden states at every pending token, before the
        shared norm (n: the drafter's `verify_heads`).
    predicted (B, m): head 0's argmax after every pending token; None after the prefill.
    path (B, P): the pending indices that stay in the cache, in order: the kept root-to-node
        path (the root, then the kept drafts); after the prefill, the whole prompt.
    kept (B,): how many leading entries of `path` are real; 0 for a row that had finished.
    tokens (B, P): the token after each path entry: the kept drafts, then the new root (the
        correction or bonus token) at index kept - 1; after the prefill, the prompt after
        its first token, then the first new token.
    new_ids: each row's new tokens on the host (the kept drafts and the new root); [] for a
        row that had finished before this step.
    last (B,): the pending index of each row's last kept token, whose heads predict the
        tokens after the new root (the root for a finished row); the engine always sets it.

    A plain record: the engine fills every field, and a drafter reads the ones it needs.
    """

    pending: Tensor
    hidden: Tensor
    predicted: Tensor | None
    path: Tensor
    kept: Tensor
    tokens: Tensor
    new_ids: list[list[int]] | None = None
    last: Tensor | None = None

    def last_two(self) -> Tensor:
        """The last two accepted tokens of each row (B, 2): the one before the newest, and it."""
        index = (self.kept - 1).clamp(min=0)[:, None]  # each row's last entry of `path`
        newest = self.tokens.gather(1, index)
        return torch.cat([self.pending.gather(1, self.path.gather(1, index)), newest], dim=1)

    def path_hidden(self) -> Tensor:
        """The heads' hidden states (B, P, n, D) at the path's tokens: every token this forward
        added to the cache, in order (row b's first kept[b] are real)."""
        rows = torch.arange(self.path.shape[0], device=self.path.device)[:, None]
        return self.hidden[rows, self.path]


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
        """Learn what the target verified and kept in its last forward pass (every row)."""

    @abstractmethod
    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences at batch `rows`, in that order."""

    @abstractmethod
    def propose(self) -> Drafts:
        """Drafts for the next forward pass: exactly `max_drafts` per row (padded)."""

    def __repr__(self) -> str:
        return self.name


class Autoregressive(Drafter):
    """No drafts: one token per forward pass, the baseline every speed-up is measured
    against (`generate` with drafter=None)."""

    name = "autoregressive"

    @property
    def tree(self) -> Tree:
        return Tree.chain(0)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], max_len: int,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self._none = torch.zeros(len(prompts), 0, dtype=torch.long,
                                 device=next(model.parameters()).device)

    def update(self, step: Verified) -> None:
        pass

    def keep(self, rows: list[int]) -> None:
        self._none = self._none[:len(rows)]

    def propose(self) -> Drafts:
        return Drafts(self._none)


def check_positive(name: str, value: object, least: int = 1) -> int:
    """`value` as an int >= `least`, or a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value
