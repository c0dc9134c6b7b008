import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtp.decode.drafters.registry import option_owners
from mtp.eval.runner import EvalConfig, evaluate
from mtp.eval.sandbox import resolve_isolation
from mtp.paths import mbpp_file

REPO = Path(__file__).resolve().parents[2]

# Hand-written HumanEval samples: HumanEval/0 passes 1 of 4, HumanEval/2 passes 3 of 4. Then
# pass@1 = (1/4 + 3/4) / 2 = 0.5 and pass@2 = ((1 - C(3,2)/C(4,2)) + 1) / 2 = 0.75.
SAMPLES = [
    ("HumanEval/0", "    return any(abs(a - b) < threshold\n"
                    "               for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"),
    ("HumanEval/0", "    return False\n"),
    ("HumanEval/0", "    return True\n"),
    ("HumanEval/0", "    return (\n"),  # syntax error
    ("HumanEval/2", "    return number % 1.0\n"),
    ("HumanEval/2", "    return number - int(number)\n"),
    ("HumanEval/2", "    import math\n    return number - math.floor(number)\n"),
    ("HumanEval/2", "    return number\n"),
]


def write_samples(path: Path, samples: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"task_id": t, "completion": c}) + "\n" for t, c in samples))
    return path


def score(samples: Path, output: Path, **overrides) -> dict:
    return evaluate(EvalConfig(task="humaneval", samples=str(samples), output=str(output), **overrides))


def test_scoring_a_samples_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    summary = score(write_samples(tmp_path / "s.jsonl", SAMPLES), tmp_path / "r.jsonl", pass_k=[1, 2])
    assert summary["pass@1"] == pytest.approx(0.5) and summary["pass@2"] == pytest.approx(0.75)
    assert (summary["problems"], summary["samples"]) == (2, 8)
    out = capsys.readouterr()
    assert json.loads(out.out.splitlines()[-1]) == summary
    assert "no samples for 162 of 164 problems" in out.err
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    by_key = {(r["task_id"], r["sample"]): r for r in records}
    assert len(by_key) == 8 and by_key[("HumanEval/2", 3)]["passed"] is False
    assert by_key[("HumanEval/0", 3)]["result"].startswith("failed: SyntaxError")
    assert by_key[("HumanEval/2", 0)]["result"] == "passed"


def test_interrupted_run_resumes_without_redoing_samples(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "s.jsonl", SAMPLES)
    output = tmp_path / "r.jsonl"
    score(samples, output)
    lines = output.read_text().splitlines()
    kept = [json.loads(line) | {"result": "kept"} for line in lines[:3]]
    # As if killed while writing the fourth line: three records and a torn one.
    output.write_text("".join(json.dumps(r) + "\n" for r in kept) + lines[3][:20])
    summary = score(samples, output)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert records[:3] == kept and len(records) == 8
    assert len({(r["task_id"], r["sample"]) for r in records}) == 8
    assert summary["pass@1"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="holds results of another run"):
        score(write_samples(tmp_path / "other.jsonl", SAMPLES), output)


