"""Multi-token prediction loss: label shifting for n heads, and three ways to backpropagate.

Every mode gives the same loss (the weighted sum of each head's mean cross-entropy) and the
same gradients; they differ in which logits are alive at once:

- `naive`: every head's logits (B, T, n, V) at once, one backward (tests, comparison).
- `headwise` (Gloeckle et al. 2024, section 2): each head runs forward and backward in turn
  on the detached trunk output, freeing its logits; one backward through the trunk ends the
  step. Memory O(V + d) per token, not O(nV + d).
- `chunked`: headwise, each head's unembedding and cross-entropy over `chunk_size` tokens at
  a time: not even one head's (B, T, V) logits exist.

Sequential heads (DeepSeek-V3's modules) form a chain, module k reading module k - 1's output
and token t + k; headwise, each module's output is detached, then the modules run backward
last first (`_sequential_backward`). An early exit (`early_exit=e`, LayerSkip: the path
`drafter=layer_skip` runs) adds head 0's loss on the stream after layer e - 1, weighted
`early_exit_weight`; the trunk then runs in two segments. A look-ahead term (`ahead=[a_1, ...]`,
modded-nanogpt) scores head 0 against tokens t + 2, t + 3, ... too.

Frozen parameters (Medusa-1) cost no backward; `train_trunk=False` detaches the trunk output
for a step (Medusa-2's heads-only warm-up).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from mtp.model import MTPModel, tokens_ahead
from mtp.train.settings import LossSettings

IGNORE_INDEX = -100


class BackwardFn(Protocol):
    """`tensor.backward(gradient)`, or Lightning's `manual_backward`, which takes the same."""

    def __call__(self, tensor: Tensor, gradient: Tensor | None = None) -> None: ...


def autograd_backward(tensor: Tensor, gradient: Tensor | None = None) -> None:
    """The plain `BackwardFn`, outside Lightning."""
    tensor.backward(gradient)


def shift_targets(tokens: Tensor, seq_len: int, n_future: int,
                  ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Inputs (B, seq_len) and targets (B, n_future, seq_len) of a block `tokens` (B, L).

    Head i at position t predicts tokens[:, t + i + 1]; a target past the block's end is
    `ignore_index`. E.g. seq_len=3, n_future=2: [[10, 11, 12, 13, 14]] gives inputs
    [[10, 11, 12]] and targets [[[11, 12, 13], [12, 13, 14]]].
    """
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be (batch, length), got shape {tuple(tokens.shape)}")
    if not 1 <= seq_len <= tokens.shape[1]:
        raise ValueError(f"seq_len={seq_len} must be in [1, {tokens.shape[1]}] "
                         f"(the block length)")
    if n_future < 1:
        raise ValueError(f"n_future must be >= 1, got {n_future}")
    missing = seq_len + n_future - tokens.shape[1]
    padded = F.pad(tokens, (0, max(missing, 0)), value=ignore_index)
    targets = torch.stack([padded[:, i + 1:i + 1 + seq_len] for i in range(n_future)], dim=1)
    return tokens[:, :seq_len], targets


@dataclass(frozen=True)
class LossOutput:
    """Detached results of one loss: `loss` is the weighted sum of every term."""

    loss: Tensor  # ()
    head_losses: Tensor  # (n,) mean cross-entropy of each head
    head_correct: Tensor  # (n,) top-1 hits
    head_count: Tensor  # (n,) targets that count (not ignore_index)
    exit_loss: Tensor | None = None  # () the early exit's next-token cross-entropy
    exit_correct: Tensor | None = None  # () its top-1 hits (of head_count[0] targets)
    ahead_losses: Tensor | None = None  # (K,) head 0's cross-entropy against t+2, ..., t+K+1
    ahead_correct: Tensor | None = None  # (K,) its top-1 hits there
    ahead_count: Tensor | None = None  # (K,) those targets that count

    @property
    def head_accuracy(self) -> Tensor:
        return self.head_correct / self.head_count.clamp(min=1)

    @property
    def ahead_accuracy(self) -> Tensor | None:
        return None if self.ahead_losses is None else \
            self.ahead_correct / self.ahead_count.clamp(min=1)


def _cross_entropy(logits: Tensor, targets: Tensor, denominator: int) -> tuple[Tensor, Tensor]:
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(wide, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()
    return loss / denominator, correct


@dataclass(frozen=True)
class Target:
    """Tokens a head's logits are scored against (its own, or head 0's look-ahead)."""

    tokens: Tensor  # (B*T,) ids, ignore_index where none
    denominator: int  # targets that count, at least 1: the term's mean divides by it
    weight: float

    def chunk(self, start: int, end: int) -> Target:
        return Target(self.tokens[start:end], self.denominator, self.weight)


def _scored(logits: Tensor, targets: Sequence[Target]) -> tuple[Tensor, Tensor, Tensor]:
    """(N, V) logits scored against each target: the weighted sum (what backpropagates), each
    term's mean cross-entropy (k,) and its top-1 hits (k,)."""
    losses, hits = zip(*(_cross_entropy(logits, t.tokens, t.denominator) for t in targets))
    total = sum(target.weight * loss for target, loss in zip(targets, losses))
    return total, torch.stack(losses), torch.stack(hits)


