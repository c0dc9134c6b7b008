"""Hugging Face Llama import/export: logits equal transformers' both ways, strict loading."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mtp import export_hf, load
from mtp.generate import generate
from mtp.interop.hf import HEADS_FILE, HEADS_LAYOUT_FILE
from mtp.interop.hf_tokenizer import read_hf_tokenizer
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import BPETokenizer, ByteTokenizer

from llama_variants import VARIANTS, random_llama  # tests/ is on the path

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
TEXT = "héllo wörld\n\tdef f(x): return x <|eos|> ✓"


def _mtp_config(gqa: bool, tie: bool, n_future: int = 3, vocab_size: int = 262) -> MTPConfig:
    return MTPConfig(vocab_size=vocab_size, dim=32, n_layers=2, n_heads=4,
                     n_kv_heads=2 if gqa else 4, max_seq_len=64, n_future=n_future,
                     tie_embeddings=tie, rope_theta=500.0, norm_eps=1e-6)


def _hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(tokens).logits


@pytest.mark.parametrize("gqa, tie", [(False, False), (True, False), (False, True),
                                      (True, True)])
def test_export_gives_head0_logits_in_transformers_and_every_head_back(
        tmp_path: Path, gqa: bool, tie: bool) -> None:
    model = MTPModel(_mtp_config(gqa, tie)).eval()
    export_hf(model, ByteTokenizer(), tmp_path)
    tokens = torch.randint(0, 262, (2, 24))
    with torch.no_grad():
        ours = model(tokens)  # (B, T, n, V)
        assert (_hf_logits(tmp_path, tokens) - ours[:, :, 0]).abs().max() <= ATOL
        loaded, tokenizer = load(tmp_path)
        torch.testing.assert_close(loaded(tokens), ours, rtol=0, atol=ATOL)
    assert loaded.config == model.config and isinstance(tokenizer, ByteTokenizer)
    layout = json.loads((tmp_path / HEADS_LAYOUT_FILE).read_text())
    assert layout["layout"] == "block" and layout["n_future"] == 3
    # engines load the files the index names: the model's, never the heads file
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert not any(key.startswith("heads.") for key in index["weight_map"])


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), BPETokenizer.train(
    ["def f(x):\n    return x + 1\n", "héllo wörld ✓"] * 20, vocab_size=300)],
    ids=["byte", "bpe"])
def test_auto_tokenizer_gives_mtp_ids(tmp_path: Path, tokenizer) -> None:
    config = MTPConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=1, n_heads=4)
    export_hf(MTPModel(config), tokenizer, tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert theirs(TEXT, add_special_tokens=False)["input_ids"] == tokenizer.encode(TEXT)
    # A prompt starts with EOS, as mtp's training documents do, in transformers too.
    assert theirs(TEXT)["input_ids"] == tokenizer.encode_prompt(TEXT) == [
        tokenizer.eos_id, *tokenizer.encode(TEXT)]
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id) == (
        tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    assert theirs.decode(tokenizer.encode(TEXT)) == tokenizer.decode(tokenizer.encode(TEXT))


def _random_llama(directory: Path, *, gqa: bool, tie: bool, dtype=torch.float32,
                  shard: bool = False):
    """A random transformers LlamaForCausalLM saved with a BPE tokenizer.json."""
    tokenizer = BPETokenizer.train(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2 if gqa else 4,
        max_position_embeddings=64, rope_theta=1000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=tie)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(directory, max_shard_size="20KB" if shard else "5GB")
    tokenizer.save(directory)
    return model, tokenizer


@pytest.mark.parametrize("gqa, tie, shard", [(False, False, False), (True, False, True),
                                             (True, True, False)])
def test_transformers_llama_loads_with_equal_logits(tmp_path: Path, gqa: bool, tie: bool,
                                                    shard: bool) -> None:
    reference, _ = _random_llama(tmp_path, gqa=gqa, tie=tie, shard=shard)
    assert shard == (tmp_path / "model.safetensors.index.json").is_file()
    model, tokenizer = load(tmp_path)
    assert model.config.n_future == 1 and model.config.n_layers == 2
    assert tokenizer.vocab_size == model.config.vocab_size
    tokens = torch.randint(0, model.config.vocab_size, (2, 20))
    with torch.no_grad():
        assert (model(tokens)[:, :, 0] - reference(tokens).logits).abs().max() <= ATOL
    if tie:
        assert model.output.weight is model.tok_embeddings.weight


def test_dtype_is_kept_unless_asked(tmp_path: Path) -> None:
    _random_llama(tmp_path, gqa=True, tie=False, dtype=torch.bfloat16)
    model, _ = load(tmp_path)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = load(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_imported_model_trains(tmp_path: Path) -> None:
    _random_llama(tmp_path, gqa=True, tie=True)
    model, _ = load(tmp_path)
    model.train()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16))
    model(tokens).logsumexp(-1).mean().backward()
    optimiser.step()
    assert model.output.weight is model.tok_embeddings.weight  # still one Parameter


def test_strict_loading_names_keys_and_shapes(tmp_path: Path) -> None:
    model = MTPModel(_mtp_config(gqa=True, tie=False)).eval()
    export_hf(model, ByteTokenizer(), tmp_path)
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "model.safetensors"
    state = load_file(weights)
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(32)}, weights)
    with pytest.raises(ValueError, match=r"unexpected keys \['model.layers.0.self_attn.q_proj"):
        load(tmp_path)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, weights)
    with pytest.raises(ValueError, match=r"missing keys \['model.layers.1.mlp.up_proj.weight'"):
        load(tmp_path)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(model.config.ffn_hidden, 32)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 32)  # GQA: 16 rows
    save_file(state, weights)
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight has shape"):
        load(tmp_path)
    (tmp_path / HEADS_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=HEADS_FILE):
        load(tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("rope_parameters", {"rope_type": "yarn", "factor": 8.0}, "rope_type 'yarn'"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "'rope_scaling' has rope_type 'dynamic'"),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0}, "'low_freq_factor' is missing"),
    ("partial_rotary_factor", 0.5, "'partial_rotary_factor' is 0.5"),
    ("hidden_act", "gelu", "'hidden_act' must be 'silu'"),
    ("num_attention_heads", "4", "'num_attention_heads' must be a int, got '4'"),
    ("tie_word_embeddings", "false", "'tie_word_embeddings' must be a bool"),
    ("attention_bias", 1, "'attention_bias' must be a bool"),
    ("model_type", "mistral", "only Llama-architecture models load"),
])
def test_unsupported_or_malformed_llama_config_is_named(tmp_path: Path, field: str, value,
                                                        message: str) -> None:
    export_hf(MTPModel(_mtp_config(gqa=False, tie=False, n_future=1)), ByteTokenizer(),
              tmp_path)
    path = tmp_path / "config.json"
    values = json.loads(path.read_text())
    if field == "rope_scaling":  # the older form, read when rope_parameters is absent
        del values["rope_parameters"]
    path.write_text(json.dumps({**values, field: value}))
    with pytest.raises(ValueError, match=f"config.json.*{message}"):
        load(tmp_path)


def test_imported_llama_decodes(tmp_path: Path) -> None:
    _random_llama(tmp_path, gqa=True, tie=False)
    model, tokenizer = load(tmp_path)
    [result] = generate(model, tokenizer, ["def f(x):"], max_new_tokens=8)
    assert len(result.token_ids) == 8 or result.finish_reason == "eos"


def test_a_tokenizer_that_adds_bos_starts_prompts_with_bos(tmp_path: Path) -> None:
    """A foreign tokenizer.json whose pipeline adds BOS (Llama's) marks documents with BOS."""
    from tokenizers import processors

    _, tokenizer = _random_llama(tmp_path, gqa=False, tie=False)
    assert tokenizer.document_start_id == tokenizer.eos_id  # mtp-trained: documents follow EOS
    raw = tokenizer._tok
    raw.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_id)])
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "mtp_tokenizer.json").unlink()  # as a Hugging Face repo has it
    _, loaded = load(tmp_path)
    assert loaded.document_start_id == loaded.bos_id != loaded.eos_id


