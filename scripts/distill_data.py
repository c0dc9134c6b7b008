"""Self-distillation data: the base model's own continuations of a corpus's prompts (Medusa).

    python scripts/distill_data.py checkpoint=runs/byte1/export out=data/distill/byte1.jsonl
    python scripts/distill_data.py checkpoint=... temperature=0.7 top_p=0.95 prompts=2000
    python scripts/distill_data.py checkpoint=... source=local 'paths=[corpus/**/*.py]'
    python scripts/distill_data.py checkpoint=model.gguf prompts_from=functions ...
    python scripts/distill_data.py checkpoint=model.gguf prompts_from=mbpp \\
        mbpp_file=path/to/mbpp.jsonl ...
    python -m mtp.train +experiment=medusa1 init_from=runs/byte1/export \\
        data=local 'data.source.paths=[data/distill/byte1.jsonl]'

Medusa trains its heads on the model's own outputs when its training data is unknown (or to
teach them what the model will say). The prompts (`prompts_from`, chosen with `seed`) never
come from the corpus's validation split:
- `windows`: `prompt_chars` characters starting at a line of a training-split document;
- `functions`: a top-level function's `def` line(s) and docstring (HumanEval's form) from the
  corpus's Python documents, up to `prompt_chars`;
- `mbpp`: MBPP's train split (task ids 601-974 of `mbpp_file` or $MTP_MBPP_FILE) in that
  form, the task's text as the docstring: never its test or validation split.
Each prompt is continued for `max_new_tokens` tokens, the heads drafting when there are
several. Each record is {"text", "prompt", "continuation", "source", "finish_reason"}
(`data=local` reads its "text"). Prints a table, then one JSON line.

Arguments are key=value (`mtp.cli`'s grammar):
  checkpoint       the base model: anything mtp.load reads (required)
  out              the JSON lines file to write (required)
  prompts_from     windows (default), functions or mbpp (above)
  prompts          512 prompts; prompt_chars: a window's length (256) or the longest
                   function prompt (1000)
  val_fraction     0.01: the data pipeline's split, whose validation documents give no
                   prompt; split_seed (0): the data pipeline's data.seed
  max_new_tokens   256;  batch_size 16
  k                the heads' tokens per forward (null: every head)
  temperature      0 (greedy); top_k (null) and top_p (1.0) when sampling
  seed             0: the prompts' choice and the sampling
"""

from __future__ import annotations

import ast
import json
import random
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from omegaconf import MISSING
from tqdm import tqdm

from mtp import cli
from mtp.bench.decoding import KEYS as DECODING_KEYS
from mtp.bench.decoding import Decoding
from mtp.data import is_validation
from mtp.data.source_options import KEYS as SOURCE_KEYS
from mtp.data.source_options import SourceOptions
from mtp.decode.output import DecodeStats
from mtp.generate.measure import time_calls
from mtp.generate.session import DecodeSettings, open_decoder
from mtp.paths import read_jsonl

PROMPTS_FROM = ("windows", "functions", "mbpp")


@dataclass(frozen=True, kw_only=True)
class DistillArgs(SourceOptions, Decoding):
    checkpoint: str = MISSING
    out: str = MISSING
    prompts_from: str = "windows"
    val_fraction: float = 0.01
    split_seed: int = 0
    prompts: int = 512
    prompt_chars: int | None = None
    max_new_tokens: int = 256
    batch_size: int = 16
    k: int | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        SourceOptions.__post_init__(self)
        cli.check_choice("prompts_from", self.prompts_from, PROMPTS_FROM)
        cli.check_positives(self, "prompts", "max_new_tokens", "batch_size")
        cli.check_positive("prompt_chars", self.chars)
        self.decoding()  # the drafter, sampling, device, dtype and threads, checked

    @property
    def chars(self) -> int:
        """A prompt's length: `prompt_chars`, else 256 for a window and 1000 for a function."""
        if self.prompt_chars is not None:
            return self.prompt_chars
        return 256 if self.prompts_from == "windows" else 1000

    def decoding(self) -> DecodeSettings:
        """How the continuations are decoded: the heads (k), sampled as asked."""
        return self.settings("heads", options={"k": self.k}, temperature=self.temperature,
                             top_k=self.top_k, top_p=self.top_p, seed=self.seed)


