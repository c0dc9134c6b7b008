"""The decode step: verify the drafts of every row, accept a path, compact the cache.

One `Engine` serves one `generate` call. Its state lives on the device: the KV cache;
`lengths` (B,), the tokens each row has cached (every accepted token but the last); `root`
(B,), each row's last accepted token; `active` (B,), the rows still decoding. A step
(`verify_and_accept`) runs one forward pass over pending = [root, drafts] (m tokens), each
token at its place in the tree (`kv_cache.cache_step`); the shared rule
(`acceptance.accept`) keeps a path and draws the next token; a tree's kept path moves to the
slots after the prefix. Then one small host read serves streaming and stopping.

Example, a chain of three drafts: the cache holds x_0..x_8, pending is [x_9, d_1, d_2, d_3]
at positions 9..12. If d_1, d_2 are kept and d_3 rejected, the new tokens are d_1, d_2 and
the correction c drawn at pending 2; lengths becomes 12, the root c, and the heads at
pending 2 (the kept node) propose the next drafts.

Compiled, the step is captured once per shape (a CUDA graph on a GPU), so it verifies the
whole tree, padding included, with its random numbers drawn before it (`acceptance.Draws`).
Eagerly, the reference, attention spans the cache up to the longest row and a chain is cut
to the batch's longest real proposal (`Engine.verified_tree`).

Exact mode (`exact=True`, docs/decoding.md): on the CPU kernels the plain step is already
exact. Off them it fixes the shapes (`windowed`): every step `width` tokens wide (the tree
padded, `Tree.padded`), a fixed batch and key length, head 0 run alone
(`StackedHeads(head0_alone)`), attention over each token's window in position order; the
reference is then `generate(drafter=None, exact=True, width=W)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from mtp.decode.acceptance import AcceptanceSettings, Draws, accept
from mtp.decode.drafters.base import Drafts, Verified
from mtp.decode.forward import (StackedHeads, hidden_states, key_width, padded, prefill,
                                  stacked_heads)
from mtp.decode.sampling import (exponential, inverse_cdf, position_uniforms, probabilities,
                                 sample)
from mtp.decode.tree import DynamicTree, Tree, TreeBuffers
from mtp.kv_cache import KVCache, cache_step
from mtp.model import MTPModel, decodes_on_kernels, use_kernels

CONTEXT_BLOCK = 256  # compiled: cache lengths are rounded up to this, so calls share graphs
MAX_SHAPES = 32  # compiled step shapes before compile=True refuses another
# Run the verify forward's heads as one batched block per head layer (`StackedHeads`) rather
# than one by one; scripts/bench_decode.py unstacked_heads=true measures what it buys.
STACK_HEADS = True
# Attention kernels for decoding on a GPU. A decode step's boolean mask rules out flash
# attention; memory-efficient attention takes it at any key length without planning, whereas
# cuDNN attention builds a plan for every new key length (on an H100 in bfloat16: 14 ms of
# CPU per call, a decode 12x slower than float32), so it is left out.
DECODE_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def attention_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels decoding allows on `device` (see DECODE_ATTENTION)."""
    return sdpa_kernel(DECODE_ATTENTION) if device.type == "cuda" else contextlib.nullcontext()


def verify_and_accept(model: MTPModel, cache: KVCache, lengths: Tensor, root: Tensor,
                      active: Tensor, drafts: Drafts, draws: Draws | None, tree: Tree,
                      buffers: TreeBuffers, heads: int | StackedHeads,
                      acceptance: AcceptanceSettings, key_len: int, windowed: bool = False,
                      layers: tuple[int, ...] = ()) -> Verified:
    """One decode step on the device (module docstring): verify `drafts`, the nodes of `tree`;
    updates the cache, `lengths` and `root` in place (active rows only)."""
    # verify: each token at its place in the tree (each row's own for a dynamic tree)
    pending = torch.cat([root[:, None], drafts.tokens], dim=1)  # (B, m)
    if drafts.parents is not None:
        buffers = TreeBuffers.from_parents(drafts.parents, tree.depth, tree.branching)
    step = cache_step(lengths, buffers.depths, buffers.visible, key_len,
                      model.config.max_seq_len, window=tree.n_nodes if windowed else None,
                      ancestors=buffers.ancestors, dtype=cache.keys.dtype)
    hidden, features = hidden_states(model, pending, cache, step, heads, layers=layers)
    target = model.unembed(hidden[:, :, 0])  # (B, m, V); hidden (B, m, n, D)
    # accept: a path, and the token after it
    accepted = accept(drafts, target, tree, acceptance, draws, buffers=buffers)
    rows = torch.arange(pending.shape[0], device=pending.device)
    path = buffers.ancestors[rows, accepted.node]  # (B, depth + 1), padded with the node
    # compact: the kept path's keys and values follow the prefix (a chain's are in place)
    if not tree.is_chain:
        cache.compact(lengths, path)
    kept = torch.where(active, accepted.n_accepted + 1, 0)
    new_root = accepted.tokens.gather(1, accepted.n_accepted[:, None])[:, 0]
    lengths.add_(kept)
    root.copy_(torch.where(active, new_root, root))
    last = torch.where(active, accepted.node, 0)  # a finished row's: path[0], as kept is 0
    children = buffers.parents == last[:, None]  # (B, m - 1): the kept node's children
    if drafts.lengths is not None:  # real ones only: padding drafts are never verified
        children &= torch.arange(children.shape[1],
                                 device=children.device) < drafts.lengths[:, None]
    return Verified(pending, hidden, target.argmax(-1), path, kept, accepted.tokens, last=last,
                    features=features, grows=children.any(-1))


