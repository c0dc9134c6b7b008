"""Cached forward passes for decoding: the trunk and heads 0..n-1 over new tokens that a
`CacheStep` places (`mtp.kv_cache`), for the verify pass, the prefill and a draft model; and
the heads stacked into one batched block per head layer (`StackedHeads`).

The heads' outputs are returned before the shared norm and unembedding, which callers apply
only where they need logits (the unembedding is the costliest layer of a large-vocabulary
model). Eagerly, attention spans the cache only up to the longest row, rounded up to
`KEY_BLOCK` (`key_width`); compiled, the whole preallocated cache (one shape).

Stacked heads. Every head reads the same trunk output, so the k heads' layer j can run as
one block whose weights are stacked along a leading head dimension: one batched matmul per
projection instead of k, and one attention call with the heads folded into the batch. At
batch 1 every one of a block's few dozen small ops costs dispatch overhead: k separate heads
pay it k times, stacked heads about once. Stacking cannot save reading the k heads' weights,
which at batch 1 on a CPU is most of a block's time (`scripts/bench_decode.py` reports the
cost per k).

Design choices of the stacked heads
- One implementation of the block: layer j of the k heads is a `Block` (model.py) whose
  parameters are the k heads' stacked (`stack_blocks`), run by the Block's own forward, so
  every block feature (biases, grouped-query attention, rotary scaling) serves both. The
  first layer reads the shared trunk output: it is normalised once and scaled per head.
- Inference only: the weights are copies, not shared with the model; training never sees
  them. Copying k blocks takes longer than a few decode steps (10-25 ms for k = 8 on a
  CPU), so `stacked_heads(model, k)` keeps the last one built on the model itself and
  rebuilds it only when k or a head parameter changes (another tensor, or an in-place
  update).
- Weights are stored (k, in, out), contiguous, and applied as x @ W: reading a weight along
  its rows is markedly faster on a CPU than nn.Linear's x @ W^T once the weights fall out of
  cache.
- The cache slots of head i's layer j are block n_layers + i * head_layers + j (see `Block`
  in model.py), so layer j of heads 0..k-1 is the strided slice n_layers + j :: head_layers of
  the cache's blocks: one write and one read for all k heads (`KVCache.write` with a slice).
- Resblock and linear heads (model.head_type) have no attention: head 0 (always a block) runs
  as above, and heads 1..k-1 as one batched matmul per layer through the model's own
  `resblock`/`linear` functions, weights (k - 1, D, D). Medusa heads (head_type medusa)
  read head 0's output after the shared final norm instead of the trunk output.

Shapes in comments: k heads, B batch, T new positions, D width, H query heads, K key/value
heads, hd head width, L cached positions up to the end of this step.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence

import torch
from torch import Tensor, nn

from mtp.kv_cache import CacheStep, KVCache, cache_step, causal
from mtp.model import Block, MTPConfig, MTPModel, RMSNorm, linear, resblock
KEY_BLOCK = 64  # eager attention spans the cache in blocks of this many slots


def hidden_states(model: MTPModel, tokens: Tensor, cache: KVCache, step: CacheStep,
                  heads: int | StackedHeads, skip: Collection[int] = (),
                  layers: Sequence[int] = ()) -> tuple[Tensor, Tensor | None]:
    """Trunk and heads 0..n-1 over `tokens` (B, T) placed by `step`: (B, T, n, D), and the
    trunk's residual stream after each of `layers`, (B, T, len(layers), D) (None without).

    The heads' outputs before the shared norm and unembedding, which callers apply only where
    they need logits (the unembedding is the costliest layer of a large-vocabulary model).
    `heads` is n, to run the model's heads one by one, or a `StackedHeads` of n heads, which
    computes the same in one batched block per head layer. `skip`: trunk layers left out
    (`MTPModel.trunk`).
    """
    trunk, features = model.trunk_states(tokens, cache=cache, step=step, skip=skip,
                                         keep=layers)  # (B, T, D)
    if isinstance(heads, StackedHeads):
        return heads(trunk, cache=cache, step=step), features
    return torch.stack([model.head(trunk, i, cache=cache, step=step) for i in range(heads)],
                       dim=2), features


def cached_forward(model: MTPModel, cache: KVCache, tokens: Tensor, lengths: Tensor,
                   key_len: int, heads: int | StackedHeads = 1,
                   skip: Collection[int] = ()) -> Tensor:
    """`hidden_states` of T new tokens in a row (B, T) after each row's `lengths`."""
    step = cache_step(lengths, *causal(tokens.shape[1], tokens.device), key_len,
                      model.config.max_seq_len)
    return hidden_states(model, tokens, cache, step, heads, skip)[0]


