"""scripts/bench_train.py runs end to end on the tiny model: a table, then one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_train.py"


@pytest.mark.slow
def test_bench_prints_mfu_and_step_time_ratios() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "1", "--warmup", "0", "--batch", "2",
         "--seq-len", "16", "--threads", "1", "--precision", "bf16-mixed",
         "--peak-flops", "1e9", "model=tiny"], capture_output=True, text=True, check=True)
    *table, last = result.stdout.strip().splitlines()
    summary = json.loads(last)
    assert {"benchmark", "batch", "seq_len", "threads", "results"} <= summary.keys()
    assert summary["results"].keys() == {"n=8 headwise", "n=8 chunked", "n=8 naive",
                                         "n=1 same trunk", "n=1 compute-matched"}
    assert summary["precision"] == "bf16-mixed" and summary["peak_flops"] == 1e9
    assert summary["mfu"] > 0  # a small peak: rounded to 5 decimals, a loaded CPU's MFU stays > 0
    assert summary["time_ratio_same_trunk"] > 0 and summary["time_ratio_compute_matched"] > 0
    assert any("MFU" in line for line in table)
