"""Portable checkpoints: export a trained model for inference, and load it back.

An export holds `model.safetensors` (a tied output weight stored once), `config.json`
(`{"format_version", "model": MTPConfig.to_dict(), "tokenizer": {...}}`) and the tokenizer's
files. `load` reads any layout in `LAYOUTS` without Lightning or Hydra, building the model on
the meta device around the loaded tensors (no second copy).

`trainer=fsdp` saves a folder of torch.distributed.checkpoint (DCP) shards and `meta.pt`, the
rest of the checkpoint; DCP keeps global shapes, so `read_sharded_checkpoint` gathers the full
weights in one process.
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mtp.interop import gguf, hf, medusa, meta, mimo
from mtp.interop.fields import (load_safetensors, load_torch, read_json_object, save_safetensors,
                                write_json)
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import Tokenizer, load_tokenizer

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_TIED = "output.weight"  # stored once, as tok_embeddings.weight, when embeddings are tied
META_FILE = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
DCP_METADATA_FILE = ".metadata"
_MODEL_KEY = "state_dict"  # the model's entry in the DCP state (optimizers are optimizer_<i>)


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


# Every export_* returns its directory and keeps the model's dtype. Under FSDP it gathers the
# full weights, so call it on every rank; rank 0 writes.


def export(model: MTPModel, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write `model` and `tokenizer` to `directory` in mtp's own layout (module docstring)."""
    return _write_layout(_write_export, model, tokenizer, directory)


def _write_export(config: MTPConfig, state: dict[str, torch.Tensor], tokenizer: Tokenizer,
                  directory: Path) -> None:
    if config.tie_embeddings:
        del state[_TIED]
    save_safetensors(state, directory / WEIGHTS_FILE)
    meta = {"format_version": FORMAT_VERSION, "model": config.to_dict(),
            "tokenizer": {"name": tokenizer.name, "vocab_size": tokenizer.vocab_size}}
    write_json(directory / CONFIG_FILE, meta)
    tokenizer.save(directory)


