"""scripts/bench_methods.py runs end to end on tiny exports: a table, a plot, then one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import prompt_file  # tests/ is on the path

from mtp.checkpoint import export
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer

METHODS = Path(__file__).resolve().parents[2] / "scripts" / "bench_methods.py"


def run_methods(tmp_path: Path, directory: Path, *args: str) -> dict:
    """bench_methods.py on `directory`'s export and the test prompts, a few tokens each, on one
    CPU thread: the rows of its last (JSON) line."""
    result = subprocess.run(
        [sys.executable, str(METHODS), f"checkpoint={directory}",
         f"prompts={prompt_file(tmp_path)}", "humaneval=0", "max_new_tokens=6", "threads=1",
         "device=cpu", *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["methods"]


@pytest.mark.slow  # ~15 s: two subprocess-free loads, every method, auto calibration
def test_bench_methods_table_plot_and_json(tiny_config, tmp_path):
    directory = export(MTPModel(tiny_config), ByteTokenizer(), tmp_path / "export")
    draft = MTPModel(MTPConfig(vocab_size=262, dim=16, n_layers=1, n_heads=2, max_seq_len=64))
    draft_dir = export(draft, ByteTokenizer(), tmp_path / "draft")
    methods = run_methods(tmp_path, directory, f"draft_model={draft_dir}",
                          f"plot={tmp_path / 'plot.png'}")
    # every drafter's candidates, as drafter=auto measures them: the heads at every k
    for name in ("autoregressive", "heads(k=2)", "heads(k=3)", "heads(k=4)", "prompt_lookup",
                 "draft_model", "lookahead", "autoregressive T=0.8"):
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
    config = MTPConfig(vocab_size=262, dim=32, n_layers=3, n_heads=4, max_seq_len=64)
    directory = export(MTPModel(config), ByteTokenizer(), tmp_path / "export")
    choice = SkipChoice((1,), 3, 3, 262).save(tmp_path / "layer_skip.json")
    methods = run_methods(tmp_path, directory, 'methods=[prompt_lookup,"prompt_lookup '
                          'adaptive=true",layer_skip,"layer_skip adaptive=true"]',
                          f"skip={choice}", "temperatures=[0]")
    assert list(methods) == ["autoregressive", "prompt_lookup", "prompt_lookup adaptive",
                             "layer_skip", "layer_skip adaptive"]
    assert all(row["identical"] for row in methods.values())


def test_bench_methods_in_both_dtypes_beside_transformers(tmp_path):
    """dtypes=[float32,bfloat16] hf=true: every method again in bfloat16, and transformers' rows in
    float32 (no tokens per forward, so no forward cost); speed-ups against float32
    autoregressive."""
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, max_seq_len=64)
    directory = export(MTPModel(config), ByteTokenizer(), tmp_path / "export")
    methods = run_methods(tmp_path, directory, "methods=[prompt_lookup]", "temperatures=[0]",
                          "dtypes=[float32,bfloat16]", "hf=true")
    assert list(methods) == ["autoregressive", "prompt_lookup", "transformers",
                             "transformers prompt_lookup", "autoregressive bf16",
                             "prompt_lookup bf16"]
    assert methods["autoregressive"]["speedup"] == 1.0
    assert methods["autoregressive bf16"]["forward_cost"] == 1.0
    for name in ("prompt_lookup", "transformers", "transformers prompt_lookup"):
        assert methods[name]["identical"] is True, name  # float32: the same ids as mtp's
    for name, row in methods.items():
        assert (row["forward_cost"] is None) == name.startswith("transformers"), name


def test_methods_are_the_registry_s_drafters_with_generate_s_options():
    """A method is a registered drafter (alone: what auto measures of it; with options: that
    one drafter); the drafters' options are generate's, each checked against its drafters."""
    from script_modules import load_script  # tests/ is on the path

    bench = load_script("bench_methods")
    args = bench.parse_args(["checkpoint=x", "num_draft=4", "draft_model=small",
                             'methods=[heads,"heads k=2",draft_model,auto]'])
    assert args.options == {"num_draft": 4, "draft_model": "small"}
    spec = bench.DrafterSpec
    assert args.method("heads k=2") == ("heads", spec("heads", k=2), True)
    assert args.method("lookahead") == ("lookahead", spec("lookahead"), True)  # auto skips it
    assert args.method("draft_model") == (  # what auto measures of it
        "draft_model", spec("auto", num_draft=4, draft_model="small"), False)
    assert args.method("auto") == ("auto", spec("auto", num_draft=4, draft_model="small"), False)
    assert bench.parse_args(["checkpoint=x", "k=4"]).method("heads")[2]  # k selects the heads
    with pytest.raises(ValueError, match="unknown drafter 'medusa'"):
        bench.parse_args(["checkpoint=x", "methods=[medusa]"])
    with pytest.raises(ValueError, match="window=3 sizes lookahead, not drafter='heads'"):
        bench.parse_args(["checkpoint=x", 'methods=["heads window=3"]'])
    with pytest.raises(ValueError, match="unknown key"):
        bench.parse_args(["checkpoint=x", "ks=[2,4]"])
    with pytest.raises(ValueError, match="dtypes"):
        bench.parse_args(["checkpoint=x", "dtypes=[float64]"])
    assert bench.label(None) == "autoregressive"
