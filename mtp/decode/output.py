"""What a generation returns: its text and ids (`Generation`), why it ended (`FinishReason`),
how it was decoded (`DecodeStats`), and how repetitive decoded text is (`repetition`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Literal

FinishReason = Literal["eos", "stop", "length", "context"]
TextCallback = Callable[[int, str], None]


@dataclass(frozen=True)
class DecodeStats:
    """How a sequence was decoded; "head j" is draft position j of a step (depth j in a tree).
    `head_verified[j]`: the steps where a draft of head j reached verification (the drafts
    before it kept); `head_acceptance[j]`: the share of those that kept it (head 0: 1.0).
    `accepted_depths[d]`: the forward passes that kept d drafts (the prefill kept none);
    `nodes_verified`: the tokens of every forward pass."""

    forward_passes: int
    new_tokens: int
    tokens_per_forward: float
    head_acceptance: list[float]
    seconds: float
    head_verified: list[int] = field(default_factory=list)
    accepted_depths: list[int] = field(default_factory=list)
    nodes_verified: int = 0

    @property
    def nodes_per_forward(self) -> float:
        """Tokens verified per forward pass (less than the tree where an eager step cut a
        chain's padding)."""
        return self.nodes_verified / max(self.forward_passes, 1)

    @classmethod
    def pooled(cls, stats: Sequence[DecodeStats]) -> DecodeStats:
        """One summary of many sequences: totals, and rates weighted by what they count."""
        if not stats:
            raise ValueError("pooled() needs at least one DecodeStats")

        def totals(rows: Iterable[Sequence[float]]) -> list:  # by index, over the stats
            return [sum(column) for column in zip_longest(*rows, fillvalue=0)]

        return cls.counted(
            forwards=sum(s.forward_passes for s in stats), tokens=sum(s.new_tokens for s in stats),
            accepted=totals([a * v for a, v in zip(s.head_acceptance, s.head_verified)]
                            for s in stats),
            verified=totals(s.head_verified for s in stats), seconds=max(s.seconds for s in stats),
            depths=totals(s.accepted_depths for s in stats),
            nodes=sum(s.nodes_verified for s in stats))

    @classmethod
    def counted(cls, *, forwards: int, tokens: int, accepted: Sequence[float],
                verified: Sequence[int], seconds: float, depths: Sequence[int],
                nodes: int) -> DecodeStats:
        """The stats of these counts: drafts `accepted` and `verified` per head."""
        return cls(forward_passes=forwards, new_tokens=tokens,
                   tokens_per_forward=tokens / max(forwards, 1),
                   head_acceptance=[a / v if v else 0.0 for a, v in zip(accepted, verified)],
                   seconds=seconds, head_verified=list(verified), accepted_depths=list(depths),
                   nodes_verified=nodes)


def repeated_share(ids: Sequence[int], n: int) -> float:
    """Share of `ids` inside an n-gram that already occurred earlier in `ids`."""
    if len(ids) < n:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    covered = [False] * len(ids)
    for start in range(len(ids) - n + 1):
        gram = tuple(ids[start:start + n])
        if gram in seen:
            covered[start:start + n] = [True] * n
        seen.add(gram)
    return sum(covered) / len(ids)


def repetition(outputs: Sequence[Sequence[int]], n: int = 8) -> float:
    """Share of all the outputs' tokens inside an n-gram that their own output already
    produced: how repetitive (degenerate) decoded text is, pooled over outputs."""
    total = sum(map(len, outputs))
    return sum(repeated_share(ids, n) * len(ids) for ids in outputs) / max(total, 1)


@dataclass(frozen=True)
class Generation:
    """A generated continuation: its text, its new token ids, why it ended, and how."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: DecodeStats
