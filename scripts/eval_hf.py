"""HumanEval or MBPP pass@1 through transformers' own `generate`, to check `mtp.eval` against.

    python scripts/eval_hf.py checkpoint=SmolLM2-135M-Instruct.Q4_1.gguf \\
        out=runs/hf_humaneval.jsonl compare=outputs/eval/humaneval/<run>/results.jsonl
    python scripts/eval_hf.py checkpoint=... task=mbpp data_file=mbpp.jsonl few_shot=3 \\
        limit=40 out=runs/hf_mbpp.jsonl compare=outputs/eval/mbpp/<run>/results.jsonl

An independent greedy run of the same problems by transformers' model (a GGUF file or a
Hugging Face directory), batch 1. Shared with `mtp.eval`, on purpose, is what defines the
benchmark, not the decoding: the task's prompts and their ids (mtp's `encode_prompt`:
transformers' GGUF tokenizer splits SmolLM2's digits otherwise), the stop rule (EOS,
`max_new_tokens`, or a task's stop string in the new text) and the scoring (`mtp.eval`'s
sandbox and pass@k on the completions as a samples file). Each completion is appended to
`out` as it is made (a rerun resumes); `compare` (an `mtp.eval` results file) compares them
problem by problem. Prints a table, then one JSON line.

Arguments are key=value (`mtp.cli`'s grammar):
  checkpoint       a GGUF file or a Hugging Face Llama directory (required)
  out              the samples (JSON lines) to write; scored results go beside it (required)
  compare          an mtp.eval results file (null: no comparison)
  task             humaneval (default) or mbpp; data_file, few_shot (0), limit (null) as
                   mtp.eval's
  max_new_tokens   512
  device           cpu (default), cuda
  dtype            null: as mtp.eval (bfloat16 on a GPU, else the checkpoint's: float32);
                   float32, bfloat16, float16
  threads          null: torch's
  isolation        auto: mtp.eval's sandbox isolation
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from omegaconf import MISSING

from mtp import cli
from mtp.bench.decoding import Decoding
from mtp.checkpoint import load
from mtp.data.benchmarks import load_task
from mtp.eval import EvalConfig, evaluate
from mtp.eval.passk import mean_pass_at_k
from mtp.interop.gguf import is_gguf
from mtp.paths import read_jsonl


@dataclass(frozen=True, kw_only=True)
class EvalHfArgs(Decoding):
    checkpoint: Path = MISSING
    out: Path = MISSING
    compare: Path | None = None
    task: str = "humaneval"
    data_file: str | None = None
    few_shot: int = 0
    limit: int | None = None
    max_new_tokens: int = 512
    threads: int | None = None  # torch's
    isolation: str = "auto"

    def __post_init__(self) -> None:
        cli.check_choice("task", self.task, ("humaneval", "mbpp"))
        cli.check_positive("few_shot", self.few_shot, least=0)
        cli.check_positive("max_new_tokens", self.max_new_tokens)
        cli.check_positives(self, "limit", "threads", optional=True)
        cli.parse_dtype(self.dtype)  # a dtype by name: not auto
        super().__post_init__()

    def load_dtype(self) -> torch.dtype:
        """The dtype mtp.eval would decode in on `device` (float32 for the checkpoint's own)."""
        return self.settings().load_dtype or torch.float32


parse_args = partial(cli.parse, schema=EvalHfArgs)


def load_hf(path: Path, dtype: torch.dtype, device: str):
    """transformers' model and tokenizer for a GGUF file or a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"pretrained_model_name_or_path": path}
    if is_gguf(path):
        where = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype).eval().to(device)
    return model, AutoTokenizer.from_pretrained(**where)


class StopInCompletion:
    """A transformers stopping criterion: a stop string in the text after the prompt.

    (transformers' own `stop_strings` also matches across the prompt's end: a prompt that
    ends in a newline and a first token `def` would stop at once.)
    """

    def __init__(self, tokenizer, prompt_length: int, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.prompt_length, self.stop = tokenizer, prompt_length, stop

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        text = completion_text(self.tokenizer, input_ids[0, self.prompt_length:].tolist())
        done = any(s in text for s in self.stop)
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def completion_text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """The completion: the text before the first stop string (Chen et al. 2021)."""
    hits = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(hits)] if hits else text


def generate_one(model, tokenizer, ids: list[int], stop: tuple[str, ...],
                 max_new_tokens: int) -> tuple[str, list[int]]:
    """transformers' greedy continuation of `ids`: the completion and its new token ids."""
    from transformers import StoppingCriteriaList

    tensor = torch.tensor([ids], device=model.device)
    out = model.generate(tensor, attention_mask=torch.ones_like(tensor), do_sample=False,
                         max_new_tokens=max_new_tokens,
                         stopping_criteria=StoppingCriteriaList(
                             [StopInCompletion(tokenizer, len(ids), stop)]))
    new = out[0, len(ids):].tolist()
    return cut_at_stop(completion_text(tokenizer, new), stop), new


def compare(ours: dict[str, dict], theirs_file: Path) -> dict:
    """Problem-by-problem comparison with an `mtp.eval` results file (first sample each)."""
    theirs = {str(record["task_id"]): record for record in read_jsonl(theirs_file)
              if record.get("sample", 0) == 0}
    common = [key for key in ours if key in theirs]
    if not common:
        raise ValueError(f"{theirs_file} has none of the {len(ours)} problems")
    differ = [key for key in common if ours[key]["completion"] != theirs[key]["completion"]]
    # mtp counts the token that completed a stop string, as the criterion here stops on it.
    lengths = [key for key in common if ours[key]["new_tokens"] != theirs[key]["new_tokens"]]
    mtp_counts = {key: (1, int(theirs[key]["passed"])) for key in common}
    return {"compared": len(common), "identical": len(common) - len(differ),
            "different": differ, "different_lengths": lengths,
            "mtp_pass@1": mean_pass_at_k(mtp_counts, [1])[1]}


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    dtype = args.load_dtype()
    task = load_task(args.task, args.data_file, args.few_shot)
    problems = list(task.problems.values())[:args.limit]
    _, tokenizer = load(args.checkpoint)  # mtp's prompt ids, as mtp.eval encodes them
    model, their_tokenizer = load_hf(args.checkpoint, dtype, args.device)

    done = {str(r["task_id"]): r for r in read_jsonl(args.out)} if args.out.exists() else {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with args.out.open("a") as f, torch.inference_mode():
        for problem in (p for p in problems if str(p.task_id) not in done):  # a rerun resumes
            ids = tokenizer.encode_prompt(problem.prompt)
            began = time.perf_counter()
            completion, new = generate_one(model, their_tokenizer, ids, task.stop,
                                           args.max_new_tokens)
            record = {"task_id": problem.task_id, "completion": completion,
                      "new_tokens": len(new), "seconds": time.perf_counter() - began}
            f.write(json.dumps(record) + "\n")
            f.flush()
            done[str(problem.task_id)] = record
            print(f"{problem.task_id:<15} {len(new):>4} new tokens  {record['seconds']:6.1f} s",
                  file=sys.stderr, flush=True)
    generated = time.perf_counter() - started

    results = args.out.with_name(args.out.stem + ".results.jsonl")
    summary = evaluate(EvalConfig(task=args.task, samples=str(args.out), output=str(results),
                                  data_file=args.data_file, few_shot=args.few_shot,
                                  limit=args.limit, isolation=args.isolation))
    ours = {str(p.task_id): done[str(p.task_id)] for p in problems}
    tokens = sum(r["new_tokens"] for r in ours.values())
    seconds = sum(r["seconds"] for r in ours.values())
    stats = {"task": args.task, "pass@1": summary["pass@1"], "problems": summary["problems"],
             "max_new_tokens": args.max_new_tokens, "new_tokens": tokens,
             "tokens_per_second": round(tokens / seconds, 2) if seconds else None,
             "seconds_this_run": round(generated, 1), "checkpoint": str(args.checkpoint),
             "samples": str(args.out), "results": str(results),
             "transformers": transformers.__version__, "torch": torch.__version__,
             "device": args.device, "dtype": cli.dtype_name(dtype),
             "threads": torch.get_num_threads()}
    if args.compare:
        stats.update(compare(ours, args.compare))
        print(f"completions identical to {args.compare}: {stats['identical']}/"
              f"{stats['compared']}; pass@1 transformers {stats['pass@1']:.4f}, "
              f"mtp {stats['mtp_pass@1']:.4f}"
              + (f"; different: {', '.join(stats['different'])}" if stats["different"] else ""))
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    cli.main(main, __doc__, errors=(ValueError, FileNotFoundError, ImportError))
