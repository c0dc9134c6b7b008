"""Self-speculative decoding with the heads (Stern et al. 2018; Medusa; Gloeckle et al. 2024).

The three steps of the decode loop, each a function:

- `draft`: at the last accepted position t, head j (1 <= j < k) predicts token t + j + 1.
  A candidate tree (`tree.py`) says which of each head's top candidates to verify and how
  they chain: the chain of k - 1 top-1 drafts is blockwise speculative decoding, a wider
  tree (Medusa) also tries head j's second or third choice.
- `verify`: one forward pass over `pending` = [the last accepted token (the root), the tree's
  drafts] through the trunk and heads 0..k-1, each node at its depth and seeing only its
  ancestors. Head 0 at node i gives the target distribution p_i of the token after it,
  which verifies node i's children; every head at every node also gives the material for
  the next drafts.
- `accept` (`acceptance.py`): the longest path that head 0 agrees with, by speculative
  sampling: lossless, and for greedy decoding exactly the autoregressive output. The cache
  keeps that path's entries (`KVCache.compact`) and drops the rest.

Worked example, k = 4. The cache holds the accepted tokens x_0..x_9 except the last, x_9.
The previous step left drafts d_1, d_2, d_3 for positions 10, 11, 12 (from heads 1, 2, 3 at
position 8, the position before x_9). Pending is [x_9, d_1, d_2, d_3] at positions 9..12:

    pending position  i        0     1     2     3
    token                      x_9   d_1   d_2   d_3
    head 0 predicts position   10    11    12    13     p_i verifies d_{i+1}
    head j predicts position   10+j  11+j  12+j  13+j

Say d_1 and d_2 are accepted and d_3 is rejected: n_accepted = 2, the new tokens are d_1,
d_2 and the correction c drawn at pending position 2 (position 12). The step produced
n_accepted + 1 = 3 tokens with one forward pass. The cache rolls back to hold x_9, d_1, d_2
(positions 9..11; d_3's entry is dropped), c is the new last accepted token, and heads
1..3 at pending position 2 (the position of d_2) propose positions 13, 14, 15: the next
pending is [c, d'_1, d'_2, d'_3]. With every draft accepted (n_accepted = 3) the bonus token
comes from head 0 at pending position 3 and the next drafts from the heads there too.

A tree works alike: with the tree [0], [1], [0, 0] pending is [x_9, a, b, c] where a and b
are head 1's two best guesses for position 10 (both at position 10, each seeing x_9 only)
and c is head 2's best guess for position 11, seen after a. If head 0 after x_9 says b, the
path x_9 -> b is accepted (c is not: it followed a), the cache keeps x_9 and b at positions
9 and 10, and head 0 after b gives the next token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtp.generate.acceptance import Drafts
from mtp.generate.sampling import SamplingConfig, probabilities
from mtp.generate.stacked_heads import StackedHeads
from mtp.generate.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel


def draft(head_logits: Tensor, tree: Tree, config: SamplingConfig,
          generator: torch.Generator | None = None) -> Drafts:
    """The heads' proposal for `tree`'s nodes 1..m-1, from the logits (B, depth, V) of heads
    1..depth at the last accepted position.

    The node at depth d and rank r gets head d's r-th candidate: its r-th most likely token
    when greedy (deterministic drafts), else its r-th draw without replacement from head d's
    distribution q (an exponential race: the order of q / E with E ~ Exp(1)), which comes
    with the distribution it was drawn from, q without the earlier draws, renormalised. Nodes
    at the same depth and rank share a token: every head reads the same position.
    """
    index = tree.buffers(head_logits.device).draft_index  # (m - 1,)
    ranks = max(tree.n_ranks, 1)
    if config.greedy:
        candidates = head_logits.topk(ranks, dim=-1).indices  # (B, depth, ranks)
        return Drafts(candidates.flatten(1)[:, index])
    q = probabilities(head_logits, config)  # (B, depth, V)
    race = q / torch.empty_like(q).exponential_(generator=generator)
    candidates = race.topk(ranks, dim=-1).indices  # (B, depth, ranks) in draw order
    drawn = torch.zeros(*candidates.shape, q.shape[-1], dtype=q.dtype, device=q.device)
    drawn.scatter_(-1, candidates[..., None], 1.0)  # (B, depth, ranks, V) one-hot draws
    earlier = drawn.cumsum(2) - drawn  # the draws before each rank
    remaining = q[:, :, None] * (1 - earlier)  # (B, depth, ranks, V)
    remaining = remaining / remaining.sum(-1, keepdim=True).clamp(min=1e-30)
    return Drafts(candidates.flatten(1)[:, index], remaining.flatten(1, 2)[:, index])


def hidden_states(model: MTPModel, cache: KVCache, tokens: Tensor,
                  heads: int | StackedHeads) -> Tensor:
    """Trunk and heads 0..n-1 over `tokens` (B, T) on the cache: (B, T, n, D).

    The heads' outputs before the shared norm and unembedding, which callers apply only where
    they need logits: the unembedding is the costliest layer of a large-vocabulary model.
    `heads` is n, to run the model's heads one by one, or a `StackedHeads` of n heads, which
    computes the same in one batched block per head layer. The cache advances by T.
    """
    trunk = model.trunk(tokens, cache=cache)  # (B, T, D)
    if isinstance(heads, StackedHeads):
        hidden = heads(trunk, cache=cache)
    elif heads == 1:
        hidden = model.head(trunk, 0, cache=cache)[:, :, None]
    else:
        hidden = torch.stack([model.head(trunk, i, cache=cache) for i in range(heads)], dim=2)
    cache.advance(tokens.shape[1])
    return hidden


def verify(model: MTPModel, cache: KVCache, pending: Tensor, heads: int | StackedHeads,
           tree: Tree) -> tuple[Tensor, Tensor]:
    """One forward pass over `pending` (B, m), `tree`'s nodes, with heads 0..n-1.

    The nodes sit at their depths after the cached prefix and each sees the prefix and its
    own ancestors (`KVCache.masked_step`). Returns head 0's logits (B, m, V) at every node,
    to verify the drafts, and every head's hidden states (B, m, n, D) (see `hidden_states`),
    of which the next drafts need one node's. The cache must hold every accepted token
    before pending[:, 0] (the root); it advances by m: `KVCache.compact` then keeps the
    accepted path.
    """
    buffers = tree.buffers(pending.device)
    cache.masked_step(buffers.depths, buffers.visible)
    hidden = hidden_states(model, cache, pending, heads)  # (B, m, n, D)
    return model.unembed(hidden[:, :, 0]), hidden