def export_hf(model: MTPModel, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write a Hugging Face `LlamaForCausalLM` directory and mtp's heads file (`mtp.interop.hf`)."""
    return _write_layout(hf.write_hf, model, tokenizer, directory)


def export_mimo(model: MTPModel, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write MiMo's layout (`mtp.interop.mimo`): sequential heads as a Qwen2's MTP layers."""
    return _write_layout(mimo.write_mimo, model, tokenizer, directory)


def export_medusa(model: MTPModel, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """Write the base model (`base/`) and heads 1..n-1 as vLLM's and FasterDecoding's Medusa
    heads (`mtp.interop.medusa`); other head types are refused before any write."""
    medusa.check_medusa(model.config)
    return _write_layout(medusa.write_medusa, model, tokenizer, directory)


def _write_layout(write: Callable[[MTPConfig, dict[str, torch.Tensor], Tokenizer, Path], None],
                  model: MTPModel, tokenizer: Tokenizer, directory: str | Path) -> Path:
    """`write(config, state, tokenizer, directory)` on rank 0, the state gathered on every rank."""
    check_vocab(model.config, tokenizer)
    state = full_state_dict(model)
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        write(model.config, state, tokenizer, Path(directory))
    return Path(directory)


# What `load` recognises, in the order it tries them (named in its error for anything else).
LAYOUTS = (
    f"an mtp export (a directory with {CONFIG_FILE} holding format_version and model)",
    "a Lightning .ckpt written by mtp.train (a file)",
    f"a sharded trainer=fsdp checkpoint folder ({META_FILE} and {DCP_METADATA_FILE})",
    f"MiMo's or DeepSeek's MTP layout of a dense Llama-like model ({hf.CONFIG_FILE} with "
    f"model_type 'mimo' or {mimo.NEXTN})",
    f"a Hugging Face Llama directory ({hf.CONFIG_FILE} with model_type 'llama' or 'qwen2', "
    f"{hf.WEIGHTS_FILE} or {hf.INDEX_FILE}, tokenizer.json or tokenizer.model)",
    f"Meta's multi-token-prediction layout ({meta.PARAMS_FILE}, {meta.WEIGHTS_FILE}, "
    f"tokenizer.model)",
    f"an export_medusa directory ({medusa.BASE_DIR}/ and {medusa.VLLM_DIR}/ or "
    f"{medusa.MEDUSA_DIR}/)",
    "a GGUF file of a Llama-architecture model (llama.cpp's format; needs the gguf package)",
)


def check_tied(state: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a tied config's weights holding an output matrix unlike the embedding."""
    stored, embedding = state.get(_TIED), state.get("tok_embeddings.weight")
    if stored is None or embedding is None or stored is embedding:
        return
    if stored.shape != embedding.shape or not torch.equal(stored, embedding):
        raise ValueError(f"{path}: the config says tie_embeddings: true but the weights hold "
                         f"their own {_TIED}, unlike tok_embeddings.weight: set "
                         f"tie_embeddings: false, or drop {_TIED} from the weights")


def load(path: str | Path, device: str | torch.device = "cpu",
         dtype: torch.dtype | None = None) -> tuple[MTPModel, Tokenizer]:
    """The model (in eval mode) and tokenizer from any layout in `LAYOUTS`; dtype None keeps
    the stored dtype (float32 for a GGUF). Every key and shape must match the model."""
    path = Path(path)
    config, state, tokenizer = _read(path, dtype)
    check_vocab(config, tokenizer)
    if config.tie_embeddings:
        check_tied(state, path)
        state.setdefault(_TIED, state["tok_embeddings.weight"])
    with torch.device("meta"):
        model = MTPModel(config)
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as e:
        raise ValueError(f"weights in {path} do not fit the model config: {e}") from e
    del state
    model.tie_weights()  # assign gave the output its own Parameter
    model.init_rope()  # made on the meta device
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def _read(path: Path,
          dtype: torch.dtype | None) -> tuple[MTPConfig, dict[str, torch.Tensor], Tokenizer]:
    """Dispatch on the layout at `path`; a GGUF is dequantized to `dtype` as it is read."""
    if gguf.is_gguf(path):
        return gguf.read_gguf(path, dtype)
    if path.is_file():
        return _from_lightning(load_torch(path, "a Lightning checkpoint"), path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path} (neither a file nor a directory)")
    if (path / CONFIG_FILE).is_file() and not hf.is_hf_llama(path):
        return _read_export(path)
    if is_sharded_checkpoint(path):
        return _from_lightning(read_sharded_checkpoint(path), path)
    readers = ((mimo.is_mtp_layers, mimo.read_mtp_layers), (hf.is_hf_llama, hf.read_hf),
               (meta.is_meta, meta.read_meta), (medusa.is_medusa_export, medusa.read_medusa))
    for is_layout, read in readers:
        if is_layout(path):
            return read(path)
    raise FileNotFoundError(
        f"{path} is a directory in none of the layouts mtp loads; looked for: "
        + "; ".join(LAYOUTS))


def _read_export(directory: Path) -> tuple[MTPConfig, dict[str, torch.Tensor], Tokenizer]:
    path = directory / CONFIG_FILE
    header = read_json_object(path)
    version = header.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version={version!r}; this version of mtp reads "
                         f"format_version={FORMAT_VERSION}")
    state = load_safetensors(directory / WEIGHTS_FILE)
    try:
        config = MTPConfig.from_dict(header.get("model"))
    except ValueError as e:
        raise ValueError(f"{path}: field 'model': {e}") from e
    return config, state, load_tokenizer(directory)


def _from_lightning(checkpoint: dict[str, Any],
                    path: Path) -> tuple[MTPConfig, dict[str, torch.Tensor], Tokenizer]:
    hparams = checkpoint.get("hyper_parameters", {})
    if "model" not in hparams or "state_dict" not in checkpoint:
        raise ValueError(f"{path} is not an mtp.train checkpoint: no model config in its "
                         f"hyper_parameters")
    state = {name.removeprefix("model."): tensor
             for name, tensor in checkpoint["state_dict"].items() if name.startswith("model.")}
    tokenizer = _tokenizer_from_files(checkpoint.get("tokenizer_files", {}), path)
    return MTPConfig.from_dict(dict(hparams["model"])), state, tokenizer


# trainer=fsdp's sharded folders (see the module's docstring)
def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a sharded checkpoint folder written by `ModelParallelStrategy`."""
    path = Path(path)
    return (path / META_FILE).is_file() and (path / DCP_METADATA_FILE).is_file()


def read_sharded_checkpoint(path: str | Path) -> dict[str, Any]:
    """The Lightning checkpoint dict of a sharded folder, the model's full `state_dict` on CPU."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a sharded checkpoint folder: it needs "
                                f"{META_FILE} and {DCP_METADATA_FILE}")
    try:
        checkpoint: dict[str, Any] = torch.load(path / META_FILE, map_location="cpu",
                                                weights_only=True)
        reader = dcp.FileSystemReader(path)
        metadata = reader.read_metadata()
    except Exception as e:  # torch raises many kinds for a truncated or foreign file
        raise ValueError(f"cannot read {path} as a sharded checkpoint: {e}") from e
    prefix = f"{_MODEL_KEY}."
    state = {key[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    if not state:
        raise ValueError(f"{path} holds no model weights (no '{prefix}*' tensors)")
    # DCP flattens nested dicts with dots: {"state_dict": {name: t}} reads "state_dict.<name>".
    with warnings.catch_warnings():  # DCP warns that it loads in a single process: it does
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({_MODEL_KEY: state}, storage_reader=reader, no_dist=True)
    checkpoint[_MODEL_KEY] = state
    return checkpoint
