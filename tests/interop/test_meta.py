"""Meta's multi-token-prediction layout: logits equal transformers' Llama for every head."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtp import load
from mtp.generate import HeadsDrafter, generate
from mtp.interop.meta import ffn_hidden

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

DIM, N_HEADS, N_KV_HEADS, N_LAYERS, N_FUTURE = 32, 4, 2, 5, 3
HIDDEN = 112  # Meta's rule for dim 32, multiple_of 16, ffn_dim_multiplier 1.3 (by hand)
TRUNK = N_LAYERS - N_FUTURE  # `layers` has TRUNK + 1 entries: the trunk, then head 0
CORPUS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n",
          "hello world, a tiny corpus for a tiny tokenizer"] * 20


def _block(prefix: str) -> dict[str, torch.Tensor]:
    hd = DIM // N_HEADS
    shapes = {"attention.wq.weight": (N_HEADS * hd, DIM), "attention.wk.weight":
              (N_KV_HEADS * hd, DIM), "attention.wv.weight": (N_KV_HEADS * hd, DIM),
              "attention.wo.weight": (DIM, N_HEADS * hd), "feed_forward.w1.weight":
              (HIDDEN, DIM), "feed_forward.w3.weight": (HIDDEN, DIM), "feed_forward.w2.weight":
              (DIM, HIDDEN), "attention_norm.weight": (DIM,), "ffn_norm.weight": (DIM,)}
    return {f"{prefix}.{name}": (1 + 0.1 * torch.randn(shape) if len(shape) == 1
                                 else 0.2 * torch.randn(shape)) for name, shape in shapes.items()}


@pytest.fixture
def meta_dir(tmp_path: Path) -> Path:
    """A random checkpoint in Meta's layout, with a tiny Llama-style tokenizer.model."""
    spm.SentencePieceTrainer.train(  # Llama's normalisation settings: text kept as it is
        sentence_iterator=iter(CORPUS), model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=300, model_type="bpe", byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    vocab = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model")).vocab_size()
    (tmp_path / "params.json").write_text(json.dumps({
        "dim": DIM, "n_layers": N_LAYERS, "n_heads": N_HEADS, "n_kv_heads": N_KV_HEADS,
        "n_future_tokens": N_FUTURE, "vocab_size": vocab, "multiple_of": 16,
        "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": 10000.0}))
    state = {"tok_embeddings.weight": torch.randn(vocab, DIM),
             "norm.weight": 1 + 0.1 * torch.randn(DIM), "output.weight": torch.randn(vocab, DIM)}
    for i in range(TRUNK + 1):
        state.update(_block(f"layers.{i}"))
    for j in range(N_FUTURE - 1):
        state.update(_block(f"extra_heads.{j}"))
    torch.save(state, tmp_path / "consolidated.pth")
    return tmp_path


def _permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """transformers' convert_llama_weights_to_hf.py permute: interleaved -> rotate-half."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def _llama_with_head(meta: dict[str, torch.Tensor], head: int, vocab: int):
    """transformers' Llama with the trunk, then head `head`'s block as its last layer."""
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=TRUNK + 1,
        num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    state = {"model.embed_tokens.weight": meta["tok_embeddings.weight"],
             "model.norm.weight": meta["norm.weight"], "lm_head.weight": meta["output.weight"]}
    sources = [f"layers.{i}" for i in range(TRUNK)]
    sources.append(f"layers.{TRUNK}" if head == 0 else f"extra_heads.{head - 1}")
    for i, src in enumerate(sources):
        layer = f"model.layers.{i}"
        state |= {
            f"{layer}.self_attn.q_proj.weight": _permute(meta[f"{src}.attention.wq.weight"],
                                                         N_HEADS),
            f"{layer}.self_attn.k_proj.weight": _permute(meta[f"{src}.attention.wk.weight"],
                                                         N_KV_HEADS),
            f"{layer}.self_attn.v_proj.weight": meta[f"{src}.attention.wv.weight"],
            f"{layer}.self_attn.o_proj.weight": meta[f"{src}.attention.wo.weight"],
            f"{layer}.mlp.gate_proj.weight": meta[f"{src}.feed_forward.w1.weight"],
            f"{layer}.mlp.up_proj.weight": meta[f"{src}.feed_forward.w3.weight"],
            f"{layer}.mlp.down_proj.weight": meta[f"{src}.feed_forward.w2.weight"],
            f"{layer}.input_layernorm.weight": meta[f"{src}.attention_norm.weight"],
            f"{layer}.post_attention_layernorm.weight": meta[f"{src}.ffn_norm.weight"]}
    model.load_state_dict(state, strict=True)
    return model


def test_meta_layout_matches_transformers_llama_for_every_head(meta_dir: Path) -> None:
    model, tokenizer = load(meta_dir)
    config = model.config
    assert (config.n_layers, config.n_future, config.ffn_hidden) == (TRUNK, N_FUTURE, HIDDEN)
    meta = torch.load(meta_dir / "consolidated.pth")
    tokens = torch.randint(0, config.vocab_size, (2, 20))
    with torch.no_grad():
        ours = model(tokens)  # (B, T, n, V)
        for head in range(N_FUTURE):
            theirs = _llama_with_head(meta, head, config.vocab_size)(tokens).logits
            assert (ours[:, :, head] - theirs).abs().max() <= 1e-4, head


def test_sentencepiece_tokenizer_gives_sentencepiece_ids(meta_dir: Path) -> None:
    _, tokenizer = load(meta_dir)
    processor = spm.SentencePieceProcessor(model_file=str(meta_dir / "tokenizer.model"))
    # (Text that starts with spaces differs: transformers' conversion adds no dummy prefix.)
    for text in ["def add(a, b):\n    return a + b", "héllo ✓  wörld\n"]:
        assert tokenizer.encode(text) == processor.encode(text)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (processor.bos_id(), processor.eos_id())
    assert tokenizer.document_start_id == processor.bos_id()  # Llama saw BOS, not EOS


def test_imported_heads_decode_self_speculatively_as_autoregressive(meta_dir: Path) -> None:
    model, tokenizer = load(meta_dir)
    prompts = ["def add(a, b):", "for i in"]
    [ar, *_] = [generate(model, tokenizer, prompts, max_new_tokens=24)]
    spec = generate(model, tokenizer, prompts, max_new_tokens=24, drafter=HeadsDrafter(N_FUTURE))
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert sum(r.stats.forward_passes for r in spec) > 0


def test_ffn_hidden_follows_meta_llama() -> None:
    assert ffn_hidden(4096, 256, None) == 11008  # Llama 2 7B
    assert ffn_hidden(8192, 4096, 1.3) == 28672  # Llama 2 70B
    assert ffn_hidden(DIM, 16, 1.3) == HIDDEN


def test_strict_meta_loading_names_keys(meta_dir: Path) -> None:
    state = torch.load(meta_dir / "consolidated.pth")
    state["extra_heads.7.attention.wq.weight"] = state.pop("extra_heads.1.attention.wq.weight")
    torch.save(state, meta_dir / "consolidated.pth")
    with pytest.raises(ValueError, match=r"unexpected keys \['extra_heads.7.attention.wq.weight'"
                                         r"\], missing keys \['extra_heads.1.attention.wq"):
        load(meta_dir)
    (meta_dir / "params.json").write_text(json.dumps({"dim": DIM, "n_layers": "5"}))
    with pytest.raises(ValueError, match=r"params.json: field 'n_layers' must be a int, got '5'"):
        load(meta_dir)


@pytest.mark.slow
def test_convert_cli_writes_a_hf_llama_with_every_head(meta_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "hf"
    subprocess.run([sys.executable, "-m", "mtp.convert", "to_hf", f"checkpoint={meta_dir}",
                    f"output={out}"], check=True, capture_output=True)
    original, _ = load(meta_dir)
    converted, tokenizer = load(out)
    tokens = torch.randint(0, original.config.vocab_size, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(converted(tokens), original(tokens), rtol=0, atol=1e-5)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    # transformers starts a prompt with BOS too, as Meta's Llama code does.
    assert theirs("def add(a, b):")["input_ids"] == tokenizer.encode_prompt("def add(a, b):") \
        == [tokenizer.bos_id, *tokenizer.encode("def add(a, b):")]
