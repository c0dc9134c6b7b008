"""Medusa heads out to serving engines, and back: vLLM's and FasterDecoding's layouts.

Medusa (Cai et al. 2024) puts head h on the base model's normed final hidden state z:
`lm_head_h(ResBlock_L(...ResBlock_1(z)))`, ResBlock(x) = x + SiLU(W x + b), no norm before
`lm_head_h`. mtp's `medusa` heads are exactly that with b = 0 and one shared lm_head, as
head h + 1, W transposed. `write_medusa` writes `base/` (a Hugging Face Llama), `vllm/` and
`medusa/` (FasterDecoding's, which TensorRT-LLM reads).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from mtp.interop import hf
from mtp.interop.fields import (check_keys, field, load_safetensors, load_torch,
                                read_json_object, write_json)
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import Tokenizer

BASE_DIR, VLLM_DIR, MEDUSA_DIR = "base", "vllm", "medusa"
CONFIG_FILE = "config.json"
VLLM_WEIGHTS = "model.safetensors"
MEDUSA_WEIGHTS = "medusa_lm_head.pt"
MEDUSA_SAFETENSORS = "medusa_lm_head.safetensors"  # read too: later Medusa training saves it

_REFUSED = {
    "resblock": "resblock heads read the trunk output and end in the shared final norm, "
                "while Medusa's heads read the base model's normed final hidden state and go "
                "to their lm_head without a norm (RMSNorm cannot be folded into an lm_head): "
                "train the heads with model.head_type=medusa",
    "block": "block heads are transformer blocks (attention and a KV cache of their own), "
             "not Medusa's ResBlocks",
    "linear": "linear heads (x @ W, no residual) are not Medusa's ResBlocks",
}


def check_medusa(config: MTPConfig) -> None:
    """Fail unless the model's heads 1..n-1 map exactly onto Medusa heads (module docstring)."""
    if config.n_future < 2:
        raise ValueError(f"the model has one head (n_future={config.n_future}): there are no "
                         f"heads to export as Medusa heads")
    if config.head_type != "medusa":
        raise ValueError(f"cannot export head_type={config.head_type!r} as Medusa heads: "
                         + _REFUSED[config.head_type])


def _head_weights(config: MTPConfig, state: dict[str, Tensor]) -> list[list[Tensor]]:
    """W of head h + 1's layer l as nn.Linear's (out, in): [h][l], for Medusa's head h."""
    return [[state[f"heads.{h + 1}.{l}.weight"].T.contiguous() for l in range(config.head_layers)]
            for h in range(config.n_future - 1)]


def vllm_heads(config: MTPConfig, state: dict[str, Tensor]) -> tuple[dict[str, Any],
                                                                     dict[str, Tensor]]:
    """vLLM's Medusa config.json and weights (`models/medusa.py`'s names) for heads 1..n-1."""
    check_medusa(config)
    num_heads = config.n_future - 1
    tensors = {f"blocks.{h}.layers.{l}.weight": weight
               for h, layers in enumerate(_head_weights(config, state))
               for l, weight in enumerate(layers)}
    for h in range(num_heads):  # safetensors stores no shared tensors: one copy per head
        tensors[f"lm_heads.{h}.weight"] = state["output.weight"].clone()
    values = {"architectures": ["MedusaModel"], "model_type": "medusa",
              "hidden_size": config.dim, "vocab_size": config.vocab_size,
              "num_heads": num_heads, "num_hidden_layers": config.head_layers,
              "truncated_vocab_size": config.vocab_size, "medusa_fc_bias": False,
              "original_lm_head": True,
              "torch_dtype": str(state["output.weight"].dtype).removeprefix("torch.")}
    return values, tensors


