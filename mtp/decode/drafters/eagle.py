"""EAGLE-3 as the drafter (Li et al. 2024, 2025): one decoder layer that reads the target's own
features and drafts one token after another, at feature level.

The module (`Eagle`): the target's residual stream after three trunk layers (a low, a middle
and a high one: `EagleConfig.layers`) is fused to the model's width by `fc` (3D -> D); the
embedding of the token after it (the target's own embedding, frozen) and that fused feature,
each normalised, are concatenated [embedding; feature] (2D) and read by the queries, keys and
values of one attention; the feature is the residual; then a feed-forward block, a final norm
and an unembedding over a reduced draft vocabulary (`lm_head`, N rows), whose draft id i is
the target's token `d2t[i]` (the N most frequent target tokens of the training data). Its
output before the final norm is the feature of the next draft step: from the second step on
the drafter reads its own feature instead of the target's (EAGLE-3's training-time test trains
it so, `mtp.train.eagle`). The layout is EAGLE-3's, so `mtp.interop.eagle3` writes it for
vLLM's and SGLang's `eagle3` drafters.

The drafter (`EagleDrafter`). Position t of the drafter's cache holds the layer's entry for
the pair (the target's features at token x_t, the token x_{t + 1}), at rotary position t, as
in training. The verify pass keeps the three layers' features (`verify_layers`), so after
each step `update` holds the commit: the features at the kept path's tokens and the token
after each (the kept drafts, then the new root x_p; after the prefill, the prompt). `propose`
runs the layer once over the commit (entries p'..p - 1), whose last output drafts the
root's children, then once per depth over the tree's nodes of the depth before: node u at
depth d reads its parent's output and its own token, at position p - 1 + d, sees the
committed entries and its ancestors, and its output drafts u's children. A chain of n drafts
costs n small forwards, a tree one per depth. The nodes sit in slots after the committed
ones, which the next commit overwrites (the target's rule; `sequential.py` keeps its modules'
caches the same way). Shapes are fixed per step (the commit is the path's width, the prefill
the prompts'), finished rows draft on harmlessly, and greedy drafts are the drafter's top
ranks, sampled ones drawn from q (the sampling rule on the draft logits, every token outside
the draft vocabulary at probability 0) with that q returned, so acceptance stays lossless.

EAGLE-2's dynamic tree (`dynamic_tree`): from the drafter's own confidence, expand the
`top_k` nodes of highest cumulative draft probability at each depth, then keep the best
`nodes` of everything drafted; `EagleDrafter.dynamic` runs it on the layer. A dynamic tree's
drafts are the drafter's top ranks (deterministic), so its q is one-hot whatever the
sampling: recursive rejection of deterministic siblings is lossless.

Files: a drafter directory holds `eagle.json` (the format, the `EagleConfig`, what training
measured, and "weights", the safetensors file of the module and its map, relative to the
directory) and `eagle.safetensors`. `python -m mtp.train.eagle` writes one and saves its
choice for the checkpoint (the same JSON with an absolute "weights"), where `drafter=eagle`
finds it; `eagle=DIR` names one.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from mtp.cli import check_positive
from mtp.decode.drafters.base import Drafter, DrafterContext, Drafts, Verified
from mtp.decode.drafters.heads import ranked
from mtp.decode.drafters.registry import register
from mtp.decode.drafters.sequential import TreePlan
from mtp.decode.forward import key_width
from mtp.decode.sampling import SamplingConfig, exponential
from mtp.decode.tree import DynamicTree, Tree, resolve_tree
from mtp.kv_cache import CacheStep, KVCache, cache_step, causal
from mtp.model import Attention, FeedForward, MTPConfig, MTPModel, RMSNorm
from mtp.tokenizers import Tokenizer

CONFIG_FILE, WEIGHTS_FILE = "eagle.json", "eagle.safetensors"
FORMAT, FORMAT_VERSION = "mtp-eagle", 1
CANDIDATE_TREES = ("tree16", "tree32", "dynamic:16")  # what `auto` measures besides the chain


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
    """The draft vocabulary's map (N,), draft id -> target id, checked: integers within the
    target's vocabulary, each target token at most once; a ValueError naming the first bad
    entry."""
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
    """The drafter's layer (module docstring): fc, the fused attention, the feed-forward block,
    the final norm and the draft vocabulary's unembedding, with the map `d2t`. Shapes: D the
    target's width, N the draft vocabulary, B batch, T tokens."""

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
        path = directory / CONFIG_FILE
        path.write_text(json.dumps(self.describe(WEIGHTS_FILE, details), indent=1) + "\n")
        return path

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
            try:
                values = json.loads(path.read_text())
            except ValueError as error:
                raise ValueError(f"{path} is not JSON: {error}") from None
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


