"""What a model's heads buy at decoding (`measure_decoding`: every run of `mtp.train` ends
with it), and the one generate-and-time loop (`time_generate`) that it, `drafter=auto` and
every benchmark script time decoding with.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from mtp.decode.drafters import Drafter, OwnHeads
from mtp.decode.forward import cached_forward, key_width
from mtp.decode.loop import generate
from mtp.decode.output import DecodeStats, Generation, repetition
from mtp.decode.tree import resolve_tree
from mtp.kv_cache import KVCache
from mtp.model import MTPModel
from mtp.tokenizers import Prompt, Tokenizer

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Timed:
    """What `time_generate` measured; `token_ids`: each prompt's new ids, in order."""

    tokens_per_second: float
    seconds: float
    stats: DecodeStats
    token_ids: list[list[int]]


def time_calls(decode: Callable[[int, list[T]], list[R]], items: Sequence[T], batch_size: int,
               *, cuda: bool = False,
               go_on: Callable[[float, list[R]], bool] | None = None) -> tuple[float, list[R]]:
    """Call `decode(start, batch)` on `items`, `batch_size` at a time: the seconds the calls
    took (synchronised when `cuda`) and their results, concatenated; the one timing loop of
    mtp's benchmarks and another library's. `go_on(seconds, results)` False stops it."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    results: list[R] = []
    seconds = 0.0
    for start in range(0, len(items), batch_size):
        began = time.perf_counter()
        results += decode(start, list(items[start:start + batch_size]))
        if cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - began
        if go_on is not None and not go_on(seconds, results):
            break
    return seconds, results


def time_generate(model: MTPModel, tokenizer: Tokenizer, prompts: Sequence[Prompt], *,
                  max_new_tokens: int, batch_size: int = 1, seed: int | None = None,
                  seed_per_batch: bool = False, warmup_tokens: int = 0,
                  go_on: Callable[[float, list[Generation]], bool] | None = None,
                  **how: Any) -> Timed:
    """Decode and time `prompts` (texts or conversations) with `generate` (`how`: its options),
    `batch_size` at a time. `seed` seeds every call (`seed_per_batch`: batch i's `seed + i`);
    `warmup_tokens` > 0 first decodes the first batch that far, untimed; `go_on`: `time_calls`'."""
    if not prompts:
        raise ValueError("time_generate needs at least one prompt")
    if warmup_tokens > 0:
        generate(model, tokenizer, list(prompts[:batch_size]), max_new_tokens=warmup_tokens,
                 seed=seed, **how)

    def decode(start: int, batch: list[Prompt]) -> list[Generation]:
        index = start // batch_size
        return generate(model, tokenizer, batch, max_new_tokens=max_new_tokens,
                        seed=seed + index if seed is not None and seed_per_batch else seed,
                        **how)

    seconds, results = time_calls(decode, prompts, batch_size,
                                  cuda=next(model.parameters()).is_cuda, go_on=go_on)
    stats = DecodeStats.pooled([r.stats for r in results])
    return Timed(stats.new_tokens / seconds, seconds, stats, [r.token_ids for r in results])


def measure_decoding(model: MTPModel, tokenizer: Tokenizer, prompts: list[str], *,
                     max_new_tokens: int, trees: Sequence[str] = (),
                     batch_size: int = 1) -> dict[str, Any]:
    """Greedy decoding of `prompts` autoregressively (k = 1), by the heads' chain at every
    k = 2..n_future and by each tree in `trees`: tokens per forward and speed-up per k and per
    tree ("tree": the one of most tokens per forward, None with one head), how repetitive the
    output is (`repeated`), whether every output was autoregressive's (`identical`), the setup."""
    if not prompts:
        raise ValueError("measure_decoding needs at least one prompt")
    began = time.perf_counter()
    n = model.config.n_future
    chain = {k: OwnHeads.variant(model, k) if k > 1 else None for k in range(1, n + 1)}
    tree_names = list(trees) if n > 1 else []
    drafters = chain | {name: OwnHeads.variant(model, n, resolve_tree(
        name, k=n, vocab_size=model.config.vocab_size)) for name in tree_names}
    with torch.inference_mode():  # each warmed up: a shape's first call pays allocation
        timed = {name: time_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                     batch_size=batch_size, warmup_tokens=8, drafter=drafter)
                 for name, drafter in drafters.items()}
    per_forward = {name: round(t.stats.tokens_per_forward, 3) for name, t in timed.items()}
    speedup = {name: round(t.tokens_per_second / timed[1].tokens_per_second, 3)
               for name, t in timed.items()}
    best = max(tree_names, key=lambda name: timed[name].stats.tokens_per_forward, default=None)
    return {
        "tokens_per_forward": {k: per_forward[k] for k in chain},
        "speedup": {k: speedup[k] for k in chain},
        "tokens_per_second_ar": round(timed[1].tokens_per_second, 1), "tree": best,
        "tree_tokens_per_forward": best and per_forward[best],
        "tree_speedup": best and speedup[best],
        "trees": {name: per_forward[name] for name in tree_names},
        "repeated": round(repetition(timed[1].token_ids), 3),
        "identical": all(t.token_ids == timed[1].token_ids for t in timed.values()),
        "device": str(next(model.parameters()).device), "prompts": len(prompts),
        "max_new_tokens": max_new_tokens, "batch_size": batch_size,
        "seconds": round(time.perf_counter() - began, 1)}


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
    return lines + verdict(figures)


