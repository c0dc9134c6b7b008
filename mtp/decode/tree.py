"""Candidate trees for tree verification (Medusa, SpecInfer, EAGLE-2): rank paths and their
buffers (`TreeBuffers`, Medusa's `generate_medusa_buffers`).

A tree is a list of rank paths, as Medusa's `medusa_choices`: `[0, 1]` is head 1's top-1
followed by head 2's top-2; every prefix of a path is in the tree too. Node 0, the root, is
the last accepted token; nodes are numbered by depth, then rank path, so a parent comes
before its children. The chain of k - 1 drafts is the tree `[0], [0, 0], ...` of k nodes.

- `chain`; `tree8` .. `tree64`: fixed trees, Medusa's construction (`Tree.from_rates`, heads
  taken as independent) on a model-independent prior (`fixed_prior`);
- `auto:N`: the N - 1 rank paths most often accepted on calibration prompts (`Calibration`):
  prefix-closed, as a path is never accepted more often than its parent, and better than
  Medusa's construction, since heads are not independent;
- `dynamic:N` (EAGLE-2, `DynamicTree`): the drafter chooses each row's tree at every step
  within a fixed size and gives each draft's parent (`Drafts.parents`).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtp.paths import read_json, read_saved, write_json

TREE_FILE = "tree.json"
FIXED_SIZES = (8, 16, 32, 64)
# The fixed presets' prior, measured on no model: every head is right at rank r with
# probability 0.6 * 0.4 ** r (trees wide near the root and deep along the top-1 path).
FIXED_PRIOR_TOP1, FIXED_PRIOR_DECAY, FIXED_PRIOR_RANKS = 0.6, 0.4, 8


@dataclass(frozen=True)
class TreeBuffers:
    """A tree's tensors on one device, built before any step reads them."""

    depths: Tensor  # (m,) the position offset of every node, 0 for the root
    visible: Tensor  # (m, m) bool: node i sees node j iff j is i or one of its ancestors
    parents: Tensor  # (m - 1,) the parent of nodes 1..m-1
    draft_index: Tensor  # (m - 1,) node i's token is topk[(depth - 1) * ranks + rank]
    ancestors: Tensor  # (m, depth + 1) the root-to-node path, padded with the node itself
    children: Tensor  # (m, max children) the children of each node in rank order, -1 padded

    def rows(self, batch: int) -> TreeBuffers:
        """The buffers with a leading batch dimension (B, ...): a static tree's repeated as
        views (one tree for every row), a dynamic tree's as they are."""
        if self.depths.dim() == 2:
            return self
        return self.map(lambda t: t.expand(batch, *t.shape))

    def map(self, function: Callable[[Tensor], Tensor]) -> TreeBuffers:
        """`function` applied to every buffer."""
        return TreeBuffers(*(function(getattr(self, f.name)) for f in fields(self)))

    @staticmethod
    def from_parents(parents: Tensor, depth: int, branching: int) -> TreeBuffers:
        """Each row's buffers of a dynamic tree: `parents` (B, m - 1), the parent of nodes
        1..m-1 (0: the root; a parent always comes before its children), at most `depth`
        deep and `branching` children a node. No draft index: the drafter drafted already."""
        batch, m = parents.shape[0], parents.shape[1] + 1
        device = parents.device
        up = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), parents], 1)
        chain = [torch.arange(m, device=device).expand(batch, m)]  # node, parent, ..., root
        for _ in range(depth):
            chain.append(up.gather(1, chain[-1]))
        chain = torch.stack(chain, dim=-1)  # (B, m, depth + 1)
        depths = (chain[..., :depth] != 0).sum(-1)  # the root has none before it
        steps = (depths[..., None] - torch.arange(depth + 1, device=device)).clamp(min=0)
        ancestors = chain.gather(2, steps)  # root first, then down to the node, then the node
        visible = torch.zeros(batch, m, m, dtype=torch.bool, device=device).scatter_(
            2, ancestors, True)
        child = torch.arange(1, m, device=device)
        own = up[:, None, 1:] == torch.arange(m, device=device)[None, :, None]  # (B, m, m-1)
        order = torch.where(own, child, m).sort(-1).values[..., :branching]  # in index order
        children = torch.where(order < m, order, -1)
        return TreeBuffers(depths, visible, parents, torch.zeros_like(parents), ancestors,
                           children)


