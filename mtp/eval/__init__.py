"""Evaluation: HumanEval and MBPP pass@k, with generated code run in a sandbox.

`python -m mtp.eval task=mbpp checkpoint=DIR` (options: `--help`), or from Python:
`evaluate(EvalConfig(task="mbpp", checkpoint=DIR, output="results.jsonl"))`.
"""

from mtp.eval.passk import pass_at_k
from mtp.eval.runner import EvalConfig, evaluate
from mtp.eval.sandbox import ExecResult, Limits, Sandbox, resolve_isolation, run_program
from mtp.data.benchmarks import Problem, Task, load_task

__all__ = ["EvalConfig", "ExecResult", "Limits", "Problem", "Sandbox", "Task", "evaluate",
           "load_task", "pass_at_k", "resolve_isolation", "run_program"]