def mtp_loss(model: MTPModel, tokens: Tensor, settings: LossSettings | None = None, *,
             seq_len: int | None = None, backward: BackwardFn | None = None,
             train_trunk: bool = True, trunk_out: Tensor | None = None,
             **options: Any) -> LossOutput:
    """Loss of every head on `tokens` (B, L), and with `backward` (`manual_backward`,
    `autograd_backward`) its gradients; the inputs are the first `seq_len` (default: L less
    the look-ahead). `settings` reads a schedule's weights at the run's start (a training step
    passes `settings.resolved(...)`); its fields may come as `options` instead
    (`mode="naive", weights=[1, 0.5]`). `trunk_out`: a frozen trunk's output, computed before
    (`mtp.train.trunk_cache`), so the trunk does not run."""
    if settings is None:
        settings = LossSettings(**options)
    elif options:
        raise TypeError(f"mtp_loss takes settings or their fields {sorted(options)}, not both")
    config = model.config
    settings.check_model(n_future=config.n_future, n_layers=config.n_layers)
    lookahead = settings.lookahead(config.n_future)
    seq_len = tokens.shape[1] - lookahead if seq_len is None else seq_len
    inputs, targets = shift_targets(tokens, seq_len, lookahead)
    trunk = run_trunk(model, inputs, early_exit=settings.early_exit, train=train_trunk,
                      detach_exit=settings.mode != "naive", trunk_out=trunk_out)
    heads = _Heads.of(targets, settings, config.n_future, backward)
    if settings.mode == "naive":
        return _naive_loss(model, tokens, trunk, heads)
    chunk_size = settings.chunk_size if settings.mode == "chunked" else None
    return _headwise_loss(model, tokens, trunk, heads, chunk_size)


@dataclass(frozen=True)
class TrunkPass:
    """The trunk's output, and with an early exit the residual stream the exit reads."""

    out: Tensor  # (B, T, D) what the heads read
    exit_state: Tensor | None = None  # (B, T, D) the stream after layer early_exit - 1
    exit_in: Tensor | None = None  # exit_state or (headwise) its detached copy: what the
    # exit head and the later layers read


def run_trunk(model: MTPModel, inputs: Tensor, *, early_exit: int | None = None,
              train: bool = True, detach_exit: bool = True,
              trunk_out: Tensor | None = None) -> TrunkPass:
    """The trunk on `inputs` (B, T), or `trunk_out`; with an `early_exit`, in two segments,
    the second on the first's output (detached when `detach_exit`). `train=False`: no graph."""
    if trunk_out is not None:
        if early_exit is not None or trunk_out.requires_grad \
                or trunk_out.shape[:2] != inputs.shape:
            raise ValueError(f"a precomputed trunk_out (shape {tuple(trunk_out.shape)}) must "
                             f"be a frozen trunk's output for inputs of shape "
                             f"{tuple(inputs.shape)}, without an early exit "
                             f"(early_exit={early_exit})")
        return TrunkPass(trunk_out)
    with torch.set_grad_enabled(train and torch.is_grad_enabled()):
        if early_exit is None:
            return TrunkPass(model.trunk(inputs))  # no graph unless the trunk trains
        exit_state = model.trunk(inputs, skip=range(early_exit, model.config.n_layers))
        exit_in = exit_state.detach().requires_grad_(exit_state.requires_grad) \
            if detach_exit else exit_state
        return TrunkPass(model.resume_trunk(exit_in, early_exit), exit_state, exit_in)


