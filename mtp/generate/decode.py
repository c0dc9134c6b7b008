"""`generate`: prompts in, continuations out, by autoregressive or self-speculative decoding.

- Prompts: training packs documents into one stream, each document followed by EOS, so a
  document starts right after an EOS. A prompt is therefore encoded as [EOS] + its tokens:
  the model continues the start of a new document. There is no BOS.
- Batches: prompts of different lengths are right-padded and prefilled together, then the
  cache rolls back to each prompt's own length; every sequence then accepts its own number
  of tokens per step. A finished sequence leaves the batch (its cache rows are dropped), so
  it costs nothing afterwards.
- The context limit: a sequence holds at most `max_seq_len` tokens, the EOS and the prompt
  included. One that reaches it stops with finish_reason "context"; a prompt that leaves no
  room is a ValueError.
- k = 1 runs `autoregressive_decode`, the baseline every speedup is measured against: one
  forward pass of the trunk and head 0 per token on the cache, one host synchronisation per
  token (the stopping rules need the token). k > 1 runs `speculative_decode`, whose loop is
  the `draft`, `verify`, `accept` steps of `speculative.py`, with heads 0..k-1 run as one
  batched block (`StackedHeads`): a verify forward pays one block's per-op overhead for the
  heads, not k blocks'. It still reads k heads' weights, which bounds its cost at batch 1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from mtp.generate.acceptance import ACCEPTANCE, TypicalAcceptance, accept
from mtp.generate.output import Generation, SequenceOutput, TextCallback
from mtp.generate.sampling import SamplingConfig, probabilities, sample
from mtp.generate.speculative import draft, hidden_states, verify
from mtp.generate.stacked_heads import StackedHeads, stacked_heads
from mtp.generate.tree import Tree, resolve_tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


def generate(model: MTPModel, tokenizer: Tokenizer, prompts: list[str], *,
             max_new_tokens: int = 256, k: int | None = None,
             sampling: SamplingConfig = SamplingConfig(), stop: Sequence[str] | str = (),
             seed: int | None = None, on_text: TextCallback | None = None,
             tree: Tree | str | Sequence[Sequence[int]] | None = None,
             acceptance: str = "exact",
             typical: TypicalAcceptance = TypicalAcceptance()) -> list[Generation]:
    """Continue each prompt; one `Generation` per prompt, in order.

    Args:
        k: heads used at most: heads 1..k-1 draft, head 0 verifies. None uses every head
            (model.config.n_future); 1 is plain autoregressive decoding. Without a tree,
            the chain of k - 1 drafts (k tokens per forward pass at most).
        tree: verify a candidate tree of the heads' top-k instead of the chain (`tree.py`):
            "chain", "tree8", "tree16", "tree32", "tree64", a list of rank paths, a `Tree`
            (e.g. from `Calibration.load(...)` for "auto:N"), or a .json file of rank paths.
            Presets fit within k heads; a tree deeper than k - 1 is a ValueError.
        acceptance: "exact" (lossless; greedy equals autoregressive) or "typical" (Medusa's
            typical acceptance with `typical`'s thresholds; not lossless when sampling).
        sampling: temperature (0: greedy), top-k and top-p of head 0's distribution. Greedy
            output is identical for every k; sampled output has the same distribution.
        stop: strings that end a generation; the returned text stops before them.
        seed: seeds this call's random draws (None: torch's global generator).
        on_text: called as on_text(prompt_index, text) with each new piece of text.
    """
    config = model.config
    k = config.n_future if k is None else k
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    _check_arguments(config.n_future, config.vocab_size, tokenizer, prompts, max_new_tokens, k,
                     sampling, stop)
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE}, got {acceptance!r}")
    if tree is None:
        tree = Tree.chain(k - 1)
    tree = resolve_tree(tree, n_heads=k, vocab_size=config.vocab_size)
    encoded = [[tokenizer.eos_id, *ids] for ids in tokenizer.encode_batch(prompts)]
    for index, ids in enumerate(encoded):
        if len(ids) >= config.max_seq_len:
            raise ValueError(
                f"prompt {index} is {len(ids)} tokens (with the EOS that starts a document), "
                f"which leaves no room in the model's context of max_seq_len="
                f"{config.max_seq_len} tokens")

    started = time.perf_counter()
    outputs = []
    for index, ids in enumerate(encoded):
        room = config.max_seq_len - len(ids)
        outputs.append(SequenceOutput(
            index, tokenizer, budget=min(max_new_tokens, room),
            budget_reason="length" if max_new_tokens <= room else "context", stop=stop,
            n_heads=tree.depth + 1, on_text=on_text, started=started))
    param = next(model.parameters())
    max_len = min(config.max_seq_len, max(map(len, encoded)) + max_new_tokens + tree.n_nodes)
    cache = KVCache(config, len(encoded), max_len, device=param.device, dtype=param.dtype)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=param.device).manual_seed(seed)
    with torch.inference_mode():
        if tree.n_nodes == 1:
            autoregressive_decode(model, cache, encoded, outputs, sampling, generator,
                                  pad_id=tokenizer.pad_id)
        else:
            speculative_decode(model, cache, encoded, outputs, tree, sampling, generator,
                               pad_id=tokenizer.pad_id, acceptance=acceptance, typical=typical)
    return [output.result() for output in outputs]


def prefill(model: MTPModel, cache: KVCache, prompts: list[list[int]],
            heads: int | StackedHeads, pad_id: int) -> Tensor:
    """Cache the prompts in the trunk and heads 0..n-1: hidden states (B, n, D).

    The heads' outputs (before the shared norm and unembedding) at each prompt's last token;
    `heads` as in `hidden_states`.
    """
    lengths = [len(ids) for ids in prompts]
    tokens = torch.full((len(prompts), max(lengths)), pad_id, dtype=torch.long)
    for row, ids in enumerate(prompts):
        tokens[row, :len(ids)] = torch.tensor(ids)
    hidden = hidden_states(model, cache, tokens.to(cache.keys.device), heads)  # (B, T, n, D)
    cache.rollback(lengths)  # right padding: each prompt keeps its own length
    rows = torch.arange(len(prompts), device=hidden.device)
    return hidden[rows, torch.tensor(lengths, device=hidden.device) - 1]


def autoregressive_decode(model: MTPModel, cache: KVCache, prompts: list[list[int]],
                          outputs: list[SequenceOutput], sampling: SamplingConfig,
                          generator: torch.Generator | None, *, pad_id: int) -> None:
    """Head 0 alone, one token per forward pass, on an empty `cache`; fills `outputs`."""
    logits = model.unembed(prefill(model, cache, prompts, 1, pad_id)[:, 0])  # (B, V)
    live = list(range(len(prompts)))
    while True:
        token = sample(probabilities(logits, sampling), generator)  # (B,)
        ids = token.tolist()
        keep = _commit(cache, outputs, live, [[t] for t in ids], [0] * len(ids))
        if not keep:
            return
        if len(keep) < len(ids):
            token = token[keep]
        logits = model.unembed(hidden_states(model, cache, token[:, None], 1)[:, 0, 0])


def speculative_decode(model: MTPModel, cache: KVCache, prompts: list[list[int]],
                       outputs: list[SequenceOutput], tree: Tree, sampling: SamplingConfig,
                       generator: torch.Generator | None, *, pad_id: int,
                       acceptance: str = "exact",
                       typical: TypicalAcceptance = TypicalAcceptance()) -> None:
    """Draft `tree` with heads 1..depth, verify with head 0, accept; on an empty `cache`.

    The cache holds every accepted token but the last; `pending` is that last token (the
    tree's root) and the drafts after it (see the worked example in `speculative.py`).
    """
    heads = stacked_heads(model, tree.depth + 1)  # one batched block per head layer
    last = prefill(model, cache, prompts, heads, pad_id)  # (B, n, D): last position
    tokens = sample(probabilities(model.unembed(last[:, 0]), sampling), generator)[:, None]
    n_accepted = node = torch.zeros(len(prompts), dtype=torch.long, device=tokens.device)
    step = None  # the tree of the last forward pass (the prefill verified only a root)
    live = list(range(len(prompts)))
    while True:
        drafts = draft(model.unembed(last[:, 1:]), tree, sampling, generator)
        root = tokens.gather(1, n_accepted[:, None])  # (B, 1)
        host = torch.cat([n_accepted[:, None], node[:, None], tokens], dim=1).tolist()  # sync
        keep = _commit(cache, outputs, live, [row[2:] for row in host],
                       [row[0] for row in host], [row[1] for row in host], step)
        if not keep:
            return
        if len(keep) < len(host):
            rows = torch.tensor(keep, device=root.device)
            root, drafts = root[rows], drafts[rows]
        step = tree.first(cache.max_len - max(cache.lengths))  # smaller near the cache's end
        target, hidden = verify(model, cache, torch.cat([root, drafts.first(
            step.n_nodes - 1).tokens], dim=1), heads, step)  # (B, m, V), (B, m, n, D)
        result = accept(drafts.first(step.n_nodes - 1), target, step, sampling, generator,
                        acceptance=acceptance, typical=typical)
        n_accepted, node, tokens = result.n_accepted, result.node, result.tokens
        last = hidden[torch.arange(len(keep), device=hidden.device), node]  # (B, n, D)


def _commit(cache: KVCache, outputs: list[SequenceOutput], live: list[int],
            tokens: list[list[int]], n_accepted: list[int], nodes: list[int] | None = None,
            tree: Tree | None = None) -> list[int]:
    """Give each live sequence its new tokens and drop the finished ones from the batch.

    After a forward pass over `tree`'s nodes (None: one token per sequence, nothing to
    undo), sequence b accepted the path to nodes[b], n_accepted[b] drafts, and one token of
    head 0 after them: tokens[b][:n_accepted[b] + 1]. The cache keeps the root and that
    path. `live` maps batch rows to outputs and is updated; returns the rows kept.
    """
    if tree is not None:
        cache.compact([tree.ancestors[node] for node in nodes])
    keep = []
    for row, (index, ids, n) in enumerate(zip(live, tokens, n_accepted)):
        output = outputs[index]
        if tree is None:
            output.count_forward(0, 0, nodes=1)
        else:  # the depth after the accepted node was verified iff it has children
            output.count_forward(n + tree.has_children[nodes[row]], n, nodes=tree.n_nodes)
        if not output.add(ids[:n + 1]):
            keep.append(row)
    if len(keep) < len(live):
        live[:] = [live[row] for row in keep]
        if keep:
            cache.keep(keep)
    return keep


def _check_arguments(n_future: int, vocab_size: int, tokenizer: Tokenizer, prompts: list[str],
                     max_new_tokens: int, k: int, sampling: SamplingConfig,
                     stop: tuple[str, ...]) -> None:
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"the tokenizer ({tokenizer!r}) has {tokenizer.vocab_size} tokens but "
                         f"the model's vocab_size is {vocab_size}: they do not belong together")
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r:.80}")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt {index} must be a non-empty string, got {prompt!r:.80}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n_future:
        raise ValueError(f"k must be an integer from 1 to n_future={n_future}, got {k!r}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {sampling!r}")
    for string in stop:
        if not isinstance(string, str) or not string:
            raise ValueError(f"stop strings must be non-empty strings, got {string!r}")