def key_width(needed: int, max_len: int, compiled: bool = False) -> int:
    """Attention's width for a step that needs `needed` slots of a `max_len` cache: all of it
    when compiled (one shape), else `needed` rounded up to KEY_BLOCK."""
    if compiled:
        return max_len
    return min(max_len, -(-needed // KEY_BLOCK) * KEY_BLOCK)


def prefill(model: MTPModel, cache: KVCache, prompts: list[list[int]],
            heads: int | StackedHeads, pad_id: int,
            layers: Sequence[int] = ()) -> tuple[Tensor, Tensor, Tensor | None]:
    """Cache the prompts, right-padded (rows 0..len(prompts)-1 of the cache), in the trunk and
    heads 0..n-1: each row's length (B,), the hidden states (B, T, n, D) at every token and
    the trunk features of `layers` (`hidden_states`).

    A row's padding is written after its prompt, where the lengths leave it stale.
    """
    device = cache.keys.device
    lengths = torch.tensor([len(ids) for ids in prompts], device=device)
    tokens = padded(prompts, pad_id, device)  # (B, T)
    start = torch.zeros(len(prompts), dtype=torch.long, device=device)
    step = cache_step(start, *causal(tokens.shape[1], device), key_len=tokens.shape[1])
    return lengths, *hidden_states(model, tokens, cache, step, heads, layers=layers)


def padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> Tensor:
    """The prompts as one tensor (B, T), right-padded with `pad_id`."""
    tokens = torch.full((len(prompts), max(map(len, prompts))), pad_id, dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, :len(ids)] = torch.tensor(ids)
    return tokens.to(device)


def stack_blocks(config: MTPConfig, blocks: list[Block], slot: slice) -> Block:
    """One `Block` whose parameters are those of `blocks` stacked along a leading dimension
    (detached copies; see `Block` for the layout), writing the cache slots `slot`.

    Linear weights are stored (k, in, out), contiguous, and the block reads them transposed
    as (k, out, in), so that its batched products run as x @ W over the stored layout.
    """
    with torch.device("meta"):
        stacked = Block(config, slot)
    for name, module in stacked.named_modules():
        for kind, param in list(module.named_parameters(recurse=False)):
            parts = [block.get_submodule(name).get_parameter(kind).detach() for block in blocks]
            if isinstance(module, RMSNorm):
                value = torch.stack(parts)[:, None, None]  # (k, 1, 1, D)
            elif kind == "weight":
                value = torch.stack([part.T for part in parts]).contiguous().mT  # (k, out, in)
            else:
                value = torch.stack(parts)  # (k, out)
            setattr(module, kind, nn.Parameter(value, requires_grad=False))
    return stacked


class StackedHeads:
    """Heads 0..k-1 of `model` as one batched block per head layer (inference only).

    `StackedHeads(model, k)(trunk_out, cache=cache, step=step)` equals
    `torch.stack([model.head(trunk_out, i, cache=cache, step=step) for i in range(k)], dim=2)`.
    With `head0_alone`, head 0 runs on its own, as a one-head forward runs it (a batched
    product rounds unlike a single one), and the stack holds heads 1..k-1: decoding's exact
    mode, where head 0's output must not depend on how many heads a step runs.
    """

    def __init__(self, model: MTPModel, k: int, *, head0_alone: bool = False) -> None:
        config = model.config
        if not 1 <= k <= config.n_future:
            raise ValueError(f"k (heads stacked) must be from 1 to n_future={config.n_future}, "
                             f"got {k!r}")
        if config.head_type == "sequential" and k > 1:
            raise ValueError("sequential heads form a chain, not a stack: stacked heads take "
                             "head 0 alone of a model.head_type='sequential' model")
        self._model = weakref.ref(model)  # for its rotary tables and norm: the model keeps us
        self.k, self.head0_alone = k, head0_alone
        first, stride = config.n_layers, config.head_layers
        n_block = min(k, config.block_heads)  # heads 0..n_block-1 are blocks
        start = 1 if head0_alone else 0  # the first stacked block head
        with torch.no_grad():
            self.layers = [
                stack_blocks(config, [model.heads[i][j] for i in range(start, n_block)],
                             slice(first + start * stride + j, first + j + n_block * stride,
                                   stride))
                for j in range(config.head_layers)] if n_block > start else []
            # Heads n_block..k-1: attention-free layers, (k - n_block, D, D) per layer.
            self.light = [torch.stack([model.heads[i][j].weight.detach()
                                       for i in range(n_block, k)]).contiguous()
                          for j in range(config.head_layers)] if k > n_block else []
        self.light_layer = linear if config.head_type == "linear" else resblock
        self.medusa = config.head_type == "medusa"

    def __call__(self, trunk_out: Tensor, *, cache: KVCache | None = None,
                 step: CacheStep | None = None) -> Tensor:
        """Heads 0..k-1 on the trunk output (B, T, D): (B, T, k, D), before the shared norm.

        With a cache, like `MTPModel.head`: writes this step's keys and values.
        """
        B, T, D = trunk_out.shape
        model = self._model()
        cos, sin = model.rope(T, step)  # (T, hd/2), or (B, T, hd/2) placed by step
        blocks = []
        if self.head0_alone:
            blocks.append(model.head(trunk_out, 0, cache=cache, step=step)[None])  # (1, B, T, D)
        if self.layers:
            h = trunk_out  # every block head reads it: the first layer normalises it once
            for layer in self.layers:
                h = layer(h, cos, sin, cache, step)  # (n_block - start, B, T, D)
            blocks.append(h)
        h = torch.cat(blocks) if len(blocks) > 1 else blocks[0]  # (n_block, B, T, D)
        if not self.light:
            return h.permute(1, 2, 0, 3)  # (B, T, k, D)
        # Heads n_block..k-1 on the trunk output (Medusa: on head 0's, normed), batched.
        light = (model.norm(h[0]) if self.medusa else trunk_out).reshape(1, B * T, D)
        for weight in self.light:
            light = self.light_layer(light, weight)  # (k - n_block, B*T, D)
        return torch.cat([h, light.view(-1, B, T, D)]).permute(1, 2, 0, 3)  # (B, T, k, D)


def stacked_heads(model: MTPModel, k: int, *, head0_alone: bool = False) -> StackedHeads:
    """`StackedHeads(model, k, head0_alone=...)`, kept on the model and reused while heads
    0..k-1 are unchanged: copying the heads' weights costs more than a few decode steps.

    A parameter counts as changed when it is another tensor, was updated in place (its
    version counter moved, as an optimiser step or `load_state_dict` does) or got new data
    (`model.to(...)` keeps the Parameter objects). Parameters made under
    `torch.inference_mode` have no version counter: those heads are rebuilt every time.
    """
    params = [p for i in range(min(k, len(model.heads))) for p in model.heads[i].parameters()]
    if any(p.is_inference() for p in params):
        return StackedHeads(model, k, head0_alone=head0_alone)
    built_from = (k, head0_alone, [(p._version, p.data_ptr(), p.dtype, p.device)
                                   for p in params])
    kept = vars(model).setdefault(_Kept.NAME, _Kept())  # no module attribute: no state_dict
    if kept.entry is not None and kept.entry[0] == built_from and all(
            ref() is p for ref, p in zip(kept.entry[1], params)):
        return kept.entry[2]
    heads = StackedHeads(model, k, head0_alone=head0_alone)
    kept.entry = (built_from, [weakref.ref(p) for p in params], heads)
    return heads


class _Kept:
    """Where `stacked_heads` keeps a model's stacked copy, in the model's `__dict__`: derived
    state, which a copy or a pickle of the model leaves behind (it is rebuilt on use)."""

    NAME = "_stacked_heads"

    def __init__(self) -> None:
        self.entry: tuple | None = None  # (what it was built from, weakrefs, StackedHeads)

    def __reduce__(self) -> tuple:
        return _Kept, ()
