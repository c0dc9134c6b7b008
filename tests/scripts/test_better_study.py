"""scripts/better_study.py: a tiny study (seconds) writes its JSON and figure; the regimes'
budgets are planned as documented; bad input is one line before any training."""

import json
import re
import shutil
from pathlib import Path

import pytest
from script_modules import load_script  # tests/ is on the path

from mtp.paths import REPO_ROOT


@pytest.fixture(scope="module")
def study():
    return load_script("better_study")


@pytest.fixture
def corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small local corpus (this package's modules, every folder's) and a data cache of the test's own."""
    monkeypatch.setenv("MTP_DATA_DIR", str(tmp_path / "data"))
    root = tmp_path / "corpus"
    root.mkdir()
    for path in sorted((REPO_ROOT / "mtp").rglob("*.py")):  # ~800 kB: enough to hold out 30%
        shutil.copy(path, root / "_".join(path.relative_to(REPO_ROOT).parts))
    return root


def _args(out: Path, corpus: Path, *extra: str) -> list[str]:
    return ["size=tiny", "seeds=[0]", "jobs=0", f"out={out}", f"corpus={corpus}",
            "extra=['trainer.precision=32-true']", *extra]


def test_a_tiny_study_writes_its_json_and_figure(study, corpus, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    report = study.main(_args(out, corpus, "recipes=[byte1,byte8,anneal]", "regimes=[flops]"))
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1]) == report
    assert json.loads((out / "better_study.json").read_text()) == report
    # the table: what docs/better.md's generated block shows (mtp.bench.tables)
    assert any(line.startswith("| regime | recipe | steps |") for line in printed)
    assert sum(line.startswith("| flops | ") for line in printed) == 3
    figure = out / "better_study.png"
    assert figure.stat().st_size > 10_000 and report["figure"] == str(figure)
    assert report["runs"].keys() == {"flops/byte1/seed0", "flops/byte8/seed0",
                                     "flops/anneal/seed0"}
    table = report["summary"]["flops"]
    for name in ("byte1", "byte8", "anneal"):
        cell = table[name]
        assert 0 <= cell["val_acc_head0"]["mean"] <= 1 and cell["step_ratio"] > 0
        assert set(cell["targets"]) == {"accuracy", "drafting", "step", "all"}
    assert table["byte1"]["tokens_per_forward_k4"]["mean"] == 1.0  # one head: no drafts
    assert table["byte8"]["tokens_per_forward_k8"]["mean"] >= 1.0
    assert len(table["anneal"]["acc_head"]) == 8 and table["byte1"]["step_ratio"] == 1.0
    # the decoded text's repeated share, which tokens per forward is read beside
    assert all(0 <= table[name]["repeated"]["mean"] <= 1 for name in table)
    # equal FLOPs: byte1's 4 steps are the budget; anneal's first run and its finish fit it
    runs = report["runs"]
    budget = runs["flops/byte1/seed0"]["flops"]
    anneal = runs["flops/anneal/seed0"]
    assert anneal["finish_steps"] == 2 and anneal["flops"] <= budget
    assert anneal["flops"] + 32 * 2 * anneal["flops_per_token"] > budget  # one step more: over
    assert (out / "flops" / "anneal" / "seed0" / "finish" / "summary.json").is_file()
    # a second call reuses every run
    again = study.main(_args(out, corpus, "recipes=[byte1,byte8,anneal]", "regimes=[flops]"))
    assert again["runs"] == report["runs"]


def test_the_time_regime_splits_the_budget_with_the_finish(study, tmp_path) -> None:
    """Equal wall-clock at size=cpu: every first run gets the step ceiling and 14 minutes,
    less the finish's 2 minutes; the schedules keep their share of the ceiling."""
    args = study.parse_args(["recipes=[byte1,stepped,anneal]", "regimes=[time]", "seeds=[0]"])
    specs = {spec["recipe"]: spec for spec in study.plan(args, tmp_path)}
    assert "trainer.max_time=00:00:14:00" in specs["byte1"]["overrides"]
    assert "trainer.max_time=00:00:12:00" in specs["anneal"]["overrides"]
    assert "trainer.max_time=00:00:02:00" in specs["anneal"]["finish"]
    assert f"init_from={tmp_path}/time/anneal/seed0/export" in specs["anneal"]["finish"]
    assert "trainer.max_steps=100000" in specs["stepped"]["overrides"]
    assert "loss.schedule_steps=[67500]" in specs["stepped"]["overrides"]  # 270 of 400
    assert specs["byte1"]["finish"] is None


def test_the_recipes_table_is_what_the_recipes_build(study, tmp_path) -> None:
    """docs/better.md's recipes table: each recipe's parameters (after its finish, where that
    grows the model) and FLOPs per token against byte1's, as the study plans and builds them."""
    import dataclasses

    import torch
    from test_docs import stated, table_rows

    from mtp.model import MTPModel

    def parameters(config) -> int:
        with torch.device("meta"):
            return MTPModel(config).num_params()

    specs = {spec["recipe"]: spec for spec in study.plan(
        study.parse_args(["regimes=[time]", "seeds=[0]"]), tmp_path)}
    page = REPO_ROOT / "docs" / "better.md"
    byte1 = specs["byte1"]["flops_per_token"]
    value, slack = stated(re.search(r"byte1's ([\d.]+) GFLOP", page.read_text()).group(1))
    assert abs(byte1 / 1e9 - value) <= slack
    rows = table_rows(page, "| study name |")
    assert [row[0].strip("`") for row in rows] == list(study.RECIPES)
    for name, _, _, counts, flops in rows:
        spec = specs[name.strip("`")]
        config = study._model(study._compose(spec["overrides"]))
        built = [parameters(config)]
        if spec["finish"]:
            grown = study._compose(spec["finish"][:-1]).model
            built.append(parameters(dataclasses.replace(
                config, n_future=grown.n_future, head_type=grown.head_type)))
        figures = [f for f in re.fullmatch(r"([\d.]+M)(?: \(([\d.]+M) after\))?",
                                           counts).groups() if f]
        ratios = [spec["flops_per_token"] / byte1] + (
            [spec["finish_flops_per_token"] / byte1] if spec["finish"] else [])
        stated_ratios = [f for f in re.fullmatch(r"([\d.]+x)(?:; finish ([\d.]+x))?",
                                                 flops).groups() if f]
        for figure, count in zip(figures, sorted(set(built), key=built.index), strict=True):
            value, slack = stated(figure)
            assert abs(count - value) <= slack, f"{name}: {figure} for {count:,}"
        for figure, ratio in zip(stated_ratios, ratios, strict=True):
            value, slack = stated(figure)
            assert abs(ratio - value) <= slack, f"{name}: {figure} for {ratio:.3f}x"


@pytest.mark.parametrize("argument, message", [
    ("recipes=[byte1,byte9]", "recipes: 'byte9' is not one of byte1, "),
    ("regimes=[speed]", "regimes: 'speed' is not one of time, flops"),
    ("regimes=[]", "regimes=[] names none of time, flops"),
    ("jobs=-1", "jobs=-1 must be an integer >= 0"),
    ("size=huge", "size='huge' is not one of cpu, short, tiny"),
    ("seeds=[0,0]", "seeds=[0, 0] must be distinct"),
    ("extra=['loss.schedule=cosine']", "loss.schedule='cosine' is not one of"),
])
def test_bad_input_is_one_line_before_training(study, tmp_path, argument, message) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        study.main([f"out={tmp_path / 'out'}", "size=tiny", argument])
    assert not (tmp_path / "out").exists()
