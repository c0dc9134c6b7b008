"""Multi-token prediction loss: label shifting for n heads, and three ways to backpropagate.

All three modes compute the same numbers, the sum over heads of each head's mean
cross-entropy (optionally weighted), and give the same gradients; they differ in which
logits are alive at once.

- `naive`: every head's logits (B, T, n, V) materialised, one backward. For tests and
  comparison: peak memory grows as n * V per token.
- `headwise` (Gloeckle et al. 2024, section 2): the trunk runs once; its output is detached;
  each head runs forward and backward in turn, accumulating into the detached output's
  gradient and freeing its logits; one backward through the trunk ends the step. Only one
  head's logits are alive at a time, so memory is O(V + d) per token instead of O(nV + d).
- `chunked`: headwise, and each head's norm + unembedding + cross-entropy also runs over
  chunks of `chunk_size` tokens, so not even one head's full (B, T, V) logits exist.

Sequential heads (`head_type="sequential"`, DeepSeek-V3's modules) form a chain: module k
reads module k - 1's output and, teacher-forced, the token t + k, which is head k - 1's
target (`model.tokens_ahead`). Their headwise backward carries the gradient down the chain:

    forward   h_0 = head 0(trunk);  h_k = module k(s_{k-1}, x_{t+k}),  s_k = h_k detached
              and right away head k's loss on s_k, backward into s_k.grad: its logits freed
    backward  for k = n-1 .. 1: h_k.backward(s_k.grad), which adds module k's share into
              s_{k-1}.grad (already holding head k-1's loss gradient); then head 0 and the trunk

So one head's logits are alive at a time, as with parallel heads; what the chain keeps
besides is each module's activations until its backward (`activation_checkpointing=all`
keeps only their inputs, (B, T, D) each). Gradients equal the naive backward's.

An early exit (`early_exit=e`, LayerSkip: Elhoushi et al. 2024) adds one more term: head 0
also reads the residual stream after trunk layer e - 1 and predicts the next token through
the shared norm and unembedding, weighted `early_exit_weight`. That is the path a
layer-skipping drafter with layers e.. skipped runs (`drafter=layer_skip`), so the term
teaches the early layers to draft. The trunk then runs in two segments, layers < e and
layers >= e, the second on a detached copy of the first's output: the heads' gradients reach
it through the second segment's backward, the exit's directly, and one backward through the
first segment ends the step (one head's logits alive at a time, as before).

Frozen parameters (Medusa-1: `requires_grad=False` on the base model) cost no backward: a
loss that needs no gradient is not backpropagated, and with a frozen embedding and trunk the
trunk output needs none, so the trunk's backward never runs. `train_trunk=False` detaches
the trunk output for a step, for the heads-only warm-up of Medusa-2.

The code reads in that order: `mtp_loss` takes the settings (`LossSettings`: mode, weights,
early exit), `run_trunk` is the trunk's part (the early exit's two segments, a frozen trunk's
precomputed output, the heads-only warm-up), then one function per mode: `_naive_loss`,
`_headwise_loss` with a whole head's unembedding at once (`_whole_head_loss`) or in chunks
(`_chunked_head_loss`), and the sequential chain's `_sequential_backward`.
"""

from __future__ import annotations

import functools
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
    tensor.backward(gradient)


