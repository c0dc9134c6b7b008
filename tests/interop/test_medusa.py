"""Medusa export: both layouts read back by readers written from the engines' key names alone
give mtp's logits, on transformers' own final hidden states; mtp.load gets every head back.

The readers below follow vLLM's `model_executor/models/medusa.py` (ResidualBlock, lm_heads,
original_lm_head) and FasterDecoding's `medusa_model.py` (an nn.ModuleList of
nn.Sequential(ResBlock * L, nn.Linear(D, V, bias=False)) loading `medusa_lm_head.pt` with
`load_state_dict(strict=False)`), not mtp's writer.
"""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from mtp import load
from mtp.checkpoint import export, export_medusa
from mtp.convert import main
from mtp.generate import HeadsDrafter, generate
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

transformers = pytest.importorskip("transformers")


def _model(head_layers: int = 1, head_type: str = "medusa", n_future: int = 4,
            tie: bool = False) -> MTPModel:
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       max_seq_len=64, n_future=n_future, head_layers=head_layers,
                       head_type=head_type, tie_embeddings=tie, norm_eps=1e-6)
    model = MTPModel(config).eval()
    with torch.no_grad():  # a final norm gain far from 1 and heads far from the identity
        model.norm.weight.uniform_(0.5, 2.0)
        for i in range(1, n_future):
            for layer in model.heads[i]:
                if hasattr(layer, "weight") and layer.weight.dim() == 2:
                    layer.weight.normal_(0.0, 0.3)
    return model


def _export(model: MTPModel, directory: Path) -> None:
    """export_medusa, which warns exactly when FasterDecoding's own model cannot run the heads
    (it repeats one ResBlock module per head: head_layers > 1)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_medusa(model, ByteTokenizer(), directory)
    notes = [w for w in caught if "FasterDecoding" in str(w.message)]
    assert len(notes) == (model.config.head_layers > 1)


def _transformers_states(base: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' final hidden state (after the final norm: Medusa's input) and logits."""
    llama = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64).eval()
    with torch.no_grad():
        hidden = llama.model(tokens).last_hidden_state  # (B, T, D)
        return hidden, llama.lm_head(hidden)


def _head_layers(model: MTPModel, index: int, hidden: torch.Tensor) -> torch.Tensor:
    """mtp's head `index` layers on a given final hidden state (what model.head feeds them)."""
    for layer in model.heads[index]:
        hidden = layer(hidden, None, None, None, None)
    return hidden


def _vllm_logits(directory: Path, hidden: torch.Tensor, shared_lm_head: bool) -> list:
    """vLLM's Medusa: ResidualBlock layers x + SiLU(layer(x)), then lm_heads[h] (or the one
    lm_head from lm_heads.0 when original_lm_head)."""
    config = json.loads((directory / "config.json").read_text())
    weights = load_file(directory / "model.safetensors")
    assert config["model_type"] == "medusa" and config["truncated_vocab_size"] == 262
    logits = []
    for h in range(config["num_heads"]):
        x = hidden
        for l in range(config["num_hidden_layers"]):
            bias = weights[f"blocks.{h}.layers.{l}.bias"].double() \
                if config.get("medusa_fc_bias", False) else None
            x = x + F.silu(F.linear(x, weights[f"blocks.{h}.layers.{l}.weight"].double(), bias))
        lm_head = weights["lm_heads.0.weight" if shared_lm_head else f"lm_heads.{h}.weight"]
        logits.append(F.linear(x, lm_head.double()))
    return logits