def rebuild_size(live: int, batch: int, compiled: bool, windowed: bool = False) -> int | None:
    """The batch to rebuild to when `live` of `batch` rows are decoding, or None to stay:
    eagerly, the live rows; compiled, the smaller power of two that holds them (few captured
    shapes); in windowed exact mode never (a row's products depend on the rows beside it)."""
    if live == batch or windowed:
        return None
    if not compiled:
        return live
    size = 1 << (live - 1).bit_length()
    return size if size < batch else None


class Engine:
    """The cache, device state and step of one `generate` call (module docstring): rows of
    at most `context` tokens; the verify forward runs heads 0..k-1 and keeps the output of
    trunk `layers`; exact mode draws from `seed`'s position uniforms and, off the kernels,
    makes every step `width` tokens wide (default: the tree's)."""

    def __init__(self, model: MTPModel, batch: int, context: int, tree: Tree, k: int, *,
                 acceptance: AcceptanceSettings, compile: bool = False,
                 width: int | None = None, seed: int = 0, layers: tuple[int, ...] = ()) -> None:
        use_kernels(model)  # as chosen for the model, else on where the kernels run
        self.on_kernels = decodes_on_kernels(model) and not compile  # (the ops run eagerly)
        self.acceptance = acceptance
        self.sampling, self.exact = acceptance.sampling, acceptance.exact
        self.windowed = self.exact and not self.on_kernels
        if self.windowed:
            tree = tree.padded(width or tree.n_nodes)
        self.model, self.tree = model, tree
        self.compiled, self.seed, self.layers = compile, seed, layers
        param = next(model.parameters())
        self.device = param.device
        self.k = k  # in a compiled shape's key: a stack is a new object per k change
        # On the kernels heads run one by one: each streams its weights once for all rows
        # already, and head 0 then computes as a one-head forward does.
        self.heads: int | StackedHeads = stacked_heads(model, k, head0_alone=self.windowed) \
            if STACK_HEADS and k > 1 and not self.on_kernels else k
        if compile:  # calls of similar lengths share one cache length, hence one graph
            context = min(model.config.max_seq_len, -(-context // CONTEXT_BLOCK) * CONTEXT_BLOCK)
        # Slack for the last step's drafts past the context, and for finished rows' (ignored)
        # writes. Blocks: the trunk's and heads 0..k-1's (a sequential model's modules are
        # their drafter's to cache).
        config = model.config
        blocks = range(config.n_layers + min(k, config.block_heads) * config.head_layers)
        self.cache = KVCache(config, batch, context + 2 * tree.n_nodes, device=self.device,
                             dtype=param.dtype, blocks=blocks)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.root = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.active = torch.ones(batch, dtype=torch.bool, device=self.device)
        self.host_lengths = [0] * batch  # mirrors of lengths and active, kept from the reads
        self.host_active = [True] * batch
        self.sequences = list(range(batch))  # each row's prompt: its position uniforms' key
        self._rows: dict[tuple[int, int], TreeBuffers] = {}  # trees' buffers, by (nodes, batch)
        self._step = compiled_step(self.device.type == "cuda") if compile else None
        self._mark_static()

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    def prefill(self, prompts: list[list[int]], generator: torch.Generator | None,
                pad_id: int) -> Verified:
        """Cache the prompts and draw each row's first token: the prefill verifies the
        prompts and keeps them whole (see `Verified`)."""
        pending = padded(prompts, pad_id, self.device)  # (B, T)
        with attention_kernels(self.device):
            lengths, hidden, features = prefill(self.model, self.cache, prompts, self.heads,
                                                pad_id, self.layers)
        self.lengths.copy_(lengths)
        self.host_lengths = [len(ids) for ids in prompts]
        rows = torch.arange(len(prompts), device=self.device)
        last = hidden[rows, lengths - 1, 0]  # (B, D): head 0 at each prompt's last token
        probs = probabilities(self.model.unembed(last), self.sampling)  # (B, V)
        if self.sampling.greedy:
            self.root.copy_(probs.argmax(-1))
        elif self.exact:  # the first new token sits at position len(prompt)
            uniform = position_uniforms(self.seed, range(len(prompts)),
                                        [[len(ids)] for ids in prompts], self.device)
            self.root.copy_(inverse_cdf(probs, uniform[:, 0]))
        else:
            self.root.copy_(sample(probs, exponential(probs.shape, generator, self.device)))
        tokens = pending.roll(-1, dims=1)  # the token after each prompt token
        tokens[rows, lengths - 1] = self.root
        path = torch.arange(pending.shape[1], device=self.device).expand_as(pending)
        return Verified(pending, hidden, None, path, lengths, tokens,
                        [[token] for token in self.root.tolist()], last=lengths - 1,
                        features=features)

    def verify_and_accept(self, drafts: Drafts, generator: torch.Generator | None
                          ) -> tuple[Verified, list[tuple[int, int]]]:
        """Verify, accept and compact (`verify_and_accept`), then the step's one host read: what
        was kept, and each row's (real drafts, whether its kept node has children)."""
        if self.windowed:
            drafts = drafts.padded(self.tree.n_nodes - 1)
        draws = None
        if self.exact and not self.sampling.greedy:  # the uniform of each node's next token
            draws = Draws(position_uniforms(
                self.seed, self.sequences,
                [[length + depth + 1 for depth in depths] for length, depths in
                 zip(self.host_lengths, self.node_depths(drafts))], self.device))
        elif not self.sampling.greedy:  # every node's, even when cut: one seed, one output
            draws = Draws.draw(self.batch, self.tree.n_nodes, self.model.config.vocab_size,
                               generator, self.device)
        tree, buffers = self.verified_tree(drafts)
        if tree is not self.tree:  # eagerly, a chain's padding is cut
            width = tree.n_nodes - 1
            drafts = replace(drafts, tokens=drafts.tokens[:, :width],
                             probs=None if drafts.probs is None else drafts.probs[:, :width])
            if draws is not None:  # one per draft; exact mode's one per node
                draws = replace(draws, uniform=draws.uniform[:, :width + self.exact])
        key_len = key_width(max(self.host_lengths) + tree.n_nodes, self.cache.max_len,
                            self.compiled or self.windowed)
        step = verify_and_accept
        if self._step is not None:
            self._step.note((self.model.config, self.cache.keys.dtype, self.batch, self.tree.paths,
                             key_len, self.k, self.acceptance, drafts.probs is None,
                             self.windowed, self.layers))
            step = self._step.function
            if self.device.type == "cuda":  # the last step's outputs may now be overwritten
                torch.compiler.cudagraph_mark_step_begin()
        with attention_kernels(self.device):
            out = step(self.model, self.cache, self.lengths, self.root, self.active, drafts,
                       draws, tree, buffers, self.heads, self.acceptance, key_len,
                       self.windowed, self.layers)
        # Every draft is real unless the drafter says how many of each row's are (`lengths`).
        real = out.kept.new_full(out.kept.shape, drafts.tokens.shape[1]) \
            if drafts.lengths is None else drafts.lengths
        host = torch.cat([out.kept[:, None], out.grows[:, None], real[:, None], out.tokens],
                         dim=1).tolist()  # the one synchronisation (eagerly, with `verified_tree`)
        new_ids, drafted = [], []
        for row, (kept, grows, n_real, *tokens) in enumerate(host):
            new_ids.append(tokens[:kept])  # none for a finished row
            drafted.append((n_real, bool(grows)))
            self.host_lengths[row] += kept
        return replace(out, new_ids=new_ids), drafted

    def node_depths(self, drafts: Drafts) -> list[list[int]]:
        """Each row's nodes' depths, on the host: the tree's, or the step's own (a dynamic
        tree's, from `drafts.parents`)."""
        if drafts.parents is None:
            return [self.tree.depths] * self.batch
        return TreeBuffers.from_parents(drafts.parents, self.tree.depth, 1).depths.tolist()

    def verified_tree(self, drafts: Drafts) -> tuple[Tree, TreeBuffers | None]:
        """The tree a step verifies, with its buffers per row (None: a dynamic tree's): the
        drafter's, or eagerly, for a padded chain, the batch's longest real proposal's."""
        tree = self.tree
        if isinstance(tree, DynamicTree):
            if drafts.parents is None:
                raise ValueError(f"{tree.name}: a dynamic tree's drafter must give each "
                                 f"draft's parent (Drafts.parents)")
            return tree, None
        if not (self.compiled or self.windowed or not tree.is_chain or drafts.lengths is None):
            longest = int(drafts.lengths.max())  # a host read: eager steps only
            if longest < drafts.count:
                tree = Tree.chain(longest)  # one instance per width
        key = (tree.n_nodes, self.batch)
        if key not in self._rows:  # built once, outside any compiled step: a view per batch
            self._rows[key] = tree.buffers(self.device).rows(self.batch)
        return tree, self._rows[key]

    def finish(self, rows: list[int]) -> None:
        """Stop decoding `rows`: they stay in the batch, masked."""
        for row in rows:
            self.host_active[row] = False
        self.active.copy_(torch.tensor(self.host_active, device=self.device))

    def keep(self, rows: list[int]) -> None:
        """Keep only the batch `rows`, in that order (a new, smaller batch)."""
        index = torch.tensor(rows, device=self.device)
        self.cache.keep(index)
        self.lengths, self.root, self.active = (t.index_select(0, index) for t in
                                                (self.lengths, self.root, self.active))
        self.host_lengths = [self.host_lengths[row] for row in rows]
        self.host_active = [self.host_active[row] for row in rows]
        self.sequences = [self.sequences[row] for row in rows]
        self._mark_static()

    def _mark_static(self) -> None:
        """A CUDA graph updates the cache, lengths and roots in place: fixed addresses."""
        if self.compiled and self.device.type == "cuda":
            for tensor in (self.cache.keys, self.cache.values, self.lengths, self.root,
                           self.active):
                torch._dynamo.mark_static_address(tensor)


class CompiledStep:
    """`verify_and_accept` compiled (CUDA graphs on a GPU), and the shapes it was compiled
    for (each on first use; `note` bounds how many)."""

    def __init__(self, function: Callable[..., Verified]) -> None:
        self.function = function
        self.shapes: set[tuple] = set()

    def note(self, shape: tuple) -> None:
        """Count a shape; a ValueError past MAX_SHAPES of them, rather than compiling without
        end (or silently eager past torch.compile's own limit)."""
        if shape not in self.shapes and len(self.shapes) >= MAX_SHAPES:
            raise ValueError(
                f"compile=True: the decode step was compiled for {len(self.shapes)} shapes "
                f"(models, batch sizes, drafter trees, cache lengths, ...), the most allowed "
                f"(engine.MAX_SHAPES); decode with fewer distinct batch sizes and lengths, or "
                f"with compile=False")
        self.shapes.add(shape)


# On a GPU or not -> the compiled step: torch.compile keeps its variants with the function's
# code, so the step is compiled, and its shapes counted, once per process.
_compiled: dict[bool, CompiledStep] = {}


def compiled_step(cuda: bool) -> CompiledStep:
    """The decode step compiled for a GPU (`cuda`: CUDA graphs) or a CPU, built on first use."""
    if cuda not in _compiled:
        check_compile_support("cuda" if cuda else "cpu")
        # Every shape is a compiled variant of the one function: allow MAX_SHAPES of them.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   MAX_SHAPES)
        _compiled[cuda] = CompiledStep(torch.compile(
            verify_and_accept, fullgraph=True, dynamic=False,
            mode="reduce-overhead" if cuda else None))
    return _compiled[cuda]


def check_compile_support(device: str) -> None:
    """A one-line ValueError when this torch cannot compile the decode step on `device`
    (TorchDynamo, and Triton on a GPU or a C++ compiler on a CPU)."""
    problem = None
    if not torch._dynamo.is_dynamo_supported():
        problem = "torch.compile is not supported by this Python/platform"
    elif device == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            problem = "Triton, which torch.compile needs for GPU kernels, is not installed"
    else:
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as error:  # noqa: BLE001 (whatever inductor's lookup raises)
            problem = f"torch.compile found no C++ compiler for CPU kernels ({error})"
    if problem:
        raise ValueError(f"compile=True: {problem} (torch {torch.__version__}); decode with "
                         f"compile=False")
