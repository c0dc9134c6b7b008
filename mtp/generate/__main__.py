"""`python -m mtp.generate checkpoint=DIR prompt='def fib(n):' drafter=auto temperature=0`.

Arguments are key=value overrides with Hydra's grammar, as every mtp command takes them
(`mtp.cli`; quote values with spaces or punctuation: prompt='def fib(n):'). Streams each
continuation to stdout as it is decoded; the choices made to decode it (drafter, dtype,
threads: `mtp.tune` records) and each generation's statistics go to stderr.

  checkpoint       anything mtp.load reads: an export, a Lightning .ckpt, a Hugging Face Llama
                   directory, a GGUF file, Meta's multi-token-prediction layout (required)
  prompt           the prompt; or prompt_file=PATH (.jsonl: one prompt per line, a text or a
                   conversation {"messages": [{"role": ..., "content": ...}, ...]})
  chat             false; true: each text prompt is a user's message, rendered with the
                   model's chat template (its assistant turn opened): chat=true prompt='Hi'
  messages_file    PATH: JSON lines, each a conversation (a list of {role, content}, or
                   {"messages": [...]}) rendered with the model's chat template
  max_new_tokens   256
  stop             list of stop strings, e.g. stop='["\\n\\n"]'
  drafter          auto (default: measures the candidates, keeps the fastest), autoregressive,
                   or a drafter below, with its options
  device           cpu
  dtype            null: the checkpoint's own (bfloat16 on a GPU); float32, bfloat16, float16;
                   auto: on a CPU with bf16 arithmetic, float32 or bfloat16, whichever runs the
                   drafter's step faster (measured)
  threads          auto (measured on a few decode steps, cached) or a count; OMP_NUM_THREADS
                   also fixes it
  compile          run the decode step compiled (CUDA graphs); null (default): on a GPU
  acceptance       exact (SpecInfer's rule, lossless), spectr (SpecTr's, lossless: for the
                   heads' siblings=iid), typical (Medusa's; not lossless when sampling)
  exact            auto (default): exact mode where it decodes within 5% of the plain step's
                   speed (on the kernels: always); true: exact mode, the ids bit for bit those
                   of autoregressive decoding, in any dtype (docs/decoding.md); off the kernels
                   every step then has one width, and the reference is autoregressive decoding
                   at that width; width: that width (null: the drafter's widest step)
  temperature      0 (greedy); top_k (null) and top_p (1.0) when sampling
  seed             null
  budget           the most seconds drafter=auto measures (30)
  kernels          true (default): decode through mtp's compiled CPU kernels, where they
                   build (each row's bits the same in any step and batch, so exact mode is
                   free); false: through torch

The drafters and their options (each option belongs to the drafters that have it; `auto` as
a value measures it, e.g. k=auto):
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from omegaconf import MISSING

from mtp import cli
from mtp.chat import as_conversations, is_conversation
from mtp.checkpoint import load
from mtp.cli import AUTO
from mtp.decode.drafters.registry import option_owners, options_help
from mtp.decode.output import DecodeStats
from mtp.generate.prompts import read_prompts
from mtp.generate.session import DecodeSettings, open_decoder


@dataclass(frozen=True, kw_only=True)
class GenerateArgs(DecodeSettings):
    """The command line: how to decode (`DecodeSettings`) and what."""

    checkpoint: str = MISSING
    exact: bool | str = AUTO
    prompt: str | None = None
    prompt_file: str | None = None
    chat: bool = False
    messages_file: str | None = None
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if sum(v is not None for v in (self.prompt, self.prompt_file, self.messages_file)) != 1:
            raise ValueError("give exactly one of prompt=..., prompt_file=... and "
                             "messages_file=...")
        cli.check_flag("chat", self.chat)
        cli.check_positive("max_new_tokens", self.max_new_tokens)
        if not all(self.stop):
            raise ValueError(f"stop={self.stop!r}: stop strings must be non-empty")


def parse_args(argv: list[str]) -> GenerateArgs:
    """key=value overrides (Hydra's grammar) on top of `GenerateArgs`' defaults, the
    drafters' options among them."""
    return cli.parse(argv, GenerateArgs, extra=option_owners(), extra_field="options")


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


def read_args_prompts(args: GenerateArgs) -> list:
    """The prompts the arguments name: texts, or conversations (`chat`: a text is one
    user's message)."""
    if args.messages_file is not None:
        return read_prompts(args.messages_file, conversations=True)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompt_file)
    return as_conversations(prompts) if args.chat else prompts


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    prompts = read_args_prompts(args)
    loaded = load(args.checkpoint, device=args.device, dtype=args.load_dtype)
    if loaded[1].chat_template is None and any(map(is_conversation, prompts)):
        raise ValueError(f"the model has no chat template (checkpoint {args.checkpoint}); "
                         f"give text prompts without chat=true, or a checkpoint whose "
                         f"tokenizer has one (GGUF tokenizer.chat_template, Hugging Face "
                         f"tokenizer_config.json chat_template)")
    decoder = open_decoder(args.checkpoint, args, loaded=loaded, prompts=prompts[:1],
                           max_new_tokens=args.max_new_tokens)
    for index, prompt in enumerate(prompts):
        if len(prompts) > 1:
            print(f"\n### prompt {index}", flush=True)
        # a conversation: its last message, then the reply
        shown = prompt[-1]["content"] + "\n" if is_conversation(prompt) else prompt
        print(shown, end="", flush=True)
        [result] = decoder.generate([prompt], max_new_tokens=args.max_new_tokens, stop=args.stop,
                                    on_text=lambda _, text: print(text, end="", flush=True))
        print(flush=True)
        print(f"[{result.finish_reason}] {describe(result.stats, decoder.label)}",
              file=sys.stderr)


if __name__ == "__main__":
    cli.main(main, __doc__ + options_help())
