"""scripts/bench_methods.py runs end to end on tiny exports: a table, a plot, then one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtp.checkpoint import export
from mtp.model import MTPModel
from mtp.tokenizers import ByteTokenizer

METHODS = Path(__file__).resolve().parents[2] / "scripts" / "bench_methods.py"


@pytest.mark.slow  # ~15 s: two subprocess-free loads, every method, auto calibration
def test_bench_methods_table_plot_and_json(tiny_config, tmp_path):
    from mtp.model import MTPConfig

    directory = export(MTPModel(tiny_config), ByteTokenizer(), tmp_path / "export")
    draft = MTPModel(MTPConfig(vocab_size=262, dim=16, n_layers=1, n_heads=2, max_seq_len=64))
    draft_dir = export(draft, ByteTokenizer(), tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("def f(x):") + "\n" + json.dumps("ab ab ab ab ab") + "\n")
    result = subprocess.run(
        [sys.executable, str(METHODS), "--checkpoint", str(directory), "--draft-model",
         str(draft_dir), "--prompts", str(prompts), "--humaneval", "0", "--max-new-tokens", "6",
         "--ks", "2", "4", "--threads", "1", "--device", "cpu", "--plot",
         str(tmp_path / "plot.png")], capture_output=True, text=True, check=True)
    *table, last = result.stdout.strip().splitlines()
    methods = json.loads(last)["methods"]
    for name in ("autoregressive", "heads(k=2)", "heads(k=4)", "prompt_lookup", "draft_model",
                 "autoregressive T=0.8"):
        row = methods[name]
        assert set(row) == {"tokens_per_second", "speedup", "tokens_per_forward",
                            "forward_cost", "identical", "repeated"}
        assert row["identical"] is (None if "T=" in name else True)
    assert any(name.startswith("auto (") for name in methods)
    assert any(name.endswith("+prompt_lookup") for name in methods)
    assert methods["autoregressive"]["speedup"] == 1.0
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_bench_methods_subset_with_layer_skipping_and_adaptive_drafts(tmp_path):
    from mtp.decode.drafters.layer_skip import SkipChoice
    from mtp.model import MTPConfig

    config = MTPConfig(vocab_size=262, dim=32, n_layers=3, n_heads=4, max_seq_len=64)
    directory = export(MTPModel(config), ByteTokenizer(), tmp_path / "export")
    choice = SkipChoice((1,), 3, 3, 262).save(tmp_path / "layer_skip.json")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("def f(x):") + "\n" + json.dumps("ab ab ab ab ab") + "\n")
    result = subprocess.run(
        [sys.executable, str(METHODS), "--checkpoint", str(directory), "--prompts", str(prompts),
         "--humaneval", "0", "--max-new-tokens", "6", "--threads", "1", "--device", "cpu",
         "--methods", "prompt_lookup", "layer_skip", "--layer-skip", str(choice), "--adaptive",
         "--temperatures", "0"], capture_output=True, text=True, check=True)
    methods = json.loads(result.stdout.strip().splitlines()[-1])["methods"]
    assert list(methods) == ["autoregressive", "prompt_lookup", "prompt_lookup adaptive",
                             "layer_skip", "layer_skip adaptive"]
    assert all(row["identical"] for row in methods.values())


def test_bench_methods_in_both_dtypes_beside_transformers(tmp_path):
    """--dtypes float32 bfloat16 --hf: every method again in bfloat16, and transformers' rows in
    float32 (no tokens per forward, so no forward cost); speed-ups against float32
    autoregressive."""
    from mtp.model import MTPConfig

    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
    directory = export(MTPModel(config), ByteTokenizer(), tmp_path / "export")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("def f(x):") + "\n" + json.dumps("ab ab ab ab ab") + "\n")
    result = subprocess.run(
        [sys.executable, str(METHODS), "--checkpoint", str(directory), "--prompts", str(prompts),
         "--humaneval", "0", "--max-new-tokens", "6", "--threads", "1", "--device", "cpu",
         "--methods", "prompt_lookup", "--temperatures", "0", "--dtypes", "float32",
         "bfloat16", "--hf"], capture_output=True, text=True, check=True)
    methods = json.loads(result.stdout.strip().splitlines()[-1])["methods"]
    assert list(methods) == ["autoregressive", "prompt_lookup", "transformers",
                             "transformers prompt_lookup", "autoregressive bf16",
                             "prompt_lookup bf16"]
    assert methods["autoregressive"]["speedup"] == 1.0
    assert methods["autoregressive bf16"]["forward_cost"] == 1.0
    for name in ("prompt_lookup", "transformers", "transformers prompt_lookup"):
        assert methods[name]["identical"] is True, name  # float32: the same ids as mtp's
    for name, row in methods.items():
        assert (row["forward_cost"] is None) == name.startswith("transformers"), name
