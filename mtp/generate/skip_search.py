"""`python -m mtp.generate.skip_search checkpoint=PATH`: choose the trunk layers that layer
skipping (`drafter=layer_skip`) leaves out, and save the choice for the checkpoint.

Draft & Verify searches by Bayesian optimisation of measured time per token; this search
ranks by the same quantity modeled from measured acceptance, with no timing (greedy decoding
only), so a seed and a checkpoint give one answer on any machine:

1. `prompts` calibration prompts drawn with `seed` (never a benchmark's);
2. every trunk layer skipped alone, teacher-forced on the model's greedy continuations: the
   share of tokens it still predicts ranks the layers from least to most harmful;
3. the nested sets of the m least harmful layers (m = 1, 2, 3, 4, 6, 8, 12, ... < n_layers)
   each decode the prompts as `drafter=layer_skip` with `max_draft` drafts, measuring the
   share of steps that keep at least i drafts, P(A >= i), on the drafter's real cache;
4. for each set and num_draft k <= max_draft, the modeled speed-up: expected tokens per step,
   1 + P(A >= 1) + ... + P(A >= k), over the step's cost in autoregressive steps,
   1 + step_cost + verify_cost * k + k * share(S), share(S) being the part of a token's
   weights a draft reads (the defaults fit SmolLM2-135M in float32 on a 2-core CPU; on a GPU
   both costs are near 0). Below 1, layer skipping does not pay for this model.

  checkpoint       anything mtp.load reads (required)
  prompt_file      data/prompts/calibration.jsonl;  prompts  8, drawn with seed (0)
  max_new_tokens   64 greedy tokens per prompt
  max_draft        8: the most drafts per step considered
  step_cost        0.6: a speculative step's cost beyond its forwards, in autoregressive steps
  verify_cost      0.03: a verify pass's cost per verified draft, in autoregressive steps
  output           also write layer_skip.json there (a file, or a directory: the checkpoint's
                   to ship it with the checkpoint); the tuner keeps it for the checkpoint
  device, dtype    cpu, float32
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mtp import cli
from mtp.decode.drafters.layer_skip import LayerSkip, SkipChoice
from mtp.generate.calibrate import CheckpointCalibration, greedy_texts
from mtp.generate.measure import time_generate
from mtp.generate.prompts import read_prompts
from mtp.generate.saved import save_choice
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer
from mtp.tune import Measurement


@dataclass(frozen=True, kw_only=True)
class SearchArgs(CheckpointCalibration):
    positive = ("prompts", "max_draft")
    prompts: int = 8
    seed: int = 0
    max_new_tokens: int = 64
    max_draft: int = 8
    step_cost: float = 0.6
    verify_cost: float = 0.03

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("step_cost", "verify_cost"):
            cli.check_number(name, getattr(self, name), lambda v: v >= 0, ">= 0")


@dataclass(frozen=True)
class Candidate:
    """A skipped set, what decoding with it kept, and its best modeled step."""

    skip: tuple[int, ...]
    kept: tuple[float, ...]  # P(A >= i) for i = 1..max_draft: steps keeping at least i drafts
    share: float  # the part of a token's weights a draft reads
    num_draft: int
    speedup: float  # modeled, over autoregressive decoding


@torch.inference_mode()
def agreement(model: MTPModel, texts: list[tuple[torch.Tensor, int]],
              skip: tuple[int, ...]) -> float:
    """The share of continuation tokens that the model with `skip` left out predicts
    (argmax, teacher-forced)."""
    hits = total = 0
    for ids, start in texts:
        hidden = model.head(model.trunk(ids, skip=skip), 0)  # (1, T, D)
        predicted = model.unembed(hidden[0, start - 1:-1]).argmax(-1)  # predicts start..T-1
        hits += int((predicted == ids[0, start:]).sum())
        total += ids.shape[1] - start
    return hits / total


def harm_order(model: MTPModel, texts: list[tuple[torch.Tensor, int]]) -> list[int]:
    """The trunk layers from the least to the most harmful to skip alone."""
    alone = [agreement(model, texts, (layer,)) for layer in range(model.config.n_layers)]
    return sorted(range(len(alone)), key=lambda layer: (-alone[layer], layer))


def kept_shares(model: MTPModel, tokenizer: Tokenizer, prompts: list[str],
                skip: tuple[int, ...], max_draft: int, max_new_tokens: int) -> tuple[float, ...]:
    """P(A >= i), i = 1..max_draft: the share of decode steps (prefills aside) that kept at
    least i drafts, decoding `prompts` greedily with `skip` drafting `max_draft`."""
    depths = time_generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                           batch_size=len(prompts),
                           drafter=LayerSkip(list(skip), max_draft)).stats.accepted_depths
    depths = depths + [0] * (max_draft + 1 - len(depths))
    depths[0] -= len(prompts)  # each prefill counts as a forward that kept nothing
    steps = max(sum(depths), 1)
    return tuple(round(sum(depths[i:]) / steps, 4) for i in range(1, max_draft + 1))


def draft_share(model: MTPModel, skip: tuple[int, ...]) -> float:
    """The part of one token's weights a draft reads with `skip` left out: the trunk layers
    it runs, head 0, the final norm and the unembedding (the embedding is a lookup)."""
    layer = [sum(p.numel() for p in block.parameters()) for block in model.layers]
    rest = sum(p.numel() for module in (model.heads[0], model.norm, model.output)
               for p in module.parameters())
    return (sum(n for i, n in enumerate(layer) if i not in skip) + rest) / (sum(layer) + rest)


def best_step(kept: Sequence[float], share: float, *, step_cost: float,
              verify_cost: float) -> tuple[int, float]:
    """The num_draft with the highest modeled speed-up, and that speed-up (see the module
    docstring); `kept[i - 1]` is P(A >= i)."""
    def speedup(k: int) -> float:
        return (1 + sum(kept[:k])) / (1 + step_cost + verify_cost * k + k * share)
    k = max(range(1, len(kept) + 1), key=lambda k: (speedup(k), -k))
    return k, speedup(k)


def nested_counts(n_layers: int) -> list[int]:
    """How many layers the candidates skip: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... < n_layers."""
    counts, m = [1, 2, 3], 4
    while m < n_layers:
        counts += [m, m * 3 // 2]
        m *= 2
    return sorted({c for c in counts if c < n_layers})


def search(model: MTPModel, tokenizer: Tokenizer, prompts: list[str], *, max_draft: int = 8,
           step_cost: float = 0.6, verify_cost: float = 0.03,
           max_new_tokens: int = 64) -> tuple[list[Candidate], list[int]]:
    """Every candidate of the search (see the module docstring), best first, and the trunk
    layers from the least to the most harmful to skip alone (the nested sets' order)."""
    n_layers = model.config.n_layers
    if n_layers < 2:
        raise ValueError(f"the model's trunk has {n_layers} layer: layer skipping needs a "
                         f"layer to keep and one to skip")
    texts = [text for text in greedy_texts(model, tokenizer, prompts, max_new_tokens)
             if text[0].shape[1] > text[1]]  # continued by at least one token
    if not texts:
        raise ValueError("the model continued no calibration prompt: nothing to measure on")
    order = harm_order(model, texts)
    candidates = []
    for m in nested_counts(n_layers):
        skip = tuple(sorted(order[:m]))
        kept = kept_shares(model, tokenizer, prompts, skip, max_draft, max_new_tokens)
        share = draft_share(model, skip)
        step = best_step(kept, share, step_cost=step_cost, verify_cost=verify_cost)
        candidates.append(Candidate(skip, kept, round(share, 4), *step))
    return sorted(candidates, key=lambda c: (-c.speedup, -len(c.skip))), order


def parse_args(argv: list[str]) -> SearchArgs:
    return cli.parse(argv, SearchArgs)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    model, tokenizer = args.load()
    pool = read_prompts(args.prompt_file)
    prompts = random.Random(args.seed).sample(pool, min(args.prompts, len(pool)))
    began = time.perf_counter()
    candidates, order = search(model, tokenizer, prompts, max_draft=args.max_draft,
                               step_cost=args.step_cost, verify_cost=args.verify_cost,
                               max_new_tokens=args.max_new_tokens)
    seconds = time.perf_counter() - began
    print(f"{'skipped':>7} {'kept >= 1':>9} {'kept >= 2':>9} {'draft share':>11} "
          f"{'num_draft':>9} {'modeled speed-up':>16}  layers skipped")
    for c in sorted(candidates, key=lambda c: len(c.skip)):
        second = f"{c.kept[1]:>9.3f}" if len(c.kept) > 1 else f"{'':>9}"
        print(f"{len(c.skip):>7} {c.kept[0]:>9.3f} {second} {c.share:>11.3f} {c.num_draft:>9} "
              f"{c.speedup:>15.2f}x  {list(c.skip)}")
    best = candidates[0]
    details = {"kept": list(best.kept), "draft_share": best.share,
               "modeled_speedup": round(best.speedup, 3), "step_cost": args.step_cost,
               "verify_cost": args.verify_cost, "prompt_file": args.prompt_file,
               "prompts": len(prompts), "seed": args.seed, "max_draft": args.max_draft,
               "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
               "seconds": round(seconds, 1), "order": order}  # least harmful first: nested sets
    choice = SkipChoice(best.skip, best.num_draft, model.config.n_layers,
                        model.config.vocab_size, details)
    record = Measurement(
        "layer_skip", f"skip {list(best.skip)}, num_draft={best.num_draft}", "measured",
        "below 1: layer skipping does not pay for this model" if best.speedup <= 1 else
        f"{best.kept[0]:.3f} of steps keep a draft",
        figures={f"{len(c.skip)} layers": c.speedup for c in candidates},
        unit="modeled speed-up", seconds=seconds, value=choice.to_json())
    for where in save_choice(args.checkpoint, record, args.output):
        print(f"saved: {where}")


if __name__ == "__main__":
    cli.main(main, __doc__)
