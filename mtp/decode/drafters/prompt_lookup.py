"""Prompt lookup (n-gram) drafting (Saxena 2023; transformers' `prompt_lookup_num_tokens`):
the longest suffix n-gram of the context (n from `max_ngram` down to `min_ngram`) is looked
up at its most recent earlier occurrence, and the `num_draft` tokens that followed it are the
drafts. No extra model; deterministic drafts (one-hot q) keep decoding exact. Code repeats
its identifiers and boilerplate, so it often pays there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mtp.cli import check_flag, check_positive
from mtp.decode.drafters.base import ChainDrafter, DrafterContext, Drafts, Verified
from mtp.decode.drafters.registry import register
from mtp.decode.sampling import SamplingConfig
from mtp.kv_cache import KVCache
from mtp.model import MTPModel


class NgramIndex:
    """The context of one sequence and each n-gram's latest continuation (updated as tokens
    arrive: a lookup is one dictionary probe per n, not a scan)."""

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


@dataclass(frozen=True, kw_only=True)
class PromptLookupOptions:
    """drafter=prompt_lookup: num_draft, drafts per step; max_ngram, min_ngram, the n-gram
    sizes looked up; adaptive, drafts per step follow each row's recent acceptance
    (`base.DraftBudget`)."""

    num_draft: int = 8
    max_ngram: int = 4
    min_ngram: int = 2
    adaptive: bool = False

    def __post_init__(self) -> None:
        check_positive("num_draft", self.num_draft)
        check_flag("adaptive", self.adaptive)
        check_positive("min_ngram", self.min_ngram)
        check_positive("max_ngram", self.max_ngram)
        if self.max_ngram < self.min_ngram:
            raise ValueError(f"max_ngram={self.max_ngram} must be >= min_ngram="
                             f"{self.min_ngram}")


@register
class PromptLookup(ChainDrafter):
    """Drafts `num_draft` tokens by n-gram lookup in the context (`max_ngram`..`min_ngram`)."""

    name = "prompt_lookup"
    Options = PromptLookupOptions
    shown = ("num_draft", "max_ngram", "min_ngram")
    rowwise = (*ChainDrafter.rowwise, "_rows")

    def __init__(self, num_draft: int = 8, max_ngram: int = 4, min_ngram: int = 2,
                 adaptive: bool = False) -> None:
        PromptLookupOptions(num_draft=num_draft, max_ngram=max_ngram, min_ngram=min_ngram,
                            adaptive=adaptive)  # checked
        self.size(num_draft, adaptive=adaptive)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._rows: list[NgramIndex] = []

    @classmethod
    def candidates(cls, model: MTPModel, options: PromptLookupOptions, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[PromptLookup]:
        yield cls.from_options(model, options, context)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        super().start(model, prompts, cache, sampling, generator)
        self._device = next(model.parameters()).device
        self._rows = [NgramIndex(ids, self.min_ngram, self.max_ngram) for ids in prompts]

    def update(self, step: Verified) -> None:
        for row, ids in zip(self._rows, step.new_ids):
            row.extend(ids)
        super().update(step)

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