@dataclass(frozen=True)
class _Heads:
    """Each head's targets (head 0's look-ahead terms after its own), counts and backward."""

    targets: list[list[Target]]  # per head: its own next tokens first
    counts: Tensor  # (lookahead,) targets that count at each distance t+1, t+2, ...
    exit_weight: float
    backward: BackwardFn | None

    @classmethod
    def of(cls, targets: Tensor, settings: LossSettings, n_future: int,
           backward: BackwardFn | None) -> _Heads:
        """The `n_future` heads of `targets` (B, lookahead, T), weighted as `settings` say."""
        counts = (targets != IGNORE_INDEX).sum(dim=(0, 2))
        denominators = counts.clamp(min=1).tolist()
        flat = [targets[:, i].flatten() for i in range(targets.shape[1])]
        per_head = [[Target(flat[i], denominators[i], weight)]
                    for i, weight in enumerate(settings.head_weights(n_future))]
        per_head[0] += [Target(flat[d], denominators[d], weight) for d, weight
                        in enumerate(settings.ahead_weights(n_future), start=1)]
        return cls(per_head, counts, settings.early_exit_weight, backward)

    def exit_targets(self) -> list[Target]:
        """The early exit's: head 0's next tokens, at the exit's weight."""
        own = self.targets[0][0]
        return [Target(own.tokens, own.denominator, self.exit_weight)]

    def output(self, losses: Sequence[Tensor], correct: Sequence[Tensor],
               exit_loss: Tensor | None = None, exit_hits: Tensor | None = None) -> LossOutput:
        """The detached `LossOutput` of the heads' losses and hits (k,) each, and the exit's
        (1,)."""
        losses = [loss.detach() for loss in losses]
        total = sum(t.weight * loss for targets, head in zip(self.targets, losses)
                    for t, loss in zip(targets, head))
        if exit_loss is not None:
            exit_loss, exit_hits = exit_loss.detach()[0], exit_hits[0]
            total = total + self.exit_weight * exit_loss
        ahead = len(self.targets[0]) - 1
        return LossOutput(loss=total, head_losses=torch.stack([loss[0] for loss in losses]),
                          head_correct=torch.stack([hits[0] for hits in correct]),
                          head_count=self.counts[:len(losses)],
                          exit_loss=exit_loss, exit_correct=exit_hits,
                          ahead_losses=losses[0][1:] if ahead else None,
                          ahead_correct=correct[0][1:] if ahead else None,
                          ahead_count=self.counts[1:1 + ahead] if ahead else None)


def _naive_loss(model: MTPModel, tokens: Tensor, trunk: TrunkPass, heads: _Heads) -> LossOutput:
    n = len(heads.targets)
    logits = torch.stack([model.unembed(state, i) for i, state in
                          enumerate(model.head_states(trunk.out, tokens, n))],
                         dim=2)  # (B, T, n, V)
    results = [_scored(logits[:, :, i].flatten(0, 1), heads.targets[i]) for i in range(n)]
    total = sum(weighted for weighted, _, _ in results)
    exit_loss = exit_hits = None
    if trunk.exit_in is not None:
        exit_total, exit_loss, exit_hits = _scored(
            model.unembed(model.head(trunk.exit_in, 0)).flatten(0, 1), heads.exit_targets())
        total = total + exit_total
    if heads.backward is not None and total.requires_grad:
        heads.backward(total)
    _, losses, correct = zip(*results)
    return heads.output(losses, correct, exit_loss, exit_hits)


