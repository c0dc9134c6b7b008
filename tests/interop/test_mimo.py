"""MiMo's layout (`to_mimo`) and DeepSeek's: the main model's logits equal transformers' Qwen2's,
a reader written here from the engines' key names (not mtp's tables) computes every module's
logits as mtp does, `mtp.load` reads both layouts back, and bad input is named."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mtp import export_hf, export_mimo, load
from mtp.convert import main
from mtp.interop.hf import HEADS_LAYOUT_FILE, interleaved_to_rotate_half
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

transformers = pytest.importorskip("transformers")

# An MTP layer's own tensors; the rest of its keys are a Qwen2 decoder layer's.
MIMO_OWN = ("hidden_layernorm.weight", "token_layernorm.weight", "input_proj.weight",
            "final_layernorm.weight")
ATOL = 1e-6  # float64, but mtp rotates queries and keys in float32


def _model(n_future: int = 3, gqa: bool = True, tie: bool = False,
           qkv_bias: bool = False) -> MTPModel:
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2 if gqa else 4,
                       max_seq_len=64, n_future=n_future, head_type="sequential",
                       tie_embeddings=tie, rope_theta=500.0, norm_eps=1e-6, qkv_bias=qkv_bias)
    model = MTPModel(config).double().eval()
    with torch.no_grad():  # norm gains away from 1 and biases from 0: every one matters
        for param in model.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)
    return model


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def _mimo_logits(directory: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every head's teacher-forced logits from MiMo files, as the engines compute them:
    transformers' Qwen2ForCausalLM for the main model, then MTP layer i = k - 1 on the
    previous depth's final-normalised state and the embedding of the token k ahead."""
    values = json.loads((directory / "config.json").read_text())
    weights = load_file(str(directory / "model.safetensors"))
    qwen = transformers.Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    previous = qwen.model(tokens).last_hidden_state  # (B, T, D), after model.norm
    logits = [qwen.lm_head(previous)]
    eps = values["rms_norm_eps"]
    for i in range(values["num_nextn_predict_layers"]):
        key = f"model.mtp_layers.{i}."
        layer = transformers.Qwen2Model(transformers.Qwen2Config(
            **{**values, "num_hidden_layers": 1})).double().eval()
        block = {f"layers.0.{name[len(key):]}": tensor for name, tensor in weights.items()
                 if name.startswith(key) and name[len(key):] not in MIMO_OWN}
        layer.load_state_dict({"embed_tokens.weight": weights["model.embed_tokens.weight"],
                               "norm.weight": weights[key + "final_layernorm.weight"], **block})
        ahead = F.pad(tokens[:, i + 1:], (0, i + 1))  # at t the token t + k
        embedded = F.embedding(ahead, weights["model.embed_tokens.weight"])
        fused = torch.cat([_rms(previous, weights[key + "hidden_layernorm.weight"], eps),
                           _rms(embedded, weights[key + "token_layernorm.weight"], eps)], dim=-1)
        x = fused @ weights[key + "input_proj.weight"].T
        previous = layer(inputs_embeds=x).last_hidden_state  # final_layernorm(block(x))
        logits.append(qwen.lm_head(previous))
    return logits


@pytest.mark.parametrize("gqa, tie, qkv_bias", [(True, False, False), (False, True, False),
                                                (True, False, True)])
def test_to_mimo_is_a_qwen2_model_and_its_mtp_layers_are_the_modules(
        tmp_path: Path, gqa: bool, tie: bool, qkv_bias: bool) -> None:
    model = _model(gqa=gqa, tie=tie, qkv_bias=qkv_bias)
    export_mimo(model, ByteTokenizer(), tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    assert (values["model_type"], values["num_nextn_predict_layers"]) == ("qwen2", 2)
    assert values["architectures"] == ["MiMoForCausalLM"]
    tokens = torch.randint(0, 262, (2, 20))
    with torch.no_grad():
        ours = model(tokens)  # (B, T, n, V)
    theirs = _mimo_logits(tmp_path, tokens)
    for k, logits in enumerate(theirs):
        torch.testing.assert_close(logits, ours[:, :, k], rtol=0, atol=ATOL, msg=f"head {k}")
    loaded, tokenizer = load(tmp_path, dtype=torch.float64)
    assert loaded.config == model.config and isinstance(tokenizer, ByteTokenizer)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), ours, rtol=0, atol=0)


def test_convert_to_mimo_and_back(tmp_path: Path) -> None:
    model = _model(n_future=2).float()
    export_hf(model, ByteTokenizer(), tmp_path / "hf")  # mtp's heads file: layout sequential
    assert json.loads((tmp_path / "hf" / HEADS_LAYOUT_FILE).read_text())["layout"] == \
        "sequential"
    main(["to_mimo", f"checkpoint={tmp_path / 'hf'}", f"output={tmp_path / 'mimo'}"])
    main(["to_mtp", f"checkpoint={tmp_path / 'mimo'}", f"output={tmp_path / 'back'}"])
    back, _ = load(tmp_path / "back")
    tokens = torch.randint(0, 262, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), model(tokens), rtol=0, atol=0)


