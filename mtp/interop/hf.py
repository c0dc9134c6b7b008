"""Hugging Face transformers' Llama layout (`LlamaForCausalLM`, and `Qwen2ForCausalLM`), both ways.

Trunk + head 0 is a Llama model (head 0's blocks are its last `head_layers` layers); heads
1..n-1 go beside it in `mtp_heads.safetensors`, described by `mtp_heads.json`: transformers
sees an ordinary next-token model, `mtp.load` every head. mtp (like Meta's code) rotates
interleaved pairs, transformers halves: query and key rows are permuted. Qwen2 is a Llama
with only q/k/v biases; what mtp cannot compute (other rope types, sliding windows, partial
rotary) is refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtp.interop.fields import (check_keys, field, load_safetensors, peek_json_object,
                                read_json_object, save_safetensors, write_json)
from mtp.interop.hf_tokenizer import read_hf_tokenizer, write_hf_tokenizer
from mtp.model import HEAD_TYPES, MTPConfig, MTPModel
from mtp.rope import RopeScaling
from mtp.tokenizers import Tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HEADS_FILE = "mtp_heads.safetensors"
HEADS_LAYOUT_FILE = "mtp_heads.json"
# The heads file's layout JSON: {"format", "format_version", "layout" (heads 1..n-1's
# head_type), "n_future", "head_layers", "weights"}; its keys `heads.{i}.{j}.<Llama sub-key>`,
# an attention-free layer's W (in, out) `heads.{i}.{j}.weight`, a fusion's `heads.{i}.hnorm`.
HEADS_FORMAT = "mtp-heads"
HEADS_FORMAT_VERSION = 1

# A block's layers: mtp name -> transformers' Llama name (of the `.weight` and any `.bias`).
BLOCK_KEYS = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# The architectures read, by model_type.
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "LlamaModel"),
                 "qwen2": ("Qwen2ForCausalLM", "Qwen2Model")}
ROPE_TYPES = ("default", "linear", "llama3")
_EMBEDDINGS, _OUTPUT = "model.embed_tokens.weight", "lm_head.weight"
# A block's parameter: its block (a trunk layer, or head i's layer j), BLOCK_KEYS stem, kind.
_BLOCK_PARAMETER = re.compile(r"(layers\.\d+|heads\.\d+\.\d+)\.(.+)\.(weight|bias)")
_TOP_KEYS = {"tok_embeddings.weight": _EMBEDDINGS, "norm.weight": "model.norm.weight",
             "output.weight": _OUTPUT}
Names = dict[str, tuple[str, int | None]]  # mtp name -> (theirs, rotary heads of a query/key)


def is_hf_llama(directory: Path) -> bool:
    """Whether `directory` has a transformers config.json (model_type or architectures)."""
    config = peek_json_object(directory / CONFIG_FILE)
    return config is not None and ("model_type" in config or "architectures" in config)


def interleaved_to_rotate_half(weight: Tensor, n_heads: int | None) -> Tensor:
    """Rows of a query/key projection, weight (n_heads * hd, D) or bias (n_heads * hd,):
    interleaved pairs -> halves; n_heads None (another tensor): `weight` as it is."""
    if n_heads is None:
        return weight
    return weight.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).reshape(weight.shape)


def rotate_half_to_interleaved(weight: Tensor, n_heads: int | None) -> Tensor:
    """The inverse of `interleaved_to_rotate_half`."""
    if n_heads is None:
        return weight
    return weight.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).reshape(weight.shape)


def parameter_names(config: MTPConfig) -> list[str]:
    """The names of an `MTPModel`'s parameters, tied ones included (from the meta device)."""
    with torch.device("meta"):
        return list(MTPModel(config).state_dict())


