"""scripts/bench_decode.py runs end to end on a tiny export: a table, then one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

from script_modules import prompt_file, tiny_export  # tests/ is on the path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_decode.py"


def test_bench_prints_a_table_and_a_json_line(tmp_path):
    directory, prompts = tiny_export(tmp_path), prompt_file(tmp_path)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), f"checkpoint={directory}", f"prompts={prompts}",
         "max_new_tokens=6", "ks=[2,4]", "trees=[tree8]", f"plot={tmp_path / 'trees.png'}",
         "repeats=1", "threads=1", "device=cpu"],
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
    # A plain forward of each step's width, against one of a single token.
    assert summary["per_k"][0]["plain_cost"] == 1.0
    assert all(row["plain_cost"] > 0 for row in summary["per_k"] + summary["per_tree"])
    assert any(line.split()[:1] == ["k=4"] for line in table)
    assert any(line.split()[:2] == ["tree8", "8"] for line in table)


def test_bad_arguments_are_one_line_errors_naming_the_key(tmp_path):
    result = subprocess.run([sys.executable, str(SCRIPT), "compile=sometimes"],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip() == "error: compile='sometimes' is not one of false, true, both"
    result = subprocess.run([sys.executable, str(SCRIPT), "--ks", "2"], capture_output=True,
                            text=True)
    assert result.returncode == 1 and result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1
