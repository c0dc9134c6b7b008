"""End to end: sampled generations have exactly the autoregressive distribution of head 0.

A 4-token model is small enough to enumerate every continuation of 3 tokens and its exact
probability under autoregressive sampling; 10,000 sampled generations must match it, whoever
drafts: the heads (parallel, or sequential modules drafting one depth after another), a
separate draft model (its own q), the model with a layer skipped (its own q, on the target's
cache), prompt lookup and lookahead (one-hot q), heads that learn between calls. Eager steps cut a
chain to the batch's longest real proposal (`engine.py`): prompt lookup with room for 8 drafts
and the draft model combined with it run that cut step at most steps.
"""

import pytest
import torch

from mtp.generate import (Combined, DecodeStats, DraftModel, HeadsDrafter, LayerSkip,
                          Lookahead, OnlineHeads, PromptLookup, SamplingConfig,
                          SequentialDrafter, generate)
from mtp.decode.acceptance import RULES
from mtp.decode.sampling import probabilities
from mtp.decode.tree import DynamicTree, Tree
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import Tokenizer

N = 10_000
EOS = 3


class DigitTokenizer(Tokenizer):
    """Ids 0..2 are the digits '0'..'2'; 3 is EOS (and BOS and padding)."""

    name, vocab_size, bos_id, eos_id, pad_id = "digits", 4, EOS, EOS, EOS

    def encode(self, text):
        return [int(c) for c in text]

    def decode(self, ids):
        return "".join(str(i) for i in ids if i != EOS)

    def incremental_decoder(self):
        tokenizer = self

        class Decoder:
            def push(self, ids):
                return tokenizer.decode(ids)

            def flush(self):
                return ""

        return Decoder()

    def save(self, directory):
        raise NotImplementedError

    @property
    def fingerprint(self):
        return "digits"


@pytest.fixture
def model():
    config = MTPConfig(vocab_size=4, dim=16, n_layers=1, n_heads=2, max_seq_len=16,
                       n_future=3, init_std=0.15)  # large weights: peaked, disagreeing heads
    return MTPModel(config).double().eval()


@torch.no_grad()
def _exact(model, prefix, sampling, depth):
    """Probability of every continuation (up to EOS or `depth` tokens) of `prefix`."""
    outcomes = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for tokens, prob in outcomes.items():
            if tokens and tokens[-1] == EOS:
                grown[tokens] = prob
                continue
            logits = model(torch.tensor([prefix + list(tokens)]))[0, -1, 0]
            for token, p in enumerate(probabilities(logits, sampling).tolist()):
                grown[tokens + (token,)] = prob * p
        outcomes = grown
    return outcomes


def _draft_model():
    torch.manual_seed(1)  # another model than the target: it disagrees with it often
    config = MTPConfig(vocab_size=4, dim=8, n_layers=1, n_heads=2, max_seq_len=16,
                       init_std=0.15)
    return DraftModel(MTPModel(config).double().eval(), DigitTokenizer(), num_draft=2)


T1, NUCLEUS = SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_p=0.9, top_k=3)


# A tree of the heads' candidates: siblings at both depths, a rank (2) that top_k=3 and top_p
# leave drawable only sometimes, and a path that continues from a second choice.
TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


@pytest.mark.parametrize("drafter, sampling", [
    ("k=1", T1), ("k=1", NUCLEUS), ("k=3", T1), ("k=3", NUCLEUS), ("tree", NUCLEUS),
    ("draft_model", NUCLEUS), ("prompt_lookup", T1), ("prompt_lookup_wide", T1),
    ("draft_model+prompt_lookup", NUCLEUS), ("lookahead", NUCLEUS), ("dynamic", NUCLEUS),
    ("exact", NUCLEUS)])
