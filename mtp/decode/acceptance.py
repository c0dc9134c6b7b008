"""Acceptance: which drafted path of a tree one verify pass keeps, and the token after it.

The verifier does not know who drafted: it gets `Drafts` (drafters/base.py), the draft tokens of
a tree's nodes 1..m-1 (the root, node 0, is the last accepted token), the distribution each
draft was drawn from (or none, for deterministic drafts, which count as one-hot), the tree
(the drafter's fixed shape; a chain is the tree with one path), and head 0's logits at every
node, which give the target distribution p of the token after that node. Padding drafts
(past a row's `lengths`) are never kept and leave the target untouched. Everything runs on
the device with fixed shapes, and the random numbers come in as `Draws`, drawn before the
step: a captured step replays exactly.

- `exact` (the default). Greedy (temperature 0): a draft is kept iff it is head 0's argmax
  after its parent; the output is the longest such path plus head 0's argmax after it, which
  is exactly autoregressive decoding. Sampling: SpecInfer's multi-candidate speculative
  sampling (Miao et al. 2024), which is lossless. From the root, try the children of the
  current node in rank order; child x drawn from q is kept with probability
  min(1, p(x) / q(x)), and after a rejection the target becomes normalise(max(p - q, 0)).
  The first kept child becomes the current node; when every child is rejected (or the node
  is a leaf) the next token is drawn from the current target. Each step is a standard
  speculative-sampling step whose output has the current target's distribution, so the
  tokens have exactly head 0's distribution. Siblings drawn without replacement (the heads'
  tree) carry the distribution they were drawn from given their earlier siblings: q with
  those removed and renormalised (see `speculative.draft`). With one path this is the
  blockwise rule of Leviathan et al. 2023.
- exact mode (`exact`): the target's own token after every node is drawn first, by
  `sampling.inverse_cdf` with the position's uniform (`Draws.uniform`: one per node; greedy:
  the argmax), and the deepest path of drafts equal to those tokens is kept, with the token
  after it. The tokens are then autoregressive sampling's with the same seed, not merely of
  its distribution; a draft is kept with probability p(draft), as speculative sampling keeps
  a deterministic draft.
- `spectr` (SpecTr, Sun et al. 2023: k-sequential draft selection, the optimal transport of
  k drafts drawn independently from q onto p): at a node with k children drawn i.i.d. from q
  (`HeadsOptions.siblings="iid"`), child i is kept with probability min(1, p(x_i) /
  (rho q(x_i))) in turn, where rho solves 1 - (1 - beta)^k = rho * beta, beta = sum_x
  min(q(x), p(x) / rho); when none is kept the token is drawn from the residual
  p - c min(q, p / rho), c = (1 - (1 - beta)^k) / beta. Lossless for any rho >= 1 with c <=
  rho (the bisection keeps to that side), and it keeps at least as much as SpecInfer's rule
  does on the same i.i.d. drafts; with one child it is that rule.
- `typical` (opt-in, Medusa's typical acceptance; NOT lossless): a draft is kept while
  p(draft) > min(epsilon, alpha * exp(-H(p))) along its path; the longest kept path wins
  (ties to the lower-ranked path) and the next token is drawn from p after it. It trades
  the exact distribution for longer accepted paths at temperature > 0; at temperature 0 it
  is the greedy rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtp.decode.drafters.base import Drafts
from mtp.decode.sampling import (SamplingConfig, exponential, inverse_cdf, probabilities,
                                 sample)
from mtp.decode.tree import Tree, TreeBuffers

ACCEPTANCE = ("exact", "typical", "spectr")


@dataclass(frozen=True, kw_only=True)
class TypicalAcceptance:
    """Medusa's thresholds: keep a draft while p(draft) > min(epsilon, alpha * exp(-H(p)))."""

    epsilon: float = 0.09
    alpha: float = 0.3

    def __post_init__(self) -> None:
        if not (0 < self.epsilon <= 1 and 0 < self.alpha <= 1):
            raise ValueError(f"typical acceptance needs 0 < epsilon, alpha <= 1, got "
                             f"epsilon={self.epsilon!r}, alpha={self.alpha!r}")


