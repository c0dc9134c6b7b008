"""The synthetic tasks' metrics: induction counts, exact match, `python -m mtp.eval`, bad input."""

import json

import pytest
import torch

from mtp.checkpoint import export
from mtp.data import InductionSource, MTPDataModule, PolynomialSource, induction, polynomial
from mtp.eval import EvalConfig, evaluate
from mtp.eval.synthetic import (check_task, greedy_predictions, induction_counts,
                                polynomial_correct, score)
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import BPETokenizer, ByteTokenizer


# --- the metrics -------------------------------------------------------------------------------

def test_induction_metric_counts_only_second_tokens_of_repeated_names() -> None:
    story = induction.test_set(1)[0]
    tokenizer = ByteTokenizer()
    tokens = tokenizer.encode_prompt(story.text)
    offset = len(tokenizer.encode_prompt(""))
    perfect = torch.tensor(tokens[1:] + [0])  # guesses[t] = token t + 1: every guess right
    counts = induction_counts(story, tokens, perfect, offset)
    repeated = counts["repeated"]
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
    with pytest.raises(ValueError, match="task='sums' is not one of"):
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
