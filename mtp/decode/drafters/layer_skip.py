"""Layer-skipping self-speculation (Draft & Verify, Zhang et al. 2023): the target drafts with
some of its trunk layers skipped, then verifies the drafts with all of them.

The draft pass runs on the target's own KV cache, writing only past each row's committed
tokens, in slots the verify pass overwrites. Which layers to skip is a search
(`mtp.generate.skip_search`), saved for the checkpoint (`SkipChoice`, `layer_skip.json`).
No second model and no training; drafts are drawn by the target's sampling rule from the
skipped model's distribution, so acceptance stays exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mtp.cli import check_flag, check_positives
from mtp.decode.drafters.base import ChainDrafter, DrafterContext, Drafts, check_threshold
from mtp.decode.drafters.registry import register
from mtp.decode.sampling import SamplingConfig
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.paths import read_saved, write_json
from mtp.tokenizers import Tokenizer

SKIP_FILE = "layer_skip.json"


def check_skip(skip: object, n_layers: int) -> tuple[int, ...]:
    """`skip` as sorted trunk layer indices, or a ValueError naming what is wrong with it."""
    if isinstance(skip, (str, bytes)) or not isinstance(skip, Sequence):
        raise ValueError(f"skip must be a list of trunk layer indices, got {skip!r:.80}")
    for layer in skip:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n_layers:
            raise ValueError(f"skip={list(skip)!r} names layer {layer!r}, but the model's trunk "
                             f"has layers 0..{n_layers - 1}")
    if len(set(skip)) != len(skip):
        raise ValueError(f"skip={list(skip)!r} names a layer twice")
    if len(skip) == n_layers:
        raise ValueError(f"skip={list(skip)!r} skips every one of the trunk's {n_layers} "
                         f"layers: the draft would read the embedding alone")
    return tuple(sorted(skip))


@dataclass(frozen=True)
class SkipChoice:
    """A skip search's choice for one model (`layer_skip.json`): what to skip, how many drafts
    per step, and what the search measured (`details`)."""

    skip: tuple[int, ...]
    num_draft: int
    n_layers: int
    vocab_size: int
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "skip": list(self.skip)}

    def save(self, path: str | Path) -> Path:
        """Write the choice to `path` (a file, or a directory for its SKIP_FILE)."""
        path = Path(path)
        return write_json(path / SKIP_FILE if path.is_dir() else path, self.to_json())

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any], *, n_layers: int,
             vocab_size: int) -> SkipChoice:
        """A choice from its file or `to_json`'s form, refusing one made for another model's
        shape."""
        values, source = read_saved(source, "layer-skip choice")
        try:
            choice = cls(tuple(values["skip"]), int(values["num_draft"]),
                         int(values["n_layers"]), int(values["vocab_size"]),
                         values.get("details", {}))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"cannot read {source} as a layer-skip choice: {error}") from error
        if (choice.n_layers, choice.vocab_size) != (n_layers, vocab_size):
            raise ValueError(f"{source} was searched for a model of {choice.n_layers} layers "
                             f"and {choice.vocab_size} tokens, not this one ({n_layers}, "
                             f"{vocab_size}): search again (python -m mtp.generate.skip_search)")
        check_skip(list(choice.skip), n_layers)
        return choice


@dataclass(frozen=True, kw_only=True)
class LayerSkipOptions:
    """drafter=layer_skip: skip, the trunk layers to leave out (a list, or a layer_skip.json;
    null: the checkpoint's searched choice); num_draft, drafts per step (null: the search's,
    else 4); threshold, stop drafting below this top probability (0: never); adaptive, drafts
    per step follow recent acceptance."""

    skip: Any = None
    num_draft: int | None = None
    threshold: float = 0.0
    adaptive: bool = False

    def __post_init__(self) -> None:
        check_positives(self, "num_draft", optional=True)
        check_threshold(self.threshold)
        check_flag("adaptive", self.adaptive)
        skip = self.skip
        if skip is not None and (isinstance(skip, bytes)
                                 or not isinstance(skip, (str, Sequence))):
            raise ValueError(f"skip must be a list of trunk layer indices or a "
                             f"layer_skip.json, got {skip!r:.80}")


@register
class LayerSkip(ChainDrafter):
    """The target drafts `num_draft` tokens with its trunk layers `skip` left out."""

    name = "layer_skip"
    Options = LayerSkipOptions
    saved, saved_file = "layer_skip", SKIP_FILE  # python -m mtp.generate.skip_search
    shown = ("skip", "num_draft")
    feeds = 1  # the root: the target's cache holds every accepted token but it

    def __init__(self, skip: Sequence[int], num_draft: int = 4, threshold: float = 0.0,
                 adaptive: bool = False) -> None:
        if isinstance(skip, (str, bytes)) or not isinstance(skip, Sequence):
            raise ValueError(f"skip must be a list of trunk layer indices, got {skip!r:.80}")
        self.skip = tuple(skip)  # checked against the model in `check`
        self.size(num_draft, threshold, adaptive)

    @classmethod
    def from_options(cls, model: MTPModel, options: LayerSkipOptions,
                     context: DrafterContext) -> LayerSkip:
        """Layer skipping with `skip`, or the choice in its file, or the checkpoint's."""
        chosen = _choice(model, options, context)
        if chosen is None:
            raise ValueError("drafter=layer_skip needs skip=[layers] or a searched choice: "
                             "python -m mtp.generate.skip_search checkpoint=...")
        skip, num_draft = chosen
        return cls(skip, options.num_draft or num_draft, options.threshold, options.adaptive)

    @classmethod
    def candidates(cls, model: MTPModel, options: LayerSkipOptions, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[LayerSkip]:
        """The searched choice, when the checkpoint has one (or skip= is given)."""
        if _choice(model, options, context) is not None:
            yield cls.from_options(model, options, context)

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:
        self.skip = check_skip(self.skip, model.config.n_layers)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        super().start(model, prompts, cache, sampling, generator)
        self._model, self._cache = model, cache  # self.skip was checked by `check`

    def propose(self) -> Drafts:
        return self.forward_drafts(self._model, self._cache, self.skip)


def _choice(model: MTPModel, options: LayerSkipOptions,
            context: DrafterContext) -> tuple[Sequence[int], int] | None:
    """The layers to skip and the drafts per step: given, from a file, or saved; or None."""
    shape = {"n_layers": model.config.n_layers, "vocab_size": model.config.vocab_size}
    if options.skip is None:
        saved = context.saved.get(LayerSkip.saved)
        choice = None if saved is None else SkipChoice.load(saved, **shape)
    elif isinstance(options.skip, str):
        if not Path(options.skip).is_file():
            raise ValueError(f"skip={options.skip!r} is neither a list of trunk layers nor a "
                             f"layer_skip.json file")
        choice = SkipChoice.load(options.skip, **shape)
    else:
        return options.skip, 4  # checked against the model by LayerSkip.check
    return None if choice is None else (choice.skip, choice.num_draft)