def shift_targets(tokens: Tensor, seq_len: int, n_future: int,
                  ignore_index: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """Split a block of tokens into model inputs and every head's targets.

    Head i at position t predicts tokens[:, t + i + 1]; a target past the end of the block is
    `ignore_index`, so it never trains. Worked example, seq_len=3, n_future=2:

        tokens  = [[10, 11, 12, 13, 14]]
        inputs  = [[10, 11, 12]]
        targets = [[[11, 12, 13],    # head 0: the next token
                    [12, 13, 14]]]   # head 1: the one after

    With tokens = [[10, 11, 12, 13]] (one look-ahead token short) head 1's last target is
    ignore_index: [[[11, 12, 13], [12, 13, -100]]].

    Args:
        tokens: (B, L) token ids with L >= seq_len; the data pipeline gives L = seq_len + n.
    Returns:
        inputs (B, seq_len) and targets (B, n_future, seq_len).
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
    """Detached results of one loss computation; `loss` is the weighted sum over heads (and
    the early exit's term, when there is one)."""

    loss: Tensor  # ()
    head_losses: Tensor  # (n,) mean cross-entropy of each head
    head_correct: Tensor  # (n,) top-1 hits
    head_count: Tensor  # (n,) targets that count (not ignore_index)
    exit_loss: Tensor | None = None  # () the early exit's next-token cross-entropy
    exit_correct: Tensor | None = None  # () its top-1 hits (of head_count[0] targets)

    @property
    def head_accuracy(self) -> Tensor:
        return self.head_correct / self.head_count.clamp(min=1)


def _head_loss(logits: Tensor, targets: Tensor, denominator: int) -> tuple[Tensor, Tensor]:
    """Summed cross-entropy over (N, V) logits divided by `denominator`, and top-1 hits."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(wide, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()
    return loss / denominator, correct


def mtp_loss(model: MTPModel, tokens: Tensor, settings: LossSettings | None = None, *,
             seq_len: int | None = None, backward: BackwardFn | None = None,
             train_trunk: bool = True, trunk_out: Tensor | None = None,
             **options: Any) -> LossOutput:
    """Loss of every head on a block of tokens, and (with `backward`) its gradients.

    Args:
        tokens: (B, L) ids; inputs are the first `seq_len` (default L - n_future).
        settings: the mode, per-head weights, early exit and chunk size (`LossSettings`);
            a plain call gives them as `options` instead: `mtp_loss(model, tokens,
            mode="naive", weights=[1, 0.5])` (`LossSettings`' fields).
        backward: called on each tensor to backpropagate (Lightning's `manual_backward`, or
            `autograd_backward`); None computes the loss only, e.g. for validation.
        train_trunk: False backpropagates into the heads only, not the trunk or embedding.
        trunk_out: the trunk's output (B, seq_len, D) for these tokens, computed before (a
            frozen trunk's, `mtp.train.trunk_cache`): the trunk does not run, and gets no
            gradient.
    """
    if settings is None:
        settings = LossSettings(**options)
    elif options:
        raise TypeError(f"mtp_loss takes settings or their fields {sorted(options)}, not both")
    config = model.config
    settings.check_model(n_future=config.n_future, n_layers=config.n_layers)
    seq_len = tokens.shape[1] - config.n_future if seq_len is None else seq_len
    inputs, targets = shift_targets(tokens, seq_len, config.n_future)
    trunk = run_trunk(model, inputs, early_exit=settings.early_exit, train=train_trunk,
                      detach_exit=settings.mode != "naive", trunk_out=trunk_out)
    heads = _Heads.of(targets, settings, backward)
    if settings.mode == "naive":
        return _naive_loss(model, tokens, trunk, heads)
    per_head = _whole_head_loss if settings.mode == "headwise" else \
        functools.partial(_chunked_head_loss, chunk_size=settings.chunk_size)
    return _headwise_loss(model, tokens, trunk, heads, per_head)


@dataclass(frozen=True)
class TrunkPass:
    """The trunk's output, and with an early exit the residual stream the exit reads."""

    out: Tensor  # (B, T, D) what the heads read
    exit_state: Tensor | None = None  # (B, T, D) the stream after layer early_exit - 1
    exit_in: Tensor | None = None  # what the exit head and the later layers read: exit_state,
    # or its detached copy (the headwise modes backpropagate into it, then through exit_state)


def run_trunk(model: MTPModel, inputs: Tensor, *, early_exit: int | None = None,
              train: bool = True, detach_exit: bool = True,
              trunk_out: Tensor | None = None) -> TrunkPass:
    """The trunk on `inputs` (B, T), or `trunk_out`, a frozen trunk's output computed before.

    With an `early_exit`, the trunk runs in two segments (module docstring), the second on
    the first's output, detached when `detach_exit`. `train=False` keeps no graph (the
    heads-only warm-up), as does a frozen trunk by itself.
    """
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
    """What each head's loss reads besides its output: targets, weights and the backward."""

    targets: list[Tensor]  # (B*T,) each head's
    counts: Tensor  # (n,) targets that count (not ignore_index)
    denominators: list[int]  # the counts, at least 1: each head's mean divides by it
    weights: tuple[float, ...]
    exit_weight: float
    backward: BackwardFn | None

    @classmethod
    def of(cls, targets: Tensor, settings: LossSettings, backward: BackwardFn | None) -> _Heads:
        """The heads of `targets` (B, n, T), weighted as `settings` say."""
        n = targets.shape[1]
        counts = (targets != IGNORE_INDEX).sum(dim=(0, 2))
        return cls([targets[:, i].flatten() for i in range(n)], counts,
                   counts.clamp(min=1).tolist(), settings.head_weights(n),
                   settings.early_exit_weight, backward)

    def output(self, losses: Sequence[Tensor], correct: Sequence[Tensor],
               exit_loss: Tensor | None = None, exit_hits: Tensor | None = None) -> LossOutput:
        """The detached `LossOutput` of the heads' (and the exit's) losses and hits."""
        head_losses = torch.stack([loss.detach() for loss in losses])
        total = sum(w * loss for w, loss in zip(self.weights, head_losses))
        if exit_loss is not None:
            exit_loss = exit_loss.detach()
            total = total + self.exit_weight * exit_loss
        return LossOutput(loss=total, head_losses=head_losses,
                          head_correct=torch.stack(list(correct)), head_count=self.counts,
                          exit_loss=exit_loss, exit_correct=exit_hits)


def _naive_loss(model: MTPModel, tokens: Tensor, trunk: TrunkPass, heads: _Heads) -> LossOutput:
    """Every head's logits at once (B, T, n, V) and one backward of the weighted sum."""
    n = len(heads.weights)
    logits = torch.stack([model.unembed(state, i) for i, state in
                          enumerate(model.head_states(trunk.out, tokens, n))],
                         dim=2)  # (B, T, n, V)
    results = [_head_loss(logits[:, :, i].flatten(0, 1), heads.targets[i],
                          heads.denominators[i]) for i in range(n)]
    total = sum(w * loss for w, (loss, _) in zip(heads.weights, results))
    exit_loss = exit_hits = None
    if trunk.exit_in is not None:
        exit_loss, exit_hits = _head_loss(
            model.unembed(model.head(trunk.exit_in, 0)).flatten(0, 1), heads.targets[0],
            heads.denominators[0])
        total = total + heads.exit_weight * exit_loss
    if heads.backward is not None and total.requires_grad:
        heads.backward(total)
    losses, correct = zip(*results)
    return heads.output(losses, correct, exit_loss, exit_hits)


class HeadLossFn(Protocol):
    """One head's loss and hits on its output (B, T, D), backpropagated into it with
    `weight` (`_whole_head_loss`, `_chunked_head_loss`)."""

    def __call__(self, model: MTPModel, head: int, head_out: Tensor, targets: Tensor,
                 denominator: int, weight: float,
                 backward: BackwardFn | None) -> tuple[Tensor, Tensor]: ...


def _headwise_loss(model: MTPModel, tokens: Tensor, trunk: TrunkPass, heads: _Heads,
                   per_head: HeadLossFn) -> LossOutput:
    """One head at a time on the detached trunk output, then one backward through the trunk
    (and with an early exit, the exit's loss, then the trunk's first segment)."""
    backward = heads.backward
    # Heads backpropagate into this detached copy; the trunk's backward runs once at the end.
    detached = trunk.out.detach().requires_grad_(trunk.out.requires_grad)

    def head_loss(i: int, head_out: Tensor, weight: float | None = None
                  ) -> tuple[Tensor, Tensor]:
        weight = heads.weights[i] if weight is None else weight
        return per_head(model, i, head_out, heads.targets[i], heads.denominators[i], weight,
                        backward)

    if model.config.head_type == "sequential":
        losses, correct = _sequential_backward(model, detached, tokens, head_loss, backward)
    else:
        losses, correct = zip(*(head_loss(i, model.head(detached, i))
                                for i in range(len(heads.weights))))
    if backward is not None and detached.grad is not None:
        backward(trunk.out, detached.grad)  # into exit_in.grad, with an early exit
    exit_loss = exit_hits = None
    if trunk.exit_in is not None:
        exit_loss, exit_hits = head_loss(0, model.head(trunk.exit_in, 0), heads.exit_weight)
        if backward is not None and trunk.exit_in.grad is not None:
            backward(trunk.exit_state, trunk.exit_in.grad)
    return heads.output(losses, correct, exit_loss, exit_hits)


def _whole_head_loss(model: MTPModel, head: int, head_out: Tensor, targets: Tensor,
                     denominator: int, weight: float,
                     backward: BackwardFn | None) -> tuple[Tensor, Tensor]:
    """Head `head`'s loss over all its logits (B*T, V) at once (the headwise mode)."""
    loss, hits = _head_loss(model.unembed(head_out, head).flatten(0, 1), targets, denominator)
    if backward is not None and loss.requires_grad:
        backward(weight * loss)
    return loss.detach(), hits


def _sequential_backward(model: MTPModel, trunk_out: Tensor, tokens: Tensor,
                         head_loss: Callable[[int, Tensor], tuple[Tensor, Tensor]],
                         backward: BackwardFn | None) -> tuple[list[Tensor], list[Tensor]]:
    """The chain's headwise losses and backward (module docstring) on the detached trunk
    output (B, T, D); `head_loss(i, state)` backpropagates head i's loss into `state`."""
    links = []  # each head's output, with its graph, and its detached copy
    losses, correct = [], []
    state = trunk_out
    for k in range(model.config.n_future):
        if k == 0:
            out = model.head(trunk_out, 0)  # (B, T, D)
        else:
            out = model.mtp_module(state, tokens_ahead(tokens, k, trunk_out.shape[1]), k)
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


def _chunked_head_loss(model: MTPModel, head: int, head_out: Tensor, targets: Tensor,
                       denominator: int, weight: float, backward: BackwardFn | None, *,
                       chunk_size: int) -> tuple[Tensor, Tensor]:
    """Head `head`'s loss over chunks of `chunk_size` tokens of `head_out` (B, T, D),
    backpropagating per chunk (the chunked mode): no (B*T, V) logits at once."""
    flat = head_out.flatten(0, 1)  # (B*T, D)
    # Chunks backpropagate into this detached copy; the head's blocks run backward once.
    detached = flat.detach().requires_grad_(flat.requires_grad)
    losses, hits = [], []
    for start in range(0, detached.shape[0], chunk_size):
        end = start + chunk_size
        chunk_loss, chunk_hits = _head_loss(model.unembed(detached[start:end], head),
                                            targets[start:end], denominator)
        if backward is not None and chunk_loss.requires_grad:
            backward(weight * chunk_loss)
        losses.append(chunk_loss.detach())
        hits.append(chunk_hits)
    if backward is not None and detached.grad is not None:
        backward(flat, detached.grad)
    return torch.stack(losses).sum(), torch.stack(hits).sum()
