"""`generate`: prompts in, continuations out, by autoregressive or speculative decoding.

- Prompts: training packs documents into one stream, each document followed by EOS, so a
  document starts right after an EOS. A prompt is therefore encoded as [EOS] + its tokens:
  the model continues the start of a new document. (`tokenizer.document_start_id`: models
  imported from elsewhere, e.g. Llama, start documents with BOS instead.)
- Batches: prompts of different lengths are right-padded and prefilled together, then the
  cache rolls back to each prompt's own length; every sequence then accepts its own number
  of tokens per step. A finished sequence leaves the batch (its cache rows are dropped), so
  it costs nothing afterwards.
- The context limit: a sequence holds at most `max_seq_len` tokens, the EOS and the prompt
  included. One that reaches it stops with finish_reason "context"; a prompt that leaves no
  room is a ValueError.
- No drafter (k = 1, drafter="autoregressive") runs `autoregressive_decode`, the baseline
  every speedup is measured against: one forward pass of the trunk and head 0 per token on
  the cache, one host synchronisation per token (the stopping rules need the token). Any
  drafter runs `speculative_decode`, whose loop is the propose, `verify`, `accept` steps:
  the drafter (`drafter.py`: the model's heads, a draft model, prompt lookup, or several)
  proposes, the target verifies in one forward pass, the shared acceptance rule keeps a
  prefix, and the drafter is told what was kept. With the heads as drafter, heads 0..k-1 run
  as one batched block (`StackedHeads`): a verify forward pays one block's per-op overhead
  for the heads, not k blocks'. It still reads k heads' weights, which bounds its cost at
  batch 1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from mtp.generate.auto import Auto
from mtp.generate.drafter import Drafter, Verified
from mtp.generate.names import resolve_drafter
from mtp.generate.output import Generation, SequenceOutput, TextCallback
from mtp.generate.sampling import SamplingConfig, probabilities, sample
from mtp.generate.acceptance import ACCEPTANCE, TypicalAcceptance, accept
from mtp.generate.speculative import hidden_states, prefill, verify
from mtp.generate.tree import Tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


def generate(model: MTPModel, tokenizer: Tokenizer, prompts: list[str], *,
             max_new_tokens: int = 256, k: int | str | None = None,
             drafter: Drafter | Auto | str | None = None,
             sampling: SamplingConfig = SamplingConfig(), stop: Sequence[str] | str = (),
             seed: int | None = None, on_text: TextCallback | None = None,
             tree: Tree | str | Sequence[Sequence[int]] | None = None,
             acceptance: str = "exact",
             typical: TypicalAcceptance = TypicalAcceptance()) -> list[Generation]:
    """Continue each prompt; one `Generation` per prompt, in order.

    Args:
        k: the heads drafter's tokens per forward pass at most: heads 1..k-1 draft, head 0
            verifies. None uses every head (model.config.n_future); 1 is plain autoregressive
            decoding; "auto" measures k = 1..n_future on the first steps and keeps the fastest.
        drafter: who proposes the drafts: None or "heads" (the model's heads, with k), a
            `Drafter` (`HeadsDrafter`, `DraftModel`, `PromptLookup`, `Lookahead`, `Combined`), a
            name ("autoregressive", "heads", "prompt_lookup", "heads+prompt_lookup",
            "lookahead", "auto"), or
            `Auto(...)`, which measures candidate drafters and keeps the fastest.
        tree: the heads drafter verifies this candidate tree of the heads' top-k instead of
            the chain (`tree.py`): "chain", "tree8", "tree16", "tree32", "tree64", a list of
            rank paths, a .json file of them, or a `Tree` (e.g. `Calibration.load(...)` for
            "auto:N"). Presets fit within k heads; a deeper tree is a ValueError.
        acceptance: "exact" (lossless; greedy equals autoregressive) or "typical" (Medusa's
            typical acceptance with `typical`'s thresholds; not lossless when sampling).
        sampling: temperature (0: greedy), top-k and top-p of head 0's distribution. Greedy
            output is identical for every drafter; sampled output has the same distribution.
        stop: strings that end a generation; the returned text stops before them.
        seed: seeds this call's random draws (None: torch's global generator).
        on_text: called as on_text(prompt_index, text) with each new piece of text.
    """
    config = model.config
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    _check_arguments(config.vocab_size, tokenizer, prompts, max_new_tokens, sampling, stop)
    if acceptance not in ACCEPTANCE:
        raise ValueError(f"acceptance must be one of {ACCEPTANCE}, got {acceptance!r}")
    chosen = resolve_drafter(model, drafter, k, tree)
    if isinstance(chosen, Drafter):
        chosen.check(model, tokenizer)
    encoded = [[tokenizer.document_start_id, *ids] for ids in tokenizer.encode_batch(prompts)]
    for index, ids in enumerate(encoded):
        if len(ids) >= config.max_seq_len:
            raise ValueError(
                f"prompt {index} is {len(ids)} tokens (with the token that starts a document), "
                f"which leaves no room in the model's context of max_seq_len="
                f"{config.max_seq_len} tokens")
    if isinstance(chosen, Auto):  # measures its candidates with generate() on these prompts
        chosen = chosen.choose(model, tokenizer, prompts, sampling=sampling,
                               max_new_tokens=max_new_tokens)

    param = next(model.parameters())
    width = 1 if chosen is None else chosen.max_drafts + 1  # tokens per forward at most
    depth = 0 if chosen is None else chosen.max_depth  # drafts one forward may accept
    started = time.perf_counter()
    outputs = []
    for index, ids in enumerate(encoded):
        room = config.max_seq_len - len(ids)
        outputs.append(SequenceOutput(
            index, tokenizer, budget=min(max_new_tokens, room),
            budget_reason="length" if max_new_tokens <= room else "context", stop=stop,
            n_heads=depth + 1, on_text=on_text, started=started))
    max_len = min(config.max_seq_len, max(map(len, encoded)) + max_new_tokens + width)
    cache = KVCache(config, len(encoded), max_len, device=param.device, dtype=param.dtype)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=param.device).manual_seed(seed)
    with torch.inference_mode():
        if chosen is None:
            autoregressive_decode(model, cache, encoded, outputs, sampling, generator,
                                  pad_id=tokenizer.pad_id)
        else:
            chosen.start(model, encoded, max_len, sampling, generator)
            speculative_decode(model, cache, encoded, outputs, chosen, sampling, generator,
                               pad_id=tokenizer.pad_id, acceptance=acceptance, typical=typical)
    return [output.result() for output in outputs]


def autoregressive_decode(model: MTPModel, cache: KVCache, prompts: list[list[int]],
                          outputs: list[SequenceOutput], sampling: SamplingConfig,
                          generator: torch.Generator | None, *, pad_id: int) -> None:
    """Head 0 alone, one token per forward pass, on an empty `cache`; fills `outputs`."""
    logits = model.unembed(prefill(model, cache, prompts, 1, pad_id)[:, 0])  # (B, V)
    live = list(range(len(prompts)))
    while True:
        token = sample(probabilities(logits, sampling), generator)  # (B,)
        ids = token.tolist()
        keep = _commit(cache, outputs, live, [[t] for t in ids], [0] * len(ids), 1)
        if not keep:
            return
        if len(keep) < len(ids):
            token = token[keep]
        logits = model.unembed(hidden_states(model, cache, token[:, None], 1)[:, 0, 0])


def speculative_decode(model: MTPModel, cache: KVCache, prompts: list[list[int]],
                       outputs: list[SequenceOutput], drafter: Drafter,
                       sampling: SamplingConfig, generator: torch.Generator | None, *,
                       pad_id: int, acceptance: str = "exact",
                       typical: TypicalAcceptance = TypicalAcceptance()) -> None:
    """Propose with `drafter`, verify with head 0, accept; on an empty `cache`.

    The cache holds every accepted token but the last; `pending` is that last token and the
    drafts after it (see the worked example in `speculative.py`). The prefill counts as a
    step that verified the prompt's last token.
    """
    heads = drafter.verify_heads(model)  # an int, or the heads drafter's StackedHeads
    last = prefill(model, cache, prompts, heads, pad_id)  # (B, n, D): last prompt position
    hidden = last[:, None]  # (B, 1, n, D)
    pending = torch.tensor([ids[-1:] for ids in prompts], device=last.device)  # (B, 1)
    tokens = sample(probabilities(model.unembed(last[:, 0]), sampling), generator)[:, None]
    n_accepted = node = torch.zeros(len(prompts), dtype=torch.long, device=tokens.device)
    n_drafts = [0] * len(prompts)  # real drafts each row had verified in the last forward
    tree = target = None  # the last forward's tree (when the drafts were one) and logits
    live = list(range(len(prompts)))
    while True:
        host = torch.cat([n_accepted[:, None], node[:, None], tokens], dim=1).tolist()  # sync
        new_ids = [row[2:row[0] + 3] for row in host]
        drafter.update(Verified(pending, n_accepted, tokens, hidden, new_ids, node, target))
        keep = _commit(cache, outputs, live, new_ids, n_drafts, pending.shape[1], tree,
                       [row[1] for row in host])
        if not keep:
            return
        if len(keep) < len(host):
            drafter.keep(keep)
            rows = torch.tensor(keep, device=tokens.device)
            tokens, n_accepted = tokens[rows], n_accepted[rows]
        room = cache.max_len - max(cache.lengths) - 1  # fewer drafts near the end of the cache
        drafts = drafter.propose(max(0, min(drafter.max_drafts, room)))
        n_drafts = drafts.real()
        pending = torch.cat([tokens.gather(1, n_accepted[:, None]), drafts.tokens], dim=1)
        tree = drafts.tree
        target, hidden = verify(model, cache, pending, heads, tree)  # (B, m, V), (B, m, n, D)
        result = accept(drafts, target, sampling, generator, acceptance=acceptance,
                        typical=typical)
        n_accepted, node, tokens = result.n_accepted, result.node, result.tokens


def _commit(cache: KVCache, outputs: list[SequenceOutput], live: list[int],
            new_ids: list[list[int]], n_drafts: list[int], m: int, tree: Tree | None = None,
            nodes: list[int] | None = None) -> list[int]:
    """Give each live sequence its new tokens and drop the finished ones from the batch.

    After a forward pass over m pending tokens, sequence b keeps the n = len(new_ids[b]) - 1
    drafts it accepted and one token of the target (`new_ids[b]`), out of n_drafts[b] real
    drafts (draft i counts as verified when drafts 1..i-1 were accepted). The cache rolls
    back to the accepted prefix; after a `tree`, it keeps the root and the path to nodes[b]
    (the depth after that node was verified iff it has children). `live` maps batch rows to
    outputs and is updated; returns the rows kept.
    """
    if tree is not None:
        cache.compact([tree.ancestors[node] for node in nodes])
        n_drafts = [len(ids) - 1 + tree.has_children[node] for ids, node in zip(new_ids, nodes)]
    elif m > 1:
        cache.rollback([length - m + len(ids) for length, ids in zip(cache.lengths, new_ids)])
    keep = []
    for row, (index, ids, verified) in enumerate(zip(live, new_ids, n_drafts)):
        output = outputs[index]
        output.count_forward(min(len(ids), verified), len(ids) - 1, nodes=m)
        if not output.add(ids):
            keep.append(row)
    if len(keep) < len(live):
        live[:] = [live[row] for row in keep]
        if keep:
            cache.keep(keep)
    return keep


def _check_arguments(vocab_size: int, tokenizer: Tokenizer, prompts: list[str],
                     max_new_tokens: int, sampling: SamplingConfig,
                     stop: tuple[str, ...]) -> None:
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"the tokenizer ({tokenizer!r}) has {tokenizer.vocab_size} tokens but "
                         f"the model's vocab_size is {vocab_size}: they do not belong together")
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r:.80}")
    for index, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"prompt {index} must be a non-empty string, got {prompt!r:.80}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a SamplingConfig, got {sampling!r}")
    for string in stop:
        if not isinstance(string, str) or not string:
            raise ValueError(f"stop strings must be non-empty strings, got {string!r}")
