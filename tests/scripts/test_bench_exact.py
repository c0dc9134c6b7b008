"""scripts/bench_exact.py runs end to end on a tiny export: a table, then one JSON line whose
exact rows are the exact reference's ids."""

import json
import subprocess
import sys
from pathlib import Path

from mtp.bench import tables
from script_modules import prompt_file, tiny_export  # tests/ is on the path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_exact.py"


def test_bench_exact_table_and_json(tmp_path):
    directory, prompts = tiny_export(tmp_path), prompt_file(tmp_path)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), f"checkpoint={directory}", f"prompt_file={prompts}",
         "max_new_tokens=6", "threads=1", "repeats=1", 'methods=["heads k=3",prompt_lookup]',
         "num_draft=3"], capture_output=True, text=True, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    rows = figures["rows"]
    assert "| heads k=3 bf16 | 3 |" in tables.exact(figures)  # docs/benchmarks.md's table
    assert list(rows) == ["autoregressive width 1 fp32", "autoregressive width 3 fp32",
                          "heads k=3 fp32", "autoregressive width 4 fp32", "prompt_lookup fp32",
                          "autoregressive width 1 bf16", "autoregressive width 3 bf16",
                          "heads k=3 bf16", "autoregressive width 4 bf16",
                          "prompt_lookup bf16"]
    assert all(row["identical"] for row in rows.values())  # exact mode's guarantee
    assert rows["autoregressive width 1 fp32"]["speedup"] > 0
    assert {row["width"] for row in rows.values()} == {1, 3, 4}
