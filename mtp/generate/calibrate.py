"""`python -m mtp.generate.calibrate checkpoint=DIR`: measure the heads, write DIR/tree.json.

What `tree=auto:N` needs: how often head d's rank-r token is right. Each calibration prompt
is decoded greedily; one teacher-forced pass over prompt + continuation gives, at every
position s, the rank of the greedy token s + d + 1 under head d's logits (positions followed
by a run of one repeated token left out). It saves the path frequencies (for every rank path,
the share of positions that would accept its node: auto:N takes the N - 1 most frequent) and
the per-head rates (Medusa's construction, for files without paths), as a tuning step's
record for this checkpoint, where generate and eval find it. `drafter=auto` then measures the
auto:N trees against the chain. Calibrate on prompts that you do not benchmark on.

  checkpoint       anything mtp.load reads (required)
  prompt_file      data/prompts/calibration.jsonl (MBPP validation-split signatures)
  max_new_tokens   128 greedy tokens per prompt
  ranks            8: ranks measured per head
  paths            1024: the most frequent rank paths kept
  output           also write tree.json there (a file, or a directory: the checkpoint's to
                   ship it with the checkpoint)
  device, dtype    cpu, float32 (the one dtype grammar: float32, bfloat16, float16)
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from omegaconf import MISSING

from mtp import cli
from mtp.checkpoint import load
from mtp.decode.loop import generate
from mtp.decode.tree import Calibration, Tree
from mtp.generate.prompts import read_prompts
from mtp.generate.saved import save_choice
from mtp.model import MTPModel
from mtp.paths import REPO_ROOT
from mtp.tokenizers import Tokenizer
from mtp.tune import Measurement

CALIBRATION_PROMPTS = REPO_ROOT / "data/prompts/calibration.jsonl"


@dataclass(frozen=True, kw_only=True)
class CheckpointCalibration:
    """The command line of a calibration of a checkpoint on held-out prompts (this module's,
    and `skip_search`'s); `positive`: a subclass's keys that must be positive integers."""

    positive: ClassVar[tuple[str, ...]] = ()
    checkpoint: str = MISSING
    prompt_file: str = str(CALIBRATION_PROMPTS)
    output: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        cli.parse_dtype(self.dtype)
        cli.check_positives(self, "max_new_tokens", *self.positive)

    def load(self) -> tuple[MTPModel, Tokenizer]:
        return load(self.checkpoint, device=self.device, dtype=cli.parse_dtype(self.dtype))


@dataclass(frozen=True, kw_only=True)
class CalibrateArgs(CheckpointCalibration):
    positive = ("ranks", "paths")
    ranks: int = 8
    paths: int = 1024


def greedy_texts(model: MTPModel, tokenizer: Tokenizer, prompts: list[str],
                 max_new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """Each prompt with the model's greedy continuation, as ids (1, T) on the model's
    device, and the length of the prompt's ids (where the continuation starts)."""
    texts = []
    for prompt, generation in zip(prompts, generate(
            model, tokenizer, prompts, max_new_tokens=max_new_tokens)):
        prefix = tokenizer.encode_prompt(prompt)  # as generate()
        ids = torch.tensor([prefix + generation.token_ids],
                           device=next(model.parameters()).device)
        texts.append((ids, len(prefix)))
    return texts


@torch.inference_mode()
def truth_ranks(model: MTPModel, tokenizer: Tokenizer, prompts: list[str],
                max_new_tokens: int) -> torch.Tensor:
    """(positions, n_future - 1): for head d, the rank of token s + d + 1 among its logits at
    position s of a greedy continuation (0: its argmax); left out are positions without that
    token and those followed by a run of one token (a small model's greedy loops on spaces,
    which every head gets right, would drown the rates in trivial cases)."""
    n_future = model.config.n_future
    rows = []
    for ids, prefix in greedy_texts(model, tokenizer, prompts, max_new_tokens):
        logits = model(ids)[0].float()  # (T, n, V)
        start, end = prefix - 1, ids.shape[1] - n_future  # every head's truth exists
        if end <= start:
            continue
        window = ids[0, start + 1:end + n_future].unfold(0, n_future, 1)  # (S, n) s+1..s+n
        varied = (window != window[:, :1]).any(1)  # not a run of one token (spaces, "___")
        ranks = []
        for head in range(1, n_future):
            scores = logits[start:end, head]  # (S, V) head's logits at positions s
            truth = ids[0, start + head + 1:end + head + 1]  # (S,) token s + head + 1
            ranks.append((scores > scores.gather(1, truth[:, None])).sum(1))
        rows.append(torch.stack(ranks, dim=1)[varied])  # (S', n - 1)
    if not rows:
        raise ValueError(f"no position to measure: give longer continuations than "
                         f"max_new_tokens={max_new_tokens} for a model with {n_future} heads")
    return torch.cat(rows).cpu()


def acceptance_rates(ranks: torch.Tensor, n_ranks: int) -> list[list[float]]:
    """rates[d][r]: P(head d + 1 has rank r | heads 1..d ranked the truth below n_ranks)."""
    rates = []
    reachable = torch.ones(ranks.shape[0], dtype=torch.bool)
    for head in range(ranks.shape[1]):
        counts = torch.bincount(ranks[reachable, head].clamp(max=n_ranks), minlength=n_ranks + 1)
        total = max(int(reachable.sum()), 1)
        rates.append([round(c / total, 4) for c in counts[:n_ranks].tolist()])
        reachable &= ranks[:, head] < n_ranks
    return rates


def path_frequencies(ranks: torch.Tensor, n_ranks: int,
                     limit: int) -> list[tuple[tuple[int, ...], float]]:
    """The `limit` rank paths most often accepted (every prefix of a position's ranks up to
    the first past `n_ranks`), with the share of positions accepting each; most frequent
    first, ties to shallower paths, so any leading slice is a valid tree."""
    counts: Counter[tuple[int, ...]] = Counter()
    for row in ranks.tolist():
        path: tuple[int, ...] = ()
        for rank in row:
            if rank >= n_ranks:
                break
            path += (rank,)
            counts[path] += 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], len(item[0]), item[0]))
    return [(path, round(count / ranks.shape[0], 6)) for path, count in ranked[:limit]]


