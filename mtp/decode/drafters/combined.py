"""Several drafters at once: each sequence takes the longest draft any of them proposes (ties:
the first listed). The pair that pays is the heads and prompt lookup: lookup's long drafts
where the context repeats, the heads' elsewhere. Every drafter hears every accepted token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from mtp.decode.drafters.base import Drafter, DrafterContext, Drafts, Verified
from mtp.decode.drafters.heads import OwnHeads
from mtp.decode.drafters.prompt_lookup import PromptLookup, PromptLookupOptions
from mtp.decode.drafters.registry import register
from mtp.decode.sampling import SamplingConfig
from mtp.decode.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


class Combined(Drafter):
    """The longest draft per sequence among `drafters` (ties: the earlier one)."""

    def __init__(self, *drafters: Drafter) -> None:
        if len(drafters) < 2 or not all(isinstance(d, Drafter) for d in drafters):
            raise ValueError(f"Combined needs two or more drafters, got {drafters!r}")
        trees = [d for d in drafters if not d.tree.is_chain]
        if trees:  # the longest draft per row is a chain's notion; tree nodes are not a prefix
            raise ValueError(f"Combined takes chains of drafts, not the candidate tree of "
                             f"{trees[0]!r}")
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)

    @property
    def tree(self) -> Tree:
        return Tree.chain(max(d.max_drafts for d in self.drafters))

    def verify_heads(self, model: MTPModel) -> int:
        return max(d.verify_heads(model) for d in self.drafters)

    def verify_layers(self, model: MTPModel) -> tuple[int, ...]:
        return tuple(sorted({layer for d in self.drafters for layer in d.verify_layers(model)}))

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:
        for drafter in self.drafters:
            drafter.check(model, tokenizer)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self._vocab = model.config.vocab_size
        for drafter in self.drafters:
            drafter.start(model, prompts, cache, sampling, generator)

    def update(self, step: Verified) -> None:
        for drafter in self.drafters:
            drafter.update(step)

    def keep(self, rows: list[int]) -> None:
        for drafter in self.drafters:
            drafter.keep(rows)

    def propose(self) -> Drafts:
        proposals = [d.propose() for d in self.drafters]
        width = self.max_drafts
        lengths = torch.stack([p.real() for p in proposals])  # (n_drafters, B)
        choice = lengths.argmax(0)  # (B,): the first of the longest
        batch = choice.shape[0]
        qs = [p.proposal(self._vocab) for p in proposals]
        dtype = max((q.dtype for q in qs), key=lambda t: torch.finfo(t).bits)
        tokens = torch.zeros(batch, width, dtype=torch.long, device=choice.device)
        probs = torch.zeros(batch, width, self._vocab, device=choice.device, dtype=dtype)
        for index, (p, q) in enumerate(zip(proposals, qs)):
            rows = choice == index
            tokens[rows, :p.count] = p.tokens[rows]
            probs[rows, :p.count] = q[rows].to(dtype)
        return Drafts(tokens, probs, lengths.gather(0, choice[None])[0])

    def __repr__(self) -> str:
        return "+".join(map(repr, self.drafters))


CHAIN = re.compile(r"heads\(k=(\d+)\)")  # a chain of heads, as the heads' candidates say


@dataclass(frozen=True, kw_only=True)
class HeadsLookupOptions(PromptLookupOptions):
    """drafter=heads+prompt_lookup: prompt lookup's options, and k, the heads' tokens per
    forward pass (null: every head)."""

    k: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k is not None and (not isinstance(self.k, int) or isinstance(self.k, bool)
                                   or self.k < 2):
            raise ValueError(f"drafter=heads+prompt_lookup needs k >= 2 (k=1 drafts nothing "
                             f"with the heads: use drafter=prompt_lookup), got k={self.k!r}")


@register
class HeadsAndLookup(Combined):
    """The heads and prompt lookup together: the longer draft per row."""

    name = "heads+prompt_lookup"
    Options = HeadsLookupOptions
    after = ("heads", "prompt_lookup")

    @classmethod
    def from_options(cls, model: MTPModel, options: HeadsLookupOptions,
                     context: DrafterContext) -> HeadsAndLookup:
        n_future = model.config.n_future
        if n_future == 1:
            raise ValueError("drafter=heads+prompt_lookup needs the heads, but the model has "
                             "one (n_future=1): use drafter=prompt_lookup")
        k = n_future if options.k is None else options.k
        return cls(OwnHeads.variant(model, k), PromptLookup(
            options.num_draft, options.max_ngram, options.min_ngram, options.adaptive))

    @classmethod
    def candidates(cls, model: MTPModel, options: HeadsLookupOptions, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[HeadsAndLookup]:
        """The fastest chain of heads measured so far, with prompt lookup."""
        chains = {int(match[1]): rate for label, rate in measured.items()
                  if (match := CHAIN.fullmatch(label))}
        if chains:
            yield cls.from_options(model, replace(options, k=max(chains, key=chains.get)),
                                   context)

