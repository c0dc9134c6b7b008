"""scripts/eval_hf.py: transformers' greedy HumanEval run gives mtp.eval's completions."""

from pathlib import Path

import pytest
import torch
from script_modules import load_script  # tests/ is on the path

from mtp.eval import EvalConfig, evaluate
from mtp.paths import mbpp_file
from mtp.tokenizers import BPETokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' GGUF loader needs it
from gguf_files import T, byte_level_vocab, write_gguf  # noqa: E402 (tests/ is on the path)

eval_hf = load_script("eval_hf")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GGUF without BOS (as SmolLM2), weights large enough for varied output."""
    tokenizer = BPETokenizer.train(["def add(a, b):\n    return a + b\n# ok\nif x:\n"] * 20,
                                   vocab_size=300)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, rope_theta=1000.0, tie_word_embeddings=True,
        initializer_range=0.5)
    torch.manual_seed(1)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf",
                      transformers.LlamaForCausalLM(config).eval(),
                      byte_level_vocab(tokenizer), T.F16)


def test_cut_at_stop_keeps_the_text_before_the_first_stop() -> None:
    stop = ("\ndef", "\n#")
    assert eval_hf.cut_at_stop("    return 1\n# x\ndef f", stop) == "    return 1"
    assert eval_hf.cut_at_stop("    return 1\n", stop) == "    return 1\n"


def test_a_stop_string_counts_only_in_the_completion(gguf: Path) -> None:
    """A prompt ending in a newline and a completion starting with `def` do not stop
    (transformers' own stop_strings would), as mtp.eval's stop rule reads only new text."""
    _, tokenizer = eval_hf.load_hf(gguf, torch.float32, "cpu")
    prompt = tokenizer("x = 1\n").input_ids
    for completion, stops in [("def", False), ("y\ndef", True), ("y\n", False)]:
        ids = torch.tensor([prompt + tokenizer(completion).input_ids])
        stop = eval_hf.StopInCompletion(tokenizer, len(prompt), ("\ndef",))
        assert stop(ids, None).tolist() == [stops], completion


def test_transformers_completions_equal_mtp_eval(tmp_path: Path, gguf: Path) -> None:
    """3 HumanEval problems through mtp.eval (batched) and through transformers' generate
    (batch 1): the same completions, token counts and pass@1."""
    ours = tmp_path / "mtp.jsonl"
    summary = evaluate(EvalConfig(task="humaneval", checkpoint=str(gguf), output=str(ours),
                                  limit=3, max_new_tokens=24, drafter="autoregressive",
                                  batch_size=3, isolation="none"))
    stats = eval_hf.main([f"checkpoint={gguf}", f"out={tmp_path / 'hf.jsonl'}", "limit=3",
                          "max_new_tokens=24", f"compare={ours}", "isolation=none", "threads=1"])
    assert (stats["compared"], stats["identical"], stats["different_lengths"]) == (3, 3, [])
    assert stats["pass@1"] == stats["mtp_pass@1"] == summary["pass@1"]
    completions = [r["completion"] for r in eval_hf.read_jsonl(ours)]
    assert len(set(completions)) == 3  # not one degenerate string


@pytest.mark.skipif(mbpp_file() is None, reason="needs MBPP's mbpp.jsonl ($MTP_MBPP_FILE)")
def test_mbpp_few_shot_completions_equal_mtp_eval(tmp_path: Path, gguf: Path) -> None:
    """The same on MBPP's 3-shot prompt, whose stop string is `[DONE]`."""
    task = {"task": "mbpp", "data_file": str(mbpp_file()), "few_shot": 3}
    ours = tmp_path / "mtp.jsonl"
    summary = evaluate(EvalConfig(**task, checkpoint=str(gguf), output=str(ours), limit=2,
                                  max_new_tokens=16, drafter="autoregressive", batch_size=2,
                                  isolation="none"))
    stats = eval_hf.main([f"checkpoint={gguf}", f"out={tmp_path / 'hf.jsonl'}", "task=mbpp",
                          f"data_file={mbpp_file()}", "few_shot=3", "limit=2",
                          "max_new_tokens=16", f"compare={ours}", "isolation=none", "threads=1"])
    assert (stats["task"], stats["compared"], stats["identical"]) == ("mbpp", 2, 2)
    assert stats["different_lengths"] == []
    assert stats["pass@1"] == stats["mtp_pass@1"] == summary["pass@1"]