@dataclass(frozen=True)
class Tree:
    """A candidate tree: its rank paths, validated. Plain attributes, computed once (every
    step reads them): n_nodes (the root included); depth; n_ranks, the heads' top-k needed;
    is_chain, one path of rank-0 drafts (no tree mask or compaction)."""

    paths: tuple[tuple[int, ...], ...]
    name: str = "custom"
    _buffers: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    n_nodes: int = field(init=False, repr=False, compare=False)
    depth: int = field(init=False, repr=False, compare=False)
    n_ranks: int = field(init=False, repr=False, compare=False)
    is_chain: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        paths: dict[tuple[int, ...], None] = {}  # in order, without repeats
        for path in self.paths:
            if (isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or not path
                    or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                               for r in path)):
                raise ValueError(f"tree {self.name}: path {path!r} must be a non-empty list of "
                                 f"ranks (integers >= 0)")
            if tuple(path) in paths:
                raise ValueError(f"tree {self.name}: path {list(path)} appears twice")
            paths[tuple(path)] = None
        for path in paths:
            if len(path) > 1 and path[:-1] not in paths:
                raise ValueError(f"tree {self.name}: path {list(path)} needs its parent "
                                 f"{list(path[:-1])} in the tree too")
        object.__setattr__(self, "paths", tuple(sorted(paths, key=lambda p: (len(p), p))))
        object.__setattr__(self, "n_nodes", len(paths) + 1)
        object.__setattr__(self, "depth", max(map(len, paths), default=0))
        object.__setattr__(self, "n_ranks", max((r for p in paths for r in p), default=-1) + 1)
        object.__setattr__(self, "is_chain", all(p == (0,) * len(p) for p in paths))

    @classmethod
    @functools.cache
    def chain(cls, depth: int) -> Tree:
        """The rank-0 chain of `depth` drafts: blockwise speculative decoding's k = depth + 1.
        One instance per depth: its buffers are then built once for every decode step."""
        return Tree(tuple((0,) * d for d in range(1, depth + 1)), name="chain")

    def padded(self, n_nodes: int) -> Tree:
        """This tree grown to `n_nodes` >= its own by a chain below its last node (a chain: a
        longer chain), its nodes numbered as before: an exact step's padding drafts."""
        if n_nodes == self.n_nodes:
            return self
        if self.is_chain:
            return Tree.chain(n_nodes - 1)
        last = self.paths[-1]  # the deepest and last: nothing extends it yet
        extra = tuple(last + (0,) * i for i in range(1, n_nodes - self.n_nodes + 1))
        return Tree(self.paths + extra, name=f"{self.name}+{len(extra)}")

    @classmethod
    def from_rates(cls, rates: Sequence[Sequence[float]], n_nodes: int,
                   name: str | None = None) -> Tree:
        """The `n_nodes`-node tree (root included) of the most probable paths under `rates`:
        rates[d][r], the probability that head d + 1's rank-r token is accepted given its
        parent was; a path's, the product along it. Ties go to shallower, then lower ranks."""
        if not isinstance(n_nodes, int) or n_nodes < 1:
            raise ValueError(f"a tree needs n_nodes >= 1 (the root), got {n_nodes!r}")
        frontier = [(-float(p), (r,)) for r, p in enumerate(rates[0])] if rates else []
        heapq.heapify(frontier)
        chosen = []
        while frontier and len(chosen) < n_nodes - 1:
            value, path = heapq.heappop(frontier)
            chosen.append(path)
            if len(path) < len(rates):
                for r, p in enumerate(rates[len(path)]):
                    heapq.heappush(frontier, (value * float(p), path + (r,)))
        return cls(tuple(chosen), name=name or f"rates:{n_nodes}")

    @cached_property
    def depths(self) -> list[int]:
        """The depth of every node on the host (the root's is 0)."""
        return [0] + [len(path) for path in self.paths]

    @cached_property
    def parents(self) -> list[int]:
        """The parent of every node (the root's is -1)."""
        index = {(): 0} | {path: i + 1 for i, path in enumerate(self.paths)}
        return [-1] + [index[path[:-1]] for path in self.paths]

    @cached_property
    def ancestors(self) -> list[list[int]]:
        """The root-to-node path of every node, both ends included."""
        paths = [[0]]
        for node, parent in enumerate(self.parents[1:], start=1):
            paths.append(paths[parent] + [node])
        return paths

    @cached_property
    def widths(self) -> list[int]:
        """The most children of any node at depth 0, 1, ..., depth - 1."""
        counts: dict[tuple[int, ...], int] = {}
        for path in self.paths:
            counts[path[:-1]] = counts.get(path[:-1], 0) + 1
        return [max(c for parent, c in counts.items() if len(parent) == d)
                for d in range(self.depth)]

    def check(self, k: int, vocab_size: int) -> None:
        """A ValueError naming the first path the model cannot draft."""
        for path in self.paths:
            if len(path) > k - 1:
                raise ValueError(f"tree {self.name}: path {list(path)} has depth {len(path)}, "
                                 f"but heads 1..{k - 1} draft depths 1..{k - 1} "
                                 f"({k} heads used)")
            if max(path) >= vocab_size:
                raise ValueError(f"tree {self.name}: path {list(path)} has rank {max(path)}, "
                                 f"beyond the vocabulary of {vocab_size} tokens")

    def buffers(self, device: torch.device | str) -> TreeBuffers:
        """This tree's tensors on `device`, built once."""
        key = str(device)
        if key not in self._buffers:
            parents = torch.tensor([self.parents[1:]], dtype=torch.long, device=device)
            one = TreeBuffers.from_parents(parents, self.depth, max(self.widths, default=0))
            ranks = max(self.n_ranks, 1)  # siblings in rank order, then each node's topk index
            index = [(len(p) - 1) * ranks + p[-1] for p in self.paths]
            self._buffers[key] = replace(one.map(lambda t: t[0]), draft_index=torch.tensor(
                index, dtype=torch.long, device=device))
        return self._buffers[key]

    def to_json(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


@dataclass(frozen=True)
class DynamicTree(Tree):
    """The size of a tree a drafter chooses at every step (EAGLE-2): `n_nodes` nodes (the
    root included), at most `depth` deep and `branching` children a node. Its `paths` are a
    stand-in of that size; a step's own tree comes with its drafts (`Drafts.parents`)."""

    branching: int = 1

    @classmethod
    def of(cls, n_nodes: int, depth: int, branching: int) -> DynamicTree:
        if not 1 <= depth < n_nodes or branching < 1:
            raise ValueError(f"a dynamic tree needs 1 <= depth < n_nodes and branching >= 1, "
                             f"got n_nodes={n_nodes}, depth={depth}, branching={branching}")
        paths = [(0,) * d for d in range(1, depth + 1)]
        paths += [(r,) for r in range(1, n_nodes - depth)]
        return cls(tuple(paths), name=f"dynamic:{n_nodes}", branching=branching)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "is_chain", False)

    @cached_property
    def widths(self) -> list[int]:
        return [min(self.branching, self.n_nodes - 1)] * self.depth

    def padded(self, n_nodes: int) -> Tree:
        return self if n_nodes == self.n_nodes else DynamicTree.of(
            n_nodes, self.depth, max(self.branching, n_nodes - self.n_nodes))

    def buffers(self, device: torch.device | str) -> TreeBuffers:
        raise ValueError(f"tree {self.name} is chosen at every step: its buffers come with "
                         f"each step's drafts (TreeBuffers.from_parents)")


