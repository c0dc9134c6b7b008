"""EAGLE-3's drafter model (Li et al. 2024, 2025); the drafter that runs it is `eagle.py`.

The module (`Eagle`): the target's residual stream after three trunk layers (low, middle,
high: `EagleConfig.layers`) is fused to the model's width by `fc` (3D -> D); the embedding of
the token after it and that feature, each normalised, are concatenated (2D) and read by one
attention's queries, keys and values, the feature being the residual; then a feed-forward
block, a final norm and an unembedding over a reduced draft vocabulary (`lm_head`, N rows),
draft id i being the target's token `d2t[i]`. Its output before the final norm is the next
step's feature (EAGLE-3's training-time test, `mtp.train.eagle`). The layout is EAGLE-3's,
so `mtp.interop.eagle3` writes it for vLLM's and SGLang's `eagle3` drafters.

Files: a drafter directory holds `eagle.json` (the format, the `EagleConfig`, what training
measured, and "weights", relative to the directory) and `eagle.safetensors`. The choice saved
for a checkpoint is the same JSON with an absolute "weights".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from mtp.cli import check_positive
from mtp.kv_cache import CacheStep, KVCache
from mtp.model import Attention, FeedForward, MTPConfig, RMSNorm
from mtp.paths import read_json, write_json

CONFIG_FILE, WEIGHTS_FILE = "eagle.json", "eagle.safetensors"
FORMAT, FORMAT_VERSION = "mtp-eagle", 1


def engine_layers(config: MTPConfig) -> tuple[int, int, int]:
    """The trunk layers vLLM and SGLang capture for EAGLE-3 by default: the inputs of Llama
    layers 2, L // 2 and L - 3 of L (trunk + head 0), i.e. the outputs of layers 1, L // 2 - 1
    and L - 4, mtp's trunk indices (not checked to be the trunk's)."""
    total = config.n_layers + config.head_layers
    return 1, total // 2 - 1, total - 4


def default_layers(config: MTPConfig) -> tuple[int, int, int]:
    """The three trunk layers whose output the drafter fuses: the engines' own default
    (`engine_layers`) where the trunk has them, else its first, middle and last layer."""
    engines = engine_layers(config)
    if 0 <= engines[0] < engines[1] < engines[2] < config.n_layers:
        return engines
    return 0, config.n_layers // 2, max(config.n_layers - 1, 0)


def check_layers(layers: object, n_layers: int) -> tuple[int, ...]:
    """`layers` as three trunk layer indices in order, or a ValueError naming the bad one."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or len(layers) != 3:
        raise ValueError(f"layers must be three trunk layer indices (low, middle, high), got "
                         f"{layers!r:.80}")
    for layer in layers:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < n_layers:
            raise ValueError(f"layers={list(layers)} names layer {layer!r}, but the target's "
                             f"trunk has layers 0..{n_layers - 1}")
    if list(layers) != sorted(layers):
        raise ValueError(f"layers={list(layers)} must be in order: low, middle, high")
    return tuple(layers)


def check_map(d2t: Tensor, vocab_size: int) -> Tensor:
    """The draft vocabulary's map (N,), draft id -> target id, checked (integers within the
    target's vocabulary, each at most once); a ValueError naming the first bad entry."""
    if d2t.dim() != 1 or d2t.numel() == 0 or d2t.dtype.is_floating_point or d2t.dtype == \
            torch.bool:
        raise ValueError(f"the draft vocabulary map must be a non-empty 1-d integer tensor, "
                         f"got {d2t.dtype} of shape {tuple(d2t.shape)}")
    outside = ((d2t < 0) | (d2t >= vocab_size)).nonzero()
    if len(outside):
        i = int(outside[0])
        raise ValueError(f"the draft vocabulary map's entry {i} is {int(d2t[i])}, outside the "
                         f"target's vocabulary of {vocab_size} tokens (0..{vocab_size - 1})")
    ordered, entries = d2t.sort(stable=True)
    twice = (ordered[1:] == ordered[:-1]).nonzero()
    if len(twice):
        i = int(twice[0])
        raise ValueError(f"the draft vocabulary map has target token {int(ordered[i])} twice "
                         f"(entries {int(entries[i])} and {int(entries[i + 1])})")
    return d2t.long()


