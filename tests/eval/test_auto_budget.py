"""drafter=auto within a budget: eval measures for at most a share of its expected time and at
most AUTO_SECONDS, says what it measured, and a second run reuses the choice from disk."""

import json
import time
from pathlib import Path

import pytest

import mtp.generate.measure as measure_module
from mtp.checkpoint import export
from mtp.eval.runner import EvalConfig, evaluate
from mtp.generate import Auto, SamplingConfig
from mtp.generate.settings import AUTO_SECONDS
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

PROMPTS = ["def add(a, b):\n", "import os\n", "for i in range(3):\n", "x = [1, 2]\n"]


@pytest.fixture
def model() -> MTPModel:
    config = MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4, max_seq_len=1024,
                       n_future=8)
    return MTPModel(config).eval()


@pytest.fixture
def slow_generate(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every decoding auto measures takes 50 ms more: a slow machine, on a clock."""
    calls: list[float] = []
    real = measure_module.generate  # auto times through the one harness

    def slow(*args, **kwargs):
        time.sleep(0.05)
        calls.append(time.perf_counter())
        return real(*args, **kwargs)

    monkeypatch.setattr(measure_module, "generate", slow)
    return calls


def test_the_budget_bounds_the_measurement_and_says_what_it_left_out(model, slow_generate):
    auto = Auto(tokens=4, budget=0.4)
    began = time.perf_counter()
    auto.choose(model, ByteTokenizer(), PROMPTS, sampling=SamplingConfig(), max_new_tokens=4,
                batch_size=1)
    spent = time.perf_counter() - began
    # The budget is checked between decodings: at most one candidate's warm-up and batch more.
    assert spent < 0.4 + 0.4, spent
    record = auto.record
    assert record.left_out and "autoregressive" in record.figures
    assert record.choice in record.figures
    line = record.describe()
    assert line.startswith(f"drafter: {record.choice} (measured in ")
    assert "of a 0.4 s budget" in line
    assert line.endswith(f"; {len(record.left_out)} left out by the budget)")

    unbounded = Auto(tokens=4)
    unbounded.choose(model, ByteTokenizer(), PROMPTS[:1], sampling=SamplingConfig(),
                     max_new_tokens=4)
    assert not unbounded.record.left_out
    assert len(unbounded.record.figures) > len(record.figures)


def test_the_budget_is_a_share_of_the_planned_decoding(model, slow_generate):
    auto = Auto(tokens=4, budget=30.0, planned_tokens=40)
    auto.choose(model, ByteTokenizer(), PROMPTS, sampling=SamplingConfig(), max_new_tokens=4,
                batch_size=1)
    expected = 0.1 * 40 / auto.record.figures["autoregressive"]  # 10% of 40 tokens at AR's rate
    assert auto.record.budget == pytest.approx(expected, rel=0.3) and auto.record.budget < 30.0
    assert auto.record.left_out


def test_eval_spends_its_budget_once_and_the_next_run_reuses_the_choice(
        model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    checkpoint = str(export(model, ByteTokenizer(), tmp_path / "export"))
    measured: list[Auto] = []
    real = Auto._measure

    def spy(self, *args):
        measured.append(self)
        return real(self, *args)

    monkeypatch.setattr(Auto, "_measure", spy)

    def run(name: str) -> dict:
        return evaluate(EvalConfig(task="humaneval", checkpoint=checkpoint, limit=2,
                                   max_new_tokens=8, batch_size=1,
                                   output=str(tmp_path / f"{name}.jsonl")))

    first = run("first")
    err = capsys.readouterr().err
    [auto] = measured
    assert auto.budget == AUTO_SECONDS
    # 2 problems x 8 tokens: 10% of that at the autoregressive rate, far under 30 s.
    assert auto.record.budget == pytest.approx(
        0.1 * 16 / auto.record.figures["autoregressive"], rel=0.01)
    choice = first["decoding"].removeprefix("auto -> ")
    assert f"drafter: {choice} (measured in " in err and "tokens/s: " in err
    cache = json.loads((tmp_path / "cache" / "tune.json").read_text())
    assert [e["step"] for e in cache.values()].count("drafter") == 1

    second = run("second")
    assert len(measured) == 1  # not measured again: read from the file
    assert second["decoding"] == first["decoding"]
    assert f"drafter: {choice} (cached, measured in " in capsys.readouterr().err


def test_a_compiled_steps_warm_up_is_not_spent_from_the_budget(model, monkeypatch):
    """On a GPU a compiled candidate's warm-up compiles its step (8.7 s of a 5.6 s budget on
    an H100 left auto nothing to compare): the budget counts only the timed decoding then."""
    real = measure_module.generate

    def compiling_warm_up(*args, compile: bool = False, **kwargs):
        if kwargs["max_new_tokens"] == 2:  # time_generate's untimed warm-up
            time.sleep(0.3)  # "compiling"; the step below runs eagerly either way
        return real(*args, **kwargs)

    monkeypatch.setattr(measure_module, "generate", compiling_warm_up)
    measured = {}
    for compile in (False, True):
        auto = Auto(tokens=4, budget=0.4, compile=compile)
        auto.choose(model, ByteTokenizer(), PROMPTS[:1], sampling=SamplingConfig(),
                    max_new_tokens=4, batch_size=1)
        measured[compile] = len(auto.record.figures)
    assert measured[False] <= 2  # eager: a 0.3 s warm-up is the candidate's own cost
    assert measured[True] > measured[False] + 2
