"""`python -m mtp.convert to_hf checkpoint=<export, .ckpt, or any layout mtp.load reads> output=<dir>`.

Commands
  to_hf    a Hugging Face LlamaForCausalLM directory (trunk + head 0) with heads 1..n-1 in
           mtp's heads file beside it (`mtp.export_hf`)
  to_mimo  MiMo's layout (`mtp.export_mimo`): a Qwen2 model with zero attention biases, and
           sequential heads as its MTP layers, which vLLM and SGLang serve as drafters
  to_mtp   an mtp export (`mtp.checkpoint.export`), e.g. of a Hugging Face, MiMo or Meta
           checkpoint
  to_medusa  the base model as a Hugging Face Llama directory (`base/`) and heads 1..n-1 as
           Medusa heads for vLLM (`vllm/`) and FasterDecoding / TensorRT-LLM (`medusa/`);
           models with `medusa` heads only (`mtp.checkpoint.export_medusa`)

Arguments (key=value, `mtp.cli`'s grammar)
  checkpoint   what to convert (required)
  output       the directory to write (required)
  dtype        null (keep the stored dtype), float32, bfloat16 or float16
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from mtp import cli
from mtp.checkpoint import export, export_hf, export_medusa, export_mimo, load

COMMANDS = {"to_hf": export_hf, "to_mimo": export_mimo, "to_mtp": export,
            "to_medusa": export_medusa}


@dataclass(frozen=True, kw_only=True)
class ConvertArgs:
    checkpoint: str = MISSING
    output: str = MISSING
    dtype: str | None = None

    def __post_init__(self) -> None:
        cli.parse_dtype(self.dtype)


def parse_args(argv: list[str]) -> tuple[str, ConvertArgs]:
    """The command and its key=value arguments; ValueError naming anything unexpected."""
    if not argv or argv[0] not in COMMANDS:
        raise ValueError(f"the first argument must be a command, one of {sorted(COMMANDS)}; "
                         f"got {argv[:1]}")
    return argv[0], cli.parse(argv[1:], ConvertArgs)


def main(argv: list[str]) -> None:
    command, args = parse_args(argv)
    model, tokenizer = load(args.checkpoint, dtype=cli.parse_dtype(args.dtype))
    output = COMMANDS[command](model, tokenizer, Path(args.output))
    config = model.config
    print(f"wrote {output}: {config.n_layers} trunk layers, {config.n_future} head(s), vocab "
          f"{config.vocab_size}, {next(model.parameters()).dtype}")


if __name__ == "__main__":
    cli.main(main, __doc__, errors=(ValueError, FileNotFoundError, ImportError))
