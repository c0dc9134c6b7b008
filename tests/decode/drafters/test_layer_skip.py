"""Layer skipping (Draft & Verify): greedy output equals autoregressive, the draft shares the
target's cache, the draft-exit, the skip search and its saved choice, and bad input.
(Sampling: tests/decode/test_speculative_sampling.py.)"""

import copy
import json

import pytest
import torch
from decode.common import PROMPTS, TOKENIZER, ids_of

from mtp.checkpoint import export
from mtp.generate import DraftModel, DrafterSpec, LayerSkip, PromptLookup, generate
from mtp.generate.__main__ import main as generate_main
from mtp.decode.drafters.layer_skip import SKIP_FILE, SkipChoice
from mtp.generate.saved import saved_file
from mtp.generate.skip_search import (best_step, draft_share, kept_shares, nested_counts,
                                     search)
from mtp.generate.skip_search import main as search_main
from mtp.model import MTPConfig, MTPModel


@pytest.fixture(scope="module")
def deep():
    """A random 4-layer model (float64): deep enough to skip some layers and keep others."""
    torch.manual_seed(0)
    config = MTPConfig(vocab_size=262, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                       max_seq_len=96, n_future=2)
    return MTPModel(config).double().eval()


@pytest.mark.parametrize("drafter", [LayerSkip([1, 2], 3), LayerSkip([0], 5),
                                     LayerSkip([3], 4, threshold=0.005)],
                         ids=["middle", "first", "exit"])
def test_greedy_equals_autoregressive(deep, drafter):
    reference = ids_of(generate(deep, TOKENIZER, PROMPTS, max_new_tokens=40))
    assert ids_of(generate(deep, TOKENIZER, PROMPTS, max_new_tokens=40, drafter=drafter)) \
        == reference
    alone = [generate(deep, TOKENIZER, [p], max_new_tokens=40, drafter=drafter)[0].token_ids
             for p in PROMPTS]
    assert alone == reference


def test_greedy_equals_autoregressive_on_a_trained_model(trained):
    reference = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=40)
    got = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=40, drafter=LayerSkip([1], 4))
    assert ids_of(got) == ids_of(reference)
    assert [g.finish_reason for g in got] == [g.finish_reason for g in reference]