class ResBlock(nn.Module):  # FasterDecoding's, verbatim in substance
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        torch.nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def _fasterdecoding_logits(directory: Path, hidden: torch.Tensor) -> list:
    """FasterDecoding's MedusaModel heads (one layer per head: its `[ResBlock] * L` repeats
    one module) loaded as its from_pretrained does."""
    config = json.loads((directory / "config.json").read_text())
    n_heads, n_layers = config["medusa_num_heads"], config["medusa_num_layers"]
    D, V = hidden.shape[-1], 262
    medusa_head = nn.ModuleList([nn.Sequential(*([ResBlock(D)] * n_layers),
                                               nn.Linear(D, V, bias=False))
                                 for _ in range(n_heads)]).double()
    state = torch.load(directory / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    result = medusa_head.load_state_dict(state, strict=False)
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        return [medusa_head[h](hidden) for h in range(n_heads)]


def _layerwise_logits(directory: Path, hidden: torch.Tensor) -> list:
    """The same file read layer by layer, as TensorRT-LLM's Medusa conversion reads it
    (`{h}.{l}.linear.weight/bias`, `{h}.{L}.weight`): each layer its own weights."""
    config = json.loads((directory / "config.json").read_text())
    n_layers = config["medusa_num_layers"]
    state = torch.load(directory / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    logits = []
    for h in range(config["medusa_num_heads"]):
        x = hidden
        for l in range(n_layers):
            x = x + F.silu(F.linear(x, state[f"{h}.{l}.linear.weight"].double(),
                                    state[f"{h}.{l}.linear.bias"].double()))
        logits.append(F.linear(x, state[f"{h}.{n_layers}.weight"].double()))
    return logits


@pytest.mark.parametrize("head_layers, tie", [(1, False), (2, False), (1, True)])
def test_both_layouts_give_mtp_logits_on_transformers_hidden_states(
        tmp_path: Path, head_layers: int, tie: bool) -> None:
    model = _model(head_layers, tie=tie)
    _export(model, tmp_path)
    assert sorted(p.name for p in (tmp_path / "base").iterdir() if "mtp_heads" in p.name) == []
    tokens = torch.randint(0, 262, (2, 20))
    hidden, base_logits = _transformers_states(tmp_path / "base", tokens)
    reference = model.double()
    with torch.no_grad():
        ours = reference(tokens)  # (B, T, n, V)
        # transformers' final hidden state is mtp's head 0 output after the shared norm (up to
        # rotary tables: float32 in both, computed differently)
        mtp_hidden = reference.norm(reference.head(reference.trunk(tokens), 0))
        torch.testing.assert_close(hidden, mtp_hidden, rtol=0, atol=1e-6)
        torch.testing.assert_close(base_logits, ours[:, :, 0], rtol=0, atol=1e-6)
        on_hidden = [reference.unembed(_head_layers(reference, i, hidden), i) for i in (1, 2, 3)]
    readers = [_vllm_logits(tmp_path / "vllm", hidden, shared_lm_head=False),
               _vllm_logits(tmp_path / "vllm", hidden, shared_lm_head=True),
               _layerwise_logits(tmp_path / "medusa", hidden)]
    if head_layers == 1:
        readers.append(_fasterdecoding_logits(tmp_path / "medusa", hidden))
    else:  # what the export warns about: one ResBlock module repeated runs other weights
        tied = _fasterdecoding_logits(tmp_path / "medusa", hidden)
        assert not torch.allclose(tied[0], on_hidden[0], atol=1e-3)
    for logits in readers:
        assert len(logits) == 3
        for h, head_logits in enumerate(logits):  # Medusa's head h is mtp's head h + 1
            torch.testing.assert_close(head_logits, on_hidden[h], rtol=0, atol=1e-12)
            torch.testing.assert_close(head_logits, ours[:, :, h + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(ours[:, :, 1], ours[:, :, 0], atol=1e-3)  # heads really differ


def test_exported_config_fields_and_shapes(tmp_path: Path) -> None:
    _export(_model(), tmp_path)
    vllm = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert {k: vllm[k] for k in ("model_type", "num_heads", "num_hidden_layers", "hidden_size",
                                 "vocab_size", "truncated_vocab_size", "medusa_fc_bias",
                                 "original_lm_head")} == {
        "model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1, "hidden_size": 32,
        "vocab_size": 262, "truncated_vocab_size": 262, "medusa_fc_bias": False,
        "original_lm_head": True}
    # vLLM renames every config key with "num" and "heads" in it to num_heads: only one here
    assert [k for k in vllm if "num" in k and "heads" in k] == ["num_heads"]
    weights = load_file(tmp_path / "vllm" / "model.safetensors")
    shapes = {k: tuple(v.shape) for k, v in weights.items()}
    assert shapes == {**{f"blocks.{h}.layers.0.weight": (32, 32) for h in range(3)},
                      **{f"lm_heads.{h}.weight": (262, 32) for h in range(3)}}
    medusa = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert (medusa["medusa_num_heads"], medusa["medusa_num_layers"]) == (3, 1)
    assert Path(medusa["base_model_name_or_path"]) == (tmp_path / "base").resolve()
    state = torch.load(tmp_path / "medusa" / "medusa_lm_head.pt", weights_only=True)
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        **{f"{h}.0.linear.weight": (32, 32) for h in range(3)},
        **{f"{h}.0.linear.bias": (32,) for h in range(3)},
        **{f"{h}.1.weight": (262, 32) for h in range(3)}}
    assert not any(state[f"{h}.0.linear.bias"].any() for h in range(3))


@pytest.mark.parametrize("layout", ["vllm", "medusa"])
@pytest.mark.parametrize("head_layers, tie", [(1, False), (2, False), (1, True)])
def test_mtp_load_gives_every_head_back(tmp_path: Path, layout: str, head_layers: int,
                                        tie: bool) -> None:
    model = _model(head_layers, tie=tie)
    _export(model, tmp_path)
    shutil.rmtree(tmp_path / ("medusa" if layout == "vllm" else "vllm"))
    loaded, tokenizer = load(tmp_path)
    assert loaded.config == model.config and isinstance(tokenizer, ByteTokenizer)
    tokens = torch.randint(0, 262, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)


def test_loaded_heads_decode_losslessly(tmp_path: Path) -> None:
    _export(_model(), tmp_path)
    model, tokenizer = load(tmp_path, dtype=torch.float64)
    prompts = ["def add(", "hello"]
    reference = generate(model, tokenizer, prompts, max_new_tokens=24)
    drafted = generate(model, tokenizer, prompts, max_new_tokens=24, drafter=HeadsDrafter(4))
    assert [g.token_ids for g in drafted] == [g.token_ids for g in reference]


def test_convert_command(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    model = _model()
    export(model, ByteTokenizer(), tmp_path / "export")
    main(["to_medusa", f"checkpoint={tmp_path / 'export'}", f"output={tmp_path / 'out'}",
          "dtype=bfloat16"])
    assert "wrote" in capsys.readouterr().out
    assert load_file(tmp_path / "out" / "vllm" / "model.safetensors")[
        "lm_heads.0.weight"].dtype == torch.bfloat16
    loaded, _ = load(tmp_path / "out")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(loaded.heads[1][0].weight, model.heads[1][0].weight.bfloat16(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, message", [
    ({"head_type": "resblock"}, r"head_type='resblock'.*read the trunk output.*"
                                r"model.head_type=medusa"),
    ({"head_type": "block"}, r"head_type='block'.*transformer blocks"),
    ({"head_type": "linear"}, r"head_type='linear'.*no residual"),
    ({"n_future": 1}, r"one head \(n_future=1\)"),
])
def test_models_that_do_not_map_are_refused_before_writing(tmp_path: Path, kwargs: dict,
                                                            message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        export_medusa(_model(**kwargs), ByteTokenizer(), tmp_path / "out")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def _edit_vllm(directory: Path, config: dict | None = None, tensors: dict | None = None) -> None:
    path = directory / "vllm" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **(config or {})}))
    weights = directory / "vllm" / "model.safetensors"
    save_file({**load_file(weights), **(tensors or {})}, str(weights))


@pytest.mark.parametrize("config, tensors, message", [
    ({"original_lm_head": False}, {"lm_heads.1.weight": torch.ones(262, 32)},
     r"head 1's lm_head differs"),
    ({"original_lm_head": False, "medusa_fc_bias": True},
     {f"blocks.{h}.layers.0.bias": torch.full((32,), 0.1) for h in range(3)},
     r"head 0 layer 0 has a non-zero bias"),
    ({"truncated_vocab_size": 100}, {}, r"truncated_vocab_size.*token_map"),
    ({"num_hidden_layers": 4}, {f"blocks.{h}.layers.{l}.weight": torch.zeros(32, 32)
                                for h in range(3) for l in range(1, 4)},
     r"heads of 4 layers need a base model of at least as many layers.*got 3"),
    ({"num_heads": 4}, {}, r"missing keys \['blocks.3.layers.0.weight'\]"),
    ({"model_type": "eagle"}, {}, r"'model_type' must be 'medusa'"),
])
def test_heads_mtp_cannot_express_are_refused(tmp_path: Path, config: dict, tensors: dict,
                                              message: str) -> None:
    _export(_model(), tmp_path)
    _edit_vllm(tmp_path, config, tensors)
    with pytest.raises(ValueError, match=message) as error:
        load(tmp_path)
    assert "\n" not in str(error.value)


def test_fasterdecoding_bias_and_keys_are_checked(tmp_path: Path) -> None:
    _export(_model(), tmp_path)
    shutil.rmtree(tmp_path / "vllm")
    path = tmp_path / "medusa" / "medusa_lm_head.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "2.0.linear.bias": torch.ones(32)}, path)
    with pytest.raises(ValueError, match=r"head 2 layer 0 has a non-zero bias"):
        load(tmp_path)
    torch.save({f"medusa_head.{k}": v for k, v in state.items()}, path)
    with pytest.raises(ValueError, match=r"unexpected keys \['medusa_head.0.0.linear.bias'"):
        load(tmp_path)
