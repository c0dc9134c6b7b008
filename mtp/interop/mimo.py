"""The serving engines' layouts of sequential MTP modules: MiMo's (both ways) and DeepSeek-V3's
(import), for dense Llama-like models.

A Llama-architecture mtp model with sequential heads (`head_layers=1`) is exactly a MiMo
checkpoint (vLLM `mimo_mtp`): a Qwen2 model (zero q/k/v biases for a model without them)
whose config.json says `num_nextn_predict_layers`, with, per module k = i + 1:

    model.mtp_layers.{i}.hidden_layernorm.weight  (D,)     mtp heads.{k}.hnorm
    model.mtp_layers.{i}.token_layernorm.weight   (D,)     mtp heads.{k}.enorm
    model.mtp_layers.{i}.input_proj.weight        (D, 2D)  mtp heads.{k}.eh_proj, over
                                                  [hidden_layernorm(h); token_layernorm(e)]
    model.mtp_layers.{i}.final_layernorm.weight   (D,)     mtp's shared norm (a copy)
    model.mtp_layers.{i}.<Qwen2 decoder layer>             mtp heads.{k}.0 (the block)

DeepSeek-V3's layout (vLLM `deepseek_mtp`), import only and of one module, puts module
k = i + 1 at `model.layers.{num_hidden_layers + i}.`, its `eh_proj` over [enorm(e); hnorm(h)]
(embedding first), with copies of the main model's norm, head and embedding that must equal
them (as MiMo's `final_layernorm` must). Names, shapes and orders agree with SGLang 0.5.23's
loaders; no engine was run on the files. SGLang's MiMo layer zeroes the token embedding at
position 0 and mtp does not: a draft may differ there, the verified output does not.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import Tensor

from mtp.interop import hf
from mtp.interop.fields import field, peek_json_object, read_json_object, save_safetensors
from mtp.interop.hf_tokenizer import read_hf_tokenizer
from mtp.model import MTPConfig
from mtp.tokenizers import Tokenizer

NEXTN = "num_nextn_predict_layers"
MIMO_TYPE, MIMO_ARCHITECTURE = "mimo", "MiMoForCausalLM"
LLAMA_LIKE = ("llama", "qwen2")  # model types whose checkpoints may carry DeepSeek's modules
QWEN2_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
# mtp's fusion parameter -> the module's key in each layout (module docstring).
MIMO_FUSION = {"hnorm": "hidden_layernorm.weight", "enorm": "token_layernorm.weight",
               "eh_proj": "input_proj.weight"}
DEEPSEEK_FUSION = {"hnorm": "hnorm.weight", "enorm": "enorm.weight", "eh_proj": "eh_proj.weight"}
# A module's copies of the main model's shared tensors, which must equal them.
MIMO_SHARED = {"final_layernorm.weight": "model.norm.weight"}
DEEPSEEK_SHARED = {"shared_head.norm.weight": "model.norm.weight",
                   "shared_head.head.weight": "lm_head.weight",
                   "embed_tokens.weight": "model.embed_tokens.weight"}


def is_mtp_layers(directory: Path) -> bool:
    """Whether `directory`'s config.json is MiMo's or has DeepSeek's `NEXTN` field."""
    values = peek_json_object(directory / hf.CONFIG_FILE)
    return values is not None and (NEXTN in values or values.get("model_type") == MIMO_TYPE
                                   or values.get("architectures") == [MIMO_ARCHITECTURE])


def write_mimo(config: MTPConfig, state: dict[str, Tensor], tokenizer: Tokenizer,
               directory: Path) -> None:
    """Write a MiMo directory (module docstring): config.json, model.safetensors, tokenizer."""
    if config.n_future > 1 and config.head_type != "sequential":
        raise ValueError(f"MiMo's MTP layers are sequential modules: model.head_type="
                         f"{config.head_type!r} heads have no place in them (to_hf keeps them)")
    if config.head_layers != 1:
        raise ValueError(f"a MiMo MTP layer holds one decoder layer, but model.head_layers="
                         f"{config.head_layers}")
    if config.out_bias or config.mlp_bias:
        raise ValueError(f"MiMo is a Qwen2 model, with biases on q/k/v only: MTPConfig.out_bias="
                         f"{config.out_bias}, mlp_bias={config.mlp_bias}")
    dtype = state["tok_embeddings.weight"].dtype
    config = dataclasses.replace(config, qkv_bias=True)  # zero biases: Llama's block exactly
    names = _names(config, mimo=True)
    zeros = {ours: torch.zeros(len(state[ours.removesuffix("bias") + "weight"]), dtype=dtype)
             for ours in names if ours not in state}  # q/k/v biases of a model without them
    tensors = hf.to_theirs(state | zeros, names)
    for i in range(config.n_future - 1):
        tensors[f"model.mtp_layers.{i}.final_layernorm.weight"] = state["norm.weight"].clone()
    save_safetensors(tensors, directory / hf.WEIGHTS_FILE)
    base = dataclasses.replace(config, n_future=1, head_type="block")
    values = hf._llama_config(base, tokenizer, dtype)  # Qwen2's: q/k/v biases only
    # model_type qwen2, not MiMo's own "mimo": transformers has no "mimo" (remote code), which
    # vLLM 0.32 refuses without trust_remote_code; the engines pick MiMo by the architecture.
    values.update(architectures=[MIMO_ARCHITECTURE], model_type="qwen2",
                  **{NEXTN: config.n_future - 1}, sliding_window=None, attention_dropout=0.0)
    hf.write_configs(directory, values, tokenizer, config.max_seq_len)