# The repeated share of a loop (docs/better.md: next-byte models 0.37-0.73, loops 0.88-0.98).
LOOPING = 0.8


def verdict(figures: dict[str, Any]) -> list[str]:
    """The line a reader of the table wants: which configuration pays, or plainly that none
    does (then the heads' model decodes faster without them)."""
    choices = {f"k={k}": x for k, x in figures["speedup"].items() if k > 1}
    if figures["tree"]:
        choices[f"tree {figures['tree']}"] = figures["tree_speedup"]
    if not choices:
        return []
    best = max(choices, key=choices.get)
    same = "identical ids" if figures.get("identical") else "ids NOT identical"
    # An undertrained model's greedy text falls into a loop that any head drafts: its speed-up
    # is not one to quote.
    loop = (f" (on text that is {figures['repeated']:.0%} repetition: a loop, not a figure to "
            f"quote)" if figures["repeated"] >= LOOPING else "")
    if choices[best] > 1.0:
        return [f"best: {best}, {choices[best]:.2f}x autoregressive decoding ({same}){loop}"]
    return [f"none pays: every k and tree is slower than autoregressive decoding here (best "
            f"{best}, {choices[best]:.2f}x); decode with drafter=autoregressive, or drafter=auto "
            f"to measure the other drafters"]


@torch.inference_mode()
def plain_forward_seconds(model: MTPModel, width: int, batch: int, context: int = 128,
                          repeats: int = 15) -> float:
    """Median seconds of one cached forward over `width` new tokens per row after `context`
    cached ones: the trunk, head 0 and the unembedding, as the verify pass computes them."""
    device = next(model.parameters()).device
    context = min(context, model.config.max_seq_len - width)
    cache = KVCache(model.config, batch, context + width, device=device,
                    dtype=next(model.parameters()).dtype)
    prompt = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    cached_forward(model, cache, prompt, torch.zeros(batch, dtype=torch.long, device=device),
                   key_width(context, cache.max_len))
    tokens = torch.randint(0, model.config.vocab_size, (batch, width), device=device)
    lengths = torch.full((batch,), context, device=device)
    key_len = key_width(context + width, cache.max_len)
    seconds = []
    for _ in range(repeats + 2):  # two warm-ups
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        hidden = cached_forward(model, cache, tokens, lengths, key_len)  # (B, width, 1, D)
        model.unembed(hidden[:, :, 0]).argmax(-1).tolist()  # the result on the host
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds[2:])


def step_width(drafter: Drafter | None) -> int:
    """Tokens per row a decode step forwards at most: the last one and the drafts."""
    return 1 if drafter is None else 1 + drafter.max_drafts
