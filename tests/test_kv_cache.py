"""The static KV cache: steps placed by explicit positions, slots and masks equal recomputation."""

import pytest
import torch

from mtp.decode.forward import StackedHeads, hidden_states
from mtp.kv_cache import KVCache, cache_step, causal
from mtp.model import MTPModel


@pytest.fixture
def model(tiny_config):
    return MTPModel(tiny_config).double().eval()


def _cache(model, batch=1, max_len=32):
    return KVCache(model.config, batch, max_len, dtype=torch.float64)


def _forward(model, tokens, cache, lengths, key_len=None):
    """A chain of new tokens after each row's `lengths` (a list), through every head."""
    lengths = torch.tensor(lengths)
    key_len = cache.max_len if key_len is None else key_len
    step = cache_step(lengths, *causal(tokens.shape[1]), key_len)
    return model(tokens, cache=cache, step=step)


@torch.no_grad()
def test_cached_logits_equal_full_recomputation_for_every_head(model):
    tokens = torch.randint(0, 262, (2, 12))
    full = model(tokens)  # (B, T, n, V)
    cache = _cache(model, batch=2)
    pieces, length = [], 0
    for size, key_len in ((5, 5), (1, 32), (3, 16), (1, 12), (1, 12), (1, 12)):
        pieces.append(_forward(model, tokens[:, length:length + size], cache, [length] * 2,
                               key_len))
        length += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), full)


@torch.no_grad()
def test_stale_slots_past_a_length_are_hidden(model):
    """A rejected draft's keys stay in the cache; the next step's mask hides them."""
    tokens = torch.randint(0, 262, (1, 10))
    cache = _cache(model)
    _forward(model, tokens[:, :6], cache, [0])
    _forward(model, torch.randint(0, 262, (1, 3)), cache, [6])  # a rejected draft
    resumed = _forward(model, tokens[:, 6:], cache, [6])
    torch.testing.assert_close(resumed, model(tokens)[:, 6:])


@torch.no_grad()
def test_ragged_lengths_match_each_sequence_alone(model):
    a, b = torch.randint(0, 262, (1, 9)), torch.randint(0, 262, (1, 9))
    cache = _cache(model, batch=2)
    _forward(model, torch.cat([a[:, :7], b[:, :7]]), cache, [0, 0])
    step = _forward(model, torch.cat([a[:, 7:9], b[:, 4:6]]), cache, [7, 4])  # b keeps 4
    torch.testing.assert_close(step[0], model(a)[0, 7:9])
    torch.testing.assert_close(step[1], model(b[:, :6])[0, 4:6])


@torch.no_grad()
def test_keep_drops_rows(model):
    a, b = torch.randint(0, 262, (1, 7)), torch.randint(0, 262, (1, 7))
    cache = _cache(model, batch=2)
    _forward(model, torch.cat([a[:, :5], b[:, :5]]), cache, [0, 0])
    cache.keep(torch.tensor([1]))
    assert cache.batch_size == 1
    torch.testing.assert_close(_forward(model, b[:, 5:], cache, [5]), model(b)[:, 5:])


def test_a_cached_forward_needs_its_step(model):
    with pytest.raises(ValueError, match="needs both cache= and step="):
        model(torch.zeros(1, 2, dtype=torch.long), cache=_cache(model))


def test_positions_past_the_context_are_clamped():
    step = cache_step(torch.tensor([6, 2]), *causal(3), key_len=9, max_position=8)
    assert step.positions.tolist() == [[6, 7, 7], [2, 3, 4]]
    assert step.slots.tolist() == [[6, 7, 8], [2, 3, 4]]
    # Row 1's slots 5..8 hold nothing of its own: hidden.
    assert step.mask[1, 0].int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0, 0]]


# A tree over 7 new tokens: node 0 is the root; parents[i] < i. Root-to-leaf paths:
# 0-1-3-6, 0-1-4, 0-2-5.
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def _tree_layout(parents):
    """Depths (m,) and ancestor-or-self visibility (m, m) of a tree given by parent links."""
    m = len(parents)
    depths, visible = [0] * m, torch.eye(m, dtype=torch.bool)
    for node in range(1, m):
        depths[node] = depths[parents[node]] + 1
        visible[node] |= visible[parents[node]]
    return torch.tensor(depths), visible


