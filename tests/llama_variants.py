"""Llama variants users hold, as random transformers models, for the interop tests.

Each variant: (model_type, the transformers config fields, the MTPConfig fields mtp maps them
to). Every parameter, biases included, is made non-zero, so a bias mtp dropped would show.
"""

from __future__ import annotations

import torch

VARIANTS = {
    "head_dim": ("llama", dict(head_dim=16), dict(head_dim=16)),
    "biases": ("llama", dict(attention_bias=True, mlp_bias=True),
               dict(qkv_bias=True, out_bias=True, mlp_bias=True)),
    "rope_linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                   "rope_theta": 100.0}),
                    dict(rope_scaling={"type": "linear", "factor": 4.0})),
    # Wavelengths of a 16-wide head at theta 1e4 fall in all three bands of original 48.
    "rope_llama3": ("llama", dict(head_dim=16, rope_parameters={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 48, "rope_theta": 10000.0}),
        dict(head_dim=16, rope_scaling={"type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 8.0, "original_max_seq_len": 48})),
    "qwen2": ("qwen2", dict(head_dim=16), dict(qkv_bias=True, head_dim=16)),
}


def random_llama(variant: str, vocab_size: int, **fields):
    """A random transformers model of `variant`: 2 layers, width 32, 4 heads, 2 KV heads."""
    import transformers

    model_type, theirs, _ = VARIANTS[variant]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}
    config = config_class[model_type](**{
        "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        **theirs, **fields})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model
