"""scripts/bench_train.py runs end to end on the tiny model: a table, then one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_train.py"


@pytest.mark.slow
def test_bench_prints_mfu_and_step_time_ratios() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "steps=1", "warmup=0", "batch=2", "seq_len=16",
         "threads=1", "precision=bf16-mixed", "peak_flops=1e9", "model=tiny"],
        capture_output=True, text=True, check=True)
    *table, last = result.stdout.strip().splitlines()
    summary = json.loads(last)
    assert {"benchmark", "batch", "seq_len", "threads", "results"} <= summary.keys()
    assert summary["results"].keys() == {"n=8 headwise", "n=8 chunked", "n=8 naive",
                                         "n=1 same trunk", "n=1 compute-matched"}
    assert summary["precision"] == "bf16-mixed" and summary["peak_flops"] == 1e9
    assert summary["mfu"] > 0  # a small peak: rounded to 5 decimals, a loaded CPU's MFU stays > 0
    assert summary["time_ratio_same_trunk"] > 0 and summary["time_ratio_compute_matched"] > 0
    assert any("MFU" in line for line in table)


def test_vocab_size_and_n_future_set_the_measured_shape(capsys) -> None:
    """vocab_size=1000 n_future=4: the models trained (and their MFU's FLOPs) have them."""
    from script_modules import load_script  # tests/ is on the path

    from mtp.model import MTPConfig
    from mtp.train.flops import flops_per_token

    bench_train = load_script("bench_train")
    summary = bench_train.main(["steps=1", "warmup=0", "batch=1", "seq_len=8", "peak_flops=1e9",
                                "vocab_size=1000", "n_future=4", "model=tiny"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert summary["results"].keys() == {"n=4 headwise", "n=4 chunked", "n=4 naive",
                                         "n=1 same trunk", "n=1 compute-matched"}
    assert (summary["vocab_size"], summary["n_future"]) == (1000, 4)
    # model=tiny: 10 blocks per token, so n=4 is a 6-block trunk and 4 heads
    config = MTPConfig(vocab_size=1000, dim=32, n_layers=6, n_heads=4, n_future=4)
    rate = summary["results"]["n=4 headwise"]
    # results round tokens/s to 0.1 and MFU to 5 decimals: a slow (loaded) CPU's few tokens/s
    # make the first rounding the larger error
    assert summary["mfu"] == pytest.approx(rate * flops_per_token(config, 8) / 1e9,
                                           rel=0.05 / rate + 1e-3, abs=1e-5)
    with pytest.raises(ValueError, match="n_future=1"):
        bench_train.parse_args(["n_future=1"])
    # the recipe's overrides (a config group, a nested key) beside the script's own keys
    args = bench_train.parse_args(["model=tiny", "seq_len=8", "model.dim=64", "+experiment=x"])
    assert (args.seq_len, args.overrides) == (8, ["model=tiny", "model.dim=64", "+experiment=x"])
