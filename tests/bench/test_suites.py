"""mtp.bench.suites: the suites are well formed, and the smoke suite (`python -m mtp.bench
smoke`, what CI runs) writes results.json and regenerates the docs' blocks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.test_markers import marked
from bench.test_records import REPO, _parses
from mtp.bench.__main__ import page, parse_args
from mtp.bench.markers import block_names
from mtp.bench.runner import fill, written
from mtp.bench.suites import SUITES, Part, suite


def test_suites_are_well_formed() -> None:
    for name in SUITES:
        parts = suite(name)
        assert parts and len({p.name for p in parts}) == len(parts)
    assert all(p.device == "cuda" for p in suite("gpu"))
    with pytest.raises(ValueError, match="unknown suite 'tpu'"):
        suite("tpu")
    with pytest.raises(ValueError, match="timeout=0"):
        Part(name="x", command=("true",), timeout=0)


@pytest.mark.parametrize("name", [n for n in SUITES if n != "smoke"])
def test_every_table_has_a_block_in_its_page(name: str) -> None:
    """The runner writes a part's table only where its page has the block: one without it
    would be measured and then shown nowhere."""
    wanted = {f"run_{name}"} | {p.name for p in suite(name) if p.renderer != "none"}
    assert wanted - set(block_names(page(name).read_text())) == set()


@pytest.mark.parametrize("name", list(SUITES))
def test_every_part_s_command_parses(name: str, tmp_path: Path) -> None:
    """Each part's command as results.json records it parses today (test_records' check:
    `python -m mtp.train`'s overrides compose, every other command's parse_args takes its
    key=value arguments, mtp.cli's grammar); {python} is this interpreter."""
    for part in suite(name):
        assert fill(part.command[0], tmp_path) == sys.executable
        assert _parses(written(part, tmp_path, REPO)) is None, part.name


def test_the_command_line_takes_the_suite_first() -> None:
    name, args = parse_args(["gpu", "budget=540", "only=[gpu_hf,gpu_eval]"])
    assert (name, args.budget, args.only) == ("gpu", 540, ["gpu_hf", "gpu_eval"])
    with pytest.raises(ValueError, match="the first argument must be a suite"):
        parse_args(["budget=540"])
    with pytest.raises(ValueError, match="bad arguments .*--budget"):
        parse_args(["gpu", "--budget=540"])


def test_smoke_suite_writes_results_and_regenerates_the_docs(tmp_path: Path) -> None:
    """`python -m mtp.bench smoke`: what CI runs; every part succeeds in seconds."""
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    docs.write_text(marked("run_smoke", "decode", "memory", "peak_flops"))
    readme.write_text(marked("headline"))
    done = subprocess.run([sys.executable, "-m", "mtp.bench", "smoke", f"out={tmp_path / 'out'}",
                           f"docs={docs}", f"readme={readme}"],
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
    assert "greedy decoding with the heads" in readme.read_text() and summary["seconds"] > 0