def test_sampled_generations_follow_head_0(model, drafter, sampling):
    exact = _exact(model, [EOS, 0, 1], sampling, depth=3)
    how = {"k=1": None, "k=3": HeadsDrafter(3), "tree": HeadsDrafter(3, Tree(TREE)),
           "draft_model": _draft_model(),
           "prompt_lookup": PromptLookup(num_draft=2, max_ngram=1, min_ngram=1),
           # the context ([EOS, 0, 1] and 3 new tokens) has at most 5 tokens after a match
           "prompt_lookup_wide": PromptLookup(num_draft=8, max_ngram=1, min_ngram=1),
           # rows with the draft model's 2 drafts (its q) beside rows with up to 4 one-hot
           "draft_model+prompt_lookup": Combined(
               _draft_model(), PromptLookup(num_draft=4, max_ngram=1, min_ngram=1)),
           "lookahead": Lookahead(window=2, ngram=3, guesses=1),
           # a tree each row chooses at each step from its heads' confidence (EAGLE-2)
           "dynamic": HeadsDrafter(3, DynamicTree.of(5, 2, 3)),
           # exact mode: each position's token from its own uniform (inverse CDF)
           "exact": HeadsDrafter(3, Tree(TREE))}
    generations = generate(model, DigitTokenizer(), ["01"] * N, max_new_tokens=3,
                           sampling=sampling, seed=0, drafter=how[drafter],
                           exact=drafter == "exact")
    _assert_distribution(generations, exact)
    pooled = DecodeStats.pooled([g.stats for g in generations])
    if drafter == "prompt_lookup_wide":  # the padding was cut: at most 5 drafts per step
        assert pooled.nodes_verified <= 6 * pooled.forward_passes - 5 * len(generations)
    if drafter in ("tree", "exact", "dynamic"):  # with siblings, a depth-1 draft is kept
        assert pooled.head_acceptance[1] > 0.75  # most of the time
        # every forward after the prefill (one node) verified the whole tree
        nodes = 5 if drafter == "dynamic" else 7
        assert pooled.nodes_verified == nodes * pooled.forward_passes - (nodes - 1) * N
    elif drafter != "k=1":  # drafts are rejected often, so the rejection rule was exercised
        rate = [g.stats.head_acceptance[1] for g in generations if g.stats.head_verified[1]]
        assert 0.1 < sum(rate) / len(rate) < 0.9


def _assert_distribution(generations, exact):
    """The generations' outcomes follow the exact distribution, cell by cell."""
    counts = {}
    for g in generations:
        counts[tuple(g.token_ids)] = counts.get(tuple(g.token_ids), 0) + 1
    assert set(counts) <= {o for o, p in exact.items() if p > 0}
    # Within 4.5 standard errors, cell by cell (and a count of 3 for the rarest cells).
    for outcome, p in exact.items():
        error = abs(counts.get(outcome, 0) / N - p)
        assert error <= 4.5 * (p * (1 - p) / N) ** 0.5 + 3 / N, (outcome, p, error)


@pytest.mark.parametrize("tree", [None, Tree(TREE)], ids=["chain", "tree"])
def test_sequential_modules_draft_losslessly(tree):
    """Each module's drafts depend on the drafts before them (a tree's siblings differ per
    parent): their q must still be the distribution they were drawn from."""
    config = MTPConfig(vocab_size=4, dim=16, n_layers=1, n_heads=2, max_seq_len=16,
                       n_future=3, init_std=0.15, head_type="sequential")
    model = MTPModel(config).double().eval()
    exact = _exact(model, [EOS, 0, 1], NUCLEUS, depth=3)
    generations = generate(model, DigitTokenizer(), ["01"] * N, max_new_tokens=3,
                           sampling=NUCLEUS, seed=0, drafter=SequentialDrafter(3, tree))
    _assert_distribution(generations, exact)
    rate = [g.stats.head_acceptance[1] for g in generations if g.stats.head_verified[1]]
    assert 0.1 < sum(rate) / len(rate) < 0.95  # the rejection rule was exercised


