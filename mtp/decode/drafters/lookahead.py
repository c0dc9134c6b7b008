"""Lookahead decoding (Fu et al. 2024) as a drafter: Jacobi iteration fills an n-gram pool,
and the n-grams that start with the last accepted token are the drafts. No extra model.

Per sequence: a window of N - 1 rows by W columns, and a pool of n-grams. Row l's column c
sits l + c positions after the root (R_0[0]), so each column read downwards runs along the
text:

    offset   0     1     2     3     4     5        (W = 4, N = 4)
    R_0      root  a_1   a_2   a_3
    R_1            b_0   b_1   b_2   b_3
    R_2                  c_0   c_1   c_2   c_3

One forward pass verifies it as one tree (R_0[c]'s parent is R_0[c - 1], R_l[c]'s is
R_{l-1}[c]), with up to G pooled guesses as chains under the root, tried first. Head 0's
token after R_{N-2}[c] is the next Jacobi iterate new[c], and column c's n-gram R_0[c], ...,
new[c] goes to the pool (at most G per first token), as do the context's own n-grams. After
a step the window moves on by one position, however many tokens were accepted (lade's
default; keeping positions gave 2.84 tokens per forward on byte8 against 3.08). Every node
is a deterministic draft (one-hot q), so decoding stays exact.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mtp.cli import check_positive
from mtp.decode.drafters.base import Drafter, Drafts, Verified
from mtp.decode.drafters.registry import register
from mtp.decode.sampling import SamplingConfig
from mtp.decode.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel


class NgramPool:
    """n-grams by first token: up to `size` continuations each, most recently seen last."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.grams: dict[int, list[tuple[int, ...]]] = {}

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        if self.size == 0:
            return
        seen = self.grams.setdefault(key, [])
        if continuation in seen:
            seen.remove(continuation)
        elif len(seen) == self.size:
            del seen[0]
        seen.append(continuation)

    def add_text(self, ids: Sequence[int], n: int, start: int = 0) -> None:
        """Every n-gram of `ids` that ends at index `start` or later, in text order."""
        for end in range(max(start, n - 1), len(ids)):
            self.add(ids[end - n + 1], tuple(ids[end - n + 2:end + 1]))

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of `key`, most recent first."""
        return self.grams.get(key, [])[::-1]


@dataclass(frozen=True)
class Layout:
    """One lookahead forward's tree; source[i]: node i + 1's index into a row's flat tokens
    (window rows, then the guesses'); top[c]: the node of R_{rows-1}[c] (new[c] after it)."""

    tree: Tree
    source: list[int]
    top: list[int]


@functools.cache
def layout(window: int, rows: int, guesses: int, length: int) -> Layout:
    """The tree of `rows` window rows of `window` columns and `guesses` chains of `length`:
    guess g is the chain (g, 0, 0, ...); R_0[c] is (guesses, 0, ..., 0) with c entries;
    R_l[c] extends R_0[c] with rank 1 (rank guesses + 1 below the root), then 0s."""
    chain = [()] + [(guesses,) + (0,) * (c - 1) for c in range(1, window)]  # R_0[c]
    flat = {chain[c]: c for c in range(1, window)}  # rank path -> index into the flat tokens
    for row in range(1, rows):
        for c in range(window):
            down = (1,) if c else (guesses + 1,)
            flat[chain[c] + down + (0,) * (row - 1)] = row * window + c
    for g in range(guesses):
        for j in range(length):
            flat[(g,) + (0,) * j] = rows * window + g * length + j
    tree = Tree(tuple(flat), name=f"lookahead(W={window}, rows={rows}, G={guesses})")
    source = [flat[path] for path in tree.paths]
    node = {index: i + 1 for i, index in enumerate(source)} | {0: 0}
    return Layout(tree, source, [node[(rows - 1) * window + c] for c in range(window)])


class _Sequence:
    """One sequence's context, n-gram pool and Jacobi window (rows of W tokens)."""

    def __init__(self, ids: Sequence[int], drafter: Lookahead, seed: int) -> None:
        self.context = list(ids)
        self.pool = NgramPool(drafter.guesses)
        self.pool.add_text(self.context, drafter.ngram)
        self.rng = random.Random(seed)  # its own: a sequence drafts alike alone or in a batch
        self.width = drafter.window
        # The prompt's last token is the root until the first token is accepted.
        self.window = [self._refill([self.context[-1]])] + [
            self._refill([]) for _ in range(drafter.ngram - 2)]

    def _refill(self, row: list[int]) -> list[int]:
        """`row` cut or topped up to W tokens drawn from the context (lade's `copy_from`)."""
        missing = self.width - len(row)
        return row[:self.width] + [self.rng.choice(self.context) for _ in range(missing)]

    def advance(self, ids: list[int], new: list[int] | None, n: int) -> None:
        """Accept `ids` (the last is the new root); `new`: the next Jacobi row (None after
        the prefill, which verified no window). The window moves on by one position."""
        window = self.window
        if new is None:
            rows = [row[1:] for row in window]
        else:
            for c in range(self.width):  # column c's n-gram, keyed by its first token
                self.pool.add(window[0][c], tuple(row[c] for row in window[1:]) + (new[c],))
            rows = window[1:] + [new]
        start = len(self.context)
        self.context += ids
        self.pool.add_text(self.context, n, start)  # after the window's: tried first
        self.window = [self._refill(row) for row in rows]
        self.window[0][0] = ids[-1]

    def flat(self, guesses: int, length: int) -> list[int]:
        """The window's rows, then `guesses` guesses of `length` tokens each (fewer repeated,
        or with none the window's row 0: useless but exact drafts)."""
        found = self.pool.guesses(self.window[0][0])[:guesses]
        if not found:
            found = [tuple((self.window[0][1:] * length)[:length])]
        tokens = [t for row in self.window for t in row]
        for g in range(guesses):
            tokens += found[g % len(found)]
        return tokens


@dataclass(frozen=True, kw_only=True)
class LookaheadOptions:
    """drafter=lookahead: window, the Jacobi window's columns W; ngram, the n-gram size N;
    guesses, the most n-grams G it verifies per step."""

    window: int = 5
    ngram: int = 4
    guesses: int = 5

    def __post_init__(self) -> None:
        check_positive("window", self.window, least=2)
        check_positive("ngram", self.ngram, 2, "an integer >= 2 (the n-gram size N): a "
                       "1-gram has no continuation to propose")
        check_positive("guesses", self.guesses, least=0)


@register
class Lookahead(Drafter):
    """Lookahead decoding: a Jacobi window of `window` columns collects `ngram`-grams; up to
    `guesses` of them that start with the last token are verified in the same forward pass.
    `seed` seeds the context tokens that refill the window (they shape the drafts only).
    """

    name = "lookahead"
    Options = LookaheadOptions
    rowwise = ("_rows",)

    def __init__(self, window: int = 5, ngram: int = 4, guesses: int = 5, seed: int = 0) -> None:
        LookaheadOptions(window=window, ngram=ngram, guesses=guesses)
        self.window, self.ngram, self.guesses, self.seed = window, ngram, guesses, seed
        # Every step's tree: (W - 1) + (N - 2) W + G (N - 1) drafts.
        self._plan = layout(window, ngram - 1, guesses, ngram - 1)
        self._rows: list[_Sequence] = []

    @property
    def tree(self) -> Tree:
        return self._plan.tree

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self._device = next(model.parameters()).device
        self._rows = [_Sequence(ids, self, self.seed * 1_000_003 + index)
                      for index, ids in enumerate(prompts)]

    def update(self, step: Verified) -> None:
        # Its window lives on the host: a read of its own, after the step's (lookahead alone).
        predicted = None if step.predicted is None else step.predicted.tolist()
        for b, (row, ids) in enumerate(zip(self._rows, step.new_ids)):
            if not ids:  # a finished row
                continue
            # new[c]: head 0's token after R_{N-2}[c], the next Jacobi iterate of column c.
            new = None if predicted is None else [predicted[b][node] for node in self._plan.top]
            row.advance(ids, new, self.ngram)

    def propose(self) -> Drafts:
        flats = [row.flat(self.guesses, self.ngram - 1) for row in self._rows]
        tokens = torch.tensor([[flat[i] for i in self._plan.source] for flat in flats])
        return Drafts(tokens.to(self._device))

    def __repr__(self) -> str:
        return f"lookahead(window={self.window}, ngram={self.ngram}, guesses={self.guesses})"
