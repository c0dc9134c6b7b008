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
- Inference only: the weights are copies, not shared with the model; training never sees
  this module. Copying k blocks takes longer than a few decode steps (15-30 ms for k = 8 on a
  CPU), so `stacked_heads(model, k)` keeps the last one built for each model and rebuilds it
  only when k or a head parameter changes (another tensor, or an in-place update).
- Weights are stored (k, in, out), contiguous, and applied as x @ W: reading a weight along
  its rows is markedly faster on a CPU than nn.Linear's x @ W^T once the weights fall out of
  cache. wq/wk/wv are one matmul, and so are w1/w3 (gate and up).
- The same function as `MTPModel.head(trunk, i)` for every head: the same RMSNorm (float32
  normalisation), rotary positions (from the step), grouped-query attention and SwiGLU. The
  first layer normalises the shared trunk output once and only scales it per head.
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

import torch
import torch.nn.functional as F
from torch import Tensor

from mtp.kv_cache import CacheStep, KVCache, cache_step, causal
from mtp.model import MTPModel, apply_rope, linear, resblock, rms_normalise
KEY_BLOCK = 64  # eager attention spans the cache in blocks of this many slots


def hidden_states(model: MTPModel, tokens: Tensor, cache: KVCache, step: CacheStep,
                  heads: int | StackedHeads) -> Tensor:
    """Trunk and heads 0..n-1 over `tokens` (B, T) placed by `step`: (B, T, n, D).

    The heads' outputs before the shared norm and unembedding, which callers apply only where
    they need logits (the unembedding is the costliest layer of a large-vocabulary model).
    `heads` is n, to run the model's heads one by one, or a `StackedHeads` of n heads, which
    computes the same in one batched block per head layer.
    """
    trunk = model.trunk(tokens, cache=cache, step=step)  # (B, T, D)
    if isinstance(heads, StackedHeads):
        return heads(trunk, cache=cache, step=step)
    return torch.stack([model.head(trunk, i, cache=cache, step=step) for i in range(heads)],
                       dim=2)


def cached_forward(model: MTPModel, cache: KVCache, tokens: Tensor, lengths: Tensor,
                   key_len: int, heads: int | StackedHeads = 1) -> Tensor:
    """`hidden_states` of T new tokens in a row (B, T) after each row's `lengths`."""
    step = cache_step(lengths, *causal(tokens.shape[1], tokens.device), key_len,
                      model.config.max_seq_len)
    return hidden_states(model, tokens, cache, step, heads)


