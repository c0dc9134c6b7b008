"""The model's own heads as the drafter: blockwise self-speculative decoding, or a tree.

Heads 1..k-1 at the last accepted position propose the k - 1 tokens after the next one; the
verify forward runs heads 0..k-1, so the kept node also yields the hidden states for the
next drafts at no extra forward pass. With a candidate tree (`tree.py`) the heads propose
their top candidates along the tree's rank paths (Medusa).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mtp.cli import check_choice, check_flag, check_positive
from mtp.decode.drafters.base import Drafter, DrafterContext, Drafts, Verified
from mtp.decode.drafters.registry import AUTO, drafter_types, register
from mtp.decode.sampling import SamplingConfig, exponential, probabilities
from mtp.decode.tree import (Calibration, DynamicTree, Tree, TreeBuffers, best_paths,
                             resolve_tree)
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


def ranked(logits: Tensor, ranks: int, config: SamplingConfig,
           generator: torch.Generator | None = None, iid: bool = False
           ) -> tuple[Tensor, Tensor | None]:
    """The first `ranks` candidates of each distribution in `logits` (..., V): their tokens
    (..., ranks), and the q each was drawn from (..., ranks, V; None when greedy: the top
    ranks). Sampling, the r-th draw without replacement (the order of q / E, E ~ Exp(1) from
    `generator`), drawn from q without the earlier draws; with `iid`, independent races (SpecTr)."""
    if config.greedy:
        return logits.topk(ranks, dim=-1).indices, None
    shape = (*logits.shape[:-1], ranks, logits.shape[-1]) if iid else logits.shape
    noise = exponential(shape, generator, logits.device)
    q = probabilities(logits, config)  # (..., V)
    if iid:
        candidates = (q[..., None, :] / noise).argmax(-1)  # (..., ranks) independent races
        return candidates, q[..., None, :].expand(*candidates.shape, q.shape[-1])
    candidates = (q / noise).topk(ranks, dim=-1).indices  # (..., ranks) in draw order
    if ranks == 1:
        return candidates, q[..., None, :]
    drawn = torch.zeros(*candidates.shape, q.shape[-1], dtype=q.dtype, device=q.device)
    drawn.scatter_(-1, candidates[..., None], 1.0)  # (..., ranks, V) one-hot draws
    remaining = q[..., None, :] * (1 - (drawn.cumsum(-2) - drawn))  # without earlier draws
    return candidates, remaining / remaining.sum(-1, keepdim=True).clamp(min=1e-30)


def draft(head_logits: Tensor, tree: Tree, config: SamplingConfig,
          generator: torch.Generator | None = None, *, buffers: TreeBuffers | None = None,
          iid: bool = False) -> Drafts:
    """The heads' proposal for `tree`'s nodes 1..m-1 from heads 1..depth's logits (B, depth,
    V): the node at depth d and rank r gets head d's r-th candidate (`ranked`)."""
    if buffers is None:
        buffers = tree.buffers(head_logits.device)
    index = buffers.draft_index  # (m - 1,)
    candidates, q = ranked(head_logits, max(tree.n_ranks, 1), config, generator, iid)
    return Drafts(candidates.flatten(1)[:, index],  # (B, depth, ranks) -> nodes
                  None if q is None else q.flatten(1, 2)[:, index])


AUTO_TREE_SIZES = (16, 32, 64)  # the calibrated trees `drafter=auto` measures
# How a tree's sibling drafts are drawn when sampling: without replacement (SpecInfer's
# rule gains most from distinct ones), or independently (SpecTr's rule, acceptance=spectr).
SIBLINGS = ("distinct", "iid")
DYNAMIC_SIZES = (8, 16, 32)  # the dynamic trees' node budgets it measures (EAGLE-2)