def key_map(config: MTPConfig) -> Names:
    """Every mtp parameter name -> (its transformers/heads-file name, its rotary heads for
    query and key projections, else None); a tied output weight is left out. Trunk and head 0
    are the Llama's layers; heads 1..n-1 keep mtp's names, with Llama's within a block."""
    rotary = {"attention.wq": config.n_heads, "attention.wk": config.n_kv_heads}
    names: Names = {}
    for ours in parameter_names(config):
        if ours == "output.weight" and config.tie_embeddings:
            continue
        block = _BLOCK_PARAMETER.fullmatch(ours)
        if block is None:  # not a block's: attention-free layers and fusions keep theirs
            names[ours] = (_TOP_KEYS.get(ours, ours), None)
            continue
        prefix, stem, kind = block.groups()
        if prefix.startswith("heads.0."):  # head 0's blocks follow the trunk's
            prefix = f"layers.{config.n_layers + int(prefix.removeprefix('heads.0.'))}"
        prefix = "model." + prefix if prefix.startswith("layers.") else prefix
        names[ours] = (f"{prefix}.{BLOCK_KEYS[stem]}.{kind}", rotary.get(stem))
    return names


def to_theirs(state: Mapping[str, Tensor], names: Names) -> dict[str, Tensor]:
    """`state`'s tensors under their `names`, query/key rows permuted to halves."""
    return {theirs: interleaved_to_rotate_half(state[ours], n_rotary).contiguous()
            for ours, (theirs, n_rotary) in names.items()}


def to_ours(tensors: dict[str, Tensor], names: Names, head_dim: int,
            source: Path) -> dict[str, Tensor]:
    """The state in mtp's `names`, taken out of `tensors` (one copy in memory), query/key rows
    permuted to interleaved pairs; a missing weight, or rows that are not whole heads, named."""
    state = {}
    for ours, (name, n_rotary) in names.items():
        if name not in tensors:
            raise ValueError(f"{source}: weight {name} is missing")
        tensor = tensors.pop(name)
        if n_rotary is not None:
            if len(tensor) != n_rotary * head_dim:
                raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, the "
                                 f"config says {n_rotary} heads of {head_dim} rows")
            tensor = rotate_half_to_interleaved(tensor, n_rotary)
        state[ours] = tensor
    return state


def write_hf(config: MTPConfig, state: dict[str, Tensor], tokenizer: Tokenizer,
             directory: Path) -> None:
    """Write a `LlamaForCausalLM` directory (and the heads file when n_future > 1)."""
    dtype = state["tok_embeddings.weight"].dtype
    hf_config = _llama_config(config, tokenizer, dtype)  # refuses what transformers lacks
    model_state = to_theirs(state, key_map(config))
    heads_state = {k: model_state.pop(k) for k in list(model_state) if k.startswith("heads.")}
    save_safetensors(model_state, directory / WEIGHTS_FILE)
    write_configs(directory, hf_config, tokenizer, config.max_seq_len)
    for stale in (HEADS_FILE, HEADS_LAYOUT_FILE, INDEX_FILE):  # written before, with heads
        (directory / stale).unlink(missing_ok=True)
    if config.n_future > 1:
        save_safetensors(heads_state, directory / HEADS_FILE)
        # Engines (vLLM) load every *.safetensors of a folder unless an index names the
        # model's: list model.safetensors alone, so the heads file is ours to read.
        write_json(directory / INDEX_FILE, {
            "metadata": {"total_size": sum(t.numel() * t.element_size()
                                           for t in model_state.values())},
            "weight_map": dict.fromkeys(sorted(model_state), WEIGHTS_FILE)})
        write_json(directory / HEADS_LAYOUT_FILE, {
            "format": HEADS_FORMAT, "format_version": HEADS_FORMAT_VERSION,
            "layout": config.head_type,
            "n_future": config.n_future, "head_layers": config.head_layers,
            "weights": HEADS_FILE})


def write_configs(directory: Path, values: dict[str, Any], tokenizer: Tokenizer,
                  max_seq_len: int) -> None:
    """config.json (`values`), generation_config.json and the tokenizer's files."""
    write_json(directory / CONFIG_FILE, values)
    write_json(directory / "generation_config.json", {
        "bos_token_id": tokenizer.bos_id, "pad_token_id": tokenizer.pad_id,
        # EOS, or EOS and the end-of-turn tokens: the list engines stop at
        "eos_token_id": sorted(stops) if len(stops := tokenizer.stop_ids) > 1 else
        tokenizer.eos_id})
    write_hf_tokenizer(tokenizer, directory, model_max_length=max_seq_len)


