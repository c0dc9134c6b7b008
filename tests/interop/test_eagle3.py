"""The EAGLE-3 export (`to_eagle3`): a reader written here from vLLM's and SGLang's
`llama_eagle3.py` (transformers' Llama rotary, norm and MLP; the layer's wiring, `fc`, the
feature capture and `d2t` as the engines read them) gives mtp's draft logits, the files read
back into the same drafter (the same drafts when decoding), and bad input is named."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from mtp.checkpoint import export
from mtp.convert import main, parse_args
from mtp.decode.drafters.eagle import EagleDrafter
from mtp.decode.drafters.eagle_model import Eagle, EagleConfig, engine_layers
from mtp.decode.loop import generate
from mtp.interop.eagle3 import read_eagle3, write_eagle3
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

transformers = pytest.importorskip("transformers")
llama = pytest.importorskip("transformers.models.llama.modeling_llama")

TOKENIZER = ByteTokenizer()
ATOL = 1e-6  # float64, but mtp rotates queries and keys in float32


@pytest.fixture
def pair():
    """A target of 10 trunk layers and head 0 (the engines' default layers: 1, 4, 7) and a
    random drafter over 200 of its tokens, norms away from 1."""
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=262, dim=32, n_layers=10, n_heads=4, n_kv_heads=2,
                       max_seq_len=64, rope_theta=500.0, norm_eps=1e-6)
    model = MTPModel(config).double().eval()
    d2t = torch.randperm(262)[:200].sort().values
    module = Eagle(EagleConfig.for_target(config, 200), d2t).double().eval()
    with torch.no_grad():
        for param in module.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)
    return model, module


@torch.no_grad()
def _engine_logits(directory: Path, target: MTPModel, tokens: torch.Tensor) -> torch.Tensor:
    """Draft logits over the target's vocabulary at every position of a draft prefill over
    `tokens` (B, T + 1), as vLLM and SGLang compute them from the files: the target's
    residual stream at the inputs of layers `eagle_aux_hidden_state_layer_ids` (vLLM's),
    concatenated and fused by fc; at position t the pair (feature t, token t + 1); then
    `midlayer`, the final norm, lm_head, and draft id i at target id i + d2t[i]."""
    values = json.loads((directory / "config.json").read_text())
    w = load_file(str(directory / "model.safetensors"))
    config = transformers.LlamaConfig(**{k: v for k, v in values.items()
                                         if k not in ("architectures",)})
    eps, H, K = values["rms_norm_eps"], values["num_attention_heads"], values["num_key_value_heads"]
    hd = values["head_dim"]
    T = tokens.shape[1] - 1
    _, kept = target.trunk_states(tokens[:, :T], keep=[i - 1 for i in
                                                       values["eagle_aux_hidden_state_layer_ids"]])
    hidden = kept.flatten(-2) @ w["fc.weight"].T  # (B, T, D)
    embeds = w["embed_tokens.weight"][tokens[:, 1:]]

    def norm(x, name):
        layer = llama.LlamaRMSNorm(x.shape[-1], eps=eps).double()
        layer.weight.copy_(w[name])
        return layer(x)

    residual = hidden
    x = torch.cat([norm(embeds, "midlayer.input_layernorm.weight"),
                   norm(hidden, "midlayer.hidden_norm.weight")], dim=-1)  # [embeds; hidden]
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).unflatten(-1, (H, hd)).transpose(1, 2)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).unflatten(-1, (K, hd)).transpose(1, 2)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).unflatten(-1, (K, hd)).transpose(1, 2)
    rotary = llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(x, torch.arange(T)[None])
    q, k = llama.apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = residual + out.transpose(1, 2).flatten(-2) @ w["midlayer.self_attn.o_proj.weight"].T
    mlp = llama.LlamaMLP(config).double()
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, name).weight.copy_(w[f"midlayer.mlp.{name}.weight"])
    h = h + mlp(norm(h, "midlayer.post_attention_layernorm.weight"))
    draft = norm(h, "norm.weight") @ w["lm_head.weight"].T  # (B, T, N)
    targets = torch.arange(len(w["d2t"])) + w["d2t"]
    full = torch.full((*draft.shape[:-1], values["vocab_size"]), -torch.inf, dtype=draft.dtype)
    full[..., targets] = draft
    return full


def test_the_engines_read_the_drafters_logits(tmp_path, pair):
    model, module = pair
    write_eagle3(model.config, TOKENIZER, module.config.to_dict(), module.state_dict(),
                 model.tok_embeddings.weight, tmp_path / "eagle3")
    tokens = torch.randint(0, 262, (2, 13))
    theirs = _engine_logits(tmp_path / "eagle3", model, tokens)
    with torch.no_grad():
        _, features = model.trunk_states(tokens[:, :12], keep=module.config.layers)
        cos, sin = model.rope(12)
        h = module(module.fuse(features), model.tok_embeddings(tokens[:, 1:]), cos, sin)
        ours = module.target_logits(h)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)
    values = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert values["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (values["draft_vocab_size"], values["vocab_size"], values["target_hidden_size"],
            values["num_hidden_layers"], values["tie_word_embeddings"]) == (200, 262, 32, 1,
                                                                            False)
    # Both engines' conventions name the same layers, which are their default.
    assert module.config.layers == engine_layers(model.config) == (1, 4, 7)
    assert values["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 7]  # SGLang
    assert values["eagle_aux_hidden_state_layer_ids"] == [2, 5, 8]  # vLLM: layer inputs
    weights = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
    assert weights["t2d"].dtype == torch.bool and int(weights["t2d"].sum()) == 200
    assert torch.equal(weights["d2t"] + torch.arange(200), module.d2t)


def test_the_files_read_back_into_the_same_drafter(tmp_path, pair):
    model, module = pair
    write_eagle3(model.config, TOKENIZER, module.config.to_dict(), module.state_dict(),
                 model.tok_embeddings.weight, tmp_path / "eagle3")
    values, state = read_eagle3(tmp_path / "eagle3", model.config, model.tok_embeddings.weight,
                                engine_layers(model.config))
    back = Eagle.from_state(values, state, "the export")
    assert back.config == module.config
    for name, tensor in module.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    prompts = ["def add(", "print('h", "x"]
    runs = [generate(model, TOKENIZER, prompts, max_new_tokens=20, drafter=EagleDrafter(m, 4))
            for m in (module, back)]
    assert [g.token_ids for g in runs[0]] == [g.token_ids for g in runs[1]]
    assert [g.stats.accepted_depths for g in runs[0]] == [g.stats.accepted_depths
                                                          for g in runs[1]]


def test_the_convert_command_writes_the_trained_drafter(tmp_path, pair):
    model, module = pair
    export(model.float(), TOKENIZER, tmp_path / "target")
    module.float().save(tmp_path / "drafter")
    main(["to_eagle3", f"checkpoint={tmp_path / 'target'}", f"eagle={tmp_path / 'drafter'}",
          f"output={tmp_path / 'served'}", "dtype=bfloat16"])
    weights = load_file(str(tmp_path / "served" / "model.safetensors"))
    assert weights["fc.weight"].dtype == torch.bfloat16
    assert json.loads((tmp_path / "served" / "config.json").read_text())["torch_dtype"] == \
        "bfloat16"
    with pytest.raises(ValueError, match="no EAGLE drafter for"):
        main(["to_eagle3", f"checkpoint={tmp_path / 'target'}", f"output={tmp_path / 'x'}"])
    with pytest.raises(ValueError, match="eagle=d names the drafter that to_eagle3 exports"):
        parse_args(["to_hf", "checkpoint=a", "output=b", "eagle=d"])


def test_bad_files_are_named(tmp_path, pair, tiny_config):
    model, module = pair
    directory = tmp_path / "eagle3"
    write_eagle3(model.config, TOKENIZER, module.config.to_dict(), module.state_dict(),
                 model.tok_embeddings.weight, directory)
    layers = engine_layers(model.config)

    def read(target=model):
        values, state = read_eagle3(directory, target.config, target.tok_embeddings.weight,
                                    layers)
        return Eagle.from_state(values, state, "the export")

    other = MTPModel(MTPConfig(**{**model.config.to_dict(), "dim": 16, "n_heads": 2,
                                  "n_kv_heads": 1})).double()
    with pytest.raises(ValueError, match="trained for a model with dim=32, but this model has "
                                         "dim=16"):
        module.config.check_target(other.config, "the export")
    with pytest.raises(ValueError, match="embed_tokens.weight differs from the target's"):
        read(MTPModel(model.config).double())
    weights = load_file(str(directory / "model.safetensors"))
    weights["d2t"][5] += 1000
    save_file(weights, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="entry 5 is .*, outside the target's vocabulary of 262"):
        read()
    values = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**values,
                                                       "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="is not an EAGLE-3 drafter's"):
        read()