@dataclass(frozen=True, kw_only=True)
class EagleOptions:
    """drafter=eagle: eagle, the drafter's directory (null: the one `python -m
    mtp.train.eagle` saved for the checkpoint); num_draft, drafts per step of a chain, and
    the deepest node of a tree; tree, a tree of the drafter's ranks (tree8 .. tree64, a list
    of rank paths or a .json file; null: the chain) or dynamic:N, EAGLE-2's tree of N nodes
    chosen at every step by the drafter's confidence."""

    eagle: str | None = None
    num_draft: int = 5
    tree: Any = None

    def __post_init__(self) -> None:
        check_positive("num_draft", self.num_draft)
        if self.eagle is not None and not isinstance(self.eagle, str):
            raise ValueError(f"eagle must be a path, got {self.eagle!r}")


@register
class EagleDrafter(Drafter):
    """An EAGLE-3 layer on the target's features drafts a chain of `num_draft` tokens, or the
    nodes of `tree` (a `Tree` of its ranks)."""

    name = "eagle"
    Options = EagleOptions
    selects = ("eagle",)
    after = ("heads",)
    saved, saved_file = "eagle", CONFIG_FILE

    def __init__(self, module: Eagle, num_draft: int = 5, tree: Tree | None = None) -> None:
        if not isinstance(module, Eagle):
            raise ValueError(f"the EAGLE drafter needs an Eagle module (Eagle.load), got "
                             f"{type(module).__name__}")
        self.module = module.eval()
        self.num_draft = check_positive("num_draft", num_draft)
        self._tree = Tree.chain(num_draft) if tree is None else tree
        self._copies: dict[tuple[torch.device, torch.dtype], Eagle] = {}

    @classmethod
    def check_named(cls, options: EagleOptions) -> None:
        if isinstance(options.tree, str) and options.tree.startswith("auto:"):
            raise ValueError(f"tree={options.tree!r} is the heads' calibrated tree: "
                             f"drafter=eagle takes tree8 .. tree64, rank paths or a .json file")
        if options.tree is not None:  # its depth within num_draft
            resolve_tree(options.tree, k=options.num_draft + 1, vocab_size=1 << 30)

    @classmethod
    def found(cls, options: EagleOptions, context: DrafterContext) -> Eagle | None:
        """The module `eagle=` names, else the one saved for the checkpoint, else None."""
        if options.eagle is not None:
            return Eagle.load(options.eagle)
        saved = context.saved.get(cls.saved)
        return None if saved is None else Eagle.load(saved)

    @classmethod
    def from_options(cls, model: MTPModel, options: EagleOptions,
                     context: DrafterContext) -> EagleDrafter:
        module = cls.found(options, context)
        if module is None:
            raise ValueError("drafter=eagle needs a trained drafter: eagle=DIR, or train one "
                             "for the checkpoint (python -m mtp.train.eagle checkpoint=...)")
        module.config.check_target(model.config, options.eagle or "the saved EAGLE drafter")
        tree = None
        if options.tree is not None:
            tree = resolve_tree(options.tree, k=options.num_draft + 1,
                                vocab_size=module.config.draft_vocab_size)
        return cls(module, options.num_draft, tree)

    @classmethod
    def candidates(cls, model: MTPModel, options: EagleOptions, context: DrafterContext,
                   measured: Mapping[str, float]) -> Iterable[EagleDrafter]:
        """With a drafter (given or saved for the checkpoint): its chain and its trees."""
        module = cls.found(options, context)
        if module is None:
            return
        module.config.check_target(model.config)
        trees = [options.tree] if options.tree is not None else [None, *CANDIDATE_TREES]
        for tree in trees:
            yield cls(module, options.num_draft, None if tree is None else resolve_tree(
                tree, k=options.num_draft + 1, vocab_size=module.config.draft_vocab_size))

    @property
    def tree(self) -> Tree:
        return self._tree

    def verify_layers(self, model: MTPModel) -> tuple[int, ...]:
        return self.module.config.layers

    def check(self, model: MTPModel, tokenizer: Tokenizer) -> None:
        self.module.config.check_target(model.config)
        self.tree.check(self.tree.depth + 1, self.module.config.draft_vocab_size)

    def start(self, model: MTPModel, prompts: Sequence[Sequence[int]], cache: KVCache,
              sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        param = next(model.parameters())
        self._layer = self._on(param.device, param.dtype)
        self._model, self._sampling, self._generator = model, sampling, generator
        self._cache = KVCache(self.module.config.block(), len(prompts),
                              cache.max_len + self.tree.n_nodes + 1, device=param.device,
                              dtype=param.dtype)
        self._held = torch.zeros(len(prompts), dtype=torch.long, device=param.device)
        self._accepted = [len(ids) for ids in prompts]  # tokens each row has, on the host
        self._commit: tuple[Tensor, Tensor, Tensor] | None = None
        self._dynamic = isinstance(self.tree, DynamicTree)  # a tree of its own every step
        self._plan = None if self._dynamic else TreePlan(self.tree, param.device)

    def _on(self, device: torch.device, dtype: torch.dtype) -> Eagle:
        """The module on `device` in `dtype` (a copy, kept, when it is not there already: the
        module itself is never rounded)."""
        param = next(self.module.parameters())
        if (param.device, param.dtype) == (device, dtype):
            return self.module
        if (device, dtype) not in self._copies:
            self._copies[device, dtype] = copy.deepcopy(self.module).to(device, dtype)
        return self._copies[device, dtype]

    def update(self, step: Verified) -> None:
        # The commit: the features at the kept path's tokens (B, P, 3, D), the token after
        # each (B, P) and how many are real (B,); after the prefill, the whole prompts.
        rows = torch.arange(step.path.shape[0], device=step.path.device)[:, None]
        self._commit = (step.features[rows, step.path], step.tokens, step.kept)
        self._accepted = [n + len(ids) for n, ids in zip(self._accepted, step.new_ids)]

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, device=self._held.device)
        self._cache.keep(index)
        self._held = self._held[index]
        self._commit = tuple(t[index] for t in self._commit)
        self._accepted = [self._accepted[row] for row in rows]

    def _run_commit(self) -> tuple[Tensor, Tensor, int]:
        """The layer over the commit (entries p'..p - 1): the output at each row's last
        entry (B, D), which drafts the root's children; the new committed lengths (B,); the
        attention width of this step."""
        features, tokens, counts = self._commit
        width = tokens.shape[1]
        old, new = self._held, self._held + counts
        length = key_width(max(self._accepted) + max(width, self.tree.n_nodes) + 1,
                           self._cache.max_len)
        step = cache_step(old, *causal(width, old.device), length,
                          self._model.config.max_seq_len)
        out = self._layer_step(self._layer.fuse(features), tokens, step)
        rows = torch.arange(tokens.shape[0], device=old.device)
        self._held = new
        return out[rows, (counts - 1).clamp(min=0)], new, length

    def _layer_step(self, hidden: Tensor, tokens: Tensor, step: CacheStep) -> Tensor:
        model = self._model
        cos, sin = model.rope(tokens.shape[1], step)
        return self._layer(hidden, model.tok_embeddings(tokens), cos, sin, self._cache, step)

    def propose(self) -> Drafts:
        if self._dynamic:  # EAGLE-2: the drafter's own confidence shapes each row's tree
            tree = self.tree
            tokens, parents, _ = self.dynamic(depth=tree.depth, top_k=tree.branching,
                                              nodes=tree.n_nodes - 1)
            return Drafts(tokens, None, parents=parents)  # top ranks: one-hot q, lossless
        plan, tree = self._plan, self.tree
        root, new, length = self._run_commit()
        batch = root.shape[0]
        drafts = torch.zeros(batch, tree.n_nodes - 1, dtype=torch.long, device=root.device)
        outputs = root[:, None, :][:, :0]  # (B, nodes, D): the output at the nodes so far
        probs = []
        for k in range(1, tree.depth + 1):
            if k > 1:  # feed the nodes of depth k - 1, each with its parent's output
                first, last = plan.nodes[k - 1], plan.nodes[k]  # they are nodes first+1..last
                parents = torch.cat([root[:, None], outputs], dim=1)[:, plan.parents[k][first:]]
                full = cache_step(new, plan.depths[1:last + 1] - 1,
                                  plan.visible[1:last + 1, 1:last + 1], length,
                                  self._model.config.max_seq_len)
                step = CacheStep(full.positions[:, first:], full.slots[:, first:],
                                 full.mask[:, :, first:])
                outputs = torch.cat([outputs, self._layer_step(
                    parents, drafts[:, first:last], step)], dim=1)
            at = root[:, None] if k == 1 else outputs[:, plan.groups[k]]  # (B, G, D)
            candidates, q = self._ranked(at, plan.ranks[k])
            drafts[:, plan.children[k] - 1] = candidates.flatten(1)[:, plan.picks[k]]
            if q is not None:
                probs.append(q.flatten(1, 2)[:, plan.picks[k]])  # (B, c, V)
        return Drafts(drafts, None if self._sampling.greedy else torch.cat(probs, dim=1))

    def _ranked(self, at: Tensor, ranks: int) -> tuple[Tensor, Tensor | None]:
        """The first `ranks` candidates after each state `at` (B, G, D), as target ids, with
        the distributions they were drawn from when sampling (`heads.ranked`)."""
        if self._sampling.greedy:  # the top ranks of the draft vocabulary, then their ids
            return self._layer.d2t[self._layer.logits(at).topk(ranks, dim=-1).indices], None
        logits = self._layer.target_logits(at)  # (B, G, V)
        noise = exponential(logits.shape, self._generator, logits.device)
        return ranked(logits, ranks, self._sampling, noise)

    def dynamic(self, *, depth: int, top_k: int, nodes: int) -> tuple[Tensor, Tensor, None]:
        """EAGLE-2's dynamic tree after the commit (`dynamic_tree` on this layer): the
        drafts (B, nodes) as target ids, each node's parent (B, nodes; 0: the root, j: node
        j), and q (None: the drafts are the layer's top ranks)."""
        root, new, length = self._run_commit()
        batch, device = root.shape[0], root.device
        outputs, seen = [root[:, None]], [torch.ones(batch, 1, 1, dtype=torch.bool,
                                                     device=device)]
        fed = 0  # nodes fed to the layer so far, at slots new .. new + fed - 1

        def expand(tokens: Tensor, parents: Tensor, at_depth: int) -> Tensor:
            nonlocal fed
            k = tokens.shape[1]
            states, ancestry = torch.cat(outputs, dim=1), torch.cat(seen, dim=1)
            rows = torch.arange(batch, device=device)[:, None]
            # Which fed nodes (and the root, column 0) each new node sees: its parent's
            # ancestors, and itself.
            sees = torch.cat([ancestry[rows, parents], torch.eye(k, dtype=torch.bool,
                                                                 device=device).expand(
                batch, k, k)], dim=2)  # (B, k, 1 + fed + k)
            relative = torch.arange(length, device=device) - new[:, None]  # (B, L)
            column = (relative + 1).clamp(0, fed + k)  # slot new + j holds fed node j + 1
            among = sees.gather(2, column[:, None, :].expand(-1, k, -1))
            among &= ((relative >= 0) & (relative < fed + k))[:, None, :]
            mask = (relative < 0)[:, None, :] | among  # the committed entries, or the path
            positions = (new - 1 + at_depth)[:, None].expand(batch, k).clamp(
                max=self._model.config.max_seq_len - 1)
            slots = new[:, None] + fed + torch.arange(k, device=device)
            out = self._layer_step(states[rows, parents], self._layer.d2t[tokens],
                                   CacheStep(positions, slots, mask[:, None]))
            outputs.append(out)
            grown = torch.cat([ancestry, torch.zeros(batch, 1 + fed, k, dtype=torch.bool,
                                                     device=device)], dim=2)
            seen[:] = [torch.cat([grown, sees], dim=1)]
            fed += k
            return torch.log_softmax(self._layer.logits(out).float(), dim=-1)

        first = torch.log_softmax(self._layer.logits(root).float(), dim=-1)
        tokens, parents, q = dynamic_tree(first, expand, depth=depth, top_k=top_k, nodes=nodes)
        return self._layer.d2t[tokens], parents, q

    def __repr__(self) -> str:
        return (f"eagle(num_draft={self.num_draft})" if self.tree.is_chain
                else f"eagle(tree={self.tree.name})")


