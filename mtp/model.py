"""The multi-token prediction transformer: a shared trunk feeding n future-token heads.

- Llama blocks (pre-norm RMSNorm, rotary embeddings on interleaved pairs as in Meta's code,
  SwiGLU, grouped-query attention); released models' variants are config fields.
- Gloeckle et al. 2024's layout: `layers` (the trunk), `heads` (n_future stacks of
  `head_layers` layers), a shared final `norm` and unembedding `output`. Head i predicts
  token t + i + 1, so trunk + head 0 is a Llama model.
- `head_type` sets heads 1..n-1 (head 0 is always blocks): `block`; `resblock` (Medusa's
  x + SiLU(W x)) and `linear` (W x), attention-free; `medusa`, resblocks on head 0's normed
  output, then the unembedding alone (Medusa's layout); `sequential` (DeepSeek-V3, MiMo),
  head k >= 1 a chain link h_k(t) = Blocks_k(eh_proj([hnorm(norm(h_{k-1}(t)));
  enorm(emb(x_{t+k}))])), taking the previous state through the shared `norm` as the
  engines do, so an export is exactly a MiMo checkpoint.
- `compute_matched` takes the heads' blocks off the trunk (equal cost per token for any n);
  `added_heads` puts heads 1..n-1 on top.
- No loss, sampling or parallelism here. The cached forward takes a `KVCache` and a
  `CacheStep` (explicit positions, slots and mask): a decode step has fixed shapes.
- Decoding on a CPU runs through `mtp.kernels` once `use_kernels` marked the model, each row
  computed the same way whatever its call holds (a token's bits do not depend on its step
  or batch); whatever needs gradients, and every other device, keeps torch's path.
- Residual output projections start at std / sqrt(2 * depth) (GPT-2).

Shapes: B batch, T sequence, D model width, H query heads, K key/value heads, hd head
width, V vocabulary, n heads used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mtp.kernels as kernels
from mtp.cli import check_choice, check_flag, check_number, check_positive
from mtp.rope import RopeScaling

if TYPE_CHECKING:
    from mtp.kv_cache import CacheStep, KVCache


HEAD_TYPES: tuple[str, ...] = ("block", "resblock", "linear", "medusa", "sequential")
HEAD_DEPTHS: tuple[str, ...] = ("matched", "added")  # how `depth` counts heads (from_depth)
BLOCK_HEAD_TYPES: tuple[str, ...] = ("block", "sequential")  # heads 1..n-1 have blocks


@dataclass(frozen=True, kw_only=True)
class MTPConfig:
    """Architecture of an `MTPModel`. Validated at construction; never mutated afterwards."""

    vocab_size: int
    dim: int = 256
    n_layers: int = 4  # trunk layers; the heads' layers come on top
    n_heads: int = 8
    n_kv_heads: int | None = None  # None: as many as n_heads (plain multi-head attention)
    head_dim: int | None = None  # None: dim // n_heads (dim must then be divisible by n_heads)
    ffn_hidden: int | None = None  # None: 8/3 * dim rounded up to a multiple of 64 (Llama)
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None  # a mapping of RopeScaling's fields is converted
    norm_eps: float = 1e-5
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    out_bias: bool = False  # a bias on the attention's output projection
    mlp_bias: bool = False  # biases on the three feed-forward projections
    n_future: int = 1  # number of heads; head i predicts token t + i + 1
    head_layers: int = 1  # layers per head (of head_type; head 0's are always blocks)
    head_type: str = "block"  # block | resblock | linear | medusa | sequential: heads 1..n-1
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:  # derived defaults, filled in during construction only
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 64 * math.ceil(8 * self.dim / 3 / 64))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))
        for name in ("vocab_size", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
                     "max_seq_len", "n_future", "head_layers"):
            value = getattr(self, name)
            if name == "head_dim" and value is None:
                if self.dim % self.n_heads:
                    raise ValueError(f"MTPConfig.dim={self.dim} must be divisible by "
                                     f"n_heads={self.n_heads} (or set head_dim)")
                value = self.dim // self.n_heads
                object.__setattr__(self, "head_dim", value)
            check_positive(f"MTPConfig.{name}", value)
        check_positive("MTPConfig.n_layers", self.n_layers, least=0)
        if self.head_dim % 2:
            raise ValueError(f"MTPConfig.head_dim={self.head_dim} must be even for rotary "
                             f"embeddings (dim={self.dim}, n_heads={self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"MTPConfig.n_heads={self.n_heads} must be divisible by "
                             f"n_kv_heads={self.n_kv_heads}")
        check_choice("MTPConfig.head_type", self.head_type, HEAD_TYPES)
        for name in ("rope_theta", "norm_eps", "init_std"):  # checked, kept as given
            check_number(f"MTPConfig.{name}", getattr(self, name), lambda v: v > 0, "a number > 0")
        for name in ("tie_embeddings", "qkv_bias", "out_bias", "mlp_bias"):
            check_flag(f"MTPConfig.{name}", getattr(self, name))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"MTPConfig.rope_scaling must be null or a mapping of "
                             f"{RopeScaling.field_names()}, got {self.rope_scaling!r}")

    @property
    def block_heads(self) -> int:
        """Heads made of transformer blocks: all of them, or head 0 alone (see head_type)."""
        return self.n_future if self.head_type in BLOCK_HEAD_TYPES else 1

    @property
    def n_blocks(self) -> int:
        """Transformer blocks in the model (each has a KV cache slot): trunk plus heads'."""
        return self.n_layers + self.block_heads * self.head_layers

    @classmethod
    def compute_matched(cls, *, depth: int, **fields: Any) -> MTPConfig:
        """The paper's fair comparison: `depth` blocks per token in all, the block heads'
        taken off the trunk (`depth=8, n_future=4`: a 4-layer trunk and 4 one-layer heads)."""
        return cls.from_depth(depth=depth, heads="matched", **fields)

    @classmethod
    def added_heads(cls, *, depth: int, **fields: Any) -> MTPConfig:
        """Trunk + head 0 keep all `depth` blocks (the next-token model); heads 1..n-1 come
        on top (`depth=12, n_future=8`: an 11-layer trunk, head 0's block, 7 more heads)."""
        return cls.from_depth(depth=depth, heads="added", **fields)

    @classmethod
    def from_depth(cls, *, depth: int, heads: str = "matched", n_future: int = 1,
                   head_layers: int = 1, head_type: str = "block", **fields: Any) -> MTPConfig:
        """`depth` blocks per token, the heads `matched` (`compute_matched`) or `added`."""
        check_choice("model.heads", heads, HEAD_DEPTHS, "matched takes the heads' blocks off "
                     "the trunk, added puts them on top")
        matched = heads == "matched" and head_type in BLOCK_HEAD_TYPES
        off_trunk = n_future if matched else 1  # the heads whose blocks count in `depth`
        n_layers = depth - off_trunk * head_layers
        if n_layers < 0:
            which = f"{off_trunk} block heads'" if off_trunk > 1 else "head 0's"
            raise ValueError(f"depth={depth} is too shallow for {which} head_layers="
                             f"{head_layers} block(s): the trunk would have {n_layers} layers")
        return cls(n_layers=n_layers, n_future=n_future, head_layers=head_layers,
                   head_type=head_type, **fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MTPConfig:
        if not isinstance(values, dict):
            raise ValueError(f"an MTPConfig needs a mapping of fields, got {values!r:.80}")
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        if unknown := sorted(set(values) - known):
            raise ValueError(f"unknown MTPConfig field(s) {unknown}; known: {sorted(known)}")
        if missing := [f.name for f in fields
                       if f.default is dataclasses.MISSING and f.name not in values]:
            raise ValueError(f"MTPConfig field(s) {missing} missing")
        return cls(**values)


def rms_normalise(x: Tensor, eps: float) -> Tensor:
    """x / RMS(x) over the last dimension, without a gain; statistics in float32."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if _on_kernels(self, x, self.weight):
            return kernels.rms_norm(x, self.weight, self.eps)
        return rms_normalise(x, self.eps) * self.weight


def rope_tables(head_dim: int, max_len: int, theta: float, device: torch.device | None = None,
                scaling: RopeScaling | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, each (max_len, head_dim // 2), in float32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    if scaling is not None:
        freqs = scaling.frequencies(freqs)
    angles = torch.outer(torch.arange(max_len, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs of x (B, T, heads, hd) by position; cos/sin (T or B×T, hd/2)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, heads, hd/2, 2)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def project(x: Tensor, layer: nn.Linear) -> Tensor:
    """`layer`(x); stacked weights (k, out, in) on x (k, ..., in) as one batched product."""
    weight, bias = layer.weight, layer.bias
    if weight.dim() == 2:
        if _on_kernels(layer, x, weight):
            return _packed(layer)(x)
        return F.linear(x, weight, bias)
    flat = x.flatten(1, -2)  # (k, N, in)
    out = flat @ weight.mT if bias is None else torch.baddbmm(bias[:, None], flat, weight.mT)
    return out.unflatten(1, x.shape[1:-1])  # (k, ..., out)


_KERNEL_MARK = "_decodes_on_kernels"  # set on the modules `use_kernels` hands to the kernels
_PACKED = "_packed_weight"  # an nn.Linear's PackedLinear and the weight it was packed from
_KERNEL_CHOICE = "_kernel_choice"  # the model's: whether the kernels were asked for


def _on_kernels(module: nn.Module, x: Tensor, weight: Tensor) -> bool:
    """Whether this call of a marked module runs on the kernels: inference on a CPU, x and
    the weight in one dtype the kernels take, not while torch.compile traces."""
    return (module.__dict__.get(_KERNEL_MARK, False) and x.device.type == "cpu"
            and x.dtype == weight.dtype and x.dtype in kernels.DTYPES
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch.compiler.is_compiling())  # the custom ops run eagerly


def _packed(layer: nn.Linear) -> kernels.PackedLinear:
    """The layer's packed weight, packed again when the weight changed since."""
    weight = layer.weight
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor keeps no version: it cannot change in place
        version = None
    source = (weight.data_ptr(), weight.dtype, version)
    entry = layer.__dict__.setdefault(_PACKED, _Packed())
    if entry.packed is None or entry.source != source:
        bias = None if layer.bias is None else layer.bias.detach()
        entry.packed, entry.source = kernels.PackedLinear(weight.detach(), bias), source
    return entry.packed


class _Packed:
    """An nn.Linear's packed weight: derived state a copy or pickle leaves behind (repacked)."""

    def __init__(self) -> None:
        self.packed: kernels.PackedLinear | None = None
        self.source: tuple | None = None

    def __reduce__(self) -> tuple:
        return _Packed, ()


def use_kernels(model: nn.Module, on: bool | None = None) -> str:
    """Decode `model` through `mtp.kernels` (on) or torch (off; None: as chosen before, else
    on); one line saying which. The kernels stay off where `mtp.kernels.active()` is not,
    on another device or dtype, and under autograd."""
    chosen = model.__dict__.get(_KERNEL_CHOICE)  # None: never chosen
    asked = on if on is not None else chosen is not False
    why_not = _why_not_kernels(model, asked)
    summary = (f"decoding through torch: {why_not}" if why_not else
               f"decoding through mtp.kernels ({kernels.status().isa}, "
               f"{torch.get_num_threads()} threads)")
    if chosen == asked and decodes_on_kernels(model) == (why_not is None):
        return summary  # marked as it should be (a device, a dtype or the switch may move)
    for module in model.modules():
        if isinstance(module, _KERNEL_MODULES):
            module.__dict__[_KERNEL_MARK] = why_not is None
            if isinstance(module, nn.Linear) and why_not is None:
                _packed(module)
            else:
                module.__dict__.pop(_PACKED, None)
    model.__dict__[_KERNEL_CHOICE] = asked
    return summary


def _why_not_kernels(model: nn.Module, asked: bool) -> str | None:
    """Why `model` cannot decode on the kernels (None: it can)."""
    param = next(model.parameters())
    if not asked:
        return "kernels off as asked"
    if param.device.type != "cpu":
        return f"the kernels are for a CPU, the model is on {param.device.type}"
    if param.dtype not in kernels.DTYPES:
        return f"the kernels take float32 and bfloat16, the model is {param.dtype}"
    return kernels.why_inactive()


def decodes_on_kernels(model: nn.Module) -> bool:
    """Whether every layer of `model` that decoding runs is on the kernels (`use_kernels`):
    then a token's arithmetic is the same in any step and any batch."""
    return _why_not_kernels(model, True) is None and all(
        module.__dict__.get(_KERNEL_MARK, False) for module in model.modules()
        if isinstance(module, _KERNEL_MODULES))


class Attention(nn.Module):
    def __init__(self, config: MTPConfig, block_index: int | slice) -> None:
        super().__init__()
        self.block_index = block_index  # its slot in the KV cache (stacked blocks: a slice)
        dim, hd, qkv_bias = config.dim, config.head_dim, config.qkv_bias
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, hd
        self.wq = nn.Linear(dim, config.n_heads * hd, bias=qkv_bias)
        self.wk = nn.Linear(dim, config.n_kv_heads * hd, bias=qkv_bias)
        self.wv = nn.Linear(dim, config.n_kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(config.n_heads * hd, dim, bias=config.out_bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None,
                step: CacheStep | None) -> Tensor:
        """x (B, T, D), or (k, B, T, D) for stacked blocks: the same shape out."""
        q = project(x, self.wq).unflatten(-1, (self.n_heads, self.head_dim))  # (B, T, H, hd)
        k = project(x, self.wk).unflatten(-1, (self.n_kv_heads, self.head_dim))
        v = project(x, self.wv).unflatten(-1, (self.n_kv_heads, self.head_dim))
        if cache is not None and step.window is None and _on_kernels(self, x, q):
            # Rotate, write the cache and attend in two kernel calls, not a few dozen ops.
            keys, values = cache.store(self.block_index)  # (B, K, max_len, hd)
            q = kernels.rope_write(q, k, v, cos, sin, keys, values, step.slots)
            width = step.key_len
            out = kernels.attention(q, keys[:, :, :width], values[:, :, :width], step.mask[:, 0])
            return project(out.flatten(-2), self.wo)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # (B, heads, T, hd)
        mask = None
        if cache is not None:
            k, v = cache.write(self.block_index, step, k, v)  # (B, K, L, hd)
            mask = step.mask.expand(*q.shape[:-3], *step.mask.shape[1:])  # (B, 1, T, L)
        lead = q.shape[:-3]  # (B,), or (k, B) for stacked blocks: one batch for attention
        q, k, v, mask = (None if t is None else t.flatten(0, -4) for t in (q, k, v, mask))
        if step is not None and step.window is not None:  # decoding's exact mode
            window = [t.expand(*lead, *t.shape[1:]).flatten(0, len(lead) - 1)
                      for t in step.window]  # every stacked head alike
            out = windowed_attention(q, k, v, *window)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 is_causal=cache is None,
                                                 enable_gqa=self.n_kv_heads != self.n_heads)
        out = out.unflatten(0, lead).transpose(-3, -2).flatten(-2)  # (B, T, H * hd)
        return project(out, self.wo)


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, slots: Tensor, bias: Tensor,
                       prefix_bias: Tensor, seen: Tensor) -> Tensor:
    """Attention whose result for a query depends only on what its position sees (decoding's
    exact mode): the prefix before each query's window and the window (in position order),
    each by one kernel of fixed shape, merged by their log-sum-exps. q (B, H, T, hd);
    k, v (B, K, L, hd); the rest a `kv_cache.Window`."""
    B, H, T, hd = q.shape
    prefix, prefix_lse = _attention_with_lse(q, k, v, prefix_bias)  # (B, H, T, hd), (B, H, T)
    rows = torch.arange(B, device=q.device)[:, None, None]
    k_window = k[rows, :, slots].flatten(0, 1).transpose(1, 2)  # (B*T, K, W, hd)
    v_window = v[rows, :, slots].flatten(0, 1).transpose(1, 2)
    alone = q.transpose(1, 2).reshape(B * T, H, 1, hd)  # each query on its own window
    own_bias = bias.flatten(0, 1)[:, None, None]  # (B*T, 1, 1, W)
    own, own_lse = _attention_with_lse(alone, k_window, v_window, own_bias)
    own, own_lse = own.view(B, T, H, hd).transpose(1, 2), own_lse.view(B, T, H).transpose(1, 2)
    prefix_lse = torch.where(seen, prefix_lse, -math.inf)  # the kernel says 0 for nothing
    # softmax over both parts = the prefix's, moved towards the window's by the window's
    # share of the total weight, exp(own_lse) / (exp(prefix_lse) + exp(own_lse))
    share = torch.sigmoid(own_lse - prefix_lse)[..., None].to(q.dtype)
    return torch.lerp(prefix, own, share)  # (B, H, T, hd)


