"""The synthetic tasks' data: generators, disjoint splits, ring arithmetic, bad input."""

import random

import numpy as np

from mtp.data import InductionSource, PolynomialSource, induction, polynomial


def test_generators_are_deterministic_and_seeded() -> None:
    assert polynomial.problems(3, 50, (1, 2, 5), test=False) == \
        polynomial.problems(3, 50, (1, 2, 5), test=False)
    assert polynomial.problems(3, 50, (1,), test=False) != polynomial.problems(4, 50, (1,),
                                                                                test=False)
    assert induction.stories(3, 20, test=False) == induction.stories(3, 20, test=False)
    assert induction.stories(3, 20, test=False) != induction.stories(4, 20, test=False)
    first, again = PolynomialSource(documents=300).load(), PolynomialSource(documents=300).load()
    assert first.key == again.key and first.documents["text"] == again.documents["text"]
    assert PolynomialSource(documents=300, seed=1).load().key != first.key
    assert polynomial.test_set(20) == polynomial.test_set(20)
    assert polynomial.test_set(30)[:20] != []  # a larger test set extends a smaller, per m
    assert [p for p in polynomial.test_set(30) if p.m == 4][:20] == \
        [p for p in polynomial.test_set(20) if p.m == 4]


def test_polynomial_train_and_test_never_share_a_problem() -> None:
    """Proved on a seed: every problem a source writes is on the training side, every test
    problem on the test side, and the sets are disjoint; m = 1 negations, a small space
    (7^5 problems) that both sides sample densely, included."""
    train = PolynomialSource(documents=20_000, min_ops=1, max_ops=2, seed=0).load()
    prompts = {t[: t.index("= ") + 2] for t in train.documents["text"]}
    test = {p.prompt for p in polynomial.test_set(2000, (1, 2))}
    assert not prompts & test
    assert not any(polynomial.is_test(p) for p in prompts)
    assert all(polynomial.is_test(p) for p in test)
    negations = [p for p in test if p.endswith(" - = ")]
    assert len(negations) > 200 and not any(p in prompts for p in negations)


def test_induction_name_pools_are_disjoint_and_test_stories_use_test_names() -> None:
    train_pool, test_pool = set(induction.name_pool(False)), set(induction.name_pool(True))
    assert not train_pool & test_pool and len(test_pool) > 100 and len(train_pool) > 300
    train = InductionSource(documents=500, seed=0).load().documents["text"]
    train_names = {s.text[c : c + 2] for s in induction.stories(0, 500, test=False)
                   for c, _ in s.names}
    assert train_names <= train_pool
    test_names = {s.text[c : c + 2] for s in induction.test_set(300) for c, _ in s.names}
    assert test_names <= test_pool
    assert not any(name in text for text in train for name in test_names
                   if f" {name} " in text or f" {name}." in text)


def test_stories_mark_every_name_and_names_are_not_template_words() -> None:
    story = induction.stories(5, 1, test=True)[0]
    names = {story.text[c : c + 2] for c, _ in story.names}
    assert len(names) == 2 and len({n[0] for n in names}) == 2  # distinct first letters
    assert len(story.names) == sum(story.text.count(n) for n in names)
    occurrences = [o for _, o in story.names]
    assert occurrences.count(1) == 2 and max(occurrences) > 1
    assert "Th" not in induction.all_names() and "On" not in induction.all_names()


def _direct(a, b=None, op="*"):
    """Integer polynomials multiplied and powered in full, reduced mod 7 and X^5 at the end."""
    a = np.array(a, dtype=object)
    if op == "*":
        full = np.convolve(a, np.array(b, dtype=object))
    elif op == "o":
        full, power = np.zeros(1, dtype=object), np.ones(1, dtype=object)
        for coefficient in a:  # sum of a_i * b(X)^i, no truncation on the way
            term = coefficient * power
            full = np.pad(full, (0, max(0, len(term) - len(full))))
            full[: len(term)] += term
            power = np.convolve(power, np.array(b, dtype=object))
    full = list(full) + [0] * 5
    return tuple(int(c) % 7 for c in full[:5])


def test_ring_operations_match_a_direct_implementation() -> None:
    rng = random.Random(0)
    for _ in range(300):
        a, b = (tuple(rng.randrange(7) for _ in range(5)) for _ in range(2))
        assert polynomial.mul(a, b) == _direct(a, b, "*")
        assert polynomial.compose(a, b) == _direct(a, b, "o")
        assert polynomial.add(a, b) == tuple((x + y) % 7 for x, y in zip(a, b))
        assert polynomial.add(a, polynomial.neg(a)) == (0,) * 5
    x = (0, 1, 0, 0, 0)  # the identity of composition
    a = (3, 0, 2, 1, 5)
    assert polynomial.compose(a, x) == a and polynomial.compose(x, a) == a
    assert polynomial.compose((1, 1, 0, 0, 0), (0, 0, 1, 0, 0)) == (1, 0, 1, 0, 0)  # 1 + X^2
    assert polynomial.compose((0, 0, 1, 0, 0), (1, 1, 0, 0, 0)) == (1, 2, 1, 0, 0)  # (1 + X)^2


def test_problem_texts_evaluate_to_their_answers() -> None:
    """Each problem re-evaluated from its text alone, left to right, with the direct ring."""
    for problem in polynomial.problems(1, 200, tuple(range(1, 11)), test=False):
        words = problem.prompt.split()[:-1]
        running, i, ops = polynomial.parse_poly(words[0]), 1, 0
        while i < len(words):
            op = words[i]
            if op == "-":
                running, i = tuple(-c % 7 for c in running), i + 1
            else:
                q = polynomial.parse_poly(words[i + 1])
                running = (tuple((x + y) % 7 for x, y in zip(running, q)) if op == "+"
                           else _direct(running, q, op))
                i += 2
            ops += 1
        assert ops == problem.m and polynomial.format_poly(running) == problem.answer


def test_python_m_mtp_train_refuses_bad_input_in_one_line(tmp_path) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "mtp.train", "data=polynomial", "data.source.max_ops=21",
         "model=tiny", "logger=none", f"run_dir={tmp_path}", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == \
        "error: data.source.max_ops=21 must be an integer number of operations in 1..20"
    assert not (tmp_path / "checkpoints").exists()
