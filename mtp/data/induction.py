"""Children's stories whose characters have random two-token names: the paper's induction task
(Gloeckle et al. 2024, section 4.1 and appendix J), generated from templates, no download.

A name is an uppercase letter then a lowercase one (`Qx`, two byte tokens). Given its first
letter, its second is one of about 20 equally likely letters, unless the name appeared
before in the story: then copying it (induction) predicts it. The metric
(`mtp.eval.synthetic`) is the accuracy on the second token of every repeated name (on first
occurrences it is chance, a control). No name starts a capitalised template word, and one
story's characters have distinct first letters. Train and test names are disjoint pools:
a name is a test name when a keyed hash of it falls below `TEST_NAME_FRACTION`.
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections import Counter
from dataclasses import dataclass

from mtp.cli import check_positive
from mtp.data.sources import Corpus
from mtp.data.synthetic import check_spelling, generated_corpus, in_fraction
from mtp.tokenizers import Tokenizer

TEST_NAME_FRACTION = 0.25
ROLES = ("girl", "boy", "cat", "dog", "bird", "fox", "bear", "rabbit", "frog", "duck")
ADJECTIVES = ("little", "happy", "kind", "small", "brave", "shy", "funny", "curious")
PLACES = ("park", "forest", "river", "garden", "beach", "hill", "farm", "pond")
THINGS = ("ball", "kite", "box", "hat", "cake", "flower", "stick", "boat", "book", "drum")
FEELINGS = ("happy", "sad", "tired", "excited", "scared", "proud", "hungry", "surprised")
# {A}, {B}: characters; the others are drawn from the lists above.
INTRODUCTIONS = (
    "Once upon a time there was a {adj} {role} named {A}.",
    "There was a {adj} {role} called {A}.",
    "{A} was a {adj} {role}.",
    "In a small town lived a {role} named {A}.",
)
EVENTS = (
    "One day {A} and {B} went to the {place}.",
    "{A} found a {thing} near the {place}.",
    "{B} said, \"{A}, let us play with the {thing}!\"",
    "{A} was {feeling}.",
    "{B} gave the {thing} to {A}.",
    "{A} and {B} played all day.",
    "{A} smiled at {B}.",
    "{B} looked at {A} and laughed.",
    "{A} wanted the {thing}, but {B} had it.",
    "Then {B} felt {feeling}.",
    "{A} ran to the {place} to find {B}.",
    "{B} helped {A} carry the {thing}.",
)
ENDINGS = (
    "At the end of the day, {A} went home.",
    "{A} and {B} were friends forever.",
    "{B} hugged {A}. The end.",
)
_TEMPLATES = INTRODUCTIONS + EVENTS + ENDINGS
ALPHABET = string.ascii_letters + " .,!\""


def all_names() -> list[str]:
    """Every possible name, sorted: an uppercase then a lowercase letter, less the starts of
    the capitalised words the templates write."""
    words = re.findall(r"\b[A-Z][a-z]+", re.sub(r"\{\w+\}", "", " ".join(_TEMPLATES)))
    blocked = {w[:2] for w in words}
    return [a + b for a in string.ascii_uppercase for b in string.ascii_lowercase
            if a + b not in blocked]


def name_pool(test: bool) -> list[str]:
    """The names of one side of the split (disjoint pools)."""
    return [n for n in all_names()
            if in_fraction(n, "mtp-induction-test", TEST_NAME_FRACTION) == test]


@dataclass(frozen=True)
class Story:
    """A story and its names: `names[i]` = (character offset, occurrence from 1)."""

    text: str
    names: tuple[tuple[int, int], ...]

    def second_tokens(self, repeated: bool) -> list[int]:
        """Character offsets of the second letter of every repeated (or every first) name."""
        return [start + 1 for start, occurrence in self.names if (occurrence > 1) == repeated]


def random_story(rng: random.Random, pool: list[str], events: int = 5) -> Story:
    """A story of two characters (distinct first letters) from `pool`: each introduced, then
    `events` event sentences and an ending."""
    first = rng.choice(pool)
    second = rng.choice([n for n in pool if n[0] != first[0]])
    cast = {"A": first, "B": second}
    sentences = [(rng.choice(INTRODUCTIONS), {"A": "A"}), (rng.choice(INTRODUCTIONS), {"A": "B"})]
    for template in rng.choices(EVENTS, k=events) + [rng.choice(ENDINGS)]:
        sentences.append((template, {"A": "A", "B": "B"} if rng.random() < 0.5
                          else {"A": "B", "B": "A"}))
    text, names, seen = "", [], Counter()
    for template, roles in sentences:
        fill = {"role": rng.choice(ROLES), "adj": rng.choice(ADJECTIVES),
                "place": rng.choice(PLACES), "thing": rng.choice(THINGS),
                "feeling": rng.choice(FEELINGS)}
        for piece in re.split(r"(\{\w+\})", template):
            key = piece[1:-1] if piece.startswith("{") else None
            if key in roles:
                name = cast[roles[key]]
                seen[name] += 1
                names.append((len(text), seen[name]))
                text += name
            else:
                text += piece.format(**fill) if key else piece
        text += " "
    return Story(text.rstrip(), tuple(names))


def stories(seed: int, count: int, *, test: bool, events: int = 5) -> list[Story]:
    """`count` stories with names from one side's pool, from `seed`."""
    rng = random.Random(f"induction-{'test' if test else 'train'}-{seed}")
    pool = name_pool(test)
    return [random_story(rng, pool, events) for _ in range(count)]


def test_set(count: int) -> list[Story]:
    """The fixed test set: `count` stories with test names (a larger count extends a smaller)."""
    check_positive("count", count)
    return stories(0, count, test=True)


@dataclass(frozen=True)
class InductionSource:
    """Training stories (one document each) with names from the training pool."""

    documents: int = 50_000
    events: int = 5  # event sentences per story, after the two introductions
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive("data.source.documents", self.documents)
        check_positive("data.source.events", self.events)

    def load(self) -> Corpus:
        return _load_induction(self)

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Fail unless `tokenizer` spells stories one token per character (names: two)."""
        check_spelling(tokenizer, "induction", ALPHABET, stories(0, 1, test=False)[0].text)


@functools.lru_cache(maxsize=2)  # a run loads its source several times (tokenizer, prepare, setup)
def _load_induction(source: InductionSource) -> Corpus:
    return generated_corpus([s.text for s in stories(source.seed, source.documents, test=False,
                                                     events=source.events)], "induction")
