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
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1]) == report
    # the tables docs/better.md's generated blocks show (mtp.bench.tables): a row per task,
    # size and head count, and induction's gaps to n = 1
    rows = [line for line in printed if line.startswith(("| induction |", "| polynomial |"))]
    assert len(rows) == sum(len(cells) for task in ("induction", "polynomial")
                            for cells in report["summary"][task].values())
    assert any(line.startswith("| n=2 - n=1 | ") for line in printed)
    assert json.loads((tmp_path / "paper_small.json").read_text()) == report
    for name in ("induction", "polynomial", "curves"):
        figure = tmp_path / f"paper_small_{name}.png"
        assert figure.stat().st_size > 10_000 and str(figure) in report["figures"]
    ladder = paper_small.LADDERS["smoke"]
    expected = {f"{task}/{size[0]}/{paper_small.variant(n, added)}/seed{seed}"
                for task in ("induction", "polynomial") for size in ladder[task]["sizes"]
                for n, added in [(n, False) for n in ladder[task]["n"]]
                + [(n, True) for n in ladder[task].get("added", [])]
                for seed in ladder["seeds"]}
    assert "induction/a/n=2 added/seed0" in expected
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
    # heads on top: head 0 keeps n = 1's whole depth, the second head's block is added
    assert summary["induction"]["b"]["n=2 added"]["parameters"] > \
        summary["induction"]["b"]["n=1"]["parameters"]
    gap = summary["induction_gap_smallest"]
    assert set(gap) == {"size", "n=2 - n=1", "n=2 added - n=1"}
    seeds = [run["final"]["accuracy_repeated"] for key, run in report["runs"].items()
             if key.startswith("induction/a/n=2 added/")]
    base = summary["induction"]["a"]["n=1"]["accuracy_repeated"]["seeds"]
    assert gap["n=2 added - n=1"]["seeds"] == [b - a for a, b in zip(base, seeds)]
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


def test_paired_gap_interval_is_students_t(paper_small) -> None:
    # t quantiles of the textbooks' tables: df 4 -> 2.132, 1 -> 6.314 (two-sided 90%)
    assert abs(paper_small.t_quantile(0.95, 4) - 2.1318) < 1e-3
    assert abs(paper_small.t_quantile(0.95, 1) - 6.3138) < 1e-3
    gap = paper_small.paired_gap([0.1, 0.2, 0.3, 0.1, 0.0], [0.2, 0.2, 0.5, 0.1, 0.1])
    assert gap["seeds"] == pytest.approx([0.1, 0.0, 0.2, 0.0, 0.1])
    half = 2.1318 * gap["std"] / 5 ** 0.5
    assert gap["interval90"] == pytest.approx([0.08 - half, 0.08 + half], abs=1e-4)


def test_paper_cpu_ladder_is_the_papers_smallest_induction_models(paper_small, tmp_path) -> None:
    specs = paper_small.plan("paper_cpu", tmp_path, "cpu", ("induction",), ["1M"])
    assert len(specs) == 5 * 3  # 5 seeds x (n = 1, n = 2 matched, n = 2 added)
    assert {(s["dim"], s["depth"], s["heads"]) for s in specs} == {(128, 5, 4)}
    assert sum("model.heads=added" in s["overrides"] for s in specs) == 5
    paper_small.check_plan(specs[:3])
    with pytest.raises(ValueError, match="sizes: '2M' is not a size of budget=paper_cpu"):
        paper_small.parse_args(["budget=paper_cpu", "sizes=[2M]"])
    with pytest.raises(ValueError, match="budget=paper_cpu has no polynomial ladder"):
        paper_small.plan("paper_cpu", tmp_path, "cpu", ("polynomial",))