def random_variant(directory: Path, variant: str):
    """A random transformers model of `variant` saved with an mtp-trained BPE tokenizer."""
    tokenizer = BPETokenizer.train(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300)
    tokenizer.save(directory)
    model = random_llama(variant, tokenizer.vocab_size)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llama_variants_load_and_export_with_transformers_logits(tmp_path: Path,
                                                                 variant: str) -> None:
    reference = random_variant(tmp_path / "theirs", variant)
    model, tokenizer = load(tmp_path / "theirs")
    expected = MTPConfig(vocab_size=tokenizer.vocab_size, dim=32, n_layers=1, n_heads=4,
                         n_kv_heads=2, ffn_hidden=64, max_seq_len=64, norm_eps=1e-5,
                         rope_theta=model.config.rope_theta, **VARIANTS[variant][2])
    assert model.config == expected
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 40))
    with torch.no_grad():
        theirs = reference(tokens).logits
        assert (model(tokens)[:, :, 0] - theirs).abs().max() <= ATOL
        export_hf(model, tokenizer, tmp_path / "ours")  # and back to transformers
        assert (_hf_logits(tmp_path / "ours", tokens) - theirs).abs().max() <= ATOL
    exported = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert exported["model_type"] == VARIANTS[variant][0]
    # The decode path (cached, stacked head 0) continues as transformers' greedy generate.
    prompt = "def f(x):"
    [ours] = generate(model, tokenizer, [prompt], max_new_tokens=8)
    ids = torch.tensor([tokenizer.encode_prompt(prompt)])
    greedy = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.token_ids == greedy[0, ids.shape[1]:].tolist()


