"""EAGLE-3 as the drafter (Li et al. 2024, 2025): one decoder layer (`eagle_model.py`) that
reads the target's own features and drafts one token after another, at feature level.

Position t of the drafter's cache holds the layer's entry for (the target's features at
x_t, the token x_{t + 1}), at rotary position t, as in training. The verify pass keeps the
three layers' features (`verify_layers`), so `update` holds the commit: the features at the
kept path's tokens and the token after each. `propose` runs the layer once over the commit,
whose last output drafts the root's children, then once per depth over the tree's nodes of
the depth before: node u at depth d reads its parent's output and its own token, at position
p - 1 + d, and sees the committed entries and its ancestors. The nodes sit in slots after the
committed ones, which the next commit overwrites (as in `sequential.py`). Greedy drafts are
the drafter's top ranks; sampled ones are drawn from q (the sampling rule on the draft
logits, 0 outside the draft vocabulary) with that q returned, so acceptance stays lossless.

EAGLE-2's dynamic tree (`dynamic_tree`): expand the `top_k` nodes of highest cumulative draft
probability at each depth, then keep the best `nodes`; its drafts are the drafter's top ranks
(one-hot q whatever the sampling: recursive rejection of deterministic siblings is lossless).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mtp.cli import check_positive
from mtp.decode.drafters.base import Drafter, DrafterContext, Drafts, Verified
from mtp.decode.drafters.eagle_model import CONFIG_FILE, Eagle
from mtp.decode.drafters.heads import ranked
from mtp.decode.drafters.registry import register
from mtp.decode.drafters.sequential import TreePlan
from mtp.decode.forward import key_width
from mtp.decode.sampling import SamplingConfig
from mtp.decode.tree import DynamicTree, Tree, keep_best, resolve_tree
from mtp.kv_cache import CacheStep, KVCache, cache_step, causal
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer

CANDIDATE_TREES = ("tree16", "tree32", "dynamic:16")  # what `auto` measures besides the chain


@dataclass(frozen=True, kw_only=True)
class EagleOptions:
    """drafter=eagle: eagle, the drafter's directory (null: the one `python -m
    mtp.train.eagle` saved for the checkpoint); num_draft, drafts per step of a chain, and
    the deepest node of a tree; tree, a tree of the drafter's ranks (tree8 .. tree64, a list
    of rank paths or a .json file; null: the chain) or dynamic:N, EAGLE-2's tree of N nodes
    chosen at every step by the drafter's confidence."""

    eagle: str | None = None
    num_draft: int = 5
    tree: Any = None

    def __post_init__(self) -> None:
        check_positive("num_draft", self.num_draft)
        if self.eagle is not None and not isinstance(self.eagle, str):
            raise ValueError(f"eagle must be a path, got {self.eagle!r}")


@register
class EagleDrafter(Drafter):
    """An EAGLE-3 layer on the target's features drafts a chain of `num_draft` tokens, or the
    nodes of `tree` (a tree of its ranks, `tree.resolve_tree`)."""

    name = "eagle"
    Options = EagleOptions
    selects = ("eagle",)
    after = ("heads",)
    saved, saved_file = "eagle", CONFIG_FILE
    rowwise = ("_cache", "_held", "_commit", "_accepted")

    def __init__(self, module: Eagle, num_draft: int = 5, tree: Any = None) -> None:
        if not isinstance(module, Eagle):
            raise ValueError(f"the EAGLE drafter needs an Eagle module (Eagle.load), got "
                             f"{type(module).__name__}")
        self.module = module.eval()
        self.num_draft = check_positive("num_draft", num_draft)
        self._tree = Tree.chain(num_draft) if tree is None else resolve_tree(
            tree, k=num_draft + 1, vocab_size=module.config.draft_vocab_size)
        self._copies: dict[tuple[torch.device, torch.dtype], Eagle] = {}

    @classmethod
    def check_named(cls, options: EagleOptions) -> None:
        if isinstance(options.tree, str) and options.tree.startswith("auto:"):
            raise ValueError(f"tree={options.tree!r} is the heads' calibrated tree: "
                             f"drafter=eagle takes tree8 .. tree64, rank paths or a .json file")
        if options.tree is not None:  # its depth within num_draft
            resolve_tree(options.tree, k=options.num_draft + 1, vocab_size=1 << 30)

    @classmethod
    def found(cls, options: EagleOptions, context: DrafterContext) -> Eagle | None:
        """The module `eagle=` names, else the one saved for the checkpoint, else None."""
        source = context.saved.get(cls.saved) if options.eagle is None else options.eagle
        return None if source is None else Eagle.load(source)

    @classmethod
    def from_options(cls, model: MTPModel, options: EagleOptions,
                     context: DrafterContext) -> EagleDrafter:
        module = cls.found(options, context)
        if module is None:
            raise ValueError("drafter=eagle needs a trained drafter: eagle=DIR, or train one "
                             "for the checkpoint (python -m mtp.train.eagle checkpoint=...)")
        module.config.check_target(model.config, options.eagle or "the saved EAGLE drafter")
        return cls(module, options.num_draft, options.tree)

    @classmethod
    def candidates(cls, model: MTPModel, options: EagleOptions, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[EagleDrafter]:
        """With a drafter (given or saved for the checkpoint): its chain and its trees."""
        module = cls.found(options, context)
        if module is None:
            return
        module.config.check_target(model.config)
        trees = [options.tree] if options.tree is not None else [None, *CANDIDATE_TREES]
        for tree in trees:
            yield cls(module, options.num_draft, tree)

    @property
    def tree(self) -> Tree:
        return self._tree

    def verify_layers(self, model: MTPModel) -> tuple[int, ...]:
        return self.module.config.layers

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:
        self.module.config.check_target(model.config)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        param = next(model.parameters())
        self._layer = self._on(param.device, param.dtype)
        self._model, self._sampling, self._generator = model, sampling, generator
        self._cache = KVCache(self.module.config.block(), len(prompts),
                              cache.max_len + self.tree.n_nodes + 1, device=param.device,
                              dtype=param.dtype)
        self._held = torch.zeros(len(prompts), dtype=torch.long, device=param.device)
        self._accepted = [len(ids) for ids in prompts]  # tokens each row has, on the host
        self._commit: tuple[Tensor, Tensor, Tensor] | None = None
        self._dynamic = isinstance(self.tree, DynamicTree)  # a tree of its own every step
        self._plan = None if self._dynamic else TreePlan(self.tree, param.device)

    def _on(self, device: torch.device, dtype: torch.dtype) -> Eagle:
        """The module on `device` in `dtype` (a kept copy if elsewhere: it is never rounded)."""
        param = next(self.module.parameters())
        if (param.device, param.dtype) == (device, dtype):
            return self.module
        if (device, dtype) not in self._copies:
            self._copies[device, dtype] = copy.deepcopy(self.module).to(device, dtype)
        return self._copies[device, dtype]

    def update(self, step: Verified) -> None:
        # The commit: the features at the kept path's tokens (B, P, 3, D), the token after
        # each (B, P) and how many are real (B,).
        rows = torch.arange(step.path.shape[0], device=step.path.device)[:, None]
        self._commit = (step.features[rows, step.path], step.tokens, step.kept)
        self._accepted = [n + len(ids) for n, ids in zip(self._accepted, step.new_ids)]

    def _grow(self) -> tuple[Tensor, Callable[[Tensor, Tensor, int], Tensor]]:
        """Run the layer over the commit: its output at each row's last entry (B, D), which
        drafts the root's children, and `feed(tokens, parents, depth)`, the layer on k nodes
        of one depth (B, k; target ids), each reading its parent's output ((B, k) or (k,); 0:
        the root, j: the j-th node fed) at position p - 1 + depth and seeing the committed
        entries and its ancestors: their outputs (B, k, D). Fed node j sits at slot new + j - 1."""
        features, tokens, counts = self._commit
        width, device = tokens.shape[1], tokens.device
        old, new = self._held, self._held + counts
        length = key_width(max(self._accepted) + max(width, self.tree.n_nodes) + 1,
                           self._cache.max_len)
        limit = self._model.config.max_seq_len
        out = self._layer_step(self._layer.fuse(features), tokens,
                               cache_step(old, *causal(width, device), length, limit))
        self._held = new
        batch = tokens.shape[0]
        rows = torch.arange(batch, device=device)[:, None]
        root = out[rows[:, 0], (counts - 1).clamp(min=0)]  # (B, D)
        outputs = [root[:, None]]
        # Which of the root (0) and the fed nodes (1..) each of those sees: its ancestors.
        seen = torch.ones(batch, 1, 1, dtype=torch.bool, device=device)

        def feed(tokens: Tensor, parents: Tensor, depth: int) -> Tensor:
            nonlocal seen
            fed, k = seen.shape[1] - 1, tokens.shape[1]
            sees = torch.cat([seen[rows, parents], torch.eye(k, dtype=torch.bool,
                                                             device=device).expand(
                batch, k, k)], dim=2)  # (B, k, 1 + fed + k): its parent's ancestors, itself
            seen = torch.cat([torch.cat([seen, seen.new_zeros(batch, 1 + fed, k)], dim=2),
                              sees], dim=1)
            full = cache_step(new, torch.full((fed + k,), depth - 1, device=device),
                              seen[:, 1:, 1:], length, limit)
            step = CacheStep(full.positions[:, fed:], full.slots[:, fed:], full.mask[:, :, fed:])
            outputs.append(self._layer_step(torch.cat(outputs, dim=1)[rows, parents], tokens,
                                            step))
            return outputs[-1]

        return root, feed

    def _layer_step(self, hidden: Tensor, tokens: Tensor, step: CacheStep) -> Tensor:
        model = self._model
        cos, sin = model.rope(tokens.shape[1], step)
        return self._layer(hidden, model.tok_embeddings(tokens), cos, sin, self._cache, step)

    def propose(self) -> Drafts:
        if self._dynamic:  # EAGLE-2: the drafter's own confidence shapes each row's tree
            tree = self.tree
            tokens, parents, _ = self.dynamic(depth=tree.depth, top_k=tree.branching,
                                              nodes=tree.n_nodes - 1)
            return Drafts(tokens, None, parents=parents)  # top ranks: one-hot q, lossless
        plan, tree = self._plan, self.tree
        root, feed = self._grow()
        drafts = torch.zeros(root.shape[0], tree.n_nodes - 1, dtype=torch.long,
                             device=root.device)
        outputs = root[:, None]  # (B, 1 + nodes, D): the root's output, then the nodes' so far
        probs = []
        for k in range(1, tree.depth + 1):
            if k > 1:  # feed the nodes of depth k - 1 (nodes first+1..last, fed in order)
                first, last = plan.nodes[k - 1], plan.nodes[k]
                outputs = torch.cat([outputs, feed(drafts[:, first:last],
                                                   plan.parents[k][first:], k - 1)], dim=1)
            # The depth k - 1 nodes' children, from the layer's outputs there (B, G, D).
            candidates, q = self._ranked(outputs[:, plan.groups[k] + 1], plan.ranks[k])
            drafts[:, plan.children[k] - 1] = candidates.flatten(1)[:, plan.picks[k]]
            if q is not None:
                probs.append(q.flatten(1, 2)[:, plan.picks[k]])  # (B, c, V)
        return Drafts(drafts, None if self._sampling.greedy else torch.cat(probs, dim=1))

    def _ranked(self, at: Tensor, ranks: int) -> tuple[Tensor, Tensor | None]:
        """The first `ranks` candidates after each state `at` (B, G, D), as target ids, with
        the distributions they were drawn from when sampling (`heads.ranked`)."""
        if self._sampling.greedy:  # the top ranks of the draft vocabulary, then their ids
            return self._layer.d2t[self._layer.logits(at).topk(ranks, dim=-1).indices], None
        return ranked(self._layer.target_logits(at), ranks, self._sampling, self._generator)

    def dynamic(self, *, depth: int, top_k: int, nodes: int) -> tuple[Tensor, Tensor, None]:
        """EAGLE-2's dynamic tree after the commit (`dynamic_tree` on this layer), its drafts
        as target ids."""
        root, feed = self._grow()
        d2t = self._layer.d2t

        def log_probs(out: Tensor) -> Tensor:
            return torch.log_softmax(self._layer.logits(out).float(), dim=-1)

        def expand(tokens: Tensor, parents: Tensor, at_depth: int) -> Tensor:
            return log_probs(feed(d2t[tokens], parents, at_depth))

        tokens, parents, q = dynamic_tree(log_probs(root), expand, depth=depth, top_k=top_k,
                                          nodes=nodes)
        return d2t[tokens], parents, q

    def __repr__(self) -> str:
        return (f"eagle(num_draft={self.num_draft})" if self.tree.is_chain
                else f"eagle(tree={self.tree.name})")


def dynamic_tree(first: Tensor, expand: Callable[[Tensor, Tensor, int], Tensor], *,
                 depth: int, top_k: int, nodes: int) -> tuple[Tensor, Tensor, None]:
    """EAGLE-2's dynamic draft tree for every row (Li et al. 2024); a node's score is the sum
    of its path's draft log-probabilities, `first` (B, N) those of the root's children.

    The root's `top_k` best children are depth 1; at each depth d < `depth` the `top_k` best
    nodes of depth d are fed to `expand(tokens (B, k), parents (B, k), d)` -> their children's
    log-probabilities (B, k, N), a parent being a fed node's number (0: the root, j: the j-th
    fed); each one's `top_k` best children are candidates of depth d + 1. The best `nodes`
    candidates form a tree (a child never scores above its parent; ties go to the parent).
    Returns their tokens, their parents (0: the root, j: the j-th kept node), (B, nodes) each
    in depth order, and q: None (the top ranks are deterministic drafts)."""
    batch, vocab = first.shape
    check_positive("depth", depth)
    check_positive("top_k", top_k)
    if top_k > vocab:
        raise ValueError(f"top_k={top_k} exceeds the draft vocabulary of {vocab} tokens")
    pool = top_k + (depth - 1) * top_k * top_k
    if not 1 <= nodes <= pool:
        raise ValueError(f"nodes={nodes} must be from 1 to the {pool} candidates that depth="
                         f"{depth} and top_k={top_k} draft")
    device = first.device
    scores, tokens = first.topk(top_k, dim=-1)  # depth 1: (B, k)
    layer = torch.arange(1, top_k + 1, device=device).expand(batch, top_k)  # pool numbers
    fed_parents = torch.zeros(batch, top_k, dtype=torch.long, device=device)
    all_scores, all_tokens = [scores], [tokens]
    all_parents = [torch.zeros(batch, top_k, dtype=torch.long, device=device)]
    size, fed = top_k, 0  # candidates so far; nodes fed so far
    for d in range(1, depth):
        logp = expand(tokens, fed_parents, d)  # (B, k, N): children of this depth's k nodes
        child_scores, child_tokens = logp.topk(top_k, dim=-1)  # (B, k, k)
        cumulative = (scores[..., None] + child_scores).flatten(1)  # (B, k * k)
        all_scores.append(cumulative)
        all_tokens.append(child_tokens.flatten(1))
        all_parents.append(layer.repeat_interleave(top_k, dim=1))
        scores, best = cumulative.topk(top_k, dim=-1)  # the next depth's k nodes
        tokens = child_tokens.flatten(1).gather(1, best)
        fed_parents = fed + 1 + best // top_k  # the fed numbers of their parents
        layer = size + 1 + best
        size, fed = size + top_k * top_k, fed + top_k
    kept, parents = keep_best(torch.cat(all_scores, dim=1), torch.cat(all_parents, dim=1),
                              nodes)  # pool order: depth order, parents first
    return torch.cat(all_tokens, dim=1).gather(1, kept), parents, None


__all__ = ["EagleDrafter", "EagleOptions", "dynamic_tree"]