parse_args = partial(cli.parse, schema=DistillArgs)


def pick_prompts(texts: list[tuple[str, str]], n: int, chars: int, seed: int
                 ) -> list[tuple[str, str]]:
    """Up to n (source, prompt) pairs: `chars` characters from a random line start of a
    random document (documents shorter than a prompt are skipped)."""
    rng = random.Random(seed)
    usable = [(source, text) for source, text in texts if len(text) > chars]
    if not usable:
        raise ValueError(f"no document is longer than prompt_chars={chars}")
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
            if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and ast.get_docstring(node)):
                prompt = "".join(lines[node.lineno - 1:node.body[0].end_lineno])
                if len(prompt) <= chars:
                    found.setdefault(prompt.rstrip() + "\n", f"{source}:{node.name}")
    if not found:
        raise ValueError(f"no top-level function with a docstring fits prompt_chars={chars}")
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


def choose_prompts(args: DistillArgs) -> tuple[int, list[tuple[str, str]]]:
    """The corpus's training documents counted, and the (source, prompt) pairs to continue."""
    if args.prompts_from == "mbpp":
        path = args.mbpp()
        if path is None:
            raise ValueError("prompts_from=mbpp needs MBPP's full mbpp.jsonl: mbpp_file=PATH "
                             "or $MTP_MBPP_FILE")
        return 0, mbpp_prompts(path, args.prompts, args.seed)
    documents = args.make_source().load().documents
    ids = documents["id"] if "id" in documents.column_names else range(len(documents))
    texts = [(str(i), t) for i, t in zip(ids, documents["text"])
             if not is_validation(t, args.split_seed, args.val_fraction)]
    pick = pick_prompts if args.prompts_from == "windows" else function_prompts
    return len(texts), pick(texts, args.prompts, args.chars, args.seed)


def main(argv: list[str]) -> dict:
    args = parse_args(argv)
    documents, prompts = choose_prompts(args)
    decoder = open_decoder(args.checkpoint, args.decoding(), prompts=[prompts[0][1]],
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f, tqdm(total=len(prompts), desc="distilling",
                                  unit="prompt") as progress:

        def distil(first: int, batch: list[tuple[str, str]]) -> list:
            outputs = decoder.generate([prompt for _, prompt in batch],
                                       max_new_tokens=args.max_new_tokens, seed=args.seed + first)
            for (source, prompt), output in zip(batch, outputs):
                f.write(json.dumps({"text": prompt + output.text, "prompt": prompt,
                                    "continuation": output.text, "source": source,
                                    "finish_reason": output.finish_reason}) + "\n")
            progress.update(len(batch))
            return outputs

        seconds, outputs = time_calls(distil, prompts, args.batch_size)
    pooled = DecodeStats.pooled([output.stats for output in outputs])
    stats = {"out": str(out), "checkpoint": str(args.checkpoint),
             "prompts_from": args.prompts_from, "documents": documents,
             "prompts": len(prompts), "new_tokens": pooled.new_tokens,
             "tokens_per_second": round(pooled.new_tokens / seconds, 1),
             "tokens_per_forward": round(pooled.tokens_per_forward, 3),
             "finish_reasons": dict(Counter(output.finish_reason for output in outputs)),
             "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
             "seconds": round(seconds, 1), "device": args.device,
             "threads": torch.get_num_threads()}
    print(f"checkpoint {args.checkpoint}  ->  {args.out}")
    for key in ("documents", "prompts", "new_tokens", "tokens_per_second",
                "tokens_per_forward", "finish_reasons", "seconds"):
        print(f"{key:<20} {stats[key]}")
    print(json.dumps(stats))
    return stats


if __name__ == "__main__":
    cli.main(main, __doc__ + DECODING_KEYS + SOURCE_KEYS)
