"""One sequence's output: when it stops, what text it streams, and its decoding statistics.

The decode loops hand each sequence the tokens it accepted in a step (one, or several at
once); `SequenceOutput.add` consumes them in order and stops at the first of:
- EOS (kept in `token_ids`, absent from the text),
- a stop string in the decoded text (the text is cut before it; `token_ids` end with the
  token that completed it, however many tokens the step accepted),
- the token budget: `max_new_tokens` ("length"), or the room left in the model's context
  ("context") when that is smaller.
Text is streamed through the tokenizer's incremental decoder, so a byte model never emits
half a UTF-8 character, and text that could be the start of a stop string is held back until
it is known not to be one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from mtp.tokenizers import Tokenizer

FinishReason = Literal["eos", "stop", "length", "context"]
TextCallback = Callable[[int, str], None]


@dataclass(frozen=True)
class DecodeStats:
    """How a sequence was decoded. Head j's acceptance rate is over the drafts it got verified.

    With another drafter than the heads, "head j" is draft position j of a step (the j-th
    draft after the last accepted token).

    `head_acceptance[0]` is 1.0 (head 0's token is always kept); `head_verified[j]` counts the
    steps where drafts of head j reached verification (head j's drafts are verified only when
    drafts of heads 1..j-1 before them were accepted), so rates can be pooled across
    sequences. With a tree, head j's acceptance is the rate at which some depth-j draft was
    kept. `accepted_depths[d]` counts the forward passes that kept d drafts (the prefill
    counts as one that kept none); `nodes_verified` counts the tokens of every forward pass.
    """

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
        """Tokens verified per forward pass (the tree's size, less near the context's end)."""
        return self.nodes_verified / max(self.forward_passes, 1)

    @classmethod
    def pooled(cls, stats: Sequence[DecodeStats]) -> DecodeStats:
        """One summary of many sequences: totals, and rates weighted by what they count."""
        if not stats:
            raise ValueError("pooled() needs at least one DecodeStats")
        forwards = sum(s.forward_passes for s in stats)
        tokens = sum(s.new_tokens for s in stats)
        n_heads = max(len(s.head_verified) for s in stats)
        verified = [sum(s.head_verified[j] for s in stats if j < len(s.head_verified))
                    for j in range(n_heads)]
        accepted = [sum(s.head_acceptance[j] * s.head_verified[j] for s in stats
                        if j < len(s.head_verified)) for j in range(n_heads)]
        depths = [sum(s.accepted_depths[d] for s in stats if d < len(s.accepted_depths))
                  for d in range(max(len(s.accepted_depths) for s in stats))]
        return cls(forward_passes=forwards, new_tokens=tokens,
                   tokens_per_forward=tokens / max(forwards, 1),
                   head_acceptance=[a / v if v else 0.0 for a, v in zip(accepted, verified)],
                   seconds=max(s.seconds for s in stats), head_verified=verified,
                   accepted_depths=depths, nodes_verified=sum(s.nodes_verified for s in stats))


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


class SequenceOutput:
    """Accumulates one sequence's accepted tokens; decides when it is finished."""

    def __init__(self, index: int, tokenizer: Tokenizer, *, budget: int,
                 budget_reason: FinishReason, stop: Sequence[str], positions: int,
                 on_text: TextCallback | None, started: float) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self._eos = tokenizer.eos_id
        self._decoder = tokenizer.incremental_decoder()
        self._budget, self._budget_reason = budget, budget_reason
        self._stop = tuple(stop)
        self._on_text = on_text
        self._emitted = 0  # characters of `text` already given to on_text
        self._started = started
        self._seconds = 0.0
        self._forwards = 0
        # Per draft position (head) 0..positions-1: drafts verified and accepted; forward
        # passes by drafts accepted.
        self._verified = [0] * positions
        self._accepted = [0] * positions
        self._depths = [0] * positions
        self._nodes = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, ids: Sequence[int]) -> bool:
        """Take a step's accepted tokens in order, up to the first stop; True once finished."""
        for token in ids:
            self.token_ids.append(token)
            if token == self._eos:
                self._finish("eos")
                break
            self._append_text(self._decoder.push((token,)))
            if self.finished:
                break
            if len(self.token_ids) == self._budget:
                self._finish(self._budget_reason)
                break
        self._stream()
        return self.finished

    def count_forward(self, verified_drafts: int, accepted_drafts: int, nodes: int) -> None:
        """Record one forward pass of `nodes` tokens that verified drafts of heads
        1..verified_drafts and kept `accepted_drafts` of them."""
        self._forwards += 1
        self._nodes += nodes
        self._depths[accepted_drafts] += 1
        self._verified[0] += 1
        self._accepted[0] += 1
        for head in range(1, verified_drafts + 1):
            self._verified[head] += 1
            self._accepted[head] += head <= accepted_drafts

    def result(self) -> Generation:
        if self.finish_reason is None:
            raise RuntimeError(f"sequence {self.index} has not finished")
        new = len(self.token_ids)
        stats = DecodeStats(
            forward_passes=self._forwards, new_tokens=new,
            tokens_per_forward=new / max(self._forwards, 1),
            head_acceptance=[a / v if v else 0.0 for a, v in zip(self._accepted, self._verified)],
            seconds=self._seconds, head_verified=list(self._verified),
            accepted_depths=list(self._depths), nodes_verified=self._nodes)
        return Generation(self.text, list(self.token_ids), self.finish_reason, stats)

    def _append_text(self, piece: str) -> None:
        if not piece:
            return
        searched_from = max(0, len(self.text) - max(map(len, self._stop), default=0) + 1)
        self.text += piece
        hits = [i for i in (self.text.find(s, searched_from) for s in self._stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self._finish("stop")

    def _finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        if reason != "stop":
            self._append_text(self._decoder.flush())  # may still complete a stop string
        self._seconds = time.perf_counter() - self._started

    def _stream(self) -> None:
        if self._on_text is None:
            return
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        if end > self._emitted:
            self._on_text(self.index, self.text[self._emitted:end])
            self._emitted = end

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a stop string could still start with."""
        return max((n for s in self._stop for n in range(len(s) - 1, 0, -1)
                    if self.text.endswith(s[:n])), default=0)
