from pathlib import Path

import pytest

from mtp.eval.sandbox import Limits, Sandbox
from mtp.data.benchmarks import HUMANEVAL_STOP, Task, load_task
from mtp.paths import mbpp_file

MBPP_FILE = mbpp_file()
needs_mbpp = pytest.mark.skipif(MBPP_FILE is None, reason="MBPP data not found: set "
                                "$MTP_MBPP_FILE or put it in ../shared/data/mbpp")
# Generous: a few MBPP references take ~4 s on a slow, busy CPU.
LIMITS = Limits(timeout=30, cpu_seconds=30)


def failures_of_references(task: Task, limit: int | None = None) -> dict[str, str]:
    """Run each problem's reference solution; return the ones that did not pass."""
    with Sandbox(LIMITS) as sandbox:
        for key, problem in list(task.problems.items())[:limit]:
            sandbox.submit(key, problem.program(problem.reference))
        return {key: r.describe() for key, r in sandbox.finished(wait=True) if not r.passed}


def test_humaneval_problems_and_prompt_format() -> None:
    task = load_task("humaneval")
    assert len(task.problems) == 164 and task.stop == HUMANEVAL_STOP
    problem = task.problems["HumanEval/0"]
    assert problem.prompt.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert problem.program("    return True\n").startswith(problem.prompt + "    return True\n")
    assert problem.test.endswith("check(has_close_elements)")


def test_humaneval_canonical_solutions_all_pass() -> None:  # ~8 s on 2 cores
    assert failures_of_references(load_task("humaneval")) == {}


def test_humaneval_wrong_completion_fails() -> None:
    problem = load_task("humaneval").problems["HumanEval/0"]
    with Sandbox(LIMITS) as sandbox:
        sandbox.submit("wrong", problem.program("    return True\n"))
        [(_, result)] = sandbox.finished(wait=True)
    assert result.status == "failed" and "AssertionError" in result.reason


@needs_mbpp
def test_mbpp_test_split_and_zero_shot_prompt() -> None:
    task = load_task("mbpp", str(MBPP_FILE))
    assert list(task.problems)[0] == "11" and list(task.problems)[-1] == "510"
    assert len(task.problems) == 500 and task.stop == ("[DONE]",)
    problem = task.problems["11"]
    assert problem.prompt == (
        "You are an expert Python programmer, and here is your task: Write a python function to "
        "remove first and last occurrence of a given character from the string. Your code should "
        'pass these tests:\n\nassert remove_Occ("hello","l") == "heo"\n'
        'assert remove_Occ("abcda","a") == "bcd"\nassert remove_Occ("PHP","P") == "H"\n[BEGIN]\n'
    )
    assert problem.program("x = 1").startswith("x = 1\n\n")


@needs_mbpp
def test_mbpp_few_shot_uses_prompt_split_tasks_2_3_4() -> None:
    task = load_task("mbpp", str(MBPP_FILE), few_shot=3)
    prompt = task.problems["11"].prompt
    assert prompt.count("[BEGIN]\n") == 4 and prompt.count("\n[DONE]\n\n") == 3
    assert prompt.index("similar_elements") < prompt.index("is_not_prime") < prompt.index("heap_queue_largest")
    assert "\r" not in prompt
    assert prompt.endswith(load_task("mbpp", str(MBPP_FILE)).problems["11"].prompt)


@needs_mbpp
def test_mbpp_reference_solutions_pass_first_30() -> None:
    assert failures_of_references(load_task("mbpp", str(MBPP_FILE)), limit=30) == {}


@needs_mbpp
@pytest.mark.slow  # ~30 s on 2 cores
def test_mbpp_reference_solutions_all_pass() -> None:
    assert failures_of_references(load_task("mbpp", str(MBPP_FILE))) == {}


@needs_mbpp
def test_mbpp_test_setup_code_runs_before_the_asserts() -> None:
    task = load_task("mbpp", str(MBPP_FILE))
    with_setup = [p for p in task.problems.values() if p.test.split("\n")[0]]
    assert with_setup, "the test split has tasks with test_setup_code"
    assert failures_of_references(Task("mbpp", {str(p.task_id): p for p in with_setup}, ())) == {}


def test_bad_task_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown task 'apps'"):
        load_task("apps")
    with pytest.raises(ValueError, match="few_shot=1: HumanEval is zero-shot"):
        load_task("humaneval", few_shot=1)
    with pytest.raises(ValueError, match="few_shot=5"):
        load_task("mbpp", few_shot=5)
    only_train = tmp_path / "mbpp.jsonl"
    only_train.write_text('{"task_id": 700, "text": "t", "code": "", "test_setup_code": "", "test_list": []}\n')
    with pytest.raises(ValueError, match="no MBPP test-split tasks"):
        load_task("mbpp", str(only_train))
    with pytest.raises(ValueError, match=r"lacks the few-shot tasks \[2, 3\]"):
        load_task("mbpp", str(only_train), few_shot=2)
