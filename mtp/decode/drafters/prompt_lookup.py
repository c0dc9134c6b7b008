"""Prompt lookup (n-gram) drafting: propose what followed the last n-gram where it occurred before.

Saxena 2023; transformers' `prompt_lookup_num_tokens`, vLLM's n-gram speculator. The last n
tokens of the context (the prompt and the text generated so far), for n from `max_ngram` down
to `min_ngram`, are looked up among the context's earlier n-grams; at the most recent earlier
occurrence of the longest one that occurs, the `num_draft` tokens that followed it are the
drafts. Code repeats its identifiers, signatures and boilerplate, so this often pays there;
no extra model, and deterministic drafts (one-hot q) keep greedy and sampled decoding exact.

Each row keeps an index n-gram -> where its latest occurrence ends, updated as tokens arrive,
so a lookup costs one dictionary probe per n rather than a scan of the context.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mtp.decode.drafters.base import (DraftBudget, Drafter, Drafts, Verified, check_flag,
                                        check_positive)
from mtp.decode.sampling import SamplingConfig
from mtp.decode.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel


class NgramIndex:
    """The context of one sequence and, per n-gram size, each n-gram's latest continuation."""

    def __init__(self, ids: Sequence[int], min_ngram: int, max_ngram: int) -> None:
        self.ids: list[int] = []
        self.sizes = range(max_ngram, min_ngram - 1, -1)  # longest first
        self.index: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it
        self.extend(ids)

    def extend(self, ids: Sequence[int]) -> None:
        for token in ids:
            # The n-grams ending just before this token now have a continuation: this token.
            end = len(self.ids)
            for n in self.sizes:
                if end >= n:
                    self.index[tuple(self.ids[end - n:end])] = end
            self.ids.append(token)

    def lookup(self, num_draft: int) -> list[int]:
        """The continuation of the longest suffix n-gram seen before (most recent), or []."""
        end = len(self.ids)
        for n in self.sizes:
            if end >= n and (at := self.index.get(tuple(self.ids[end - n:]))) is not None:
                return self.ids[at:at + num_draft]
        return []


class PromptLookup(Drafter):
    """Drafts `num_draft` tokens by n-gram lookup in the context (`max_ngram`..`min_ngram`)."""

    name = "prompt_lookup"

    def __init__(self, num_draft: int = 8, max_ngram: int = 4, min_ngram: int = 2,
                 adaptive: bool = False) -> None:
        self.num_draft = check_positive("num_draft", num_draft)
        self.adaptive = check_flag("adaptive", adaptive)  # DraftBudget: from acceptance
        self.min_ngram = check_positive("min_ngram", min_ngram)
        self.max_ngram = check_positive("max_ngram", max_ngram)
        if max_ngram < min_ngram:
            raise ValueError(f"max_ngram={max_ngram} must be >= min_ngram={min_ngram}")
        self._rows: list[NgramIndex] = []

    @property
    def tree(self) -> Tree:
        return Tree.chain(self.num_draft)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self._device = next(model.parameters()).device
        self._rows = [NgramIndex(ids, self.min_ngram, self.max_ngram) for ids in prompts]
        self._budget = DraftBudget(self.num_draft, len(prompts)) if self.adaptive else None

    def update(self, step: Verified) -> None:
        for row, ids in zip(self._rows, step.new_ids):
            row.extend(ids)
        if self._budget is not None:
            self._budget.update(step)

    def keep(self, rows: list[int]) -> None:
        self._rows = [self._rows[row] for row in rows]
        if self._budget is not None:
            self._budget.keep(rows)

    def propose(self) -> Drafts:
        limits = self._budget.counts if self._budget else [self.num_draft] * len(self._rows)
        found = [row.lookup(limit) for row, limit in zip(self._rows, limits)]
        if self._budget is not None:
            self._budget.proposed = [len(ids) for ids in found]
        width = self.num_draft  # padded to the fixed shape; an eager step cuts it to the
        # longest match of the batch, and `lengths` keeps the padding from being accepted
        tokens = torch.tensor([ids + [0] * (width - len(ids)) for ids in found])
        lengths = torch.tensor([len(ids) for ids in found])
        return Drafts(tokens.to(self._device), None, lengths.to(self._device))

    def __repr__(self) -> str:
        return (f"prompt_lookup(num_draft={self.num_draft}, max_ngram={self.max_ngram}, "
                f"min_ngram={self.min_ngram}{', adaptive' if self.adaptive else ''})")