def calibrate(args: CalibrateArgs) -> tuple[Calibration, Measurement]:
    """Measure the rates; the calibration and its record (saved by the caller)."""
    model, tokenizer = args.load()
    config = model.config
    if config.n_future < 2:
        raise ValueError(f"{args.checkpoint} has one head: there is nothing to draft with")
    prompts = read_prompts(args.prompt_file)
    began = time.perf_counter()
    ranks = truth_ranks(model, tokenizer, prompts, args.max_new_tokens)
    rates = acceptance_rates(ranks, args.ranks)
    seconds = time.perf_counter() - began
    details: dict[str, Any] = {
        "prompt_file": args.prompt_file, "prompts": len(prompts), "positions": ranks.shape[0],
        "max_new_tokens": args.max_new_tokens, "device": args.device, "dtype": args.dtype,
        "threads": torch.get_num_threads(), "seconds": round(seconds, 1)}
    calibration = Calibration(rates, config.n_future, config.vocab_size, details=details,
                              paths=path_frequencies(ranks, args.ranks, args.paths))
    lengths = {f"auto:{size}": calibration.expected_length(calibration.tree(size))
               for size in SIZES}
    record = Measurement("trees", f"heads 1..{config.n_future - 1} at ranks < {args.ranks}",
                         "measured", f"{ranks.shape[0]} positions of {len(prompts)} prompts",
                         figures=lengths, unit="tokens per forward on these positions",
                         seconds=seconds, value=calibration.to_json())
    return calibration, record


SIZES = (8, 16, 32, 64, 128)  # the trees the command prints


def parse_args(argv: list[str]) -> CalibrateArgs:
    return cli.parse(argv, CalibrateArgs)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    calibration, record = calibrate(args)
    print("head  " + " ".join(f"rank{r:<2}" for r in range(args.ranks)))
    for head, row in enumerate(calibration.rates, start=1):
        print(f"{head:>4}  " + " ".join(f"{p:6.3f}" for p in row))
    for size in SIZES:
        tree = calibration.tree(size)
        medusa = Tree.from_rates(calibration.rates, size)
        print(f"auto:{size}: depth {tree.depth}, {calibration.expected_length(tree):.2f} tokens "
              f"per forward on these positions (the rates' independent-heads tree: "
              f"{calibration.expected_length(medusa):.2f})")
    for where in save_choice(args.checkpoint, record, args.output):
        print(f"saved: {where}")


if __name__ == "__main__":
    cli.main(main, __doc__)
