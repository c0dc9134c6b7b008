"""Portable export and load: identical logits, clear errors for broken or foreign files."""

import json
from pathlib import Path

import pytest
import torch

from mtp.checkpoint import WEIGHTS_FILE, export, load, tokenizer_files
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import BPETokenizer, ByteTokenizer


@pytest.mark.parametrize("tie", [False, True])
def test_export_round_trip_gives_identical_logits(tmp_path: Path, tiny_config: MTPConfig,
                                                  tie: bool) -> None:
    config = MTPConfig.from_dict({**tiny_config.to_dict(), "tie_embeddings": tie})
    model = MTPModel(config).eval()
    export(model, ByteTokenizer(), tmp_path)
    loaded, tokenizer = load(tmp_path)
    assert loaded.config == config and isinstance(tokenizer, ByteTokenizer)
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    torch.testing.assert_close(loaded(tokens), model(tokens), rtol=0, atol=0)
    assert not loaded.training


def test_load_converts_dtype(tmp_path: Path, tiny_config: MTPConfig) -> None:
    export(MTPModel(tiny_config), ByteTokenizer(), tmp_path)
    model, _ = load(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.rope_cos.dtype == torch.float32  # the rotary tables stay exact


def test_bpe_tokenizer_travels_with_the_export(tmp_path: Path) -> None:
    tokenizer = BPETokenizer.train(["def f(x):\n    return x\n"] * 20, vocab_size=300)
    config = MTPConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=1, n_heads=4)
    export(MTPModel(config), tokenizer, tmp_path)
    _, loaded = load(tmp_path)
    assert loaded.encode("return x") == tokenizer.encode("return x")


def test_lightning_checkpoint_loads_without_lightning(tmp_path: Path,
                                                     tiny_config: MTPConfig) -> None:
    model = MTPModel(tiny_config)
    path = tmp_path / "last.ckpt"
    torch.save({"hyper_parameters": {"model": tiny_config.to_dict(), "seq_len": 32},
                "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "tokenizer_files": tokenizer_files(ByteTokenizer())}, path)
    loaded, tokenizer = load(path)
    tokens = torch.randint(0, 256, (1, 8))
    torch.testing.assert_close(loaded(tokens), model.eval()(tokens), rtol=0, atol=0)
    assert tokenizer.vocab_size == 262


def test_vocab_mismatch_is_refused(tmp_path: Path, tiny_config: MTPConfig) -> None:
    model = MTPModel(MTPConfig.from_dict({**tiny_config.to_dict(), "vocab_size": 300}))
    with pytest.raises(ValueError, match="vocab_size=300 does not match .*vocab_size=262"):
        export(model, ByteTokenizer(), tmp_path)


def test_missing_and_corrupt_checkpoints_are_named(tmp_path: Path,
                                                   tiny_config: MTPConfig) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at .*nowhere"):
        load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="none of the layouts mtp loads"):
        load(tmp_path)
    export(MTPModel(tiny_config), ByteTokenizer(), tmp_path / "export")
    (tmp_path / "export" / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="corrupt weights file"):
        load(tmp_path / "export")
    (tmp_path / "junk.ckpt").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="cannot read .*junk.ckpt"):
        load(tmp_path / "junk.ckpt")


def test_weights_that_do_not_fit_the_config_are_named(tmp_path: Path,
                                                      tiny_config: MTPConfig) -> None:
    export(MTPModel(tiny_config), ByteTokenizer(), tmp_path)
    bigger = {**tiny_config.to_dict(), "dim": 64}
    (tmp_path / "config.json").write_text(
        (tmp_path / "config.json").read_text().replace('"dim": 32', '"dim": 64'))
    assert MTPConfig.from_dict(bigger).dim == 64
    with pytest.raises(ValueError, match="do not fit the model config"):
        load(tmp_path)


def test_tied_embeddings_load_as_one_parameter(tmp_path: Path, tiny_config: MTPConfig) -> None:
    config = MTPConfig.from_dict({**tiny_config.to_dict(), "tie_embeddings": True})
    export(MTPModel(config), ByteTokenizer(), tmp_path / "a")
    model, tokenizer = load(tmp_path / "a")
    assert model.output.weight is model.tok_embeddings.weight
    optimiser = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randint(0, 262, (1, 8))).sum().backward()
    optimiser.step()
    export(model, tokenizer, tmp_path / "b")  # stores tok_embeddings.weight only
    reloaded, _ = load(tmp_path / "b")
    tokens = torch.randint(0, 262, (1, 8))
    torch.testing.assert_close(reloaded(tokens), model(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("edit, message", [
    (lambda meta: [meta], r"must hold a JSON object, got list"),
    (lambda meta: {**meta, "model": None}, r"field 'model'.*mapping of fields, got None"),
    (lambda meta: {**meta, "model": {k: v for k, v in meta["model"].items()
                                     if k != "vocab_size"}}, r"field 'model'.*\['vocab_size'\]"),
    (lambda meta: {**meta, "model": {**meta["model"], "rope_theta": "10000"}},
     r"rope_theta='10000' must be a number > 0"),
    (lambda meta: {**meta, "model": {**meta["model"], "norm_eps": None}},
     r"norm_eps=None must be a number > 0"),
    (lambda meta: {**meta, "model": {**meta["model"], "tie_embeddings": "false"}},
     r"tie_embeddings='false' must be true or false"),
])
def test_malformed_config_json_is_a_value_error_naming_file_field_value(
        tmp_path: Path, tiny_config: MTPConfig, edit, message: str) -> None:
    export(MTPModel(tiny_config), ByteTokenizer(), tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ValueError, match=f"config.json.*{message}"):
        load(tmp_path)
