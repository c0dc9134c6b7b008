"""Sequential heads (DeepSeek-V3's MTP modules) as the drafter: one depth after another, as
EAGLE drafts, for chains and trees.

Module k at position t reads depth k - 1's state there and the token t + k, and predicts
token t + k + 1 (`MTPModel.mtp_module`). As in training, after each step module k's own KV
cache holds the positions whose token is accepted, 0..p - k (x_p: the root). Slot = position.
Each step, `propose` runs module k = 1..depth once, over
- the commit: the tokens accepted since the last step, x_{p'+1}..x_p, at positions
  p'+1-k..p-k, each fed by depth k - 1's state at the token before it (head 0's from the
  verify pass, `Verified.path_hidden`; a module's from its own commit);
- the tree: the drafts of depths 1..k-1, node u (depth d) at position p + d - k, fed by depth
  k - 1's state at u's parent, in slots past the committed ones (the next commit overwrites);
and draws the children of the depth k - 1 nodes from module k's distributions at them.

Example, a chain of depth 3 after a step that kept one draft (p' = 9, p = 11):

    module 1   commit x_10 x_11 at positions 9, 10   fed by head 0 at x_9 x_10   -> d_1 at 10
    module 2   commit x_10 x_11 at positions 8, 9    fed by module 1 at x_9 x_10 (x_9's from
               the last step); tree: d_1 at 10       fed by module 1 at x_11     -> d_2 at 10
    module 3   commit x_10 x_11 at positions 7, 8    fed by module 2 at x_9 x_10; tree: d_1 at
               9, d_2 at 10                          fed by module 2 at x_11, d_1 -> d_3 at 10

Tokens j < k (short prompts) have no position in module k: they go to a trash slot no query
sees. Shapes are fixed (the commit padded to the tree's depth + 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mtp.decode.drafters.base import Drafts, Verified
from mtp.decode.drafters.heads import OwnHeads, ranked
from mtp.decode.tree import DynamicTree
from mtp.decode.forward import key_width
from mtp.decode.sampling import SamplingConfig
from mtp.kv_cache import CacheStep, KVCache, cache_step
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


class SequentialDrafter(OwnHeads):
    """The modules 1..k-1 of a `head_type="sequential"` model draft a chain of k - 1 tokens, or
    the nodes of `tree`; the verify pass runs head 0 alone (the default `verify_heads`)."""

    sequential = True
    rowwise = ("_cache", "_root", "_last", "_commit")

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:
        if model.config.head_type != "sequential":
            raise ValueError(f"SequentialDrafter drafts with sequential modules, but "
                             f"model.head_type={model.config.head_type!r}: use HeadsDrafter")
        if isinstance(self.tree, DynamicTree):
            raise ValueError(f"tree={self.tree.name}: sequential modules draft a fixed tree "
                             f"(chain, tree8..tree64, auto:N or rank paths)")
        self.check_size(model)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        config, depth = model.config, self.tree.depth
        self._model, self._sampling, self._generator = model, sampling, generator
        param = next(model.parameters())
        first = config.n_layers + config.head_layers  # module 1's first block
        # Past max_len: the tree's scratch slots and the trash slot.
        self._cache = KVCache(config, len(prompts), cache.max_len + self.tree.n_nodes + 1,
                              device=param.device, dtype=param.dtype,
                              blocks=range(first, first + depth * config.head_layers))
        self._root = torch.zeros(len(prompts), dtype=torch.long, device=param.device)  # p
        # Module k's state at the root token (B, depth, D): what feeds module k + 1 next.
        self._last = torch.zeros(len(prompts), depth, config.dim, dtype=param.dtype,
                                 device=param.device)
        self._commit: tuple[Tensor, Tensor, Tensor] | None = None
        self._plan = TreePlan(self.tree, param.device)

    def update(self, step: Verified) -> None:
        # The commit: the tokens accepted since the last step, and head 0's states at the
        # tokens before them (B, C, D).
        self._commit = (step.tokens, step.path_hidden()[:, :, 0], step.kept)

    def propose(self) -> Drafts:
        model, plan = self._model, self._plan
        tokens, fed, counts = self._commit  # fed: depth 0's states before the commit's tokens
        batch, width = tokens.shape
        old, new = self._root, self._root + counts
        rows = torch.arange(batch, device=tokens.device)
        drafts = torch.zeros(batch, self.tree.n_nodes - 1, dtype=torch.long,
                             device=tokens.device)
        probs = []
        length = key_width(int(new.max()) + self.tree.n_nodes + 1, self._cache.max_len)
        nodes_out = fed[:, :0]  # depth k - 1's states at the tree's nodes (none for head 0)
        for k in range(1, self.tree.depth + 1):
            n = plan.nodes[k]  # the tree's nodes 1..n have depths 1..k-1
            parents = torch.cat([self._last[:, k - 2, None] if k > 1 else fed[:, :0],
                                 nodes_out], dim=1)  # (B, 1 + nodes, D): root, then nodes
            node_fed = parents[:, plan.parents[k]]  # (B, n, D)
            step = self._step(k, old, counts, new, n, length)
            out = model.mtp_module(torch.cat([fed, node_fed], dim=1),
                                   torch.cat([tokens, drafts[:, :n]], dim=1), k,
                                   cache=self._cache, step=step)  # (B, C + n, D)
            committed, nodes_out = out[:, :width], out[:, width:]
            # Module k at the tokens before the next commit's: its state at the old root, then
            # its commit's; then its state at the new root (unchanged for a finished row).
            fed = torch.cat([self._last[:, k - 1, None], committed[:, :width - 1]], dim=1)
            root_state = committed[rows, (counts - 1).clamp(min=0)]
            self._last[:, k - 1] = torch.where(counts[:, None] > 0, root_state,
                                               self._last[:, k - 1])
            # The depth k - 1 nodes' children, from module k's distributions there.
            at = self._last[:, 0, None] if k == 1 else nodes_out[:, plan.groups[k]]  # (B, G, D)
            candidates, q = ranked(model.unembed(at), plan.ranks[k], self._sampling,
                                   self._generator, self.iid)
            drafts[:, plan.children[k] - 1] = candidates.flatten(1)[:, plan.picks[k]]
            if q is not None:
                probs.append(q.flatten(1, 2)[:, plan.picks[k]])  # (B, c, V)
        self._root = new
        return Drafts(drafts, None if self._sampling.greedy else torch.cat(probs, dim=1))

    def _step(self, k: int, old: Tensor, counts: Tensor, new: Tensor, n: int,
              length: int) -> CacheStep:
        """Positions, slots (B, C + n) and mask (B, 1, C + n, L) of module k's commit (C
        tokens) and the tree's nodes 1..n, over `length` slots."""
        tokens = self._commit[0]
        width, device = tokens.shape[1], tokens.device
        holds = (new + 1 - k).clamp(min=0)  # positions module k holds after the commit
        trash = holds + n  # after the nodes: one slot for every token module k leaves out
        slots = torch.arange(length, device=device)  # (L,)
        position = old[:, None] + 1 + torch.arange(width, device=device) - k  # (B, C)
        valid = (torch.arange(width, device=device) < counts[:, None]) & (position >= 0)
        commit_slot = torch.where(valid, position, trash[:, None])
        commit_mask = torch.where(valid[..., None], slots <= position[..., None],
                                  slots == trash[:, None, None])  # (B, C, L)
        node_position = new[:, None] + self._plan.depths[1:n + 1] - k  # (B, n)
        # Node u sees its ancestors and itself, but no node before position 0 but itself.
        seen = self._plan.visible[1:n + 1, 1:n + 1] & ((node_position >= 0)[:, None, :]
                                                       | torch.eye(n, dtype=torch.bool,
                                                                   device=device))
        nodes = cache_step(holds, node_position - holds[:, None], seen, length)  # at slots holds..
        limit = self._model.config.max_seq_len - 1  # past the context: rows about to stop
        positions = torch.cat([position, nodes.positions], dim=1).clamp(0, limit)
        return CacheStep(positions, torch.cat([commit_slot, nodes.slots], dim=1),
                         torch.cat([commit_mask[:, None], nodes.mask], dim=2))


