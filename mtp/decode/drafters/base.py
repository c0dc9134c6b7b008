"""The drafter seam of speculative decoding: who proposes tokens, apart from who verifies them.

A drafter proposes draft tokens for every sequence of the batch, with the distributions q it
drew them from (or none: a deterministic drafter's q is one-hot on its draft, for which the
acceptance rule is still exact). The decode step verifies them with the target model and
accepts a path (`acceptance.accept`); then it hands the drafter what that forward pass
verified and kept (`Verified`), from which the drafter updates its own state (a draft
model's cache, prompt lookup's n-gram index, the heads' hidden states). Verification and
acceptance never know who drafted, as in vLLM's proposer/scorer split and transformers'
`CandidateGenerator`; and `Verified` holds only facts of verification (what ran, what each
head computed, what was kept), so a new drafter takes what it needs from it and adds no
field to it.

Every drafter has a fixed shape, its `tree` (a chain of `max_drafts` drafts, or a tree of
`max_drafts` nodes under the last accepted token), and proposes exactly `max_drafts` drafts
per row at every step; a row with fewer real drafts pads, and `Drafts.lengths` says how
many are real. So a compiled verify forward has the same shape at every step, and an eager
one verifies a chain only up to the batch's longest real proposal (`engine.py`).

The decode loop (`loop.py`), in the drafter's words:

    drafter.start(model, prompts, cache, ...)    once, before the target's prefill
    drafter.update(verified)                     the prefill: the prompts, the first token
    loop:
        drafts = drafter.propose()               draft: max_drafts drafts per row
        (verify [last token, drafts]; accept a path)
        drafter.update(verified)                 commit: what the forward verified and kept
        drafter.keep(rows)                       now and then: finished sequences leave

The drafters are this package's other modules; each registers itself by name, with its
options and what `drafter=auto` measures of it (`registry.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mtp.decode.sampling import SamplingConfig, exponential, probabilities, sample
from mtp.decode.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


@dataclass(frozen=True)
class Drafts:
    """Draft tokens (B, n): the nodes 1..n of the drafter's tree, for every row.

    probs: the proposal distributions q (B, n, V), or None for a deterministic drafter (q is
        then one-hot on each draft). For siblings of a tree: q given the earlier siblings.
    lengths: how many leading drafts of each row are real (B,), or None when all n are. A
        row's drafts past its length are padding: never accepted, and with no q (the
        correction there is drawn from the target alone).
    parents: each draft's parent node (B, n) (0: the root), for a drafter whose tree changes
        from step to step (`tree.DynamicTree`): its nodes' tree this step, every row its own;
        a parent comes before its children. None for a fixed tree.
    """

    tokens: Tensor
    probs: Tensor | None = None
    lengths: Tensor | None = None
    parents: Tensor | None = None

    @property
    def count(self) -> int:
        """Draft positions per row (n)."""
        return self.tokens.shape[1]

    def real(self) -> Tensor:
        """Real drafts of each row (B,), on the device."""
        if self.lengths is not None:
            return self.lengths
        return torch.full((self.tokens.shape[0],), self.count, device=self.tokens.device)

    def proposal(self, vocab_size: int) -> Tensor:
        """q (B, n, V) with padding rows zero: one-hot where the drafter gave none."""
        if self.probs is not None:
            probs = self.probs
        else:
            probs = torch.zeros(*self.tokens.shape, vocab_size, device=self.tokens.device)
            probs.scatter_(-1, self.tokens[..., None], 1.0)
        if self.lengths is not None:
            real = torch.arange(self.count, device=probs.device) < self.lengths[:, None]
            probs = probs * real[..., None]
        return probs


@dataclass(frozen=True)
class Verified:
    """What one forward pass of the target verified and kept, for every row (B rows).

    pending (B, m): the tokens the forward ran on: the last accepted token (the tree's root),
        then the drafts; after the prefill, the prompts (right-padded).
    hidden (B, m, n, D): heads 0..n-1's hidden states at every pending token, before the
        shared norm (n: the drafter's `verify_heads`).
    predicted (B, m): head 0's argmax after every pending token; None after the prefill.
    path (B, P): the pending indices that stay in the cache, in order: the kept root-to-node
        path (the root, then the kept drafts); after the prefill, the whole prompt.
    kept (B,): how many leading entries of `path` are real; 0 for a row that had finished.
    tokens (B, P): the token after each path entry: the kept drafts, then the new root (the
        correction or bonus token) at index kept - 1; after the prefill, the prompt after
        its first token, then the first new token.
    new_ids: each row's new tokens on the host (the kept drafts and the new root); [] for a
        row that had finished before this step.
    last (B,): the pending index of each row's last kept token, whose heads predict the
        tokens after the new root (the root for a finished row); the engine always sets it.
    features (B, m, L, D): the trunk's residual stream after each layer the drafter's
        `verify_layers` names, at every pending token; None when it names none.
    grows (B,): whether each row's kept node has children in the step's tree (a tree's
        draft after the kept path was verified too); None after the prefill.

    A plain record: the engine fills every field, and a drafter reads the ones it needs.
    """

    pending: Tensor
    hidden: Tensor
    predicted: Tensor | None
    path: Tensor
    kept: Tensor
    tokens: Tensor
    new_ids: list[list[int]] | None = None
    last: Tensor | None = None
    features: Tensor | None = None
    grows: Tensor | None = None

    def last_two(self) -> Tensor:
        """The last two accepted tokens of each row (B, 2): the one before the newest, and it."""
        index = (self.kept - 1).clamp(min=0)[:, None]  # each row's last entry of `path`
        newest = self.tokens.gather(1, index)
        return torch.cat([self.pending.gather(1, self.path.gather(1, index)), newest], dim=1)

    def path_hidden(self) -> Tensor:
        """The heads' hidden states (B, P, n, D) at the path's tokens: every token this forward
        added to the cache, in order (row b's first kept[b] are real)."""
        rows = torch.arange(self.path.shape[0], device=self.path.device)[:, None]
        return self.hidden[rows, self.path]


@dataclass(frozen=True)
class DrafterContext:
    """What building a drafter may need besides the model: the saved choices of tuning steps
    for its checkpoint, by step (`saved`: "trees", the heads' calibration; "layer_skip", the
    searched layers), as the JSON each step saves; a drafter reads the one it needs."""

    saved: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NoOptions:
    """The options of a drafter that has none."""


class Drafter(ABC):
    """Proposes drafts for one `generate` call at a time; `start` resets its state.

    A drafter that `registry.register`s itself also says, as class attributes, how the
    command lines name, size and measure it (see `registry.py`).
    """

    #: Its name on the command lines: `python -m mtp.generate drafter=NAME`.
    name: str = ""
    #: Its options: a frozen dataclass whose fields are the command lines' keys.
    Options: type = NoOptions
    #: Options that, given with drafter=auto, name this drafter (k=4 alone: the heads).
    selects: tuple[str, ...] = ()
    #: Drafters whose candidates `drafter=auto` measures before this one's.
    after: tuple[str, ...] = ()
    #: The tuning step whose saved choice it reads from `DrafterContext.saved`, and the file
    #: that holds that choice beside a checkpoint (`mtp.generate` finds both).
    saved: str | None = None
    saved_file: str | None = None

    @classmethod
    def from_options(cls, model: MTPModel, options: Any,
                     context: DrafterContext) -> Drafter | None:
        """The drafter `options` describe for `model` (None: autoregressive decoding)."""
        raise NotImplementedError(f"{cls.__name__} is not built by name")

    @classmethod
    def candidates(cls, model: MTPModel, options: Any, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[Drafter]:
        """What `drafter=auto` measures of this drafter for `model` (none by default);
        `measured`: the tokens/s of the candidates measured so far, by label."""
        return ()

    @classmethod
    def check_named(cls, options: Any) -> None:  # noqa: B027 (optional)
        """Raise ValueError for options that cannot work when this drafter is named (not
        merely a candidate of auto), before anything loads."""

    @property
    @abstractmethod
    def tree(self) -> Tree:
        """The fixed shape of every proposal: `Tree.chain(n)` for a chain of n drafts."""

    @property
    def max_drafts(self) -> int:
        """Drafts per step (the verify forward has one more token)."""
        return self.tree.n_nodes - 1

    @property
    def max_depth(self) -> int:
        """The most drafts one step can accept: the tree's depth. Sizes the per-depth
        acceptance statistics."""
        return self.tree.depth

    def verify_heads(self, model: MTPModel) -> int:
        """How many of the target's heads the verify forward runs (their hidden states at the
        kept node reach `update`); only head 0 unless the drafter reads the others."""
        return 1

    def verify_layers(self, model: MTPModel) -> tuple[int, ...]:
        """The trunk layers whose output the verify forward keeps for `update`
        (`Verified.features`); none unless the drafter reads the target's features."""
        return ()

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:  # noqa: B027 (optional)
        """Raise ValueError before any decoding if the drafter cannot serve this model."""

    @abstractmethod
    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Begin a call: prompts as token ids (each starting with its document token), before
        any update. `cache` is the target's (filled by its prefill, after `start`): its
        `max_len` bounds the tokens of any row, drafts included, and a self-speculative
        drafter (layer skipping) runs the target on it, writing only past each row's
        committed tokens, in slots the next verify pass overwrites."""

    @abstractmethod
    def update(self, step: Verified) -> None:
        """Learn what the target verified and kept in its last forward pass (every row)."""

    @abstractmethod
    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences at batch `rows`, in that order."""

    @abstractmethod
    def propose(self) -> Drafts:
        """Drafts for the next forward pass: exactly `max_drafts` per row (padded)."""

    def __repr__(self) -> str:
        return self.name


class Autoregressive(Drafter):
    """No drafts: one token per forward pass, the baseline every speed-up is measured
    against (`generate` with drafter=None)."""

    name = "autoregressive"

    @classmethod
    def from_options(cls, model: MTPModel, options: Any, context: DrafterContext) -> None:
        return None  # `generate` decodes autoregressively without a drafter

    @property
    def tree(self) -> Tree:
        return Tree.chain(0)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self._none = torch.zeros(len(prompts), 0, dtype=torch.long,
                                 device=next(model.parameters()).device)

    def update(self, step: Verified) -> None:
        pass

    def keep(self, rows: list[int]) -> None:
        self._none = self._none[:len(rows)]

    def propose(self) -> Drafts:
        return Drafts(self._none)


def check_positive(name: str, value: object, least: int = 1) -> int:
    """`value` as an int >= `least`, or a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def check_flag(name: str, value: object) -> bool:
    """`value` as a bool, or a ValueError naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_threshold(threshold: object) -> float:
    """A draft-exit threshold (a probability in [0, 1)), or a ValueError naming it."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) \
            or not 0 <= threshold < 1:
        raise ValueError(f"threshold must be a probability in [0, 1) (0: never stop early), "
                         f"got {threshold!r}")
    return float(threshold)


class DraftBudget:
    """How many drafts each row proposes next, from its recent acceptance (the schedule of
    transformers' assistant models): a step that kept every draft the row proposed raises its
    count by two, one that rejected a draft lowers it by one, between 1 and `most`; a step
    that proposed nothing changes nothing. Every row starts at `most`.

    On a CPU a verify step costs more the more tokens it verifies, so drafts that are likely
    rejected are cut from the step (eagerly, the chain is cut to the longest real proposal),
    and a sequential drafter runs fewer draft forwards. The drafter sets `proposed`, each
    row's real drafts, when it proposes; `update` reads it with what the step kept."""

    def __init__(self, most: int, rows: int) -> None:
        self.most = most
        self.counts = [most] * rows
        self.proposed: list[int] = []  # each row's real drafts in the last proposal

    @property
    def longest(self) -> int:
        """The most drafts any row proposes next."""
        return max(self.counts)

    def update(self, step: Verified) -> None:
        """Learn from a step what each row kept of what it `proposed`."""
        for row, (count, ids) in enumerate(zip(self.proposed, step.new_ids)):
            if not ids or not count:  # a finished row, or nothing proposed: no evidence
                continue
            kept_all = len(ids) - 1 >= count  # the kept drafts, then the target's token
            self.counts[row] = min(self.most, self.counts[row] + 2) if kept_all \
                else max(1, self.counts[row] - 1)
        self.proposed = []

    def keep(self, rows: list[int]) -> None:
        self.counts = [self.counts[row] for row in rows]


def draft_options(threshold: float, adaptive: bool) -> str:
    """The draft-exit and adaptive options of a drafter's repr, when set."""
    return (f", threshold={threshold}" if threshold else "") + (", adaptive" if adaptive else "")


class DraftSequence:
    """The drafts of a drafter that drafts one position at a time (a draft model, layer
    skipping): each position's logits are turned into a draft by the target's sampling rule
    (`draw`), and a row stops drafting once its draft's top probability falls below
    `threshold` (Draft & Verify's draft-exit) or it has drafted its `budget` count: its later
    drafts are padding (`Drafts.lengths`), which an eager step does not verify. Threshold 0
    and no budget never stop: every draft is real, with no host read."""

    def __init__(self, count: int, sampling: SamplingConfig, generator: torch.Generator | None,
                 threshold: float = 0.0, budget: DraftBudget | None = None) -> None:
        self.count, self.sampling, self.generator = count, sampling, generator
        self.threshold, self.budget = threshold, budget
        self._tokens: list[Tensor] = []
        self._probs: list[Tensor] = []
        self._real: Tensor | None = None  # (B,) leading confident drafts, with a threshold
        self._alive: Tensor | None = None

    @property
    def positions(self) -> int:
        """The most positions to draft: `count`, or the budget's longest row."""
        return self.budget.longest if self.budget else self.count

    def draw(self, logits: Tensor) -> Tensor | None:
        """The next draft (B, 1) from the drafter's `logits` (B, V), drawn from q = the
        sampling rule's distribution (greedy: its argmax); None once no row drafts on.
        Confidence is the top probability of the logits' softmax, whatever the sampling."""
        probs = probabilities(logits, self.sampling)
        tokens = (probs.argmax(-1) if self.sampling.greedy else sample(
            probs, exponential(probs.shape, self.generator, logits.device)))[:, None]
        self._tokens.append(tokens)
        self._probs.append(probs)
        if not self.threshold:
            return tokens
        sure = torch.softmax(logits.float(), dim=-1).amax(-1) >= self.threshold
        self._alive = sure if self._alive is None else self._alive & sure
        self._real = self._alive.long() if self._real is None else self._real + self._alive
        return tokens if bool(self._alive.any()) else None  # a host read: with a threshold

    def run(self, logits: Callable[[Tensor, int], Tensor], first: Tensor) -> Drafts:
        """Draft position by position: `logits(fed, index)` runs the drafter on the tokens
        `fed` (first `first`, then each draft (B, 1)) and returns its logits (B, V) for
        position `index`; stops at `positions` or once no row drafts on."""
        fed: Tensor | None = first
        for index in range(self.positions):
            fed = self.draw(logits(fed, index))
            if fed is None:
                break
        return self.drafts()

    def drafts(self) -> Drafts:
        """The drafts so far, padded to `count` per row; tells the budget what was proposed."""
        tokens, probs = torch.cat(self._tokens, dim=1), torch.stack(self._probs, dim=1)
        missing = self.count - tokens.shape[1]
        if missing:
            tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], missing)], dim=1)
            probs = torch.cat([probs, probs.new_zeros(probs.shape[0], missing,
                                                      probs.shape[2])], dim=1)
        real = self._real
        if self.budget is not None:
            limits = torch.tensor(self.budget.counts, device=tokens.device)
            real = limits.clamp(max=len(self._tokens)) if real is None else real.minimum(limits)
            self.budget.proposed = real.tolist()
        return Drafts(tokens, probs, real)
