"""`python -m mtp.eval task=humaneval checkpoint=DIR ...`: generate, execute, report pass@k.

Arguments are key=value overrides with Hydra's grammar (`mtp.cli`), e.g.
`samples_per_problem=10 temperature=0.8 pass_k=[1,10]`.

  task               humaneval | mbpp | polynomial | induction (the paper's synthetic tasks,
                     scored greedily: limit= problems per m (2000) or stories (1000); m=[1,2])
  checkpoint         an exported directory, a Lightning .ckpt, anything mtp.load reads
  samples            score this JSON-lines file of {"task_id", "completion"} instead
  output             per-sample results (JSON lines; rerun with the same output= to resume);
                     default outputs/eval/TASK/DATE_TIME/results.jsonl
  data_file          local data: mbpp.jsonl (default: the Hub), HumanEval.jsonl(.gz)
  few_shot           0 (MBPP: 3 reproduces Austin et al. 2021's prompt)
  samples_per_problem  1;  pass_k  [1] (each <= samples_per_problem)
  temperature, top_p   0 (greedy), 1.0; use e.g. temperature=0.8 with several samples
  max_new_tokens     512
  batch_size         8 samples generated together (several problems, several samples each)
  limit              only the first N problems
  seed               0
  timeout            10 seconds per program (wall clock; CPU time is limited alike)
  workers            parallel programs (null: one per CPU core)
  isolation          auto | namespaces (no network, read-only files, own PIDs) | none

How it decodes takes the keys of `python -m mtp.generate` (drafter=auto and its options,
device, dtype, threads, compile, acceptance, exact, width, budget): `python -m mtp.generate
--help`.
"""

from mtp import cli
from mtp.decode.drafters.registry import option_owners
from mtp.eval.runner import EvalConfig, evaluate


def parse_args(argv: list[str]) -> EvalConfig:
    """key=value overrides on top of `EvalConfig`'s defaults, the drafters' options among
    them."""
    return cli.parse(argv, EvalConfig, extra=option_owners(), extra_field="options")


def main(argv: list[str]) -> None:
    evaluate(parse_args(argv))


if __name__ == "__main__":
    cli.main(main, __doc__)
