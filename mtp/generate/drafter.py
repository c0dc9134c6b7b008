"""The drafter seam of speculative decoding: who proposes tokens, apart from who verifies them.

A drafter proposes draft tokens for every sequence of the batch, with the distributions q it
drew them from (or none: a deterministic drafter's q is one-hot on its draft, for which the
acceptance rule is still exact). The decode loop verifies them with the target model and
accepts a prefix (`speculative.accept`); then it tells the drafter what happened, so that the
drafter can update its own state (a draft model's cache, prompt lookup's n-gram index, the
heads' hidden states). Verification and acceptance never know who drafted, as in vLLM's
proposer/scorer split and transformers' `CandidateGenerator`.

The decode loop's step, in the drafter's words:

    drafter.start(model, prompts, ...)           once, after the target's prefill
    loop:
        drafter.update(step)                     what the last forward verified and accepted
        drafter.keep(rows)                       finished sequences leave the batch
        drafts = drafter.propose(limit)          at most `limit` drafts per sequence
        (verify pending = [last token, drafts]; accept a prefix)

Drafters live one per file: `heads_drafter.py` (the model's own heads), `draft_model.py`,
`prompt_lookup.py`, `lookahead.py` (Jacobi iteration and an n-gram pool), `combined.py`
(several drafters, the longest draft per sequence);
`auto.py` picks the fastest by measurement and `names.py` builds drafters from names.
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


@dataclass(frozen=True)
class Drafts:
    """Draft tokens (B, n) and how they were proposed.

    probs: the proposal distributions q (B, n, V), or None for a deterministic drafter (q is
        then one-hot on each draft). For siblings of a tree: q given the earlier siblings.
    lengths: how many leading drafts of each row are real, or None when all n are. A row's
        drafts past its length are padding: never accepted, and with no q (the correction
        there is drawn from the target alone).
    tree: the parent links when the drafts are a tree's nodes 1..n (`tree.py`), shared by
        the batch; None for a chain (draft i follows draft i - 1).
    """

    tokens: Tensor
    probs: Tensor | None = None
    lengths: Tensor | None = None
    tree: Tree | None = None

    @property
    def count(self) -> int:
        """Draft positions per row (n)."""
        return self.tokens.shape[1]

    def real(self) -> list[int]:
        """Real drafts of each row, on the host."""
        if self.lengths is None:
            return [self.count] * self.tokens.shape[0]
        return self.lengths.tolist()

    def __getitem__(self, rows: Tensor | slice) -> Drafts:
        return Drafts(self.tokens[rows], None if self.probs is None else self.probs[rows],
                      None if self.lengths is None else self.lengths[rows], self.tree)

    def first(self, n: int) -> Drafts:
        """The first n drafts of every sequence (of a tree: its first n + 1 nodes' subtree)."""
        return Drafts(self.tokens[:, :n], None if self.probs is None else self.probs[:, :n],
                      None if self.lengths is None else self.lengths.clamp(max=n),
                      None if self.tree is None else self.tree.first(n + 1))

    def shape(self) -> Tree:
        """The tree these drafts fill: their own, or the chain of n drafts."""
        return self.tree if self.tree is not None else Tree.chain(self.count)

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

    @staticmethod
    def none(batch: int, device: torch.device | str) -> Drafts:
        """No drafts at all: the step verifies only the last token (an autoregressive step)."""
        return Drafts(torch.zeros(batch, 0, dtype=torch.long, device=device))


@dataclass(frozen=True)
class Verified:
    """What one forward pass of the target verified and what was accepted.

    pending: the verified tokens (B, m): the last accepted token, then the drafts.
    n_accepted: (B,) drafts kept; tokens (B, m): the kept drafts, then the correction (or
        bonus) token at index n_accepted.
    node: (B,) the pending index of the last kept draft (0: none); n_accepted for a chain,
        the accepted path's last node for a tree.
    hidden: the target's heads' hidden states (B, m, n_heads, D) at the pending positions.
    logits: head 0's logits (B, m, V) at the pending positions (None after the prefill).
    new_ids: each row's new tokens on the host (the kept drafts and the correction).
    The prefill counts as verifying the prompt's last token: m = 1, no drafts.
    """

    pending: Tensor
    n_accepted: Tensor
    tokens: Tensor
    hidden: Tensor
    new_ids: list[list[int]]
    node: Tensor | None = None  # None: n_accepted
    logits: Tensor | None = None

    @property
    def last_node(self) -> Tensor:
        """(B,) the pending index whose hidden states predict the next tokens."""
        return self.n_accepted if self.node is None else self.node

    def last_two(self) -> Tensor:
        """The last two accepted tokens of each row (B, 2): the one before the newest, and it."""
        return torch.cat([self.pending.gather(1, self.last_node[:, None]),
                          self.tokens.gather(1, self.n_accepted[:, None])], dim=1)


class Drafter(ABC):
    """Proposes drafts for one `generate` call at a time; `start` resets its state."""

    #: Name in `python -m mtp.generate drafter=...`.
    name: str = ""

    @property
    @abstractmethod
    def max_drafts(self) -> int:
        """The most drafts it proposes per step (the verify forward has one more token)."""

    @property
    def max_depth(self) -> int:
        """The most drafts one step can accept: max_drafts for a chain, less for a tree (its
        depth). Sizes the per-depth acceptance statistics."""
        return self.max_drafts

    def verify_heads(self, model: MTPModel) -> int:
        """How many of the target's heads the verify forward must run (their hidden states
        reach `update`); only head 0 unless the drafter reads the others."""
        return 1

    def check(self, model: MTPModel, tokenizer) -> None:  # noqa: B027 (optional hook)
        """Raise ValueError before any decoding if the drafter cannot serve this model."""

    @abstractmethod
    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], max_len: int,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Begin a call: prompts as token ids (each starting with EOS), before any update."""

    @abstractmethod
    def update(self, step: Verified) -> None:
        """Learn what the target accepted in its last forward pass (every row of the batch)."""

    @abstractmethod
    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences at batch `rows`, in that order."""

    @abstractmethod
    def propose(self, limit: int) -> Drafts:
        """Drafts for the next forward pass: at most `limit` per row (limit <= max_drafts)."""

    def __repr__(self) -> str:
        return self.name


def check_positive(name: str, value: object, least: int = 1) -> int:
    """`value` as an int >= `least`, or a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value
