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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from mtp.model import MTPModel, tokens_ahead

IGNORE_INDEX = -100
LossMode = Literal["naive", "headwise", "chunked"]
LOSS_MODES: tuple[str, ...] = ("naive", "headwise", "chunked")


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


def mtp_loss(model: MTPModel, tokens: Tensor, *, seq_len: int | None = None,
             mode: LossMode = "headwise", weights: Sequence[float] | None = None,
             backward: BackwardFn | None = None, chunk_size: int = 4096,
             train_trunk: bool = True, early_exit: int | None = None,
             early_exit_weight: float = 1.0, trunk_out: Tensor | None = None) -> LossOutput:
    """Loss of every head on a block of tokens, and (with `backward`) its gradients.

    Args:
        tokens: (B, L) ids; inputs are the first `seq_len` (default L - n_future).
        mode: "naive", "headwise" or "chunked" (module docstring); same loss, same gradients.
        weights: per-head loss weights (default all 1).
        backward: called on each tensor to backpropagate (Lightning's `manual_backward`, or
            `autograd_backward`); None computes the loss only, e.g. for validation.
        chunk_size: tokens per unembedding chunk in "chunked" mode.
        train_trunk: False backpropagates into the heads only, not the trunk or embedding.
        early_exit: LayerSkip's early-exit term at trunk layer e (module docstring), from 1
            to n_layers - 1; None: none. early_exit_weight: its weight.
        trunk_out: the trunk's output (B, seq_len, D) for these tokens, computed before (a
            frozen trunk's, `mtp.train.trunk_cache`): the trunk does not run, and gets no gradient.
    """
    n = model.config.n_future
    if mode not in LOSS_MODES:
        raise ValueError(f"loss mode {mode!r} is not one of {LOSS_MODES}")
    weights = [1.0] * n if weights is None else [float(w) for w in weights]
    if len(weights) != n or any(w < 0 for w in weights):
        raise ValueError(f"weights must be {n} non-negative numbers (one per head), "
                         f"got {weights}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    check_early_exit(early_exit, early_exit_weight, model.config.n_layers)
    seq_len = tokens.shape[1] - n if seq_len is None else seq_len
    inputs, targets = shift_targets(tokens, seq_len, n)
    counts = (targets != IGNORE_INDEX).sum(dim=(0, 2))  # (n,)
    denominators = counts.clamp(min=1).tolist()
    head_targets = [targets[:, i].flatten() for i in range(n)]  # (B*T,) each

    if trunk_out is not None and (early_exit is not None or trunk_out.requires_grad
                                  or trunk_out.shape[:2] != inputs.shape):
        raise ValueError(f"a precomputed trunk_out (shape {tuple(trunk_out.shape)}) must be "
                         f"a frozen trunk's output for inputs of shape {tuple(inputs.shape)}, "
                         f"without an early exit (early_exit={early_exit})")
    exit_state = exit_in = None  # the stream at the early exit, and what the rest reads
    with torch.set_grad_enabled(train_trunk and torch.is_grad_enabled()):
        if trunk_out is None and early_exit is None:
            trunk_out = model.trunk(inputs)  # (B, T, D); no graph unless the trunk trains
        elif trunk_out is None:
            exit_state = model.trunk(inputs, skip=range(early_exit, model.config.n_layers))
            exit_in = exit_state if mode == "naive" else \
                exit_state.detach().requires_grad_(exit_state.requires_grad)
            trunk_out = model.resume_trunk(exit_in, early_exit)
    exit_loss = exit_hits = None
    if mode == "naive":
        logits = torch.stack([model.unembed(state, i) for i, state in
                              enumerate(model.head_states(trunk_out, tokens, n))],
                             dim=2)  # (B, T, n, V)
        results = [_head_loss(logits[:, :, i].flatten(0, 1), head_targets[i], denominators[i])
                   for i in range(n)]
        total = sum(w * loss for w, (loss, _) in zip(weights, results))
        if exit_in is not None:
            exit_loss, exit_hits = _head_loss(model.unembed(model.head(exit_in, 0)).flatten(0, 1),
                                              head_targets[0], denominators[0])
            total = total + early_exit_weight * exit_loss
        if backward is not None and total.requires_grad:
            backward(total)
        losses, correct = zip(*results)
    else:
        # Heads backpropagate into this detached copy; the trunk's backward runs once at the end.
        detached = trunk_out.detach().requires_grad_(trunk_out.requires_grad)

        def head_loss(i: int, head_out: Tensor, weight: float | None = None
                      ) -> tuple[Tensor, Tensor]:
            """Head i's loss and hits on its output (B, T, D), backpropagated into it."""
            weight = weights[i] if weight is None else weight
            if mode == "chunked":
                return _chunked_head_loss(model, i, head_out.flatten(0, 1), head_targets[i],
                                          denominators[i], weight, backward, chunk_size)
            loss, hits = _head_loss(model.unembed(head_out, i).flatten(0, 1), head_targets[i],
                                    denominators[i])
            if backward is not None and loss.requires_grad:
                backward(weight * loss)
            return loss.detach(), hits

        if model.config.head_type == "sequential":
            losses, correct = _sequential_backward(model, detached, tokens, head_loss, backward)
        else:
            losses, correct = zip(*(head_loss(i, model.head(detached, i)) for i in range(n)))
        if backward is not None and detached.grad is not None:
            backward(trunk_out, detached.grad)  # into exit_in.grad, with an early exit
        if exit_in is not None:
            exit_loss, exit_hits = head_loss(0, model.head(exit_in, 0), early_exit_weight)
            if backward is not None and exit_in.grad is not None:
                backward(exit_state, exit_in.grad)
    head_losses = torch.stack([loss.detach() for loss in losses])
    total = sum(w * loss for w, loss in zip(weights, head_losses))
    if exit_loss is not None:
        exit_loss = exit_loss.detach()
        total = total + early_exit_weight * exit_loss
    return LossOutput(loss=total, head_losses=head_losses,
                      head_correct=torch.stack(list(correct)), head_count=counts,
                      exit_loss=exit_loss, exit_correct=exit_hits)


def check_early_exit(early_exit: int | None, weight: float, n_layers: int) -> None:
    """A ValueError naming the value when an early exit cannot be read from this trunk."""
    if early_exit is None:
        return
    if not isinstance(early_exit, int) or isinstance(early_exit, bool) \
            or not 1 <= early_exit < n_layers:
        raise ValueError(f"early_exit={early_exit!r} must be a trunk layer from 1 to "
                         f"n_layers - 1 = {n_layers - 1} (the exit reads the stream after "
                         f"layer early_exit - 1)")
    if not weight >= 0:
        raise ValueError(f"early_exit_weight={weight!r} must be >= 0")


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
                       denominator: int, weight: float, backward: BackwardFn | None,
                       chunk_size: int) -> tuple[Tensor, Tensor]:
    """Head `head`'s loss over token chunks of (N, D) `head_out`, backpropagating per chunk."""
    # Chunks backpropagate into this detached copy; the head's blocks run backward once.
    detached = head_out.detach().requires_grad_(head_out.requires_grad)
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
        backward(head_out, detached.grad)
    return torch.stack(losses).sum(), torch.stack(hits).sum()