def _headwise_loss(model: MTPModel, tokens: Tensor, trunk: TrunkPass, heads: _Heads,
                   chunk_size: int | None) -> LossOutput:
    """One head at a time on the detached trunk output (`_head_loss`), then one backward
    through the trunk (then the early exit's loss and the trunk's first segment)."""
    backward = heads.backward
    # Heads backpropagate into this detached copy; the trunk's backward runs once at the end.
    detached = trunk.out.detach().requires_grad_(trunk.out.requires_grad)

    def head_loss(i: int, head_out: Tensor) -> tuple[Tensor, Tensor]:
        return _head_loss(model, i, head_out, heads.targets[i], backward, chunk_size)

    if model.config.head_type == "sequential":
        losses, correct = _sequential_backward(model, detached, tokens, head_loss, backward)
    else:
        losses, correct = zip(*(head_loss(i, model.head(detached, i))
                                for i in range(len(heads.targets))))
    if backward is not None and detached.grad is not None:
        backward(trunk.out, detached.grad)  # into exit_in.grad, with an early exit
    exit_loss = exit_hits = None
    if trunk.exit_in is not None:
        exit_loss, exit_hits = _head_loss(model, 0, model.head(trunk.exit_in, 0),
                                          heads.exit_targets(), backward, chunk_size)
        if backward is not None and trunk.exit_in.grad is not None:
            backward(trunk.exit_state, trunk.exit_in.grad)
    return heads.output(losses, correct, exit_loss, exit_hits)


def _head_loss(model: MTPModel, head: int, head_out: Tensor, targets: Sequence[Target],
               backward: BackwardFn | None, chunk_size: int | None) -> tuple[Tensor, Tensor]:
    """One head's losses and hits (k,) on its output (B, T, D), backpropagated into it; with
    `chunk_size` (`chunked`), unembedded and scored that many tokens at a time."""
    if chunk_size is None:
        return _backpropagated(_scored(model.unembed(head_out, head).flatten(0, 1), targets),
                               backward)
    flat = head_out.flatten(0, 1)  # (B*T, D)
    # Chunks backpropagate into this detached copy; the head's blocks run backward once.
    detached = flat.detach().requires_grad_(flat.requires_grad)
    scored = []
    for start in range(0, len(flat), chunk_size):
        end = start + chunk_size
        scored.append(_backpropagated(_scored(model.unembed(detached[start:end], head),
                                              [t.chunk(start, end) for t in targets]), backward))
    losses, hits = zip(*scored)
    if backward is not None and detached.grad is not None:
        backward(flat, detached.grad)
    return torch.stack(losses).sum(0), torch.stack(hits).sum(0)


def _backpropagated(scored: tuple[Tensor, Tensor, Tensor],
                    backward: BackwardFn | None) -> tuple[Tensor, Tensor]:
    """`_scored`'s losses and hits (k,), their weighted sum backpropagated. It takes the scores,
    not the logits: a name holding the (N, V) logits would keep them alive through the
    backward, beside their gradient (the memory head by head saves)."""
    total, losses, hits = scored
    if backward is not None and total.requires_grad:
        backward(total)
    return losses.detach(), hits


def _sequential_backward(model: MTPModel, trunk_out: Tensor, tokens: Tensor,
                         head_loss: Callable[[int, Tensor], tuple[Tensor, Tensor]],
                         backward: BackwardFn | None) -> tuple[list[Tensor], list[Tensor]]:
    """The sequential chain's headwise losses and backward on the detached trunk output;
    `head_loss(i, state)` backpropagates head i's loss into `state`."""
    links = []  # each head's output, with its graph, and its detached copy
    losses, correct = [], []
    state = trunk_out
    for k in range(model.config.n_future):
        out = model.head(trunk_out, 0) if k == 0 else \
            model.mtp_module(state, tokens_ahead(tokens, k, trunk_out.shape[1]), k)  # (B, T, D)
        state = out.detach().requires_grad_(out.requires_grad)
        loss, hits = head_loss(k, state)
        losses.append(loss)
        correct.append(hits)
        links.append((out, state))
    while links:  # last module first; each graph is freed by its backward
        out, state = links.pop()
        if backward is not None and state.grad is not None:
            backward(out, state.grad)
    return losses, correct