def _path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("stacked", [False, True])
@torch.no_grad()
def test_tree_step_equals_each_root_to_leaf_path_on_its_own(model, stacked):
    """Every node's logits equal a plain forward over prefix + its path; ragged prefixes."""
    prefixes = torch.randint(0, 262, (2, 9))
    lengths = torch.tensor([9, 5])
    tree = torch.randint(0, 262, (2, len(PARENTS)))  # each row's own tokens, one tree shape
    cache = _cache(model, batch=2)
    _forward(model, prefixes, cache, [0, 0])
    step = cache_step(lengths, *_tree_layout(PARENTS), key_len=20)
    heads = StackedHeads(model, 4) if stacked else 4
    logits = model.unembed(hidden_states(model, tree, cache, step, heads)[0])  # (B, m, n, V)
    for row, length in enumerate(lengths.tolist()):
        for node in range(len(PARENTS)):
            path = tree[row, _path(PARENTS, node)]
            alone = model(torch.cat([prefixes[row, :length], path])[None])[0, -1]  # (n, V)
            torch.testing.assert_close(logits[row, node], alone)


@torch.no_grad()
def test_compacted_path_continues_as_if_decoded_alone(model):
    """Rows keep different paths (one a plain prefix); decoding then matches recomputation."""
    prefix = torch.randint(0, 262, (2, 6))
    tree = torch.randint(0, 262, (2, len(PARENTS)))
    cache = _cache(model, batch=2)
    _forward(model, prefix, cache, [0, 0])
    lengths = torch.tensor([6, 6])
    model(tree, cache=cache, step=cache_step(lengths, *_tree_layout(PARENTS), key_len=16))
    kept = [_path(PARENTS, 6), [0, 1, 1, 1]]  # 0-1-3-6 moves; 0-1 is in place (padded)
    cache.compact(lengths, torch.tensor(kept))
    following = torch.randint(0, 262, (2, 1))
    out = _forward(model, following, cache, [6 + 4, 6 + 2])  # one token each, ragged lengths
    for row, nodes in enumerate((kept[0], [0, 1])):
        sequence = torch.cat([prefix[row], tree[row, nodes], following[row]])
        torch.testing.assert_close(out[row, 0], model(sequence[None])[0, -1])


def test_compiled_writes_and_moves_update_the_cache_in_place(tiny_config):
    """Compiled, a step must write its slots, not copy the store: a write into a view of it
    (`keys[block].scatter_`) was compiled as a copy of the block's whole store, and a move as
    a copy of the whole cache, at every step. No generated loop may span a whole store."""
    from torch._inductor.utils import run_and_get_code

    max_len = 97  # a store of 2 * 3 * 4 * 97 * 8 = 18624 elements: a distinctive loop bound
    config = MTPModel(tiny_config).config
    config = type(config)(**{**config.to_dict(), "n_layers": 1, "n_future": 1, "n_heads": 4,
                             "n_kv_heads": 4, "dim": 32})
    cache = KVCache(config, 3, max_len)
    one_block, whole = 3 * 4 * max_len * 8, cache.keys.numel()
    lengths = torch.tensor([5, 9, 2])
    step = cache_step(lengths, *causal(2), max_len)

    def write_and_move(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        k, v = cache.write(1, step, keys, values)
        cache.compact(lengths, torch.tensor([[0, 1], [1, 1], [0, 0]]))
        return k[..., 0, :].sum() + v[..., 0, :].sum()  # reads one slot, not the store

    expected = KVCache(config, 3, max_len)
    new = torch.randn(2, 3, 4, 2, 8)
    expected.write(1, step, *new)
    expected.compact(lengths, torch.tensor([[0, 1], [1, 1], [0, 0]]))
    _, code = run_and_get_code(torch.compile(write_and_move, fullgraph=True), *new)
    assert torch.equal(cache.keys, expected.keys) and torch.equal(cache.values, expected.values)
    loop_bounds = {f"<static_cast<int64_t>({n}L)" for n in (one_block, whole)}
    assert not [bound for bound in loop_bounds if any(bound in c for c in code)]
