"""The drafter seam: who proposes tokens, apart from who verifies them (vLLM's
proposer/scorer split). A drafter proposes exactly `max_drafts` drafts per row at every step,
the nodes of its fixed `tree` (padding marked by `Drafts.lengths`), with the q it drew them
from (none: one-hot), so a compiled verify step has one shape; the step hands it back what it
verified and kept (`Verified`: facts of verification only).

    drafter.start(model, prompts, cache, ...)    once, before the target's prefill
    drafter.update(verified)                     the prefill: the prompts, the first token
    loop:
        drafts = drafter.propose()               draft: max_drafts drafts per row
        (verify [last token, drafts]; accept a path)
        drafter.update(verified)                 commit: what the forward verified and kept
        drafter.keep(rows)                       now and then: finished sequences leave
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mtp.cli import check_flag, check_number, check_positive
from mtp.decode.forward import cached_forward, key_width
from mtp.decode.sampling import SamplingConfig, exponential, probabilities, sample
from mtp.decode.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


@dataclass(frozen=True)
class Drafts:
    """Draft tokens (B, n): the nodes 1..n of the drafter's tree, for every row."""

    tokens: Tensor
    # The proposals q (B, n, V) (a tree's siblings: given the earlier ones); None: one-hot.
    probs: Tensor | None = None
    # How many leading drafts of each row are real (B,), the rest padding; None: all n.
    lengths: Tensor | None = None
    # Each draft's parent node (B, n) (0: the root; parents first) for a drafter choosing each
    # row's tree at every step (`tree.DynamicTree`); None: the drafter's fixed tree.
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
        probs = self.probs
        if probs is None:
            probs = torch.zeros(*self.tokens.shape, vocab_size, device=self.tokens.device)
            probs.scatter_(-1, self.tokens[..., None], 1.0)
        if self.lengths is not None:
            real = torch.arange(self.count, device=probs.device) < self.lengths[:, None]
            probs = probs * real[..., None]
        return probs

    def padded(self, count: int) -> Drafts:
        """These drafts grown to `count` per row by padding drafts (zeros, hanging from the
        root), which `lengths` leaves out."""
        missing = count - self.count
        if missing == 0:
            return self

        def pad(t: Tensor | None) -> Tensor | None:
            return None if t is None else torch.cat(
                [t, t.new_zeros(t.shape[0], missing, *t.shape[2:])], dim=1)

        return Drafts(pad(self.tokens), pad(self.probs), self.real(), pad(self.parents))


@dataclass(frozen=True)
class Verified:
    """What one forward pass of the target verified and kept, for every row (B rows). After
    the prefill: pending is the prompts (right-padded), path the whole prompt, tokens the
    prompt after its first token then the first new one; predicted and grows are None."""

    pending: Tensor  # (B, m): the last accepted token (the tree's root), then the drafts
    hidden: Tensor  # (B, m, n, D): heads 0..n-1 (`verify_heads`), before the shared norm
    predicted: Tensor | None  # (B, m): head 0's argmax after every pending token
    path: Tensor  # (B, P): the pending indices kept in the cache, in order (root to node)
    kept: Tensor  # (B,): how many of path's are real (0: a finished row)
    tokens: Tensor  # (B, P): the token after each path entry (the new root at kept - 1)
    new_ids: list[list[int]] | None = None  # each row's new tokens on the host ([]: finished)
    last: Tensor | None = None  # (B,): the pending index of the last kept token (or the root)
    features: Tensor | None = None  # (B, m, L, D): the trunk after each `verify_layers`
    grows: Tensor | None = None  # (B,): whether each row's kept node has children

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
    """What building a drafter may need besides the model: the JSON that tuning steps saved
    for its checkpoint, by step (`saved`: "trees", the heads' calibration; "layer_skip", ...)."""

    saved: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NoOptions:
    """The options of a drafter that has none."""


