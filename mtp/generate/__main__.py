"""`python -m mtp.generate checkpoint=DIR prompt='def fib(n):' drafter=auto temperature=0`.

Arguments are key=value overrides with Hydra's grammar, as in `mtp.train` and `mtp.eval`
(quote values with spaces or punctuation: prompt='def fib(n):'). Streams each continuation
to stdout as it is decoded, then prints its statistics to stderr.

  checkpoint       anything mtp.load reads: an export, a Lightning .ckpt, a Hugging Face Llama
                   directory, Meta's multi-token-prediction layout (required)
  prompt           the prompt; or prompt_file=PATH (.jsonl: one prompt per line)
  max_new_tokens   256
  drafter          auto (default: measures the candidates, keeps the fastest), autoregressive,
                   heads, prompt_lookup, heads+prompt_lookup, draft_model, layer_skip, lookahead
  k                the heads' tokens per forward pass at most; null: every head; auto
  draft_model      a checkpoint sharing the tokenizer (drafter=draft_model, or a candidate of auto)
  num_draft        drafts per step of prompt lookup (8), the draft model (4) or layer_skip
  skip             layer_skip's trunk layers to leave out: a list, or a layer_skip.json (default:
                   the checkpoint's, from python -m mtp.generate.skip_search)
  threshold        draft_model's and layer_skip's draft-exit: stop drafting below this top
                   probability (0: never)
  adaptive         prompt lookup's, draft_model's and layer_skip's drafts per step follow each
                   row's recent acceptance (+2 after a step that kept all, -1 otherwise); false
  online           the heads learn from the target's output between prompts (prompt_file=):
                   greedy output unchanged, sampling lossless; false
  max_ngram, min_ngram   prompt lookup's n-gram sizes (4, 2)
  window, ngram, guesses  lookahead's Jacobi window W (5), n-gram size N (4) and the most
                   n-grams G it verifies per step (5)
  choice_file      where auto caches its choice (default: under ~/.cache/mtp, per checkpoint);
                   calibration= is its old name, accepted until the next release
  tree             the heads' candidate tree: chain, tree8/16/32/64, auto:N (needs the
                   checkpoint's tree.json, from python -m mtp.generate.calibrate), a .json file
                   of rank paths, or a list, e.g. tree='[[0],[1],[0,0]]'. Without it, auto
                   also measures the auto:N trees of a calibrated checkpoint
  acceptance       exact (lossless) or typical (Medusa's; not lossless when sampling)
  compile          run the decode step compiled (CUDA graphs); null (default): on a GPU
  temperature      0 (greedy); top_k (null) and top_p (1.0) when sampling
  stop             list of stop strings, e.g. stop='["\\n\\n"]'
  seed             null
  device, dtype    cpu, null: bfloat16 on a GPU, else the checkpoint's dtype; auto: on a
                   CPU with bf16 arithmetic, float32 or bfloat16, whichever runs the
                   drafter's step width faster (measured)
  threads          intra-op threads; null: measured on a few decode steps and cached
                   (mtp.threads); OMP_NUM_THREADS also fixes it
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import TypeVar

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mtp.checkpoint import load
from mtp.decode.acceptance import typical_thresholds
from mtp.generate.auto import choose_drafter, default_choice_file
from mtp.decode.loop import decoding_compile, decoding_dtype, generate
from mtp.decode.output import DecodeStats
from mtp.generate.prompts import read_prompts
from mtp.decode.sampling import SamplingConfig
from mtp.decode.spec import DrafterSpec
from mtp.decode.tree import find_calibration
from mtp.generate.measure import choose_decode_dtype, choose_decode_threads, step_width

@dataclass(frozen=True, kw_only=True)
class GenerateArgs(DrafterSpec):
    """The command line: a `DrafterSpec` (drafter, k, tree, ...) and how to decode what."""

    drafter: str = "auto"  # DrafterSpec's, measured: see the module docstring
    checkpoint: str = MISSING
    prompt: str | None = None
    prompt_file: str | None = None
    max_new_tokens: int = 256
    choice_file: str | None = None
    calibration: str | None = None  # choice_file's old name (deprecated)
    acceptance: str = "exact"
    compile: bool | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    device: str = "cpu"
    dtype: str | None = None
    threads: int | None = None


# auto measures at most this long (eval also bounds it by its run's expected time; one
# generation is too short a run to size the measurement by, and its choice is cached)
AUTO_SECONDS = 30.0

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
    if args.calibration is not None:  # "calibration" now means the heads' tree.json only
        print("mtp.generate: calibration= is renamed choice_file= and goes in the next "
              "release", file=sys.stderr)
        args = replace(args, choice_file=args.choice_file or args.calibration, calibration=None)
    if (args.prompt is None) == (args.prompt_file is None):
        raise ValueError("give exactly one of prompt=... and prompt_file=...")
    # Errors before anything loads, as the spec's.
    decoding_dtype(args.device, args.dtype)
    typical_thresholds(args.acceptance)
    sampling(args)
    if args.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={args.max_new_tokens} must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"threads={args.threads} must be at least 1 (or null: measured)")
    for string in args.stop:
        if not string:
            raise ValueError(f"stop={args.stop!r}: stop strings must be non-empty")
    return args


def sampling(args: GenerateArgs) -> SamplingConfig:
    """The arguments' sampling settings (checked)."""
    return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def describe(stats: DecodeStats, drafter: str) -> str:
    """One line of decoding statistics."""
    rate = stats.new_tokens / stats.seconds if stats.seconds else float("nan")
    drafts = " ".join(f"{a:.2f}" for a in stats.head_acceptance[1:])
    line = (f"{drafter}: {stats.new_tokens} tokens in {stats.forward_passes} forward passes "
            f"({stats.tokens_per_forward:.2f} tokens/forward), {stats.seconds:.2f} s, "
            f"{rate:.1f} tokens/s" + (f"; draft acceptance {drafts}" if drafts else ""))
    if stats.nodes_per_forward > 1:
        depths = " ".join(map(str, stats.accepted_depths))
        line += (f"; {stats.nodes_per_forward:.1f} tokens verified per forward; forward "
                 f"passes by drafts accepted (0, 1, ...): {depths}")
    return line


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    how = sampling(args)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompt_file)
    args = args.with_saved_choice(args.checkpoint)
    compiled = decoding_compile(args.device, args.compile)
    model, tokenizer = load(args.checkpoint, device=args.device,
                            dtype=decoding_dtype(args.device, args.dtype))
    calibration = find_calibration(args.checkpoint, n_future=model.config.n_future,
                                   vocab_size=model.config.vocab_size)
    # Threads first (auto's measurements and cache key depend on them), for the drafter
    # named, or at one token per step when auto will choose one.
    named = None if args.measured else args.build(model, calibration)
    choose_decode_threads(model, tokenizer, prompts[0], drafter=named, requested=args.threads)
    drafter, auto = named, None
    if args.measured:
        drafter, auto = choose_drafter(
            model, tokenizer, args, prompts[:1], sampling=how,
            max_new_tokens=args.max_new_tokens, calibration=calibration,
            cache_file=args.choice_file or default_choice_file(args.checkpoint),
            compile=compiled, budget=AUTO_SECONDS)
    if auto is not None:
        print(auto.describe(), file=sys.stderr, flush=True)
    if args.dtype == "auto":  # measured at the width of the drafter's steps
        print(choose_decode_dtype(model, width=step_width(drafter)).describe(), file=sys.stderr)
    name = f"auto -> {auto.choice}" if auto is not None else str(drafter or "autoregressive")
    for index, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"\n### prompt {index}", flush=True)
        print(prompt, end="", flush=True)
        [result] = generate(model, tokenizer, [prompt], max_new_tokens=args.max_new_tokens,
                            drafter=drafter, sampling=how, stop=args.stop, seed=args.seed,
                            on_text=lambda _, text: print(text, end="", flush=True),
                            acceptance=args.acceptance, compile=compiled)
        print(flush=True)
        print(f"[{result.finish_reason}] {describe(result.stats, name)}", file=sys.stderr)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"error: {error}")
