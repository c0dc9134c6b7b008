"""Verification and acceptance, shared by every drafter (`drafter.py`).

The three steps of the decode loop, each a function; the worked example below uses the
model's own heads as the drafter (blockwise self-speculative decoding, Stern et al. 2018, as
Gloeckle et al. 2024 use it), but `verify` and `accept` do not know who drafted:

- draft (`heads_drafter.draft`): at the last accepted position t, head j (1 <= j < k)
  predicts token t + j + 1; those k - 1 tokens are the proposals, drawn from the heads' own
  distributions q_j. With a candidate tree (`tree.py`, Medusa) the heads also propose their
  second or third choices, with parent links. Other drafters propose their own tokens and q
  (`Drafts`).
- `verify`: one forward pass over `pending` = [the last accepted token, the k - 1 drafts]
  through the trunk and heads 0..k-1. Head 0 at pending position i gives the target
  distribution p_i of the token after it, which verifies draft i + 1; every head at every
  position also gives the material for the next drafts. A tree's nodes each sit at their
  depth and see only their ancestors.
- `accept` (`acceptance.py`): speculative sampling (Leviathan et al. 2023, Chen et al. 2023)
  draft by draft: keep draft d with probability min(1, p(d) / q(d)); at the first rejection
  draw the correction from normalise(max(p - q, 0)), and when every draft is kept draw a
  bonus token from head 0 at the last pending position. Each token then has exactly head
  0's distribution. Greedy is the same rule with one-hot p and q: a draft is kept iff it is
  head 0's argmax, and the correction is head 0's argmax. A tree tries a node's children
  in turn (SpecInfer); the cache then keeps the accepted path (`KVCache.compact`).

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

from mtp.generate.stacked_heads import StackedHeads
from mtp.generate.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel


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


def prefill(model: MTPModel, cache: KVCache, prompts: list[list[int]],
            heads: int | StackedHeads, pad_id: int) -> Tensor:
    """Cache the prompts in the trunk and heads 0..n-1: hidden states (B, n, D).

    The heads' outputs (before the shared norm and unembedding) at each prompt's last token;
    `heads` as in `hidden_states`.
    """
    lengths = [len(ids) for ids in prompts]
    tokens = torch.full((len(prompts), max(lengths)), pad_id, dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, :len(ids)] = torch.tensor(ids)
    hidden = hidden_states(model, cache, tokens.to(cache.keys.device), heads)  # (B, T, n, D)
    cache.rollback(lengths)  # right padding: each prompt keeps its own length
    rows = torch.arange(len(prompts), device=hidden.device)
    return hidden[rows, torch.tensor(lengths, device=hidden.device) - 1]


def verify(model: MTPModel, cache: KVCache, pending: Tensor, heads: int | StackedHeads,
           tree: Tree | None = None) -> tuple[Tensor, Tensor]:
    """One forward pass over `pending` (B, m) with heads 0..n-1 (see `hidden_states`).

    Returns head 0's logits (B, m, V) at every pending position, to verify the drafts, and
    every head's hidden states (B, m, n, D), of which the next drafts need one position.
    The cache must hold every accepted token before pending[:, 0]; it advances by m. With a
    `tree`, pending is the root and the tree's nodes: each sits at its depth and sees only
    its ancestors (`KVCache.masked_step`), and `KVCache.compact` then keeps the accepted path.
    """
    if tree is not None:
        buffers = tree.buffers(pending.device)
        cache.masked_step(buffers.depths, buffers.visible)
    hidden = hidden_states(model, cache, pending, heads)  # (B, m, n, D)
    return model.unembed(hidden[:, :, 0]), hidden