@dataclass(frozen=True)
class KSequential:
    """SpecTr's k-sequential selection of one of a node's i.i.d. drafts (module docstring):
    `iterations` of bisection for rho."""

    iterations: int = 40


# "exact" (SpecInfer's rule), "typical" (Medusa's thresholds), "spectr", or a rule's object
Acceptance = str | TypicalAcceptance | KSequential
Rule = TypicalAcceptance | KSequential | None  # None: the default, SpecInfer's rule


def acceptance_rule(acceptance: Acceptance) -> Rule:
    """The rule `acceptance` names: None for "exact" (SpecInfer's recursive rejection)."""
    if isinstance(acceptance, (TypicalAcceptance, KSequential)):
        return acceptance
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE}, a TypicalAcceptance or a "
                         f"KSequential, got {acceptance!r}")
    return {"exact": None, "typical": TypicalAcceptance(), "spectr": KSequential()}[acceptance]


@dataclass(frozen=True)
class Draws:
    """The random numbers of one step's acceptance, drawn before the step.

    uniform (B, m - 1): one per draft node, for its test u * q < p; exponential (B, V): the
    race that draws the correction or bonus token (`sampling.sample`). Exact mode: uniform
    (B, m), one per node, for the token after it (`sampling.position_uniforms`), and no
    exponential.
    """

    uniform: Tensor
    exponential: Tensor | None = None

    @staticmethod
    def draw(batch: int, nodes: int, vocab: int, generator: torch.Generator | None,
             device: torch.device | str) -> Draws:
        uniform = torch.rand((batch, nodes - 1), generator=generator, device=device)
        return Draws(uniform, exponential((batch, vocab), generator, device))


@dataclass(frozen=True)
class Accepted:
    """Per sequence: the last accepted node, its depth, and the new tokens.

    tokens (B, depth + 1): the kept drafts along the accepted path, then at index n_accepted
    the correction or bonus token (the next root); later entries are not output.
    """

    node: Tensor  # (B,)
    n_accepted: Tensor  # (B,)
    tokens: Tensor  # (B, depth + 1)


def accept(drafts: Drafts, target: Tensor, tree: Tree, sampling: SamplingConfig,
           draws: Draws | None = None, rule: Rule = None, *,
           buffers: TreeBuffers | None = None, exact: bool = False) -> Accepted:
    """Verify `drafts` (the nodes of `tree`) against head 0's logits `target` (B, m, V).

    `draws` are needed when sampling; `rule` (`acceptance_rule`) switches from SpecInfer's
    rule to Medusa's typical acceptance or SpecTr's; `exact` to exact mode's (the module
    docstring). `buffers`: the tree's on `target`'s device, which the engine holds (else
    looked up).
    """
    batch = target.shape[0]
    if buffers is None:
        buffers = tree.buffers(target.device)
    if buffers.depths.dim() == 1:  # one tree for every row
        buffers = buffers.rows(batch)
    rows = torch.arange(batch, device=target.device)
    real = None  # (B, m - 1): which drafts are not padding
    if drafts.lengths is not None:
        real = torch.arange(drafts.tokens.shape[1], device=target.device) < drafts.lengths[:, None]
    if tree.n_nodes == 1:  # no drafts: an autoregressive step
        node = torch.zeros(batch, dtype=torch.long, device=target.device)
        target0 = target[:, 0]
        next_token = target0.argmax(-1) if sampling.greedy else inverse_cdf(
            probabilities(target0, sampling), draws.uniform[:, 0]) if exact else sample(
            probabilities(target0, sampling), draws.exponential)
    elif sampling.greedy or exact:
        predicted = target.argmax(-1) if sampling.greedy else inverse_cdf(
            probabilities(target, sampling), draws.uniform)  # (B, m) the token after each node
        node = _deepest_kept(_and(drafts.tokens == predicted.gather(1, buffers.parents), real),
                             buffers)
        next_token = predicted[rows, node]
    elif isinstance(rule, TypicalAcceptance):
        typical = rule
        p = probabilities(target, sampling)  # (B, m, V)
        entropy = -torch.special.xlogy(p, p).sum(-1)  # (B, m)
        threshold = torch.minimum(typical.alpha * torch.exp(-entropy),
                                  torch.full_like(entropy, typical.epsilon))
        parents = buffers.parents[..., None].expand(-1, -1, p.shape[-1])  # (B, m - 1, V)
        p_draft = p.gather(1, parents).gather(-1, drafts.tokens[..., None]).squeeze(-1)
        node = _deepest_kept(_and(p_draft > threshold.gather(1, buffers.parents), real),
                             buffers)
        next_token = sample(p[rows, node], draws.exponential)
    else:
        select = _k_sequential if isinstance(rule, KSequential) else _recursive_rejection
        node, residual = select(drafts, probabilities(target, sampling), tree, buffers, real,
                                draws.uniform, rule)
        next_token = sample(residual, draws.exponential)
    path = buffers.ancestors[rows, node][:, 1:]  # (B, depth): the accepted nodes, then padding
    tokens = drafts.tokens.gather(1, (path - 1).clamp(min=0))
    tokens = torch.cat([tokens, next_token[:, None]], dim=1)  # (B, depth + 1)
    n_accepted = buffers.depths[rows, node]
    tokens[rows, n_accepted] = next_token
    return Accepted(node, n_accepted, tokens)


