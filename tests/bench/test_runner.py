"""mtp.bench.runner: suites run part by part (a failure or a hang costs one part), and
results.json records each figure's conditions."""

import json
import subprocess
from pathlib import Path

import pytest

from mtp.bench import runner
from mtp.bench.machine import commit
from mtp.bench.runner import last_json, run_suite
from mtp.bench.suites import Part
from mtp.bench.tables import blocks

REPO = Path(__file__).resolve().parents[2]
PY = "{python}"


def test_last_json_reads_only_a_final_json_object() -> None:
    assert last_json('table\n{"a": 1}\n') == {"a": 1}
    assert last_json('{"a": 1}\ntable\n') is None
    assert last_json("[1, 2]") is None and last_json("") is None


def test_a_failure_or_a_hang_costs_one_part(tmp_path: Path) -> None:
    parts = (
        Part(name="good", command=(PY, "-c", "print('table'); print('{\"x\": 2}')"), timeout=30,
             repeats=3),
        Part(name="bad", command=(PY, "-c", "import sys; print('boom'); sys.exit(3)"),
             timeout=30),
        Part(name="hang", command=(PY, "-c", "import time; time.sleep(30)"), timeout=1),
        Part(name="after_bad", command=(PY, "-c", "print('{}')"), timeout=30, needs=("bad",)),
        # a step with no table (a search whose output a later part reads): its exit decides
        Part(name="search", command=(PY, "-c", "print('saved')"), timeout=30, table="none"),
        Part(name="after_search", command=(PY, "-c", "print('{}')"), timeout=30,
             needs=("search",)),
        Part(name="file", command=(PY, "-c", "import json, sys; open(sys.argv[1], 'w')"
                                   ".write(json.dumps({'y': 1}))", "{out}/y.json"), timeout=30,
             result_file="y.json"),
    )
    results = run_suite("test", parts, tmp_path, REPO)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    good = results["parts"]["good"]
    assert good["result"] == {"x": 2} and good["returncode"] == 0 and good["repeats"] == 3
    assert len(good["load_before"]) == 3 and len(good["load_after"]) == 3
    assert good["command"].startswith("python -c") and good["device"] == "cpu"
    assert {"commit", "cpu_flags", "seconds", "device_name", "started"} <= good.keys()
    assert results["parts"]["bad"]["result"] is None
    assert results["parts"]["bad"]["returncode"] == 3
    assert "boom" in results["parts"]["bad"]["output_tail"]
    assert results["parts"]["hang"]["returncode"] == "timeout"
    assert results["parts"]["hang"]["seconds"] < 10
    assert "bad" in results["parts"]["after_bad"]["skipped"]
    assert results["parts"]["file"]["result"] == {"y": 1}
    assert results["parts"]["search"]["result"] == {"returncode": 0}
    assert results["parts"]["after_search"]["result"] == {}
    assert (tmp_path / "logs" / "bad.log").read_text().startswith("$ python -c")

    # --only: rerun one part, keep the others' records
    again = run_suite("test", parts, tmp_path, REPO, only=["good"])
    assert again["parts"]["bad"] == results["parts"]["bad"]
    assert again["parts"]["good"]["started"] >= results["parts"]["good"]["started"]
    with pytest.raises(ValueError, match="no part \\['nope'\\]"):
        run_suite("test", parts, tmp_path, REPO, only=["nope"])

    rendered = blocks(again, {"good": "eval", "bad": "eval", "file": "none", "search": "none",
                              "after_search": "eval"})
    assert "Failed (exit 3)" in rendered["bad"] and "file" not in rendered
    assert "skipped" in rendered["after_bad"] and "| x | 2 |" in rendered["good"]
    assert "python -m mtp.bench test" in rendered["run_test"]


def test_a_budget_cuts_timeouts_and_skips_what_it_has_no_time_for(tmp_path: Path) -> None:
    """A lent GPU's lease: the parts run in order until the budget is spent."""
    sleep = (PY, "-c", "import time; time.sleep(30)")
    parts = (Part(name="first", command=(PY, "-c", "print('{}')"), timeout=30),
             Part(name="long", command=sleep, timeout=600),
             Part(name="late", command=(PY, "-c", "print('{}')"), timeout=30))
    results = run_suite("test", parts, tmp_path, REPO, budget=4, min_part_seconds=0.5)
    first, long, late = (results["parts"][n] for n in ("first", "long", "late"))
    assert first["result"] == {}
    assert long["returncode"] == "timeout" and long["seconds"] < 10  # cut from 600 s
    assert late["result"] is None and "budget of 4 s" in late["skipped"]


def test_a_part_that_needs_mbpp_is_refused_in_one_line_without_it(tmp_path: Path,
                                                                  monkeypatch) -> None:
    parts = (Part(name="first", command=(PY, "-c", "print('{}')"), timeout=30),
             Part(name="sandbox", command=(PY, "-c", "print('{}')", "mbpp_file={mbpp}"),
                  timeout=30))
    monkeypatch.setattr(runner, "mbpp_file", lambda: None)
    with pytest.raises(ValueError, match=r"^part sandbox needs MBPP's mbpp.jsonl: set "
                                         r"\$MTP_MBPP_FILE"):
        run_suite("test", parts, tmp_path, REPO)
    assert not (tmp_path / "results.json").exists()  # nothing ran
    assert run_suite("test", parts, tmp_path, REPO, only=["first"])["parts"]["first"]["result"] \
        == {}
    mbpp = tmp_path / "mbpp.jsonl"
    monkeypatch.setattr(runner, "mbpp_file", lambda: mbpp)
    assert runner.fill("mbpp_file={mbpp}", tmp_path) == f"mbpp_file={mbpp}"


def test_the_commit_is_dirty_for_code_not_for_regenerated_pages(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "page.md").write_text("table\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = commit(tmp_path)
    assert clean and not clean.endswith("-dirty")
    (tmp_path / "page.md").write_text("a regenerated table\n")
    assert commit(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert commit(tmp_path) == clean + "-dirty"
