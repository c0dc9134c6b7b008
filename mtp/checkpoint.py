"""Portable checkpoints: export a trained model for inference, and load it back.

An exported directory holds
- `model.safetensors`: the weights (full, unsharded; a tied output weight is stored once);
- `config.json`: `{"format_version", "model": MTPConfig.to_dict(), "tokenizer": {...}}`;
- the tokenizer's own files (`Tokenizer.save`).

`load` reads such a directory, or a Lightning `.ckpt` written by `mtp.train` (its
hyperparameters carry the model config and the checkpoint embeds the tokenizer's files): a
single file, or the sharded folder of `trainer=fsdp` (`mtp.sharded`), with neither Lightning
nor Hydra involved.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mtp.model import MTPConfig, MTPModel
from mtp.sharded import is_sharded_checkpoint, read_sharded_checkpoint
from mtp.tokenizers import Tokenizer, load_tokenizer

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_TIED = "output.weight"  # stored once, as tok_embeddings.weight, when embeddings are tied


def check_vocab(config: MTPConfig, tokenizer: Tokenizer) -> None:
    """Fail unless the model's vocabulary is the tokenizer's."""
    if config.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"model vocab_size={config.vocab_size} does not match the "
                         f"{tokenizer.name} tokenizer's vocab_size={tokenizer.vocab_size}")


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of the parameters; a collective under FSDP (call on every rank)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):  # an FSDP2 DTensor shard
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return state


def tokenizer_files(tokenizer: Tokenizer) -> dict[str, str]:
    """The tokenizer's saved files as {name: text}, to embed in a Lightning checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        return {p.name: p.read_text() for p in sorted(Path(tmp).iterdir())}


def _tokenizer_from_files(files: dict[str, str], source: Path) -> Tokenizer:
    if not files:
        raise ValueError(f"{source} carries no tokenizer: it was not written by mtp.train")
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        return load_tokenizer(tmp)


def export(model: MTPModel, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write `model` and `tokenizer` to `directory` (see the module docstring); return it.

    Under FSDP this gathers the full weights, so call it on every rank; rank 0 writes.
    """
    check_vocab(model.config, tokenizer)
    state = full_state_dict(model)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return Path(directory)
    if model.config.tie_embeddings:
        del state[_TIED]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    meta = {"format_version": FORMAT_VERSION, "model": model.config.to_dict(),
            "tokenizer": {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size}}
    (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    tokenizer.save(directory)
    return directory


def load(path: str | Path, device: str | torch.device = "cpu",
         dtype: torch.dtype = torch.float32) -> tuple[MTPModel, Tokenizer]:
    """The model (in eval mode) and tokenizer from an export or a Lightning checkpoint."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        config, state, tokenizer = _read_export(path)
    elif path.is_file():
        config, state, tokenizer = _read_lightning(path)
    elif is_sharded_checkpoint(path):
        config, state, tokenizer = _from_lightning(read_sharded_checkpoint(path), path)
    elif path.is_dir():
        raise FileNotFoundError(
            f"{path} is a directory without {CONFIG_FILE} (not an export) that is not a sharded "
            f"trainer=fsdp checkpoint either (no meta.pt and .metadata)")
    else:
        raise FileNotFoundError(f"no checkpoint at {path}: expected an exported directory "
                                f"(with {CONFIG_FILE} and {WEIGHTS_FILE}) or a Lightning .ckpt")
    check_vocab(config, tokenizer)
    if config.tie_embeddings:
        state.setdefault(_TIED, state["tok_embeddings.weight"])
    with torch.device("meta"):
        model = MTPModel(config)
    model.to_empty(device=device)  # also builds the rotary tables on `device`
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"weights in {path} do not fit the model config: {e}") from e
    return model.to(dtype=dtype).eval(), tokenizer


def _read_export(directory: Path) -> tuple[MTPConfig, dict[str, torch.Tensor], Tokenizer]:
    try:
        meta = json.loads((directory / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt {directory / CONFIG_FILE}: {e}") from e
    version = meta.get("format_version")
    if version != FORMAT_VERSION or "model" not in meta:
        raise ValueError(f"{directory / CONFIG_FILE} has format_version={version!r}; this "
                         f"version of mtp reads format_version={FORMAT_VERSION}")
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {directory}")
    try:
        state = load_file(str(weights))
    except SafetensorError as e:
        raise ValueError(f"corrupt weights file {weights}: {e}") from e
    return MTPConfig.from_dict(meta["model"]), state, load_tokenizer(directory)


def _read_lightning(path: Path) -> tuple[MTPConfig, dict[str, torch.Tensor], Tokenizer]:
    try:
        checkpoint: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        raise ValueError(f"cannot read {path} as a Lightning checkpoint: {e}") from e
    return _from_lightning(checkpoint, path)


def _from_lightning(checkpoint: dict[str, Any],
                    path: Path) -> tuple[MTPConfig, dict[str, torch.Tensor], Tokenizer]:
    hparams = checkpoint.get("hyper_parameters", {})
    if "model" not in hparams or "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not an mtp.train checkpoint: no model config in its "
                         f"hyper_parameters")
    prefix = "model."
    state = {name[len(prefix):]: tensor for name, tensor in checkpoint["state_dict"].items()
             if name.startswith(prefix)}
    tokenizer = _tokenizer_from_files(checkpoint.get("tokenizer_files", {}), path)
    return MTPConfig.from_dict(dict(hparams["model"])), state, tokenizer