def test_exact_enumeration_is_a_distribution(model):
    exact = _exact(model, [EOS, 0], SamplingConfig(temperature=1.0), depth=3)
    assert abs(sum(exact.values()) - 1) < 1e-9
    assert all(len(o) == 3 or o[-1] == EOS for o in exact)
    assert max(exact.values()) < 0.5  # spread out enough to be a test


@pytest.mark.parametrize("drafter", [LayerSkip([1], num_draft=2),
                                     LayerSkip([0], num_draft=3, threshold=0.4)],
                         ids=["layer_skip", "layer_skip_exit"])
def test_layer_skipping_drafts_losslessly(drafter):
    """The target drafting for itself with a layer skipped, on its own cache; with a
    draft-exit threshold, rows stop drafting early and the step verifies the real drafts."""
    torch.manual_seed(2)
    config = MTPConfig(vocab_size=4, dim=16, n_layers=2, n_heads=2, max_seq_len=16,
                       init_std=0.15)
    model = MTPModel(config).double().eval()
    exact = _exact(model, [EOS, 0, 1], NUCLEUS, depth=3)
    generations = generate(model, DigitTokenizer(), ["01"] * N, max_new_tokens=3,
                           sampling=NUCLEUS, seed=0, drafter=drafter)
    _assert_distribution(generations, exact)
    rate = [g.stats.head_acceptance[1] for g in generations if g.stats.head_verified[1]]
    assert 0.1 < sum(rate) / len(rate) < 0.95  # drafts are rejected: the rule was exercised
    if drafter.threshold:  # unsure drafts were never verified: fewer nodes than a full chain
        pooled = DecodeStats.pooled([g.stats for g in generations])
        assert pooled.nodes_verified < 4 * pooled.forward_passes - 3 * len(generations)


def test_heads_that_learn_between_calls_draft_losslessly(model):
    """Online heads: each call's q comes from heads the earlier calls trained; the pooled
    samples of five calls still follow head 0."""
    exact = _exact(model, [EOS, 0, 1], NUCLEUS, depth=3)
    online = OnlineHeads(3, lr=5e-2, steps=2)
    before = [p.clone() for p in model.heads[1].parameters()]
    generations = []
    for call in range(5):
        generations += generate(model, DigitTokenizer(), ["01"] * (N // 5), max_new_tokens=3,
                                sampling=NUCLEUS, seed=call, drafter=online)
    assert online.learnt == 8
    assert any(not torch.equal(p, q) for p, q in zip(model.heads[1].parameters(), before))
    _assert_distribution(generations, exact)


@pytest.mark.parametrize("acceptance", [name for name, rule in RULES.items() if rule.lossless])
def test_every_lossless_rule_keeps_head_0s_distribution_on_iid_siblings(model, acceptance):
    """Three i.i.d. sibling drafts at each depth (siblings=iid): every rule that says it is
    lossless (SpecInfer's recursive rejection, SpecTr's k-sequential selection) gives head 0's
    distribution."""
    exact = _exact(model, [EOS, 0, 1], NUCLEUS, depth=3)
    drafter = HeadsDrafter(3, Tree(TREE), siblings="iid")
    generations = generate(model, DigitTokenizer(), ["01"] * N, max_new_tokens=3,
                           sampling=NUCLEUS, seed=0, drafter=drafter, acceptance=acceptance)
    _assert_distribution(generations, exact)


def test_spectrs_rho_solves_its_equation_on_the_lossless_side():
    from mtp.decode.acceptance import _rho

    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    rho, share = _rho(p, q, torch.tensor([3, 3]), iterations=60)
    beta = torch.minimum(q, p / rho[:, None]).sum(-1)
    assert torch.allclose(1 - (1 - beta) ** 3, rho * beta, atol=1e-9)  # its equation
    assert (share <= rho).all() and rho[1].item() == pytest.approx(1.0)  # q = p: rho 1
    one, _ = _rho(p, q, torch.tensor([1, 1]), iterations=60)  # one draft: the usual rule
    assert torch.allclose(one, torch.ones(2, dtype=torch.float64))