def dynamic_tree(first: Tensor, expand: Callable[[Tensor, Tensor, int], Tensor], *,
                 depth: int, top_k: int, nodes: int) -> tuple[Tensor, Tensor, None]:
    """EAGLE-2's dynamic draft tree for every row (Li et al. 2024), from the drafter's own
    confidence: a node's score is the sum of its path's draft log-probabilities.

    first (B, N): log-probabilities of the root's children. The root's `top_k` best children
    are depth 1; at each depth d < `depth` the `top_k` best-scoring nodes of depth d are fed
    to the drafter, `expand(tokens (B, k), parents (B, k), d)` -> log-probabilities (B, k, N)
    of their children, where a parent is a fed node's number (0: the root, j: the j-th node
    fed, in feeding order); each fed node's `top_k` best children are candidates of depth
    d + 1. Then every candidate is reranked by score and the best `nodes` kept: a child never
    scores above its parent (ties go to the parent), so the kept nodes form a tree.

    Returns the kept nodes' tokens (B, nodes), their parents (B, nodes: 0 the root, j the
    j-th kept node, parents before children, nodes in depth order), and q: None, the drafts
    being the drafter's top ranks (deterministic: one-hot q, whatever the sampling).
    """
    batch, vocab = first.shape
    check_positive("depth", depth)
    check_positive("top_k", top_k)
    if top_k > vocab:
        raise ValueError(f"top_k={top_k} exceeds the draft vocabulary of {vocab} tokens")
    pool = top_k + (depth - 1) * top_k * top_k
    if not 1 <= nodes <= pool:
        raise ValueError(f"nodes={nodes} must be from 1 to the {pool} candidates that depth="
                         f"{depth} and top_k={top_k} draft")
    device = first.device
    scores, tokens = first.topk(top_k, dim=-1)  # depth 1: (B, k)
    layer = torch.arange(1, top_k + 1, device=device).expand(batch, top_k)  # pool numbers
    fed_parents = torch.zeros(batch, top_k, dtype=torch.long, device=device)
    all_scores, all_tokens = [scores], [tokens]
    all_parents = [torch.zeros(batch, top_k, dtype=torch.long, device=device)]
    size, fed = top_k, 0  # candidates so far; nodes fed so far
    for d in range(1, depth):
        logp = expand(tokens, fed_parents, d)  # (B, k, N): children of this depth's k nodes
        child_scores, child_tokens = logp.topk(top_k, dim=-1)  # (B, k, k)
        cumulative = (scores[..., None] + child_scores).flatten(1)  # (B, k * k)
        all_scores.append(cumulative)
        all_tokens.append(child_tokens.flatten(1))
        all_parents.append(layer.repeat_interleave(top_k, dim=1))
        scores, best = cumulative.topk(top_k, dim=-1)  # the next depth's k nodes
        tokens = child_tokens.flatten(1).gather(1, best)
        fed_parents = fed + 1 + best // top_k  # the fed numbers of their parents
        layer = size + 1 + best
        size, fed = size + top_k * top_k, fed + top_k
    scores, tokens = torch.cat(all_scores, dim=1), torch.cat(all_tokens, dim=1)  # (B, pool)
    parents = torch.cat(all_parents, dim=1)  # pool numbers, 0: the root
    order = scores.sort(dim=1, descending=True, stable=True).indices  # ties: earlier first
    kept = order[:, :nodes].sort(dim=1).values  # pool order: depth order, parents first
    where = torch.zeros(batch, pool + 1, dtype=torch.long, device=device)  # pool -> kept
    where.scatter_(1, kept + 1, torch.arange(1, nodes + 1, device=device).expand(batch, nodes))
    return tokens.gather(1, kept), where.gather(1, parents.gather(1, kept)), None


__all__ = ["Eagle", "EagleConfig", "EagleDrafter", "EagleOptions", "check_layers", "check_map",
           "default_layers", "dynamic_tree", "engine_layers"]
