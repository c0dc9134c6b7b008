"""Self-distillation data: the base model's own continuations of a corpus's prompts (Medusa).

    python scripts/distill_data.py --checkpoint runs/byte1/export --out data/distill/byte1.jsonl
    python scripts/distill_data.py --checkpoint ... --temperature 0.7 --top-p 0.95 --prompts 2000
    python scripts/distill_data.py --checkpoint ... --source local --paths 'corpus/**/*.py'
    python scripts/distill_data.py --checkpoint model.gguf --prompts-from functions ...
    python scripts/distill_data.py --checkpoint model.gguf --prompts-from mbpp \\
        --mbpp-file ../shared/data/mbpp/mbpp.jsonl ...
    python -m mtp.train +experiment=medusa1 init_from=runs/byte1/export \\
        data=local 'data.source.paths=[data/distill/byte1.jsonl]'

When the base model's training data is unknown (or to teach the heads what the model will
actually say rather than what the corpus says), Medusa trains its heads on the model's own
outputs. The prompts (`--prompts-from`), chosen with `--seed`, never from the validation
split of the corpus as the data pipeline computes it:
- `windows`: `--prompt-chars` characters starting at a line of a training-split document;
- `functions`: HumanEval-style prompts, a top-level function's `def` line(s) and docstring
  (and nothing of its body) from the corpus's Python documents, up to `--prompt-chars`
  characters (the stdlib has about 2,200 of them);
- `mbpp`: MBPP's train split (task ids 601-974 of `--mbpp-file`, the full `mbpp.jsonl`) in
  the same form: the reference solution's signature, the task's text as the docstring.
  Never the test split (11-510) that `mtp.eval task=mbpp` scores, nor the validation split
  (511-600) that data/prompts/calibration.jsonl calibrates trees on.
Neither corpus holds a HumanEval problem. Each prompt is continued for `--max-new-tokens`
tokens in batches of `--batch-size`, greedily or sampled (`--temperature`, `--top-k`,
`--top-p`), with the model's heads drafting when it has several (same output
distribution). Every record of the JSON lines file is {"text": prompt + continuation,
"prompt", "continuation", "source", "finish_reason"}: `data=local` reads its "text".
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from mtp.checkpoint import load
from mtp.data import is_validation
from mtp.data.source_options import add_source_arguments, make_source
from mtp.jsonl import read_jsonl
from mtp.generate import DrafterSpec, SamplingConfig, generate


def pick_prompts(texts: list[tuple[str, str]], n: int, chars: int, seed: int
                 ) -> list[tuple[str, str]]:
    """Up to n (source, prompt) pairs: `chars` characters from a random line start of a
    random document (documents shorter than a prompt are skipped)."""
    rng = random.Random(seed)
    usable = [(source, text) for source, text in texts if len(text) > chars]
    if not usable:
        raise ValueError(f"no document is longer than --prompt-chars={chars}")
    prompts = []
    for source, text in (rng.choice(usable) for _ in range(n)):
        starts = [0] + [i + 1 for i, c in enumerate(text[:len(text) - chars]) if c == "\n"]
        start = rng.choice(starts)
        prompts.append((source, text[start:start + chars]))
    return prompts


def function_prompts(texts: list[tuple[str, str]], n: int, chars: int, seed: int
                     ) -> list[tuple[str, str]]:
    """Up to n (source, prompt) pairs: a top-level function's signature and docstring, as
    HumanEval's prompts are, each at most `chars` characters; distinct, chosen at random."""
    found = {}
    for source, text in texts:
        try:
            module = ast.parse(text)
        except (SyntaxError, ValueError):  # not Python, or Python this interpreter cannot read
            continue
        lines = text.splitlines(keepends=True)
        for node in module.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                prompt = "".join(lines[node.lineno - 1:node.body[0].end_lineno])
                if len(prompt) <= chars:
                    found.setdefault(prompt.rstrip() + "\n", f"{source}:{node.name}")
    if not found:
        raise ValueError(f"no top-level function with a docstring fits --prompt-chars={chars}")
    chosen = random.Random(seed).sample(sorted(found), min(n, len(found)))
    return [(found[prompt], prompt) for prompt in chosen]


MBPP_TRAIN_IDS = range(601, 975)  # MBPP's train split (Austin et al. 2021)