def _llama_config(config: MTPConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    """A transformers config.json: Llama's, or Qwen2's for a model with q/k/v biases only."""
    if config.qkv_bias and not (config.out_bias or config.mlp_bias):
        model_type, architecture = "qwen2", "Qwen2ForCausalLM"
        variant = {"use_sliding_window": False, "max_window_layers": config.n_layers}
    elif config.qkv_bias == config.out_bias:
        model_type, architecture = "llama", "LlamaForCausalLM"
        variant = {"attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias}
    else:
        raise ValueError(f"no transformers Llama or Qwen2 has MTPConfig.qkv_bias="
                         f"{config.qkv_bias}, out_bias={config.out_bias}, mlp_bias="
                         f"{config.mlp_bias}: Llama biases all four attention projections or "
                         f"none, Qwen2 only q/k/v and no MLP")
    rope: dict[str, Any] = {"rope_type": "default"}
    if config.rope_scaling is not None:
        scaling = config.rope_scaling
        rope = {"rope_type": scaling.type, "factor": scaling.factor}
        if scaling.type == "llama3":
            rope.update(low_freq_factor=scaling.low_freq_factor,
                        high_freq_factor=scaling.high_freq_factor,
                        original_max_position_embeddings=scaling.original_max_seq_len)
    return {
        "architectures": [architecture], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.dim,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layers + config.head_layers,  # trunk + head 0
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
        # transformers >= 5 reads rope_parameters; older versions, vLLM and llama.cpp's
        # converter read rope_theta and rope_scaling.
        "rope_theta": config.rope_theta,
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
        **({"rope_scaling": rope} if config.rope_scaling is not None else {}),
        "tie_word_embeddings": config.tie_embeddings, **variant,
        "initializer_range": config.init_std, "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id,
        "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True}


def read_hf(directory: Path) -> tuple[MTPConfig, dict[str, Tensor], Tokenizer]:
    """Config, weights (mtp names, stored dtype) and tokenizer of a transformers Llama dir."""
    heads = _read_heads_layout(directory)
    config = _mtp_config(directory / CONFIG_FILE, *heads)
    theirs = _read_safetensors(directory)
    if (directory / HEADS_FILE).is_file() or heads != (1, 1, "block"):
        theirs.update(load_safetensors(directory / HEADS_FILE))
    drop_tied_output(config, theirs, directory)
    names = key_map(config)
    check_keys(theirs, (name for name, _ in names.values()),
               f"weights in {directory} do not fit its config.json (and {HEADS_LAYOUT_FILE})")
    state = to_ours(theirs, names, config.head_dim, directory)
    return config, state, read_hf_tokenizer(directory)


def drop_tied_output(config: MTPConfig, tensors: dict[str, Tensor], directory: Path) -> None:
    """Drop the output weight some tied checkpoints store anyway, which must be the embedding."""
    if config.tie_embeddings and _OUTPUT in tensors:
        if not torch.equal(tensors.pop(_OUTPUT), tensors.get(_EMBEDDINGS, torch.empty(0))):
            raise ValueError(f"{directory}: tie_word_embeddings is true but {_OUTPUT} differs "
                             f"from {_EMBEDDINGS}")


def _read_heads_layout(directory: Path) -> tuple[int, int, str]:
    """(n_future, head_layers, head_type) from mtp_heads.json; (1, 1, "block") without it."""
    path = directory / HEADS_LAYOUT_FILE
    if not path.is_file():
        return 1, 1, "block"
    layout = read_json_object(path)
    field(layout, path, "format", "str", choices=(HEADS_FORMAT,))
    field(layout, path, "format_version", "int", choices=(HEADS_FORMAT_VERSION,))
    field(layout, path, "weights", "str", HEADS_FILE, choices=(HEADS_FILE,))
    return (field(layout, path, "n_future", "int"), field(layout, path, "head_layers", "int"),
            field(layout, path, "layout", "str", choices=HEAD_TYPES))


def _mtp_config(path: Path, n_future: int, head_layers: int, head_type: str,
                values: dict[str, Any] | None = None) -> MTPConfig:
    """An MTPConfig from a transformers Llama or Qwen2 config.json (or its `values`)."""
    values = read_json_object(path) if values is None else values
    model_type = field(values, path, "model_type", "str", "llama")
    architectures = field(values, path, "architectures", "list",
                          [ARCHITECTURES.get(model_type, ("?",))[0]])
    if model_type not in ARCHITECTURES or not set(architectures) <= set(ARCHITECTURES[model_type]):
        raise ValueError(f"{path}: only Llama-architecture models load (model_type 'llama' or "
                         f"'qwen2', architectures {[a for v in ARCHITECTURES.values() for a in v]}"
                         f"), got model_type={model_type!r}, architectures={architectures!r}")
    field(values, path, "hidden_act", "str", "silu", choices=("silu",))  # mtp's Llama block
    if model_type == "qwen2":
        if field(values, path, "use_sliding_window", "bool", False):
            raise ValueError(f"{path}: field 'use_sliding_window' is true; mtp implements only "
                             f"full attention")
        biases = {"qkv_bias": True, "out_bias": False, "mlp_bias": False}
    else:
        attention_bias = field(values, path, "attention_bias", "bool", False)
        biases = {"qkv_bias": attention_bias, "out_bias": attention_bias,
                  "mlp_bias": field(values, path, "mlp_bias", "bool", False)}
    n_heads = field(values, path, "num_attention_heads", "int")
    dim = field(values, path, "hidden_size", "int")
    n_blocks = field(values, path, "num_hidden_layers", "int")
    if n_blocks < head_layers:
        raise ValueError(f"{path}: field 'num_hidden_layers' must be at least head_layers="
                         f"{head_layers} ({HEADS_LAYOUT_FILE}), got {n_blocks}")
    max_seq_len = field(values, path, "max_position_embeddings", "int", 2048)
    rope_theta, rope_scaling = _rope(values, path, max_seq_len)
    try:
        return MTPConfig(
            vocab_size=field(values, path, "vocab_size", "int"), dim=dim,
            n_layers=n_blocks - head_layers, n_heads=n_heads,
            n_kv_heads=field(values, path, "num_key_value_heads", "int", n_heads),
            head_dim=field(values, path, "head_dim", "int", None),
            ffn_hidden=field(values, path, "intermediate_size", "int"), max_seq_len=max_seq_len,
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            norm_eps=field(values, path, "rms_norm_eps", "number", 1e-6), **biases,
            n_future=n_future, head_layers=head_layers, head_type=head_type,
            tie_embeddings=field(values, path, "tie_word_embeddings", "bool", False),
            init_std=field(values, path, "initializer_range", "number", 0.02))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _rope(values: dict[str, Any], path: Path,
          max_seq_len: int) -> tuple[float, RopeScaling | None]:
    """rope theta and scaling from transformers >= 5's rope_parameters or the older fields."""
    name = "rope_parameters" if values.get("rope_parameters") is not None else "rope_scaling"
    rope = field(values, path, name, "object", {})
    theta = field(rope, path, "rope_theta", "number", None) \
        or field(values, path, "rope_theta", "number", 10000.0)
    partial = rope.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    if partial != 1:
        raise ValueError(f"{path}: field 'partial_rotary_factor' is {partial!r}; mtp rotates "
                         f"every dimension of a head (1.0)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{path}: field {name!r} has rope_type {kind!r}; mtp implements "
                         f"{list(ROPE_TYPES)}")
    if kind == "default":
        return theta, None
    factor = field(rope, path, "factor", "number")
    if kind == "linear":
        return theta, RopeScaling(type="linear", factor=factor)
    # As transformers: a top-level original_max_position_embeddings wins over the rope dict's.
    original = field(values, path, "original_max_position_embeddings", "int", None) \
        or field(rope, path, "original_max_position_embeddings", "int", max_seq_len)
    try:
        return theta, RopeScaling(
            type="llama3", factor=factor,
            low_freq_factor=field(rope, path, "low_freq_factor", "number"),
            high_freq_factor=field(rope, path, "high_freq_factor", "number"),
            original_max_seq_len=original)
    except ValueError as e:
        raise ValueError(f"{path}: field {name!r}: {e}") from e


def _read_safetensors(directory: Path) -> dict[str, Tensor]:
    """Every tensor of model.safetensors, else of the shards its index names."""
    index_path = directory / INDEX_FILE
    if (directory / WEIGHTS_FILE).is_file() or not index_path.is_file():
        return load_safetensors(directory / WEIGHTS_FILE)
    weight_map = field(read_json_object(index_path), index_path, "weight_map", "object")
    tensors: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(load_safetensors(directory / shard))
    check_keys(tensors, weight_map, f"{index_path} does not match its shards")
    return tensors