@dataclass(frozen=True, kw_only=True)
class EagleConfig:
    """The drafter's shape and the target it reads: the target's width, vocabulary and
    trunk layers; the three trunk layers fused (`layers`); the draft vocabulary's size; the
    layer's attention and feed-forward shapes (the target's, by `for_target`)."""

    target_dim: int
    target_vocab_size: int
    target_layers: int
    layers: tuple[int, ...]
    draft_vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden: int
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("target_dim", "target_vocab_size", "target_layers", "draft_vocab_size",
                     "n_heads", "n_kv_heads", "head_dim", "ffn_hidden"):
            check_positive(f"EagleConfig.{name}", getattr(self, name))
        object.__setattr__(self, "layers", check_layers(list(self.layers), self.target_layers))
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} exceeds the target's "
                             f"vocabulary of {self.target_vocab_size} tokens")
        self.block()  # the attention's shapes, checked

    @classmethod
    def for_target(cls, config: MTPConfig, draft_vocab_size: int,
                   layers: Sequence[int] | None = None) -> EagleConfig:
        """A drafter for the model of `config`: its width and attention shapes."""
        if config.n_layers < 1:
            raise ValueError("an EAGLE drafter reads trunk layers: the model has none")
        return cls(target_dim=config.dim, target_vocab_size=config.vocab_size,
                   target_layers=config.n_layers,
                   layers=tuple(default_layers(config) if layers is None else layers),
                   draft_vocab_size=draft_vocab_size, n_heads=config.n_heads,
                   n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                   ffn_hidden=config.ffn_hidden, norm_eps=config.norm_eps)

    def block(self) -> MTPConfig:
        """The layer's shapes as a one-block model config (its attention, feed-forward and
        KV cache are `mtp.model`'s)."""
        return MTPConfig(vocab_size=self.target_vocab_size, dim=self.target_dim, n_layers=0,
                         n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                         head_dim=self.head_dim, ffn_hidden=self.ffn_hidden,
                         norm_eps=self.norm_eps)

    def check_target(self, config: MTPConfig, source: str = "the EAGLE drafter") -> None:
        """A ValueError, naming the value, unless the drafter was made for a model of this
        width, vocabulary, trunk depth and head width."""
        for ours, theirs in (("target_dim", "dim"), ("target_vocab_size", "vocab_size"),
                             ("target_layers", "n_layers"), ("head_dim", "head_dim")):
            if getattr(self, ours) != getattr(config, theirs):
                raise ValueError(f"{source} was trained for a model with {theirs}="
                                 f"{getattr(self, ours)}, but this model has {theirs}="
                                 f"{getattr(config, theirs)}: train one for it "
                                 f"(python -m mtp.train.eagle)")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "layers": list(self.layers)}

    @classmethod
    def from_dict(cls, values: Any, source: str) -> EagleConfig:
        try:
            return cls(**{**values, "layers": tuple(values["layers"])})
        except (TypeError, KeyError) as error:
            raise ValueError(f"{source}: not an EAGLE drafter's config ({error})") from None