def fixed_prior(k: int) -> list[list[float]]:
    """The fixed presets' prior for heads 1..k-1."""
    row = [FIXED_PRIOR_TOP1 * FIXED_PRIOR_DECAY ** r for r in range(FIXED_PRIOR_RANKS)]
    return [row] * (k - 1)


@dataclass(frozen=True)
class Calibration:
    """Acceptance measured on calibration prompts for one model (`tree.json`,
    `mtp.generate.calibrate`): `rates[d][r]`, how often head d + 1's rank-r token was greedy
    decoding's, heads 1..d being right; `paths`, the most frequent rank paths, each with the
    share of positions that would accept its node (empty in older files)."""

    rates: list[list[float]]
    n_future: int
    vocab_size: int
    details: dict[str, Any] = field(default_factory=dict)
    paths: list[tuple[tuple[int, ...], float]] = field(default_factory=list)

    def tree(self, n_nodes: int, k: int | None = None, name: str | None = None) -> Tree:
        """`auto:N`: the N-node tree for heads 0..k-1 (default: all), from the path
        frequencies, else from the rates under Medusa's independence assumption."""
        depth = (self.n_future if k is None else k) - 1
        name = name or f"auto:{n_nodes}"
        medusa = Tree.from_rates(self.rates[:depth], n_nodes, name=name)
        if not self.paths:
            return medusa
        # A path is never accepted more often than its parent: the most frequent paths (ties
        # to shallower) are prefix-closed.
        frequent = sorted((-f, len(p), p) for p, f in self.paths if len(p) <= depth)
        chosen = {path for _, _, path in frequent[:n_nodes - 1]}
        # Calibration saw too few distinct paths (a short calibration): the rest by Medusa's
        # rule, most probable first, so that parents come before their children.
        for path in sorted(medusa.paths, key=lambda p: (-self._product(p), len(p), p)):
            if len(chosen) >= n_nodes - 1:
                break
            if len(path) == 1 or path[:-1] in chosen:
                chosen.add(path)
        return Tree(tuple(chosen), name=name)

    def _product(self, path: Sequence[int]) -> float:
        """A path's acceptance probability under the rates, heads taken as independent."""
        return math.prod(self.rates[d][r] for d, r in enumerate(path))

    def expected_length(self, tree: Tree) -> float:
        """Tokens per forward `tree` would accept on the calibration positions (its paths'
        frequencies), or under the rates' independence assumption without them."""
        if not self.paths:
            return 1.0 + sum(map(self._product, tree.paths))
        frequency = dict(self.paths)
        return 1.0 + sum(frequency.get(path, 0.0) for path in tree.paths)

    def to_json(self) -> dict[str, Any]:
        """What `tree.json` holds (with the auto:N trees of the fixed sizes, to read)."""
        return {"n_future": self.n_future, "vocab_size": self.vocab_size, "rates": self.rates,
                "paths": {",".join(map(str, p)): f for p, f in self.paths},
                "details": self.details,
                "trees": {str(n): self.tree(n).to_json() for n in FIXED_SIZES}}

    def save(self, directory: str | Path) -> Path:
        return write_json(Path(directory) / TREE_FILE, self.to_json())

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any], *, n_future: int,
             vocab_size: int) -> Calibration:
        """A calibration from its tree.json or `to_json`'s form, checked against a model of
        that shape."""
        data, source = read_saved(source, "tree calibration")
        try:
            rates = [[float(p) for p in row] for row in data["rates"]]
            paths = [(tuple(int(r) for r in p.split(",")), float(f))
                     for p, f in data.get("paths", {}).items()]
            calibration = cls(rates, int(data["n_future"]), int(data["vocab_size"]),
                              data.get("details", {}), paths)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{source} is not a tree calibration: {e}") from e
        if (calibration.n_future, calibration.vocab_size) != (n_future, vocab_size):
            raise ValueError(
                f"{source} was calibrated for n_future={calibration.n_future}, vocab_size="
                f"{calibration.vocab_size}, not this model's n_future={n_future}, "
                f"vocab_size={vocab_size}")
        if len(rates) != n_future - 1 or any(not 0 <= p <= 1 for row in rates for p in row):
            raise ValueError(f"{source}: rates must be {n_future - 1} rows (heads "
                             f"1..{n_future - 1}) of probabilities")
        if any(not p or len(p) > n_future - 1 or min(p) < 0 or not 0 <= f <= 1
               for p, f in calibration.paths):
            raise ValueError(f"{source}: paths must map rank paths of depth 1..{n_future - 1} "
                             f"(\"0,1\") to frequencies")
        return calibration


