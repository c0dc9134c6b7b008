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

Arguments
  checkpoint   what to convert (required)
  output       the directory to write (required)
  dtype        null (keep the stored dtype), float32, bfloat16 or float16
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mtp.checkpoint import export, export_hf, export_medusa, export_mimo, load

COMMANDS = {"to_hf": export_hf, "to_mimo": export_mimo, "to_mtp": export,
            "to_medusa": export_medusa}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ARGUMENTS = ("checkpoint", "output", "dtype")


def parse_args(argv: list[str]) -> tuple[str, dict[str, str]]:
    """The command and its key=value arguments; ValueError naming anything unexpected."""
    if not argv or argv[0] not in COMMANDS:
        raise ValueError(f"the first argument must be a command, one of {sorted(COMMANDS)}; "
                         f"got {argv[:1]}")
    args = {}
    for item in argv[1:]:
        key, sep, value = item.partition("=")
        if not sep or key not in ARGUMENTS:
            raise ValueError(f"expected key=value with key in {list(ARGUMENTS)}, got {item!r}")
        args[key] = value
    for key in ("checkpoint", "output"):
        if not args.get(key):
            raise ValueError(f"missing {key}=...")
    if args.get("dtype", "null") not in ("null", *DTYPES):
        raise ValueError(f"dtype must be null or one of {sorted(DTYPES)}, got {args['dtype']!r}")
    return argv[0], args


def main(argv: list[str]) -> None:
    command, args = parse_args(argv)
    dtype = DTYPES.get(args.get("dtype", "null"))
    model, tokenizer = load(args["checkpoint"], dtype=dtype)
    output = COMMANDS[command](model, tokenizer, Path(args["output"]))
    config = model.config
    print(f"wrote {output}: {config.n_layers} trunk layers, {config.n_future} head(s), vocab "
          f"{config.vocab_size}, {next(model.parameters()).dtype}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError, ImportError) as error:
        sys.exit(f"error: {error}")
