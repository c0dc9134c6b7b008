import pytest
import torch

from mtp.kv_cache import KVCache
from mtp.model import MTPModel


@pytest.fixture
def model(tiny_config):
    return MTPModel(tiny_config).double().eval()


def _cache(model, batch=1, max_len=32):
    return KVCache(model.config, batch, max_len, dtype=torch.float64)


@torch.no_grad()
def test_cached_logits_equal_full_recomputation_for_every_head(model):
    tokens = torch.randint(0, 262, (2, 12))
    full = model(tokens)  # (B, T, n, V)
    cache = _cache(model, batch=2)
    pieces = [model(tokens[:, :5], cache=cache)]  # prefill, then steps of 1 and 3 tokens
    pieces += [model(tokens[:, 5:6], cache=cache), model(tokens[:, 6:9], cache=cache)]
    pieces += [model(tokens[:, t:t + 1], cache=cache) for t in range(9, 12)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)
    assert cache.lengths == [12, 12]


@torch.no_grad()
def test_rollback_forgets_rejected_positions(model):
    tokens = torch.randint(0, 262, (1, 10))
    cache = _cache(model)
    model(tokens[:, :6], cache=cache)
    model(torch.randint(0, 262, (1, 3)), cache=cache)  # a rejected draft
    cache.rollback([6])
    resumed = model(tokens[:, 6:], cache=cache)
    torch.testing.assert_close(resumed, model(tokens)[:, 6:])


@torch.no_grad()
def test_ragged_lengths_match_each_sequence_alone(model):
    a, b = torch.randint(0, 262, (1, 9)), torch.randint(0, 262, (1, 9))
    cache = _cache(model, batch=2)
    model(torch.cat([a[:, :7], b[:, :7]]), cache=cache)
    cache.rollback([7, 4])  # sequence b keeps only 4 tokens
    step = model(torch.cat([a[:, 7:9], b[:, 4:6]]), cache=cache)
    torch.testing.assert_close(step[0], model(a)[0, 7:9])
    torch.testing.assert_close(step[1], model(b[:, :6])[0, 4:6])
    assert cache.lengths == [9, 6]


def test_cache_errors_are_clear(model):
    cache = _cache(model, max_len=8)
    with pytest.raises(ValueError, match="exceed the cache's max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="cannot roll back from 0 to 3"):
        cache.rollback([3])
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len=64"):
        KVCache(model.config, 1, 65)
