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
        assert set(row) == {"tokens_per_second", "speedup", "tokens_per_forward", "identical",
                            "repeated"}
        assert row["identical"] is (None if "T=" in name else True)
    assert any(name.startswith("auto (") for name in methods)
    assert any(name.endswith("+prompt_lookup") for name in methods)
    assert methods["autoregressive"]["speedup"] == 1.0
    assert (tmp_path / "plot.png").stat().st_size > 0
