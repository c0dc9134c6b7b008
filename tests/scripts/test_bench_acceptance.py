"""scripts/bench_acceptance.py runs end to end on a tiny export: a table, then one JSON line
with each rule's figures."""

import json
import subprocess
import sys
from pathlib import Path

from mtp.bench import tables
from script_modules import prompt_file, tiny_export  # tests/ is on the path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_acceptance.py"


def test_bench_acceptance_table_and_json(tmp_path):
    directory, prompts = tiny_export(tmp_path), prompt_file(tmp_path)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), f"checkpoint={directory}", f"prompt_file={prompts}",
         "max_new_tokens=6", "threads=1", "tree=tree8"], capture_output=True, text=True,
        check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    rules = figures["rules"]
    assert "| spectr iid |" in tables.acceptance(figures)  # docs/benchmarks.md's table
    assert list(rules) == ["specinfer distinct", "specinfer iid", "spectr iid"]
    assert all(1 <= row["tokens_per_forward"] <= 4 for row in rules.values())