class FusedAttention(Attention):
    """`mtp.model.Attention` whose queries, keys and values read [embedding; feature] (2D)."""

    def __init__(self, config: MTPConfig) -> None:
        super().__init__(config, 0)
        wide = 2 * config.dim
        self.wq = nn.Linear(wide, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(wide, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(wide, config.n_kv_heads * config.head_dim, bias=False)


class Eagle(nn.Module):
    """The drafter's layer (module docstring), with the draft vocabulary's map `d2t`. Shapes:
    D the target's width, N the draft vocabulary, B batch, T tokens."""

    def __init__(self, config: EagleConfig, d2t: Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        block = config.block()
        dim = config.target_dim
        self.fc = nn.Linear(3 * dim, dim, bias=False)
        self.input_norm = RMSNorm(dim, config.norm_eps)  # on the token's embedding
        self.hidden_norm = RMSNorm(dim, config.norm_eps)  # on the feature
        self.attention = FusedAttention(block)
        self.ffn_norm = RMSNorm(dim, config.norm_eps)
        self.feed_forward = FeedForward(block)
        self.norm = RMSNorm(dim, config.norm_eps)
        self.lm_head = nn.Linear(dim, config.draft_vocab_size, bias=False)
        if d2t is None:
            d2t = torch.arange(config.draft_vocab_size)
        if d2t.shape != (config.draft_vocab_size,):
            raise ValueError(f"the draft vocabulary map has {d2t.numel()} entries for "
                             f"draft_vocab_size={config.draft_vocab_size}")
        self.register_buffer("d2t", check_map(d2t, config.target_vocab_size))
        self.init_weights()

    def init_weights(self, std: float = 0.02) -> None:
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            else:  # the residual branches' outputs start smaller, as the model's (GPT-2)
                scale = 2 ** -0.5 if name.endswith(("wo.weight", "w2.weight")) else 1.0
                nn.init.normal_(param, std=std * scale)

    def fuse(self, features: Tensor) -> Tensor:
        """The target's three layers' features (..., 3, D) -> the drafter's (..., D)."""
        return self.fc(features.flatten(-2))  # [low; middle; high]

    def forward(self, hidden: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor,
                cache: KVCache | None = None, step: CacheStep | None = None,
                attend: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """The layer on features `hidden` (B, T, D) and token embeddings `embedded`: its
        output (B, T, D) before the final norm, the next step's feature. Attention is
        causal without a cache, placed by `step` with one, or `attend`'s (training)."""
        x = torch.cat([self.input_norm(embedded), self.hidden_norm(hidden)], dim=-1)
        h = hidden + (self.attention(x, cos, sin, cache, step) if attend is None else attend(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def logits(self, h: Tensor) -> Tensor:
        """Draft logits (..., N) over the draft vocabulary."""
        return self.lm_head(self.norm(h))

    def target_logits(self, h: Tensor) -> Tensor:
        """Draft logits spread over the target's vocabulary (..., V): -inf outside the draft
        vocabulary, which the drafter then never proposes."""
        logits = self.logits(h)
        full = logits.new_full((*logits.shape[:-1], self.config.target_vocab_size), -math.inf)
        return full.index_copy(-1, self.d2t, logits)

    def save(self, directory: str | Path, details: Mapping[str, Any] | None = None) -> Path:
        """Write `eagle.json` and `eagle.safetensors` into `directory`; the JSON's path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().contiguous() for name, tensor in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return write_json(directory / CONFIG_FILE, self.describe(WEIGHTS_FILE, details))

    def describe(self, weights: str, details: Mapping[str, Any] | None = None
                 ) -> dict[str, Any]:
        """The JSON that names this drafter, its weights at `weights` (a path)."""
        return {"format": FORMAT, "format_version": FORMAT_VERSION,
                "config": self.config.to_dict(), "weights": weights,
                "details": dict(details or {})}

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any]) -> Eagle:
        """A drafter from a directory (its eagle.json), an eagle.json file, or the JSON of
        one (a saved choice, whose "weights" path is absolute); a ValueError naming the file
        and what is wrong with it."""
        if isinstance(source, Mapping):
            values, base, name = source, None, "the saved EAGLE drafter"
        else:
            path = Path(source)
            path = path / CONFIG_FILE if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"eagle={source}: no EAGLE drafter there (no {CONFIG_FILE}; "
                                 f"python -m mtp.train.eagle writes one)")
            values = read_json(path, "an EAGLE drafter's file")
            base, name = path.parent, str(path)
        if not isinstance(values, Mapping) or values.get("format") != FORMAT:
            raise ValueError(f"{name} is not an EAGLE drafter's file (format {FORMAT!r})")
        weights = Path(str(values.get("weights")))
        if not weights.is_absolute():
            if base is None:
                raise ValueError(f"{name} names its weights {weights} relative to a directory "
                                 f"it does not know: give eagle=DIR")
            weights = base / weights
        try:
            state = load_file(str(weights))
        except (OSError, SafetensorError) as error:
            raise ValueError(f"{name}: cannot read its weights {weights}: {error}") from None
        return cls.from_state(values.get("config"), state, name)

    @classmethod
    def from_state(cls, config: Any, state: Mapping[str, Tensor], source: str) -> Eagle:
        """A drafter from its config's fields (`EagleConfig.to_dict`) and its state dict (with
        `d2t`), both checked; a ValueError naming `source` and what does not fit."""
        config = EagleConfig.from_dict(config, source)
        d2t = state.get("d2t")
        if d2t is None:
            raise ValueError(f"{source} has no draft vocabulary map (d2t)")
        module = cls(config, d2t).to(state["fc.weight"].dtype if "fc.weight" in state
                                     else torch.float32)
        try:
            module.load_state_dict(state)
        except RuntimeError as error:
            raise ValueError(f"{source}: the weights do not fit the config: "
                             f"{str(error).splitlines()[-1].strip()}") from None
        return module.eval().requires_grad_(False)
