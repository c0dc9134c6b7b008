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
from pathlib import Path

import torch
from torch import Tensor

from mtp.interop import hf
from mtp.interop.fields import (check_keys, field, load_safetensors, load_torch,
                                read_json_object, save_safetensors, write_json)
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import Tokenizer

BASE_DIR, VLLM_DIR, MEDUSA_DIR = "base", "vllm", "medusa"
CONFIG_FILE = "config.json"
VLLM_WEIGHTS = "model.safetensors"
MEDUSA_WEIGHTS = "medusa_lm_head.pt"
MEDUSA_SAFETENSORS = "medusa_lm_head.safetensors"  # read too: later Medusa training saves it
# Each layout's (weight, bias, lm_head) names of head h's layer l; an lm_head's l is the layer
# count (FasterDecoding's lm_head follows a head's layers).
VLLM_KEYS = ("blocks.{h}.layers.{l}.weight", "blocks.{h}.layers.{l}.bias", "lm_heads.{h}.weight")
MEDUSA_KEYS = ("{h}.{l}.linear.weight", "{h}.{l}.linear.bias", "{h}.{l}.weight")

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


def _head_tensors(config: MTPConfig, state: dict[str, Tensor], keys: tuple[str, str, str], *,
                  bias: bool, copies: bool) -> dict[str, Tensor]:
    """Heads 1..n-1 as Medusa's heads 0..n-2 under a layout's `keys`: W as nn.Linear's (out,
    in), zero biases if `bias` (Medusa's ResBlock has one), the shared lm_head (`copies`: a
    copy per head)."""
    weight, bias_key, lm_head = keys
    L, output = config.head_layers, state["output.weight"]
    zeros = output.new_zeros(config.dim)
    tensors = {}
    for h in range(config.n_future - 1):
        for l in range(L):
            tensors[weight.format(h=h, l=l)] = state[f"heads.{h + 1}.{l}.weight"].T.contiguous()
            if bias:
                tensors[bias_key.format(h=h, l=l)] = zeros
        tensors[lm_head.format(h=h, l=L)] = output.clone() if copies else output
    return tensors


def write_medusa(config: MTPConfig, state: dict[str, Tensor], tokenizer: Tokenizer,
                 directory: Path) -> None:
    """Write `base/`, `vllm/` and `medusa/` (module docstring) into `directory`."""
    check_medusa(config)
    if config.head_layers > 1:
        warnings.warn(f"head_layers={config.head_layers}: FasterDecoding's own MedusaModel "
                      f"repeats one ResBlock module per head ([ResBlock] * medusa_num_layers), "
                      f"so it runs every layer of a head with the last layer's weights; vLLM "
                      f"(and, as far as we know, TensorRT-LLM) reads each layer", stacklevel=2)
    base = directory / BASE_DIR
    base_config = dataclasses.replace(config, n_future=1, head_type="block")
    base_state = {name: t for name, t in state.items() if MTPModel.is_base_parameter(name)}
    hf.write_hf(base_config, base_state, tokenizer, base)
    num_heads, num_layers = config.n_future - 1, config.head_layers
    # vLLM's `models/medusa.py`; FasterDecoding's `MedusaModel.medusa_head`.
    vllm = {"architectures": ["MedusaModel"], "model_type": "medusa",
            "hidden_size": config.dim, "vocab_size": config.vocab_size,
            "num_heads": num_heads, "num_hidden_layers": num_layers,
            "truncated_vocab_size": config.vocab_size, "medusa_fc_bias": False,
            "original_lm_head": True,
            "torch_dtype": str(state["output.weight"].dtype).removeprefix("torch.")}
    medusa = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
              "base_model_name_or_path": str(base.resolve())}
    for sub, values in ((VLLM_DIR, vllm), (MEDUSA_DIR, medusa)):
        (directory / sub).mkdir(parents=True, exist_ok=True)
        write_json(directory / sub / CONFIG_FILE, values)
    # safetensors stores no shared tensors (an lm_head per head); torch.save keeps one copy.
    save_safetensors(_head_tensors(config, state, VLLM_KEYS, bias=False, copies=True),
                     directory / VLLM_DIR / VLLM_WEIGHTS)
    (directory / MEDUSA_DIR / MEDUSA_SAFETENSORS).unlink(missing_ok=True)  # an older export's
    torch.save(_head_tensors(config, state, MEDUSA_KEYS, bias=True, copies=False),
               directory / MEDUSA_DIR / MEDUSA_WEIGHTS)


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
    return _heads(tensors, num_heads, num_layers, VLLM_KEYS, directory / VLLM_WEIGHTS,
                  bias=bias, shared=shared)


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
    return _heads(tensors, num_heads, num_layers, MEDUSA_KEYS, weights)


def _heads(tensors: dict[str, Tensor], num_heads: int, num_layers: int,
           keys: tuple[str, str, str], source: Path, *, bias: bool = True,
           shared: bool = False) -> MedusaHeads:
    """The heads in `tensors`, which must hold exactly the tensors a layout's `keys` name for
    each head h and layer l: biases only if `bias`; head 0's lm_head for all if `shared`
    (the other heads' are then ignored, as vLLM ignores them)."""
    weight, bias_key, lm_head = keys
    at = [[{"h": h, "l": l} for l in range(num_layers)] for h in range(num_heads)]
    names = {name.format(**where) for head in at for where in head
             for name in ((weight, bias_key) if bias else (weight,))}
    lm_heads = [lm_head.format(h=0 if shared else h, l=num_layers) for h in range(num_heads)]
    others = {lm_head.format(h=h, l=num_layers) for h in range(1, num_heads)} if shared else ()
    check_keys(tensors, names | set(lm_heads), f"{source} does not fit its {CONFIG_FILE}", others)
    return MedusaHeads(
        weights=[[tensors[weight.format(**where)] for where in head] for head in at],
        biases=[[tensors[bias_key.format(**where)] if bias else None for where in head]
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
