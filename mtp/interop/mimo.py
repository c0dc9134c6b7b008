"""The serving engines' layouts of sequential MTP modules: MiMo's (both ways) and DeepSeek-V3's
(import), for dense Llama-like models.

A Llama-architecture mtp model with sequential heads (`head_type="sequential"`,
`head_layers=1`) is exactly a MiMo checkpoint (Xiaomi MiMo-7B; vLLM `mimo_mtp`, method "mtp"):
a Qwen2 model (Llama's block with query/key/value biases: zero for a model without them, the
model's own for one with `qkv_bias`) whose config.json says `num_nextn_predict_layers`, and
per module k = i + 1, in model.safetensors:

    model.mtp_layers.{i}.hidden_layernorm.weight   (D,)     mtp heads.{k}.hnorm
    model.mtp_layers.{i}.token_layernorm.weight    (D,)     mtp heads.{k}.enorm
    model.mtp_layers.{i}.input_proj.weight         (D, 2D)  mtp heads.{k}.eh_proj, over
                                                            [hidden_layernorm(h); token_layernorm(e)]
    model.mtp_layers.{i}.final_layernorm.weight    (D,)     mtp's shared norm (a copy)
    model.mtp_layers.{i}.<Qwen2 decoder layer>              mtp heads.{k}.0 (the block):
        input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj.weight,
        self_attn.{q,k,v}_proj.bias, mlp.{gate,up,down}_proj.weight

vLLM reads the block's keys under `model.mtp_layers.{i}.mtp_block.` (its loader inserts
`mtp_block.`). MiMo's module feeds on the target's final-normalised state and hands on its
own `final_layernorm` output, which is mtp's chain with the shared norm (see `mtp.model`).

Reading a MiMo directory back, biases that are all zero are dropped (the model is a Llama
again); others are kept (`MTPConfig.qkv_bias`).

DeepSeek-V3's layout (vLLM `deepseek_mtp`, SGLang `deepseek_nextn`) puts module k = i + 1 after
the main model's layers, at `model.layers.{num_hidden_layers + i}.`: `enorm.weight`,
`hnorm.weight`, `eh_proj.weight` (D, 2D) over [enorm(e); hnorm(h)] (embedding first, the
other order), `shared_head.norm.weight`, `shared_head.head.weight` (V, D), optionally
`embed_tokens.weight`, and the decoder layer's keys. Import only, for a dense Llama-like
model (model_type llama or qwen2), with one module: vLLM's deepseek_mtp chains a second
module on the first one's un-normalised output, which mtp's chain does not compute.

These names, shapes and concatenation orders agree with SGLang 0.5.23's loaders
(`sglang/srt/models/mimo_mtp.py`, `deepseek_nextn.py`, read from its wheel), which name the
keys as vLLM does; no engine was run on the files. SGLang's MiMo layer zeroes the token
embedding at position 0, which mtp's training and drafter do not: a draft may differ there,
the verified output does not. mtp has one final
norm, one unembedding and one embedding: a module's own copies of them must equal the main
model's (a ValueError names the key that differs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from mtp.interop import hf
from mtp.interop.fields import field, peek_json_object, read_json_object
from mtp.interop.hf_tokenizer import read_hf_tokenizer, write_hf_tokenizer
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
    """Whether `directory`'s config.json is MiMo's or carries DeepSeek's `num_nextn_predict_layers`."""
    values = peek_json_object(directory / hf.CONFIG_FILE)
    return values is not None and (NEXTN in values or values.get("model_type") == MIMO_TYPE)


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
    state = dict(state)
    if not config.qkv_bias:  # Qwen2's biases, zero: Llama's block exactly
        for block in _blocks(config):
            for name, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads),
                                ("wv", config.n_kv_heads)):
                state[f"{block}.attention.{name}.bias"] = torch.zeros(heads * config.head_dim,
                                                                      dtype=dtype)
        config = dataclasses.replace(config, qkv_bias=True)
    base = dataclasses.replace(config, n_future=1, head_type="block")
    tensors = {}
    for ours, (theirs, n_rotary) in hf.key_map(base).items():
        tensors[theirs] = _rotated(state[ours], n_rotary, hf.interleaved_to_rotate_half)
    for i in range(config.n_future - 1):
        prefix = f"model.mtp_layers.{i}."
        for sub, hf_sub in hf.block_keys(config).items():
            tensors[prefix + hf_sub] = _rotated(state[f"heads.{i + 1}.0.{sub}"],
                                                _rotary(config, sub),
                                                hf.interleaved_to_rotate_half)
        for ours, theirs in MIMO_FUSION.items():
            tensors[prefix + theirs] = state[f"heads.{i + 1}.{ours}"]
        tensors[prefix + "final_layernorm.weight"] = state["norm.weight"].clone()
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / hf.WEIGHTS_FILE),
              metadata={"format": "pt"})
    values = hf._llama_config(base, tokenizer, dtype)  # Qwen2's: q/k/v biases only
    values.update(architectures=[MIMO_ARCHITECTURE], model_type=MIMO_TYPE,
                  **{NEXTN: config.n_future - 1}, sliding_window=None, attention_dropout=0.0)
    hf._write_json(directory / hf.CONFIG_FILE, values)
    hf._write_json(directory / "generation_config.json", {
        "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id})
    write_hf_tokenizer(tokenizer, directory, model_max_length=config.max_seq_len)


def read_mtp_layers(directory: Path) -> tuple[MTPConfig, dict[str, Tensor], Tokenizer]:
    """Config, weights (mtp names, stored dtype) and tokenizer of a MiMo or DeepSeek-style
    directory of a dense Llama-like model (module docstring)."""
    path = directory / hf.CONFIG_FILE
    values = read_json_object(path)
    model_type = field(values, path, "model_type", "str")
    if model_type != MIMO_TYPE and model_type not in LLAMA_LIKE:
        raise ValueError(f"{path}: field 'model_type' is {model_type!r}; sequential modules "
                         f"import from dense Llama-like models only ({MIMO_TYPE!r}, "
                         f"{', '.join(map(repr, LLAMA_LIKE))}): not from mixtures of experts or "
                         f"DeepSeek-V3's latent attention")
    modules = field(values, path, NEXTN, "int", 0)
    mimo = model_type == MIMO_TYPE
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
    if config.tie_embeddings and "lm_head.weight" in theirs:  # stored anyway by some writers
        if not torch.equal(theirs.pop("lm_head.weight"), theirs["model.embed_tokens.weight"]):
            raise ValueError(f"{directory}: tie_word_embeddings is true but lm_head.weight "
                             f"differs from model.embed_tokens.weight")
    base = dataclasses.replace(config, n_future=1, head_type="block")
    state = {}
    for ours, (name, n_rotary) in hf.key_map(base).items():
        state[ours] = _rotated(_take(theirs, name, directory), n_rotary,
                               hf.rotate_half_to_interleaved)
    main = {name: state[ours] for ours, (name, _) in hf.key_map(base).items()}
    if config.tie_embeddings:
        main["lm_head.weight"] = state["tok_embeddings.weight"]
    for i in range(modules):
        prefix = f"model.mtp_layers.{i}." if mimo else f"model.layers.{config.n_layers + 1 + i}."
        for sub, hf_sub in hf.block_keys(config).items():
            state[f"heads.{i + 1}.0.{sub}"] = _rotated(
                _take(theirs, prefix + hf_sub, directory), _rotary(config, sub),
                hf.rotate_half_to_interleaved)
        for ours, name in (MIMO_FUSION if mimo else DEEPSEEK_FUSION).items():
            state[f"heads.{i + 1}.{ours}"] = _take(theirs, prefix + name, directory)
        if not mimo:  # DeepSeek's eh_proj reads [embedding; hidden]: mtp's, [hidden; embedding]
            embedding, hidden = state[f"heads.{i + 1}.eh_proj"].chunk(2, dim=1)
            state[f"heads.{i + 1}.eh_proj"] = torch.cat([hidden, embedding], dim=1)
        for name, shared in (MIMO_SHARED if mimo else DEEPSEEK_SHARED).items():
            if prefix + name not in theirs and name == "embed_tokens.weight":
                continue  # optional: vLLM takes the main model's
            copy = _take(theirs, prefix + name, directory)
            if not torch.equal(copy, main[shared]):
                raise ValueError(f"{directory}: {prefix + name} differs from {shared}; mtp's "
                                 f"modules share the main model's (one {shared})")
    if theirs:
        raise ValueError(f"{directory}: unexpected weights {sorted(theirs)[:8]} for "
                         f"{NEXTN}={modules} in {hf.CONFIG_FILE}")
    return config, state, read_hf_tokenizer(directory)


def _blocks(config: MTPConfig) -> list[str]:
    """Every block's name prefix: the trunk's, then the heads'."""
    return ([f"layers.{l}" for l in range(config.n_layers)]
            + [f"heads.{i}.{j}" for i in range(config.n_future) for j in range(config.head_layers)])


def _rotary(config: MTPConfig, sub: str) -> int | None:
    """The rotary heads of a query or key projection's weight or bias (permuted between the
    layouts), else None."""
    return {"attention.wq": config.n_heads,
            "attention.wk": config.n_kv_heads}.get(sub.rsplit(".", 1)[0])


def _rotated(tensor: Tensor, n_rotary: int | None, permute) -> Tensor:
    return tensor if n_rotary is None else permute(tensor, n_rotary)


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
