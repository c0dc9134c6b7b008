"""The EAGLE drafter samples losslessly: 10,000 sampled generations of a 4-token model follow
its exact autoregressive distribution (tests/decode/test_speculative_sampling.py's
enumeration), with a chain, a tree whose siblings are drawn without replacement, a draft
vocabulary that leaves a target token out (q is 0 there), and a dynamic tree's deterministic
drafts (one-hot q)."""

import pytest
import torch

from decode.test_speculative_sampling import (
    EOS,
    NUCLEUS,
    T1,
    TREE,
    DigitTokenizer,
    _assert_distribution,  # tests/ on path
    _exact,
)
from mtp.decode.drafters.eagle import EagleDrafter
from mtp.decode.drafters.eagle_model import Eagle, EagleConfig
from mtp.decode.loop import generate
from mtp.decode.output import DecodeStats
from mtp.decode.tree import DynamicTree, Tree
from mtp.model import MTPConfig, MTPModel

N = 10_000


@pytest.fixture
def pair():
    """A peaked random 4-token target and a drafter that disagrees with it often, over draft
    tokens 0, 1 and EOS (2 is left out)."""
    config = MTPConfig(vocab_size=4, dim=16, n_layers=2, n_heads=2, max_seq_len=16,
                       n_future=1, init_std=0.15)
    model = MTPModel(config).double().eval()
    module = Eagle(EagleConfig.for_target(config, 3), torch.tensor([0, 1, EOS]))
    module.init_weights(std=0.3)
    return model, module.double().eval()


@pytest.mark.parametrize("how, sampling", [("chain", T1), ("chain", NUCLEUS), ("tree", NUCLEUS),
                                           ("dynamic", NUCLEUS)])
def test_sampled_generations_follow_the_target(pair, how, sampling):
    model, module = pair
    exact = _exact(model, [EOS, 0, 1], sampling, depth=3)
    drafter = {"chain": EagleDrafter(module, 2), "tree": EagleDrafter(module, 2, Tree(TREE)),
               "dynamic": EagleDrafter(module, 2, DynamicTree.of(4, 2, 2))}[how]
    generations = generate(model, DigitTokenizer(), ["01"] * N, max_new_tokens=3,
                           sampling=sampling, seed=0, drafter=drafter)
    _assert_distribution(generations, exact)
    pooled = DecodeStats.pooled([g.stats for g in generations])
    assert 0.1 < pooled.head_acceptance[1] < 0.9  # drafts are rejected: the rule was exercised
