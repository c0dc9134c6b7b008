"""Greedy decoding speed against transformers, on the same weights, prompts, dtype and threads.

    python scripts/bench_hf.py checkpoint=runs/byte8/export           # any mtp.load layout
    python scripts/bench_hf.py random_bpe_model=true                    # ~65M params, 32k BPE
    python scripts/bench_hf.py checkpoint=DIR humaneval=20              # HumanEval prompts
    python scripts/bench_hf.py checkpoint=DIR device=cuda dtype=bfloat16 compile=true
    python scripts/bench_hf.py checkpoint=DIR humaneval=10 static=false   # no compiling

The model is exported with `mtp.export_hf` and loaded back with transformers'
`AutoModelForCausalLM` in the same dtype. Each prompt is decoded alone (batch 1, greedy), from
the same input ids to EOS or `max_new_tokens`, by transformers' `generate`, by it with its
compiled static cache, by its prompt lookup, and by mtp at every k up to n_future. Repeats run
every method in turn after a warm-up; figures are medians of new tokens/s. `identical`: every
method produced the same ids; `distinct_4grams` (distinct / total 4-grams): speed-ups on
looping text are not representative. Prints a table, then one JSON line.

Arguments are key=value (`mtp.cli`'s grammar); how it decodes (device, dtype, threads) is
below.
  checkpoint       anything mtp.load reads; or random_bpe_model=true: untrained, a 32k BPE
                   vocabulary trained on bpe_corpus_mb (16) MB of the stdlib, ~65M parameters
  prompts          data/prompts/code.jsonl; humaneval=N: the first N HumanEval prompts instead
  max_new_tokens   128
  prompt_lookup_tokens   10: transformers' prompt_lookup_num_tokens
  repeats          3
  compile          false: mtp's compiled decode step (CUDA graphs on a GPU) with true
  static           true: transformers' compiled static-cache generate (false leaves it out:
                   compiling a large model on a CPU takes minutes)
"""

from __future__ import annotations

import json
import statistics
import sysconfig
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from mtp import cli
from mtp.bench.decoding import KEYS, Decoding, take_turns
from mtp.bench.hf import hf_model, static_compiled, time_hf
from mtp.bench.prompts import CODE_PROMPTS, humaneval_prompts
from mtp.decode.drafters.registry import DrafterSpec
from mtp.generate.measure import time_generate
from mtp.generate.prompts import read_prompts
from mtp.generate.session import open_decoder
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import BPETokenizer


@dataclass(frozen=True, kw_only=True)
class HfBenchArgs(Decoding):
    checkpoint: Path | None = None
    random_bpe_model: bool = False
    bpe_corpus_mb: float = 16.0
    prompts: Path = CODE_PROMPTS
    humaneval: int = 0
    max_new_tokens: int = 128
    prompt_lookup_tokens: int = 10
    repeats: int = 3
    compile: bool = False
    static: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if (self.checkpoint is None) == (not self.random_bpe_model):
            raise ValueError("give checkpoint=... or random_bpe_model=true (one of them)")
        cli.check_positives(self, "max_new_tokens", "prompt_lookup_tokens", "repeats")
        cli.check_positive("humaneval", self.humaneval, least=0)


parse_args = partial(cli.parse, schema=HfBenchArgs)