def test_bad_samples_files(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=f"{empty}: no samples"):
        score(empty, out)
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"task_id": "HumanEval/0", "completion": "x"}\n{"task_id": \n')
    with pytest.raises(ValueError, match=f"{malformed}:2: not valid JSON"):
        score(malformed, out)
    no_completion = write_samples(tmp_path / "nc.jsonl", [])
    no_completion.write_text('\n{"task_id": "HumanEval/0"}\n')
    with pytest.raises(ValueError, match=f"{no_completion}:2: needs a 'task_id' and a string"):
        score(no_completion, out)
    unknown = write_samples(tmp_path / "u.jsonl", [("HumanEval/0", "x"), ("HumanEval/999", "x")])
    with pytest.raises(ValueError, match="task ids not in humaneval: HumanEval/999"):
        score(unknown, out)
    with pytest.raises(ValueError, match=r"k=\[1, 5\]: every k must lie in 1..4"):
        score(write_samples(tmp_path / "s.jsonl", SAMPLES), out, pass_k=[1, 5])
    assert not out.exists() or out.read_text() == ""


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({}, "exactly one of checkpoint="),
        ({"checkpoint": "c", "samples": "s"}, "exactly one of checkpoint="),
        ({"checkpoint": "c", "drafter": "greedy"}, "unknown drafter 'greedy': choose one of auto, "),
        ({"checkpoint": "c", "pass_k": [1, 10], "samples_per_problem": 5, "temperature": 0.8},
         r"k=\[1, 10\]"),
        ({"checkpoint": "c", "k": [1, 10]}, r"pass@k's list is pass_k=\[1, 10\]"),
        ({"checkpoint": "c", "samples_per_problem": 4}, "samples_per_problem=4 at temperature=0"),
        ({"checkpoint": "c", "limit": 0}, "limit=0"),
        ({"checkpoint": "c", "dtype": "int8"}, "dtype='int8' is not one of"),
        ({"checkpoint": "c", "k": 0}, "k must be an integer >= 1, 'auto' or None .* got 0"),
        ({"checkpoint": "c", "k": "many"}, "k must be an integer >= 1, 'auto' or None"),
        ({"checkpoint": "c", "drafter": "lookahead", "k": 2}, "k=2 sizes heads"),
        ({"checkpoint": "c", "acceptance": "medusa"}, "acceptance must be one of"),
    ],
)
def test_bad_settings_fail_before_any_work(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**{"task": "mbpp", "output": "unused.jsonl", **overrides})
    with pytest.raises(ValueError, match="task='sums' is not one of humaneval, mbpp, "):
        EvalConfig(task="sums", checkpoint="c")


