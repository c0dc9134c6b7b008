"""mtp.bench.suites: the suites are well formed, and the smoke suite (`python -m mtp.bench
smoke`, what CI runs) writes results.json and regenerates the docs' blocks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtp.bench.markers import block_names
from mtp.bench.suites import SUITES, Part, suite

from bench.test_markers import marked


def test_suites_are_well_formed() -> None:
    for name in SUITES:
        parts = suite(name)
        assert parts and len({p.name for p in parts}) == len(parts)
    assert all(p.device == "cuda" for p in suite("gpu"))
    with pytest.raises(ValueError, match="unknown suite 'tpu'"):
        suite("tpu")
    with pytest.raises(ValueError, match="timeout=0"):
        Part(name="x", command=("true",), timeout=0)


def test_smoke_suite_writes_results_and_regenerates_the_docs(tmp_path: Path) -> None:
    """`python -m mtp.bench smoke`: what CI runs; every part succeeds in seconds."""
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    docs.write_text(marked("run_smoke", "decode", "memory", "peak_flops"))
    readme.write_text(marked("headline"))
    done = subprocess.run([sys.executable, "-m", "mtp.bench", "smoke", "--out",
                           str(tmp_path / "out"), "--docs", str(docs), "--readme", str(readme)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["failed"] == [] and summary["parts"] == len(suite("smoke"))
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["parts"]["decode"]["result"]["identical"] is True
    text = docs.read_text()
    assert "old" not in text and "| k=2 |" in text and "| headwise | 4 |" in text
    assert "python -m mtp.bench smoke" in text and block_names(text) == [
        "run_smoke", "decode", "memory", "peak_flops"]
    assert "greedy speed-up" in readme.read_text()
