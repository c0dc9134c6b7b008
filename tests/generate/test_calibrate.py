"""`python -m mtp.generate.calibrate`: measured rates, tree.json, and auto:N from it."""

import json

import pytest
import torch

from mtp.checkpoint import export
from mtp.decode.tree import TREE_FILE, Calibration, Tree
from mtp.generate import Auto, DrafterContext, DrafterSpec, generate
from mtp.generate.__main__ import main as generate_main
from mtp.generate.calibrate import acceptance_rates, main, path_frequencies, truth_ranks
from mtp.generate.saved import saved_choices
from mtp.model import MTPModel
from mtp.tokenizers import ByteTokenizer


def test_rates_condition_on_the_earlier_heads():
    # positions x heads 1..3: the rank of the truth
    ranks = torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [5, 0, 0]])
    rates = acceptance_rates(ranks, n_ranks=2)
    assert rates[0] == [0.5, 0.25]  # over all 4 positions (one ranks past 2)
    assert rates[1] == pytest.approx([2 / 3, 1 / 3], abs=1e-4)  # head 1 ranked within 2
    assert rates[2] == pytest.approx([2 / 3, 1 / 3], abs=1e-4)


def test_path_frequencies_count_every_accepted_prefix():
    ranks = torch.tensor([[0, 0, 1], [0, 1, 0], [1, 0, 0], [5, 0, 0]])
    assert path_frequencies(ranks, n_ranks=2, limit=100) == [
        ((0,), 0.5), ((1,), 0.25), ((0, 0), 0.25), ((0, 1), 0.25), ((1, 0), 0.25),
        ((0, 0, 1), 0.25), ((0, 1, 0), 0.25), ((1, 0, 0), 0.25)]  # (5, ...) accepts nothing
    assert path_frequencies(ranks, n_ranks=2, limit=3) == [((0,), 0.5), ((1,), 0.25),
                                                           ((0, 0), 0.25)]


def test_frequent_paths_beat_the_independent_heads_tree_when_heads_agree():
    # 40% of positions: every head right at rank 0; 60%: head 1 right at rank 1, the others
    # far off. Heads 2 and 3 are right exactly where head 1's top choice was: correlated.
    ranks = torch.tensor([[0, 0, 0]] * 4 + [[1, 9, 9]] * 6)
    rates = acceptance_rates(ranks, n_ranks=2)
    calibration = Calibration(rates, n_future=4, vocab_size=262,
                              paths=path_frequencies(ranks, n_ranks=2, limit=100))
    frequent, medusa = calibration.tree(4), Tree.from_rates(rates, 4)
    assert set(frequent.paths) == {(1,), (0,), (0, 0)}
    assert set(medusa.paths) == {(1,), (0,), (1, 0)}  # independence: 0.6 * 0.4 > 0.4 * 0.4
    assert calibration.expected_length(frequent) == pytest.approx(2.4)  # 1 + .6 + .4 + .4
    assert calibration.expected_length(medusa) == pytest.approx(2.0)  # (1, 0) never accepted
    # more nodes than paths seen: completed by the rates, still a valid tree of that size
    big = calibration.tree(7)
    assert big.n_nodes == 7 and {(1,), (0,), (0, 0), (0, 0, 0)} <= set(big.paths)


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


def test_calibrate_saves_a_calibration_that_generate_and_auto_read(tiny_config, tmp_path,
                                                                    capsys, monkeypatch):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    model = MTPModel(tiny_config)
    directory = export(model, ByteTokenizer(), tmp_path / "export")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in ["def f(x):", "import os\n"]))
    main([f"checkpoint={directory}", f"prompt_file={prompts}", "max_new_tokens=20",
          "ranks=4", f"output={tmp_path}"])
    out = capsys.readouterr().out
    assert "auto:16: depth" in out and "saved: trees: heads 1..3 at ranks < 4 (measured" in out
    [saved] = saved_choices(directory).values()
    calibration = Calibration.load(saved, n_future=4, vocab_size=262)
    assert len(calibration.rates) == 3 and all(len(row) == 4 for row in calibration.rates)
    assert 0 < calibration.details["positions"] <= 2 * (20 - 3)  # runs of one token left out
    data = json.loads((tmp_path / TREE_FILE).read_text())  # output= writes the file too
    assert data == saved
    assert "paths" in data  # a random model's heads never rank the truth in their top 4: {}
    assert len(data["trees"]["16"]) == 15
    generate_main([f"checkpoint={directory}", "prompt=xy", "max_new_tokens=6",
                   "drafter=heads", "tree=auto:16"])
    assert "[length] heads(tree=auto:16): 6 tokens" in capsys.readouterr().err
    auto = Auto(context=DrafterContext(saved={"trees": saved}))
    assert "heads(tree=auto:32)" in auto.candidates(model, {})
    with pytest.raises(ValueError, match="tree='tree8' sizes heads or eagle, not drafter='prompt_lookup'"):
        DrafterSpec(drafter="prompt_lookup", tree="tree8")


def test_a_calibration_for_another_model_is_refused(tiny_config, tmp_path):
    Calibration([[0.5]] * 7, n_future=8, vocab_size=262).save(tmp_path)
    with pytest.raises(ValueError, match="calibrated for n_future=8"):
        Calibration.load(tmp_path / TREE_FILE, n_future=4, vocab_size=262)