def _config(**settings) -> EvalConfig:
    """An EvalConfig from flat keys, as the command line takes them: the drafters' options
    among them."""
    owners = option_owners()
    options = {key: settings.pop(key) for key in list(settings) if key in owners}
    return EvalConfig(**settings, options=options)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m mtp.eval ARGS` from the repository's root."""
    return subprocess.run([sys.executable, "-m", "mtp.eval", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_scores_a_samples_file(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "s.jsonl", SAMPLES[4:])
    run = run_cli("task=humaneval", f"samples={samples}", "pass_k=[1,4]",
                  f"output={tmp_path / 'r.jsonl'}")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.splitlines()[-1])
    assert summary["pass@1"] == pytest.approx(0.75) and summary["pass@4"] == 1.0
    assert re.search(r"^pass@1 +0\.7500$", run.stdout, re.MULTILINE)


def test_summary_states_the_weakest_isolation_any_sample_ran_in(tmp_path: Path) -> None:
    samples = write_samples(tmp_path / "s.jsonl", SAMPLES)
    output = tmp_path / "r.jsonl"
    level = resolve_isolation("auto")
    assert score(samples, tmp_path / "fresh.jsonl")["isolation"] == level
    assert score(samples, output, isolation="none")["isolation"] == "none"
    lines = output.read_text().splitlines()
    assert all(json.loads(line)["isolation"] == "none" for line in lines)
    output.write_text("\n".join(lines[:4]) + "\n")  # half done without isolation, resumed with it
    assert score(samples, output)["isolation"] == "none"


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"task_id": \n')
    run = run_cli("task=humaneval", f"samples={malformed}", f"output={tmp_path / 'r.jsonl'}")
    assert run.returncode == 1
    assert run.stderr == f"error: {malformed}:1: not valid JSON (Expecting value): " \
                         f"'{{\"task_id\":'\n"


MBPP_FILE = mbpp_file()
needs_mbpp = pytest.mark.skipif(MBPP_FILE is None, reason="MBPP data not found: set "
                                "$MTP_MBPP_FILE or put it in ../shared/data/mbpp")


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> str:
    """A random tiny byte-level model, exported as `python -m mtp.train` would."""
    import torch

    from mtp.checkpoint import export
    from mtp.model import MTPConfig, MTPModel
    from mtp.tokenizers import ByteTokenizer

    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=640, n_future=4, head_layers=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a width-32 model: more threads only spin against each other
    yield str(export(MTPModel(config), ByteTokenizer(), tmp_path / "tiny"))
    torch.set_num_threads(threads)


@needs_mbpp
@pytest.mark.parametrize(("drafter", "k", "decoding"),
                         [("heads", None, "heads(k=4)"), ("heads", 1, "autoregressive"),
                          ("autoregressive", None, "autoregressive"),
                          ("prompt_lookup", None, "prompt_lookup(num_draft=8, max_ngram=4, "
                                                  "min_ngram=2)"),
                          ("lookahead", None, "lookahead(window=5, ngram=4, guesses=5)")])
def test_generating_with_a_tiny_model(tmp_path: Path, tiny_checkpoint: str, drafter: str,
                                      k: int | None, decoding: str) -> None:
    output = tmp_path / "r.jsonl"
    config = _config(task="mbpp", checkpoint=tiny_checkpoint, data_file=str(MBPP_FILE),
                     output=str(output), limit=2, samples_per_problem=2, pass_k=[1, 2],
                     temperature=0.8, drafter=drafter, k=k, max_new_tokens=8,
                     batch_size=3)  # one batch holds two problems
    summary = evaluate(config)
    assert (summary["problems"], summary["samples"], summary["decoding"]) == (2, 4, decoding)
    assert summary["pass@1"] == 0.0  # random weights write no working code
    assert summary["tokens_per_second"] > 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted((r["task_id"], r["sample"]) for r in records) == [(t, i) for t in (11, 12) for i in range(2)]
    assert all(0 < r["new_tokens"] <= 8 and r["finish_reason"] in ("length", "stop", "eos") for r in records)
    if decoding == "autoregressive":  # one token per forward pass
        assert all(r["forward_passes"] == r["new_tokens"] for r in records)
        assert summary["tokens_per_forward"] == 1.0
    assert evaluate(config) == summary  # everything done: a rerun only re-reads the results


@needs_mbpp
def test_prompts_longer_than_the_context_count_as_failed(tmp_path: Path, tiny_checkpoint: str,
                                                         capsys: pytest.CaptureFixture) -> None:
    summary = evaluate(EvalConfig(task="mbpp", checkpoint=tiny_checkpoint, data_file=str(MBPP_FILE),
                                  output=str(tmp_path / "r.jsonl"), limit=2, few_shot=3,
                                  max_new_tokens=8))
    assert summary["pass@1"] == 0.0 and summary["samples"] == 2
    assert "2 prompts do not fit the model's context of 640 tokens" in capsys.readouterr().err
    record = json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])
    assert record["finish_reason"] == "context" and "leaves no room in max_seq_len=640" in record["result"]


@needs_mbpp
def test_cli_end_to_end_with_a_tiny_model(tmp_path: Path, tiny_checkpoint: str) -> None:
    output = tmp_path / "r.jsonl"
    run = run_cli("task=mbpp", f"checkpoint={tiny_checkpoint}", f"data_file={MBPP_FILE}",
                  "limit=2", "samples_per_problem=2", "temperature=0.8", "pass_k=[1,2]",
                  "max_new_tokens=8", f"output={output}",
                  env={**os.environ, "OMP_NUM_THREADS": "1", "MTP_CACHE": str(tmp_path / "cache")})
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout.splitlines()[-1])
    assert {k: summary[k] for k in ("task", "problems", "samples", "pass@1", "pass@2")} == {
        "task": "mbpp", "problems": 2, "samples": 4, "pass@1": 0.0, "pass@2": 0.0}
    assert summary["decoding"].startswith("auto -> ")  # the default measured its candidates
    choice = summary["decoding"].removeprefix("auto -> ")
    assert f"drafter: {choice} (measured in " in run.stderr  # once, before decoding
    assert "drafter|" in (tmp_path / "cache" / "tune.json").read_text()
    assert summary["tokens_per_forward"] >= 1 and summary["tokens_per_second"] > 0
    assert len(output.read_text().splitlines()) == 4
    assert "mbpp: 100%" in run.stderr  # the progress bar


@needs_mbpp
def test_generating_with_a_candidate_tree(tmp_path: Path, tiny_checkpoint: str) -> None:
    config = _config(task="mbpp", checkpoint=tiny_checkpoint, data_file=str(MBPP_FILE),
                     output=str(tmp_path / "r.jsonl"), limit=1, drafter="heads",
                     tree="tree8", max_new_tokens=8)
    summary = evaluate(config)
    assert summary["decoding"] == "heads(tree=tree8)" and summary["samples"] == 1
