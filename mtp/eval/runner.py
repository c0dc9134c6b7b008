"""An evaluation run: generate samples (or read a samples file), execute them, report pass@k.

Each problem's samples go to the sandbox as soon as they are generated, and each executed
sample is appended to the results file at once, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

import mtp.eval.synthetic as synthetic
from mtp.checkpoint import load
from mtp.cli import AUTO, check_choice, check_positive, check_positives
from mtp.data.benchmarks import Problem, Task, load_task
from mtp.data.decontaminate import BENCHMARKS
from mtp.eval.passk import check_ks, mean_pass_at_k
from mtp.eval.results import ResultsFile, read_samples
from mtp.eval.sandbox import ISOLATION_LEVELS, ExecResult, Limits, Sandbox
from mtp.generate.session import Decoder, DecodeSettings, open_decoder

TASKS = BENCHMARKS + synthetic.TASKS


@dataclass(frozen=True, kw_only=True)
class EvalConfig(DecodeSettings):
    """One evaluation (`python -m mtp.eval`'s arguments): exactly one of `checkpoint` and
    `samples`; how it decodes is the `DecodeSettings` this extends."""

    task: str = "humaneval"  # humaneval | mbpp | polynomial | induction
    exact: bool | str = AUTO  # exact mode where it costs at most 5% (measured)
    checkpoint: str | None = None
    samples: str | None = None  # score this JSON-lines file of {"task_id", "completion"}
    output: str | None = None  # per-sample results (JSON lines); rerun with it to resume
    data_file: str | None = None
    few_shot: int = 0
    samples_per_problem: int = 1
    pass_k: Any = field(default_factory=lambda: [1])  # pass@k for each k (pass_k=10: [10])
    max_new_tokens: int = 512
    batch_size: int = 8
    limit: int | None = None
    seed: int | None = 0
    timeout: float = Limits.timeout
    workers: int | None = None
    isolation: str = "auto"  # sandbox: namespaces | none | auto (namespaces where they work)
    m: Any = None  # polynomial: the numbers of operations tested (None: 1..10; m=3: [3])

    def __post_init__(self) -> None:
        for name in ("pass_k", "m"):  # one number on the command line means a list of one
            if isinstance(getattr(self, name), int):
                object.__setattr__(self, name, [getattr(self, name)])
        k = self.options.get("k")
        if isinstance(k, (list, tuple)):
            raise ValueError(f"k={list(k)}: k is the heads' tokens per forward pass (as in "
                             f"mtp.generate); pass@k's list is pass_k={list(k)}")
        super().__post_init__()  # how it decodes
        check_choice("task", self.task, TASKS)
        check_choice("isolation", self.isolation, ISOLATION_LEVELS)
        if self.output is None:  # a fresh directory per run, as Hydra's runs have
            run = time.strftime("%Y-%m-%d_%H-%M-%S")
            object.__setattr__(self, "output", f"outputs/eval/{self.task}/{run}/results.jsonl")
        if self.task in synthetic.TASKS:
            check_synthetic(self)
        if (self.checkpoint is None) == (self.samples is None):
            raise ValueError(f"give exactly one of checkpoint= (generate) and samples= (score a "
                             f"file), got checkpoint={self.checkpoint!r}, samples={self.samples!r}")
        check_positives(self, "samples_per_problem", "max_new_tokens", "batch_size")
        if self.limit is not None:
            check_positive("limit", self.limit, need="a positive integer (or null for all "
                           "problems)")
        if self.checkpoint is not None:
            check_ks(self.pass_k, self.samples_per_problem)
            if self.temperature == 0 and self.samples_per_problem > 1:
                raise ValueError(f"samples_per_problem={self.samples_per_problem} at temperature=0 "
                                 f"repeats one greedy sample: set temperature > 0 (e.g. 0.8) for "
                                 f"pass@k with k > 1")

    def run_fields(self) -> dict[str, Any]:
        """What identifies this run in its results file; a resumed run must match it."""
        generating = self.checkpoint is not None
        return {"task": self.task, "checkpoint": _absolute(self.checkpoint),
                "samples_file": _absolute(self.samples),
                "decoding": self.drafter if generating else None,
                "temperature": self.temperature if generating else None,
                "top_p": self.top_p if generating else None, "few_shot": self.few_shot}


def evaluate(config: EvalConfig) -> dict[str, Any]:
    """Run `config`: print a table and a final JSON line; return that summary."""
    if config.task in synthetic.TASKS:
        return evaluate_synthetic(config)
    task = load_task(config.task, config.data_file, config.few_shot)
    problems = list(task.problems.values())[: config.limit]
    limits = Limits(timeout=config.timeout, cpu_seconds=max(1, round(config.timeout)))
    with Sandbox(limits, config.workers, config.isolation) as sandbox, \
            ResultsFile(config.output,
                        {**config.run_fields(), "isolation": sandbox.isolation}) as results:
        decoding = None
        if config.samples is not None:
            problems = _score_samples(config, task, problems, results, sandbox)
        else:
            decoding = _generate_and_score(config, task, problems, results, sandbox)
    summary = summarize(config, results.records, problems, decoding)
    print_summary(summary)
    return summary


def _score_samples(config: EvalConfig, task: Task, problems: list[Problem],
                   results: ResultsFile, sandbox: Sandbox) -> list[Problem]:
    """Execute the samples file's completions; return the problems it attempts."""
    path = config.samples
    samples = read_samples(path)
    unknown = sorted({task_id for task_id, _ in samples} - task.problems.keys())
    if unknown:
        raise ValueError(f"{path}: task ids not in {task.name}: {_listing(unknown)}")
    per_task = Counter(task_id for task_id, _ in samples)
    check_ks(config.pass_k, min(per_task.values()))
    chosen = {str(p.task_id) for p in problems}
    missing = [key for key in task.problems if key in chosen and key not in per_task]
    if missing:
        print(f"warning: {path} has no samples for {len(missing)} of {len(chosen)} problems: "
              f"{_listing(missing)}; pass@k covers the {len(chosen) - len(missing)} attempted",
              file=sys.stderr)
    done = results.done()
    seen: Counter[str] = Counter()
    for task_id, completion in samples:
        index, seen[task_id] = seen[task_id], seen[task_id] + 1
        if task_id in chosen and (task_id, index) not in done:
            problem = task.problems[task_id]
            sandbox.submit((problem, index, completion, {}), problem.program(completion))
    with tqdm(total=len(sandbox), desc=task.name) as progress:
        _record(sandbox.finished(wait=True), results, progress)
    return [p for p in problems if str(p.task_id) in per_task]


def _generate_and_score(config: EvalConfig, task: Task, problems: list[Problem],
                        results: ResultsFile, sandbox: Sandbox) -> str:
    """Generate the missing samples in batches of `batch_size` and execute them; returns the
    decoding used (the checkpoint opened once: drafter=auto measures on the first prompts)."""
    done = results.done()
    todo = [(p, [i for i in range(config.samples_per_problem) if (str(p.task_id), i) not in done])
            for p in problems]
    model, tokenizer = load(config.checkpoint, device=config.device, dtype=config.load_dtype)
    context = model.config.max_seq_len
    progress = tqdm(total=sum(len(indices) for _, indices in todo), desc=task.name)
    too_long, items = [], []
    for problem, indices in todo:
        # generate() needs room for one new token after the prompt (as encode_prompt gives it).
        prompt_tokens = len(tokenizer.encode_prompt(problem.prompt))
        if indices and prompt_tokens >= context:
            too_long.append(str(problem.task_id))
            reason = f"prompt of {prompt_tokens} tokens leaves no room in max_seq_len={context}"
            outcome = ExecResult("failed", reason, "")
            stats = {"finish_reason": "context", "new_tokens": 0, "forward_passes": 0,
                     "tokens_per_forward": 0.0, "seconds": 0.0}
            _record((((problem, i, "", stats), outcome) for i in indices), results, progress)
            continue
        items += [(problem, index) for index in indices]
    decoder = None  # with no sample left to generate, a measured drafter is not measured
    if items or not config.spec.measured:
        decoder = open_decoder(config.checkpoint, config, loaded=(model, tokenizer),
                               prompts=[p.prompt for p, _ in items],
                               batch_size=max(1, min(config.batch_size, len(items))),
                               max_new_tokens=config.max_new_tokens,
                               planned_tokens=len(items) * config.max_new_tokens)
    for start in range(0, len(items), config.batch_size):
        batch = items[start : start + config.batch_size]
        completions = _sample(config, decoder, task, batch)
        for (problem, index), (completion, stats) in zip(batch, completions):
            sandbox.submit((problem, index, completion, stats), problem.program(completion))
        _record(sandbox.finished(), results, progress)
    _record(sandbox.finished(wait=True), results, progress)
    progress.close()
    if too_long:
        print(f"warning: {len(too_long)} prompts do not fit the model's context of {context} "
              f"tokens and count as failed: {_listing(too_long)}", file=sys.stderr)
    return decoder.label if decoder is not None else config.drafter


def _sample(config: EvalConfig, decoder: Decoder, task: Task,
            batch: list[tuple[Problem, int]]) -> list[tuple[str, dict[str, Any]]]:
    """(completion, stats) of each (problem, sample index) of `batch`, generated together."""
    began = time.perf_counter()
    first, index = batch[0]
    generations = decoder.generate(
        [problem.prompt for problem, _ in batch], max_new_tokens=config.max_new_tokens,
        stop=task.stop,
        # Seeded by the batch's first sample, not call order: reruns and resumed runs agree.
        seed=zlib.crc32(f"{config.seed}/{first.task_id}/{index}".encode()))
    share = (time.perf_counter() - began) / len(batch)  # each sample's part of the call
    return [(g.text, {"finish_reason": g.finish_reason, "new_tokens": g.stats.new_tokens,
                      "forward_passes": g.stats.forward_passes,
                      "tokens_per_forward": g.stats.tokens_per_forward, "seconds": share})
            for g in generations]


def _record(finished: Iterator[tuple[Any, ExecResult]], results: ResultsFile,
            progress: tqdm) -> None:
    """Append each executed sample to the results file as it arrives."""
    for (problem, index, completion, stats), outcome in finished:
        results.append({"task_id": problem.task_id, "sample": index, "completion": completion,
                        "passed": outcome.passed, "result": outcome.describe(), **stats})
        progress.update()


def summarize(config: EvalConfig, records: list[dict[str, Any]], problems: list[Problem],
              decoding: str | None) -> dict[str, Any]:
    """pass@k over `problems` from their records, with counts and decoding speed (`decoding`:
    the drafter that generated them)."""
    keys = {str(p.task_id) for p in problems}
    mine = [r for r in records if str(r["task_id"]) in keys]
    if not mine:
        raise ValueError(f"{config.output}: no executed samples to score")
    samples = Counter(str(r["task_id"]) for r in mine)
    passed = Counter(str(r["task_id"]) for r in mine if r["passed"])
    counts = {key: (n, passed[key]) for key, n in samples.items()}
    summary: dict[str, Any] = {"task": config.task}
    summary.update({f"pass@{k}": v for k, v in mean_pass_at_k(counts, config.pass_k).items()})
    summary.update(problems=len(counts), samples=len(mine))
    # The weakest sandbox any counted sample ran in (records from before isolation existed: none).
    levels = {r.get("isolation", "none") for r in mine}
    summary["isolation"] = "namespaces" if levels == {"namespaces"} else "none"
    if config.checkpoint is not None:
        # Pooled over samples, as DecodeStats.pooled does: totals, then one ratio.
        tokens = sum(r["new_tokens"] for r in mine)
        seconds = sum(r["seconds"] for r in mine)
        forwards = sum(r["forward_passes"] for r in mine)
        summary.update(decoding=decoding,
                       tokens_per_second=tokens / seconds if seconds else None,
                       tokens_per_forward=tokens / forwards if forwards else None)
    summary["output"] = str(config.output)
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    """A two-column table, then the summary as one JSON line (the last line of output)."""
    width = max(map(len, summary))
    for key, value in summary.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    print(json.dumps(summary), flush=True)


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).resolve())


