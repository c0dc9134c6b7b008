"""Cached forward passes for decoding: the trunk and heads 0..n-1 over new tokens that a
`CacheStep` places, for the verify pass, the prefill and a draft model; and the heads stacked
into one batched block per head layer (`StackedHeads`).

Heads' outputs are returned before the shared norm and unembedding, which callers apply only
where they need logits (the costliest layer of a large-vocabulary model). Eagerly, attention
spans the cache up to the longest row, rounded up to `KEY_BLOCK`; compiled, all of it.

Stacked heads: layer j of the k heads runs as one `Block` with their parameters stacked
(`stack_blocks`): one batched matmul per projection and one attention call, which at batch 1
saves k - 1 times a block's dispatch overhead. Head i's layer j caches in block n_layers +
i * head_layers + j, so layer j of all heads is one strided slice of the cache.
Attention-free heads past head 0 run as one batched matmul per layer; Medusa heads read head
0's normed output. Shapes: k heads, B batch, T new positions, D width.
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
    """Trunk and heads 0..n-1 (`heads`: n, or a `StackedHeads`) over `tokens` (B, T) placed
    by `step`: (B, T, n, D) before the shared norm, and the trunk's output after each of
    `layers` (B, T, len(layers), D; None without); `skip`: trunk layers left out."""
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
    """Cache the prompts, right-padded (their padding is written past each row's length,
    stale), in the trunk and heads 0..n-1: each row's length (B,), and `hidden_states`."""
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
    (detached copies), writing the cache slots `slot`; linear weights stored (k, in, out),
    contiguous, read transposed as (k, out, in): x @ W is faster on a CPU than x @ W^T."""
    with torch.device("meta"):
        stacked = Block(config, slot)
    for name, module in stacked.named_modules():
        for kind, _ in list(module.named_parameters(recurse=False)):
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
    """Heads 0..k-1 of `model` as one batched block per head layer (inference only), equal
    to stacking `model.head(trunk_out, i, ...)`. With `head0_alone` (exact mode), head 0 runs
    on its own as a one-head forward does (a batched product rounds unlike a single one)."""

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
        """Heads 0..k-1 on the trunk output (B, T, D): (B, T, k, D), before the shared norm;
        with a cache, like `MTPModel.head`, writes this step's keys and values."""
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
    0..k-1 keep their tensors, version counters (an optimiser step moves them) and data.
    Parameters made under `torch.inference_mode` have no version counter: rebuilt each time."""
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
    """Where `stacked_heads` keeps a model's stacked copy, in its `__dict__`: derived state,
    which a copy or a pickle of the model leaves behind."""

    NAME = "_stacked_heads"

    def __init__(self) -> None:
        self.entry: tuple | None = None  # (what it was built from, weakrefs, StackedHeads)

    def __reduce__(self) -> tuple:
        return _Kept, ()
