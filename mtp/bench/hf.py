"""transformers on mtp's weights: the model, exported and loaded back, and its timed greedy
`generate` (scripts/bench_hf.py, scripts/bench_methods.py hf=true)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from mtp.checkpoint import export_hf
from mtp.generate.measure import time_calls
from mtp.model import MTPModel
from mtp.tokenizers import Tokenizer


def hf_model(model: MTPModel, tokenizer: Tokenizer) -> Any:
    """transformers' `AutoModelForCausalLM` with `model`'s weights, dtype and device (through
    `mtp.export_hf`; head 0 only)."""
    import transformers

    transformers.logging.set_verbosity_error()
    param = next(model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model, tokenizer, tmp)
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=param.dtype).eval().to(param.device)


def time_hf(model, inputs: list[list[int]], max_new_tokens: int, tokenizer: Tokenizer,
            **options) -> tuple[float, list[list[int]]]:
    """Seconds over all prompts and the new ids of transformers' greedy `generate`."""
    def decode(_: int, batch: list[list[int]]) -> list[list[int]]:
        [ids] = batch
        tensor = torch.tensor([ids], device=model.device)
        out = model.generate(tensor, attention_mask=torch.ones_like(tensor), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_id,
                             pad_token_id=tokenizer.pad_id, **options)
        return [out[0, len(ids):].tolist()]  # waits for the device

    return time_calls(decode, inputs, 1)


def static_compiled(device: torch.device) -> dict:
    """transformers' options for its static cache with a compiled forward (on a CPU,
    `_compile_all_devices` asks it to compile, which it does alone only on accelerators)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True)
    if device.type == "cpu":
        config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}