class TreePlan:
    """A tree's bookkeeping per depth k, computed once: the nodes 1..nodes[k] run, their
    parents, the depth k - 1 nodes that draw children (`groups`), the ranks they need, and
    where each child's candidate sits among them (`picks`)."""

    def __init__(self, tree, device: torch.device) -> None:
        buffers = tree.buffers(device)
        depths = tree.depths
        self.depths, self.visible = buffers.depths, buffers.visible
        self.nodes, self.parents, self.groups, self.ranks = {}, {}, {}, {}
        self.children, self.picks = {}, {}
        for k in range(1, tree.depth + 1):
            n = sum(1 for d in depths[1:] if d < k)
            self.nodes[k] = n
            self.parents[k] = torch.tensor(tree.parents[1:n + 1], dtype=torch.long,
                                           device=device)
            groups = [u for u, d in enumerate(depths) if d == k - 1]
            children = [u for u, d in enumerate(depths) if d == k]
            ranks = [tree.paths[u - 1][-1] for u in children]
            self.ranks[k] = max(ranks) + 1
            self.groups[k] = torch.tensor([u - 1 for u in groups], device=device)
            self.children[k] = torch.tensor(children, device=device)
            self.picks[k] = torch.tensor(
                [groups.index(tree.parents[u]) * self.ranks[k] + r
                 for u, r in zip(children, ranks)], device=device)
