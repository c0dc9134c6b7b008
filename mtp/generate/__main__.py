"""`python -m mtp.generate checkpoint=DIR prompt='def fib(n):' k=8 temperature=0`.

Arguments are key=value overrides with Hydra's grammar, as in `mtp.train` and `mtp.eval`
(quote values with spaces or punctuation: prompt='def fib(n):'). Streams each continuation
to stdout as it is decoded, then prints its statistics to stderr.

  checkpoint       anything mtp.load reads: an export, a Lightning .ckpt, a Hugging Face Llama
                   directory, Meta's multi-token-prediction layout (required)
  prompt           the prompt; or prompt_file=PATH (.jsonl: one prompt per line)
  max_new_tokens   256
  k                heads used at most; null: every head; 1: autoregressive
  tree             null (the chain of k - 1 drafts), chain, tree8/16/32/64, auto:N (needs the
                   checkpoint's tree.json: python -m mtp.generate.calibrate), a .json file of
                   rank paths, or a list of rank paths, e.g. tree='[[0],[1],[0,0]]'. With
                   neither k nor tree, the fastest configuration tree.json recorded, if any
  acceptance       exact (lossless) or typical (Medusa's; not lossless when sampling)
  temperature      0 (greedy); top_k (null) and top_p (1.0) when sampling
  stop             list of stop strings, e.g. stop='["\\n\\n"]'
  seed             null
  device, dtype    cpu, null (the checkpoint's dtype); e.g. device=cuda dtype=bfloat16
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mtp.checkpoint import load
from mtp.generate.decode import generate
from mtp.generate.output import DecodeStats
from mtp.generate.prompts import read_prompts
from mtp.generate.sampling import SamplingConfig
from mtp.generate.tree import Tree, find_calibration, resolve_tree

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class GenerateArgs:
    checkpoint: str = MISSING
    prompt: str | None = None
    prompt_file: str | None = None
    max_new_tokens: int = 256
    k: int | None = None
    tree: Any = None
    acceptance: str = "exact"
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    device: str = "cpu"
    dtype: str | None = None


Args = TypeVar("Args")


def parse_overrides(argv: list[str], schema: type[Args]) -> Args:
    """key=value overrides (Hydra's grammar) on top of a dataclass's defaults."""
    try:
        values = {o.key_or_group: o.value() for o in OverridesParser.create().parse_overrides(argv)}
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(f"bad arguments {argv}: {e}") from e


def parse_args(argv: list[str]) -> GenerateArgs:
    """key=value overrides (Hydra's grammar) on top of `GenerateArgs`' defaults."""
    args = parse_overrides(argv, GenerateArgs)
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of prompt=... and prompt_file=...")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {args.dtype!r}")
    return args


def describe(stats: DecodeStats, k: int, tree: Tree | None = None) -> str:
    """One line of decoding statistics."""
    rate = stats.new_tokens / stats.seconds if stats.seconds else float("nan")
    heads = " ".join(f"{a:.2f}" for a in stats.head_acceptance)
    line = (f"k={k}: {stats.new_tokens} tokens in {stats.forward_passes} forward passes "
            f"({stats.tokens_per_forward:.2f} tokens/forward), {stats.seconds:.2f} s, "
            f"{rate:.1f} tokens/s; head acceptance {heads}")
    if tree is not None:
        depths = " ".join(map(str, stats.accepted_depths))
        line += (f"; tree {tree.name} ({tree.n_nodes} nodes, {stats.nodes_per_forward:.1f} "
                 f"verified per forward), accepted depths 0.. {depths}")
    return line


def choose_decoding(checkpoint: str, config: Any, k: int | None,
                    tree: Any) -> tuple[int, Tree | None]:
    """k and tree for a checkpoint: as given, else the fastest its tree.json measured.

    Without a tree.json and with neither given: the chain of every head.
    """
    calibration = find_calibration(checkpoint, n_future=config.n_future,
                                   vocab_size=config.vocab_size)
    if k is None and tree is None and calibration is not None and calibration.fastest:
        k, tree = calibration.fastest["k"], calibration.fastest["tree"]
    k = config.n_future if k is None else k
    if tree is None:
        return k, None
    return k, resolve_tree(tree, n_heads=k, vocab_size=config.vocab_size,
                           calibration=calibration)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompt_file)
    model, tokenizer = load(args.checkpoint, device=args.device, dtype=DTYPES.get(args.dtype))
    k, tree = choose_decoding(args.checkpoint, model.config, args.k, args.tree)
    for index, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"\n### prompt {index}", flush=True)
        print(prompt, end="", flush=True)
        [result] = generate(model, tokenizer, [prompt], max_new_tokens=args.max_new_tokens, k=k,
                            sampling=sampling, stop=args.stop, seed=args.seed,
                            on_text=lambda _, text: print(text, end="", flush=True), tree=tree,
                            acceptance=args.acceptance)
        print(flush=True)
        print(f"[{result.finish_reason}] {describe(result.stats, k, tree)}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
