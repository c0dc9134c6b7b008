"""Drafters by name, as `generate(drafter=...)`, `python -m mtp.generate drafter=...` and
`python -m mtp.eval drafter=...` take them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtp.generate.auto import AUTOREGRESSIVE, Auto
from mtp.generate.combined import Combined
from mtp.generate.draft_model import DraftModel
from mtp.generate.drafter import Drafter
from mtp.generate.heads_drafter import HeadsDrafter
from mtp.generate.lookahead import Lookahead
from mtp.generate.prompt_lookup import PromptLookup
from mtp.generate.tree import Calibration, Tree, resolve_tree
from mtp.model import MTPModel

DRAFTERS = ("auto", AUTOREGRESSIVE, "heads", "prompt_lookup", "heads+prompt_lookup",
            "draft_model", "lookahead")
_USES_K = ("auto", "heads", "heads+prompt_lookup")
AUTO_TREE_SIZES = (16, 32, 64)  # the calibrated trees `auto` measures against the chain


def resolve_drafter(model: MTPModel, drafter: Drafter | Auto | str | None,
                    k: int | str | None, tree: Any = None) -> Drafter | Auto | None:
    """What `generate` decodes with: a drafter, an `Auto` to measure, or None (autoregressive).

    `k` sizes the heads drafter (None: every head, 1: autoregressive, "auto": measured);
    `tree` gives it a candidate tree (`tree.resolve_tree`) within k heads.
    """
    n_future = model.config.n_future
    if tree is not None:
        if drafter not in (None, "heads") or k == "auto":
            raise ValueError(f"tree= is the heads drafter's candidate tree: use drafter=heads "
                             f"(or None) and an integer k, not drafter={drafter!r}, k={k!r}")
        heads = n_future if k is None else k
        if not isinstance(heads, int) or isinstance(heads, bool) or not 2 <= heads <= n_future:
            raise ValueError(f"a tree needs k from 2 to n_future={n_future}, got k={k!r}")
        return HeadsDrafter(heads, resolve_tree(tree, n_heads=heads,
                                                vocab_size=model.config.vocab_size))
    if k is not None and k != "auto" and (not isinstance(k, int) or isinstance(k, bool)
                                          or not 1 <= k <= n_future):
        raise ValueError(f"k must be an integer from 1 to n_future={n_future}, 'auto' or None, "
                         f"got {k!r}")
    if isinstance(drafter, (Drafter, Auto)):
        if k is not None:
            raise ValueError(f"k={k!r} sizes the heads drafter; {drafter!r} is sized by its own "
                             f"arguments: leave k=None")
        return drafter
    name = "heads" if drafter is None else drafter
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTERS)}")
    if k is not None and name not in _USES_K and not (name == AUTOREGRESSIVE and k == 1):
        raise ValueError(f"k={k!r} sizes the heads drafter, not drafter={name!r}")
    if name == "draft_model":
        raise ValueError("drafter='draft_model' needs the draft model: pass "
                         "DraftModel(model, tokenizer) (Python) or draft_model=PATH (CLI)")
    if name == "auto" or k == "auto":
        return Auto(heads_only=name != "auto")
    if name == AUTOREGRESSIVE:
        return None
    if name == "prompt_lookup":
        return PromptLookup()
    if name == "lookahead":
        return Lookahead()
    k = n_future if k is None else k
    if k == 1:  # heads 1..k-1 draft nothing
        if name == "heads":
            return None
        raise ValueError(f"drafter={name!r} needs the heads, but k=1 (n_future={n_future}): "
                         f"use drafter=prompt_lookup")
    heads = HeadsDrafter(k)
    return heads if name == "heads" else Combined(heads, PromptLookup())


def drafter_from_options(model: MTPModel, name: str, *, k: int | str | None = None,
                         draft_model: str | None = None, num_draft: int | None = None,
                         max_ngram: int | None = None, min_ngram: int | None = None,
                         calibration: str | Path | None = None, tree: Any = None,
                         trees: Calibration | None = None, window: int | None = None,
                         ngram: int | None = None,
                         guesses: int | None = None) -> Drafter | Auto | str:
    """The command lines' drafter for `model`: a name plus its options (None: a default).

    `draft_model` is a checkpoint path, loaded onto the model's device and dtype; `num_draft`
    sizes prompt lookup or the draft model; `window`, `ngram` and `guesses` size lookahead;
    `calibration` is where `auto` caches its choice.
    `tree` gives the heads a candidate tree (drafter auto or heads); `trees`, a checkpoint's
    tree calibration, resolves `auto:N` and makes its auto:N trees candidates of `auto`.
    Pass the result to `generate(drafter=...)` with k=None ("autoregressive" for no drafter).
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}: choose one of {', '.join(DRAFTERS)}")
    if tree is not None:
        if name not in ("auto", "heads") or k == "auto":
            raise ValueError(f"tree= is the heads drafter's candidate tree, not for "
                             f"drafter={name!r}, k={k!r}")
        heads = model.config.n_future if k is None else k
        return resolve_drafter(model, "heads", heads, resolve_tree(
            tree, n_heads=heads, vocab_size=model.config.vocab_size, calibration=trees))
    if name == "auto" and k is not None:  # k=3 (or k=auto) alone asks for the heads
        name = "heads"
    uses_lookup = name in ("auto", "prompt_lookup", "heads+prompt_lookup")
    for option, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
        if value is not None and not uses_lookup:
            raise ValueError(f"{option} configures prompt lookup, not drafter={name!r}")
    if num_draft is not None and name in (AUTOREGRESSIVE, "heads"):
        raise ValueError(f"num_draft sizes prompt lookup or the draft model, not "
                         f"drafter={name!r} (use k=)")
    if draft_model is not None and name not in ("draft_model", "auto"):
        raise ValueError(f"draft_model= is for drafter=draft_model or auto, not {name!r}")
    lookahead = _given(window=window, ngram=ngram, guesses=guesses)
    if lookahead and name != "lookahead":
        raise ValueError(f"{next(iter(lookahead))}= configures lookahead, not drafter={name!r}")
    if name == "lookahead":
        if k is not None or num_draft is not None:
            raise ValueError(f"lookahead is sized by window=, ngram= and guesses=, not "
                             f"{'k' if k is not None else 'num_draft'}=")
        return Lookahead(**lookahead)
    if name == "draft_model" and draft_model is None:
        raise ValueError("drafter=draft_model needs draft_model=PATH (a checkpoint that shares "
                         "the tokenizer)")
    drafts_model = None
    if draft_model is not None:
        from mtp.checkpoint import load

        param = next(model.parameters())
        small, tokenizer = load(draft_model, device=param.device, dtype=param.dtype)
        drafts_model = DraftModel(small, tokenizer, **_given(num_draft=num_draft))
        if name == "draft_model":
            return drafts_model
    lookup_num = None if name == "auto" and draft_model is not None else num_draft
    lookup = PromptLookup(**_given(num_draft=lookup_num, max_ngram=max_ngram,
                                   min_ngram=min_ngram))
    if name == "auto" or k == "auto":
        return Auto(heads_only=name != "auto", draft_model=drafts_model, prompt_lookup=lookup,
                    calibration=calibration, trees=auto_trees(model, trees))
    if name == "prompt_lookup":
        if k is not None:
            raise ValueError(f"k={k!r} sizes the heads drafter: use num_draft= for prompt lookup")
        return lookup
    resolved = resolve_drafter(model, name, k)
    if isinstance(resolved, Combined):  # heads+prompt_lookup with this lookup's options
        return Combined(resolved.drafters[0], lookup)
    return AUTOREGRESSIVE if resolved is None else resolved


def auto_trees(model: MTPModel, calibration: Calibration | None) -> tuple[Tree, ...]:
    """`auto`'s candidate trees: a calibrated checkpoint's auto:N for N in AUTO_TREE_SIZES."""
    if calibration is None or model.config.n_future < 2:
        return ()
    return tuple(resolve_tree(f"auto:{size}", n_heads=model.config.n_future,
                              vocab_size=model.config.vocab_size, calibration=calibration)
                 for size in AUTO_TREE_SIZES)


def _given(**options):
    return {key: value for key, value in options.items() if value is not None}
