"""`python -m mtp.convert to_hf checkpoint=<export, .ckpt, or what mtp.load reads> output=<dir>`.

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
  to_eagle3  the checkpoint's EAGLE drafter (`python -m mtp.train.eagle`) in the EAGLE-3
           layout that vLLM's `eagle3` and SGLang's `EAGLE3` methods load
           (`mtp.interop.eagle3`); serve it beside the target's `to_hf` directory

Arguments (key=value, `mtp.cli`'s grammar)
  checkpoint   what to convert (required); for to_eagle3, the drafter's target
  output       the directory to write (required)
  dtype        null (keep the stored dtype), float32, bfloat16 or float16
  eagle        to_eagle3's drafter directory (null: the one trained for the checkpoint)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from mtp import cli
from mtp.checkpoint import export, export_hf, export_medusa, export_mimo, load
from mtp.decode.drafters.base import DrafterContext
from mtp.decode.drafters.eagle import EagleDrafter, EagleOptions
from mtp.generate.saved import saved_choices
from mtp.interop.eagle3 import write_eagle3

EAGLE3 = "to_eagle3"
COMMANDS = {"to_hf": export_hf, "to_mimo": export_mimo, "to_mtp": export,
            "to_medusa": export_medusa, EAGLE3: write_eagle3}


@dataclass(frozen=True, kw_only=True)
class ConvertArgs:
    checkpoint: str = MISSING
    output: str = MISSING
    dtype: str | None = None
    eagle: str | None = None

    def __post_init__(self) -> None:
        cli.parse_dtype(self.dtype)


def parse_args(argv: list[str]) -> tuple[str, ConvertArgs]:
    """The command and its key=value arguments; ValueError naming anything unexpected."""
    if not argv or argv[0] not in COMMANDS:
        raise ValueError(f"the first argument must be a command, one of {sorted(COMMANDS)}; "
                         f"got {argv[:1]}")
    args = cli.parse(argv[1:], ConvertArgs)
    if args.eagle is not None and argv[0] != EAGLE3:
        raise ValueError(f"eagle={args.eagle} names the drafter that {EAGLE3} exports, not "
                         f"{argv[0]}'s")
    return argv[0], args


def main(argv: list[str]) -> None:
    command, args = parse_args(argv)
    dtype = cli.parse_dtype(args.dtype)
    model, tokenizer = load(args.checkpoint, dtype=dtype)
    if command == EAGLE3:  # the drafter named, else the one saved for the checkpoint
        context = DrafterContext(saved=saved_choices(Path(args.checkpoint)))
        module = EagleDrafter.found(EagleOptions(eagle=args.eagle), context)
        if module is None:
            raise ValueError(f"no EAGLE drafter for {args.checkpoint}: give eagle=DIR, or "
                             f"train one (python -m mtp.train.eagle checkpoint=...)")
        module.config.check_target(model.config, args.eagle or "the saved EAGLE drafter")
        output = write_eagle3(model.config, tokenizer, module.config.to_dict(),
                              module.state_dict(), model.tok_embeddings.weight,
                              Path(args.output), dtype)
        print(f"wrote {output}: EAGLE-3 drafter for {args.checkpoint}, layers "
              f"{list(module.config.layers)}, draft vocabulary {module.config.draft_vocab_size}")
        return
    output = COMMANDS[command](model, tokenizer, Path(args.output))
    config = model.config
    print(f"wrote {output}: {config.n_layers} trunk layers, {config.n_future} head(s), vocab "
          f"{config.vocab_size}, {next(model.parameters()).dtype}")


if __name__ == "__main__":
    cli.main(main, __doc__, errors=(ValueError, FileNotFoundError, ImportError))
