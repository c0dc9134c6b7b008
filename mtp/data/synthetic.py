"""What the synthetic tasks (`mtp.data.polynomial`, `mtp.data.induction`) share: their
fixed train/test partition and the check that a tokenizer can spell them."""

from __future__ import annotations

import hashlib
from collections import Counter

from mtp.data.sources import Corpus, _corpus
from mtp.tokenizers import Tokenizer


def generated_corpus(texts: list[str], task: str) -> Corpus:
    """A generator's documents as a `Corpus` (one per text, keyed by their content)."""
    return _corpus([str(i) for i in range(len(texts))], texts, Counter(), prefix=task,
                   searched=[f"the {task} generator"])


def in_fraction(text: str, key: str, fraction: float) -> bool:
    """Whether a keyed hash of `text` falls below `fraction`: a fixed partition of all texts,
    which makes train and test disjoint."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, key=key.encode())
    return int.from_bytes(digest.digest(), "little") < fraction * 2**64


def check_spelling(tokenizer: Tokenizer, task: str, alphabet: str, sample: str) -> None:
    """Fail, in one line, unless `tokenizer` spells the task one token per character (each of
    `alphabet`, and all of `sample`): the tasks are scored token by token."""
    for ch in alphabet:
        ids = tokenizer.encode(ch)
        if len(ids) != 1 or tokenizer.decode(ids) != ch:
            raise ValueError(f"tokenizer {tokenizer.name!r} cannot spell {ch!r} of the {task} "
                             f"task's alphabet as one token (ids {ids}): use tokenizer=byte")
    ids = tokenizer.encode(sample)
    if len(ids) != len(sample):
        raise ValueError(f"tokenizer {tokenizer.name!r} encodes {sample[:40]!r}... in {len(ids)} "
                         f"tokens, not one per character as the {task} task is scored: "
                         f"use tokenizer=byte")
