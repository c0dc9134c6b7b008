"""The acceptance rule on stub distributions: agreeing, disagreeing, and exact in distribution."""

import pytest
import torch

from mtp.decode.acceptance import AcceptanceSettings, Draws
from mtp.decode.acceptance import accept as accept_drafts
from mtp.decode.drafters.base import Drafts
from mtp.decode.sampling import SamplingConfig
from mtp.decode.tree import Tree


def accept(drafts, target, generator=None):
    """The rule on target distributions (B, m, V) of a chain; their logs are the logits
    `accept` takes (log 0 = -inf keeps one-hot rows one-hot, which is greedy decoding)."""
    greedy = bool(target.eq(1).sum(-1).eq(1).all()) and (
        drafts.probs is None or bool(drafts.probs.eq(1).sum(-1).eq(1).all()))
    batch, nodes, vocab = target.shape
    draws = None if greedy else Draws.draw(batch, nodes, vocab, generator, "cpu")
    result = accept_drafts(drafts, target.log(), Tree.chain(drafts.count),
                           AcceptanceSettings(SamplingConfig(temperature=0 if greedy else 1)),
                           draws)
    return result.n_accepted, result.tokens

N = 40_000  # rows sampled at once; each a frequency's standard error is below 0.0025


def _one_hot(ids, vocab=5):
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).double()


def test_heads_that_always_agree_accept_every_draft_and_a_bonus_token():
    target = _one_hot([[1, 2, 3, 4]])  # head 0's argmax at the 4 pending positions
    drafts = Drafts(torch.tensor([[1, 2, 3]]), _one_hot([[1, 2, 3]]))
    n_accepted, tokens = accept(drafts, target)
    assert n_accepted.tolist() == [3]
    assert tokens.tolist() == [[1, 2, 3, 4]]


def test_heads_that_never_agree_give_one_token_per_forward():
    target = _one_hot([[1, 2, 3, 4]])
    drafts = Drafts(torch.tensor([[0, 2, 3]]), _one_hot([[0, 2, 3]]))
    n_accepted, tokens = accept(drafts, target)
    assert n_accepted.tolist() == [0]
    assert tokens[:, 0].tolist() == [1]  # head 0's correction


def test_partial_agreement_keeps_the_agreeing_prefix_per_sequence():
    target = _one_hot([[1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = Drafts(torch.tensor([[1, 2, 0], [1, 0, 3]]), _one_hot([[1, 2, 0], [1, 0, 3]]))
    n_accepted, tokens = accept(drafts, target)
    assert n_accepted.tolist() == [2, 1]
    assert tokens[0, :3].tolist() == [1, 2, 3] and tokens[1, :2].tolist() == [1, 2]


def _frequencies(tokens, vocab):
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def test_speculative_sampling_keeps_head_0s_distribution():
    p0 = torch.tensor([0.1, 0.6, 0.2, 0.1], dtype=torch.float64)  # head 0, first position
    p1 = torch.tensor([0.4, 0.1, 0.1, 0.4], dtype=torch.float64)  # head 0, second position
    q1 = torch.tensor([0.1, 0.1, 0.7, 0.1], dtype=torch.float64)  # head 1's proposal
    q2 = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)  # head 2's proposal
    generator = torch.Generator().manual_seed(0)
    proposals = torch.stack([q1, q2]).expand(N, 2, 4)
    draft_ids = torch.stack([torch.multinomial(q, N, replacement=True, generator=generator)
                             for q in (q1, q2)], dim=1)  # (N, 2)
    target = torch.stack([p0, p1, p0]).expand(N, 3, 4)
    n_accepted, tokens = accept(Drafts(draft_ids, proposals), target, generator)

    first = _frequencies(tokens[:, 0], 4)
    torch.testing.assert_close(first, p0, atol=0.01, rtol=0)
    # The test has power: resampling from p instead of the residual max(p - q, 0) is far off.
    rejected = 1 - torch.minimum(p0, q1).sum()
    wrong = torch.minimum(p0, q1) + rejected * p0
    assert (wrong - p0).abs().max() > 0.1

    # Given the first draft was kept, the second token has head 0's second distribution.
    second = _frequencies(tokens[n_accepted >= 1, 1], 4)
    torch.testing.assert_close(second, p1, atol=0.02, rtol=0)
    # Acceptance rates are the overlaps sum(min(p, q)).
    assert abs((n_accepted >= 1).double().mean() - torch.minimum(p0, q1).sum()) < 0.01


def test_identical_proposal_and_target_accept_everything():
    p = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    drafts = Drafts(torch.multinomial(p, 1000, replacement=True)[:, None], p.expand(1000, 1, 3))
    n_accepted, _ = accept(drafts, p.expand(1000, 2, 3))
    assert n_accepted.eq(1).all()


def test_a_new_rule_is_one_registered_class(monkeypatch, tiny_config):
    """A rule registered by name is acceptance=<name> end to end, and says for itself that
    exact mode does not refine it; nothing else in mtp names it."""
    from dataclasses import dataclass
    from typing import ClassVar

    import mtp.decode.acceptance as acceptance
    from mtp.decode.sampling import sample
    from mtp.generate import HeadsDrafter, generate
    from mtp.model import MTPModel
    from mtp.tokenizers import ByteTokenizer

    monkeypatch.setattr(acceptance, "RULES", dict(acceptance.RULES))

    @acceptance.register_rule
    @dataclass(frozen=True)
    class RootOnly(acceptance.AcceptanceRule):
        """Keeps no draft: the token after the root, drawn from p (lossless, and useless)."""

        name: ClassVar[str] = "root_only"
        lossless: ClassVar[bool] = True

        def select(self, drafts, p, tree, buffers, real, draws):
            node = torch.zeros(p.shape[0], dtype=torch.long)
            return node, sample(p[:, 0], draws.exponential)

    assert isinstance(acceptance.acceptance_rule("root_only"), RootOnly)
    model = MTPModel(tiny_config).eval()
    sampled = dict(drafter=HeadsDrafter(4), sampling=SamplingConfig(temperature=1.0), seed=0)
    [g] = generate(model, ByteTokenizer(), ["def f("], max_new_tokens=6,
                   acceptance="root_only", **sampled)
    assert g.stats.forward_passes == len(g.token_ids)  # one token per step: no draft kept
    with pytest.raises(ValueError, match="acceptance=root_only is a rule of its own"):
        generate(model, ByteTokenizer(), ["def f("], acceptance="root_only", exact=True)
