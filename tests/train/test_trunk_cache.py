"""Medusa-1 from cached trunk outputs: the same heads as training through the frozen trunk."""

import pytest
import torch

from mtp.model import MTPConfig, MTPModel
from mtp.train.loss import autograd_backward, mtp_loss
from mtp.train.settings import InitSettings, LossSettings, OptimSettings, RunSettings, TrainSettings
from mtp.train.trunk_cache import TrunkCache

SEQ = 16


def _frozen_base(config: MTPConfig) -> MTPModel:
    torch.manual_seed(0)
    model = MTPModel(config)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(not MTPModel.is_base_parameter(name))
    return model


def _train(model: MTPModel, blocks: torch.Tensor, order: list[list[int]],
           cache: TrunkCache | None) -> dict[str, torch.Tensor]:
    """One AdamW step per batch of block indices in `order`; the trained heads' weights."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    for batch in order:
        tokens, index = blocks[batch], torch.tensor(batch)
        trunk_out = None if cache is None else cache.trunk_out(model, tokens[:, :SEQ], index)
        mtp_loss(model, tokens, seq_len=SEQ, mode="headwise", backward=autograd_backward,
                 trunk_out=trunk_out)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("head_type", ["medusa", "block"])
def test_cached_trunk_outputs_train_the_same_heads(tiny_config: MTPConfig, head_type) -> None:
    config = MTPConfig(**{**tiny_config.to_dict(), "n_future": 3, "head_type": head_type})
    blocks = torch.randint(0, config.vocab_size, (6, SEQ + 3))
    # Three epochs over six blocks, the batches reshuffled: later epochs read the cache.
    order = [[0, 1], [2, 3], [4, 5], [5, 2], [0, 3], [1, 4], [3, 0], [4, 5], [1, 2]]
    through_trunk = _train(_frozen_base(config), blocks, order, cache=None)
    cache = TrunkCache()
    calls = []
    model = _frozen_base(config)
    real_trunk = model.trunk
    model.trunk = lambda inputs, **kw: calls.append(inputs.shape[0]) or real_trunk(inputs, **kw)
    from_cache = _train(model, blocks, order, cache)
    assert calls == [2, 2, 2] and len(cache) == 6  # each block through the trunk once
    assert cache.nbytes() == 6 * SEQ * config.dim * 4
    assert through_trunk.keys() == from_cache.keys() and through_trunk
    for name, weight in through_trunk.items():
        torch.testing.assert_close(from_cache[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_a_cached_trunk_needs_a_frozen_one(tiny_config: MTPConfig) -> None:
    with pytest.raises(ValueError, match="optim.cache_trunk=true keeps a frozen trunk's outputs"):
        OptimSettings(cache_trunk=True)
    with pytest.raises(ValueError, match="optim.cache_trunk=true keeps the trunk's final outputs, "
                                         "which loss.early_exit=1 cannot read"):
        TrainSettings(run=RunSettings(seq_len=SEQ, max_steps=10), loss=LossSettings(early_exit=1),
                      optim=OptimSettings(freeze_trunk=True, cache_trunk=True),
                      init=InitSettings(init_from="base"))
    model = MTPModel(tiny_config)
    tokens = torch.randint(0, tiny_config.vocab_size, (2, SEQ + tiny_config.n_future))
    live = model.trunk(tokens[:, :SEQ])  # carries the trunk's graph: not a frozen output
    with pytest.raises(ValueError, match="must be a frozen trunk's output"):
        mtp_loss(model, tokens, seq_len=SEQ, trunk_out=live)
    with pytest.raises(ValueError, match="one index per block"):
        TrunkCache().trunk_out(model, tokens[:, :SEQ], torch.tensor([0]))