def test_skipping_nothing_drafts_what_the_target_says_on_its_own_cache(deep):
    # The draft pass reads the full model's keys and values of every verified token and its
    # own of the tokens it drafted this step: with no layer skipped those are the target's,
    # so every draft is kept. A draft that read stale or misplaced slots would be rejected.
    for generation in generate(deep, TOKENIZER, PROMPTS, max_new_tokens=30,
                               drafter=LayerSkip([], 4)):
        stats = generation.stats
        assert stats.head_acceptance[1:] == [1.0] * 4
        assert stats.forward_passes == 1 + -(-(stats.new_tokens - 1) // 5)


def test_the_draft_exit_stops_drafting_below_the_threshold(deep):
    # Bounds every CPU's rounding keeps: a draft's top probability is at least 1/262 (above
    # 1e-6: never an exit) and, for this random model, far below 0.99 (always an exit, after
    # the first draft, which is then not verified).
    reference = ids_of(generate(deep, TOKENIZER, PROMPTS, max_new_tokens=30))
    for threshold, nodes in ((1e-6, 7), (0.99, 1)):
        got = generate(deep, TOKENIZER, PROMPTS, max_new_tokens=30,
                       drafter=LayerSkip([1], 6, threshold=threshold))
        assert ids_of(got) == reference
        for generation in got:  # the prefill verifies the prompt: one node, as an exit
            steps = generation.stats.forward_passes - 1
            assert generation.stats.nodes_verified - 1 <= nodes * steps
            assert generation.stats.nodes_verified - 1 >= steps * (1 if nodes == 1 else 2)


def test_a_draft_model_takes_the_draft_exit_too(deep, trained_draft):
    reference = ids_of(generate(deep, TOKENIZER, PROMPTS, max_new_tokens=30))
    for threshold in (0.5, 1 - 1e-9):  # the second: no draft is sure enough (as a bound)
        drafter = DraftModel(trained_draft, TOKENIZER, num_draft=5, threshold=threshold)
        got = generate(deep, TOKENIZER, PROMPTS, max_new_tokens=30, drafter=drafter)
        assert ids_of(got) == reference
    for generation in got:  # every step verified the last token alone
        assert generation.stats.nodes_verified == generation.stats.forward_passes


def test_the_search_is_deterministic_and_its_choice_reloads(deep, tmp_path):
    prompts = ["def add(", "print('h", "for i"]
    first, order = search(deep, TOKENIZER, prompts, max_draft=5, max_new_tokens=24)
    assert search(deep, TOKENIZER, prompts, max_draft=5, max_new_tokens=24) == (first, order)
    costs = {"step_cost": 0.6, "verify_cost": 0.03}  # the defaults
    assert sorted(order) == [0, 1, 2, 3] and nested_counts(4) == [1, 2, 3]
    assert {c.skip for c in first} == {tuple(sorted(order[:m])) for m in (1, 2, 3)}
    assert [c.speedup for c in first] == sorted((c.speedup for c in first), reverse=True)
    best = first[0]
    # What the search reports is what its parts compute, from a real decode.
    kept = kept_shares(deep, TOKENIZER, prompts, best.skip, 5, 24)
    assert kept == best.kept and list(kept) == sorted(kept, reverse=True) and kept[0] > 0
    assert best.share == pytest.approx(draft_share(deep, best.skip), abs=1e-4)
    assert best_step(kept, draft_share(deep, best.skip), **costs) \
        == (best.num_draft, pytest.approx(best.speedup))
    choice = SkipChoice(best.skip, best.num_draft, 4, 262, {"seed": 0})
    path = choice.save(tmp_path)
    assert path == tmp_path / SKIP_FILE
    assert SkipChoice.load(path, n_layers=4, vocab_size=262) == choice
    with pytest.raises(ValueError, match="searched for a model of 4 layers"):
        SkipChoice.load(path, n_layers=6, vocab_size=262)
    # A choice kept with a checkpoint arrives as its JSON, and its errors say so.
    assert SkipChoice.load(choice.to_json(), n_layers=4, vocab_size=262) == choice
    with pytest.raises(ValueError, match="^the saved layer-skip choice was searched"):
        SkipChoice.load(choice.to_json(), n_layers=6, vocab_size=262)


def test_the_kept_shares_count_steps_not_prefills(deep):
    # Skipping nothing, every step keeps all its drafts: P(A >= i) = 1 at every depth.
    assert kept_shares(deep, TOKENIZER, ["def add(", "zzz"], (), 4, 21) == (1.0,) * 4


def test_the_modeled_step(deep):
    k, speedup = best_step([1.0] * 8, 0.5, step_cost=0.0, verify_cost=0.1)
    assert k == 8 and speedup == pytest.approx(9 / (1 + 0.8 + 4))
    assert best_step([0.0] * 8, 0.5, step_cost=0.0, verify_cost=0.1) \
        == (1, pytest.approx(1 / 1.6))
    assert best_step([0.9, 0.5, 0.1], 0.2, step_cost=0.0, verify_cost=0.1)[0] == 2
    # A fixed cost per step favours longer steps.
    assert best_step([0.6, 0.5, 0.45], 0.5, step_cost=0.0, verify_cost=0.1)[0] == 1
    assert best_step([0.6, 0.5, 0.45], 0.5, step_cost=3.0, verify_cost=0.1)[0] == 3
    assert draft_share(deep, ()) == 1.0 and 0 < draft_share(deep, (0, 1, 2)) < 0.5
    assert nested_counts(29) == [1, 2, 3, 4, 6, 8, 12, 16, 24]


def test_the_command_lines_search_save_the_choice_and_decode_with_it(deep, tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    checkpoint = tmp_path / "export"
    export(deep.float(), TOKENIZER, checkpoint)
    deep.double()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    search_main([f"checkpoint={checkpoint}", f"prompt_file={prompts}", "prompts=3",
                 "max_new_tokens=16", f"output={tmp_path}"])
    out = capsys.readouterr().out
    assert "saved: layer_skip: skip [" in out and f"saved: {tmp_path / SKIP_FILE}" in out
    choice = json.loads((tmp_path / SKIP_FILE).read_text())
    assert choice["n_layers"] == 4 and choice["details"]["prompts"] == 3
    assert sorted(choice["details"]["order"]) == [0, 1, 2, 3]
    # generate finds the choice the tuner keeps for this checkpoint
    assert not (checkpoint / SKIP_FILE).exists()
    generate_main([f"checkpoint={checkpoint}", "prompt='def add('", "max_new_tokens=12",
                   "drafter=layer_skip"])
    assert f"layer_skip(skip={choice['skip']}, num_draft={choice['num_draft']})" \
        in capsys.readouterr().err


def test_a_checkpoint_shipped_with_its_choice_decodes_with_it(deep, tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_CACHE", str(tmp_path / "cache"))
    checkpoint = export(deep.float(), TOKENIZER, tmp_path / "export")
    deep.double()
    SkipChoice((2,), 3, 4, 262).save(checkpoint)
    from mtp.generate import DecodeSettings, open_decoder

    decoder = open_decoder(checkpoint, DecodeSettings(drafter="layer_skip", threads=1),
                           report=None)
    assert repr(decoder.drafter) == "layer_skip(skip=[2], num_draft=3)"
    assert saved_file(tmp_path / "model.gguf", SKIP_FILE) == tmp_path / f"model.gguf.{SKIP_FILE}"


@pytest.mark.parametrize("skip, message", [
    ([0, 1, 2, 3], "skips every one of the trunk's 4 layers"),
    ([1, 4], "names layer 4, but the model's trunk has layers 0..3"),
    ([-1], "names layer -1"),
    ([2, 2], "names a layer twice"),
    ("1,2", "skip='1,2' is neither a list of trunk layers nor a layer_skip.json file"),
])
def test_bad_skip_sets_are_refused_before_decoding(deep, skip, message):
    with pytest.raises(ValueError, match=message):
        generate(deep, TOKENIZER, ["x"], max_new_tokens=4,
                 drafter=DrafterSpec(drafter="layer_skip", skip=skip))


@pytest.mark.parametrize("options, message", [
    ({"drafter": "layer_skip", "threshold": 1.0}, "threshold=1.0 must be a probability in"),
    ({"drafter": "layer_skip", "threshold": -0.1}, "threshold=-0.1 must be a probability in"),
    ({"drafter": "heads", "skip": [1]}, "sizes layer_skip, not drafter='heads'"),
    ({"drafter": "prompt_lookup", "threshold": 0.5}, "sizes draft_model or layer_skip"),
])
def test_bad_options_are_refused_when_the_spec_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        DrafterSpec(**options)


def test_layer_skip_without_a_choice_says_how_to_make_one(deep):
    with pytest.raises(ValueError, match="python -m mtp.generate.skip_search"):
        DrafterSpec(drafter="layer_skip").build(deep)


def test_the_draft_budget_follows_acceptance():
    from mtp.decode.drafters.base import DraftBudget, Verified

    budget = DraftBudget(6, rows=3)
    budget.counts = [3, 3, 6]

    def step(proposed, new_ids):
        budget.proposed = proposed
        budget.update(Verified(*(torch.zeros(3, 1),) * 6, new_ids=new_ids))

    # row 0 kept its 3 drafts, row 1 kept 1 of 3, row 2 had finished
    step([3, 3, 6], [[1, 2, 3, 4], [1, 2], []])
    assert budget.counts == [5, 2, 6] and budget.longest == 6
    step([5, 0, 6], [[1, 2, 3, 4, 5, 6], [7], [1]])  # row 1 proposed nothing
    assert budget.counts == [6, 2, 5]
    for _ in range(3):
        step([1, 1, 1], [[1], [1], [1]])
    assert budget.counts == [3, 1, 2]  # never below one
    budget.update(Verified(*(torch.zeros(3, 1),) * 6, new_ids=[[1], [1], [1]]))
    assert budget.counts == [3, 1, 2]  # nothing proposed since: nothing learnt
    budget.keep([2, 0])
    assert budget.counts == [2, 3]


@pytest.mark.parametrize("make", [
    lambda draft: LayerSkip([0], 6, adaptive=True),  # skipping layer 0: drafts often wrong
    lambda draft: LayerSkip([0], 5, threshold=0.3, adaptive=True),
    lambda draft: DraftModel(draft, TOKENIZER, num_draft=6, adaptive=True),
    lambda draft: PromptLookup(num_draft=8, adaptive=True)],
    ids=["layer_skip", "layer_skip_exit", "draft_model", "prompt_lookup"])
def test_adaptive_drafting_keeps_greedy_identity(trained, trained_draft, make):
    reference = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=48)
    fixed = make(trained_draft)
    fixed.adaptive = False
    full = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=48, drafter=fixed)
    adaptive = generate(trained, TOKENIZER, PROMPTS, max_new_tokens=48,
                        drafter=make(trained_draft))
    assert ids_of(adaptive) == ids_of(full) == ids_of(reference)


def test_adaptive_drafting_stops_proposing_rejected_drafts(trained, trained_draft):
    """A draft model that always drafts the NUL byte, which the trained model never writes:
    every draft is rejected, so an adaptive row proposes one draft a step once its count has
    come down (6, 5, 4, ..., 1), where a fixed one proposes six every step."""
    never = copy.deepcopy(trained_draft)
    with torch.no_grad():
        never.output.weight.zero_()
        never.output.weight[0] = 1.0  # token 0 wins every argmax
    runs = [generate(trained, TOKENIZER, ["def add("], max_new_tokens=30,
                     drafter=DraftModel(never, TOKENIZER, num_draft=6, adaptive=adaptive))[0]
            for adaptive in (False, True)]
    fixed, adaptive = (run.stats for run in runs)
    assert runs[0].token_ids == runs[1].token_ids
    steps = fixed.new_tokens - 1  # nothing kept: one token a forward, the prefill's first
    assert fixed.forward_passes == adaptive.forward_passes == steps + 1
    assert fixed.nodes_verified == 1 + 7 * steps  # the prefill, then six drafts a step
    assert adaptive.nodes_verified == 1 + sum(1 + min(6, max(1, 7 - step))
                                              for step in range(1, steps + 1))


def test_adaptive_is_a_flag():
    with pytest.raises(ValueError, match="adaptive='yes' must be true or false"):
        PromptLookup(adaptive="yes")
    with pytest.raises(ValueError, match="adaptive=True sizes prompt_lookup"):
        DrafterSpec(drafter="heads", adaptive=True)