def _deepseek_style(model: MTPModel, directory: Path) -> None:
    """A Llama directory with DeepSeek's MTP layer after its layers, written here by name."""
    export_hf(model, ByteTokenizer(), directory)
    for name in ("mtp_heads.safetensors", HEADS_LAYOUT_FILE):
        (directory / name).unlink()
    weights = load_file(str(directory / "model.safetensors"))
    values = json.loads((directory / "config.json").read_text())
    key = f"model.layers.{values['num_hidden_layers']}."
    head = model.heads[1]
    block = head[0]
    config = model.config
    weights.update({
        key + "enorm.weight": head.enorm, key + "hnorm.weight": head.hnorm,
        key + "eh_proj.weight": torch.cat(head.eh_proj.chunk(2, dim=1)[::-1], dim=1),
        key + "shared_head.norm.weight": model.norm.weight,
        key + "shared_head.head.weight": model.output.weight,
        key + "embed_tokens.weight": model.tok_embeddings.weight,
        key + "input_layernorm.weight": block.attention_norm.weight,
        key + "post_attention_layernorm.weight": block.ffn_norm.weight,
        key + "self_attn.q_proj.weight": interleaved_to_rotate_half(block.attention.wq.weight,
                                                                    config.n_heads),
        key + "self_attn.k_proj.weight": interleaved_to_rotate_half(block.attention.wk.weight,
                                                                    config.n_kv_heads),
        key + "self_attn.v_proj.weight": block.attention.wv.weight,
        key + "self_attn.o_proj.weight": block.attention.wo.weight,
        key + "mlp.gate_proj.weight": block.feed_forward.w1.weight,
        key + "mlp.up_proj.weight": block.feed_forward.w3.weight,
        key + "mlp.down_proj.weight": block.feed_forward.w2.weight})
    save_file({k: v.detach().contiguous() for k, v in weights.items()},
              str(directory / "model.safetensors"))
    values["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(values))


def test_deepseek_layout_of_a_llama_model_loads_with_equal_logits(tmp_path: Path) -> None:
    model = _model(n_future=2)
    _deepseek_style(model, tmp_path)
    loaded, _ = load(tmp_path, dtype=torch.float64)
    tokens = torch.randint(0, 262, (2, 16))
    assert loaded.config == model.config
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


def _edit(directory: Path, config: dict | None = None, weights: dict | None = None) -> None:
    if config:
        values = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**values, **config}))
    if weights:
        tensors = load_file(str(directory / "model.safetensors"))
        save_file({**tensors, **weights}, str(directory / "model.safetensors"))


@pytest.mark.parametrize("layout, config, weights, message", [
    ("mimo", {"model_type": "deepseek_v3"}, None,
     "field 'model_type' is 'deepseek_v3'; sequential modules import from dense Llama-like"),
    ("mimo", {"use_sliding_window": True}, None, "field 'use_sliding_window' is true"),
    ("mimo", None, {"model.mtp_layers.1.final_layernorm.weight": torch.ones(32)},
     r"model.mtp_layers.1.final_layernorm.weight differs from model.norm.weight"),
    ("mimo", None, {"model.mtp_layers.0.extra.weight": torch.ones(2)},
     r"unexpected weights \['model.mtp_layers.0.extra.weight'\]"),
    ("mimo", {"num_nextn_predict_layers": 3}, None,
     "weight model.mtp_layers.2.hidden_layernorm.weight is missing"),
    ("deepseek", {"num_nextn_predict_layers": 2}, None,
     "field 'num_nextn_predict_layers' must be 0 or 1 in DeepSeek's layout"),
    ("deepseek", None, {"model.layers.3.shared_head.head.weight": torch.zeros(262, 32)},
     "model.layers.3.shared_head.head.weight differs from lm_head.weight"),
])
def test_bad_checkpoints_name_the_field(tmp_path: Path, layout, config, weights,
                                        message) -> None:
    model = _model().float()
    if layout == "mimo":
        export_mimo(model, ByteTokenizer(), tmp_path)
    else:
        _deepseek_style(_model(n_future=2).float(), tmp_path)
    _edit(tmp_path, config, weights)
    with pytest.raises(ValueError, match=message):
        load(tmp_path)


def test_bad_exports_and_head_types_are_named(tmp_path: Path, tiny_config: MTPConfig) -> None:
    with pytest.raises(ValueError, match="model.head_type='block' heads have no place"):
        export_mimo(MTPModel(tiny_config), ByteTokenizer(), tmp_path / "a")
    fields = _model().config.to_dict()
    with pytest.raises(ValueError, match="model.head_layers=2"):
        export_mimo(MTPModel(MTPConfig(**{**fields, "head_layers": 2})), ByteTokenizer(),
                    tmp_path / "b")
    with pytest.raises(ValueError, match="MTPConfig.out_bias=True"):
        export_mimo(MTPModel(MTPConfig(**{**fields, "qkv_bias": True, "out_bias": True})),
                    ByteTokenizer(), tmp_path / "b")
    # One nonzero bias: read as a model with biases (Qwen2's), not dropped.
    export_mimo(_model().float(), ByteTokenizer(), tmp_path / "d")
    _edit(tmp_path / "d", weights={"model.mtp_layers.0.self_attn.k_proj.bias": torch.ones(16)})
    assert load(tmp_path / "d")[0].config.qkv_bias
    # A sequential checkpoint read as another head type: its fusion weights do not fit.
    export_hf(_model().float(), ByteTokenizer(), tmp_path / "c")
    layout = json.loads((tmp_path / "c" / HEADS_LAYOUT_FILE).read_text())
    (tmp_path / "c" / HEADS_LAYOUT_FILE).write_text(json.dumps({**layout, "layout": "block"}))
    with pytest.raises(ValueError, match=r"unexpected keys \['heads.1.eh_proj'"):
        load(tmp_path / "c")
