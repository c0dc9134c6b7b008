"""StackedHeads computes exactly what model.head does, head by head, with and without a cache."""

import copy
import gc
import pickle
import weakref

import pytest
import torch

from mtp.decode.forward import StackedHeads, hidden_states, stacked_heads
from mtp.kv_cache import KVCache, cache_step, causal
from mtp.model import MTPConfig, MTPModel

EXACT = {"atol": 1e-12, "rtol": 1e-12}


# Llama variants: every bias, and heads wider than dim / n_heads.
VARIANT = dict(qkv_bias=True, out_bias=True, mlp_bias=True, head_dim=12)


def _model(head_layers: int, n_kv_heads: int, head_type: str = "block",
           variant: bool = False) -> MTPModel:
    config = MTPConfig(vocab_size=262, dim=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads,
                       max_seq_len=64, n_future=4, head_layers=head_layers, head_type=head_type,
                       **(VARIANT if variant else {}))
    model = MTPModel(config).double().eval()
    with torch.no_grad():  # distinct norm weights and larger weights: every head differs
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


SHAPES = pytest.mark.parametrize("head_layers,n_kv_heads,head_type,variant", [
    (1, 4, "block", False), (1, 2, "block", False), (2, 4, "block", False),
    (2, 1, "block", False), (1, 2, "resblock", False), (2, 1, "resblock", False),
    (2, 2, "linear", False), (1, 2, "medusa", False), (2, 1, "medusa", False),
    (2, 2, "block", True), (1, 2, "resblock", True)])


@SHAPES
@torch.no_grad()
def test_equals_each_head_without_a_cache(head_layers, n_kv_heads, head_type, variant):
    model = _model(head_layers, n_kv_heads, head_type, variant)
    trunk = torch.randn(2, 7, 32, dtype=torch.float64)
    for k in (1, 3, 4):
        reference = torch.stack([model.head(trunk, i) for i in range(k)], dim=2)
        torch.testing.assert_close(StackedHeads(model, k)(trunk), reference, **EXACT)


@SHAPES
@pytest.mark.parametrize("ragged", [False, True])
@torch.no_grad()
def test_equals_each_head_on_a_cache_over_steps_with_rollback(head_layers, n_kv_heads,
                                                              head_type, variant, ragged):
    """Prefill, verify steps of several widths, roll-backs (ragged or not), a dropped row."""
    model, k = _model(head_layers, n_kv_heads, head_type, variant), 3
    stacked = StackedHeads(model, k)
    caches = [KVCache(model.config, 3, 40, dtype=torch.float64) for _ in range(2)]
    # (tokens, the lengths kept afterwards: a roll-back, or None to keep them all)
    steps = [(6, [6, 4, 5] if ragged else [5, 5, 5]), (3, [7, 5, 8] if ragged else [7, 7, 7]),
             (1, None), (3, [10, 9] if ragged else [10, 10]), (2, None)]
    lengths = torch.zeros(3, dtype=torch.long)
    for number, (width, kept) in enumerate(steps):
        tokens = torch.randint(0, 262, (caches[0].batch_size, width))
        step = cache_step(lengths, *causal(width), key_len=40)
        hidden = []
        for cache, run in zip(caches, ("each", "stacked")):
            trunk = model.trunk(tokens, cache=cache, step=step)
            if run == "each":
                hidden.append(torch.stack([model.head(trunk, i, cache=cache, step=step)
                                           for i in range(k)], dim=2))
            else:
                hidden.append(stacked(trunk, cache=cache, step=step))
            if number == 2:
                cache.keep(torch.tensor([2, 0]))
        lengths = lengths + width if kept is None else torch.tensor(kept)
        if number == 2:
            lengths = lengths[[2, 0]]
        torch.testing.assert_close(hidden[1], hidden[0], **EXACT)
        torch.testing.assert_close(caches[1].keys, caches[0].keys, **EXACT)
        torch.testing.assert_close(caches[1].values, caches[0].values, **EXACT)


@torch.no_grad()
def test_hidden_states_takes_stacked_heads_and_leaves_the_other_heads_slots_alone():
    model = _model(2, 2)
    tokens = torch.randint(0, 262, (2, 5))
    caches = [KVCache(model.config, 2, 16, dtype=torch.float64) for _ in range(2)]
    step = cache_step(torch.zeros(2, dtype=torch.long), *causal(5), key_len=5)
    each, _ = hidden_states(model, tokens, caches[0], step, 3)
    stacked, _ = hidden_states(model, tokens, caches[1], step, StackedHeads(model, 3))
    torch.testing.assert_close(stacked, each, **EXACT)
    assert caches[1].keys[model.config.n_layers + 3 * 2:].abs().sum() == 0  # head 3 unused


@torch.no_grad()
def test_attention_free_heads_take_no_cache_slots():
    """Resblock heads 1..n-1 beside block head 0: the cache holds the trunk's and head 0's."""
    model = _model(2, 2, "resblock")
    assert model.config.n_blocks == model.config.n_layers + 2
    cache = KVCache(model.config, 1, 16, dtype=torch.float64)
    assert cache.keys.shape[0] == model.config.n_blocks
    step = cache_step(torch.zeros(1, dtype=torch.long), *causal(5), key_len=5)
    hidden, _ = hidden_states(model, torch.randint(0, 262, (1, 5)), cache, step,
                              StackedHeads(model, 4))
    assert hidden.shape == (1, 5, 4, 32)
    assert (cache.keys[:, :, :, :5].abs().flatten(1).sum(1) > 0).all()  # every slot written


def test_k_is_checked(tiny_config):
    model = MTPModel(tiny_config)
    with pytest.raises(ValueError, match=r"k \(heads stacked\) must be from 1 to n_future=4, got 5"):
        StackedHeads(model, 5)


@torch.no_grad()
def test_stacked_heads_are_reused_until_a_head_parameter_changes():
    model = _model(1, 2)
    trunk = torch.randn(1, 4, 32, dtype=torch.float64)
    heads = stacked_heads(model, 3)
    assert stacked_heads(model, 3) is heads
    assert stacked_heads(model, 2) is not heads  # another k
    model.heads[1][0].feed_forward.w2.weight.mul_(2)  # in place, as an optimiser step
    updated = stacked_heads(model, 2)
    assert stacked_heads(model, 2) is updated
    torch.testing.assert_close(updated(trunk)[:, :, 1], model.head(trunk, 1), **EXACT)
    wq = model.heads[0][0].attention.wq
    wq.weight = torch.nn.Parameter(torch.randn_like(wq.weight))  # another tensor
    torch.testing.assert_close(stacked_heads(model, 2)(trunk)[:, :, 0], model.head(trunk, 0),
                               **EXACT)
    model.heads[2][0].attention.wo.weight.zero_()  # a head that is not used: no rebuild
    assert stacked_heads(model, 2) is stacked_heads(model, 2)
    model.float()  # new data in the same Parameter objects, version counters unchanged
    assert stacked_heads(model, 2)(trunk.float()).dtype == torch.float32


def test_a_model_copies_and_pickles_without_its_stacked_heads():
    model = _model(1, 4)
    heads = stacked_heads(model, 2)
    trunk = torch.randn(1, 4, 32, dtype=torch.float64)
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert stacked_heads(copied, 2) is not heads  # built anew, for the copy's weights
        torch.testing.assert_close(stacked_heads(copied, 2)(trunk), heads(trunk), **EXACT)


def test_cached_stacked_heads_do_not_keep_their_model_alive():
    model = _model(1, 4)
    stacked_heads(model, 2)
    reference = weakref.ref(model)
    del model
    gc.collect()
    assert reference() is None
