"""EAGLE-3 drafters out to vLLM's `eagle3` and SGLang's `EAGLE3` speculative methods, and back.

An mtp EAGLE drafter (`mtp.decode.drafters.eagle_model.Eagle`) is EAGLE-3's layout exactly: `fc`
fuses three target layers' residual streams [low; middle; high] (3D -> D); one decoder layer
whose q/k/v read [input_layernorm(embedding); hidden_norm(fused feature)] (2D) with the fused
feature as the residual; a final norm; an lm_head over the draft vocabulary, mapped to the
target's ids. `write_eagle3` writes the directory both engines load
(`LlamaForCausalLMEagle3`, as SafeAILab's released EAGLE-3 checkpoints name it), and
`read_eagle3` reads one back for a target model. Both translate plain values, the drafter's
config fields and state dict (mtp's names; `d2t` the target ids), as the rest of interop
does: `Eagle.from_state` builds the drafter, and checks it.

config.json: a Llama config of one layer (`num_hidden_layers` 1) with the target's width,
heads, head width, feed-forward width, norm epsilon and rotary settings, and
  architectures          ["LlamaForCausalLMEagle3"]  (vLLM's registry and SGLang's EntryClass)
  vocab_size             the target's V;  draft_vocab_size N (the lm_head's rows)
  target_hidden_size     the target's width (the fc reads 3 x it)
  tie_word_embeddings    false (SGLang would make the lm_head the embedding)
  eagle_config           {"eagle_aux_hidden_state_layer_ids": [i, j, k], "use_aux_hidden_state":
                         true}: SGLang's field; it captures the output of layer id (it adds 1
                         and captures that layer's input), which is mtp's trunk layer index
  eagle_aux_hidden_state_layer_ids  [i + 1, j + 1, k + 1]: vLLM's field, read at the top
                         level; it captures the input of layer id
mtp's default layers are both engines' own default, (2, L // 2, L - 3) as layer inputs, so an
engine version that reads neither field captures the same features.

model.safetensors (D width, N draft tokens, V target tokens, H/K query/key heads, hd):
  fc.weight (D, 3D); norm.weight (D,); lm_head.weight (N, D)
  midlayer.input_layernorm.weight (D,)         on the token's embedding
  midlayer.hidden_norm.weight (D,)             on the fused feature
  midlayer.self_attn.{q,k,v}_proj.weight (H*hd | K*hd, 2D); o_proj (D, H*hd)
  midlayer.post_attention_layernorm.weight (D,); midlayer.mlp.{gate,up,down}_proj.weight
  d2t (N,) int64: target id - draft id (vLLM and SGLang add arange(N) to it)
  t2d (V,) bool: whether each target token is in the draft vocabulary (both engines skip it;
      EAGLE's training code writes it)
  (neither where N = V: the map is the identity, and vLLM 0.32 then has no parameter for
  d2t and refuses the file: "no module or parameter named 'draft_id_to_target_id'")
  embed_tokens.weight (V, D): the target's embedding (both engines may use the target's own;
      the drafter's must equal it, and `read_eagle3` checks that it does)
q and k rows are permuted from mtp's interleaved rotary pairs to transformers' halves
(`hf.interleaved_to_rotate_half`), as for every Llama layer mtp writes.

Where the names come from: vLLM's `model_executor/models/llama_eagle3.py` (its load_weights
renames `midlayer.` to `layers.0.`, `d2t` to `draft_id_to_target_id`, skips `t2d`; its
config reads draft_vocab_size, target_hidden_size and eagle_config.use_aux_hidden_state) and
`v1/worker/gpu/spec_decode/eagle/eagle3_utils.py` (eagle_aux_hidden_state_layer_ids); SGLang's
`srt/models/llama_eagle3.py` (midlayer, hot tokens = d2t + arange) and its model runner
(eagle_config.eagle_aux_hidden_state_layer_ids, + 1 in `set_eagle3_layers_to_capture`);
SafeAILab/EAGLE's `eagle/traineagle3/cnets.py` (the layer's math, d2t and t2d). No engine was
run on the files here; the tests read them back with a reader written from those sources.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from mtp.interop import hf
from mtp.interop.fields import field, load_safetensors, read_json_object, write_json
from mtp.model import MTPConfig
from mtp.tokenizers import Tokenizer

ARCHITECTURE = "LlamaForCausalLMEagle3"
# mtp's Eagle parameter -> EAGLE-3's name; the block's own as transformers' Llama names them.
KEYS = {"fc.weight": "fc.weight", "norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "input_norm.weight": "midlayer.input_layernorm.weight",
        "hidden_norm.weight": "midlayer.hidden_norm.weight",
        **{ours: f"midlayer.{theirs}" for ours, theirs in hf.BLOCK_KEYS.items()
           if ours != "attention_norm.weight"}}
EMBEDDING = "embed_tokens.weight"


def _rotary(drafter: Mapping[str, Any]) -> dict[str, int]:
    """The query and key projections, whose rows the two rotary layouts order differently."""
    return {"attention.wq.weight": drafter["n_heads"],
            "attention.wk.weight": drafter["n_kv_heads"]}


def write_eagle3(target: MTPConfig, tokenizer: Tokenizer, drafter: Mapping[str, Any],
                 state: Mapping[str, Tensor], embedding: Tensor, directory: Path,
                 dtype: torch.dtype | None = None) -> Path:
    """Write an EAGLE-3 directory (module docstring) of the drafter whose config fields
    (`EagleConfig.to_dict()`) and state (mtp's names, `d2t` target ids) are given, for the
    model of `target` whose token embedding is `embedding`; in `dtype` (None: the state's)."""
    dtype = dtype or state["fc.weight"].dtype
    rotary = _rotary(drafter)
    tensors = {}
    for ours, theirs in KEYS.items():
        tensor = state[ours].detach().to("cpu", dtype)
        if ours in rotary:
            tensor = hf.interleaved_to_rotate_half(tensor, rotary[ours])
        tensors[theirs] = tensor
    d2t = state["d2t"].cpu().long()
    if len(d2t) < target.vocab_size:  # a full draft vocabulary is the identity: no map
        tensors["d2t"] = d2t - torch.arange(len(d2t))  # the engines add arange(N) back
        tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill(0, d2t,
                                                                                      True)
    tensors[EMBEDDING] = embedding.detach().to("cpu", dtype)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / hf.WEIGHTS_FILE),
              metadata={"format": "pt"})
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
    """An EAGLE-3 directory (vLLM's and SGLang's layout) read as a drafter for the model of
    `target`, whose token embedding is `embedding`: the drafter's config fields and state
    (mtp's names, `d2t` the target ids), for `Eagle.from_state`. `default_layers`: the trunk
    layers when the config names none (the engines' default: `eagle.engine_layers`). A
    ValueError names the file and the field that does not fit."""
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
    rotary, state = _rotary(drafter), {}
    for ours, theirs in KEYS.items():
        if theirs not in tensors:
            raise ValueError(f"{weights} has no {theirs}")
        tensor = tensors[theirs]
        state[ours] = hf.rotate_half_to_interleaved(tensor, rotary[ours]) if ours in rotary \
            else tensor
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
    """The trunk layers the drafter reads: SGLang's field (layer outputs), else vLLM's (layer
    inputs, one more), else `default`."""
    eagle = field(values, path, "eagle_config", "object", {})
    if eagle.get("eagle_aux_hidden_state_layer_ids"):
        return list(eagle["eagle_aux_hidden_state_layer_ids"])
    ids = field(values, path, "eagle_aux_hidden_state_layer_ids", "list", None)
    return [int(i) - 1 for i in ids] if ids else list(default)


__all__ = ["ARCHITECTURE", "KEYS", "eagle3_config", "read_eagle3", "write_eagle3"]