def _attention_with_lse(q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Attention of q (B, H, T, hd) over k, v (B, K, L, hd) plus `bias` (B, 1, T, L), and
    its log-sum-exp (B, H, T) in float32."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1).float(), v.repeat_interleave(groups, 1).float()
    scores = q.float() @ k.mT * q.shape[-1] ** -0.5 + bias.float()
    lse = scores.logsumexp(-1)  # (B, H, T)
    weights = (scores - lse.nan_to_num(neginf=0.0)[..., None]).exp()
    return (weights @ v).to(q.dtype), lse


class FeedForward(nn.Module):
    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=config.mlp_bias)  # gate
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=config.mlp_bias)  # up
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=config.mlp_bias)  # down

    def forward(self, x: Tensor) -> Tensor:
        gate, up = project(x, self.w1), project(x, self.w3)
        if _on_kernels(self, gate, up):
            return project(kernels.silu_mul(gate, up), self.w2)
        return project(F.silu(gate) * up, self.w2)


# What `use_kernels` marks: every module whose arithmetic decoding runs (Block and the heads'
# layers are made of these; attention-free heads only draft).
_KERNEL_MODULES = (nn.Linear, RMSNorm, Attention, FeedForward)


class Block(nn.Module):
    """A pre-norm transformer block on x (B, T, D); or k blocks stacked (linear weights
    (k, out, in), norms (k, 1, 1, D), `block_index` a slice): `decode.forward.StackedHeads`."""

    def __init__(self, config: MTPConfig, block_index: int | slice) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, block_index)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None,
                step: CacheStep | None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, step)
        return x + self.feed_forward(self.ffn_norm(x))