def _listing(items: Sequence[str], most: int = 5) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def check_synthetic(config: EvalConfig) -> None:
    """The options a synthetic task's evaluation takes (one-line errors)."""
    if config.samples is not None:
        raise ValueError(f"task={config.task} scores a checkpoint (its argmax); a samples file "
                         f"({config.samples}) has no logits to score")
    if config.temperature != 0:
        raise ValueError(f"task={config.task} is scored greedily: temperature="
                         f"{config.temperature} must be 0")
    if config.m is not None:
        if config.task != "polynomial":
            raise ValueError(f"m={config.m} is the polynomial task's, not {config.task}'s")
        object.__setattr__(config, "m", list(synthetic.check_ms(config.m)))


def evaluate_synthetic(config: EvalConfig) -> dict[str, Any]:
    """`task=polynomial|induction`: score the checkpoint, write one record per problem (or
    story) to `config.output`, print a table and a final JSON line."""
    model, tokenizer = load(config.checkpoint, device=config.device, dtype=config.load_dtype)
    began = time.perf_counter()
    figures, records = synthetic.score(config.task, model, tokenizer, size=config.limit,
                             ms=config.m or synthetic.DEFAULT_MS, batch_size=config.batch_size)
    with ResultsFile(config.output, config.run_fields()) as results:
        done = results.done()
        for record in records:
            if (record["task_id"], 0) not in done:
                results.append({**record, "sample": 0})
    summary = {"task": config.task, **figures, "decoding": "greedy (teacher-forced argmax)",
               "seconds": round(time.perf_counter() - began, 2), "output": str(config.output)}
    print_summary(summary)
    return summary
