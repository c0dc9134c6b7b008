"""Arithmetic in the ring F7[X]/(X^5): the paper's algorithmic-reasoning task (Gloeckle et al.
2024, section 4.2 and appendix K), generated from a seed, no download.

An element is its 5 coefficients in F7, lowest degree first: `30215` is 3 + 0X + 2X^2 + X^3 +
5X^4. A problem is a start element and `m` operations applied left to right, each uniform: `-`
negation, `+ q` addition, `* q` multiplication mod X^5, `o q` composition r(q(X)) mod X^5. The
text is the problem, ` = ` and the result (`10230 + 00611 - o 21005 = 31402`); a model is asked
the 5 digits after `= `. A problem (its text before ` = `) is a test problem when a keyed hash
of it falls below `TEST_FRACTION`: no seed, count or m of a training source can reach one.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from mtp.cli import check_positive
from mtp.data.sources import Corpus
from mtp.data.synthetic import check_spelling, generated_corpus, in_fraction
from mtp.tokenizers import Tokenizer

P, DEGREE = 7, 5  # the field F7 and the truncation X^5
OPERATORS = ("-", "+", "*", "o")
MAX_OPS = 20  # the longest problem any source or test set writes (the paper tests m <= 10)
TEST_MS = tuple(range(1, 11))  # the paper's in-domain 1..5 and out-of-domain 6..10
TEST_FRACTION = 0.1  # share of all problems reserved for testing
ALPHABET = "0123456" + "".join(OPERATORS) + " ="
Poly = tuple[int, ...]  # DEGREE coefficients in [0, P), lowest degree first


def add(a: Poly, b: Poly) -> Poly:
    return tuple((x + y) % P for x, y in zip(a, b))


def neg(a: Poly) -> Poly:
    return tuple(-x % P for x in a)


def mul(a: Poly, b: Poly) -> Poly:
    """a * b with the terms of degree >= DEGREE dropped (the ideal (X^5))."""
    out = [0] * DEGREE
    for i, x in enumerate(a):
        for j in range(DEGREE - i):
            out[i + j] += x * b[j]
    return tuple(c % P for c in out)


def compose(a: Poly, b: Poly) -> Poly:
    """a(b(X)) mod X^5, by Horner's rule in the ring."""
    out = (0,) * DEGREE
    for coefficient in reversed(a):
        out = add(mul(out, b), (coefficient,) + (0,) * (DEGREE - 1))
    return out


def apply(op: str, running: Poly, operand: Poly | None) -> Poly:
    """One operation on the running result."""
    if op == "-":
        return neg(running)
    return {"+": add, "*": mul, "o": compose}[op](running, operand)


def format_poly(a: Poly) -> str:
    return "".join(map(str, a))


def parse_poly(text: str) -> Poly:
    if len(text) != DEGREE or any(c not in "0123456" for c in text):
        raise ValueError(f"{text!r} is not {DEGREE} coefficients in 0..{P - 1}")
    return tuple(map(int, text))


def check_ops(m: int, what: str = "m") -> None:
    if not isinstance(m, int) or not 1 <= m <= MAX_OPS:
        raise ValueError(f"{what}={m!r} must be an integer number of operations in 1..{MAX_OPS}")


@dataclass(frozen=True)
class Problem:
    """One problem: `prompt` (ending in `= `), the `answer`'s 5 digits, its operations `m`."""

    prompt: str
    answer: str
    m: int

    @property
    def text(self) -> str:
        return self.prompt + self.answer


def random_problem(rng: random.Random, m: int) -> Problem:
    """A problem of `m` operations, every choice uniform."""

    def element() -> Poly:
        return tuple(rng.randrange(P) for _ in range(DEGREE))

    running = element()
    words = [format_poly(running)]
    for _ in range(m):
        op = rng.choice(OPERATORS)
        operand = None if op == "-" else element()
        running = apply(op, running, operand)
        words += [op] if operand is None else [op, format_poly(operand)]
    return Problem(" ".join(words) + " = ", format_poly(running), m)


def is_test(prompt: str) -> bool:
    """Whether a problem (its prompt) is reserved for testing."""
    return in_fraction(prompt, "mtp-polynomial-test", TEST_FRACTION)


def problems(seed: int, count: int, ms: tuple[int, ...], *, test: bool) -> list[Problem]:
    """`count` problems from one side of the split, m uniform over `ms`, from `seed`."""
    for m in ms:
        check_ops(m)
    rng = random.Random(f"polynomial-{'test' if test else 'train'}-{seed}")
    out = []
    while len(out) < count:
        problem = random_problem(rng, rng.choice(ms))
        if is_test(problem.prompt) == test:
            out.append(problem)
    return out


def test_set(per_m: int, ms: tuple[int, ...] = TEST_MS) -> list[Problem]:
    """The fixed test set: `per_m` problems for each m, the same for every checkpoint (each m
    has its own stream, so a larger `per_m` extends a smaller one)."""
    check_positive("per_m", per_m)
    return [p for m in ms for p in problems(m, per_m, (m,), test=True)]


@dataclass(frozen=True)
class PolynomialSource:
    """Training problems of F7[X]/(X^5) (one document each), m uniform in min_ops..max_ops
    (the paper: 1..5). Never a test problem (`is_test`)."""

    documents: int = 200_000
    min_ops: int = 1
    max_ops: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        check_ops(self.min_ops, "data.source.min_ops")
        check_ops(self.max_ops, "data.source.max_ops")
        if self.min_ops > self.max_ops:
            raise ValueError(f"data.source.min_ops={self.min_ops} exceeds max_ops={self.max_ops}")
        check_positive("data.source.documents", self.documents)

    def load(self) -> Corpus:
        return _load_polynomial(self)

    def check_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Fail unless `tokenizer` spells problems one token per character (answers: 5 tokens)."""
        check_spelling(tokenizer, "polynomial", ALPHABET, test_set(1, (3,))[0].text)


@functools.lru_cache(maxsize=2)  # a run loads its source several times (tokenizer, prepare, setup)
def _load_polynomial(source: PolynomialSource) -> Corpus:
    ms = tuple(range(source.min_ops, source.max_ops + 1))
    return generated_corpus([p.text for p in problems(source.seed, source.documents, ms,
                                                      test=False)], "polynomial")
