"""EAGLE-3 drafters out to vLLM's `eagle3` and SGLang's `EAGLE3` speculative methods, and back.

An mtp EAGLE drafter (`mtp.decode.drafters.eagle_model.Eagle`) is EAGLE-3's layout exactly;
`write_eagle3` writes the directory both engines load (`LlamaForCausalLMEagle3`) and
`read_eagle3` reads one back for a target model, as plain values for `Eagle.from_state`.
docs/serving.md ("EAGLE-3 drafters") lists every key and the engine sources they come from.
Traps: SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids` count layer outputs, vLLM's
top-level field layer inputs (one more); a full draft vocabulary leaves out `d2t` and `t2d`
(vLLM 0.32 then has no `draft_id_to_target_id` and refuses the file).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mtp.interop import hf
from mtp.interop.fields import (field, load_safetensors, read_json_object, save_safetensors,
                                write_json)
from mtp.model import MTPConfig
from mtp.tokenizers import Tokenizer

ARCHITECTURE = "LlamaForCausalLMEagle3"
# mtp's Eagle parameter -> EAGLE-3's name; the block's own as transformers' Llama names them.
KEYS = {"fc.weight": "fc.weight", "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "input_norm.weight": "midlayer.input_layernorm.weight",
        "hidden_norm.weight": "midlayer.hidden_norm.weight",
        **{f"{ours}.weight": f"midlayer.{theirs}.weight" for ours, theirs in hf.BLOCK_KEYS.items()
           if ours != "attention_norm"}}
EMBEDDING = "embed_tokens.weight"


def _names(drafter: Mapping[str, Any]) -> hf.Names:
    """`KEYS`, with the query and key projections' heads (`hf.key_map`'s form)."""
    rotary = {"attention.wq.weight": drafter["n_heads"],
              "attention.wk.weight": drafter["n_kv_heads"]}
    return {ours: (theirs, rotary.get(ours)) for ours, theirs in KEYS.items()}


def write_eagle3(target: MTPConfig, tokenizer: Tokenizer, drafter: Mapping[str, Any],
                 state: Mapping[str, Tensor], embedding: Tensor, directory: Path,
                 dtype: torch.dtype | None = None) -> Path:
    """Write the EAGLE-3 directory of a drafter (`EagleConfig.to_dict()` and state) for
    `target` and its token `embedding`, in `dtype` (None: the state's)."""
    dtype = dtype or state["fc.weight"].dtype
    tensors = hf.to_theirs({k: state[k].detach().to("cpu", dtype) for k in KEYS}, _names(drafter))
    d2t = state["d2t"].cpu().long()
    if len(d2t) < target.vocab_size:  # a full draft vocabulary is the identity: no map
        tensors["d2t"] = d2t - torch.arange(len(d2t))  # the engines add arange(N) back
        tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill(0, d2t,
                                                                                      True)
    tensors[EMBEDDING] = embedding.detach().to("cpu", dtype)
    save_safetensors({k: v.contiguous() for k, v in tensors.items()},
                     directory / hf.WEIGHTS_FILE)
    write_json(directory / hf.CONFIG_FILE, eagle3_config(target, tokenizer, drafter, dtype))
    return directory


def eagle3_config(target: MTPConfig, tokenizer: Tokenizer, drafter: Mapping[str, Any],
                  dtype: torch.dtype) -> dict[str, Any]:
    """config.json: the target's Llama config, narrowed to the drafter's one layer."""
    values = hf._llama_config(target, tokenizer, dtype)  # rotary settings, token ids
    layers = list(drafter["layers"])
    values.update(
        architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1,
        hidden_size=drafter["target_dim"], target_hidden_size=drafter["target_dim"],
        intermediate_size=drafter["ffn_hidden"], num_attention_heads=drafter["n_heads"],
        num_key_value_heads=drafter["n_kv_heads"], head_dim=drafter["head_dim"],
        rms_norm_eps=drafter["norm_eps"], vocab_size=drafter["target_vocab_size"],
        draft_vocab_size=drafter["draft_vocab_size"], tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True},
        eagle_aux_hidden_state_layer_ids=[layer + 1 for layer in layers])
    return values


def read_eagle3(directory: Path, target: MTPConfig, embedding: Tensor,
                default_layers: Sequence[int]) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The drafter's config fields and state (for `Eagle.from_state`) of an EAGLE-3 directory
    for `target` and its token `embedding`; `default_layers` where the config names none."""
    path = directory / hf.CONFIG_FILE
    values = read_json_object(path)
    architectures = field(values, path, "architectures", "list", [])
    if not any("Eagle3" in str(name) for name in architectures):
        raise ValueError(f"{path}: architectures {architectures} is not an EAGLE-3 drafter's "
                         f"(e.g. {ARCHITECTURE})")
    if field(values, path, "num_hidden_layers", "int") != 1:
        raise ValueError(f"{path}: num_hidden_layers={values['num_hidden_layers']}: mtp's EAGLE "
                         f"drafter has one layer")
    width = field(values, path, "hidden_size", "int")
    vocab = field(values, path, "vocab_size", "int")
    heads = field(values, path, "num_attention_heads", "int")
    if field(values, path, "target_hidden_size", "int", width) != width:
        raise ValueError(f"{path}: hidden_size={width} differs from target_hidden_size="
                         f"{values['target_hidden_size']}: mtp's drafter is as wide as its "
                         f"target")
    drafter = {"target_dim": width, "target_vocab_size": vocab,
               "target_layers": target.n_layers, "layers": _layers(values, path, default_layers),
               "draft_vocab_size": field(values, path, "draft_vocab_size", "int", vocab),
               "n_heads": heads, "n_kv_heads": field(values, path, "num_key_value_heads", "int",
                                                     heads),
               "head_dim": field(values, path, "head_dim", "int", width // heads),
               "ffn_hidden": field(values, path, "intermediate_size", "int"),
               "norm_eps": field(values, path, "rms_norm_eps", "number")}
    weights = directory / hf.WEIGHTS_FILE
    tensors = load_safetensors(weights)
    state = hf.to_ours(tensors, _names(drafter), drafter["head_dim"], weights)
    offsets = tensors.get("d2t")
    state["d2t"] = torch.arange(drafter["draft_vocab_size"]) + (0 if offsets is None
                                                                 else offsets.long())
    own = tensors.get(EMBEDDING)
    if own is not None and (own.shape != embedding.shape
                            or not torch.equal(own.to(embedding), embedding.detach())):
        raise ValueError(f"{weights}: {EMBEDDING} differs from the target's token embedding, "
                         f"which mtp's drafter reads")
    return drafter, state


def _layers(values: dict[str, Any], path: Path, default: Sequence[int]) -> list[int]:
    """The trunk layers the drafter reads: SGLang's field, else vLLM's (one more), or default."""
    eagle = field(values, path, "eagle_config", "object", {})
    if eagle.get("eagle_aux_hidden_state_layer_ids"):
        return list(eagle["eagle_aux_hidden_state_layer_ids"])
    ids = field(values, path, "eagle_aux_hidden_state_layer_ids", "list", None)
    return [int(i) - 1 for i in ids] if ids else list(default)
