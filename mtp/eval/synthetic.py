"""The synthetic tasks' metrics: polynomial exact match per m, induction accuracy on repeated
names (`mtp.data.polynomial`, `mtp.data.induction`).

Both are read off one teacher-forced forward pass: head 0's argmax at every position. For
polynomial this is greedy decoding's exact match (greedy writes the answer exactly when each
digit is the argmax after the correct prefix); induction is scored per token, as the paper
does: the top guess for a name's second letter, given the story so far and its first.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean
from typing import Any

import torch

from mtp.data import induction, polynomial
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer

SOURCES = {"polynomial": polynomial.PolynomialSource, "induction": induction.InductionSource}
TASKS = tuple(SOURCES)
DEFAULT_MS = polynomial.TEST_MS
DEFAULT_SIZE = {"polynomial": 2000, "induction": 1000}  # problems per m (the paper's) | stories


def check_task(task: str, tokenizer: Tokenizer) -> None:
    """Fail unless `task` is a synthetic task `tokenizer` can spell (one line)."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {TASKS}")
    SOURCES[task]().check_tokenizer(tokenizer)


def check_ms(ms: Sequence[int]) -> tuple[int, ...]:
    """The numbers of operations to test, each in 1..polynomial.MAX_OPS."""
    ms = tuple(ms)
    if not ms:
        raise ValueError("m=[] names no number of operations to test")
    for m in ms:
        polynomial.check_ops(m)
    return ms


@torch.no_grad()
def greedy_predictions(model: MTPModel, sequences: list[list[int]], pad_id: int,
                       batch_size: int = 64) -> list[torch.Tensor]:
    """Head 0's argmax at every position of each sequence: `out[i][t]` guesses
    `sequences[i][t + 1]` (batched by length, padded on the right)."""
    longest = max(map(len, sequences))
    if longest > model.config.max_seq_len:
        raise ValueError(f"a sequence of {longest} tokens exceeds the model's max_seq_len="
                         f"{model.config.max_seq_len}")
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    out: list[torch.Tensor | None] = [None] * len(sequences)
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        width = max(len(sequences[i]) for i in chosen)
        tokens = torch.full((len(chosen), width), pad_id, dtype=torch.long)
        for row, i in enumerate(chosen):
            tokens[row, : len(sequences[i])] = torch.tensor(sequences[i])
        guesses = model(tokens.to(device), heads=[0])[:, :, 0].argmax(-1).cpu()  # (B, T)
        for row, i in enumerate(chosen):
            out[i] = guesses[row, : len(sequences[i])]
    return out


def polynomial_correct(model: MTPModel, tokenizer: Tokenizer,
                       problems: Sequence[polynomial.Problem], batch_size: int = 64
                       ) -> list[tuple[bool, str]]:
    """Per problem: whether the greedy answer is exactly right, and the digits the model wrote
    up to its first wrong one (inclusive)."""
    prompts = [tokenizer.encode_prompt(p.prompt) for p in problems]
    answers = [tokenizer.encode(p.answer) for p in problems]
    guesses = greedy_predictions(model, [q + a for q, a in zip(prompts, answers)],
                                 tokenizer.pad_id, batch_size)
    out = []
    for prompt, answer, guess in zip(prompts, answers, guesses):
        written = guess[len(prompt) - 1 : len(prompt) - 1 + len(answer)].tolist()
        wrong = next((j for j, (w, a) in enumerate(zip(written, answer)) if w != a), None)
        shown = written if wrong is None else written[: wrong + 1]
        out.append((wrong is None, tokenizer.decode(shown)))
    return out


def induction_counts(story: induction.Story, tokens: Sequence[int], guesses: torch.Tensor,
                     offset: int) -> dict[str, int]:
    """Right guesses and totals on the second letter of repeated and first names; character
    c of the story is `tokens[offset + c]`, and `guesses[t]` guesses token t + 1."""
    counts = {}
    for kind, repeated in (("repeated", True), ("first", False)):
        positions = [offset + c for c in story.second_tokens(repeated)]
        counts[kind] = len(positions)
        counts[f"{kind}_correct"] = sum(int(guesses[t - 1]) == tokens[t] for t in positions)
    return counts


def score(task: str, model: MTPModel, tokenizer: Tokenizer, *, size: int | None = None,
          ms: Sequence[int] = DEFAULT_MS, batch_size: int = 64
          ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The task's summary figures and per-sample records on its fixed test set of `size`
    problems per m, or stories (None: `DEFAULT_SIZE`)."""
    check_task(task, tokenizer)
    size = DEFAULT_SIZE[task] if size is None else size
    if task == "polynomial":
        problems = polynomial.test_set(size, check_ms(ms))
        results = polynomial_correct(model, tokenizer, problems, batch_size)
        records = [{"task_id": f"m{p.m}/{i % size}", "m": p.m, "prompt": p.prompt,
                    "answer": p.answer, "completion": written, "passed": right}
                   for i, (p, (right, written)) in enumerate(zip(problems, results))]
        summary = {"accuracy": fmean(r["passed"] for r in records)}
        for m in dict.fromkeys(p.m for p in problems):
            summary[f"accuracy_m{m}"] = fmean(r["passed"] for r in records if r["m"] == m)
        summary["problems"] = len(records)
        return summary, records
    stories = induction.test_set(size)
    offset = len(tokenizer.encode_prompt(""))
    sequences = [tokenizer.encode_prompt(s.text) for s in stories]
    guesses = greedy_predictions(model, sequences, tokenizer.pad_id, batch_size)
    counts = [induction_counts(s, q, g, offset) for s, q, g in zip(stories, sequences, guesses)]
    records = [{"task_id": str(i), **c} for i, c in enumerate(counts)]
    totals = {key: sum(c[key] for c in counts) for key in counts[0]}
    summary = {"accuracy_repeated": totals["repeated_correct"] / totals["repeated"],
               "accuracy_first": totals["first_correct"] / totals["first"],
               "repeated": totals["repeated"], "first": totals["first"], "stories": len(stories)}
    return summary, records
