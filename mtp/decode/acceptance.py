"""Acceptance: which drafted path of a tree one verify pass keeps, and the token after it.

It gets `Drafts` (the tokens of the tree's nodes 1..m-1 and the q each was drawn from; none:
one-hot), the tree, and head 0's logits at every node (the target p of the token after it).
Padding drafts are never kept. Everything runs on the device with fixed shapes; random
numbers come in as `Draws`, so a captured step replays. The rules (`register_rule`):

- `exact` (default). Greedy: a draft is kept iff it is head 0's argmax after its parent; the
  deepest such path plus the argmax after it is autoregressive decoding's output. Sampling:
  SpecInfer's multi-candidate rule (Miao et al. 2024), lossless: from the root, try the
  current node's children in rank order, child x kept with probability min(1, p(x) / q(x));
  after a rejection p becomes normalise(max(p - q, 0)); the first kept child becomes the
  current node, and when none is kept the next token is drawn from the current p. Siblings
  drawn without replacement carry q given their earlier siblings (`heads.ranked`). With one
  path it is Leviathan et al.'s blockwise rule.
- exact mode: the target's own token after every node is drawn first (`inverse_cdf` with
  the position's uniform; greedy: the argmax), and the deepest path of drafts equal to those
  tokens is kept: autoregressive sampling's tokens with the same seed.
- `spectr` (SpecTr, Sun et al. 2023, k-sequential selection): a node's k children drawn
  i.i.d. from q (`siblings="iid"`); child i is kept with probability min(1, p(x_i) /
  (rho q(x_i))) in turn, rho solving 1 - (1 - beta)^k = rho beta, beta = sum_x min(q(x),
  p(x) / rho); when none is kept the token is drawn from the residual p - c min(q, p / rho),
  c = (1 - (1 - beta)^k) / beta. Lossless for rho >= 1 with c <= rho (the bisection keeps to
  that side); with one child it is SpecInfer's rule.
- `typical` (Medusa's typical acceptance; NOT lossless): a draft is kept while p(draft) >
  min(epsilon, alpha * exp(-H(p))) along its path; the longest kept path wins (ties to lower
  ranks), the next token drawn from p after it. Greedy, it is the greedy rule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from mtp.decode.drafters.base import Drafts
from mtp.decode.sampling import (SamplingConfig, exponential, inverse_cdf, probabilities,
                                 sample)
from mtp.decode.tree import Tree, TreeBuffers


class AcceptanceRule:
    """A rule that keeps a drafted path when sampling (greedy, every rule is the greedy one):
    its `name` (acceptance=), whether it keeps head 0's distribution (`lossless`), whether
    exact mode, the deterministic form of SpecInfer's rule, refines it (`exact_mode`). Rules
    are frozen dataclasses with defaults: hashable (a compiled step's shape keys on the rule)
    and built from the name."""

    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = False
    exact_mode: ClassVar[bool] = False

    def select(self, drafts: Drafts, p: Tensor, tree: Tree, buffers: TreeBuffers,
               real: Tensor | None, draws: Draws) -> tuple[Tensor, Tensor]:
        """Sampling, given the target p (B, m, V) after every node and which drafts are `real`
        (B, m - 1; None: all): the last kept node (B,) and the token after it (B,). By
        default a walk down the tree (`_descend`), `choose` picking at each node."""
        return _descend(drafts, p, tree, buffers, real, draws, self.choose)

    def choose(self, drafts: Drafts, p: Tensor, index: Tensor, valid: Tensor,
               uniforms: Tensor) -> tuple[Tensor, Tensor]:
        """At one node per row, target p (B, V), its children's draft `index` (B, w) in rank
        order, which are `valid` to try and their uniforms (B, w): the kept child (-1: none)
        and the target after."""
        raise NotImplementedError


RULES: dict[str, type[AcceptanceRule]] = {}


def register_rule(cls: type[AcceptanceRule]) -> type[AcceptanceRule]:
    """Class decorator: make `cls` the rule acceptance=`cls.name` names."""
    if not cls.name or RULES.get(cls.name, cls) is not cls:
        raise ValueError(f"an acceptance rule needs a name of its own, got {cls.__name__} "
                         f"with name={cls.name!r}")
    RULES[cls.name] = cls
    return cls


@register_rule
@dataclass(frozen=True)
class RecursiveRejection(AcceptanceRule):
    """SpecInfer's multi-candidate rule (module docstring), the default."""

    name: ClassVar[str] = "exact"
    lossless: ClassVar[bool] = True
    exact_mode: ClassVar[bool] = True

    def choose(self, drafts: Drafts, p: Tensor, index: Tensor, valid: Tensor,
               uniforms: Tensor) -> tuple[Tensor, Tensor]:
        rows = torch.arange(p.shape[0], device=p.device)
        chosen = torch.full_like(rows, -1)
        for rank in range(index.shape[1]):
            token = drafts.tokens[rows, index[:, rank]]  # (B,)
            q = _proposal(drafts, rows, index[:, rank], p)  # (B, V)
            q_token, p_token = q[rows, token], p[rows, token]
            # A draft its own proposal could not have drawn (e.g. a rank past top_k) was never
            # proposed: skip it without touching the target.
            trying = valid[:, rank] & (chosen < 0) & (q_token > 0)
            kept = trying & (uniforms[:, rank] * q_token < p_token)  # probability min(1, p / q)
            chosen = torch.where(kept, index[:, rank] + 1, chosen)
            p = torch.where((trying & ~kept)[:, None], _residual(p, q), p)
        return chosen, p


@register_rule
@dataclass(frozen=True, kw_only=True)
class TypicalAcceptance(AcceptanceRule):
    """Medusa's thresholds: keep a draft while p(draft) > min(epsilon, alpha * exp(-H(p)))."""

    name: ClassVar[str] = "typical"
    epsilon: float = 0.09
    alpha: float = 0.3

    def __post_init__(self) -> None:
        if not (0 < self.epsilon <= 1 and 0 < self.alpha <= 1):
            raise ValueError(f"typical acceptance needs 0 < epsilon, alpha <= 1, got "
                             f"epsilon={self.epsilon!r}, alpha={self.alpha!r}")

    def select(self, drafts: Drafts, p: Tensor, tree: Tree, buffers: TreeBuffers,
               real: Tensor | None, draws: Draws) -> tuple[Tensor, Tensor]:
        entropy = -torch.special.xlogy(p, p).sum(-1)  # (B, m)
        threshold = torch.minimum(self.alpha * torch.exp(-entropy),
                                  torch.full_like(entropy, self.epsilon))
        parents = buffers.parents[..., None].expand(-1, -1, p.shape[-1])  # (B, m - 1, V)
        p_draft = p.gather(1, parents).gather(-1, drafts.tokens[..., None]).squeeze(-1)
        node = _deepest_kept(_and(p_draft > threshold.gather(1, buffers.parents), real),
                             buffers)
        rows = torch.arange(p.shape[0], device=p.device)
        return node, sample(p[rows, node], draws.exponential)


@register_rule
@dataclass(frozen=True)
class KSequential(AcceptanceRule):
    """SpecTr's k-sequential selection of one of a node's i.i.d. drafts (module docstring):
    `iterations` of bisection for rho."""

    name: ClassVar[str] = "spectr"
    lossless: ClassVar[bool] = True
    iterations: int = 40

    def choose(self, drafts: Drafts, p: Tensor, index: Tensor, valid: Tensor,
               uniforms: Tensor) -> tuple[Tensor, Tensor]:
        # A node's children are k i.i.d. drafts from one q.
        rows = torch.arange(p.shape[0], device=p.device)
        k = valid.sum(-1)  # (B,) the node's drafts
        q = _proposal(drafts, rows, index[:, 0], p)  # i.i.d. siblings share one q
        rho, share = _rho(p, q, k, self.iterations)  # (B,) each
        chosen = torch.full_like(rows, -1)
        for rank in range(index.shape[1]):
            token = drafts.tokens[rows, index[:, rank]]  # (B,)
            q_token, p_token = q[rows, token], p[rows, token]
            trying = valid[:, rank] & (chosen < 0) & (q_token > 0)
            kept = trying & (uniforms[:, rank] * rho * q_token < p_token)  # min(1, p / (rho q))
            chosen = torch.where(kept, index[:, rank] + 1, chosen)
        # None kept: the residual p - c min(q, p / rho), c = share; a leaf keeps p itself.
        residual = _residual(p, share[:, None] * torch.minimum(q, p / rho[:, None]))
        return chosen, torch.where(((chosen < 0) & (k > 0))[:, None], residual, p)


# A rule's name (acceptance=exact, typical, spectr) or the rule itself
Acceptance = str | AcceptanceRule


def acceptance_rule(acceptance: Acceptance) -> AcceptanceRule:
    """The rule `acceptance` names (`RULES`), or `acceptance` when it is one."""
    if isinstance(acceptance, AcceptanceRule):
        return acceptance
    if acceptance not in RULES:
        raise ValueError(f"acceptance must be one of {tuple(RULES)} or an AcceptanceRule, "
                         f"got {acceptance!r}")
    return RULES[acceptance]()


@dataclass(frozen=True)
class AcceptanceSettings:
    """How every step of a call accepts, chosen once: head 0's `sampling`, the `rule` when
    sampling, and `exact` mode (module docstring)."""

    sampling: SamplingConfig = SamplingConfig()
    rule: AcceptanceRule = RecursiveRejection()
    exact: bool = False


@dataclass(frozen=True)
class Draws:
    """One step's random numbers, drawn before it: uniform (B, m - 1), one per draft for its
    test u * q < p, and exponential (B, V), the race for the next token (`sampling.sample`);
    exact mode: uniform (B, m), one per node for the token after it, no exponential."""

    uniform: Tensor
    exponential: Tensor | None = None

    @staticmethod
    def draw(batch: int, nodes: int, vocab: int, generator: torch.Generator | None,
             device: torch.device | str) -> Draws:
        uniform = torch.rand((batch, nodes - 1), generator=generator, device=device)
        return Draws(uniform, exponential((batch, vocab), generator, device))


@dataclass(frozen=True)
class Accepted:
    """Per sequence: the last accepted node, its depth, and the new tokens (B, depth + 1): the
    kept drafts along the path, then at index n_accepted the next root (later ones unused)."""

    node: Tensor  # (B,)
    n_accepted: Tensor  # (B,)
    tokens: Tensor  # (B, depth + 1)


def accept(drafts: Drafts, target: Tensor, tree: Tree,
           settings: AcceptanceSettings = AcceptanceSettings(), draws: Draws | None = None, *,
           buffers: TreeBuffers | None = None) -> Accepted:
    """Verify `drafts` (the nodes of `tree`) against head 0's logits `target` (B, m, V) by the
    settings' rule, or exact mode's; `draws` when sampling; `buffers`: the tree's, on device."""
    sampling, exact = settings.sampling, settings.exact
    batch = target.shape[0]
    if buffers is None:
        buffers = tree.buffers(target.device)
    if buffers.depths.dim() == 1:  # one tree for every row (a step reads no tree.py)
        buffers = buffers.rows(batch)
    rows = torch.arange(batch, device=target.device)
    real = None if drafts.lengths is None else (  # (B, m - 1): which drafts are not padding
        torch.arange(drafts.tokens.shape[1], device=target.device) < drafts.lengths[:, None])
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
    else:
        node, next_token = settings.rule.select(drafts, probabilities(target, sampling), tree,
                                                buffers, real, draws)
    path = buffers.ancestors[rows, node][:, 1:]  # (B, depth): the accepted nodes, then padding
    tokens = drafts.tokens.gather(1, (path - 1).clamp(min=0))
    tokens = torch.cat([tokens, next_token[:, None]], dim=1)  # (B, depth + 1)
    n_accepted = buffers.depths[rows, node]
    tokens[rows, n_accepted] = next_token
    return Accepted(node, n_accepted, tokens)


def _and(kept: Tensor, real: Tensor | None) -> Tensor:
    return kept if real is None else kept & real


def _deepest_kept(kept: Tensor, buffers: TreeBuffers) -> Tensor:
    """The deepest node (B,) whose whole path is kept (kept (B, m - 1): nodes 1..m-1); ties
    to the lower node index (lower ranks)."""
    root = torch.ones(kept.shape[0], 1, dtype=torch.bool, device=kept.device)
    kept = torch.cat([root, kept], dim=1)  # the root is always kept
    ancestors = buffers.ancestors  # (B, m, depth + 1)
    on_path = kept.gather(1, ancestors.flatten(1)).view(ancestors.shape).all(-1)  # (B, m)
    return (on_path * (buffers.depths + 1)).argmax(-1)  # argmax returns the first maximum


def _descend(drafts: Drafts, p_all: Tensor, tree: Tree, buffers: TreeBuffers,
             real: Tensor | None, draws: Draws, choose: Callable[..., tuple[Tensor, Tensor]]
             ) -> tuple[Tensor, Tensor]:
    """SpecInfer's or SpecTr's walk down the tree, `choose` picking at each node: the last
    accepted node (B,) and the token drawn after it (B,); node i's test draws uniform[:, i - 1]."""
    batch = p_all.shape[0]
    rows = torch.arange(batch, device=p_all.device)
    node = torch.zeros(batch, dtype=torch.long, device=p_all.device)
    p = p_all[:, 0]  # (B, V) the current target
    descending = torch.ones(batch, dtype=torch.bool, device=p_all.device)
    for width in tree.widths:  # the most children of any node at each depth
        children = buffers.children[rows, node, :width]  # (B, width), -1 padded
        index = (children - 1).clamp(min=0)  # their drafts
        valid = (children >= 0) & descending[:, None]  # (B, width): the drafts to try
        if real is not None:
            valid &= real.gather(1, index)
        uniforms = draws.uniform.gather(1, index).to(p.dtype)
        chosen, p = choose(drafts, p, index, valid, uniforms)
        moved = chosen >= 0
        node = torch.where(moved, chosen, node)
        p = torch.where(moved[:, None], p_all[rows, node], p)
        descending &= moved
    return node, sample(p, draws.exponential)


def _proposal(drafts: Drafts, rows: Tensor, index: Tensor, p: Tensor) -> Tensor:
    """q (B, V) of the draft at `index` (B,) of each row: one-hot for deterministic drafts."""
    if drafts.probs is None:
        return torch.nn.functional.one_hot(drafts.tokens[rows, index], p.shape[-1]).to(p.dtype)
    return drafts.probs[rows, index].to(p.dtype)


def _residual(p: Tensor, removed: Tensor) -> Tensor:
    """normalise(max(p - removed, 0)); p itself where that is all zero (p == q: a rejection
    there has probability 0)."""
    residual = (p - removed).clamp(min=0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=1e-30), p)


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