def test_rope_scaling_changes_the_logits(tmp_path: Path) -> None:
    """The scaled-rope variants above would pass unscaled if the positions never mattered."""
    random_variant(tmp_path, "rope_llama3")
    model, _ = load(tmp_path)
    plain = MTPModel(dataclasses.replace(model.config, rope_scaling=None))
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, model.config.vocab_size, (1, 40))
    with torch.no_grad():
        assert (plain(tokens) - model(tokens)).abs().max() > 1e-2


def test_bias_layouts_transformers_lacks_are_refused(tmp_path: Path) -> None:
    config = MTPConfig(vocab_size=262, dim=32, n_layers=1, n_heads=4, qkv_bias=True,
                       mlp_bias=True)
    with pytest.raises(ValueError, match="qkv_bias=True, out_bias=False, mlp_bias=True"):
        export_hf(MTPModel(config), ByteTokenizer(), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_qwen2_sliding_window_is_refused(tmp_path: Path) -> None:
    random_variant(tmp_path, "qwen2")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "use_sliding_window": True}))
    with pytest.raises(ValueError, match="'use_sliding_window' is true"):
        load(tmp_path)


@pytest.mark.parametrize("template, tokenizer_config", [
    (False, {"tokenizer_class": "GPT2Tokenizer"}),  # SmolLM2's: no template, no BOS
    (True, {"tokenizer_class": "PreTrainedTokenizerFast"}),  # Llama 3's: BOS in the template
    (True, {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True}),
    # transformers >= 5 follows tokenizer.json's template over add_bos_token beside it.
    (False, {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True}),
], ids=["smollm2", "llama3", "llama", "template-wins"])
def test_prompts_start_as_transformers_starts_them(tmp_path: Path, template: bool,
                                                   tokenizer_config: dict) -> None:
    from tokenizers import processors

    raw = BPETokenizer.train(["def f(x):\n    return x + 1\n"] * 20, vocab_size=300).backend
    if template:
        raw.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", special_tokens=[("<|bos|>", raw.token_to_id("<|bos|>"))])
    raw.save(str(tmp_path / "tokenizer.json"))  # a Hugging Face repo's files: no mtp header
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", **tokenizer_config}))
    ours = read_hf_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    # (Text spelling a special token differs by design: mtp encodes it as text.)
    for text in ("héllo wörld\n\tdef f(x): return x ✓", "def f(x):"):
        assert ours.encode_prompt(text) == theirs(text)["input_ids"]
    assert ours.document_start_id == (ours.bos_id if template else None)


@pytest.mark.parametrize("tokenizer_config", [
    None, {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True},
    {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False},
    {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": True}],
    ids=["no-config", "bos", "no-bos", "bos-eos"])
def test_sentencepiece_prompts_start_as_transformers_starts_them(
        tmp_path: Path, tokenizer_config: dict | None) -> None:
    """A tokenizer.model alone: tokenizer_config.json's add_bos_token/add_eos_token decide."""
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["def add(a, b):\n    return a + b\n"] * 20),
        model_prefix=str(tmp_path / "tokenizer"), vocab_size=300, model_type="bpe",
        byte_fallback=True, minloglevel=2)
    (tmp_path / "tokenizer.vocab").unlink()
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    ours = read_hf_tokenizer(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ours.encode_prompt("def add") == theirs("def add")["input_ids"]