def key_width(needed: int, max_len: int, compiled: bool = False) -> int:
    """Attention's width for a step that needs `needed` slots of a `max_len` cache: all of it
    when compiled (one shape), else `needed` rounded up to KEY_BLOCK."""
    if compiled:
        return max_len
    return min(max_len, -(-needed // KEY_BLOCK) * KEY_BLOCK)


def prefill(model: MTPModel, cache: KVCache, prompts: list[list[int]],
            heads: int | StackedHeads, pad_id: int) -> tuple[Tensor, Tensor]:
    """Cache the prompts, right-padded (rows 0..len(prompts)-1 of the cache), in the trunk and
    heads 0..n-1: each row's length (B,) and the hidden states (B, T, n, D) at every token.

    A row's padding is written after its prompt, where the lengths leave it stale.
    """
    device = cache.keys.device
    lengths = torch.tensor([len(ids) for ids in prompts], device=device)
    tokens = padded(prompts, pad_id, device)  # (B, T)
    start = torch.zeros(len(prompts), dtype=torch.long, device=device)
    step = cache_step(start, *causal(tokens.shape[1], device), key_len=tokens.shape[1])
    return lengths, hidden_states(model, tokens, cache, step, heads)


def padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> Tensor:
    """The prompts as one tensor (B, T), right-padded with `pad_id`."""
    tokens = torch.full((len(prompts), max(map(len, prompts))), pad_id, dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, :len(ids)] = torch.tensor(ids)
    return tokens.to(device)


class _StackedLayer:
    """Layer j of k heads: each weight (k, in, out), each norm weight (k, 1, D)."""

    def __init__(self, blocks: list, slot: slice) -> None:
        def stack(get) -> Tensor:
            return torch.stack([get(block).detach() for block in blocks]).contiguous()

        self.slot = slot  # cache blocks of this layer, heads 0..k-1
        self.attention_norm = stack(lambda b: b.attention_norm.weight[None])  # (k, 1, D)
        self.ffn_norm = stack(lambda b: b.ffn_norm.weight[None])  # (k, 1, D)
        self.wqkv = stack(lambda b: torch.cat([b.attention.wq.weight, b.attention.wk.weight,
                                               b.attention.wv.weight]).T)  # (k, D, (H+2K)hd)
        self.wo = stack(lambda b: b.attention.wo.weight.T)  # (k, H*hd, D)
        self.w13 = stack(lambda b: torch.cat([b.feed_forward.w1.weight,
                                              b.feed_forward.w3.weight]).T)  # (k, D, 2F)
        self.w2 = stack(lambda b: b.feed_forward.w2.weight.T)  # (k, F, D)
        # Biases (MTPConfig.qkv_bias, out_bias, mlp_bias), (k, 1, out) each, or None.
        attention, ffn = blocks[0].attention, blocks[0].feed_forward
        self.bqkv = None if attention.wq.bias is None else stack(lambda b: torch.cat([
            b.attention.wq.bias, b.attention.wk.bias, b.attention.wv.bias])[None])
        self.bo = None if attention.wo.bias is None else stack(
            lambda b: b.attention.wo.bias[None])
        self.b13 = None if ffn.w1.bias is None else stack(lambda b: torch.cat([
            b.feed_forward.w1.bias, b.feed_forward.w3.bias])[None])
        self.b2 = None if ffn.w2.bias is None else stack(lambda b: b.feed_forward.w2.bias[None])


def _affine(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight (+ bias): x (k, N, in), weight (k, in, out), bias (k, 1, out) or None."""
    return x @ weight if bias is None else torch.baddbmm(bias, x, weight)


class StackedHeads:
    """Heads 0..n_heads-1 of `model` as one batched block per head layer (inference only).

    `StackedHeads(model, k)(trunk_out, cache=cache, step=step)` equals
    `torch.stack([model.head(trunk_out, i, cache=cache, step=step) for i in range(k)], dim=2)`.
    """

    def __init__(self, model: MTPModel, n_heads: int) -> None:
        config = model.config
        if not 1 <= n_heads <= config.n_future:
            raise ValueError(f"n_heads must be from 1 to n_future={config.n_future}, "
                             f"got {n_heads!r}")
        if config.head_type == "sequential" and n_heads > 1:
            raise ValueError("sequential heads form a chain, not a stack: stacked_heads takes "
                             "head 0 alone of a model.head_type='sequential' model")
        self._model = weakref.ref(model)  # for its rotary tables; no cycle via `_built`
        self.n_heads = n_heads
        self.n_q, self.n_kv, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.eps = config.norm_eps
        first, stride = config.n_layers, config.head_layers
        n_block = min(n_heads, config.block_heads)  # heads 0..n_block-1 are blocks
        with torch.no_grad():
            self.layers = [
                _StackedLayer([model.heads[i][j] for i in range(n_block)],
                              slice(first + j, first + j + n_block * stride, stride))
                for j in range(config.head_layers)]
            # Heads n_block..k-1: attention-free layers, (k - n_block, D, D) per layer.
            self.light = [torch.stack([model.heads[i][j].weight.detach()
                                       for i in range(n_block, n_heads)]).contiguous()
                          for j in range(config.head_layers)] if n_heads > n_block else []
        self.n_block = n_block
        self.light_layer = linear if config.head_type == "linear" else resblock
        self.medusa = config.head_type == "medusa"

    def __call__(self, trunk_out: Tensor, *, cache: KVCache | None = None,
                 step: CacheStep | None = None) -> Tensor:
        """Heads 0..k-1 on the trunk output (B, T, D): (B, T, k, D), before the shared norm.

        With a cache, like `MTPModel.head`: writes this step's keys and values.
        """
        B, T, D = trunk_out.shape
        h = trunk_out.reshape(B * T, D)
        blocks = self._blocks(h, B, T, cache, step)  # (n_block, B*T, D)
        light = self._model().norm(blocks[0]) if self.medusa else h
        for weight in self.light:
            light = self.light_layer(light, weight)  # (k - n_block, B*T, D)
        if self.light:
            blocks = torch.cat([blocks, light])
        return blocks.view(self.n_heads, B, T, D).permute(1, 2, 0, 3)  # (B, T, k, D)

    def _blocks(self, h: Tensor, B: int, T: int, cache: KVCache | None,
                step: CacheStep | None) -> Tensor:
        """The block heads on the trunk output h (B*T, D): (n_block, B*T, D)."""
        k = self.n_block
        cos, sin = self._model().rope(T, step)  # (T, hd/2), or (B, T, hd/2) placed by step
        mask = None
        if step is not None:
            mask = step.mask.repeat(k, 1, 1, 1)  # (B, 1, T, L) -> (k*B, 1, T, L), head-major
        # The first layer's input is the trunk's, the same for every head: normalise it once.
        normed = rms_normalise(h, self.eps)  # (B*T, D), then (k, B*T, D)
        for j, layer in enumerate(self.layers):
            if j:
                normed = rms_normalise(h, self.eps)
            h = h + self._attention(layer, normed * layer.attention_norm, B, T, cos, sin, mask,
                                    cache, step)  # (k, B*T, D)
            gate, up = _affine(rms_normalise(h, self.eps) * layer.ffn_norm, layer.w13,
                               layer.b13).chunk(2, dim=-1)
            h = h + _affine(F.silu(gate) * up, layer.w2, layer.b2)  # (k, B*T, D)
        return h

    def _attention(self, layer: _StackedLayer, x: Tensor, B: int, T: int, cos: Tensor,
                   sin: Tensor, mask: Tensor | None, cache: KVCache | None,
                   step: CacheStep | None) -> Tensor:
        """Attention of layer `layer` for all k heads; x (k, B*T, D) -> (k, B*T, D)."""
        k, H, K, hd = self.n_block, self.n_q, self.n_kv, self.head_dim
        qkv = _affine(x, layer.wqkv, layer.bqkv).view(k, B, T, H + 2 * K, hd)
        qk = apply_rope(qkv[..., :H + K, :], cos, sin)  # one rotation for queries and keys
        q = qk[..., :H, :].transpose(2, 3)  # (k, B, H, T, hd)
        keys = qk[..., H:, :].transpose(2, 3)  # (k, B, K, T, hd)
        values = qkv[..., H + K:, :].transpose(2, 3)  # (k, B, K, T, hd)
        gqa = K != H
        if cache is None:
            out = F.scaled_dot_product_attention(
                q.flatten(0, 1), keys.flatten(0, 1), values.flatten(0, 1), is_causal=True,
                enable_gqa=gqa)
        else:
            keys, values = cache.write(layer.slot, step, keys, values)  # (k, B, K, L, hd)
            out = F.scaled_dot_product_attention(
                q.flatten(0, 1), keys.flatten(0, 1), values.flatten(0, 1), attn_mask=mask,
                enable_gqa=gqa)  # (k*B, H, T, hd)
        out = out.unflatten(0, (k, B)).transpose(2, 3).reshape(k, B * T, H * hd)
        return _affine(out, layer.wo, layer.bo)


# model -> (what it was built from, StackedHeads); an entry goes when its model does.
_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stacked_heads(model: MTPModel, n_heads: int) -> StackedHeads:
    """`StackedHeads(model, n_heads)`, reused while heads 0..n_heads-1 are unchanged.

    A parameter counts as changed when it is another tensor, was updated in place (its
    version counter moved, as an optimiser step or `load_state_dict` does) or got new data
    (`model.to(...)` keeps the Parameter objects). Parameters made under
    `torch.inference_mode` have no version counter: those heads are rebuilt every time.
    """
    params = [p for i in range(min(n_heads, len(model.heads))) for p in model.heads[i].parameters()]
    if any(p.is_inference() for p in params):
        return StackedHeads(model, n_heads)
    versions = [(p._version, p.data_ptr(), p.dtype, p.device) for p in params]
    entry = _built.get(model)
    if entry is not None:
        (built_n, refs, built_versions), heads = entry
        if (built_n == n_heads and built_versions == versions
                and all(ref() is p for ref, p in zip(refs, params))):
            return heads
    heads = StackedHeads(model, n_heads)
    _built[model] = ((n_heads, [weakref.ref(p) for p in params], versions), heads)
    return heads