def resolve_tree(spec: Tree | str | Sequence[Sequence[int]], *, k: int, vocab_size: int,
                 calibration: Calibration | None = None) -> Tree:
    """The tree that `spec` names (a `Tree`, a list of rank paths, "chain", "tree8" ..
    "tree64", "auto:N" with `calibration`, "dynamic:N", or a JSON file of rank paths), checked
    against a model using heads 0..k-1."""
    if isinstance(spec, Tree):
        tree = spec
    elif isinstance(spec, str):
        tree = _named_tree(spec, k, calibration)
    elif isinstance(spec, Sequence) and spec:
        tree = Tree(tuple(spec))
    else:
        raise ValueError(f"tree must be a preset name, 'auto:N', a JSON file or a non-empty list "
                         f"of rank paths, got {spec!r}")
    tree.check(k, vocab_size)
    return tree


DYNAMIC_BRANCHING = 8  # a dynamic tree's most children of a node: the heads' top-8


def best_paths(scores: Tensor, n_nodes: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's `n_nodes` - 1 rank paths of the largest cumulative score (EAGLE-2's tree,
    for depths that draft independently, as the heads do), from scores (B, D, R), depth
    d + 1's rank-r log-probability: each node's depth (1-based), rank and parent (0: the
    root), (B, n_nodes - 1) each, parents first. A path scores no more than its parent, so
    a beam of n_nodes - 1 per depth holds them all; ties go to the shallower path."""
    batch, depth, ranks = scores.shape
    budget = n_nodes - 1
    kept_scores, kept_parent, kept_rank, levels = [], [], [], []
    total = torch.zeros(batch, 1, dtype=scores.dtype, device=scores.device)  # the root
    numbers = torch.zeros(batch, 1, dtype=torch.long, device=scores.device)  # in the pool
    pooled = 0
    for d in range(depth):
        candidates = (total[:, :, None] + scores[:, d, None, :]).flatten(1)  # (B, K * R)
        best, index = candidates.topk(min(budget, candidates.shape[1]), dim=1)
        kept_scores.append(best)
        kept_parent.append(numbers.gather(1, index // ranks))  # the parent's pool number
        kept_rank.append(index % ranks)
        levels.append(torch.full_like(index, d + 1))
        numbers = pooled + 1 + torch.arange(index.shape[1], device=scores.device).expand_as(index)
        pooled += index.shape[1]
        total = best
    kept, parents = keep_best(torch.cat(kept_scores, 1), torch.cat(kept_parent, 1), budget)
    return torch.cat(levels, 1).gather(1, kept), torch.cat(kept_rank, 1).gather(1, kept), parents


def keep_best(scores: Tensor, parents: Tensor, nodes: int) -> tuple[Tensor, Tensor]:
    """The `nodes` best candidates of each row (ties: the earlier), a tree as none scores above
    its parent, from scores (B, P) and each one's parent `parents` (B, P; j: the j-th, 0: the
    root): their pool indices in pool order (B, nodes), and their parents among them."""
    batch = scores.shape[0]
    kept = scores.sort(dim=1, descending=True, stable=True).indices[:, :nodes].sort(dim=1).values
    node = torch.zeros(batch, scores.shape[1] + 1, dtype=torch.long, device=scores.device)
    node.scatter_(1, kept + 1, torch.arange(1, nodes + 1, device=scores.device).expand(
        batch, nodes))  # pool number -> kept node
    return kept, node.gather(1, parents.gather(1, kept))


def _named_tree(spec: str, k: int, calibration: Calibration | None) -> Tree:
    if spec == "chain":
        return Tree.chain(k - 1)
    if spec.startswith("dynamic:"):
        size = spec[8:]
        if not size.isdigit() or int(size) < 2:
            raise ValueError(f"tree={spec!r}: dynamic:N needs a node budget N >= 2 (the last "
                             f"token and a draft), e.g. dynamic:16")
        return DynamicTree.of(int(size), min(k - 1, int(size) - 1),
                              min(DYNAMIC_BRANCHING, int(size) - 1))
    if spec.startswith("tree") and spec[4:] in {str(n) for n in FIXED_SIZES}:
        return Tree.from_rates(fixed_prior(k), int(spec[4:]), name=spec)
    if spec.startswith("auto:"):
        size = spec[5:]
        if not size.isdigit() or int(size) < 1:
            raise ValueError(f"tree={spec!r}: auto:N needs a node count N >= 1, e.g. auto:32")
        if calibration is None:
            raise ValueError(
                f"tree={spec!r} needs measured acceptance rates: run `python -m "
                f"mtp.generate.calibrate checkpoint=...` first (generate's command line and "
                f"eval read its choice)")
        return calibration.tree(int(size), k, name=spec)
    path = Path(spec)
    if path.suffix == ".json":
        if not path.is_file():
            raise ValueError(f"tree={spec!r}: no such file")
        paths = read_json(path, "a tree file")
        if isinstance(paths, dict) and "rates" in paths:
            raise ValueError(f"{path} is a calibration file: use tree=auto:N with its checkpoint")
        if not isinstance(paths, list) or not paths:
            raise ValueError(f"tree file {path} must hold a non-empty list of rank paths")
        return Tree(tuple(paths), name=str(path))
    raise ValueError(f"unknown tree {spec!r}: expected chain, "
                     f"{', '.join(f'tree{n}' for n in FIXED_SIZES)}, auto:N, dynamic:N, a "
                     f".json file of rank paths, or a list of rank paths")
