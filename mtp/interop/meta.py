"""Meta's multi-token-prediction release: params.json + consolidated.pth + tokenizer.model.

facebook/multi-token-prediction is Llama code with `n_future_tokens`: `layers[:-1]` is the
trunk, `layers[-1]` head 0 and `extra_heads.{j}` head j + 1; block sub-keys and rotary layout
are mtp's own. Only single-file checkpoints load (the 7B release is one).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from mtp.interop.fields import check_keys, field, load_torch, read_json_object
from mtp.interop.hf import parameter_names
from mtp.interop.hf_tokenizer import SENTENCEPIECE_FILE, sentencepiece_tokenizer
from mtp.model import MTPConfig
from mtp.tokenizers import Tokenizer

PARAMS_FILE = "params.json"
WEIGHTS_FILE = "consolidated.pth"
DEFAULT_MAX_SEQ_LEN = 2048  # Meta's ModelArgs default; params.json may set max_seq_len
_DERIVED = ("rope.freqs",)  # rotary table some Llama releases store; mtp recomputes it


def is_meta(directory: Path) -> bool:
    return (directory / PARAMS_FILE).is_file()


def ffn_hidden(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's llama FeedForward width: 2/3 of 4 * dim, scaled, rounded up to multiple_of."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def read_meta(directory: Path) -> tuple[MTPConfig, dict[str, Tensor], Tokenizer]:
    """Config, weights (mtp names, stored dtype, memory-mapped) and tokenizer of a Meta dir."""
    tokenizer = sentencepiece_tokenizer(directory, bos=True) \
        if (directory / SENTENCEPIECE_FILE).is_file() else None
    config = meta_config(directory / PARAMS_FILE, tokenizer)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        shards = sorted(p.name for p in directory.glob("consolidated.*.pth"))
        raise FileNotFoundError(
            f"no {WEIGHTS_FILE} in {directory}" + (
                f": found model-parallel shards {shards}; merge them into one file first"
                if shards else ""))
    # mmap: tensors stay on disk until used, so the model never holds a second copy.
    theirs = load_torch(weights, "a PyTorch state dict", mmap=True)
    if tokenizer is None:
        raise FileNotFoundError(f"no {SENTENCEPIECE_FILE} in {directory}")
    return config, rename(theirs, config, weights), tokenizer


def meta_config(path: Path, tokenizer: Tokenizer | None = None) -> MTPConfig:
    """An MTPConfig from Meta's params.json (vocab_size -1: the tokenizer's, as Meta does)."""
    params = read_json_object(path)
    n_blocks = field(params, path, "n_layers", "int")
    n_future = field(params, path, "n_future_tokens", "int", 1)
    if not 1 <= n_future <= n_blocks:
        raise ValueError(f"{path}: field 'n_future_tokens' must be from 1 to n_layers="
                         f"{n_blocks}, got {n_future}")
    vocab_size = field(params, path, "vocab_size", "int", -1)
    if vocab_size < 1 and tokenizer is not None:
        vocab_size = tokenizer.vocab_size
    dim = field(params, path, "dim", "int")
    n_heads = field(params, path, "n_heads", "int")
    try:
        return MTPConfig(
            vocab_size=vocab_size, dim=dim, n_layers=n_blocks - n_future,  # `layers` - head 0
            n_heads=n_heads, n_kv_heads=field(params, path, "n_kv_heads", "int", n_heads),
            ffn_hidden=ffn_hidden(dim, field(params, path, "multiple_of", "int", 256),
                                  field(params, path, "ffn_dim_multiplier", "number", None)),
            max_seq_len=field(params, path, "max_seq_len", "int", DEFAULT_MAX_SEQ_LEN),
            rope_theta=field(params, path, "rope_theta", "number", 10000.0),
            norm_eps=field(params, path, "norm_eps", "number", 1e-5), n_future=n_future,
            head_layers=1)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def meta_names(config: MTPConfig) -> dict[str, str]:
    """Meta's name of every mtp parameter: {mtp name: Meta name}."""
    ours = parameter_names(config)
    names = dict(zip(ours, ours))
    for name in ours:
        if name.startswith("heads."):
            _, head, _, sub = name.split(".", 3)  # heads.{i}.0.{sub}: one block per head
            names[name] = f"layers.{config.n_layers}.{sub}" if head == "0" else \
                f"extra_heads.{int(head) - 1}.{sub}"
    return names


def rename(theirs: dict[str, Tensor], config: MTPConfig, source: Path) -> dict[str, Tensor]:
    """Meta's names -> mtp's, strictly: unexpected and missing keys are named."""
    names = meta_names(config)
    check_keys(theirs, names.values(), f"{source} does not fit its {PARAMS_FILE}", _DERIVED)
    return {ours: theirs[name] for ours, name in names.items()}