def random_bpe_model(corpus_mb: float, device: torch.device,
                     dtype: torch.dtype | None) -> tuple[MTPModel, BPETokenizer]:
    """An untrained ~65M-parameter model (4 heads) with a 32k BPE trained on Python's stdlib."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        texts.append(path.read_text(errors="replace"))
        size += len(texts[-1])
        if size > corpus_mb * 1e6:
            break
    tokenizer = BPETokenizer.train(texts, vocab_size=32_000)
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=tokenizer.vocab_size, dim=512, n_layers=6, n_heads=8,
                       n_kv_heads=8, n_future=4, max_seq_len=2048)
    return MTPModel(config).to(device=device, dtype=dtype).eval(), tokenizer


def distinct_4grams(outputs: list[list[int]]) -> float:
    grams = [tuple(ids[i:i + 4]) for ids in outputs for i in range(len(ids) - 3)]
    return len(set(grams)) / max(len(grams), 1)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    import transformers

    device = torch.device(args.device)
    prompts = humaneval_prompts(args.humaneval) if args.humaneval else read_prompts(args.prompts)
    settings = args.settings()
    loaded = random_bpe_model(args.bpe_corpus_mb, device, settings.load_dtype) \
        if args.random_bpe_model else None
    decoder = open_decoder(args.checkpoint, settings, loaded=loaded, prompts=prompts[:1])
    checkpoint = str(args.checkpoint or "random-bpe")
    model, tokenizer = decoder.model, decoder.tokenizer
    dtype_name = cli.dtype_name(next(model.parameters()).dtype)
    inputs = tokenizer.encode_prompts(prompts)  # as mtp's generate
    hf = hf_model(model, tokenizer)

    ks = list(range(2, model.config.n_future + 1))
    hf_options = {"hf": {}, **({"hf_static": static_compiled(device)} if args.static else {}),
                  "hf_prompt_lookup": {"prompt_lookup_num_tokens": args.prompt_lookup_tokens}}
    drafters = {f"mtp_k{k}": DrafterSpec("heads", k=k).build(model) for k in [1, *ks]}
    methods = [*hf_options, *drafters]

    outputs, tokens_per_forward = {}, {}  # each method's last new ids; mtp's tokens per forward

    def run(name: str, n: int = len(prompts), tokens: int = args.max_new_tokens) -> float:
        """New tokens/s of method `name` on the first `n` prompts."""
        if name in hf_options:
            seconds, outputs[name] = time_hf(hf, inputs[:n], tokens, tokenizer, **hf_options[name])
        else:
            timed = time_generate(model, tokenizer, prompts[:n], max_new_tokens=tokens,
                                  drafter=drafters[name], compile=args.compile)
            seconds, outputs[name] = timed.seconds, timed.token_ids
            tokens_per_forward[name] = timed.stats.tokens_per_forward
        return sum(map(len, outputs[name])) / seconds

    compiled = {"hf_static", *(drafters if args.compile else ())}
    with torch.inference_mode():
        for name in methods:  # warm-up: allocator, kernels, compiled shapes
            run(name) if name in compiled else run(name, 1, 16)
        speed = take_turns({name: partial(run, name) for name in methods}, args.repeats)
    median = {name: statistics.median(values) for name, values in speed.items()}
    static = median.get("hf_static")  # None with static=false
    reference = outputs["hf"]
    same = {name: ids == reference for name, ids in outputs.items()}
    best_k = max(ks, key=lambda k: median[f"mtp_k{k}"]) if ks else 1
    new_tokens = sum(map(len, reference))

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"checkpoint {checkpoint}  {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"params  {device_name} {dtype_name}  mtp {'compiled' if args.compile else 'eager'}  "
          f"threads {torch.get_num_threads()}  {len(prompts)} prompts x "
          f"<= {args.max_new_tokens} new tokens ({new_tokens} generated)  repeats "
          f"{args.repeats}  transformers {transformers.__version__}  torch {torch.__version__}")
    print(f"{'method':<20} {'tokens/s':>9} {'vs hf':>7} {'tok/fwd':>8} {'same ids':>9}")
    for name in methods:
        tpf = f"{tokens_per_forward[name]:.2f}" if name in tokens_per_forward else ""
        print(f"{name:<20} {median[name]:>9.1f} {median[name] / median['hf']:>6.2f}x {tpf:>8} "
              f"{str(same[name]):>9}")
    print(json.dumps({
        "hf_tokens_per_second": round(median["hf"], 1),
        "hf_static_tokens_per_second": static and round(static, 1),
        "hf_prompt_lookup_tokens_per_second": round(median["hf_prompt_lookup"], 1),
        "mtp_ar_tokens_per_second": round(median["mtp_k1"], 1),
        "mtp_spec_tokens_per_second": round(median[f"mtp_k{best_k}"], 1),
        "mtp_spec_k": best_k,
        "mtp_spec_tokens_per_forward": round(tokens_per_forward[f"mtp_k{best_k}"], 3),
        "mtp_ar_over_hf": round(median["mtp_k1"] / median["hf"], 3),
        "mtp_ar_over_hf_static": static and round(median["mtp_k1"] / static, 3),
        "mtp_spec_over_hf": round(median[f"mtp_k{best_k}"] / median["hf"], 3),
        "hf_prompt_lookup_over_hf": round(median["hf_prompt_lookup"] / median["hf"], 3),
        "identical": all(same.values()),
        "distinct_4grams": round(distinct_4grams(reference), 3),
        "per_method_tokens_per_second": {name: round(v, 1) for name, v in median.items()},
        "compiled": args.compile, "device": args.device, "device_name": device_name,
        "checkpoint": checkpoint, "dtype": dtype_name, "threads": torch.get_num_threads(),
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "new_tokens": new_tokens, "repeats": args.repeats,
        "transformers": transformers.__version__, "torch": torch.__version__}))


if __name__ == "__main__":
    cli.main(main, __doc__ + KEYS, errors=(ValueError, FileNotFoundError, ImportError))
