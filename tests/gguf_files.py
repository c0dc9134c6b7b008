"""Tiny GGUF files for tests, written the way llama.cpp's convert_hf_to_gguf.py writes them.

`write_gguf` takes a transformers LlamaForCausalLM and a tokenizer and writes its GGUF: the
`llama.*` hyperparameters, the tokenizer as `tokenizer.ggml.*` metadata, and the tensors
under GGUF names, query/key rows permuted back to Meta's interleaved layout (llama.cpp's
`LlamaModel.permute`), 2-D weights in the chosen type and 1-D ones in F32. Written here from
llama.cpp's converter, not from mtp's reader, so the two can disagree.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

gguf = __import__("pytest").importorskip("gguf")
T = gguf.GGMLQuantizationType

# transformers' Llama name (after model.layers.{l}.) -> GGUF's (after blk.{l}.)
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: Hugging Face's rotate-half rows -> interleaved pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def k_quant_blocks(values: np.ndarray, qtype) -> np.ndarray:
    """Random but well-formed blocks of a K-quant (the gguf package cannot quantize to one):
    random bytes, with each block's float16 scales set to small finite values."""
    rows, cols = values.shape
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (size - 2,), T.Q2_K: (size - 4, size - 2),
              T.Q3_K: (size - 2,)}[qtype]
    for offset in scales:
        data[..., offset:offset + 2] = rng.uniform(1e-3, 4e-3, (rows, cols // block)).astype(
            np.float16)[..., None].view(np.uint8)
    return data.reshape(rows, -1)


def _quantize(tensor: torch.Tensor, qtype) -> np.ndarray:
    values = tensor.detach().float().numpy()
    if values.ndim == 1 or qtype == T.F32:
        return values
    if qtype in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        return k_quant_blocks(values, qtype)
    return gguf.quants.quantize(values, qtype)


def llama3_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float,
                      old: int) -> torch.Tensor:
    """llama.cpp's converter's rope_freqs tensor for a Llama 3.1 rope_scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def write_gguf(path: Path, model, tokenizer: dict, qtype=T.F16, *,
               extra_metadata: dict | None = None) -> Path:
    """The GGUF of transformers `model` with `tokenizer` (a dict of tokenizer.ggml.* values:
    model, pre, tokens, token_type, merges or scores, bos/eos/pad ids, add_bos_token...)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny test llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(
            head_dim, rope["rope_theta"], rope["factor"], rope["low_freq_factor"],
            rope["high_freq_factor"], rope["original_max_position_embeddings"]).numpy())
    for key, value in tokenizer.items():
        _add(writer, f"tokenizer.ggml.{key}", value)
    for key, value in (extra_metadata or {}).items():
        _add(writer, key, value)

    state = model.state_dict()
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"]}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for name, tensor in state.items():
        if not name.startswith("model.layers."):
            continue
        layer, rest = name[len("model.layers."):].split(".", 1)
        stem, kind = rest.rsplit(".", 1)
        if stem == "self_attn.q_proj":
            tensor = permute(tensor, n_head)
        elif stem == "self_attn.k_proj":
            tensor = permute(tensor, n_kv)
        tensors[f"blk.{layer}.{LAYER_NAMES[stem]}.{kind}"] = tensor
    for name, tensor in tensors.items():
        kind = qtype if tensor.ndim == 2 else T.F32
        writer.add_tensor(name, _quantize(tensor, kind), raw_dtype=kind if kind not in (
            T.F32, T.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif value and isinstance(value[0], float):
        writer.add_array(key, [float(v) for v in value])
    else:
        writer.add_array(key, list(value))


def byte_level_vocab(tokenizer, pre: str = "gpt-2") -> dict:
    """tokenizer.ggml.* values of an mtp BPETokenizer (byte-level, trained with specials
    pad/bos/eos at ids 0, 1, 2), as llama.cpp's converter writes a gpt2-type vocabulary."""
    import json

    state = json.loads(tokenizer.backend.to_str())
    vocab = state["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    return {"model": "gpt2", "pre": pre, "tokens": tokens,
            "token_type": [3 if t in ("<|pad|>", "<|bos|>", "<|eos|>") else 1 for t in tokens],
            "merges": merges, "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id, "padding_token_id": tokenizer.pad_id,
            "add_bos_token": False}