class Drafter(ABC):
    """Proposes drafts for one `generate` call at a time; `start` resets its state. The class
    attributes say how the command lines name, size and measure it (`registry.py`)."""

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
    #: Its state of one entry per row, which `keep` cuts to the rows kept (`kept`).
    rowwise: tuple[str, ...] = ()

    @classmethod
    def from_options(cls, model: MTPModel, options: Any,
                     context: DrafterContext) -> Drafter | None:
        """The drafter `options` describe for `model` (None: autoregressive decoding); by
        default, the options' fields are the constructor's keywords."""
        return cls(**vars(options))

    @classmethod
    def candidates(cls, model: MTPModel, options: Any, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[Drafter]:
        """What `drafter=auto` measures of this drafter for `model` (none by default);
        `measured`: the tokens/s of the candidates measured so far, by label."""
        return ()

    @classmethod  # noqa: B027 (optional: most drafters have nothing to check)
    def check_named(cls, options: Any) -> None:
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

    def verify_heads(self, model: MTPModel) -> int:
        """How many of the target's heads the verify forward runs (their hidden states reach
        `update`); only head 0 unless the drafter reads the others."""
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
        """Begin a call: prompts as token ids, before any update. `cache` is the target's
        (filled by its prefill, after `start`): its `max_len` bounds any row's tokens, drafts
        included; a self-speculative drafter (layer skipping) may write to it only past each
        row's committed tokens, in slots the next verify pass overwrites."""

    @abstractmethod
    def update(self, step: Verified) -> None:
        """Learn what the target verified and kept in its last forward pass (every row)."""

    def keep(self, rows: list[int]) -> None:
        """Keep only the sequences at batch `rows`, in that order (its `rowwise` state)."""
        for name in self.rowwise:
            setattr(self, name, kept(getattr(self, name), rows))

    @abstractmethod
    def propose(self) -> Drafts:
        """Drafts for the next forward pass: exactly `max_drafts` per row (padded)."""

    def __repr__(self) -> str:
        return self.name


def kept(state: Any, rows: list[int]) -> Any:
    """Per-row `state` at batch `rows`: a tensor (rows first), a host list, a tuple of such,
    None, or an object cut in place by its own `keep` (a KV cache, a `DraftBudget`)."""
    if isinstance(state, tuple):
        return tuple(kept(part, rows) for part in state)
    if isinstance(state, list):
        return [state[row] for row in rows]
    if isinstance(state, Tensor):
        return state[torch.tensor(rows, device=state.device)]
    if isinstance(state, KVCache):
        state.keep(torch.tensor(rows, device=state.keys.device))
    elif state is not None:
        state.keep(rows)
    return state


class Autoregressive(Drafter):
    """No drafts: one token per forward pass, the baseline every speed-up is measured
    against (`generate` with drafter=None)."""

    name = "autoregressive"
    rowwise = ("_none",)

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

    def propose(self) -> Drafts:
        return Drafts(self._none)


def check_threshold(threshold: object) -> float:
    """A draft-exit threshold (a probability in [0, 1)), or a ValueError naming it."""
    return check_number("threshold", threshold, lambda v: 0 <= v < 1,
                        "a probability in [0, 1) (0: never stop early)")


class DraftBudget:
    """How many drafts each row proposes next (transformers' assistant-model schedule): +2
    after a step that kept every draft the row proposed, -1 after a rejection, between 1 and
    `most` (the start). The drafter sets `proposed`, each row's real drafts, when it proposes;
    fewer likely-rejected drafts cost less to verify and to draft."""

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


class ChainDrafter(Drafter):
    """A drafter of a chain of `num_draft` drafts whose rows may draft fewer: `adaptive`
    (`DraftBudget`) and `threshold` (`forward_drafts`). Its repr shows the attributes `shown`."""

    num_draft: int
    threshold: float = 0.0
    adaptive: bool = False
    shown: tuple[str, ...] = ("num_draft",)
    #: How many of the last accepted tokens (1 or 2) `forward_drafts` feeds first (0: none).
    feeds: int = 0
    rowwise = ("_accepted", "_tail", "_budget")

    def size(self, num_draft: int, threshold: float = 0.0, adaptive: bool = False) -> None:
        """Set (and check) the drafts per step, the draft-exit threshold and adaptivity."""
        self.num_draft = check_positive("num_draft", num_draft)
        self.threshold = check_threshold(threshold)
        self.adaptive = check_flag("adaptive", adaptive)

    @property
    def tree(self) -> Tree:
        return Tree.chain(self.num_draft)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        self._sampling, self._generator = sampling, generator
        self._budget = DraftBudget(self.num_draft, len(prompts)) if self.adaptive else None
        self._accepted = [len(ids) for ids in prompts]  # each row's accepted tokens, on the host
        self._tail: Tensor | None = None  # (B, feeds): the last accepted tokens

    def update(self, step: Verified) -> None:
        self._accepted = [n + len(ids) for n, ids in zip(self._accepted, step.new_ids)]
        if self.feeds:
            self._tail = step.last_two()[:, 2 - self.feeds:]
        if self._budget is not None:
            self._budget.update(step)

    def forward_drafts(self, model: MTPModel, cache: KVCache, skip: Sequence[int] = ()
                       ) -> Drafts:
        """This step's drafts by `model`'s cached forward (trunk layers `skip` left out) on
        `cache`, which holds every accepted token but the last `feeds`: they are fed at once,
        then each draft, drawn by the target's sampling rule. A row stops once its draft's
        top probability falls below `threshold` (Draft & Verify's draft-exit) or at its
        budget's count; later drafts are padding. Threshold 0 and no budget never stop: every
        draft is real, with no host read. Positions past the model's context (only rows about
        to stop) are clamped, their drafts merely wrong."""
        fed = self._tail  # (B, feeds), then each draft (B, 1)
        feeds, budget, sampling = fed.shape[1], self._budget, self._sampling
        lengths = torch.tensor(self._accepted, device=fed.device) - feeds
        width = key_width(max(self._accepted) + self.num_draft, cache.max_len)
        tokens, probs = [], []
        alive = real = None  # with a threshold: rows still sure; their leading sure drafts
        for index in range(budget.longest if budget else self.num_draft):
            after = lengths + (index + feeds - 1 if index else 0)
            hidden = cached_forward(model, cache, fed, after, width, skip=skip)  # (B, T, 1, D)
            logits = model.unembed(hidden[:, -1, 0])
            q = probabilities(logits, sampling)
            fed = (q.argmax(-1) if sampling.greedy else sample(
                q, exponential(q.shape, self._generator, logits.device)))[:, None]
            tokens.append(fed)
            probs.append(q)
            if self.threshold:  # confidence: the top softmax probability, whatever the sampling
                sure = torch.softmax(logits.float(), dim=-1).amax(-1) >= self.threshold
                alive = sure if alive is None else alive & sure
                real = alive.long() if real is None else real + alive
                if not bool(alive.any()):  # a host read: with a threshold
                    break
        if budget is not None:
            limits = torch.tensor(budget.counts, device=fed.device)
            real = limits.clamp(max=len(tokens)) if real is None else real.minimum(limits)
            budget.proposed = real.tolist()
        return Drafts(torch.cat(tokens, dim=1), torch.stack(probs, dim=1),
                      real).padded(self.num_draft)

    def __repr__(self) -> str:
        values = [(name, getattr(self, name)) for name in self.shown]
        shown = [f"{name}={list(v) if isinstance(v, tuple) else v}" for name, v in values]
        shown += [f"threshold={self.threshold}"] * bool(self.threshold)
        return f"{self.name}({', '.join(shown + ['adaptive'] * self.adaptive)})"