@dataclass(frozen=True, kw_only=True)
class HeadsOptions:
    """drafter=heads: k, the tokens per forward pass at most (heads 1..k-1 draft; null: every
    head; auto: each k measured); tree, a candidate tree (`tree.resolve_tree`: chain, tree8
    .. tree64, auto:N, dynamic:N, a .json file or a list of rank paths; null: the chain);
    online, the heads keep learning from the target between calls (`drafters.online`);
    siblings, how a tree's sibling drafts are drawn when sampling (distinct, or iid for
    acceptance=spectr)."""

    k: int | str | None = None
    tree: Any = None
    online: bool = False
    siblings: str = "distinct"

    def __post_init__(self) -> None:
        k = self.k
        if k is not None and k != AUTO and (not isinstance(k, int) or isinstance(k, bool)
                                            or k < 1):
            raise ValueError(f"k must be an integer >= 1, 'auto' or None (every head), got "
                             f"{k!r}")
        if self.tree is not None and k == AUTO:
            raise ValueError("tree= gives the heads one candidate tree; k='auto' measures "
                             "chains: choose one")
        check_flag("online", self.online)
        check_choice("siblings", self.siblings, SIBLINGS)


@register
class OwnHeads(Drafter):
    """The model's own heads draft: k tokens per forward pass at most (2 <= k <= n_future),
    heads 1..k-1 drafting a chain, or the nodes of `tree` (`tree.resolve_tree`). The variant
    that drafts is the one made for the model's heads and online learning (`variant`)."""

    name = "heads"
    Options = HeadsOptions
    selects = ("k", "tree")
    saved, saved_file = "trees", "tree.json"  # `python -m mtp.generate.calibrate`
    #: Which variant this is: for sequential modules (or parallel heads), learning online.
    sequential: bool = False
    online: bool = False

    def __init__(self, k: int, tree: Tree | None = None, siblings: str = "distinct") -> None:
        self.k = check_positive("k", k, least=2)
        self.iid = HeadsOptions(siblings=siblings).siblings == "iid"
        self._tree = Tree.chain(k - 1) if tree is None else tree
        if self._tree.depth > self.k - 1:
            raise ValueError(f"tree {self._tree.name} has depth {self._tree.depth}, but k={k} "
                             f"heads draft depths 1..{k - 1}")

    @classmethod
    def variant(cls, model: MTPModel, k: int, tree: Tree | None = None, *,
                online: bool = False, siblings: str = "distinct") -> OwnHeads:
        """The heads drafter that serves `model`: k heads, `tree` (None: the chain)."""
        HeadsOptions(k=k, online=online, siblings=siblings)  # checked
        sequential = model.config.head_type == "sequential"
        if sequential and online:
            raise ValueError("online=true trains parallel heads; model.head_type='sequential' "
                             "modules draft a chain that cannot learn online here")
        drafter_types()  # every variant's module imported
        variant = next(v for v in _subclasses(OwnHeads)
                       if (v.sequential, v.online) == (sequential, online))
        return variant(k, tree, siblings)

    @classmethod
    def from_options(cls, model: MTPModel, options: HeadsOptions,
                     context: DrafterContext) -> OwnHeads | None:
        n_future = model.config.n_future
        k = n_future if options.k is None else options.k
        if not 1 <= k <= n_future:
            raise ValueError(f"k must be from 1 to n_future={n_future}, got k={k}")
        if options.tree is None:
            return None if k == 1 else cls.variant(model, k, online=options.online)
        if k == 1:
            raise ValueError(f"a tree needs k from 2 to n_future={n_future}, got k=1")
        tree = resolve_tree(options.tree, k=k, vocab_size=model.config.vocab_size,
                            calibration=calibration(model, context))
        return cls.variant(model, k, tree, online=options.online, siblings=options.siblings)

    @classmethod
    def candidates(cls, model: MTPModel, options: HeadsOptions, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[OwnHeads]:
        """Every chain k = 2..n_future; unless k=auto, the dynamic trees of DYNAMIC_SIZES
        nodes (parallel heads) and, with a calibration, its auto:N trees."""
        n_future, vocab = model.config.n_future, model.config.vocab_size
        for k in range(2, n_future + 1):
            yield cls.variant(model, k)
        if options.k == AUTO or n_future < 3:
            return
        found = calibration(model, context)
        trees = [f"dynamic:{size}" for size in DYNAMIC_SIZES
                 if model.config.head_type != "sequential"]
        trees += [f"auto:{size}" for size in AUTO_TREE_SIZES if found is not None]
        for tree in trees:
            yield cls.variant(model, n_future, resolve_tree(tree, k=n_future, vocab_size=vocab,
                                                            calibration=found))

    @property
    def tree(self) -> Tree:
        return self._tree

    def check_size(self, model: MTPModel) -> None:
        """A ValueError unless the model has the k heads and the tree's ranks."""
        n_future = model.config.n_future
        if self.k > n_future:
            raise ValueError(f"the heads drafter needs k from 2 to n_future={n_future}, got "
                             f"k={self.k}" + (" (the model has one head: use another drafter)"
                                              if n_future == 1 else ""))
        self.tree.check(self.k, model.config.vocab_size)

    def __repr__(self) -> str:
        return f"heads(k={self.k})" if self.tree.is_chain else f"heads(tree={self.tree.name})"


def calibration(model: MTPModel, context: DrafterContext) -> Calibration | None:
    """The heads' measured acceptance for `model` (tree=auto:N), if one was saved."""
    saved = context.saved.get(OwnHeads.saved)
    if saved is None:
        return None
    return Calibration.load(saved, n_future=model.config.n_future,
                            vocab_size=model.config.vocab_size)


def _subclasses(cls: type) -> list[type]:
    return [found for sub in cls.__subclasses__() for found in (sub, *_subclasses(sub))]


class HeadsDrafter(OwnHeads):
    """Parallel heads 1..k-1 draft at the last accepted position, from the hidden states the
    verify pass computed there (it runs heads 0..depth)."""

    rowwise = ("_last",)

    def verify_heads(self, model: MTPModel) -> int:
        return self.tree.depth + 1

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:
        if model.config.head_type == "sequential":
            raise ValueError("model.head_type='sequential': its modules draft one depth after "
                             "another, with SequentialDrafter (drafter=heads chooses it)")
        self.check_size(model)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self._model, self._sampling, self._generator = model, sampling, generator
        device = next(model.parameters()).device
        self._dynamic = isinstance(self.tree, DynamicTree)  # chosen at every step
        self._buffers = None if self._dynamic else self.tree.buffers(device)  # once per call
        self._last: Tensor | None = None  # (B, depth, D): heads 1..depth at the last position

    def update(self, step: Verified) -> None:
        rows = torch.arange(step.hidden.shape[0], device=step.hidden.device)
        self._last = step.hidden[rows, step.last, 1:self.tree.depth + 1]  # (B, depth, D)

    def propose(self) -> Drafts:
        logits = self._model.unembed(self._last, head=1)  # (B, depth, V): heads 1..depth
        if self._dynamic:
            return dynamic_draft(logits, self.tree)
        return draft(logits, self.tree, self._sampling, self._generator, buffers=self._buffers,
                     iid=self.iid)


def dynamic_draft(head_logits: Tensor, tree: DynamicTree) -> Drafts:
    """The heads' dynamic tree (EAGLE-2, `best_paths`) over their top `tree.branching`
    tokens; deterministic drafts (one-hot q)."""
    top = head_logits.float().log_softmax(-1).topk(tree.branching, dim=-1)  # (B, depth, R)
    depth, rank, parents = best_paths(top.values, tree.n_nodes)  # (B, m - 1) each
    rows = torch.arange(depth.shape[0], device=depth.device)[:, None]
    return Drafts(top.indices[rows, depth - 1, rank], parents=parents)
