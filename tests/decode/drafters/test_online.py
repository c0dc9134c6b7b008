"""Online heads (drafters/online.py): the heads learn from the target between calls, and the
target's output never changes."""

import copy

import pytest
import torch

from mtp.generate import DrafterSpec, HeadsDrafter, OnlineHeads, generate
from mtp.model import MTPConfig, MTPModel
from mtp.tokenizers import ByteTokenizer
from conftest import DOCS  # tests/ is on the path

TOKENIZER = ByteTokenizer()


@pytest.fixture
def fresh_heads(trained: MTPModel) -> MTPModel:
    """The trained trunk and head 0, heads 1..3 at random: drafts that are mostly wrong."""
    model = copy.deepcopy(trained)
    torch.manual_seed(1)
    untrained = MTPModel(model.config).double()
    for head, new in zip(model.heads[1:], untrained.heads[1:]):
        head.load_state_dict(new.state_dict())
    return model


def test_greedy_output_stays_the_targets_while_the_heads_learn(fresh_heads) -> None:
    prompts = [doc[:8] for doc in DOCS]
    reference = generate(fresh_heads, TOKENIZER, prompts, max_new_tokens=40)
    online = OnlineHeads(4, lr=2e-2, steps=10)
    before = [p.clone() for p in fresh_heads.heads[1].parameters()]
    per_forward = []
    for _ in range(5):  # a stream: the same prompts again
        got = generate(fresh_heads, TOKENIZER, prompts, max_new_tokens=40, drafter=online)
        assert [g.token_ids for g in got] == [g.token_ids for g in reference]
        per_forward.append(sum(g.stats.new_tokens for g in got) /
                           sum(g.stats.forward_passes for g in got))
    assert online.learnt == 4 * 10  # four calls after the first, ten steps each
    assert any(not torch.equal(p, q) for p, q in zip(fresh_heads.heads[1].parameters(), before))
    head0 = dict(copy.deepcopy(fresh_heads).heads[0].named_parameters())
    assert all(torch.equal(p, head0[n]) for n, p in fresh_heads.heads[0].named_parameters())
    assert per_forward[-1] > per_forward[0] + 1.0, per_forward  # the heads learnt to draft

    frozen = HeadsDrafter(4)  # the same heads, no longer learning, keep what they learnt
    got = generate(fresh_heads, TOKENIZER, prompts, max_new_tokens=40, drafter=frozen)
    assert [g.token_ids for g in got] == [g.token_ids for g in reference]


def test_the_trunk_and_head_0_never_change(fresh_heads) -> None:
    base = {n: p.clone() for n, p in fresh_heads.named_parameters()
            if MTPModel.is_base_parameter(n)}
    online = OnlineHeads(3, lr=1e-2)
    for _ in range(3):
        generate(fresh_heads, TOKENIZER, ["def add(", "import o"], max_new_tokens=16,
                 drafter=online)
    assert online.learnt == 2
    for name, p in fresh_heads.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), name
    assert repr(online) == "heads(k=3, online)"


def test_online_is_for_heads_that_can_learn() -> None:
    with pytest.raises(ValueError, match="online=True sizes heads, not "
                                         "drafter='prompt_lookup'"):
        DrafterSpec(drafter="prompt_lookup", online=True)
    with pytest.raises(ValueError, match="online='yes' must be true or false"):
        DrafterSpec(drafter="heads", online="yes")
    sequential = MTPModel(MTPConfig(vocab_size=262, dim=16, n_layers=1, n_heads=2,
                                    max_seq_len=32, n_future=3, head_type="sequential"))
    with pytest.raises(ValueError, match="online=true trains parallel heads"):
        DrafterSpec(drafter="heads", online=True).build(sequential)
    with pytest.raises(ValueError, match="learning rate must be > 0, got lr=0"):
        OnlineHeads(2, lr=0)
    built = DrafterSpec(drafter="heads", k=3, online=True).build(MTPModel(MTPConfig(
        vocab_size=262, dim=16, n_layers=1, n_heads=2, max_seq_len=32, n_future=4)))
    assert isinstance(built, OnlineHeads) and built.k == 3
