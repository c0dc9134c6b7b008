"""scripts/bench_decode.py runs end to end on a tiny export: a table, then one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtp.checkpoint import export
from mtp.model import MTPModel
from mtp.tokenizers import ByteTokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"


def test_bench_prints_a_table_and_a_json_line(tiny_config, tmp_path):
    directory = export(MTPModel(tiny_config), ByteTokenizer(), tmp_path / "export")
    prompts = tmp_path / "prompts.jsonl"  # short enough for the tiny context of 64
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n" + json.dumps("import os") + "\n")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--checkpoint", str(directory), "--prompts", str(prompts),
         "--max-new-tokens", "6",
         "--ks", "2", "4", "--trees", "tree8", "--plot", str(tmp_path / "trees.png"),
         "--repeats", "1", "--threads", "1", "--device", "cpu"],
        capture_output=True, text=True, check=True)
    *table, last = result.stdout.strip().splitlines()
    summary = json.loads(last)
    for key in ("tokens_per_second_ar", "tokens_per_second_spec", "speedup", "k",
                "tokens_per_forward", "identical"):
        assert key in summary
    assert summary["identical"] is True and summary["k"] in (2, 4)
    assert summary["tree_nodes"] == 8 and summary["tree_identical"] is True
    for key in ("chain_tokens_per_forward", "tree_tokens_per_forward", "tree_speedup",
                "repeated"):
        assert key in summary
    assert (tmp_path / "trees.png").stat().st_size > 0
    assert [row["k"] for row in summary["per_k"]] == [1, 2, 4]
    assert any(line.split()[:1] == ["k=4"] for line in table)
    assert any(line.split()[:2] == ["tree8", "8"] for line in table)


METHODS = SCRIPT.parent / "bench_methods.py"


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
        assert set(row) == {"tokens_per_second", "speedup", "tokens_per_forward", "identical",
                            "repeated"}
        assert row["identical"] is (None if "T=" in name else True)
    assert any(name.startswith("auto (") for name in methods)
    assert any(name.endswith("+prompt_lookup") for name in methods)
    assert methods["autoregressive"]["speedup"] == 1.0
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_repeated_share():
    from mtp.generate.output import repeated_share, repetition

    assert repeated_share([1, 2, 3, 4, 5, 6], 2) == 0.0
    assert repeated_share([7, 7, 7, 7], 2) == 0.75  # (7, 7) again at 1 and 2: 1..3
    assert repeated_share([1, 2, 3, 9, 1, 2, 3], 3) == 3 / 7
    # pooled by length: 3 of 7 tokens, then 0 of 3; an output shorter than n repeats nothing
    assert repetition([[1, 2, 3, 9, 1, 2, 3], [4, 5, 6], [8]], 3) == 3 / 11