def read_mtp_layers(directory: Path) -> tuple[MTPConfig, dict[str, Tensor], Tokenizer]:
    """Config, weights (mtp names) and tokenizer of a MiMo or DeepSeek-style directory."""
    path = directory / hf.CONFIG_FILE
    values = read_json_object(path)
    model_type = field(values, path, "model_type", "str")
    if model_type != MIMO_TYPE and model_type not in LLAMA_LIKE:
        raise ValueError(f"{path}: field 'model_type' is {model_type!r}; sequential modules "
                         f"import from dense Llama-like models only ({MIMO_TYPE!r}, "
                         f"{', '.join(map(repr, LLAMA_LIKE))}): not from mixtures of experts or "
                         f"DeepSeek-V3's latent attention")
    modules = field(values, path, NEXTN, "int", 0)
    mimo = model_type == MIMO_TYPE or values.get("architectures") == [MIMO_ARCHITECTURE]
    if modules < 0 or (not mimo and modules > 1):
        raise ValueError(f"{path}: field {NEXTN!r} must be 0 or 1 in DeepSeek's layout (vLLM "
                         f"chains a second module on the first one's un-normalised output, "
                         f"which mtp does not compute), got {modules}")
    qwen2 = dict(values, model_type="qwen2", architectures=["Qwen2ForCausalLM"]) if mimo \
        else values
    config = hf._mtp_config(path, 1 + modules, 1, "sequential" if modules else "block",
                            values=qwen2)
    theirs = hf._read_safetensors(directory)
    if config.qkv_bias and _zero_biases(theirs):  # dropped: the model is a Llama
        config = dataclasses.replace(config, qkv_bias=False)
    hf.drop_tied_output(config, theirs, directory)
    names = _names(config, mimo)
    state = hf.to_ours(theirs, names, config.head_dim, directory)
    if not mimo and modules:  # DeepSeek's eh_proj reads [embedding; hidden], mtp's the other
        embedding, hidden = state["heads.1.eh_proj"].chunk(2, dim=1)
        state["heads.1.eh_proj"] = torch.cat([hidden, embedding], dim=1)
    main = {name: state[ours] for ours, (name, _) in names.items()}
    main.setdefault("lm_head.weight", state["tok_embeddings.weight"])  # tied
    for i in range(modules):
        prefix = _prefix(config, i, mimo)
        for name, shared in (MIMO_SHARED if mimo else DEEPSEEK_SHARED).items():
            if prefix + name not in theirs and name == "embed_tokens.weight":
                continue  # optional: vLLM takes the main model's
            if not torch.equal(_take(theirs, prefix + name, directory), main[shared]):
                raise ValueError(f"{directory}: {prefix + name} differs from {shared}; mtp's "
                                 f"modules share the main model's (one {shared})")
    if theirs:
        raise ValueError(f"{directory}: unexpected weights {sorted(theirs)[:8]} for "
                         f"{NEXTN}={modules} in {hf.CONFIG_FILE}")
    return config, state, read_hf_tokenizer(directory)


def _prefix(config: MTPConfig, i: int, mimo: bool) -> str:
    """Module i's key prefix in MiMo's or DeepSeek's layout."""
    return f"model.mtp_layers.{i}." if mimo else f"model.layers.{config.n_layers + 1 + i}."


def _names(config: MTPConfig, mimo: bool) -> hf.Names:
    """`hf.key_map`, with the modules' keys in MiMo's or DeepSeek's layout."""
    fusion = MIMO_FUSION if mimo else DEEPSEEK_FUSION
    names = {}
    for ours, (theirs, n_rotary) in hf.key_map(config).items():
        if theirs.startswith("heads."):
            _, k, rest = theirs.split(".", 2)
            theirs = _prefix(config, int(k) - 1, mimo) + fusion.get(rest, rest.removeprefix("0."))
        names[ours] = (theirs, n_rotary)
    return names


def _take(tensors: dict[str, Tensor], name: str, directory: Path) -> Tensor:
    if name not in tensors:
        raise ValueError(f"{directory}: weight {name} is missing")
    return tensors.pop(name)


def _zero_biases(tensors: dict[str, Tensor]) -> bool:
    """Remove Qwen2's attention biases if every one is zero; whether they were."""
    names = [n for n in tensors if n.endswith(QWEN2_BIASES)]
    if any(tensors[n].count_nonzero() for n in names):
        return False
    for name in names:
        del tensors[name]
    return True