def resblock(x: Tensor, weight: Tensor) -> Tensor:
    """Medusa's head layer x + SiLU(x @ weight); weight (D, D), or (k, D, D) for k heads."""
    return x + F.silu(x @ weight)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """A linear head layer x @ weight; weight (D, D), or (k, D, D) for k heads."""
    return x @ weight


class HeadLayer(nn.Module):
    """An attention-free head layer, `resblock` (also `medusa`'s) or `linear`; W (in, out)."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.kind = config.head_type
        self.weight = nn.Parameter(torch.empty(config.dim, config.dim))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None,
                step: CacheStep | None) -> Tensor:  # Block's signature: a head is a layer list
        return (linear if self.kind == "linear" else resblock)(x, self.weight)

    def extra_repr(self) -> str:
        return f"{self.kind}, dim={self.weight.shape[0]}"


class SequentialHead(nn.ModuleList):
    """A sequential head (DeepSeek-V3's MTP module): its blocks, and the input fusion's
    parameters named as in DeepSeek-V3's checkpoints."""

    FUSION: tuple[str, ...] = ("hnorm", "enorm", "eh_proj")

    def __init__(self, config: MTPConfig, first_block: int) -> None:
        super().__init__(Block(config, first_block + j) for j in range(config.head_layers))
        self.eps = config.norm_eps
        self.hnorm = nn.Parameter(torch.ones(config.dim))  # gain on the previous depth's state
        self.enorm = nn.Parameter(torch.ones(config.dim))  # gain on the token embedding
        # nn.Linear's (out, in) layout over the concatenation [hidden; embedding] (MiMo's order).
        self.eh_proj = nn.Parameter(torch.empty(config.dim, 2 * config.dim))

    def fuse(self, hidden: Tensor, embedded: Tensor) -> Tensor:
        """eh_proj([hnorm(hidden); enorm(embedded)]): (..., D) each -> (..., D)."""
        both = torch.cat([rms_normalise(hidden, self.eps) * self.hnorm,
                          rms_normalise(embedded, self.eps) * self.enorm], dim=-1)
        return F.linear(both, self.eh_proj)


def tokens_ahead(tokens: Tensor, k: int, length: int) -> Tensor:
    """What sequential module k reads under teacher forcing: (B, length), at position t
    tokens[:, t + k]; 0 past the end (where head k - 1's target is ignored)."""
    ahead = tokens[:, k:k + length]
    return F.pad(ahead, (0, length - ahead.shape[1]))


def _check_cached(cache: KVCache | None, step: CacheStep | None) -> None:
    if (cache is None) != (step is None):
        raise ValueError("a cached forward needs both cache= and step= (see mtp.kv_cache); "
                         f"got cache={type(cache).__name__}, step={type(step).__name__}")


def _head(config: MTPConfig, index: int) -> nn.ModuleList:
    """Head `index`'s layers; a block head's blocks take cache slots after the trunk's."""
    first = config.n_layers + index * config.head_layers
    if index > 0 and config.head_type == "sequential":
        return SequentialHead(config, first)
    if index == 0 or config.head_type == "block":
        return nn.ModuleList(Block(config, first + j) for j in range(config.head_layers))
    return nn.ModuleList(HeadLayer(config) for _ in range(config.head_layers))


class MTPModel(nn.Module):
    """Trunk, n_future heads, shared final norm and unembedding. See the module docstring."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.heads = nn.ModuleList(_head(config, i) for i in range(config.n_future))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.tie_weights()
        # Rotary tables: derived state, not saved, float32 whatever the parameters' (_apply).
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_rope()
        if self.output.weight.device.type != "meta":
            self.init_weights()

    def tie_weights(self) -> None:
        """Make `output.weight` the embedding Parameter itself when tied."""
        if self.config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_rope(self) -> None:
        """(Re)build the rotary tables on the parameters' device (after a meta-device load)."""
        cfg = self.config
        self.rope_cos, self.rope_sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta,
                                                   self.output.weight.device, cfg.rope_scaling)

    def _apply(self, fn: Any, recurse: bool = True) -> MTPModel:
        # .to(), .cuda() and to_empty() pass here: keep the rotary tables exact float32.
        super()._apply(fn, recurse)
        self.init_rope()
        return self

    def init_weights(self) -> None:
        """(Re)initialise every parameter and the rotary tables, e.g. after `to_empty`."""
        cfg = self.config
        self.init_rope()
        residual_std = cfg.init_std / math.sqrt(2 * (cfg.n_layers + cfg.head_layers))
        for name, param in self.named_parameters():
            if name.endswith(("norm.weight", ".hnorm", ".enorm")):
                nn.init.ones_(param)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=cfg.init_std)

    def rope(self, T: int, step: CacheStep | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin of T positions from 0 (no step), or of the step's positions (B, T)."""
        if step is None:
            if T > (limit := self.config.max_seq_len):
                raise ValueError(f"sequence length {T} exceeds max_seq_len={limit}")
            return self.rope_cos[:T], self.rope_sin[:T]
        return self.rope_cos[step.positions], self.rope_sin[step.positions]

    def trunk(self, tokens: Tensor, *, cache: KVCache | None = None,
              step: CacheStep | None = None, skip: Collection[int] = ()) -> Tensor:
        """Embed tokens (B, T) and run the trunk, but for layers `skip`: (B, T, D)."""
        return self.trunk_states(tokens, cache=cache, step=step, skip=skip)[0]

    def trunk_states(self, tokens: Tensor, *, cache: KVCache | None = None,
                     step: CacheStep | None = None, skip: Collection[int] = (),
                     keep: Sequence[int] = ()) -> tuple[Tensor, Tensor | None]:
        """`trunk`, and the residual stream after each trunk layer in `keep` (an EAGLE-3
        drafter's features): (B, T, D) and (B, T, len(keep), D), None when `keep` is empty."""
        _check_cached(cache, step)
        cos, sin = self.rope(tokens.shape[1], step)
        h = self.tok_embeddings(tokens)  # (B, T, D)
        kept = {}
        for index, block in enumerate(self.layers):
            if index not in skip:
                h = block(h, cos, sin, cache, step)
            if index in keep:
                kept[index] = h
        return h, torch.stack([kept[i] for i in keep], dim=2) if keep else None

    def resume_trunk(self, h: Tensor, start: int) -> Tensor:
        """Trunk layers start.. on h (B, T, D), uncached: the rest of a `trunk` that skipped
        them (the loss's LayerSkip exit)."""
        return self._run(self.layers[start:], h, None, None)

    def _run(self, blocks: nn.ModuleList, h: Tensor, cache: KVCache | None,
             step: CacheStep | None) -> Tensor:
        """`blocks` in turn on h (B, T, D), at positions from 0 or at the step's."""
        _check_cached(cache, step)
        cos, sin = self.rope(h.shape[1], step)
        for block in blocks:
            h = block(h, cos, sin, cache, step)
        return h

    def head(self, trunk_out: Tensor, index: int, *, cache: KVCache | None = None,
             step: CacheStep | None = None) -> Tensor:
        """Head `index`'s layers on the trunk output: (B, T, D), for `unembed(h, index)`."""
        if isinstance(self.heads[index], SequentialHead):
            raise ValueError(f"head {index} is a sequential module: it reads the previous "
                             f"depth's state and the tokens ahead (MTPModel.mtp_module)")
        h = trunk_out
        if index and self.config.head_type == "medusa":
            h = self.norm(self.head(trunk_out, 0, cache=cache, step=step))
        return self._run(self.heads[index], h, cache, step)

    def mtp_module(self, previous: Tensor, tokens: Tensor, index: int, *,
                   cache: KVCache | None = None, step: CacheStep | None = None) -> Tensor:
        """Sequential head `index` >= 1: (B, T, D), before the shared norm. previous: head
        index - 1's output (B, T, D); tokens (B, T): at position t the token t + index."""
        head = self.heads[index]
        if not isinstance(head, SequentialHead):
            raise ValueError(f"head {index} is not a sequential module (model.head_type="
                             f"{self.config.head_type!r})")
        h = head.fuse(self.norm(previous), self.tok_embeddings(tokens))  # (B, T, D)
        return self._run(head, h, cache, step)

    def head_states(self, trunk_out: Tensor, tokens: Tensor, n: int) -> list[Tensor]:
        """Heads 0..n-1's outputs (B, T, D) on the trunk output of tokens[:, :T]; sequential
        heads are teacher-forced on `tokens` (B, L >= T)."""
        if self.config.head_type != "sequential":
            return [self.head(trunk_out, i) for i in range(n)]
        states = [self.head(trunk_out, 0)]
        for k in range(1, n):
            ahead = tokens_ahead(tokens, k, trunk_out.shape[1])  # (B, T)
            states.append(self.mtp_module(states[-1], ahead, k))
        return states

    def unembed(self, h: Tensor, head: int = 0) -> Tensor:
        """Head `head`'s logits (..., V) from its output (..., D): shared norm, unembedding."""
        if not (head and self.config.head_type == "medusa"):
            h = self.norm(h)
        if _on_kernels(self.output, h, self.output.weight):
            return _packed(self.output)(h)
        return self.output(h)  # the module's call: its hooks (FSDP's unsharding) run

    def forward(self, tokens: Tensor, *, cache: KVCache | None = None,
                step: CacheStep | None = None, heads: Sequence[int] | None = None) -> Tensor:
        """Logits of the chosen heads (default all): (B, T, n, V). With a cache, `tokens` are
        new tokens placed by `step`; sequential heads are teacher-forced, without a cache."""
        heads = list(range(self.config.n_future) if heads is None else heads)
        chain = self.config.head_type == "sequential" and max(heads) > 0
        if chain and cache is not None:
            raise ValueError("a cached forward runs head 0 only for sequential heads: their "
                             "modules need the tokens ahead (see mtp.decode.drafters.sequential)")
        h = self.trunk(tokens, cache=cache, step=step)
        if chain:
            states = self.head_states(h, tokens, max(heads) + 1)
            return torch.stack([self.unembed(states[i]) for i in heads], dim=2)
        return torch.stack([self.unembed(self.head(h, i, cache=cache, step=step), i)
                            for i in heads], dim=2)  # (B, T, n, V)

    @staticmethod
    def is_base_parameter(name: str) -> bool:
        """Whether parameter `name` is the base next-token model's (all but heads 1..n-1)."""
        return not name.startswith("heads.") or name.startswith("heads.0.")

    def num_params(self, *, embeddings: bool = True) -> int:
        """Parameter count; `embeddings=False` leaves out the input embedding table."""
        total = sum(p.numel() for p in self.parameters())
        if not embeddings and not self.config.tie_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total