def _and(kept: Tensor, real: Tensor | None) -> Tensor:
    return kept if real is None else kept & real


def _deepest_kept(kept: Tensor, buffers: TreeBuffers) -> Tensor:
    """The deepest node (B,) whose whole path is kept; kept (B, m - 1) for nodes 1..m-1.

    Ties go to the lower node index (lower ranks); under greedy acceptance siblings are
    distinct tokens, so at most one path is kept.
    """
    root = torch.ones(kept.shape[0], 1, dtype=torch.bool, device=kept.device)
    kept = torch.cat([root, kept], dim=1)  # the root is always kept
    ancestors = buffers.ancestors  # (B, m, depth + 1)
    on_path = kept.gather(1, ancestors.flatten(1)).view(ancestors.shape).all(-1)  # (B, m)
    return (on_path * (buffers.depths + 1)).argmax(-1)  # argmax returns the first maximum


def _recursive_rejection(drafts: Drafts, p_all: Tensor, tree: Tree, buffers: TreeBuffers,
                         real: Tensor | None, uniforms: Tensor,
                         rule: None = None) -> tuple[Tensor, Tensor]:
    """SpecInfer's rule: the last accepted node (B,) and the distribution (B, V) after it.

    uniforms (B, m - 1): node i's test draws uniforms[:, i - 1].
    """
    batch, _, vocab = p_all.shape
    rows = torch.arange(batch, device=p_all.device)
    node = torch.zeros(batch, dtype=torch.long, device=p_all.device)
    p = p_all[:, 0]  # (B, V) the current target
    descending = torch.ones(batch, dtype=torch.bool, device=p_all.device)
    for width in tree.widths:  # the most children of any node at each depth
        children = buffers.children[rows, node, :width]  # (B, width), -1 padded
        chosen = torch.full_like(node, -1)
        for rank in range(width):
            child = children[:, rank]
            index = (child - 1).clamp(min=0)
            token = drafts.tokens[rows, index]  # (B,)
            if drafts.probs is None:
                q = torch.nn.functional.one_hot(token, vocab).to(p.dtype)
            else:
                q = drafts.probs[rows, index].to(p.dtype)  # (B, V)
            q_token, p_token = q[rows, token], p[rows, token]
            uniform = uniforms[rows, index].to(p.dtype)
            # A draft its own proposal could not have drawn (e.g. a rank past top_k) was
            # never proposed: skip it without touching the target.
            trying = descending & (child >= 0) & (chosen < 0) & (q_token > 0)
            if real is not None:
                trying &= real[rows, index]
            kept = trying & (uniform * q_token < p_token)  # probability min(1, p / q)
            chosen = torch.where(kept, child, chosen)
            residual = (p - q).clamp(min=0)
            total = residual.sum(-1, keepdim=True)
            # An all-zero residual means p == q, where rejection has probability 0.
            residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
            p = torch.where((trying & ~kept)[:, None], residual, p)
        moved = chosen >= 0
        node = torch.where(moved, chosen, node)
        p = torch.where(moved[:, None], p_all[rows, node], p)
        descending &= moved
    return node, p


