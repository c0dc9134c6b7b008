"""The model's own heads as the drafter: blockwise self-speculative decoding, or a tree.

Heads 1..k-1 at the last accepted position propose the k - 1 tokens after the next one; the
verify forward runs heads 0..k-1, so the kept node also yields the hidden states for the
next drafts, at no extra forward pass. The worked example in `engine.py` follows one step.
With a candidate tree (`tree.py`) the heads propose their top candidates along the tree's
rank paths (Medusa), with its parent links; the chain is the tree of rank-0 paths. The
drafter holds the tree's buffers (`TreeBuffers`) from `start`, so a step builds nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mtp.decode.drafters.base import Drafter, Drafts, Verified, check_positive
from mtp.decode.sampling import SamplingConfig, exponential, probabilities
from mtp.decode.tree import Tree, TreeBuffers
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


def ranked(logits: Tensor, ranks: int, config: SamplingConfig,
           noise: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The first `ranks` candidates of each distribution in `logits` (..., V): their tokens
    (..., ranks) in rank order, and the distribution each was drawn from (..., ranks, V), None
    when greedy.

    Greedy, the r-th candidate is the r-th most likely token (deterministic). Sampling, it is
    the r-th draw without replacement from q (an exponential race: the order of q / E with
    E ~ Exp(1), `noise` like the logits; rank 0 is a plain draw from q), drawn from q without
    the earlier draws, renormalised.
    """
    if config.greedy:
        return logits.topk(ranks, dim=-1).indices, None
    q = probabilities(logits, config)  # (..., V)
    candidates = (q / noise).topk(ranks, dim=-1).indices  # (..., ranks) in draw order
    if ranks == 1:
        return candidates, q[..., None, :]
    drawn = torch.zeros(*candidates.shape, q.shape[-1], dtype=q.dtype, device=q.device)
    drawn.scatter_(-1, candidates[..., None], 1.0)  # (..., ranks, V) one-hot draws
    remaining = q[..., None, :] * (1 - (drawn.cumsum(-2) - drawn))  # without earlier draws
    return candidates, remaining / remaining.sum(-1, keepdim=True).clamp(min=1e-30)


def draft(head_logits: Tensor, tree: Tree, config: SamplingConfig,
          noise: Tensor | None = None, *, buffers: TreeBuffers | None = None) -> Drafts:
    """The heads' proposal for `tree`'s nodes 1..m-1, from the logits (B, depth, V) of heads
    1..depth at the last accepted position.

    The node at depth d and rank r gets head d's r-th candidate (`ranked`), with the
    distribution it was drawn from when sampling. Nodes of equal depth and rank share a token
    (every head reads the same position). `noise`: Exp(1) draws like the logits, needed when
    sampling. `buffers`: the tree's on the logits' device, when the caller holds them.
    """
    if buffers is None:
        buffers = tree.buffers(head_logits.device)
    index = buffers.draft_index  # (m - 1,)
    candidates, q = ranked(head_logits, max(tree.n_ranks, 1), config, noise)
    return Drafts(candidates.flatten(1)[:, index],  # (B, depth, ranks) -> nodes
                  None if q is None else q.flatten(1, 2)[:, index])


class OwnHeads(Drafter):
    """The model's own heads draft: k tokens per forward pass at most (2 <= k <= n_future),
    heads 1..k-1 drafting a chain, or the nodes of `tree` (a `Tree`, resolved for the model:
    see `tree.resolve_tree`). What the parallel heads (`HeadsDrafter`) and the sequential
    modules (`SequentialDrafter`) share: their size, and its checks."""

    name = "heads"

    def __init__(self, k: int, tree: Tree | None = None) -> None:
        self.k = check_positive("k", k, least=2)
        self._tree = Tree.chain(k - 1) if tree is None else tree
        if self._tree.depth > self.k - 1:
            raise ValueError(f"tree {self._tree.name} has depth {self._tree.depth}, but k={k} "
                             f"heads draft depths 1..{k - 1}")

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


class HeadsDrafter(OwnHeads):
    """Parallel heads 1..k-1 draft at the last accepted position, from the hidden states the
    verify pass computed there (it runs heads 0..depth)."""

    def __init__(self, k: int, tree: Tree | None = None) -> None:
        super().__init__(k, tree)
        self._last: Tensor | None = None  # (B, depth, D): heads 1..depth at the last position

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
        self._buffers = self.tree.buffers(next(model.parameters()).device)  # once per call
        self._last = None

    def update(self, step: Verified) -> None:
        rows = torch.arange(step.hidden.shape[0], device=step.hidden.device)
        self._last = step.hidden[rows, step.last, 1:self.tree.depth + 1]  # (B, depth, D)

    def keep(self, rows: list[int]) -> None:
        self._last = self._last[torch.tensor(rows, device=self._last.device)]

    def propose(self) -> Drafts:
        logits = self._model.unembed(self._last, head=1)  # (B, depth, V): heads 1..depth
        noise = None if self._sampling.greedy else exponential(
            logits.shape, self._generator, logits.device)
        return draft(logits, self.tree, self._sampling, noise, buffers=self._buffers)
