"""scripts/paper_small.py: a tiny sweep (seconds) writes the JSON and both figures; bad input
is one line before any training."""

import json

import pytest
from script_modules import load_script  # tests/ is on the path


@pytest.fixture(scope="module")
def paper_small():
    return load_script("paper_small")


def test_tiny_sweep_writes_the_json_and_both_figures(paper_small, tmp_path, capsys,
                                                     monkeypatch) -> None:
    monkeypatch.setenv("MTP_DATA_DIR", str(tmp_path / "data"))
    report = paper_small.main(["budget=smoke", "jobs=0", f"out={tmp_path}"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert json.loads((tmp_path / "paper_small.json").read_text()) == report
    for name in ("induction", "polynomial", "curves"):
        figure = tmp_path / f"paper_small_{name}.png"
        assert figure.stat().st_size > 10_000 and str(figure) in report["figures"]
    ladder = paper_small.LADDERS["smoke"]
    expected = {paper_small.run_key(task, size[0], n, seed)
                for task in ("induction", "polynomial") for size in ladder[task]["sizes"]
                for n in ladder[task]["n"] for seed in ladder["seeds"]}
    assert report["runs"].keys() == expected
    summary = report["summary"]
    # every (size, n) has its mean and spread over seeds; polynomial for m = 1..10
    cell = summary["polynomial"]["a"]["n=4"]
    assert list(cell["accuracy_m"]) == [str(m) for m in range(1, 11)]
    assert set(cell["accuracy"]) == {"mean", "std", "min", "max", "seeds"}
    assert summary["induction_gap_smallest"]["size"] == "a"
    run = report["runs"]["induction/b/n=2/seed0"]
    assert [p["step"] for p in run["curve"]] == [2, 4]  # the learning curve's checkpoints
    assert run["steps"] == 4 and 0 <= run["final"]["accuracy_repeated"] <= 1
    # equal compute: n = 1 and n = 2 have the same blocks per token, so the same parameters
    # but for the extra heads' blocks in place of trunk blocks
    assert summary["induction"]["b"]["n=1"]["parameters"] == \
        summary["induction"]["b"]["n=2"]["parameters"]
    # a second call reuses every run's result
    again = paper_small.main(["budget=smoke", "jobs=0", f"out={tmp_path}"])
    assert again["runs"] == report["runs"]


def test_bad_input_is_one_line_before_training(paper_small, tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="unknown task 'sums'"):
        paper_small.parse_args(["budget=smoke", "tasks=[sums]", f"out={tmp_path}"])
    with pytest.raises(ValueError, match="budget='tpu'"):
        paper_small.parse_args(["budget=tpu"])
    ladder = json.loads(json.dumps(paper_small.LADDERS["smoke"]))
    ladder["polynomial"]["sizes"] = [["a", 16, 3, 2]]  # 3 blocks cannot hold 4 heads
    monkeypatch.setitem(paper_small.LADDERS, "smoke", ladder)
    with pytest.raises(ValueError, match="depth=3 is too shallow"):
        paper_small.main(["budget=smoke", f"out={tmp_path}"])
    assert not (tmp_path / "polynomial").exists()
