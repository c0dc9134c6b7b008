"""A separate, smaller draft model proposes γ tokens per step (Leviathan et al. 2023;
transformers' `assistant_model=`): any model `mtp.load` reads that shares the target's
tokenizer, each draft drawn under the target's sampling rule, so acceptance stays exact.

Its own KV cache holds every accepted token but the last two, which the first draft forward
feeds together (after a step that kept every draft, the last draft was never fed); its
forwards have two shapes, (B, 2) and (B, 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mtp.cli import check_flag, check_positive
from mtp.decode.drafters.base import ChainDrafter, DrafterContext, Drafts, check_threshold
from mtp.decode.drafters.registry import register
from mtp.decode.forward import prefill
from mtp.decode.sampling import SamplingConfig
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


@dataclass(frozen=True, kw_only=True)
class DraftModelOptions:
    """drafter=draft_model: draft_model, a checkpoint that shares the target's tokenizer;
    num_draft, drafts per step; threshold, stop drafting once a draft's top probability falls
    below it (0: never); adaptive, drafts per step follow recent acceptance."""

    draft_model: str | None = None
    num_draft: int = 4
    threshold: float = 0.0
    adaptive: bool = False

    def __post_init__(self) -> None:
        check_positive("num_draft", self.num_draft)
        check_threshold(self.threshold)  # draft-exit: see ChainDrafter.forward_drafts
        check_flag("adaptive", self.adaptive)  # DraftBudget: from acceptance


@register
class DraftModel(ChainDrafter):
    """`model` (with its `tokenizer`, which must be the target's) drafts `num_draft` tokens."""

    name = "draft_model"
    Options = DraftModelOptions
    feeds = 2  # the last two accepted tokens (module docstring)
    rowwise = (*ChainDrafter.rowwise, "_cache")

    def __init__(self, model: MTPModel, tokenizer: Tokenizer, num_draft: int = 4,
                 threshold: float = 0.0, adaptive: bool = False) -> None:
        if not isinstance(model, MTPModel):
            raise ValueError(f"the draft model must be an MTPModel (see mtp.load), got "
                             f"{type(model).__name__}")
        self.size(num_draft, threshold, adaptive)
        self.model, self.tokenizer = model.eval(), tokenizer
        self._cache: KVCache | None = None

    @classmethod
    def check_named(cls, options: DraftModelOptions) -> None:
        if options.draft_model is None:
            raise ValueError("drafter=draft_model needs draft_model=PATH (a checkpoint that "
                             "shares the tokenizer)")

    @classmethod
    def from_options(cls, model: MTPModel, options: DraftModelOptions,
                     context: DrafterContext) -> DraftModel:
        """The draft model checkpoint, loaded on the target's device and dtype."""
        from mtp.checkpoint import load  # the one drafter that reads a checkpoint

        cls.check_named(options)
        param = next(model.parameters())
        small, tokenizer = load(options.draft_model, device=param.device, dtype=param.dtype)
        return cls(small, tokenizer, options.num_draft, options.threshold, options.adaptive)

    @classmethod
    def candidates(cls, model: MTPModel, options: DraftModelOptions, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[DraftModel]:
        """The draft model, when one is given."""
        if options.draft_model is not None:
            yield cls.from_options(model, options, context)

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:
        if tokenizer.fingerprint != self.tokenizer.fingerprint:
            raise ValueError(f"the draft model's tokenizer ({self.tokenizer!r}) differs from the "
                             f"target's ({tokenizer!r}): a draft model must share the tokenizer")
        if self.model.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"the draft model's vocab_size={self.model.config.vocab_size} "
                             f"differs from the target's {model.config.vocab_size}")
        mine, theirs = next(self.model.parameters()), next(model.parameters())
        if mine.device != theirs.device:
            raise ValueError(f"the draft model is on {mine.device} but the target on "
                             f"{theirs.device}: move them to one device")

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        config = self.model.config
        needed = max(map(len, prompts))
        if needed >= config.max_seq_len:
            raise ValueError(f"the draft model's max_seq_len={config.max_seq_len} cannot hold "
                             f"a prompt of {needed} tokens")
        super().start(model, prompts, cache, sampling, generator)
        param = next(self.model.parameters())
        self._cache = KVCache(config, len(prompts), cache.max_len, device=param.device,
                              dtype=param.dtype)
        # Every prompt token but the last: `propose` feeds it with the first new token.
        prefill(self.model, self._cache, [ids[:-1] for ids in prompts], 1,
                pad_id=self.tokenizer.pad_id)

    def propose(self) -> Drafts:
        return self.forward_drafts(self.model, self._cache)