def fasterdecoding_heads(config: MTPConfig, state: dict[str, Tensor],
                         base_model: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """FasterDecoding's Medusa config.json and `medusa_lm_head.pt` (`MedusaModel.medusa_head`'s
    state dict; zero biases, one lm_head shared by every head)."""
    check_medusa(config)
    L = config.head_layers
    zeros = state["output.weight"].new_zeros(config.dim)  # Medusa's ResBlock has a bias
    tensors = {}
    for h, layers in enumerate(_head_weights(config, state)):
        for l, weight in enumerate(layers):
            tensors[f"{h}.{l}.linear.weight"] = weight
            tensors[f"{h}.{l}.linear.bias"] = zeros
        tensors[f"{h}.{L}.weight"] = state["output.weight"]  # torch.save keeps one copy
    values = {"medusa_num_heads": config.n_future - 1, "medusa_num_layers": L,
              "base_model_name_or_path": base_model}
    return values, tensors


def write_medusa(config: MTPConfig, state: dict[str, Tensor], tokenizer: Tokenizer,
                 directory: Path) -> None:
    """Write `base/`, `vllm/` and `medusa/` (module docstring) into `directory`."""
    check_medusa(config)
    base = directory / BASE_DIR
    vllm_config, vllm_tensors = vllm_heads(config, state)
    medusa_config, medusa_tensors = fasterdecoding_heads(config, state, str(base.resolve()))
    if config.head_layers > 1:
        warnings.warn(f"head_layers={config.head_layers}: FasterDecoding's own MedusaModel "
                      f"repeats one ResBlock module per head ([ResBlock] * medusa_num_layers), "
                      f"so it runs every layer of a head with the last layer's weights; vLLM "
                      f"(and, as far as we know, TensorRT-LLM) reads each layer", stacklevel=2)
    base_config = dataclasses.replace(config, n_future=1, head_type="block")
    base_state = {name: t for name, t in state.items() if MTPModel.is_base_parameter(name)}
    hf.write_hf(base_config, base_state, tokenizer, base)
    for sub, values in ((VLLM_DIR, vllm_config), (MEDUSA_DIR, medusa_config)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
        write_json(directory / sub / CONFIG_FILE, values)
    save_file(vllm_tensors, str(directory / VLLM_DIR / VLLM_WEIGHTS), metadata={"format": "pt"})
    (directory / MEDUSA_DIR / MEDUSA_SAFETENSORS).unlink(missing_ok=True)  # an older export's
    torch.save(medusa_tensors, directory / MEDUSA_DIR / MEDUSA_WEIGHTS)


# -- reading back ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MedusaHeads:
    """Medusa heads as the engines hold them: [h][l] (out, in) weights and biases (or None)."""

    weights: list[list[Tensor]]
    biases: list[list[Tensor | None]]
    lm_heads: list[Tensor]
    source: Path


def is_medusa_export(directory: Path) -> bool:
    """Whether `directory` holds `base/` and Medusa heads in `vllm/` or `medusa/`."""
    return (directory / BASE_DIR / CONFIG_FILE).is_file() and any(
        (directory / sub / CONFIG_FILE).is_file() for sub in (VLLM_DIR, MEDUSA_DIR))


def read_medusa(directory: Path) -> tuple[MTPConfig, dict[str, Tensor], Tokenizer]:
    """The mtp model (medusa heads) of a `write_medusa` directory: config, weights, tokenizer."""
    base_config, base_state, tokenizer = hf.read_hf(directory / BASE_DIR)
    if base_config.n_future != 1:
        raise ValueError(f"{directory / BASE_DIR} carries mtp heads ({hf.HEADS_LAYOUT_FILE}); "
                         f"a Medusa export's base model has none")
    heads = read_vllm_heads(directory / VLLM_DIR) if (directory / VLLM_DIR).is_dir() \
        else read_fasterdecoding_heads(directory / MEDUSA_DIR)
    return (*medusa_model(base_config, base_state, heads), tokenizer)


def read_vllm_heads(directory: Path) -> MedusaHeads:
    """The heads of vLLM's Medusa draft directory (config.json + model.safetensors)."""
    path = directory / CONFIG_FILE
    values = read_json_object(path)
    field(values, path, "model_type", "str", choices=("medusa",))
    num_heads, num_layers = (field(values, path, name, "int")
                             for name in ("num_heads", "num_hidden_layers"))
    vocab = field(values, path, "vocab_size", "int")
    truncated = field(values, path, "truncated_vocab_size", "int", vocab)
    if truncated != vocab:
        raise ValueError(f"{path}: field 'truncated_vocab_size' is {truncated}, not vocab_size="
                         f"{vocab}: a token_map drafts from part of the vocabulary, which mtp's "
                         f"heads cannot")
    bias = field(values, path, "medusa_fc_bias", "bool", False)
    shared = field(values, path, "original_lm_head", "bool", False)
    tensors = load_safetensors(directory / VLLM_WEIGHTS)
    tensors = {name.removeprefix("medusa_heads."): t for name, t in tensors.items()}
    # vLLM ignores other heads' lm_heads when original_lm_head is set
    others = {f"lm_heads.{h}.weight" for h in range(1, num_heads)} if shared else set()
    return _heads(tensors, num_heads, num_layers, "blocks.{h}.layers.{l}.weight",
                  "blocks.{h}.layers.{l}.bias" if bias else None,
                  "lm_heads.0.weight" if shared else "lm_heads.{h}.weight",
                  directory / VLLM_WEIGHTS, others)


def read_fasterdecoding_heads(directory: Path) -> MedusaHeads:
    """The heads of FasterDecoding's layout (config.json + medusa_lm_head.pt/.safetensors)."""
    path = directory / CONFIG_FILE
    values = read_json_object(path)
    num_heads, num_layers = (field(values, path, name, "int")
                             for name in ("medusa_num_heads", "medusa_num_layers"))
    weights = directory / MEDUSA_SAFETENSORS
    if weights.is_file():
        tensors = load_safetensors(weights)
    else:
        weights = directory / MEDUSA_WEIGHTS
        if not weights.is_file():
            raise FileNotFoundError(f"no {MEDUSA_WEIGHTS} or {MEDUSA_SAFETENSORS} in {directory}")
        tensors = load_torch(weights, "a PyTorch state dict")
        if not isinstance(tensors, dict):
            raise ValueError(f"{weights} holds a {type(tensors).__name__}, not a state dict")
    # The lm_head follows a head's layers: "{h}.{num_layers}.weight".
    return _heads(tensors, num_heads, num_layers, "{h}.{l}.linear.weight",
                  "{h}.{l}.linear.bias", "{h}.{l}.weight", weights)


def _heads(tensors: dict[str, Tensor], num_heads: int, num_layers: int, weight: str,
           bias: str | None, lm_head: str, source: Path, others: Iterable[str] = ()
           ) -> MedusaHeads:
    """The heads in `tensors`, which must hold exactly (but for `others`) the tensors named by
    `weight`, `bias` (None: none) and `lm_head` formatted with each head h and layer l."""
    at = [[{"h": h, "l": l} for l in range(num_layers)] for h in range(num_heads)]
    names = {name.format(**where) for head in at for where in head for name in (weight, bias)
             if name is not None}
    lm_heads = [lm_head.format(h=h, l=num_layers) for h in range(num_heads)]
    check_keys(tensors, names | set(lm_heads), f"{source} does not fit its {CONFIG_FILE}", others)
    return MedusaHeads(
        weights=[[tensors[weight.format(**where)] for where in head] for head in at],
        biases=[[None if bias is None else tensors[bias.format(**where)] for where in head]
                for head in at],
        lm_heads=[tensors[name] for name in lm_heads], source=source)


def medusa_model(base: MTPConfig, state: dict[str, Tensor],
                 heads: MedusaHeads) -> tuple[MTPConfig, dict[str, Tensor]]:
    """A next-token model (`base`, `state`) with Medusa `heads` as an mtp model's config and
    weights; heads mtp cannot express are refused naming the tensor."""
    num_heads, num_layers = len(heads.weights), len(heads.weights[0]) if heads.weights else 0
    blocks = base.n_layers + base.head_layers  # the Llama's layers
    if num_heads < 1 or num_layers < 1:
        raise ValueError(f"{heads.source}: {num_heads} head(s) of {num_layers} layer(s); mtp "
                         f"needs at least one head of at least one layer")
    if num_layers > blocks:
        raise ValueError(f"{heads.source}: heads of {num_layers} layers need a base model of at "
                         f"least as many layers (mtp's head 0 has as many blocks as each head "
                         f"has layers), got {blocks}")
    output = state["tok_embeddings.weight" if base.tie_embeddings else "output.weight"]
    for h in range(num_heads):
        if not torch.equal(heads.lm_heads[h], output):
            raise ValueError(f"{heads.source}: head {h}'s lm_head differs from the base model's "
                             f"lm_head; mtp's heads share the unembedding")
        for l in range(num_layers):
            weight, bias = heads.weights[h][l], heads.biases[h][l]
            if tuple(weight.shape) != (base.dim, base.dim):
                raise ValueError(f"{heads.source}: head {h} layer {l} weight has shape "
                                 f"{tuple(weight.shape)}, expected {(base.dim, base.dim)}")
            if bias is not None and bool(bias.any()):
                raise ValueError(f"{heads.source}: head {h} layer {l} has a non-zero bias; "
                                 f"mtp's Medusa heads have none")
    config = dataclasses.replace(base, n_layers=blocks - num_layers, head_layers=num_layers,
                                 n_future=num_heads + 1, head_type="medusa")
    # By their transformers names, which do not move when the trunk/head 0 split does.
    theirs = {name: state[ours] for ours, (name, _) in hf.key_map(base).items()}
    theirs.update({f"heads.{h + 1}.{l}.weight": heads.weights[h][l].T.contiguous()
                   for h in range(num_heads) for l in range(num_layers)})
    return config, {ours: theirs[name] for ours, (name, _) in hf.key_map(config).items()}
