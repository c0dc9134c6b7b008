"""`python -m mtp.generate.calibrate`: measured rates, tree.json, and auto:N from it."""

import json

import pytest
import torch

from mtp.checkpoint import export
from mtp.generate import generate
from mtp.generate.__main__ import main as generate_main
from mtp.generate.auto import Auto
from mtp.generate.calibrate import acceptance_rates, main, truth_ranks
from mtp.generate.names import drafter_from_options
from mtp.generate.tree import Calibration, find_calibration
from mtp.model import MTPModel
from mtp.tokenizers import ByteTokenizer


def test_rates_condition_on_the_earlier_heads():
    # positions x heads 1..3: the rank of the truth
    ranks = torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [5, 0, 0]])
    rates = acceptance_rates(ranks, n_ranks=2)
    assert rates[0] == [0.5, 0.25]  # over all 4 positions (one ranks past 2)
    assert rates[1] == pytest.approx([2 / 3, 1 / 3], abs=1e-4)  # head 1 ranked within 2
    assert rates[2] == pytest.approx([2 / 3, 1 / 3], abs=1e-4)


@torch.no_grad()
def test_truth_ranks_match_a_manual_count(tiny_config):
    model = MTPModel(tiny_config).double().eval()
    tokenizer = ByteTokenizer()
    ranks = truth_ranks(model, tokenizer, ["ab"], max_new_tokens=10)
    [g] = generate(model, tokenizer, ["ab"], max_new_tokens=10)
    ids = [tokenizer.eos_id, *tokenizer.encode("ab"), *g.token_ids]
    logits = model(torch.tensor([ids]))[0]  # (T, n, V)
    start = 2  # the prompt's last position
    assert ranks.shape == (len(ids) - 4 - start, 3)
    for row, s in enumerate(range(start, len(ids) - 4)):
        for head in (1, 2, 3):
            truth = ids[s + head + 1]
            assert ranks[row, head - 1] == (logits[s, head] > logits[s, head, truth]).sum()


def test_calibrate_writes_tree_json_that_generate_and_auto_read(tiny_config, tmp_path, capsys):
    model = MTPModel(tiny_config)
    directory = export(model, ByteTokenizer(), tmp_path / "export")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in ["def f(x):", "import os\n"]))
    main([f"checkpoint={directory}", f"prompt_file={prompts}", "max_new_tokens=20",
          "ranks=4"])
    out = capsys.readouterr().out
    assert "auto:16: depth" in out and "wrote" in out
    calibration = find_calibration(directory, n_future=4, vocab_size=262)
    assert len(calibration.rates) == 3 and all(len(row) == 4 for row in calibration.rates)
    assert 0 < calibration.details["positions"] <= 2 * (20 - 3)  # runs of one token left out
    data = json.loads((directory / "tree.json").read_text())
    assert len(data["trees"]["16"]) == 15
    generate_main([f"checkpoint={directory}", "prompt=xy", "max_new_tokens=6",
                   "drafter=heads", "tree=auto:16"])
    assert "[length] heads(tree=auto:16): 6 tokens" in capsys.readouterr().err
    auto = drafter_from_options(model, "auto", trees=calibration)
    assert isinstance(auto, Auto)
    assert "heads(tree=auto:32)" in auto.candidates(model)
    with pytest.raises(ValueError, match="tree= is the heads drafter's candidate tree"):
        drafter_from_options(model, "prompt_lookup", tree="tree8")


def test_a_calibration_for_another_model_is_refused(tiny_config, tmp_path):
    Calibration([[0.5]] * 7, n_future=8, vocab_size=262).save(tmp_path)
    with pytest.raises(ValueError, match="calibrated for n_future=8"):
        find_calibration(tmp_path, n_future=4, vocab_size=262)
