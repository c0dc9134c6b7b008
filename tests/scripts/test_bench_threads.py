"""scripts/bench_threads.py: its worker measures decoding in-process; end to end, a table and
one JSON line with every setting idle and loaded."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_modules import load_script  # tests/ is on the path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_threads.py"
bench = load_script("bench_threads")


def test_the_worker_decodes_the_byte8_shape(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MTP_CACHE", str(tmp_path))
    model, _ = bench.build("byte8")
    assert (model.config.n_future, model.config.dim, model.config.vocab_size) == (8, 256, 262)
    result = bench.worker("byte8", "default", 0.05, 4)
    assert result["tokens_per_second"] > 0 and result["threads"] == torch.get_num_threads()
    with pytest.raises(ValueError, match="models: 'gpt2'"):
        bench.parse_args(["models=[byte8,gpt2]"])


@pytest.mark.slow
def test_bench_prints_idle_and_loaded_for_every_setting() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "models=[byte8]", "seconds=0.1"],
                            capture_output=True, text=True, check=True)
    *table, last = result.stdout.strip().splitlines()
    summary = json.loads(last)
    assert [row["setting"] for row in summary["rows"]] == [
        "spin, torch's threads", "passive, torch's threads", "passive, measured"]
    for row in summary["rows"]:
        assert row["idle_tokens_per_second"] > 0 and row["loaded_tokens_per_second"] > 0
        # the ratio of the unrounded rates; each rate is printed to 0.1 tokens/s, which moves
        # a ratio of small rates (a starved machine's) by up to 0.05 * (1 + ratio) / idle
        idle, ratio = row["idle_tokens_per_second"], row["loaded_over_idle"]
        assert ratio == pytest.approx(row["loaded_tokens_per_second"] / idle, rel=0.01,
                                      abs=0.05 * (1 + ratio) / idle + 0.001)
    assert any("loaded/idle" in line for line in table)