def mbpp_prompts(path: Path, n: int, seed: int) -> list[tuple[str, str]]:
    """Up to n (source, prompt) pairs from MBPP's train split: the signature of the function
    the first test calls, then the task's text as its docstring."""
    prompts = []
    for row in read_jsonl(path):
        if row["task_id"] not in MBPP_TRAIN_IDS:
            continue
        defs = [line.rstrip() for line in row["code"].replace("\r\n", "\n").split("\n")
                if line.startswith("def ")]
        called = [d for d in defs if d[4:].split("(")[0] + "(" in row["test_list"][0]]
        if called:
            prompts.append((f"mbpp/{row['task_id']}",
                            f'{called[-1]}\n    """{row["text"].strip()}"""\n'))
    if not prompts:
        raise ValueError(f"{path}: no MBPP train-split task (ids 601-974) with a signature")
    return random.Random(seed).sample(prompts, min(n, len(prompts)))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="the base model: an export dir or .ckpt (anything mtp.load reads)")
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file to write")
    add_source_arguments(parser)
    parser.add_argument("--prompts-from", choices=("windows", "functions", "mbpp"),
                        default="windows", help="what a prompt is (module docstring)")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="the data pipeline's split: its validation documents give no prompt")
    parser.add_argument("--split-seed", type=int, default=0, help="the data pipeline's data.seed")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--prompt-chars", type=int,
                        help="a window's length (default 256); the longest function prompt "
                             "(default 1000)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--k", type=int, help="tokens per forward (default: every head)")
    parser.add_argument("--seed", type=int, default=0, help="prompt choice and sampling")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.prompts_from == "mbpp" and args.mbpp_file is None:
        raise SystemExit("--prompts-from mbpp needs --mbpp-file (the full mbpp.jsonl)")
    if args.prompt_chars is None:
        args.prompt_chars = 256 if args.prompts_from == "windows" else 1000
    for name in ("prompts", "prompt_chars", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)

    model, tokenizer = load(args.checkpoint, device=args.device)
    if args.prompts_from == "mbpp":
        texts, prompts = [], mbpp_prompts(Path(args.mbpp_file), args.prompts, args.seed)
    else:
        documents = make_source(args).load().documents
        ids = documents["id"] if "id" in documents.column_names else range(len(documents))
        texts = [(str(i), t) for i, t in zip(ids, documents["text"])
                 if not is_validation(t, args.split_seed, args.val_fraction)]
        pick = pick_prompts if args.prompts_from == "windows" else function_prompts
        prompts = pick(texts, args.prompts, args.prompt_chars, args.seed)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    started, new_tokens, forwards, reasons = time.perf_counter(), 0, 0, Counter()
    with args.out.open("w") as f, tqdm(total=len(prompts), desc="distilling",
                                       unit="prompt") as progress:
        for first in range(0, len(prompts), args.batch_size):
            batch = prompts[first:first + args.batch_size]
            outputs = generate(model, tokenizer, [prompt for _, prompt in batch],
                               max_new_tokens=args.max_new_tokens,
                               drafter=DrafterSpec(drafter="heads", k=args.k),
                               sampling=sampling, seed=args.seed + first)
            for (source, prompt), out in zip(batch, outputs):
                f.write(json.dumps({"text": prompt + out.text, "prompt": prompt,
                                    "continuation": out.text, "source": source,
                                    "finish_reason": out.finish_reason}) + "\n")
                new_tokens += out.stats.new_tokens
                forwards += out.stats.forward_passes
                reasons[out.finish_reason] += 1
            progress.update(len(batch))
    seconds = time.perf_counter() - started

    stats = {"out": str(args.out), "checkpoint": str(args.checkpoint),
             "prompts_from": args.prompts_from, "documents": len(texts),
             "prompts": len(prompts), "new_tokens": new_tokens,
             "tokens_per_second": round(new_tokens / seconds, 1),
             "tokens_per_forward": round(new_tokens / max(forwards, 1), 3),
             "finish_reasons": dict(reasons), "temperature": args.temperature,
             "top_k": args.top_k, "top_p": args.top_p, "seconds": round(seconds, 1),
             "device": args.device, "threads": torch.get_num_threads()}
    print(f"checkpoint {args.checkpoint}  ->  {args.out}")
    for key in ("documents", "prompts", "new_tokens", "tokens_per_second",
                "tokens_per_forward", "finish_reasons", "seconds"):
        print(f"{key:<20} {stats[key]}")
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    main()
