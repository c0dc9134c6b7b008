"""Drafters by name and options: one validated `DrafterSpec` for generate's and eval's command
lines (their arguments extend it) and the scripts, and `make_drafter`, the one function
`generate` resolves names with.

    DrafterSpec()                                         the model's heads, every one
    DrafterSpec(drafter="heads", k=4)                     heads 1..3 draft, head 0 verifies
    DrafterSpec(drafter="heads", tree="tree16")           the heads' 16-node candidate tree
    DrafterSpec(drafter="prompt_lookup", num_draft=8)
    DrafterSpec(drafter="lookahead", window=5, ngram=4, guesses=5)
    DrafterSpec(drafter="draft_model", draft_model="runs/small/export", num_draft=4)
    DrafterSpec(drafter="layer_skip", skip=[4, 5, 6], num_draft=4, threshold=0.6)
    DrafterSpec(drafter="auto")                           measured: see `auto.choose_drafter`

Options are checked when the spec is made, each against the drafters it sizes, so a command
line with an option its drafter ignores fails before anything loads. What needs the model
(k within its heads, a tree within k) is checked when the drafter is built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mtp.decode.drafters import (Combined, DraftModel, Drafter, HeadsDrafter, LayerSkip,
                                   Lookahead, OnlineHeads, OwnHeads, PromptLookup,
                                   SequentialDrafter)
from mtp.decode.drafters.base import check_flag, check_threshold
from mtp.decode.drafters.layer_skip import SkipChoice, default_skip_file
from mtp.decode.tree import Calibration, Tree, resolve_tree
from mtp.model import MTPModel

AUTOREGRESSIVE = "autoregressive"
DRAFTERS = ("auto", AUTOREGRESSIVE, "heads", "prompt_lookup", "heads+prompt_lookup",
            "draft_model", "layer_skip", "lookahead")
# Which drafters each option sizes ("auto" takes the options of the candidates it measures).
OPTIONS = {
    "k": ("auto", "heads", "heads+prompt_lookup"),
    "tree": ("auto", "heads"),
    "num_draft": ("auto", "prompt_lookup", "heads+prompt_lookup", "draft_model",
                  "layer_skip"),
    "max_ngram": ("auto", "prompt_lookup", "heads+prompt_lookup"),
    "min_ngram": ("auto", "prompt_lookup", "heads+prompt_lookup"),
    "window": ("lookahead",),
    "ngram": ("lookahead",),
    "guesses": ("lookahead",),
    "draft_model": ("auto", "draft_model"),
    "skip": ("layer_skip",),
    "threshold": ("draft_model", "layer_skip"),
    "adaptive": ("prompt_lookup", "heads+prompt_lookup", "draft_model", "layer_skip"),
    "online": ("heads",),
}


@dataclass(frozen=True, kw_only=True)
class DrafterSpec:
    """A drafter by name, with the options that size it (None: the drafter's default).

    drafter: a name from DRAFTERS; the default, the model's own heads, builds for any model
        (a model with one head decodes autoregressively). The command lines default to
        "auto", which measures (`auto.choose_drafter`) rather than builds.
    k: the heads' tokens per forward pass at most (heads 1..k-1 draft; None: every head;
        1: autoregressive; "auto": measure the heads' k alone).
    tree: the heads' candidate tree (`tree.resolve_tree`: chain, tree8..tree64, auto:N, a
        .json file or a list of rank paths).
    num_draft: drafts per step of prompt lookup (8), the draft model (4) or layer skipping
        (4, or its saved choice's).
    max_ngram, min_ngram: prompt lookup's n-gram sizes (4, 2).
    window, ngram, guesses: lookahead's Jacobi window W (5), n-gram size N (4) and the most
        n-grams G verified per step (5).
    draft_model: a checkpoint sharing the target's tokenizer.
    skip: the trunk layers layer skipping leaves out: a list, or a `layer_skip.json` from
        `python -m mtp.generate.skip_search` (the command lines find the checkpoint's own).
    threshold: the draft model's and layer skipping's draft-exit: a row stops drafting once
        its draft's top probability falls below it (0: never).
    adaptive: prompt lookup's, the draft model's and layer skipping's number of drafts
        follows each row's recent acceptance (`drafters.base.DraftBudget`); default false.
    online: the heads keep learning from the target between calls (`drafters.online`:
        greedy output unchanged, sampling lossless); default false.
    """

    drafter: str = "heads"
    k: int | str | None = None
    tree: Any = None
    num_draft: int | None = None
    max_ngram: int | None = None
    min_ngram: int | None = None
    window: int | None = None
    ngram: int | None = None
    guesses: int | None = None
    draft_model: str | None = None
    skip: Any = None
    threshold: float | None = None
    adaptive: bool | None = None
    online: bool | None = None

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r}: choose one of "
                             f"{', '.join(DRAFTERS)}")
        for option, users in OPTIONS.items():
            if getattr(self, option) is not None and self.drafter not in users:
                raise ValueError(f"{option}={getattr(self, option)!r} sizes "
                                 f"{' or '.join(u for u in users if u != 'auto')}, not "
                                 f"drafter={self.drafter!r}")
        k = self.k
        if k is not None and k != "auto" and (not isinstance(k, int) or isinstance(k, bool)
                                              or k < 1):
            raise ValueError(f"k must be an integer >= 1, 'auto' or None (every head), got "
                             f"{k!r}")
        if k == "auto" and self.drafter not in ("auto", "heads"):
            raise ValueError(f"k='auto' measures the heads' k: use drafter=heads or auto, not "
                             f"{self.drafter!r}")
        if self.tree is not None and k == "auto":
            raise ValueError("tree= gives the heads one candidate tree; k='auto' measures "
                             "chains: choose one")
        if k == 1 and self.drafter == "heads+prompt_lookup":
            raise ValueError("drafter=heads+prompt_lookup needs k >= 2 (k=1 drafts nothing "
                             "with the heads): use drafter=prompt_lookup")
        if self.threshold is not None:
            check_threshold(self.threshold)
        if self.online is not None:
            check_flag("online", self.online)
        if self.drafter == "draft_model" and self.draft_model is None:
            raise ValueError("drafter=draft_model needs draft_model=PATH (a checkpoint that "
                             "shares the tokenizer)")

    @property
    def measured(self) -> bool:
        """Whether the drafter is chosen by measurement (`auto.choose_drafter`): auto, unless
        an integer k or a tree asks for the heads; or k='auto'."""
        return self.k == "auto" or (self.drafter == "auto" and self.k is None
                                    and self.tree is None)

    def build(self, model: MTPModel, calibration: Calibration | None = None) -> Drafter | None:
        """The drafter for `model` (None: autoregressive decoding).

        `calibration` (a checkpoint's tree.json) resolves tree=auto:N. A measured spec
        (drafter=auto, k=auto) is chosen by `auto.choose_drafter`, not built here.
        """
        if self.measured:
            raise ValueError(f"drafter={self.drafter!r}, k={self.k!r} is chosen by "
                             f"measurement: use mtp.generate.auto.choose_drafter (the command "
                             f"lines do) or Auto(...).choose()")
        name = "heads" if self.drafter == "auto" else self.drafter  # k= or tree= given
        if name == AUTOREGRESSIVE:
            return None
        if name == "prompt_lookup":
            return self.prompt_lookup()
        if name == "lookahead":
            return Lookahead(**self._given("window", "ngram", "guesses"))
        if name == "draft_model":
            return self.load_draft_model(model)
        if name == "layer_skip":
            return self.layer_skip(model)
        n_future = model.config.n_future
        k = n_future if self.k is None else self.k
        if not 1 <= k <= n_future:
            raise ValueError(f"k must be from 1 to n_future={n_future}, got k={k}")
        if self.tree is not None:
            if k == 1:
                raise ValueError(f"a tree needs k from 2 to n_future={n_future}, got k=1")
            tree = resolve_tree(self.tree, k=k, vocab_size=model.config.vocab_size,
                                calibration=calibration)
            return heads_drafter(model, k, tree, online=bool(self.online))
        if k == 1:  # heads 1..k-1 draft nothing
            if name == "heads":
                return None
            raise ValueError(f"drafter={name!r} needs the heads, but the model has one "
                             f"(n_future=1): use drafter=prompt_lookup")
        heads = heads_drafter(model, k, online=bool(self.online))
        return heads if name == "heads" else Combined(heads, self.prompt_lookup())

    def with_saved_choice(self, checkpoint: str | Path) -> DrafterSpec:
        """This spec, with layer skipping's choice saved beside `checkpoint`
        (`python -m mtp.generate.skip_search`) when skip= is not given: the command lines'."""
        if self.drafter != "layer_skip" or self.skip is not None:
            return self
        saved = default_skip_file(checkpoint)
        return replace(self, skip=str(saved)) if saved.is_file() else self

    def prompt_lookup(self) -> PromptLookup:
        """Prompt lookup with this spec's options."""
        return PromptLookup(**self._given("num_draft", "max_ngram", "min_ngram", "adaptive"))

    def load_draft_model(self, model: MTPModel) -> DraftModel:
        """The draft model checkpoint, loaded on the target's device and dtype."""
        from mtp.checkpoint import load  # checkpoint loading is not needed for any other drafter

        param = next(model.parameters())
        small, tokenizer = load(self.draft_model, device=param.device, dtype=param.dtype)
        return DraftModel(small, tokenizer, **self._given("num_draft", "threshold", "adaptive"))

    def layer_skip(self, model: MTPModel) -> LayerSkip:
        """Layer skipping with this spec's skip list, or the choice saved in its file."""
        if self.skip is None:
            raise ValueError("drafter=layer_skip needs skip=[layers] or a layer_skip.json: "
                             "search one with python -m mtp.generate.skip_search checkpoint=...")
        options = self._given("num_draft", "threshold", "adaptive")
        if isinstance(self.skip, str):
            if not Path(self.skip).is_file():
                raise ValueError(f"skip={self.skip!r} is neither a list of trunk layers nor a "
                                 f"layer_skip.json file")
            choice = SkipChoice.load(self.skip, n_layers=model.config.n_layers,
                                     vocab_size=model.config.vocab_size)
            return LayerSkip(choice.skip, **{"num_draft": choice.num_draft, **options})
        return LayerSkip(self.skip, **options)  # checked against the model by its `check`

    def _given(self, *names: str) -> dict[str, Any]:
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


def heads_drafter(model: MTPModel, k: int, tree: Tree | None = None, *,
                  online: bool = False) -> OwnHeads:
    """The model's own heads as the drafter (`drafter=heads`): parallel heads draft at once
    (`HeadsDrafter`, `OnlineHeads` learning as they go), sequential modules one depth after
    another (`SequentialDrafter`)."""
    if model.config.head_type != "sequential":
        return OnlineHeads(k, tree) if online else HeadsDrafter(k, tree)
    if online:
        raise ValueError("online=true trains parallel heads; model.head_type='sequential' "
                         "modules draft a chain that cannot learn online here")
    return SequentialDrafter(k, tree)


def make_drafter(model: MTPModel, drafter: Drafter | DrafterSpec | str | None) -> Drafter | None:
    """What `generate` decodes with: a drafter, or None for autoregressive decoding.

    `drafter`: a `Drafter`, a `DrafterSpec`, a name from DRAFTERS (with default options), or
    None (autoregressive).
    """
    if drafter is None or isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, str):
        drafter = DrafterSpec(drafter=drafter)
    if not isinstance(drafter, DrafterSpec):
        raise ValueError(f"drafter must be a Drafter, a DrafterSpec, a name or None, got "
                         f"{drafter!r:.80}")
    return drafter.build(model)