def _k_sequential(drafts: Drafts, p_all: Tensor, tree: Tree, buffers: TreeBuffers,
                  real: Tensor | None, uniforms: Tensor,
                  rule: KSequential) -> tuple[Tensor, Tensor]:
    """SpecTr's rule (module docstring): the last accepted node (B,) and the distribution
    (B, V) after it; a node's children are its k i.i.d. drafts from one q."""
    batch, _, vocab = p_all.shape
    rows = torch.arange(batch, device=p_all.device)
    node = torch.zeros(batch, dtype=torch.long, device=p_all.device)
    p = p_all[:, 0]  # (B, V) the current target
    descending = torch.ones(batch, dtype=torch.bool, device=p_all.device)
    for width in tree.widths:  # the most children of any node at each depth
        children = buffers.children[rows, node, :width]  # (B, width), -1 padded
        index = (children - 1).clamp(min=0)
        valid = (children >= 0) & descending[:, None]
        if real is not None:
            valid &= real.gather(1, index)
        k = valid.sum(-1)  # (B,) the node's drafts
        if drafts.probs is None:  # deterministic drafts: one-hot q (each its own)
            q = torch.nn.functional.one_hot(drafts.tokens[rows, index[:, 0]], vocab).to(p.dtype)
        else:  # i.i.d. siblings share the q they were drawn from
            q = drafts.probs[rows, index[:, 0]].to(p.dtype)  # (B, V)
        rho, share = _rho(p, q, k, rule.iterations)  # (B,) each
        chosen = torch.full_like(node, -1)
        for rank in range(width):
            token = drafts.tokens.gather(1, index[:, rank:rank + 1])[:, 0]  # (B,)
            q_token, p_token = q[rows, token], p[rows, token]
            uniform = uniforms.gather(1, index[:, rank:rank + 1])[:, 0].to(p.dtype)
            trying = valid[:, rank] & (chosen < 0) & (q_token > 0)
            kept = trying & (uniform * rho * q_token < p_token)  # min(1, p / (rho q))
            chosen = torch.where(kept, children[:, rank], chosen)
        moved = chosen >= 0
        # None kept: the residual p - c min(q, p / rho), c = share; a leaf keeps p itself.
        residual = (p - share[:, None] * torch.minimum(q, p / rho[:, None])).clamp(min=0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual / total.clamp(min=1e-30), p)
        p = torch.where((~moved & (k > 0))[:, None], residual, p)
        node = torch.where(moved, chosen, node)
        p = torch.where(moved[:, None], p_all[rows, node], p)
        descending &= moved
    return node, p


def _rho(p: Tensor, q: Tensor, k: Tensor, iterations: int) -> tuple[Tensor, Tensor]:
    """SpecTr's rho (B,) for k i.i.d. drafts from q (B, V) of target p, by bisection on
    [1, k], kept on the side where c = (1 - (1 - beta)^k) / beta <= rho (lossless), and c."""
    count = k.clamp(min=1).to(p.dtype)
    low, high = torch.ones_like(count), count

    def share(rho: Tensor) -> Tensor:
        beta = torch.minimum(q, p / rho[:, None]).sum(-1).clamp(min=1e-30)
        return (1 - (1 - beta) ** count) / beta

    for _ in range(iterations):
        middle = (low + high) / 2
        above = share(middle) > middle  # rho is further up
        low, high = torch.where(above, middle, low), torch.where(above, high, middle)
    return high, torch.minimum(share(high), high)