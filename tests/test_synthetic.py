"""The synthetic tasks: generators, disjoint splits, ring arithmetic, the metrics, bad input."""

import json
import random

import numpy as np
import pytest
import torch

from mtp.checkpoint import export
from mtp.data import InductionSource, MTPDataModule, PolynomialSource, induction, polynomial
from mtp.eval import EvalConfig, evaluate
from mtp.eval.synthetic import (check_task, greedy_predictions, induction_counts,
                                polynomial_correct, score)
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import BPETokenizer, ByteTokenizer


# --- generators: deterministic, train and test disjoint ---------------------------------------

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


# --- ring arithmetic against a direct implementation ----------------------------------------

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


# --- the metrics -------------------------------------------------------------------------------

def test_induction_metric_counts_only_second_tokens_of_repeated_names() -> None:
    story = induction.test_set(1)[0]
    tokenizer = ByteTokenizer()
    tokens = tokenizer.encode_prompt(story.text)
    offset = len(tokenizer.encode_prompt(""))
    perfect = torch.tensor(tokens[1:] + [0])  # guesses[t] = token t + 1: every guess right
    counts = induction_counts(story, tokens, perfect, offset)
    repeated, first = counts["repeated"], counts["first"]
    assert counts == {"repeated": repeated, "repeated_correct": repeated, "first": 2,
                      "first_correct": 2}
    assert repeated == len(story.names) - 2
    second = {offset + c for c in story.second_tokens(True)}
    # Wrong everywhere except the second letters of repeated names: still all of them right.
    only = torch.tensor([tokens[t + 1] if t + 1 in second else 0 for t in range(len(tokens))])
    assert induction_counts(story, tokens, only, offset) == {
        "repeated": repeated, "repeated_correct": repeated, "first": 2, "first_correct": 0}
    # Right everywhere except there (first letters of names included): none counted right.
    but = torch.tensor([0 if t + 1 in second else tokens[t + 1] if t + 1 < len(tokens) else 0
                        for t in range(len(tokens))])
    assert induction_counts(story, tokens, but, offset) == {
        "repeated": repeated, "repeated_correct": 0, "first": 2, "first_correct": 2}


@pytest.fixture
def tiny_export(tmp_path):
    torch.manual_seed(0)
    model = MTPModel(MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4, max_seq_len=512,
                               n_future=2))
    return export(model.eval(), ByteTokenizer(), tmp_path / "export"), model.eval()


def test_polynomial_exact_match_is_greedy_decoding(tiny_export) -> None:
    """Teacher-forced argmax exact match equals greedy generation: an 'answer' set to what
    greedy decoding writes scores right, one changed digit scores wrong."""
    from mtp.generate import generate

    _, model = tiny_export
    tokenizer = ByteTokenizer()
    with torch.no_grad():  # every other token's logit the digits' mean: greedy writes digits
        digits = model.output.weight[48:55]
        model.output.weight.copy_(digits.mean(0).expand_as(model.output.weight))
        model.output.weight[48:55] = digits
    problems = polynomial.test_set(2, (1, 3))
    written = [g.text for g in generate(model, tokenizer, [p.prompt for p in problems],
                                        max_new_tokens=5)]
    as_greedy = [polynomial.Problem(p.prompt, w, p.m) for p, w in zip(problems, written)]
    assert [right for right, _ in polynomial_correct(model, tokenizer, as_greedy)] == [True] * 4
    changed = [polynomial.Problem(p.prompt, w[:2] + chr(ord(w[2]) ^ 1) + w[3:], p.m)
               for p, w in zip(problems, written)]
    results = polynomial_correct(model, tokenizer, changed)
    assert [right for right, _ in results] == [False] * 4
    assert [shown for _, shown in results] == [w[:3] for w in written]  # up to the first miss


def test_greedy_predictions_ignore_right_padding(tiny_export) -> None:
    _, model = tiny_export
    short, long = [258, 49, 50, 51], [258, 52, 53, 54, 55, 56, 57]
    together = greedy_predictions(model, [short, long], pad_id=256)
    alone = greedy_predictions(model, [short], pad_id=256)
    assert torch.equal(together[0], alone[0]) and len(together[1]) == len(long)


def test_python_m_mtp_eval_writes_records_and_a_summary(tiny_export, tmp_path, capsys) -> None:
    path, _ = tiny_export
    summary = evaluate(EvalConfig(task="polynomial", checkpoint=str(path), limit=3,
                                  output=str(tmp_path / "p.jsonl")))
    assert [f"accuracy_m{m}" in summary for m in range(1, 11)] == [True] * 10
    assert summary["problems"] == 30
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    records = [json.loads(line) for line in open(tmp_path / "p.jsonl")]
    assert len(records) == 30 and {r["m"] for r in records} == set(range(1, 11))
    summary = evaluate(EvalConfig(task="induction", checkpoint=str(path), limit=4,
                                  output=str(tmp_path / "i.jsonl")))
    assert summary["stories"] == 4 and 0 <= summary["accuracy_repeated"] <= 1
    assert summary["repeated"] == sum(len(s.second_tokens(True)) for s in induction.test_set(4))


# --- bad input: one-line errors before any work -------------------------------------------------

def test_bad_input_is_refused(tiny_export, tmp_path) -> None:
    path, model = tiny_export
    for m in (0, polynomial.MAX_OPS + 1):
        with pytest.raises(ValueError, match=f"m={m} must be"):
            EvalConfig(task="polynomial", checkpoint=str(path), m=[m], output="x")
        with pytest.raises(ValueError, match="max_ops"):
            PolynomialSource(max_ops=m)
    with pytest.raises(ValueError, match="polynomial task's"):
        EvalConfig(task="induction", checkpoint=str(path), m=[1], output="x")
    with pytest.raises(ValueError, match="unknown synthetic task 'sums'"):
        check_task("sums", ByteTokenizer())
    with pytest.raises(ValueError, match="unknown task 'sums'"):
        evaluate(EvalConfig(task="sums", checkpoint=str(path), output=str(tmp_path / "x")))
    with pytest.raises(ValueError, match="greedily"):
        EvalConfig(task="induction", checkpoint=str(path), temperature=0.8, output="x")
    bpe = BPETokenizer.train([s.text for s in induction.stories(0, 300, test=False)], 400)
    with pytest.raises(ValueError, match="use tokenizer=byte"):
        MTPDataModule(InductionSource(documents=10), bpe, seq_len=32, n_future=1)
    with pytest.raises(ValueError, match="use tokenizer=byte"):
        score("induction", model, bpe, size=1)
    bpe = BPETokenizer.train([p.text for p in polynomial.problems(0, 300, (1,), test=False)],
                             400)
    with pytest.raises(ValueError, match="use tokenizer=byte"):
        MTPDataModule(PolynomialSource(documents=10), bpe, seq_len=32, n_future=1)


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
